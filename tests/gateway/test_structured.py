"""Structured output (issue 23): `response_format` `json_object` / `json_schema` enforced while decoding through
llguidance (`swarm.client.decoding.grammar`, applied by `swarm.client.decoding.sampling.Sampler`).

Without a swarm: a sampler drawing from random logits under a schema's grammar always ends with a document that
parses and validates; schemas llguidance cannot enforce are refused. End to end: a real gateway over the test swarm
answers `json_schema` and `json_object` requests with documents that validate (greedy and sampled, n=2, streamed and
not), checked structurally against the schema, never against fixed text. Issue 39: closed and strict schemas'
grammars, sampled from random logits, never write an undeclared key (strict: never leave a declared one out), the
open grammar takes one; a strict `response_format` through the gateway has exactly the declared keys."""
from __future__ import annotations

import json
import re
from typing import Optional

import pytest
import torch
from jsonschema import Draft202012Validator

from gateway.schemas import ToolDefinition
from gateway.structured.toolparse import parse_all
from gateway.structured.tools import tool_grammar
from swarm.client.decoding.grammar import (
    GrammarConstraint,
    check_grammar,
    closed_schema,
    json_schema_grammar,
)
from swarm.client.decoding.sampling import Sampler, SamplingParams
from tests.fixtures.gateway_fixtures import client, gateway, one_torch_thread  # noqa: F401
from tests.fixtures.tool_calls import grammar_tokenizer  # noqa: F401  (a fixture)

MODEL = "smollm2-135m-instruct"

CAT = {  # every value bounded, so that random logits end the document in reasonable time
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 30},
        "colour": {"enum": ["black", "white", "ginger", "grey"]},
        "indoor": {"type": "boolean"},
        "toys": {"type": "array", "items": {"type": "string", "maxLength": 6}, "maxItems": 3},
    },
    "required": ["name", "age", "colour"],
    "additionalProperties": False,
}
NESTED = {
    "type": "object",
    "properties": {"owner": {"$ref": "#/$defs/person"}, "pets": {"type": "array", "maxItems": 2,
                                                                  "items": {"$ref": "#/$defs/person"}}},
    "required": ["owner", "pets"],
    "additionalProperties": False,
    "$defs": {"person": {"type": "object", "properties": {"id": {"type": "integer", "minimum": 1, "maximum": 99}},
                         "required": ["id"], "additionalProperties": False}},
}


def sample_document(tokenizer, grammar_tokenizer, schema, seed: int, greedy: bool = False, limit: int = 400,
                    grammar: Optional[str] = None):
    """Draw a document under `schema`'s grammar (or `grammar`) from random logits; returns its text."""
    constraint = GrammarConstraint(grammar_tokenizer, grammar or json_schema_grammar(schema))
    params = SamplingParams(max_tokens=limit, temperature=0 if greedy else 1.0, seed=seed)
    sampler = Sampler(params, 1, len(tokenizer), constraint=constraint)
    generator = torch.Generator().manual_seed(seed)
    ids = [1]
    for step in range(limit):
        choice = sampler.choose(torch.tensor(ids), torch.randn(len(tokenizer), generator=generator) * 3, limit - step)
        ids.append(choice.token_id)
        if constraint.complete:
            break
    assert constraint.complete, tokenizer.decode(ids[1:])
    return tokenizer.decode(ids[1:], skip_special_tokens=True)


@pytest.mark.parametrize("schema", [CAT, NESTED], ids=["cat", "refs"])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_sampled_documents_validate(tokenizer, grammar_tokenizer, schema, seed):
    text = sample_document(tokenizer, grammar_tokenizer, schema, seed, greedy=seed == 2)
    Draft202012Validator(schema).validate(json.loads(text))


LOOSE = {  # no additionalProperties anywhere, optional properties: JSON Schema lets other keys in
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 8},
        "size": {"type": "integer", "minimum": 0, "maximum": 9},
        "tags": {"type": "array", "maxItems": 2, "items": {"type": "object", "properties": {
            "k": {"type": "string", "maxLength": 4}, "v": {"type": "boolean"}}}},
        "owner": {"anyOf": [{"type": "object", "properties": {"id": {"type": "integer", "minimum": 0, "maximum": 9}},
                             "required": ["id"]}, {"type": "null"}]},
    },
    "required": ["name"],
}


def undeclared(value, schema, strict: bool) -> list:
    """The keys of `value` that `schema` does not declare (strict: also the declared ones missing), at any depth."""
    if isinstance(value, list):
        return [bad for item in value for bad in undeclared(item, schema.get("items", {}), strict)]
    if not isinstance(value, dict):
        return []
    schema = next((b for b in schema.get("anyOf", []) if b.get("type") == "object"), schema)
    declared = schema.get("properties", {})
    bad = [k for k in value if k not in declared] + ([k for k in declared if k not in value] if strict else [])
    return bad + [b for k, v in value.items() if k in declared for b in undeclared(v, declared[k], strict)]


