"""The bodies of OpenAI's Responses API (`POST /v1/responses`) as pydantic models: the request, its input items,
the Response object with its output items and usage.

Written from OpenAI's OpenAPI document (`openai/openai-openapi` 2.3.0: CreateResponse, InputItem, EasyInputMessage,
FunctionToolCall, FunctionCallOutputItemParam, FunctionTool, ToolChoiceParam, TextResponseFormatConfiguration,
Response, OutputMessage, OutputTextContent, ResponseUsage). The request's top level rejects unknown fields (a 400
"Unknown parameter", as OpenAI answers); input items accept unknown fields (an output item sent back as input carries
`id`, `status`, `annotations`, ...). Every parameter of CreateResponse is declared, so that one the gateway does not
implement is a 400 naming it (`gateway.api.responses.convert.UNSUPPORTED`), never ignored. Built-in tools (web search,
file search, ...) are declared as `HostedTool` so that they get a clear 400 rather than a validation error.
"""
from __future__ import annotations

import time
from typing import Annotated, Any, Dict, List, Literal, Optional, Tuple, Union

from pydantic import BaseModel, ConfigDict, Discriminator, Field, Tag, field_validator, model_serializer

from gateway.schemas import FUNCTION_NAME


class _Item(BaseModel):
    model_config = ConfigDict(extra="ignore")


class InputPart(_Item):
    """A content part of an input message: `input_text` / `output_text` (text); others are a 400 (text only)."""
    type: str
    text: Optional[str] = None


class MessageItem(_Item):
    type: Optional[Literal["message"]] = None
    role: Literal["user", "system", "developer", "assistant"]
    content: Union[str, List[InputPart]]


class FunctionCallItem(_Item):
    """A function call of an earlier response, sent back in the input."""
    type: Literal["function_call"]
    call_id: str
    name: str
    arguments: str  # a JSON object, as text


class FunctionCallOutputItem(_Item):
    """The result of a function call: `output` as text or a list of `input_text` parts."""
    type: Literal["function_call_output"]
    call_id: str
    output: Union[str, List[InputPart]]


class OtherItem(_Item):
    """Any other item type (item references, reasoning, built-in tools' calls): a 400 naming it."""
    type: str


def _kind(value: Any, known: Tuple[str, ...], untyped: str) -> str:
    """The union member of an item: its `type` when known, `untyped` without one, else "other" (tags start with
    "kind:", which `gateway.errors` leaves out of a 400's `param`)."""
    if isinstance(value, str):
        return "kind:option"
    kind = (value.get("type") if isinstance(value, dict) else getattr(value, "type", None)) or untyped
    return f"kind:{kind}" if kind in known else "kind:other"


def _input_kind(value: Any) -> str:
    return _kind(value, ("message", "function_call", "function_call_output"), "message")


InputItem = Annotated[Union[Annotated[MessageItem, Tag("kind:message")],
                            Annotated[FunctionCallItem, Tag("kind:function_call")],
                            Annotated[FunctionCallOutputItem, Tag("kind:function_call_output")],
                            Annotated[OtherItem, Tag("kind:other")]], Discriminator(_input_kind)]


Input = Annotated[Union[Annotated[str, Tag("kind:text")], Annotated[List[InputItem], Tag("kind:items")]],
                  Discriminator(lambda value: "kind:text" if isinstance(value, str) else "kind:items")]


class FunctionTool(_Item):
    """The Responses API's flat function tool (chat's is nested under `function`)."""
    type: Literal["function"]
    name: str = Field(pattern=FUNCTION_NAME)
    description: Optional[str] = None
    parameters: Optional[Dict[str, Any]] = None
    strict: Optional[bool] = None


class HostedTool(_Item):
    """A built-in tool (`web_search`, `file_search`, `code_interpreter`, ...): not served here (a 400)."""
    type: str


Tool = Annotated[Union[Annotated[FunctionTool, Tag("kind:function")], Annotated[HostedTool, Tag("kind:other")]],
                 Discriminator(lambda value: _kind(value, ("function",), ""))]


class FunctionChoice(_Item):
    type: Literal["function"]
    name: str


