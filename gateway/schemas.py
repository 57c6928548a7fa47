"""OpenAI request and response bodies as pydantic models.

Requests accept and ignore unknown fields (OpenAI's SDK sends vendor fields such as `top_k` at the top level
through `extra_body`); known fields are range-checked, and a violation becomes a 400 naming the field. Fields of
OpenAI's or vLLM's API that the gateway does not support (`functions`, `prompt_logprobs`, ...) are
declared here all the same, so that `gateway.api.params` can answer them with a 400 instead of ignoring them.
`model` is required on both completion endpoints, as in OpenAI's spec.
Responses mirror OpenAI's objects: `chat.completion`, `chat.completion.chunk`, `text_completion`, the model
list, plus vLLM-style `/tokenize` and `/detokenize` bodies.
"""
from __future__ import annotations

import time
from typing import Any, Dict, List, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field, field_serializer, model_serializer

from swarm import __version__

SYSTEM_FINGERPRINT = f"swarmgate-{__version__}"  # OpenAI: a string when present, never null


class _Request(BaseModel):
    model_config = ConfigDict(extra="ignore")


class ContentPart(_Request):
    type: str
    text: Optional[str] = None


class FunctionCallIn(_Request):
    name: str
    arguments: str  # a JSON object, as text (OpenAI's shape)


class ToolCallIn(_Request):
    """A tool call of an earlier assistant message, sent back in the history."""
    id: Optional[str] = None
    type: Literal["function"] = "function"
    function: FunctionCallIn


class ChatMessage(_Request):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Optional[Union[str, List[ContentPart]]] = None
    name: Optional[str] = None
    tool_calls: Optional[List[ToolCallIn]] = None  # assistant messages only
    tool_call_id: Optional[str] = None  # tool messages: the call they answer
    function_call: Optional[Any] = None  # deprecated: a 400 from gateway.api.params.check_messages


FUNCTION_NAME = r"^[a-zA-Z0-9_-]{1,64}$"  # OpenAI's rule for function names


class FunctionDefinition(_Request):
    name: str = Field(pattern=FUNCTION_NAME)
    description: Optional[str] = None
    parameters: Optional[Dict[str, Any]] = None  # a JSON Schema of the arguments object (absent: no arguments)
    strict: Optional[bool] = None  # the arguments always validate when a call is forced; auto calls are parsed


class ToolDefinition(_Request):
    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(_Request):
    name: str


class NamedToolChoice(_Request):
    type: Literal["function"]
    function: NamedFunction


class StreamOptions(_Request):
    include_usage: Optional[bool] = False


class JsonSchemaFormat(_Request):
    name: str = Field(default="response", pattern=FUNCTION_NAME)
    description: Optional[str] = None
    schema_: Optional[Dict[str, Any]] = Field(default=None, alias="schema")  # absent: any JSON object
    strict: Optional[bool] = None  # the output always follows the schema, strict or not


class ResponseFormat(_Request):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: Optional[JsonSchemaFormat] = None  # required with type json_schema


