"""From an OpenAI request body to what the engine runs: model check, prompt ids, `SamplingParams`.

Everything that makes a request invalid is found here, before any slot is taken or any server contacted:
an unknown model (404 `model_not_found`), a prompt plus `max_tokens` longer than the context (400
`context_length_exceeded`, OpenAI's wording), token ids outside the vocabulary, `n` above the limit, an
`max_tokens: 0` on a text completion without `echo` (with `echo` it scores the prompt, as vLLM allows), and so on
(400, naming the parameter). A parameter of OpenAI's or vLLM's API that the gateway does not support (`functions`,
`function_call`, `prompt_logprobs`, chat `echo`, ...) is a 400 naming it, never silently ignored
(`check_chat_request`, `check_completion_request`; docs/openai_api.md lists every parameter); vLLM's `min_tokens`
is applied (the end-of-sequence and stop token ids are masked until that many tokens are out). Tools and
`response_format` are checked by `gateway.structured.tools` and `gateway.structured.grammars`, which give `chat_params`
its grammar.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional, Sequence, Tuple, cast

from gateway.api.unsupported import CHAT, COMPLETIONS, check
from gateway.config import GatewayConfig
from gateway.errors import bad_request, not_found
from gateway.schemas import ChatCompletionRequest, ChatMessage, CompletionRequest, _SamplingFields
from gateway.serving.tokens import Tokens
from swarm.client.api import SamplingParams

COMPLETIONS_DEFAULT_MAX_TOKENS = 16  # OpenAI's default for the legacy completions endpoint
MAX_STOP_STRINGS = 16


@dataclass
class Limits:
    context: int
    default_max_tokens: int
    max_n: int
    vocab_size: int
    eos_token_ids: Tuple[int, ...] = ()  # what min_tokens masks (with the request's stop_token_ids)


def check_model(requested: Optional[str], config: GatewayConfig, required: bool = False) -> str:
    if required and not requested:
        raise bad_request("You must provide a model parameter.", param="model")
    if requested and requested not in (config.model_name, config.model_path):
        raise not_found(f"The model '{requested}' does not exist; this gateway serves '{config.model_name}'.",
                        param="model", code="model_not_found")
    return config.model_name


def completion_budget(prompt_len: int, requested: Optional[int], default: int, context: int, param: str) -> int:
    if prompt_len >= context or (requested is not None and prompt_len + requested > context):
        asked = prompt_len + (requested or 0)
        detail = f"you requested {asked} tokens ({prompt_len} in the prompt, {requested or 0} in the completion)"
        raise bad_request(
            f"This model's maximum context length is {context} tokens. However, {detail}. "
            f"Please reduce the length of the prompt or the completion.", param=param, code="context_length_exceeded")
    return requested if requested is not None else min(default, context - prompt_len)


def _logit_bias(body: _SamplingFields, vocab_size: int) -> dict:
    bias = {}
    for key, value in (body.logit_bias or {}).items():
        try:
            token = int(key)
        except ValueError:
            raise bad_request(f"logit_bias keys must be token ids, got {key!r}.", param="logit_bias") from None
        if not 0 <= token < vocab_size:
            raise bad_request(f"logit_bias token id {token} is outside the vocabulary (0..{vocab_size - 1}).",
                              param="logit_bias")
        if not -100 <= value <= 100:
            raise bad_request(f"logit_bias values must be within [-100, 100], got {value}.", param="logit_bias")
        bias[token] = float(value)
    return bias


def _unsupported(name: str, why: str = "") -> Exception:
    return bad_request(f"'{name}' is not supported by this gateway{why}.", param=name)


def check_messages(messages: Sequence[ChatMessage]) -> None:
    """The deprecated `function_call` of assistant messages is a 400 (tools replace functions; use `tool_calls`)."""
    for i, m in enumerate(messages):
        if m.function_call is not None:
            raise bad_request("'function_call' in messages is not supported (deprecated): use 'tool_calls'.",
                              param=f"messages.{i}.function_call")


def _check_shared(body: _SamplingFields) -> None:
    if body.stream_options is not None and not body.stream:
        raise bad_request("stream_options can only be given when stream is true.", param="stream_options")
    if body.prompt_logprobs is not None:
        raise _unsupported("prompt_logprobs")


def check_chat_request(body: ChatCompletionRequest) -> None:
    """The 400s of a chat request that do not depend on its prompt, before the chat template runs."""
    if body.functions is not None:
        raise _unsupported("functions", " (deprecated: use 'tools')")
    if body.function_call is not None and body.function_call != "none":
        raise _unsupported("function_call", " (deprecated: use 'tool_choice'); only 'none' is accepted")
    if body.echo:
        raise _unsupported("echo", " on chat completions")
    if body.best_of is not None and body.best_of != (body.n or 1):
        raise bad_request("best_of other than n is not supported.", param="best_of")
    _check_shared(body)
    check(body, CHAT)
    check_messages(body.messages)


def check_completion_request(body: CompletionRequest) -> None:
    """The 400s of a text completion request that do not depend on its prompts."""
    _check_shared(body)
    check(body, COMPLETIONS)


def _common(body: _SamplingFields, limits: Limits, max_tokens: int) -> SamplingParams:
    if body.n is not None and body.n > limits.max_n:
        raise bad_request(f"n must be at most {limits.max_n}, got {body.n}.", param="n")
    stops = body.stop_list()
    if len(stops) > MAX_STOP_STRINGS:
        raise bad_request(f"At most {MAX_STOP_STRINGS} stop strings are supported.", param="stop")
    stop_ids = list(body.stop_token_ids or [])
    bad = [t for t in stop_ids if not 0 <= t < limits.vocab_size]
    if bad:
        raise bad_request(f"stop_token_ids: {bad[0]} is outside the vocabulary.", param="stop_token_ids")
    top_k = body.top_k if body.top_k is not None and body.top_k > 0 else 0
    min_tokens = body.min_tokens or 0
    if min_tokens > max_tokens:
        raise bad_request(f"min_tokens ({min_tokens}) must be at most max_tokens ({max_tokens}).", param="min_tokens")
    params = SamplingParams(
        max_tokens=max_tokens,
        temperature=1.0 if body.temperature is None else body.temperature,
        top_p=1.0 if body.top_p is None else body.top_p,
        top_k=top_k,
        min_p=body.min_p or 0.0,
        presence_penalty=body.presence_penalty or 0.0,
        frequency_penalty=body.frequency_penalty or 0.0,
        repetition_penalty=1.0 if body.repetition_penalty is None else body.repetition_penalty,
        logit_bias=_logit_bias(body, limits.vocab_size),
        seed=body.seed,
        stop=[s for s in stops if s],
        stop_token_ids=stop_ids,
        ignore_eos=bool(body.ignore_eos),
    )
    ends = params.end_token_ids(limits.eos_token_ids)
    params.min_new_tokens = min_tokens if ends else 0
    params.eos_token_id = ends if min_tokens and ends else None
    return params


def chat_params(body: ChatCompletionRequest, prompt_len: int, limits: Limits, grammar: Optional[str] = None
                ) -> SamplingParams:
    """`grammar`: the structured output's (`gateway.structured.grammars.request_grammar`), None for free text."""
    requested = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
    max_tokens = completion_budget(prompt_len, requested, limits.default_max_tokens, limits.context, "messages")
    params = _common(body, limits, max_tokens)
    if body.top_logprobs is not None and body.top_logprobs > 0 and not body.logprobs:
        raise bad_request("top_logprobs requires logprobs to be true.", param="top_logprobs")
    params.logprobs = bool(body.logprobs)
    params.top_logprobs = body.top_logprobs or 0
    params.grammar = grammar
    return params


