"""Structured output of a chat request: which grammar constrains its decoding, checked before anything runs.

`response_format` `json_object` is the grammar of any JSON object, `json_schema` the grammar of its schema (llguidance
compiles both: `swarm.client.grammar.json_schema_grammar`); a forced tool call (`tool_choice` `required` or a named
function) is `gateway.tools.tool_grammar`. The two cannot be combined (a 400 naming `response_format`). A grammar
llguidance cannot use (a schema keyword it does not implement, a `$ref` it cannot resolve, ...) is a 400 naming the
parameter that carried the schema: `check` runs llguidance's validation against the model's tokenizer, on a worker
thread (the first call builds llguidance's tokenizer, ~0.4 s).
"""
from __future__ import annotations

from typing import Optional, Tuple

from gateway.errors import bad_request
from gateway.schemas import ChatCompletionRequest
from gateway.tokens import Tokens
from gateway.tools import tool_grammar
from swarm.client.grammar import check_grammar, json_schema_grammar

ANY_OBJECT = {"type": "object"}


def request_grammar(body: ChatCompletionRequest, tool_choice: str) -> Tuple[Optional[str], str]:
    """(the grammar, the parameter to blame when it is invalid); (None, "") for free text."""
    fmt = body.response_format
    forced = tool_choice not in ("none", "auto")
    if fmt is not None and fmt.type != "text" and forced:
        raise bad_request("response_format cannot be combined with a forced tool call (tool_choice).",
                          param="response_format")
    if forced:
        return tool_grammar(body.tools or [], tool_choice, body.parallel_tool_calls is not False), "tools"
    if fmt is None or fmt.type == "text":
        return None, ""
    if fmt.type == "json_object":
        return json_schema_grammar(ANY_OBJECT), "response_format"
    if fmt.json_schema is None:
        raise bad_request("response_format of type 'json_schema' needs a 'json_schema' object.",
                          param="response_format.json_schema")
    schema = fmt.json_schema.schema_ if fmt.json_schema.schema_ is not None else ANY_OBJECT
    try:
        return json_schema_grammar(schema), "response_format.json_schema.schema"
    except ValueError as e:
        raise bad_request(f"Invalid JSON Schema: {e}", param="response_format.json_schema.schema") from None


def check(tokens: Tokens, grammar: str, param: str) -> None:
    """A 400 naming `param` when llguidance cannot use `grammar` with this tokenizer."""
    why = check_grammar(tokens.grammar_tokenizer, grammar)
    if why:
        raise bad_request(f"The schema cannot be enforced: {why}", param=param)
