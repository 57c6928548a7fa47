"""`POST /v1/chat/completions` and `POST /v1/completions`, streamed (SSE) or not.

Both endpoints validate and tokenize, take a slot and check the route (`GatewayState.admit`), then either
collect the engine's events into one response object, or stream them the way OpenAI does: the first chunk
of each choice carries the role, content deltas follow, each choice ends with one chunk holding its
`finish_reason`, an optional usage chunk with empty `choices`, then `data: [DONE]`. SSE comments keep the
connection alive during a long prefill; a failure mid-stream is a `data:` line with an `error` object, then
`[DONE]`. A client that goes away cancels its generation (which closes its swarm session). Usage always
carries `prompt_tokens_details.cached_tokens`: the prompt tokens a pooled session already held (0 on a miss).
A chat reply also carries swarmgate's `swarm.servers` (`schemas.SwarmInfo`: the peer ids that served it; on a
stream, in the usage chunk), which OpenAI clients ignore.
A text completion with `echo` and `logprobs` also scores its prompt (`ClientModel.prompt_logprobs`, one forward pass
per prompt after admission): the logprobs cover the prompt's tokens, then the generated ones (streamed: the first
chunk of each choice carries the prompt's); `max_tokens: 0` with `echo` returns just the prompt.
"""
from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass
from typing import AsyncIterator, Callable, Dict, List, Optional, Tuple, Union, cast

from fastapi import APIRouter, Depends, Request
from pydantic_core import to_json
from sse_starlette.sse import EventSourceResponse
from starlette.background import BackgroundTask
from starlette.concurrency import run_in_threadpool

from gateway.api.auth import caller_of, owner_of, require_api_key
from gateway.api.params import (
    chat_params,
    check_chat_request,
    check_completion_request,
    completion_params,
    completion_prompts,
)
from gateway.api.state import GatewayState
from gateway.schemas import (
    AssistantMessage,
    ChatChoice,
    ChatCompletion,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChoiceLogprobs,
    ChunkChoice,
    Completion,
    CompletionChoice,
    CompletionLogprobs,
    CompletionRequest,
    Delta,
    PromptTokensDetails,
    SwarmInfo,
    TokenLogprob,
    TopLogprob,
    Usage,
)
from gateway.serving.engine import RequestRun
from gateway.serving.events import ChoiceDelta, Done, GenerationFailed, swarm_error
from gateway.structured.grammars import check as check_grammar
from gateway.structured.grammars import request_grammar
from gateway.structured.toolparse import ToolCallParser, finish_reason, parser_maker
from gateway.structured.tools import check_tools
from swarm.client.api import SamplingParams, TokenChoice

router = APIRouter(dependencies=[Depends(require_api_key)])


async def _state(request: Request, requested: Optional[str]) -> GatewayState:
    """The state of the model a request names (`gateway.api.models.ServedModels.route`: a 404 for an unknown one)."""
    return await request.app.state.models.route(requested)


def _request_id(request: Request) -> str:
    return request.state.request_id


# ---- logprobs ---------------------------------------------------------------------------------------------------
def chat_logprobs(state: GatewayState, tokens: List[TokenChoice]) -> ChoiceLogprobs:
    t = state.tokens
    return ChoiceLogprobs(content=[
        TokenLogprob(token=t.token_string(c.token_id), logprob=c.logprob, bytes=t.token_byte_list(c.token_id),
                     top_logprobs=[TopLogprob(token=t.token_string(i), logprob=lp, bytes=t.token_byte_list(i))
                                   for i, lp in c.top])
        for c in tokens if c.logprob is not None
    ])


def completion_logprobs(state: GatewayState, tokens: List[TokenChoice], offset: int) -> CompletionLogprobs:
    t, out = state.tokens, CompletionLogprobs()
    for c in tokens:
        if c.logprob is None:
            continue
        text = t.token_string(c.token_id)
        out.tokens.append(text)
        out.token_logprobs.append(c.logprob)
        out.top_logprobs.append({t.token_string(i): lp for i, lp in c.top} if c.top else None)
        out.text_offset.append(offset)
        offset += len(text)
    return out


