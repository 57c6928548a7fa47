"""`POST /v1/responses`, `GET /v1/responses/{id}`, `DELETE /v1/responses/{id}`: OpenAI's Responses API.

A request is checked (`convert.check_request`), joined to its `previous_response_id`'s stored conversation, turned
into a chat request (`convert.to_chat`) and planned by the chat path itself (`gateway.api.completions.plan_chat`: chat
template, tools, the grammar of `text.format` or forced calls, sampling parameters); a chat error's `param` is
renamed to the Responses request's (`convert.rename_param`). It then runs as chat's does: one job, admitted under a
slot (`GatewayState.admit`), its engine events collected or streamed (`gateway.api.completions.collect`,
`sse_response`); the same tool-call parser reads calls out of the text, and `output.OutputBuilder` turns content and
calls into output items and, streamed, into the typed events (`event:` and `data:` lines, no `[DONE]`). A later turn
that names `previous_response_id` sends the whole conversation again, so the session pool finds the previous turn's
session by its tokens and only the new tokens go to the servers (`usage.input_tokens_details.cached_tokens`). With
`store` (default true) the finished response and its conversation go to the `ResponseStore` (`store.py`: the gateway's
state store, bounded, with a TTL), which `GET` and `DELETE` read, on this gateway or any other sharing the store;
another API key's responses are not found. A store that fails is a 503 (`store_unavailable`) for what needs it: a
`previous_response_id`, `GET`, `DELETE`, and storing a non-streamed response (a streamed one's failure is logged).
"""
from __future__ import annotations

import logging
from typing import AsyncIterator, Dict, List, Optional

from fastapi import APIRouter, Depends, FastAPI, Request
from starlette.concurrency import run_in_threadpool

from gateway.api.auth import caller_of, owner_of, require_api_key
from gateway.api.completions import Totals, collect, plan_chat, sse_response
from gateway.api.responses.convert import check_request, output_messages, rename_param, to_chat, tool_dicts
from gateway.api.responses.output import OutputBuilder, new_id
from gateway.api.responses.schemas import (
    FunctionChoice,
    InputTokensDetails,
    Response,
    ResponsesRequest,
    ResponseUsage,
)
from gateway.api.responses.store import ResponseStore
from gateway.api.state import GatewayState
from gateway.config import GatewayConfig
from gateway.errors import APIError, bad_request, not_found
from gateway.schemas import ChatMessage
from gateway.serving.events import ChoiceDelta, Done, GenerationFailed
from gateway.store import Store, StoreUnavailable
from gateway.structured.toolparse import Parsed

logger = logging.getLogger("swarmgate.gateway")
router = APIRouter(dependencies=[Depends(require_api_key)])


def install(app: FastAPI, config: GatewayConfig, store: Store) -> None:
    """Serve the Responses API on `app`, keeping at most `config.responses_store_max` responses in `store`."""
    app.state.responses = ResponseStore(store, config.responses_store_max, config.responses_store_ttl)
    app.include_router(router)


def _store(request: Request) -> ResponseStore:
    return request.app.state.responses


def _new_response(body: ResponsesRequest, model_name: str, store: bool) -> Response:
    """The Response object of a request, before any output: the request's settings echoed."""
    choice = body.tool_choice
    tool_choice = ({"type": "function", "name": choice.name} if isinstance(choice, FunctionChoice)
                   else choice if isinstance(choice, str) else "auto" if body.tools else "none")
    fmt = body.text.format if body.text is not None else None
    return Response(
        id=new_id("resp"), model=model_name, instructions=body.instructions, max_output_tokens=body.max_output_tokens,
        max_tool_calls=body.max_tool_calls, parallel_tool_calls=body.parallel_tool_calls is not False,
        previous_response_id=body.previous_response_id, store=store,
        temperature=1.0 if body.temperature is None else body.temperature,
        top_p=1.0 if body.top_p is None else body.top_p, tool_choice=tool_choice, tools=tool_dicts(body),
        text={"format": fmt.model_dump(mode="json", by_alias=True, exclude_none=True) if fmt else {"type": "text"}},
        user=body.user, metadata=body.metadata or {}, safety_identifier=body.safety_identifier,
        prompt_cache_key=body.prompt_cache_key)