class OtherChoice(_Item):
    """A tool_choice of another kind (`allowed_tools`, a hosted tool, `mcp`, `custom`): a 400."""
    type: str


ToolChoice = Annotated[Union[Annotated[Literal["none", "auto", "required"], Tag("kind:option")],
                             Annotated[FunctionChoice, Tag("kind:function")],
                             Annotated[OtherChoice, Tag("kind:other")]],
                       Discriminator(lambda value: _kind(value, ("function",), ""))]


class TextFormat(_Item):
    type: Literal["text", "json_object", "json_schema"]
    name: Optional[str] = Field(default=None, pattern=FUNCTION_NAME)  # json_schema: required
    description: Optional[str] = None
    schema_: Optional[Dict[str, Any]] = Field(default=None, alias="schema")  # json_schema: required
    strict: Optional[bool] = None


class TextParam(_Item):
    format: Optional[TextFormat] = None
    verbosity: Optional[str] = None  # not supported (a 400 unless null)


class ReasoningParam(_Item):
    effort: Optional[str] = None
    summary: Optional[str] = None
    generate_summary: Optional[str] = None
    mode: Optional[str] = None
    context: Optional[str] = None


class StreamOptions(_Item):
    include_obfuscation: Optional[bool] = None


_WEATHER = {"type": "function", "name": "get_weather", "strict": True, "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"], "additionalProperties": False}}
EXAMPLES: Any = [  # in /openapi.json (gateway.api.openapi sets `model` to the served name)
    {"model": "MODEL", "input": "Hello!", "max_output_tokens": 16},
    {"model": "MODEL", "instructions": "Answer briefly.", "stream": True, "max_output_tokens": 16,
     "input": [{"role": "user", "content": [{"type": "input_text", "text": "Name a colour."}]}]},
    {"model": "MODEL", "input": "Weather in Paris?", "tools": [_WEATHER], "tool_choice": "required",
     "max_output_tokens": 32, "temperature": 0},
    {"model": "MODEL", "input": "A cat as JSON", "max_output_tokens": 24, "text": {"format": {
        "type": "json_schema", "name": "cat", "strict": True, "schema": {
            "type": "object", "properties": {"name": {"type": "string"}}, "required": ["name"],
            "additionalProperties": False}}}},
]


class ResponsesRequest(BaseModel):
    """CreateResponse. Supported: model, input, instructions, max_output_tokens, temperature, top_p, tools (function),
    tool_choice, parallel_tool_calls, text.format, stream, store, previous_response_id, metadata, user; accepted
    without effect: safety_identifier, prompt_cache_key, max_tool_calls (no built-in tools), include: [],
    service_tier auto/default, truncation disabled, reasoning without an effort. The rest: a 400 naming it."""

    model_config = ConfigDict(extra="forbid", json_schema_extra={"examples": EXAMPLES})

    model: str
    input: Input
    instructions: Optional[str] = None
    max_output_tokens: Optional[int] = Field(default=None, ge=16)  # OpenAI's minimum
    temperature: Optional[float] = Field(default=None, ge=0, le=2)
    top_p: Optional[float] = Field(default=None, gt=0, le=1)
    tools: Optional[List[Tool]] = None
    tool_choice: Optional[ToolChoice] = None
    parallel_tool_calls: Optional[bool] = None
    text: Optional[TextParam] = None
    stream: Optional[bool] = False
    stream_options: Optional[StreamOptions] = None
    store: Optional[bool] = True
    previous_response_id: Optional[str] = None
    metadata: Optional[Dict[str, str]] = None
    user: Optional[str] = None
    # accepted, no effect
    safety_identifier: Optional[str] = Field(default=None, max_length=64)
    prompt_cache_key: Optional[str] = None  # conversations are found again by their tokens (session pool)
    max_tool_calls: Optional[int] = Field(default=None, ge=1)  # counts built-in tools' calls: there are none
    # not supported unless a value that asks for nothing (gateway.api.responses.convert.UNSUPPORTED)
    include: Optional[List[str]] = None
    service_tier: Optional[str] = None
    truncation: Optional[str] = None
    reasoning: Optional[ReasoningParam] = None
    background: Optional[bool] = None
    conversation: Optional[Any] = None
    context_management: Optional[Any] = None
    moderation: Optional[Any] = None
    prompt: Optional[Any] = None
    prompt_cache_retention: Optional[str] = None
    prompt_cache_options: Optional[Any] = None
    top_logprobs: Optional[int] = Field(default=None, ge=0, le=20)

    @field_validator("metadata")
    @classmethod
    def _metadata_limits(cls, value: Optional[Dict[str, str]]) -> Optional[Dict[str, str]]:
        """OpenAI's limits: at most 16 pairs, keys up to 64 characters, values up to 512."""
        if value is not None and (len(value) > 16 or any(len(k) > 64 or len(v) > 512 for k, v in value.items())):
            raise ValueError("at most 16 pairs, keys of at most 64 characters and values of at most 512")
        return value