def prompt_logprobs(state: GatewayState, ids: List[int], echo: str, top_k: int, adapter: Optional[str] = None
                    ) -> CompletionLogprobs:
    """The echoed prompt's logprobs (OpenAI's legacy `echo` + `logprobs`): one entry per prompt token, the first
    with null `token_logprobs` and `top_logprobs`; `text_offset` is where each token starts in the echoed text.
    Runs on a worker thread (a forward pass through the swarm)."""
    t = state.tokens
    scored = (state.model.prompt_logprobs(ids, top_k) if adapter is None
              else state.model.prompt_logprobs(ids, top_k, adapter=adapter))
    out = CompletionLogprobs(tokens=[t.token_string(i) for i in ids], token_logprobs=[None],
                             top_logprobs=[None], text_offset=[])
    for entry in scored:
        out.token_logprobs.append(entry.logprob)
        top = [(i, lp) for i, lp in entry.top if i < t.vocab_size]
        out.top_logprobs.append({t.token_string(i): lp for i, lp in top} if top else None)
    for k in range(len(ids)):  # the decoded prefix's length, clipped to the echoed text
        out.text_offset.append(min(len(t.decode(ids[:k])), len(echo)) if k else 0)
    return out


def _joined(first: CompletionLogprobs, then: CompletionLogprobs) -> CompletionLogprobs:
    return CompletionLogprobs(tokens=first.tokens + then.tokens,
                              token_logprobs=first.token_logprobs + then.token_logprobs,
                              top_logprobs=first.top_logprobs + then.top_logprobs,
                              text_offset=first.text_offset + then.text_offset)


# ---- running ------------------------------------------------------------------------------------------------------
async def _watch_disconnect(request: Request, run: RequestRun) -> None:
    while not run.closed:
        if await request.is_disconnected():
            run.close()
            return
        await asyncio.sleep(0.5)


class Totals:
    """The token counts of a request's jobs (their `Done` events) and the peer ids that served them."""

    def __init__(self) -> None:
        self.prompt_tokens = self.completion_tokens = self.cached_tokens = 0
        self.servers: List[str] = []  # peer ids that served the jobs, each once, in order

    def add(self, done: Done) -> None:
        self.prompt_tokens += done.prompt_tokens
        self.completion_tokens += done.completion_tokens
        self.cached_tokens += done.cached_tokens
        self.servers += [s for s in done.servers if s not in self.servers]

    def usage(self) -> Usage:
        return make_usage(self.prompt_tokens, self.completion_tokens, self.cached_tokens)


class Collected(Totals):
    def __init__(self, count: int):
        super().__init__()
        self.texts = [""] * count
        self.tokens: List[List[TokenChoice]] = [[] for _ in range(count)]
        self.finish: List[Optional[str]] = [None] * count


def make_usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> Usage:
    return Usage(prompt_tokens=prompt_tokens, completion_tokens=completion_tokens,
                 total_tokens=prompt_tokens + completion_tokens,
                 prompt_tokens_details=PromptTokensDetails(cached_tokens=cached_tokens))


async def collect(request: Request, run: RequestRun, n: int) -> Collected:
    out = Collected(n * len(run.jobs))
    watcher = asyncio.create_task(_watch_disconnect(request, run))
    try:
        async for k, event in run.events():
            if isinstance(event, ChoiceDelta):
                index = k * n + event.index
                out.texts[index] += event.text
                out.tokens[index].extend(event.tokens)
                out.finish[index] = event.finish_reason or out.finish[index]
            elif isinstance(event, Done):
                out.add(event)
            elif isinstance(event, GenerationFailed):
                raise event.error
    finally:
        watcher.cancel()
        run.close()
    return out