def _usage(totals: Totals, pooled: bool) -> ResponseUsage:
    written = totals.prompt_tokens - totals.cached_tokens if pooled else 0
    return ResponseUsage(input_tokens=totals.prompt_tokens, output_tokens=totals.completion_tokens,
                         total_tokens=totals.prompt_tokens + totals.completion_tokens,
                         input_tokens_details=InputTokensDetails(cached_tokens=totals.cached_tokens,
                                                                 cache_write_tokens=written))


@router.post("/v1/responses")
async def create_response(body: ResponsesRequest, request: Request):
    store, owner = _store(request), owner_of(request)
    check_request(body)
    history: List[ChatMessage] = []
    if body.previous_response_id is not None:
        previous = await run_in_threadpool(store.get, owner, body.previous_response_id)
        if previous is None:
            raise bad_request(f"Previous response with id '{body.previous_response_id}' not found.",
                              param="previous_response_id", code="previous_response_not_found")
        history = list(previous.conversation)
    try:
        chat = to_chat(body, history)
        # the model the request names (a turn may change it: the conversation is text)
        state: GatewayState = await request.app.state.models.route(chat.model)
        plan = await plan_chat(state, chat)
    except APIError as e:
        raise rename_param(e) from None
    conversation = [m for m in chat.messages[1 if body.instructions else 0:]]
    stored = bool(body.store) and store.enabled
    response = _new_response(body, plan.model_name, stored)
    builder = OutputBuilder(response)
    parser = plan.new_parser() if plan.new_parser is not None else None
    request_id = request.state.request_id
    run = await state.admit([state.new_job(plan.prompt, plan.params, 1, request_id, owner, plan.adapter,
                                           stream=bool(body.stream), speculative=state.speculation(chat))],
                            caller_of(request))
    pooled = state.config.session_pool and state.config.pool_max_sessions > 0

    def feed(text: str, last: bool) -> None:
        if parser is None:
            builder.feed(Parsed(content=text))
            return
        builder.feed(parser.feed(text))
        if last:
            builder.feed(parser.finish())

    def finish(reason: Optional[str], totals: Totals) -> None:
        builder.finish(reason == "length", _usage(totals, pooled))

    async def keep() -> None:
        if stored:
            await run_in_threadpool(store.put, owner, response.model_dump(mode="json"),
                                    conversation + output_messages(response.output))

    if not body.stream:
        got = await collect(request, run, 1)
        feed(got.texts[0], True)
        finish(got.finish[0], got)
        await keep()
        return response

    async def events() -> AsyncIterator[Dict[str, str]]:
        builder.start()
        totals, reason = Totals(), None
        async for _, event in run.events():
            if isinstance(event, ChoiceDelta):
                feed(event.text, event.finish_reason is not None)
                reason = event.finish_reason or reason
            elif isinstance(event, Done):
                totals.add(event)
            elif isinstance(event, GenerationFailed):
                builder.fail(event.error)
                break
            for kind, data in builder.take():
                yield {"event": kind, "data": data}
        else:
            finish(reason, totals)
            try:
                await keep()
            except StoreUnavailable as e:
                logger.warning(f"response {response.id} was streamed but not stored: {e}")
        for kind, data in builder.take():
            yield {"event": kind, "data": data}

    return sse_response(state, run, events())


@router.get("/v1/responses/{response_id}")
async def get_response(response_id: str, request: Request, stream: bool = False):
    if stream:
        raise bad_request("Streaming a stored response again is not supported.", param="stream")
    entry = await run_in_threadpool(_store(request).get, owner_of(request), response_id)
    if entry is None:
        raise not_found(f"No response with id '{response_id}' found (responses are kept for a limited time).",
                        param="response_id")
    return entry.response


@router.delete("/v1/responses/{response_id}")
async def delete_response(response_id: str, request: Request):
    if not await run_in_threadpool(_store(request).delete, owner_of(request), response_id):
        raise not_found(f"No response with id '{response_id}' found.", param="response_id")
    return {"id": response_id, "object": "response", "deleted": True}