# ---- the Response object ------------------------------------------------------------------------------------------
class OutputText(BaseModel):
    type: Literal["output_text"] = "output_text"
    text: str
    annotations: List[Any] = Field(default_factory=list)
    logprobs: List[Any] = Field(default_factory=list)


class OutputMessage(BaseModel):
    id: str
    type: Literal["message"] = "message"
    role: Literal["assistant"] = "assistant"
    status: Literal["in_progress", "completed", "incomplete"]
    content: List[OutputText] = Field(default_factory=list)


class OutputFunctionCall(BaseModel):
    id: str
    type: Literal["function_call"] = "function_call"
    call_id: str
    name: str
    arguments: str
    status: Literal["in_progress", "completed", "incomplete"]


OutputItem = Union[OutputMessage, OutputFunctionCall]


class InputTokensDetails(BaseModel):
    cached_tokens: int = 0  # input tokens whose states a pooled session already held
    cache_write_tokens: int = 0  # input tokens computed into a session that the pool keeps (0: pool off)


class OutputTokensDetails(BaseModel):
    reasoning_tokens: int = 0  # this model does not reason


class ResponseUsage(BaseModel):
    input_tokens: int
    input_tokens_details: InputTokensDetails
    output_tokens: int
    output_tokens_details: OutputTokensDetails = Field(default_factory=OutputTokensDetails)
    total_tokens: int


class ResponseError(BaseModel):
    code: str  # ResponseErrorCode: server_error, rate_limit_exceeded, ...
    message: str


class IncompleteDetails(BaseModel):
    reason: Literal["max_output_tokens", "content_filter"]


class Reasoning(BaseModel):
    effort: Optional[str] = None
    summary: Optional[str] = None


class Response(BaseModel):
    id: str
    object: Literal["response"] = "response"
    created_at: int = Field(default_factory=lambda: int(time.time()))
    completed_at: Optional[int] = None
    status: Literal["completed", "failed", "in_progress", "incomplete"] = "in_progress"
    error: Optional[ResponseError] = None
    incomplete_details: Optional[IncompleteDetails] = None
    instructions: Optional[str] = None
    max_output_tokens: Optional[int] = None
    max_tool_calls: Optional[int] = None
    model: str
    output: List[OutputItem] = Field(default_factory=list)
    parallel_tool_calls: bool = True
    previous_response_id: Optional[str] = None
    reasoning: Reasoning = Field(default_factory=Reasoning)
    service_tier: str = "default"
    store: bool = True
    temperature: float = 1.0
    text: Dict[str, Any] = Field(default_factory=lambda: {"format": {"type": "text"}})
    tool_choice: Union[str, Dict[str, Any]] = "auto"
    tools: List[Dict[str, Any]] = Field(default_factory=list)
    top_p: float = 1.0
    truncation: str = "disabled"
    usage: Optional[ResponseUsage] = None
    user: Optional[str] = None
    metadata: Dict[str, str] = Field(default_factory=dict)
    safety_identifier: Optional[str] = None
    prompt_cache_key: Optional[str] = None

    @model_serializer(mode="wrap")
    def _omit_nulls(self, handler) -> Dict[str, Any]:
        out = handler(self)
        for key in ("user", "usage"):  # the spec's `user` is a string and `usage` an object, never null
            if out.get(key, ...) is None:
                del out[key]
        return out