class _SamplingFields(_Request):
    """Fields shared by chat and text completions."""

    model: Optional[str] = None
    max_tokens: Optional[int] = Field(default=None, ge=1)
    temperature: Optional[float] = Field(default=None, ge=0, le=2)
    top_p: Optional[float] = Field(default=None, gt=0, le=1)
    top_k: Optional[int] = Field(default=None, ge=-1)
    min_p: Optional[float] = Field(default=None, ge=0, le=1)
    presence_penalty: Optional[float] = Field(default=None, ge=-2, le=2)
    frequency_penalty: Optional[float] = Field(default=None, ge=-2, le=2)
    repetition_penalty: Optional[float] = Field(default=None, gt=0, le=10)
    seed: Optional[int] = None
    stop: Optional[Union[str, List[str]]] = None
    stop_token_ids: Optional[List[int]] = None
    ignore_eos: Optional[bool] = False
    n: Optional[int] = Field(default=1, ge=1)
    logit_bias: Optional[Dict[str, float]] = None
    stream: Optional[bool] = False
    stream_options: Optional[StreamOptions] = None
    user: Optional[str] = None
    min_tokens: Optional[int] = Field(default=None, ge=0)  # vLLM: end-of-sequence / stop ids masked until then
    prompt_logprobs: Optional[int] = None  # vLLM extra, not supported: a 400 when given
    # swarmgate: speculative decoding of this request (None: the gateway's --speculative, --num_draft_tokens)
    speculative: Optional[Literal["off", "ngram", "draft_model"]] = None
    num_draft_tokens: Optional[int] = Field(default=None, ge=1, le=16)
    # vLLM's guided decoding (gateway.structured.grammars)
    guided_json: Optional[Union[Dict[str, Any], str]] = None
    guided_regex: Optional[str] = None
    guided_choice: Optional[List[str]] = None
    guided_grammar: Optional[str] = None
    structured_outputs: Optional[Dict[str, Any]] = None
    # not supported: gateway.api.unsupported.SHARED (a 400 naming the field unless null or a value that asks for
    # nothing)
    use_beam_search: Optional[bool] = None
    length_penalty: Optional[float] = None
    include_stop_str_in_output: Optional[bool] = None
    skip_special_tokens: Optional[bool] = None
    spaces_between_special_tokens: Optional[bool] = None
    truncate_prompt_tokens: Optional[int] = None
    allowed_token_ids: Optional[List[int]] = None
    bad_words: Optional[List[str]] = None
    priority: Optional[int] = None
    logits_processors: Optional[List[Any]] = None
    return_tokens_as_token_ids: Optional[bool] = None
    return_token_ids: Optional[bool] = None
    guided_decoding_backend: Optional[str] = None
    guided_whitespace_pattern: Optional[str] = None
    structural_tag: Optional[str] = None
    request_id: Optional[str] = None
    cache_salt: Optional[str] = None
    kv_transfer_params: Optional[Dict[str, Any]] = None
    vllm_xargs: Optional[Dict[str, Any]] = None

    def stop_list(self) -> List[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)


_WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
CHAT_EXAMPLES: Any = [  # in /openapi.json (gateway.api.openapi sets `model` to the served name)
    {"model": "MODEL", "messages": [{"role": "user", "content": "Hello!"}], "max_tokens": 8},
    {"model": "MODEL", "messages": [{"role": "user", "content": "Weather in Paris?"}], "tools": [_WEATHER],
     "tool_choice": "required", "max_tokens": 24, "temperature": 0},
    {"model": "MODEL", "messages": [{"role": "user", "content": "A cat as JSON"}], "stream": True, "max_tokens": 16,
     "response_format": {"type": "json_schema", "json_schema": {"name": "cat", "schema": {
         "type": "object", "properties": {"name": {"type": "string"}}, "required": ["name"]}}}},
    {"model": "MODEL", "messages": [{"role": "user", "content": "Hi"}], "n": 2, "logprobs": True, "top_logprobs": 2,
     "stop": ["."], "seed": 1, "max_tokens": 8, "stream": True, "stream_options": {"include_usage": True}},
]
COMPLETION_EXAMPLES: Any = [
    {"model": "MODEL", "prompt": "The capital of France is", "max_tokens": 8, "temperature": 0},
    {"model": "MODEL", "prompt": ["Once upon", "a time"], "max_tokens": 4, "echo": True, "logprobs": 2, "n": 2},
    {"model": "MODEL", "prompt": "Answer:", "max_tokens": 4, "guided_choice": ["yes", "no"], "stream": True},
]


