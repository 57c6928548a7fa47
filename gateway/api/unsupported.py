"""Request parameters of OpenAI's and vLLM's APIs that the gateway does not implement, and their 400s.

Each is declared on the request models (`gateway.schemas`: never dropped silently) and listed here with the values
that ask for nothing (always allowed, as is null) and why it is refused. `check(body, table)` is the 400 naming the
first one given with another value. The parameters with conditions of their own (`functions`, `function_call`, chat
`echo`, `best_of`, `prompt_logprobs`, `stream_options`, `suffix`) are checked in `gateway.api.params`.
docs/openai_api.md lists every parameter of both endpoints; tests/gateway/test_api_table.py checks the table against
this.
"""
from __future__ import annotations

from typing import Any, Dict, Tuple

from gateway.errors import bad_request

Table = Dict[str, Tuple[Tuple[Any, ...], str]]  # name -> (values that ask for nothing, why it is refused)

SHARED: Table = {  # vLLM's sampling and output extras
    "use_beam_search": ((False,), "beam search is not supported by the gateway"),
    "length_penalty": ((1, 1.0), "it only applies to beam search"),
    "include_stop_str_in_output": ((False,), "stop strings are never part of the output"),
    "skip_special_tokens": ((True,), "special tokens are always skipped"),
    "spaces_between_special_tokens": ((True,), "special tokens are always skipped"),
    "truncate_prompt_tokens": ((), "prompts are never truncated (a longer prompt is a 400)"),
    "allowed_token_ids": ((), "use logit_bias"),
    "bad_words": (([],), "use logit_bias"),
    "priority": ((0,), "requests are served first come, first served"),
    "logits_processors": ((), "custom logits processors cannot be sent over HTTP here"),
    "return_tokens_as_token_ids": ((False,), "logprobs carry token strings and bytes"),
    "return_token_ids": ((False,), "use /tokenize"),
    "guided_decoding_backend": (("auto", "guidance", "llguidance"), "guided decoding always runs on llguidance"),
    "guided_whitespace_pattern": ((), "JSON is written compactly"),
    "structural_tag": ((), "structural tags are not supported; use tools or response_format"),
    "request_id": ((), "the gateway names requests itself (X-Request-Id)"),
    "cache_salt": ((), "pooled sessions are namespaced by API key"),
    "kv_transfer_params": ((), "no disaggregated prefill"),
    "vllm_xargs": ((), "no vLLM extension arguments"),
}

CHAT: Table = {
    **SHARED,
    "modalities": ((["text"],), "this model writes text only"),
    "audio": ((), "this model writes text only"),
    "prediction": ((), "predicted outputs are not supported"),
    "web_search_options": ((), "the gateway has no web search"),
    "reasoning_effort": ((), "this model does not reason"),
    "verbosity": ((), "this model has no verbosity setting"),
    "store": ((False,), "completions are not stored"),
    "service_tier": (("auto", "default"), "there is one service tier"),
    "prompt_cache_retention": ((), "prompt caching is automatic (pooled sessions)"),
    "add_special_tokens": ((False,), "the chat template adds the special tokens"),
    "continue_final_message": ((False,), "the last message cannot be continued"),
    "documents": ((), "the chat template is not given documents"),
    "chat_template": ((), "the model's own chat template is used"),
    "mm_processor_kwargs": ((), "this model takes text only"),
}

COMPLETIONS: Table = {
    **SHARED,
    "add_special_tokens": ((True,), "the tokenizer's special tokens are always added"),
    "prompt_embeds": ((), "prompts are text or token ids"),
}


def check(body: Any, table: Table) -> None:
    for name, (no_ops, why) in table.items():
        value = getattr(body, name)
        if value is not None and not any(value == ok and type(value) is type(ok) for ok in no_ops):
            raise bad_request(f"'{name}' is not supported by this gateway: {why}.", param=name)