class TextChunks:
    """The JSON of a stream's plain text chunks (one choice's content delta, nothing else): `make(index, text)`
    (the response's own chunk builder) runs once per choice with a marker for the text, and each delta's text is put
    in its place by pydantic's own string encoder: the same bytes as building and dumping the models for every token,
    for a fraction of the CPU (issue 46: the gateway's CPU per token)."""

    MARKER = "\x00swarmgate-text\x00"

    def __init__(self, make: Callable[[int, str], str]):
        self.make = make
        self._parts: Dict[int, Tuple[str, str]] = {}  # choice index -> (JSON before the text, after it)

    def json(self, index: int, text: str) -> str:
        parts = self._parts.get(index)
        if parts is None:
            before, marker, after = self.make(index, self.MARKER).partition(to_json(self.MARKER).decode())
            if not marker or self.MARKER in after:  # (never: the marker is in no other field)
                return self.make(index, text)
            parts = self._parts[index] = (before, after)
        return parts[0] + to_json(text).decode() + parts[1]


class StreamResponse(EventSourceResponse):
    """sse_starlette's response, whose every send (each chunk of every stream) entered an anyio cancel scope for
    its `send_timeout` even when there is none (~8 us of the event loop per chunk, issue 46: the gateway's CPU per
    token): without a timeout (the gateway sets none) a chunk is sent as it is; with one, as sse_starlette does."""

    async def _send_with_timeout(self, send, message) -> None:
        if self.send_timeout is None:
            await send(message)
        else:
            await super()._send_with_timeout(send, message)


def sse_response(state: GatewayState, run: RequestRun, chunks: AsyncIterator[Union[str, Dict[str, str]]]
                 ) -> EventSourceResponse:
    """`chunks`: each event's data, or a dict of SSE fields (`event`, `data`)."""
    async def body():
        try:
            async for data in chunks:
                yield data if isinstance(data, dict) else {"data": data}
        finally:
            run.close()

    async def close() -> None:  # (a plain function would be called on a worker thread: a hop per request)
        run.close()

    return StreamResponse(body(), ping=state.config.sse_keepalive, sep="\n", background=BackgroundTask(close),
                               headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})


async def stream_events(run: RequestRun, n: int, on_delta, on_usage) -> AsyncIterator[str]:
    """Shared streaming loop: yields the serialized chunks of deltas, usage, errors and `[DONE]`;
    `on_usage(usage, servers)` gets the peer ids that served the jobs."""
    totals = Totals()
    failed = False
    async for k, event in run.events():
        if isinstance(event, ChoiceDelta):
            for chunk in on_delta(k * n + event.index, event):
                yield chunk
        elif isinstance(event, Done):
            totals.add(event)
        elif isinstance(event, GenerationFailed):
            yield json.dumps(event.error.body())
            failed = True
            break
    if not failed:
        usage_chunk = on_usage(totals.usage(), totals.servers)
        if usage_chunk is not None:
            yield usage_chunk
    yield "[DONE]"


def _include_usage(body) -> bool:
    return bool(body.stream_options and body.stream_options.include_usage)


# ---- chat ---------------------------------------------------------------------------------------------------------
@dataclass
class ChatPlan:
    """What a chat request runs: the model id to answer with and its LoRA adapter, the prompt ids, the sampling
    parameters (with the grammar of structured output or forced calls), and a maker of one choice's tool-call
    parser (None: the output is not parsed for calls)."""

    model_name: str
    adapter: Optional[str]
    prompt: List[int]
    params: SamplingParams
    new_parser: Optional[Callable[[], ToolCallParser]]