class ChatCompletionRequest(_SamplingFields):
    model_config = ConfigDict(extra="ignore", json_schema_extra={"examples": CHAT_EXAMPLES})

    model: str  # required here (optional on /tokenize)
    messages: List[ChatMessage] = Field(min_length=1)
    max_completion_tokens: Optional[int] = Field(default=None, ge=1)
    logprobs: Optional[bool] = False
    top_logprobs: Optional[int] = Field(default=None, ge=0, le=20)
    response_format: Optional[ResponseFormat] = None
    add_generation_prompt: Optional[bool] = True
    chat_template_kwargs: Optional[Dict[str, Any]] = None  # vLLM: extra variables for the chat template
    tools: Optional[List[ToolDefinition]] = Field(default=None, min_length=1)
    tool_choice: Optional[Union[Literal["none", "auto", "required"], NamedToolChoice]] = None
    parallel_tool_calls: Optional[bool] = None  # false: at most one tool call
    # not supported (a 400 from gateway.api.params.check_chat_request unless absent or a no-op value)
    functions: Optional[Any] = None
    function_call: Optional[Any] = None
    echo: Optional[bool] = None
    best_of: Optional[int] = Field(default=None, ge=1)
    # not supported: gateway.api.unsupported.CHAT
    modalities: Optional[List[str]] = None
    audio: Optional[Dict[str, Any]] = None
    prediction: Optional[Dict[str, Any]] = None
    web_search_options: Optional[Dict[str, Any]] = None
    reasoning_effort: Optional[str] = None
    verbosity: Optional[str] = None
    store: Optional[bool] = None
    service_tier: Optional[str] = None
    prompt_cache_retention: Optional[str] = None
    add_special_tokens: Optional[bool] = None
    continue_final_message: Optional[bool] = None
    documents: Optional[List[Dict[str, Any]]] = None
    chat_template: Optional[str] = None
    mm_processor_kwargs: Optional[Dict[str, Any]] = None
    # accepted, no effect on the output (as with `user`)
    metadata: Optional[Dict[str, str]] = None
    safety_identifier: Optional[str] = None
    prompt_cache_key: Optional[str] = None  # conversations are found again by their tokens (session pool)


class CompletionRequest(_SamplingFields):
    model_config = ConfigDict(extra="ignore", json_schema_extra={"examples": COMPLETION_EXAMPLES})

    model: str  # required here (optional on /tokenize)
    prompt: Union[str, List[str], List[int], List[List[int]]]
    max_tokens: Optional[int] = Field(default=None, ge=0)  # 0 only with echo (scoring a prompt), as vLLM
    echo: Optional[bool] = False
    logprobs: Optional[int] = Field(default=None, ge=0, le=20)
    suffix: Optional[str] = None
    best_of: Optional[int] = Field(default=None, ge=1)
    response_format: Optional[ResponseFormat] = None  # vLLM: structured output on text completions too
    # not supported: gateway.api.unsupported.COMPLETIONS
    add_special_tokens: Optional[bool] = None
    prompt_embeds: Optional[Any] = None


class TokenizeRequest(_Request):
    model: Optional[str] = None
    prompt: Optional[str] = None
    messages: Optional[List[ChatMessage]] = None
    add_special_tokens: Optional[bool] = True
    add_generation_prompt: Optional[bool] = True
    chat_template_kwargs: Optional[Dict[str, Any]] = None


class DetokenizeRequest(_Request):
    model: Optional[str] = None
    tokens: List[int]


# ---- responses ------------------------------------------------------------------------------------------------
class PromptTokensDetails(BaseModel):
    cached_tokens: int = 0  # prompt tokens whose states a pooled session already held


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails = Field(default_factory=PromptTokensDetails)


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: Optional[List[int]] = None


class TokenLogprob(TopLogprob):
    top_logprobs: List[TopLogprob] = Field(default_factory=list)


class ChoiceLogprobs(BaseModel):
    content: Optional[List[TokenLogprob]] = None
    refusal: Optional[List[TokenLogprob]] = None  # required (nullable) by OpenAI's spec: always sent, null


class FunctionCall(BaseModel):
    name: str
    arguments: str  # JSON text


