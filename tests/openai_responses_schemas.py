"""Compact JSON Schemas (draft 2020-12) of the OpenAI Responses API's Response object and stream events, for the
spec-validation tests (the chat API's are in tests/openai_schemas.py).

Written by hand from the required fields, types, nullability and enums of the OpenAI OpenAPI document (repository
`openai/openai-openapi`, `openapi.json` version 2.3.0, read on 2026-11-26): Response (ModelResponseProperties,
ResponseProperties and its own properties), OutputMessage, OutputTextContent, RefusalContent, FunctionToolCall,
FunctionTool, ToolChoiceOptions / ToolChoiceFunction, ResponseTextParam and its formats, ResponseUsage,
ResponseError (with ResponseErrorCode), Reasoning, and the events ResponseCreatedEvent, ResponseInProgressEvent,
ResponseCompletedEvent, ResponseIncompleteEvent, ResponseFailedEvent, ResponseOutputItemAddedEvent / DoneEvent,
ResponseContentPartAddedEvent / DoneEvent, ResponseTextDeltaEvent / DoneEvent,
ResponseFunctionCallArgumentsDeltaEvent / DoneEvent and ResponseErrorEvent. Like the spec, the schemas allow
additional properties. Narrower than the spec in one way, on purpose: output items, tools and tool choices are only
the kinds this gateway serves (messages and function calls; function tools), so that another kind fails the test.
"""
from __future__ import annotations

from typing import Dict

from tests.openai_schemas import DIALECT, INTEGER, NUMBER, STRING, Schema, const_enum, nullable

ITEM_STATUS = const_enum("in_progress", "completed", "incomplete")
ERROR_CODES = ("server_error", "rate_limit_exceeded", "invalid_prompt", "data_residency_mismatch", "bio_policy",
               "vector_store_timeout", "invalid_image", "invalid_image_format", "invalid_base64_image",
               "invalid_image_url", "image_too_large", "image_too_small", "image_parse_error",
               "image_content_policy_violation", "invalid_image_mode", "image_file_too_large",
               "unsupported_image_media_type", "empty_image_file", "failed_to_download_image", "image_file_not_found")
SERVICE_TIERS = ("auto", "default", "flex", "scale", "priority", "fast", "ultrafast")

LOGPROB: Schema = {  # ResponseLogProb (events) / LogProb (content)
    "type": "object",
    "required": ["token", "logprob"],
    "properties": {"token": STRING, "logprob": NUMBER,
                   "top_logprobs": {"type": "array", "items": {
                       "type": "object", "properties": {"token": STRING, "logprob": NUMBER}}}},
}

OUTPUT_TEXT: Schema = {  # OutputTextContent
    "type": "object",
    "required": ["type", "text", "annotations", "logprobs"],
    "properties": {"type": const_enum("output_text"), "text": STRING,
                   "annotations": {"type": "array", "items": {"type": "object", "required": ["type"]}},
                   "logprobs": {"type": "array", "items": LOGPROB}},
}

REFUSAL: Schema = {"type": "object", "required": ["type", "refusal"],  # RefusalContent
                   "properties": {"type": const_enum("refusal"), "refusal": STRING}}

OUTPUT_CONTENT: Schema = {"oneOf": [OUTPUT_TEXT, REFUSAL]}

OUTPUT_MESSAGE: Schema = {  # OutputMessage
    "type": "object",
    "required": ["id", "type", "role", "content", "status"],
    "properties": {"id": STRING, "type": const_enum("message"), "role": const_enum("assistant"),
                   "content": {"type": "array", "items": OUTPUT_CONTENT}, "status": ITEM_STATUS},
}

FUNCTION_CALL: Schema = {  # FunctionToolCall
    "type": "object",
    "required": ["type", "call_id", "name", "arguments"],
    "properties": {"id": STRING, "type": const_enum("function_call"), "call_id": STRING, "name": STRING,
                   "arguments": STRING, "namespace": STRING, "status": ITEM_STATUS},
}

OUTPUT_ITEM: Schema = {"oneOf": [OUTPUT_MESSAGE, FUNCTION_CALL]}  # OutputItem (the kinds served here)

FUNCTION_TOOL: Schema = {  # FunctionTool
    "type": "object",
    "required": ["type", "name", "strict", "parameters"],
    "properties": {"type": const_enum("function"), "name": STRING, "description": nullable(STRING),
                   "parameters": nullable({"type": "object"}), "strict": nullable({"type": "boolean"})},
}

TOOL_CHOICE: Schema = {"oneOf": [  # ToolChoiceOptions / ToolChoiceFunction
    const_enum("none", "auto", "required"),
    {"type": "object", "required": ["type", "name"], "properties": {"type": const_enum("function"), "name": STRING}},
]}

TEXT_FORMAT: Schema = {"oneOf": [  # ResponseFormatText / TextResponseFormatJsonSchema / ResponseFormatJsonObject
    {"type": "object", "required": ["type"], "properties": {"type": const_enum("text")}},
    {"type": "object", "required": ["type", "schema", "name"],
     "properties": {"type": const_enum("json_schema"), "name": STRING, "description": STRING,
                    "schema": {"type": "object"}, "strict": nullable({"type": "boolean"})}},
    {"type": "object", "required": ["type"], "properties": {"type": const_enum("json_object")}},
]}

