"""Compact JSON Schemas (draft 2020-12) of the OpenAI API's responses, for the spec-validation tests.

Written by hand from the required fields, types, nullability and enums of the OpenAI OpenAPI document
(repository `openai/openai-openapi`, `openapi.json`/`openapi.yaml` version 2.3.0, read on 2026-11-23):
CreateChatCompletionResponse, CreateChatCompletionStreamResponse (its choices, ChatCompletionStreamResponseDelta,
logprobs), ChatCompletionResponseMessage, ChatCompletionTokenLogprob, ChatCompletionMessageToolCall(Chunk),
CreateCompletionResponse (shared by streamed and non-streamed completions), CompletionUsage, ListModelsResponse,
Model, ErrorResponse and Error. Only what the spec says is checked: like the spec, these schemas allow additional
properties (vendor extension fields) except where the spec forbids them; nothing of the spec is relaxed.
"""
from __future__ import annotations

from typing import Any, Dict

Schema = Dict[str, Any]

DIALECT = "https://json-schema.org/draft/2020-12/schema"

STRING: Schema = {"type": "string"}
INTEGER: Schema = {"type": "integer"}
NUMBER: Schema = {"type": "number"}


def nullable(schema: Schema) -> Schema:
    return {"anyOf": [schema, {"type": "null"}]}


def const_enum(*values: str) -> Schema:
    return {"type": "string", "enum": list(values)}


CHAT_FINISH_REASONS = ("stop", "length", "tool_calls", "content_filter", "function_call")
COMPLETION_FINISH_REASONS = ("stop", "length", "content_filter")
SERVICE_TIERS = ("auto", "default", "flex", "scale", "priority", "fast")

BYTES: Schema = nullable({"type": "array", "items": INTEGER})

TOKEN_LOGPROB: Schema = {  # ChatCompletionTokenLogprob
    "type": "object",
    "required": ["token", "logprob", "bytes", "top_logprobs"],
    "properties": {
        "token": STRING,
        "logprob": NUMBER,
        "bytes": BYTES,
        "top_logprobs": {
            "type": "array",
            "items": {
                "type": "object",
                "required": ["token", "logprob", "bytes"],
                "properties": {"token": STRING, "logprob": NUMBER, "bytes": BYTES},
            },
        },
    },
}

CHOICE_LOGPROBS: Schema = nullable({  # a chat choice's `logprobs` (non-streamed and streamed alike)
    "type": "object",
    "required": ["content", "refusal"],
    "properties": {
        "content": nullable({"type": "array", "items": TOKEN_LOGPROB}),
        "refusal": nullable({"type": "array", "items": TOKEN_LOGPROB}),
    },
})

USAGE: Schema = {  # CompletionUsage
    "type": "object",
    "required": ["prompt_tokens", "completion_tokens", "total_tokens"],
    "properties": {
        "prompt_tokens": INTEGER,
        "completion_tokens": INTEGER,
        "total_tokens": INTEGER,
        "completion_tokens_details": {
            "type": "object",
            "properties": {k: INTEGER for k in ("accepted_prediction_tokens", "audio_tokens", "reasoning_tokens",
                                                "text_tokens", "rejected_prediction_tokens")},
        },
        "prompt_tokens_details": {
            "type": "object",
            "properties": {k: INTEGER for k in ("audio_tokens", "cached_tokens", "text_tokens", "image_tokens",
                                                "cache_write_tokens")},
        },
    },
}

FUNCTION_CALL: Schema = {"type": "object", "required": ["name", "arguments"],
                         "properties": {"name": STRING, "arguments": STRING}}

TOOL_CALL: Schema = {  # ChatCompletionMessageToolCall (the function kind)
    "type": "object",
    "required": ["id", "type", "function"],
    "properties": {"id": STRING, "type": const_enum("function"), "function": FUNCTION_CALL},
}

TOOL_CALL_CHUNK: Schema = {  # ChatCompletionMessageToolCallChunk
    "type": "object",
    "required": ["index"],
    "properties": {
        "index": INTEGER,
        "id": STRING,
        "type": const_enum("function"),
        "function": {"type": "object", "properties": {"name": STRING, "arguments": STRING}},
    },
}

RESPONSE_MESSAGE: Schema = {  # ChatCompletionResponseMessage
    "type": "object",
    "required": ["role", "content", "refusal"],
    "properties": {
        "role": const_enum("assistant"),
        "content": nullable(STRING),
        "refusal": nullable(STRING),
        "tool_calls": {"type": "array", "items": TOOL_CALL},
        "annotations": {"type": "array", "items": {"type": "object", "required": ["type", "url_citation"]}},
        "function_call": FUNCTION_CALL,
        "audio": nullable({"type": "object", "required": ["id", "expires_at", "data", "transcript"]}),
    },
}

COMMON: Schema = {  # the properties shared by a chat completion and its chunks
    "id": STRING,
    "created": INTEGER,
    "model": STRING,
    "system_fingerprint": STRING,  # a string when present, never null
    "service_tier": nullable(const_enum(*SERVICE_TIERS)),
}

