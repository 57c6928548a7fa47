"""Tool calling on the prompt side: the tools in the prompt, tool calls and results in the history, forced calls.

The format is Hermes' (also Qwen 2.5's): a call is `<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`,
a tool's result is `<tool_response>\\n...\\n</tool_response>`. When the model's chat template renders tools itself (it
uses a `tools` variable), it gets them (`apply_chat_template(..., tools=...)`) with the history in transformers'
shape (assistant `tool_calls` with parsed arguments, `tool` messages). Otherwise (SmolLM2's template, for one)
`render_messages` writes the tools into the system message (`system_prompt`, a new one first when there is none),
assistant calls as `<tool_call>` blocks after their content, and each run of `tool` messages as one user message of
`<tool_response>` blocks. `gateway.structured.toolparse` reads calls of this format back out of the generated text.

`tool_grammar(tools, choice, parallel)` is the llguidance grammar (`swarm.client.decoding.grammar`) that forces a call
with
`tool_choice` `required` (one of the tools) or a named function: the output is always `<tool_call>` blocks whose
arguments validate against the function's JSON Schema, closed (`closed_schema`: no undeclared key; with the
function's `strict`, every property too). A named function and `parallel_tool_calls: false` allow exactly one call.
`required` with parallel calls allows more, but another call starts only with the opening tag itself, right after
the closing one: the newline a model writes there (p ~0.6-0.8 for SmolLM2, which would go on with prose; the opening
tag ~1e-4, the end of turn ~0.15-0.3) is not allowed, so it cannot become a call the model did not mean.
`tool_choice: "none"` leaves the tools out of the prompt and the output unparsed. `call_header(name)` is the text a
forced call's body starts with (the grammar's compact JSON), which `gateway.structured.toolparse` reads cut calls
against.
"""
from __future__ import annotations

import json
from typing import Any, Dict, List, Optional, Sequence, Union

from gateway.errors import bad_request
from gateway.schemas import ChatMessage, NamedToolChoice, ToolDefinition
from swarm.client.api import closed_schema, styled_schema

CALL_OPEN, CALL_CLOSE = "<tool_call>", "</tool_call>"
RESPONSE_OPEN, RESPONSE_CLOSE = "<tool_response>", "</tool_response>"
NO_ARGUMENTS: Dict[str, Any] = {"type": "object", "properties": {}}

SYSTEM_PROMPT = """# Tools

You may call one or more functions to assist with the user query.

You are provided with function signatures within <tools></tools> XML tags:
<tools>
{tools}
</tools>

For each function call, return a json object with function name and arguments within <tool_call></tool_call> \
XML tags:
<tool_call>
{{"name": <function-name>, "arguments": <args-json-object>}}
</tool_call>"""


def tool_dicts(tools: Sequence[ToolDefinition]) -> List[Dict[str, Any]]:
    return [t.model_dump(exclude_none=True) for t in tools]


def system_prompt(tools: Sequence[ToolDefinition]) -> str:
    return SYSTEM_PROMPT.format(tools="\n".join(json.dumps(t, ensure_ascii=False) for t in tool_dicts(tools)))


def call_text(name: str, arguments: Any) -> str:
    return f"{CALL_OPEN}\n{json.dumps({'name': name, 'arguments': arguments}, ensure_ascii=False)}\n{CALL_CLOSE}"


def check_tools(tools: Optional[Sequence[ToolDefinition]], choice: Union[str, NamedToolChoice, None]) -> str:
    """The effective tool_choice ('none', 'auto', 'required' or the forced function's name); 400s for duplicate
    names, a named function that is not among the tools, or a choice other than 'none' without tools."""
    names = [t.function.name for t in tools or ()]
    for i, name in enumerate(names):
        if name in names[:i]:
            raise bad_request(f"Tool names must be unique; '{name}' is given twice.", param=f"tools.{i}.function.name")
        params = tools[i].function.parameters if tools else None
        if params is not None and params.get("type", "object") != "object":
            raise bad_request("A function's parameters must be a JSON Schema of type 'object'.",
                              param=f"tools.{i}.function.parameters")
        if tools and tools[i].function.strict:  # checked whatever the choice, as OpenAI checks strict schemas
            _closed_parameters(tools[i], i)
    if choice is None:
        return "auto" if names else "none"
    if isinstance(choice, NamedToolChoice):
        if choice.function.name not in names:
            raise bad_request(f"tool_choice names the function '{choice.function.name}', which is not among the "
                              f"tools.", param="tool_choice")
        return choice.function.name
    if choice != "none" and not names:
        raise bad_request(f"tool_choice '{choice}' requires tools.", param="tool_choice")
    return choice