@pytest.mark.parametrize("strict", [False, True], ids=["closed", "strict"])
@pytest.mark.parametrize("kind", ["response_format", "tool"])
def test_no_output_of_a_closed_grammar_has_an_undeclared_key(tokenizer, grammar_tokenizer, kind, strict):
    """Issue 39: documents drawn from random logits under the grammar of a schema that never says
    `additionalProperties` (as `response_format` and a forced call build it) have no key the schema does not
    declare, at any depth; with `strict` every declared key is there too. Each still validates against the schema."""
    tool = ToolDefinition(type="function", function={"name": "f", "parameters": LOOSE, "strict": strict})
    grammar = (json_schema_grammar(closed_schema(LOOSE, strict)) if kind == "response_format"
               else tool_grammar([tool], "f", parallel=False))
    for seed in range(6):
        text = sample_document(tokenizer, grammar_tokenizer, LOOSE, seed, limit=600, grammar=grammar)
        if kind == "tool":
            content, calls = parse_all(text, ["f"], stream_arguments=True)
            assert content is None and len(calls) == 1, text
            text = calls[0].function.arguments
        value = json.loads(text)
        Draft202012Validator(LOOSE).validate(value)
        assert not undeclared(value, LOOSE, strict), text


def test_closing_keeps_other_keys_out(tokenizer, grammar_tokenizer):
    """The open schema's grammar takes an undeclared key (so the test above could fail); the closed one refuses it at
    its first character; vLLM's guided_json keeps the open meaning. Strict schemas that cannot be strict are refused."""
    text = '{"name": "a", "zz": 1}'

    def takes(grammar: str) -> bool:
        constraint = GrammarConstraint(grammar_tokenizer, grammar)
        try:
            for token in tokenizer.encode(text, add_special_tokens=False):
                constraint.advance(token)
        except ValueError:
            return False
        return constraint.accepting

    assert takes(json_schema_grammar(LOOSE)) and not takes(json_schema_grammar(closed_schema(LOOSE)))
    assert closed_schema({"type": "object"}) == {"type": "object"}  # json_object: any object
    assert closed_schema({"type": "object"}, strict=True)["additionalProperties"] is False
    for bad in ({"type": "object", "properties": {"a": {"type": "string"}}, "additionalProperties": True},
                {"type": "object", "properties": {"a": {}}},
                {"allOf": [{"type": "object", "properties": {"a": {"type": "string"}}}]}):
        with pytest.raises(ValueError, match="strict"):
            closed_schema(bad, strict=True)


def test_unenforceable_schemas_are_refused(grammar_tokenizer):
    assert check_grammar(grammar_tokenizer, json_schema_grammar(CAT)) == ""
    assert check_grammar(grammar_tokenizer, json_schema_grammar({"type": "object", "dependentSchemas": {"a": {}}}))
    assert check_grammar(grammar_tokenizer, json_schema_grammar({"$ref": "#/$defs/missing"}))
    assert check_grammar(grammar_tokenizer, "start: (")


# ---- the app over a scripted model (which writes other text than the constraint allows) --------------------------
GUIDED = [  # (request fields, a check of the output text)
    ({"guided_choice": ["yes", "no way"]}, lambda t: t in ("yes", "no way")),
    ({"structured_outputs": {"choice": ["left", "right"]}}, lambda t: t in ("left", "right")),
    ({"guided_regex": "[a-c]{2,5}-[0-9]+"}, lambda t: re.fullmatch("[a-c]{2,5}-[0-9]+", t)),
    ({"guided_grammar": 'start: "x=" /[0-9]{1,3}/ ";"'}, lambda t: re.fullmatch("x=[0-9]{1,3};", t)),
    ({"guided_grammar": 'root ::= "v" [0-9] [0-9]'}, lambda t: re.fullmatch("v[0-9][0-9]", t)),  # GBNF
    ({"guided_json": CAT}, lambda t: Draft202012Validator(CAT).is_valid(json.loads(t))),
    ({"guided_json": json.dumps(NESTED)}, lambda t: Draft202012Validator(NESTED).is_valid(json.loads(t))),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "c", "schema": CAT}}},
     lambda t: Draft202012Validator(CAT).is_valid(json.loads(t))),
    ({"structured_outputs": {"json": LOOSE, "disable_additional_properties": True}},  # vLLM's: closed objects
     lambda t: Draft202012Validator(LOOSE).is_valid(json.loads(t)) and not undeclared(json.loads(t), LOOSE, False)),
]


@pytest.fixture(scope="module")
def scripted(tokenizer):
    from tests.fixtures.tool_calls import tool_app

    with tool_app(tokenizer, 'Sure! {"name": "Tom", "age": 3} is a cat, yes.') as client:
        yield client