async def plan_chat(state: GatewayState, body: ChatCompletionRequest) -> ChatPlan:
    """Validate a chat request and render its prompt (every 400 is found here, before a slot is taken); used by
    `/v1/chat/completions` and by the Responses API (`gateway.responses`), which converts its requests to chat's."""
    model_name, adapter = await state.aresolve_model(body.model, True)
    check_chat_request(body)
    tool_choice = check_tools(body.tools, body.tool_choice)
    tools = body.tools if tool_choice != "none" else None
    prompt = await run_in_threadpool(state.tokens.chat_prompt, body.messages, bool(body.add_generation_prompt),
                                     body.chat_template_kwargs, tools)
    grammar, blame = request_grammar(body, tool_choice)
    if grammar is not None:
        await run_in_threadpool(check_grammar, state.tokens, grammar, blame)
    params = chat_params(body, len(prompt), state.limits, grammar)
    return ChatPlan(model_name, adapter, prompt, params, parser_maker(tools, tool_choice, body.parallel_tool_calls))


@router.post("/v1/chat/completions")
async def chat_completions(body: ChatCompletionRequest, request: Request):
    state = await _state(request, body.model)
    plan = await plan_chat(state, body)
    model_name, params, new_parser = plan.model_name, plan.params, plan.new_parser
    n = body.n or 1
    completion_id = "chatcmpl-" + _request_id(request)
    created = int(time.time())
    run = await state.admit([state.new_job(plan.prompt, params, n, _request_id(request), owner_of(request),
                                           plan.adapter, stream=bool(body.stream),
                                           speculative=state.speculation(body))], caller_of(request))

    if not body.stream:
        got = await collect(request, run, n)
        choices = []
        for i in range(n):
            parser = new_parser() if new_parser is not None else None
            content, calls = parser.whole(got.texts[i]) if parser is not None else (got.texts[i], [])
            choices.append(ChatChoice(index=i, message=AssistantMessage(content=content, tool_calls=calls or None),
                                      logprobs=chat_logprobs(state, got.tokens[i]) if params.logprobs else None,
                                      finish_reason=finish_reason(got.finish[i], parser)))
        usage = got.usage()
        return ChatCompletion(id=completion_id, created=created, model=model_name, choices=choices, usage=usage,
                              swarm=SwarmInfo(servers=got.servers))

    def chunk(choices, usage=None, swarm: Optional[SwarmInfo] = None) -> str:
        return ChatCompletionChunk(id=completion_id, created=created, model=model_name, choices=choices,
                                   usage=usage, swarm=swarm).model_dump_json(exclude=None if swarm else {"swarm"})

    parsers = [new_parser() for _ in range(n)] if new_parser is not None else None
    plain = TextChunks(lambda index, text: chunk([ChunkChoice(index=index, delta=Delta(content=text))]))

    def on_delta(index: int, event: ChoiceDelta):
        if parsers is None and not params.logprobs and not event.finish_reason:  # most tokens: a text delta
            if event.text:
                yield plain.json(index, event.text)
            return
        logprobs = chat_logprobs(state, event.tokens) if params.logprobs and event.tokens else None
        text, pieces = event.text, []
        if parsers is not None:  # content outside tool-call blocks, and the calls' pieces
            parsed = parsers[index].feed(event.text)
            if event.finish_reason:
                rest = parsers[index].finish()
                parsed.content, parsed.chunks = parsed.content + rest.content, parsed.chunks + rest.chunks
            text, pieces = parsed.content, parsed.chunks
        if text or logprobs is not None:
            yield chunk([ChunkChoice(index=index, delta=Delta(content=text or None), logprobs=logprobs)])
        for piece in pieces:
            yield chunk([ChunkChoice(index=index, delta=Delta(tool_calls=[piece]))])
        if event.finish_reason:
            reason = finish_reason(event.finish_reason, parsers[index] if parsers is not None else None)
            yield chunk([ChunkChoice(index=index, delta=Delta(), finish_reason=reason)])

    def on_usage(usage: Usage, servers: List[str]) -> Optional[str]:
        return chunk([], usage, SwarmInfo(servers=servers)) if _include_usage(body) else None

    async def chunks():
        for i in range(n):
            yield chunk([ChunkChoice(index=i, delta=Delta(role="assistant", content=""))])
        async for data in stream_events(run, n, on_delta, on_usage):
            yield data

    return sse_response(state, run, chunks())