def call_arguments(raw: str, param: str) -> Any:
    """A tool call's arguments (JSON text) as the object they must be; else a 400 naming `param`."""
    try:
        value = json.loads(raw)
    except ValueError:
        raise bad_request("Tool call arguments must be a JSON object.", param=param) from None
    if not isinstance(value, dict):
        raise bad_request("Tool call arguments must be a JSON object.", param=param)
    return value


def render_messages(messages: Sequence[ChatMessage], texts: Sequence[str], tools: Optional[Sequence[ToolDefinition]],
                    native: bool) -> List[Dict[str, Any]]:
    """The messages as the dicts `apply_chat_template` takes. `texts[i]`: message i's content as text; `tools`: the
    tools to show (None: none); `native`: the template renders tools and tool messages itself."""
    out: List[Dict[str, Any]] = []
    for i, (m, text) in enumerate(zip(messages, texts)):
        role = "system" if m.role == "developer" else m.role
        if m.tool_calls and role != "assistant":
            raise bad_request("Only assistant messages carry tool_calls.", param=f"messages.{i}.tool_calls")
        calls = [(c.function.name,
                  call_arguments(c.function.arguments, f"messages.{i}.tool_calls.{j}.function.arguments"))
                 for j, c in enumerate(m.tool_calls or ())]
        if native:
            entry: Dict[str, Any] = {"role": role, "content": text}
            if calls:
                entry["tool_calls"] = [{"type": "function", "function": {"name": n, "arguments": a}} for n, a in calls]
            if role == "tool" and m.tool_call_id is not None:
                entry["tool_call_id"] = m.tool_call_id
            out.append(entry)
        elif role == "tool":
            block = f"{RESPONSE_OPEN}\n{text}\n{RESPONSE_CLOSE}"
            if out and out[-1].get("tool_results"):
                out[-1]["content"] += "\n" + block
            else:
                out.append({"role": "user", "content": block, "tool_results": True})
        else:
            parts = [text] if text else []
            out.append({"role": role, "content": "\n".join(parts + [call_text(n, a) for n, a in calls])})
    for entry in out:
        entry.pop("tool_results", None)
    if tools and not native:
        prompt = system_prompt(tools)
        if out and out[0]["role"] == "system":
            out[0]["content"] = (out[0]["content"] + "\n\n" + prompt) if out[0]["content"] else prompt
        else:
            out.insert(0, {"role": "system", "content": prompt})
    return out


def call_header(name: str) -> str:
    """The start of a forced call's body, up to its arguments, as the grammar writes it."""
    return '{"name": %s, "arguments": ' % json.dumps(name)


def _closed_parameters(tool: ToolDefinition, index: int) -> Dict[str, Any]:
    """The function's parameters closed (`closed_schema`); a 400 for a strict schema that cannot be strict."""
    try:
        return closed_schema(tool.function.parameters or NO_ARGUMENTS, strict=bool(tool.function.strict))
    except ValueError as e:
        raise bad_request(f"Invalid strict schema: {e}", param=f"tools.{index}.function.parameters") from None


def _call_schema(tool: ToolDefinition, index: int) -> Dict[str, Any]:
    """The JSON Schema of one call's body: the function's name, then its arguments, closed (with the function's
    `strict`: every property required) and their `$defs` hoisted to the root so that `#/$defs/...` references still
    resolve."""
    params = _closed_parameters(tool, index)
    hoisted: Dict[str, Any] = {key: params.pop(key) for key in ("$defs", "definitions") if key in params}
    return {"type": "object", "properties": {"name": {"const": tool.function.name}, "arguments": params},
            "required": ["name", "arguments"], "additionalProperties": False, **hoisted}


def tool_grammar(tools: Sequence[ToolDefinition], choice: str, parallel: bool) -> Optional[str]:
    """The grammar forcing tool calls for an effective `choice` (see `check_tools`); None for 'none' and 'auto'."""
    if choice in ("none", "auto"):
        return None
    chosen = [(i, t) for i, t in enumerate(tools) if choice == "required" or t.function.name == choice]
    open_text, close_text = json.dumps(CALL_OPEN + "\n"), json.dumps("\n" + CALL_CLOSE)
    lines = ["%llguidance {}", "start: call+" if parallel and choice == "required" else "start: call",
             "call: " + " | ".join(f"call{k}" for k in range(len(chosen)))]
    for k, (index, tool) in enumerate(chosen):
        lines.append(f"call{k}: {open_text} body{k} {close_text}")
        lines.append(f"body{k}: %json {styled_schema(_call_schema(tool, index))}")
    return "\n".join(lines) + "\n"