def completion_prompts(body: CompletionRequest, tokens: Tokens) -> List[List[int]]:
    prompt = body.prompt
    if isinstance(prompt, str):
        prompts = [tokens.encode(prompt, add_special_tokens=True)]
    elif prompt and all(isinstance(p, int) for p in prompt):
        prompts = [list(cast(List[int], prompt))]
    elif prompt and all(isinstance(p, str) for p in prompt):
        prompts = [tokens.encode(p, add_special_tokens=True) for p in cast(List[str], prompt)]
    else:
        prompts = [list(p) for p in cast(List[List[int]], prompt)]
    if not prompts or any(not p for p in prompts):
        raise bad_request("The prompt must not be empty.", param="prompt")
    if len(prompts) > 64:
        raise bad_request("At most 64 prompts per request are supported.", param="prompt")
    for p in prompts:
        tokens.check_ids(p, "prompt")
    return prompts


def completion_params(body: CompletionRequest, prompt_len: int, limits: Limits) -> SamplingParams:
    if body.suffix:
        raise bad_request("suffix is not supported by this model.", param="suffix")
    if body.best_of is not None and body.best_of != (body.n or 1):
        raise bad_request("best_of other than n is not supported.", param="best_of")
    if body.max_tokens == 0 and not body.echo:
        raise bad_request("max_tokens must be at least 1 unless echo is true.", param="max_tokens")
    max_tokens = completion_budget(prompt_len, body.max_tokens, COMPLETIONS_DEFAULT_MAX_TOKENS, limits.context,
                                   "prompt")
    params = _common(body, limits, max_tokens)
    if body.logprobs is not None:
        params.logprobs = True
        params.top_logprobs = body.logprobs
    return params