USAGE: Schema = {  # ResponseUsage
    "type": "object",
    "required": ["input_tokens", "input_tokens_details", "output_tokens", "output_tokens_details", "total_tokens"],
    "properties": {
        "input_tokens": INTEGER,
        "input_tokens_details": {"type": "object", "required": ["cached_tokens", "cache_write_tokens"],
                                 "properties": {"cached_tokens": INTEGER, "cache_write_tokens": INTEGER}},
        "output_tokens": INTEGER,
        "output_tokens_details": {"type": "object", "required": ["reasoning_tokens"],
                                  "properties": {"reasoning_tokens": INTEGER}},
        "total_tokens": INTEGER,
    },
}

RESPONSE: Schema = {  # Response
    "$schema": DIALECT,
    "type": "object",
    "required": ["id", "object", "created_at", "error", "incomplete_details", "instructions", "model", "tools",
                 "output", "parallel_tool_calls", "metadata", "tool_choice", "temperature", "top_p"],
    "properties": {
        "id": STRING,
        "object": const_enum("response"),
        "status": const_enum("completed", "failed", "in_progress", "cancelled", "queued", "incomplete"),
        "created_at": NUMBER,
        "completed_at": nullable(NUMBER),
        "error": nullable({"type": "object", "required": ["code", "message"],
                           "properties": {"code": const_enum(*ERROR_CODES), "message": STRING}}),
        "incomplete_details": nullable({"type": "object", "properties": {
            "reason": const_enum("max_output_tokens", "content_filter")}}),
        "instructions": nullable({"anyOf": [STRING, {"type": "array"}]}),
        "model": STRING,
        "output": {"type": "array", "items": OUTPUT_ITEM},
        "parallel_tool_calls": {"type": "boolean"},
        "metadata": nullable({"type": "object", "additionalProperties": STRING}),
        "tool_choice": TOOL_CHOICE,
        "tools": {"type": "array", "items": FUNCTION_TOOL},
        "temperature": nullable({"type": "number", "minimum": 0, "maximum": 2}),
        "top_p": nullable({"type": "number", "minimum": 0, "maximum": 1}),
        "top_logprobs": nullable({"type": "integer", "minimum": 0, "maximum": 20}),
        "user": STRING,  # not nullable in the spec: omitted when not given
        "safety_identifier": nullable(STRING),
        "prompt_cache_key": nullable(STRING),
        "previous_response_id": nullable(STRING),
        "background": nullable({"type": "boolean"}),
        "max_output_tokens": nullable(INTEGER),
        "max_tool_calls": nullable(INTEGER),
        "text": {"type": "object", "properties": {"format": TEXT_FORMAT,
                                                  "verbosity": nullable(const_enum("low", "medium", "high"))}},
        "reasoning": nullable({"type": "object", "properties": {
            "effort": nullable(const_enum("none", "minimal", "low", "medium", "high", "xhigh", "max")),
            "summary": nullable(const_enum("auto", "concise", "detailed"))}}),
        "service_tier": nullable(const_enum(*SERVICE_TIERS)),
        "truncation": nullable(const_enum("auto", "disabled")),
        "output_text": nullable(STRING),
        "usage": USAGE,
    },
}


def _event(kind: str, required: tuple, **properties: Schema) -> Schema:
    return {"type": "object", "required": ["type", "sequence_number", *required],
            "properties": {"type": const_enum(kind), "sequence_number": INTEGER, **properties}}


_IN_ITEM: Dict[str, Schema] = {"item_id": STRING, "output_index": INTEGER}
_IN_PART: Dict[str, Schema] = {**_IN_ITEM, "content_index": INTEGER}
_LOGPROBS: Schema = {"type": "array", "items": LOGPROB}

STREAM_EVENTS: Dict[str, Schema] = {
    **{kind: _event(kind, ("response",), response=RESPONSE) for kind in (
        "response.created", "response.in_progress", "response.completed", "response.incomplete",
        "response.failed")},
    **{kind: _event(kind, ("output_index", "item"), output_index=INTEGER, item=OUTPUT_ITEM) for kind in (
        "response.output_item.added", "response.output_item.done")},
    **{kind: _event(kind, ("item_id", "output_index", "content_index", "part"), part=OUTPUT_CONTENT, **_IN_PART)
       for kind in ("response.content_part.added", "response.content_part.done")},
    "response.output_text.delta": _event("response.output_text.delta",
                                         ("item_id", "output_index", "content_index", "delta", "logprobs"),
                                         delta=STRING, logprobs=_LOGPROBS, **_IN_PART),
    "response.output_text.done": _event("response.output_text.done",
                                        ("item_id", "output_index", "content_index", "text", "logprobs"),
                                        text=STRING, logprobs=_LOGPROBS, **_IN_PART),
    "response.function_call_arguments.delta": _event("response.function_call_arguments.delta",
                                                     ("item_id", "output_index", "delta"), delta=STRING, **_IN_ITEM),
    "response.function_call_arguments.done": _event("response.function_call_arguments.done",
                                                    ("item_id", "name", "output_index", "arguments"),
                                                    name=STRING, arguments=STRING, **_IN_ITEM),
    "error": _event("error", ("code", "message", "param"), code=nullable(STRING), message=STRING,
                    param=nullable(STRING)),
}

STREAM_EVENT: Schema = {"$schema": DIALECT, "oneOf": list(STREAM_EVENTS.values())}  # ResponseStreamEvent