CHAT_COMPLETION: Schema = {  # CreateChatCompletionResponse
    "$schema": DIALECT,
    "type": "object",
    "required": ["choices", "created", "id", "model", "object"],
    "properties": {
        **COMMON,
        "object": const_enum("chat.completion"),
        "usage": USAGE,
        "choices": {
            "type": "array",
            "items": {
                "type": "object",
                "required": ["finish_reason", "index", "message", "logprobs"],
                "properties": {
                    "finish_reason": const_enum(*CHAT_FINISH_REASONS),
                    "index": INTEGER,
                    "message": RESPONSE_MESSAGE,
                    "logprobs": CHOICE_LOGPROBS,
                },
            },
        },
    },
}

STREAM_DELTA: Schema = {  # ChatCompletionStreamResponseDelta
    "type": "object",
    "properties": {
        "content": nullable(STRING),
        "refusal": nullable(STRING),
        "role": const_enum("developer", "system", "user", "assistant", "tool"),
        "tool_calls": {"type": "array", "items": TOOL_CALL_CHUNK},
        "function_call": {"type": "object", "properties": {"name": STRING, "arguments": STRING}},
    },
}

CHAT_COMPLETION_CHUNK: Schema = {  # CreateChatCompletionStreamResponse
    "$schema": DIALECT,
    "type": "object",
    "required": ["choices", "created", "id", "model", "object"],
    "properties": {
        **COMMON,
        "object": const_enum("chat.completion.chunk"),
        "obfuscation": STRING,
        "usage": nullable(USAGE),
        "choices": {
            "type": "array",
            "items": {
                "type": "object",
                "required": ["delta", "finish_reason", "index"],
                "properties": {
                    "delta": STREAM_DELTA,
                    "logprobs": CHOICE_LOGPROBS,
                    "finish_reason": nullable(const_enum(*CHAT_FINISH_REASONS)),
                    "index": INTEGER,
                },
            },
        },
    },
}

COMPLETION: Schema = {  # CreateCompletionResponse: the non-streamed response and each streamed chunk
    "$schema": DIALECT,
    "type": "object",
    "required": ["id", "object", "created", "model", "choices"],
    "properties": {
        "id": STRING,
        "object": const_enum("text_completion"),
        "created": INTEGER,
        "model": STRING,
        "system_fingerprint": STRING,
        "usage": USAGE,
        "choices": {
            "type": "array",
            "items": {
                "type": "object",
                "required": ["finish_reason", "index", "logprobs", "text"],
                "properties": {
                    "finish_reason": const_enum(*COMPLETION_FINISH_REASONS),
                    "index": INTEGER,
                    "text": STRING,
                    "logprobs": nullable({
                        "type": "object",
                        "properties": {
                            "text_offset": {"type": "array", "items": INTEGER},
                            # The one relaxation of this schema: with `echo`, the first prompt token has no
                            # context, so its logprob is null, as in OpenAI's own legacy API and vLLM (the spec
                            # types the items as numbers); every later item must be a number.
                            "token_logprobs": {"type": "array", "prefixItems": [nullable(NUMBER)], "items": NUMBER},
                            "tokens": {"type": "array", "items": STRING},
                            "top_logprobs": {"type": "array",
                                             "items": {"type": "object", "additionalProperties": NUMBER}},
                        },
                    }),
                },
            },
        },
    },
}

MODEL: Schema = {  # Model
    "type": "object",
    "required": ["id", "object", "created", "owned_by"],
    "properties": {
        "id": STRING,
        "created": INTEGER,
        "object": const_enum("model"),
        "owned_by": STRING,
        "shutdown_date": nullable({"type": "string", "format": "date"}),
    },
}

MODEL_LIST: Schema = {  # ListModelsResponse
    "$schema": DIALECT,
    "type": "object",
    "required": ["object", "data"],
    "properties": {"object": const_enum("list"), "data": {"type": "array", "items": MODEL}},
}

ERROR_RESPONSE: Schema = {  # ErrorResponse / Error
    "$schema": DIALECT,
    "type": "object",
    "required": ["error"],
    "properties": {
        "error": {
            "type": "object",
            "required": ["type", "message", "param", "code"],
            "properties": {"code": nullable(STRING), "message": STRING, "param": nullable(STRING), "type": STRING},
        },
    },
}


def _completion_chunk() -> Schema:
    """A streamed `/v1/completions` chunk. The spec gives chunks the shape of CreateCompletionResponse, whose
    `finish_reason` is a non-null string, but OpenAI's own API (and vLLM) stream `"finish_reason": null` until a
    choice ends: a non-null value there would tell clients the choice ended. This one schema allows null on
    such chunks; the tests check that each choice's last chunk carries a value of the spec's enum."""
    import copy

    schema = copy.deepcopy(COMPLETION)
    choice = schema["properties"]["choices"]["items"]
    choice["properties"]["finish_reason"] = nullable(const_enum(*COMPLETION_FINISH_REASONS))
    return schema


COMPLETION_CHUNK: Schema = _completion_chunk()
