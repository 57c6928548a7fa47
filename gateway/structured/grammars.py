"""Structured output of a request: which grammar constrains its decoding, checked before anything runs.

One of these may constrain the output (two are a 400 naming the second): `response_format` `json_object` (any JSON
object) or `json_schema` (its schema); a forced tool call (`tool_choice` `required` or a named function:
`gateway.structured.tools.tool_grammar`); vLLM's `guided_json` (a schema), `guided_regex`, `guided_choice`,
`guided_grammar` (Lark or GBNF) and their newer form `structured_outputs` (`json`, `regex`, `choice`, `grammar`,
`json_object`). llguidance compiles them (`swarm.client.decoding.grammar`). A grammar llguidance cannot use (a JSON
Schema keyword it does not implement, a `$ref` it cannot resolve, a regex or grammar that does not parse) is a 400
naming the parameter that carried it: `check` runs llguidance's validation against the model's tokenizer, on a worker
thread (the first call builds llguidance's tokenizer, ~0.4 s).

JSON Schemas of OpenAI's parameters (`response_format` `json_schema`, a forced call's arguments) are closed
(`swarm.client.decoding.grammar.closed_schema`): an object that declares its properties gets no other key unless the
schema allows others explicitly; with `strict: true` every declared property is also required. vLLM's `guided_json`
keeps JSON Schema's own meaning (other keys allowed where `additionalProperties` is absent), as vLLM does, unless
`structured_outputs.disable_additional_properties` is true.
"""
from __future__ import annotations

import functools
import json
from typing import Any, Callable, Dict, List, Optional, Protocol, Tuple

from gateway.errors import bad_request
from gateway.schemas import ResponseFormat
from gateway.structured.tools import tool_grammar
from swarm.client.api import (
    GrammarTokenizer,
    check_grammar,
    choice_grammar,
    closed_schema,
    json_schema_grammar,
    lark_grammar,
    regex_grammar,
)

ANY_OBJECT = {"type": "object"}
STRUCTURED_OUTPUTS = ("json", "regex", "choice", "grammar", "json_object")
_NO_OPS = {"disable_fallback": (False,), "disable_any_whitespace": (False,), "whitespace_pattern": (),
           "structural_tag": (), "disable_additional_properties": (False, True)}  # (the values accepted)


def _schema(value: Any, param: str, close: bool = False, strict: bool = False) -> str:
    """The grammar of a JSON Schema given as an object or as its text; `close`: closed (`closed_schema`)."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError:
            raise bad_request("The JSON Schema is not valid JSON.", param=param) from None
    if not isinstance(value, dict):
        raise bad_request("A JSON Schema must be a JSON object.", param=param)
    if close:
        try:
            value = closed_schema(value, strict)
        except ValueError as e:
            raise bad_request(f"Invalid strict schema: {e}", param=param) from None
    return json_schema_grammar(value)


def _text(value: Any, param: str) -> str:
    if not isinstance(value, str) or not value:
        raise bad_request("Expected a non-empty string.", param=param)
    return value


def _choices(value: Any, param: str) -> str:
    if not isinstance(value, list) or not value or not all(isinstance(c, str) and c for c in value):
        raise bad_request("Expected a list of non-empty strings.", param=param)
    return choice_grammar(value)


def _format(fmt: ResponseFormat) -> Tuple[str, str]:
    if fmt.type == "json_object":
        return "response_format", json_schema_grammar(ANY_OBJECT)
    if fmt.json_schema is None:
        raise bad_request("response_format of type 'json_schema' needs a 'json_schema' object.",
                          param="response_format.json_schema")
    param = "response_format.json_schema.schema"
    schema = fmt.json_schema.schema_ if fmt.json_schema.schema_ is not None else ANY_OBJECT
    return param, _schema(schema, param, close=True, strict=bool(fmt.json_schema.strict))


def _regex(value: Any, param: str) -> str:
    return regex_grammar(_text(value, param))


def _lark(value: Any, param: str) -> str:
    return lark_grammar(_text(value, param))


def _any_object(value: Any, param: str) -> str:
    return json_schema_grammar(ANY_OBJECT)


_GUIDED: Dict[str, Callable[[Any, str], str]] = {"json": _schema, "regex": _regex, "choice": _choices,
                                                 "grammar": _lark}


def _guided(build: Callable[[Any, str], str], value: Any, param: str) -> Tuple[str, str]:
    return param, build(value, param)


def _forced_call(body: Any, tool_choice: str) -> Tuple[str, str]:
    grammar = tool_grammar(body.tools or [], tool_choice, body.parallel_tool_calls is not False)
    assert grammar is not None  # a forced choice always has one
    return "tools", grammar


def request_grammar(body: Any, tool_choice: str = "none") -> Tuple[Optional[str], str]:
    """(the grammar of a chat or text completion request, the parameter to blame when it is invalid); (None, "")
    for free text. `tool_choice`: the effective one (`gateway.structured.tools.check_tools`)."""
    given: List[Tuple[str, Callable[[], Tuple[str, str]]]] = []
    if tool_choice not in ("none", "auto"):
        given.append(("tool_choice", functools.partial(_forced_call, body, tool_choice)))
    fmt = getattr(body, "response_format", None)
    if fmt is not None and fmt.type != "text":
        given.append(("response_format", functools.partial(_format, fmt)))
    guided = dict(_GUIDED)
    if (body.structured_outputs or {}).get("disable_additional_properties"):  # vLLM's: objects closed
        guided["json"] = functools.partial(_schema, close=True)
    for kind, build in guided.items():
        value = getattr(body, f"guided_{kind}", None)
        if value is not None:
            given.append((f"guided_{kind}", functools.partial(_guided, build, value, f"guided_{kind}")))
    for key, value in (body.structured_outputs or {}).items():
        param = f"structured_outputs.{key}"
        if key in _NO_OPS:
            if value is not None and value not in _NO_OPS[key]:
                raise bad_request(f"'{param}' is not supported by this gateway.", param=param)
        elif key == "json_object":
            if value:
                given.append((param, functools.partial(_guided, _any_object, value, param)))
        elif key in guided:
            if value is not None:
                given.append((param, functools.partial(_guided, guided[key], value, param)))
        else:
            raise bad_request(f"Unknown structured_outputs key '{key}'; one of {', '.join(STRUCTURED_OUTPUTS)}.",
                              param=param)
    if len(given) > 1:
        raise bad_request(f"Only one of response_format, a forced tool call and guided decoding may constrain the "
                          f"output; '{given[0][0]}' and '{given[1][0]}' are given.", param=given[1][0])
    if not given:
        return None, ""
    try:
        param, grammar = given[0][1]()
    except ValueError as e:
        raise bad_request(f"Invalid constraint: {e}", param=given[0][0]) from None
    return grammar, param


class GrammarTokens(Protocol):
    """What `check` needs of the gateway's tokenizer (`gateway.serving.tokens.Tokens`, which sits above this package):
    llguidance's view of it, built on first use (so on `check`'s worker thread, not the event loop)."""

    @property
    def grammar_tokenizer(self) -> GrammarTokenizer: ...


def check(tokens: GrammarTokens, grammar: str, param: str) -> None:
    """A 400 naming `param` when llguidance cannot use `grammar` with this tokenizer."""
    why = check_grammar(tokens.grammar_tokenizer, grammar)
    if why:
        raise bad_request(f"{param}: the constraint cannot be enforced: {why}", param=param)