class ToolCall(BaseModel):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: Optional[str] = None
    refusal: Optional[str] = None  # required (nullable) by OpenAI's spec: always sent, null
    tool_calls: Optional[List[ToolCall]] = None  # omitted when there are none (the spec: an array when present)

    @model_serializer(mode="wrap")
    def _omit_no_calls(self, handler) -> Dict[str, Any]:
        out = handler(self)
        if out.get("tool_calls", ...) is None:
            del out["tool_calls"]
        return out


class ChatChoice(BaseModel):
    index: int
    message: AssistantMessage
    logprobs: Optional[ChoiceLogprobs] = None
    finish_reason: Optional[str] = None


class SwarmInfo(BaseModel):
    """swarmgate's extension of a reply (OpenAI clients ignore unknown fields): the peer ids of the servers that
    served it, in chain order (after any failover); on a stream, in the usage chunk."""

    servers: List[str] = Field(default_factory=list)


class ChatCompletion(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: List[ChatChoice]
    usage: Usage
    system_fingerprint: str = SYSTEM_FINGERPRINT
    swarm: Optional[SwarmInfo] = None


class _NoNulls(BaseModel):
    @model_serializer(mode="wrap")
    def _drop_none(self, handler) -> Dict[str, Any]:
        return {k: v for k, v in handler(self).items() if v is not None}


class FunctionCallChunk(_NoNulls):
    name: Optional[str] = None
    arguments: Optional[str] = None


class ToolCallChunk(_NoNulls):
    """A streamed piece of a tool call: the first has `id`, `type` and the function's name, later ones arguments."""
    index: int
    id: Optional[str] = None
    type: Optional[Literal["function"]] = None
    function: Optional[FunctionCallChunk] = None


class Delta(_NoNulls):
    role: Optional[str] = None
    content: Optional[str] = None
    tool_calls: Optional[List[ToolCallChunk]] = None


class ChunkChoice(BaseModel):
    index: int
    delta: Delta
    logprobs: Optional[ChoiceLogprobs] = None
    finish_reason: Optional[str] = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: List[ChunkChoice]
    usage: Optional[Usage] = None
    system_fingerprint: str = SYSTEM_FINGERPRINT
    swarm: Optional[SwarmInfo] = None  # only on the usage chunk (`SwarmInfo`)


class CompletionLogprobs(BaseModel):
    tokens: List[str] = Field(default_factory=list)
    token_logprobs: List[Optional[float]] = Field(default_factory=list)
    top_logprobs: List[Optional[Dict[str, float]]] = Field(default_factory=list)
    text_offset: List[int] = Field(default_factory=list)

    @field_serializer("top_logprobs")
    def _no_null_tops(self, tops: List[Optional[Dict[str, float]]]) -> List[Dict[str, float]]:
        return [top or {} for top in tops]  # OpenAI's spec: each position is an object (empty with logprobs=0)


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: Optional[CompletionLogprobs] = None
    finish_reason: Optional[str] = None


class Completion(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: List[CompletionChoice]
    usage: Optional[Usage] = None  # OpenAI's spec: an object when present, never null (streamed chunks omit it)
    system_fingerprint: str = SYSTEM_FINGERPRINT

    @model_serializer(mode="wrap")
    def _omit_null_usage(self, handler) -> Dict[str, Any]:
        out = handler(self)
        if out.get("usage", ...) is None:
            del out["usage"]
        return out


class ModelCoverage(BaseModel):
    """A base model's swarm as `/v1/models` shows it (swarmgate's extension): its blocks, how many an online server
    serves, the usable online servers, and the missing blocks as half-open ranges ('' when none)."""

    blocks: int
    blocks_served: int
    servers: int
    missing_blocks: str


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "swarmgate"
    context_length: int
    max_model_len: int
    parent: Optional[str] = None  # a LoRA adapter's base model (None: a base model)
    coverage: Optional[ModelCoverage] = None  # a base model's swarm (None: an adapter, or the swarm unreadable now)


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: List[ModelCard]