@pytest.mark.parametrize("fields, ok", GUIDED, ids=lambda v: str(v)[:30] if isinstance(v, dict) else "")
@pytest.mark.parametrize("endpoint", ["/v1/chat/completions", "/v1/completions"])
def test_guided_decoding_is_enforced_on_both_endpoints(scripted, endpoint, fields, ok):
    base = ({"messages": [{"role": "user", "content": "hi"}]} if endpoint == "/v1/chat/completions"
            else {"prompt": "Answer:"})
    for extra in ({"temperature": 0}, {"temperature": 1.0, "seed": 3, "n": 2}):
        r = scripted.post(endpoint, json={"model": "fake", "max_tokens": 150, **base, **fields, **extra})
        assert r.status_code == 200, r.text
        for choice in r.json()["choices"]:
            text = choice["message"]["content"] if "message" in choice else choice["text"]
            assert choice["finish_reason"] == "stop" and ok(text), text


@pytest.mark.parametrize("fields, param", [
    ({"guided_choice": ["a"], "guided_regex": "a"}, "guided_choice"),  # the second in gateway.structured.grammars's
    # order
    ({"structured_outputs": {"json_object": True}, "guided_regex": "a"}, "structured_outputs.json_object"),
    ({"response_format": {"type": "json_object"}, "guided_json": {}}, "guided_json"),
    ({"guided_regex": "("}, "guided_regex"),
    ({"guided_choice": []}, "guided_choice"),
    ({"guided_json": "{not json"}, "guided_json"),
    ({"guided_grammar": "start: ("}, "guided_grammar"),
    ({"structured_outputs": {"xml": "x"}}, "structured_outputs.xml"),
    ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs.choice"),
    ({"structured_outputs": {"whitespace_pattern": " "}}, "structured_outputs.whitespace_pattern"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "c", "schema": {"$ref": "#/nope"}}}},
     "response_format.json_schema.schema"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "c", "strict": True, "schema": {
        "type": "object", "properties": {"a": {"type": "string"}}, "additionalProperties": True}}}},
     "response_format.json_schema.schema"),  # strict, but other keys allowed
])
def test_bad_constraints_are_400s(scripted, fields, param):
    for endpoint, base in (("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}),
                           ("/v1/completions", {"prompt": "a"})):
        r = scripted.post(endpoint, json={"model": "fake", "max_tokens": 5, **base, **fields})
        assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text


# ---- end to end -------------------------------------------------------------------------------------------------
def _schema_format(schema):
    return {"type": "json_schema", "json_schema": {"name": "cat", "schema": schema, "strict": True}}


MESSAGES = [{"role": "user", "content": "Describe a cat as JSON: its name, age and colour."}]


@pytest.mark.parametrize("sampling", [dict(temperature=0), dict(temperature=1.0, seed=11, n=2)], ids=["greedy", "n2"])
def test_json_schema_output_validates(client, sampling):
    r = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=120,
                                       response_format=_schema_format(CAT), **sampling)
    assert len(r.choices) == sampling.get("n", 1)
    for choice in r.choices:
        assert choice.finish_reason == "stop", choice
        Draft202012Validator(CAT).validate(json.loads(choice.message.content))
    streamed = ""
    for chunk in client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=120, stream=True,
                                                response_format=_schema_format(CAT), **{**sampling, "n": 1}):
        streamed += "".join(c.delta.content or "" for c in chunk.choices if c.index == 0)
    assert streamed == r.choices[0].message.content


def test_json_schema_with_refs_and_json_object(client):
    r = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=120, temperature=0,
                                       response_format=_schema_format(NESTED))
    assert r.choices[0].finish_reason == "stop"
    Draft202012Validator(NESTED).validate(json.loads(r.choices[0].message.content))
    r = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=200, temperature=0,
                                       response_format={"type": "json_object"})
    if r.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(r.choices[0].message.content), dict)
    else:  # cut by max_tokens: a prefix of an object, as OpenAI's
        assert r.choices[0].finish_reason == "length" and r.choices[0].message.content.startswith("{")


def test_unenforceable_schema_is_a_400(client):
    import openai

    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=5, response_format=_schema_format(
            {"type": "object", "dependentSchemas": {"a": {}}}))
    assert info.value.body["param"] == "response_format.json_schema.schema"


def test_strict_json_schema_has_every_property_and_no_other(client):
    """Issue 39: `response_format` `json_schema` with `strict` and a schema that requires nothing and leaves other
    keys open: the document has exactly the declared properties, streamed and whole alike."""
    from tests.fixtures.tool_calls import FORECAST, both_ways

    schema = FORECAST["function"]["parameters"]
    got = both_ways(client, model=MODEL, messages=[{"role": "user", "content": "Forecast for Paris as JSON."}],
                    max_tokens=60, temperature=0, response_format={"type": "json_schema", "json_schema": {
                        "name": "forecast", "schema": schema, "strict": True}})
    assert got["finish_reason"] == "stop" and not got["tool_calls"], got
    value = json.loads(got["content"])
    Draft202012Validator(schema).validate(value)
    assert set(value) == set(schema["properties"]), value
