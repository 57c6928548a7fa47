"""A Responses request as the chat request the gateway already serves, and a response's output as chat history.

`to_chat(body, history)` turns `POST /v1/responses` into a `gateway.schemas.ChatCompletionRequest`, so that it runs
through exactly the chat path (`gateway.api.completions.plan_chat`: chat template, tools in the prompt, grammar,
`SamplingParams`): `instructions` become the first system message; a string input one user message; input items
become messages (roles user / system / developer / assistant, content as text or `input_text` / `output_text`
parts), a run of `function_call` items the tool calls of one assistant message (joined to the assistant message
right before them), each `function_call_output` a `tool` message. `history`: the stored conversation of
`previous_response_id` (its input and output, without its instructions, as OpenAI does), put before the input.
Flat function tools become chat tools, `tool_choice` {type: function, name} a named function, `text.format` chat's
`response_format` (the same grammar engine), `max_output_tokens` `max_completion_tokens`.

`UNSUPPORTED` lists the CreateResponse parameters the gateway does not implement, with the values that ask for
nothing; `check_request` answers the others with a 400 naming them: built-in tools (only function tools run here),
`background` (a response is generated while the request waits), `reasoning` with an effort or summary (this model
does not reason), `conversation`, `prompt` templates, `top_logprobs`, `include` (its items need built-in tools or
logprobs), ... `rename_param` maps a chat error's `param` back onto the Responses request's names.
"""
from __future__ import annotations

import json
from typing import Any, Dict, List, Optional, Sequence

from gateway.api.responses.schemas import (
    FunctionCallItem,
    FunctionCallOutputItem,
    FunctionChoice,
    FunctionTool,
    InputPart,
    MessageItem,
    OutputItem,
    OutputMessage,
    ResponsesRequest,
)
from gateway.api.unsupported import Table, check
from gateway.errors import APIError, bad_request
from gateway.schemas import (
    ChatCompletionRequest,
    ChatMessage,
    FunctionCallIn,
    FunctionDefinition,
    JsonSchemaFormat,
    NamedFunction,
    NamedToolChoice,
    ResponseFormat,
    ToolCallIn,
    ToolDefinition,
)
from gateway.structured.tools import call_arguments

UNSUPPORTED: Table = {
    "background": ((False,), "a response is generated while its request waits (no background mode)"),
    "conversation": ((), "conversations are not stored here; continue with previous_response_id"),
    "context_management": ((), "the context is never compacted (a longer input is a 400)"),
    "moderation": ((), "the gateway does not moderate"),
    "prompt": ((), "no prompt templates are stored here; send instructions and input"),
    "prompt_cache_retention": ((), "prompt caching is automatic (pooled sessions)"),
    "prompt_cache_options": ((), "prompt caching is automatic (pooled sessions)"),
    "top_logprobs": ((0,), "logprobs are not returned by the Responses API here (use /v1/chat/completions)"),
    "include": (([],), "nothing can be included: there are no built-in tools, no reasoning, no logprobs here"),
    "service_tier": (("auto", "default"), "there is one service tier"),
    "truncation": (("disabled",), "inputs are never truncated (a longer input is a 400)"),
}
TEXT_PARTS = ("input_text", "output_text")


def check_request(body: ResponsesRequest) -> None:
    """The 400s that do not depend on the prompt: unsupported parameters, built-in tools, tool choices of other
    kinds, reasoning, obfuscation, `stream_options` without `stream`."""
    check(body, UNSUPPORTED)
    for i, tool in enumerate(body.tools or ()):
        if not isinstance(tool, FunctionTool):
            raise bad_request(f"The built-in tool '{tool.type}' is not available on this gateway: only function "
                              f"tools (type 'function') are supported.", param=f"tools.{i}.type")
    choice = body.tool_choice
    if choice is not None and not isinstance(choice, (str, FunctionChoice)):
        raise bad_request(f"tool_choice of type '{choice.type}' is not supported: use 'none', 'auto', 'required' or "
                          f"{{'type': 'function', 'name': ...}}.", param="tool_choice")
    reasoning = body.reasoning
    if reasoning is not None and (reasoning.effort not in (None, "none") or reasoning.summary is not None
                                  or reasoning.generate_summary is not None):
        raise bad_request("'reasoning' is not supported: this model does not reason.", param="reasoning")
    if body.text is not None and body.text.verbosity is not None:
        raise bad_request("'text.verbosity' is not supported: this model has no verbosity setting.",
                          param="text.verbosity")
    if body.stream_options is not None:
        if not body.stream:
            raise bad_request("stream_options can only be given when stream is true.", param="stream_options")
        if body.stream_options.include_obfuscation:
            raise bad_request("Stream obfuscation is not supported: deltas are sent as they are.",
                              param="stream_options.include_obfuscation")


def _text(content: Any, param: str) -> str:
    """An item's content as text: a string, or `input_text` / `output_text` parts joined by newlines."""
    if isinstance(content, str):
        return content
    texts = []
    for j, part in enumerate(content):
        part_param = f"{param}.{j}"
        if not isinstance(part, InputPart) or part.type not in TEXT_PARTS or part.text is None:
            kind = getattr(part, "type", type(part).__name__)
            raise bad_request(f"Content part type '{kind}' is not supported: this model takes text only "
                              f"({' or '.join(TEXT_PARTS)}).", param=part_param)
        texts.append(part.text)
    return "\n".join(texts)