# ---- text completions ---------------------------------------------------------------------------------------------
def _echo_texts(body: CompletionRequest, prompts: List[List[int]], state: GatewayState) -> List[str]:
    if isinstance(body.prompt, str):
        return [body.prompt]
    if all(isinstance(p, str) for p in body.prompt):
        return list(cast(List[str], body.prompt))
    return [state.tokens.decode(ids) for ids in prompts]


@router.post("/v1/completions")
async def completions(body: CompletionRequest, request: Request):
    state = await _state(request, body.model)
    model_name, adapter = await state.aresolve_model(body.model, True)
    check_completion_request(body)
    prompts = await run_in_threadpool(completion_prompts, body, state.tokens)
    grammar, blame = request_grammar(body)
    if grammar is not None:
        await run_in_threadpool(check_grammar, state.tokens, grammar, blame)
    jobs = []
    for prompt in prompts:
        params = completion_params(body, len(prompt), state.limits)
        params.grammar = grammar
        jobs.append(state.new_job(prompt, params, body.n or 1, _request_id(request), owner_of(request), adapter,
                                  stream=bool(body.stream), speculative=state.speculation(body)))
    n, want_logprobs = body.n or 1, body.logprobs is not None
    completion_id = "cmpl-" + _request_id(request)
    created = int(time.time())
    echoes = _echo_texts(body, prompts, state) if body.echo else [""] * len(prompts)
    run = await state.admit(jobs, caller_of(request))
    scored: List[Optional[CompletionLogprobs]] = [None] * len(prompts)
    if body.echo and want_logprobs:
        try:
            for k, prompt in enumerate(prompts):
                scored[k] = await run_in_threadpool(prompt_logprobs, state, prompt, echoes[k], body.logprobs or 0,
                                                    adapter)
        except Exception as e:
            run.close()
            raise swarm_error(e) from None
        except BaseException:
            run.close()
            raise

    def choice_logprobs(i: int, tokens: List[TokenChoice], offset: int, first: bool) -> Optional[CompletionLogprobs]:
        if not want_logprobs:
            return None
        generated = completion_logprobs(state, tokens, offset)
        prompt_part = scored[i // n] if first else None
        return _joined(prompt_part, generated) if prompt_part is not None else generated

    if not body.stream:
        got = await collect(request, run, n)
        choices = []
        for i in range(n * len(prompts)):
            prefix = echoes[i // n]
            logprobs = choice_logprobs(i, got.tokens[i], len(prefix), True)
            choices.append(CompletionChoice(index=i, text=prefix + got.texts[i], logprobs=logprobs,
                                            finish_reason=got.finish[i]))
        usage = got.usage()
        return Completion(id=completion_id, created=created, model=model_name, choices=choices, usage=usage)

    offsets: Dict[int, int] = {}

    def chunk(choices, usage=None) -> str:
        return Completion(id=completion_id, created=created, model=model_name, choices=choices,
                          usage=usage).model_dump_json()

    def on_delta(index: int, event: ChoiceDelta):
        text, first = event.text, index not in offsets
        if first:
            text = echoes[index // n] + text
            offsets[index] = len(echoes[index // n])
        logprobs = choice_logprobs(index, event.tokens, offsets[index], first)
        offsets[index] += len(event.text)
        if text or event.finish_reason or (logprobs is not None and logprobs.tokens):
            yield chunk([CompletionChoice(index=index, text=text, logprobs=logprobs,
                                          finish_reason=event.finish_reason)])

    def on_usage(usage: Usage, servers: List[str]) -> Optional[str]:
        return chunk([], usage) if _include_usage(body) else None

    return sse_response(state, run, stream_events(run, n, on_delta, on_usage))