def _arguments(raw: str, param: str) -> str:
    call_arguments(raw, param)  # a JSON object, else a 400
    return raw


def input_messages(body: ResponsesRequest) -> List[ChatMessage]:
    """The request's input as chat messages (no instructions, no history)."""
    if isinstance(body.input, str):
        return [ChatMessage(role="user", content=body.input)]
    if not body.input:
        raise bad_request("The input must not be empty.", param="input")
    out: List[ChatMessage] = []
    for i, item in enumerate(body.input):
        param = f"input.{i}"
        if isinstance(item, MessageItem):
            out.append(ChatMessage(role=item.role, content=_text(item.content, f"{param}.content")))
        elif isinstance(item, FunctionCallItem):
            call = ToolCallIn(id=item.call_id, function=FunctionCallIn(
                name=item.name, arguments=_arguments(item.arguments, f"{param}.arguments")))
            last = out[-1] if out else None
            if last is not None and last.role == "assistant":  # the same turn: its text, then its calls
                last.tool_calls = [*(last.tool_calls or []), call]
            else:
                out.append(ChatMessage(role="assistant", content=None, tool_calls=[call]))
        elif isinstance(item, FunctionCallOutputItem):
            out.append(ChatMessage(role="tool", content=_text(item.output, f"{param}.output"),
                                   tool_call_id=item.call_id))
        else:
            raise bad_request(f"Input items of type '{item.type}' are not supported: use messages, function_call "
                              f"and function_call_output items (item references: previous_response_id).",
                              param=f"{param}.type")
    return out


def output_messages(output: Sequence[OutputItem]) -> List[ChatMessage]:
    """A response's output items as the chat history that follows its input (one assistant message: its text,
    then its calls; a call cut short by max_output_tokens, whose arguments are not a whole JSON object, is left
    out: the chat template could not render it, and the client never got a call to answer)."""
    texts = [part.text for item in output if isinstance(item, OutputMessage) for part in item.content]
    calls = [ToolCallIn(id=item.call_id, function=FunctionCallIn(name=item.name, arguments=item.arguments))
             for item in output if not isinstance(item, OutputMessage) and _is_object(item.arguments)]
    if not texts and not calls:
        return [ChatMessage(role="assistant", content="")]
    return [ChatMessage(role="assistant", content="".join(texts) or None, tool_calls=calls or None)]


def _is_object(text: str) -> bool:
    try:
        return isinstance(json.loads(text), dict)
    except ValueError:
        return False


def _response_format(body: ResponsesRequest) -> Optional[ResponseFormat]:
    fmt = body.text.format if body.text is not None else None
    if fmt is None or fmt.type != "json_schema":
        return ResponseFormat(type=fmt.type) if fmt is not None else None
    if fmt.name is None:
        raise bad_request("Missing required parameter: 'text.format.name'.", param="text.format.name")
    if fmt.schema_ is None:
        raise bad_request("Missing required parameter: 'text.format.schema'.", param="text.format.schema")
    return ResponseFormat(type="json_schema", json_schema=JsonSchemaFormat(
        name=fmt.name, description=fmt.description, schema=fmt.schema_, strict=fmt.strict))


def to_chat(body: ResponsesRequest, history: Sequence[ChatMessage] = ()) -> ChatCompletionRequest:
    """The chat request that serves `body` (see the module's docstring)."""
    messages = [*([ChatMessage(role="system", content=body.instructions)] if body.instructions else []),
                *history, *input_messages(body)]
    tools = [ToolDefinition(type="function", function=FunctionDefinition(
        name=t.name, description=t.description, parameters=t.parameters, strict=t.strict))
        for t in body.tools or () if isinstance(t, FunctionTool)] or None
    choice: Any = body.tool_choice
    if isinstance(choice, FunctionChoice):
        choice = NamedToolChoice(type="function", function=NamedFunction(name=choice.name))
    return ChatCompletionRequest(model=body.model, messages=messages, max_completion_tokens=body.max_output_tokens,
                                 temperature=body.temperature, top_p=body.top_p, tools=tools, tool_choice=choice,
                                 parallel_tool_calls=body.parallel_tool_calls, response_format=_response_format(body),
                                 stream=bool(body.stream), user=body.user)


_PARAMS = (("messages", "input"), ("response_format.json_schema.", "text.format."), ("response_format", "text.format"),
           ("max_completion_tokens", "max_output_tokens"))


def rename_param(error: APIError) -> APIError:
    """A chat-path error with its `param` in the Responses request's names (`messages.3...` is `input`, a tool's
    `tools.0.function.name` is `tools.0.name`, `response_format...` is `text.format...`)."""
    given = param = error.param
    if given is None or param is None:
        return error
    for old, new in _PARAMS:
        if param.startswith(old):
            param = "input" if old == "messages" else new + param[len(old):]
            break
    param = param.replace(".function.", ".")
    error.message, error.param = error.message.replace(given, param), param
    return error


def tool_dicts(body: ResponsesRequest) -> List[Dict[str, Any]]:
    """The Response object's `tools`: each function tool as FunctionTool (strict and parameters always present,
    null when not given: a tool is strict only when it says so, where OpenAI's default is strict)."""
    return [{"type": "function", "name": t.name, "description": t.description, "parameters": t.parameters,
             "strict": t.strict}
            for t in body.tools or () if isinstance(t, FunctionTool)]
