"""Tool calling (issue 23): tools in the prompt, tool calls parsed from the output and streamed, forced calls.

Without a swarm: the Hermes rendering of tools and of a tool-call history (`gateway.structured.tools`), the parser fed
the same text whole or in any split (`gateway.structured.toolparse`), a template that renders tools itself getting them,
and the in-process app over a scripted model (calls in `message.tool_calls`, `finish_reason: "tool_calls"`, the streamed
shape). End to end, on a real gateway over the test swarm with the bundled model: a named function and `required`
are forced by the grammar (the call's arguments validate against the function's schema; `parallel_tool_calls: false`
gives exactly one call), streamed calls reassemble to the non-streamed ones, and a history carrying tool calls and
tool results is answered. Issue 39: forced calls cut anywhere (max_tokens, a stop string) come back as partial calls,
never markup, the same whole and streamed (the parser at every cut point; the real gateway compared field by field);
after a call the grammar allows only the end or the opening tag (one call where the newline made repeats); strict
functions get every declared property and no other, unstrictable ones are 400s. Outputs are checked structurally,
never against fixed text."""
from __future__ import annotations

import json
import random

import pytest
from jsonschema import Draft202012Validator

from gateway.schemas import ChatMessage, ToolDefinition
from gateway.structured.toolparse import ToolCallParser, parse_all
from gateway.structured.tools import CALL_OPEN, call_text, render_messages, tool_grammar
from swarm.client.decoding.grammar import GrammarConstraint, closed_schema, json_schema_grammar
from tests.fixtures import openai_schemas as oas
from tests.fixtures.gateway_fixtures import client, gateway, one_torch_thread  # noqa: F401
from tests.fixtures.openai_checks import sse, validate
from tests.fixtures.tool_calls import (  # noqa: F401  (grammar_tokenizer: a fixture)
    ASK,
    FORECAST,
    SCRIPT,
    TIME,
    TOOLS,
    WEATHER,
    both_ways,
    grammar_tokenizer,
    tool_app,
    tool_body,
)

MODEL = "smollm2-135m-instruct"
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}


# ---- prompt side ----------------------------------------------------------------------------------------------------
def test_hermes_rendering_of_tools_and_history():
    tools = [ToolDefinition(**WEATHER)]
    history = [ChatMessage(role="user", content="weather in Paris?"),
               ChatMessage(role="assistant", content=None, tool_calls=[
                   {"id": "call_1", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]),
               ChatMessage(role="tool", tool_call_id="call_1", content="21 C"),
               ChatMessage(role="tool", tool_call_id="call_2", content="sunny")]
    texts = [m.content or "" for m in history]
    out = render_messages(history, texts, tools, native=False)
    assert [m["role"] for m in out] == ["system", "user", "assistant", "user"]
    assert '"name": "get_weather"' in out[0]["content"] and "<tools>" in out[0]["content"]
    assert out[2]["content"] == call_text("get_weather", {"city": "Paris"})
    assert out[3]["content"].count("<tool_response>") == 2 and "21 C" in out[3]["content"]
    system = render_messages([ChatMessage(role="system", content="Be brief.")] + history[:1], ["Be brief.", "x"],
                             tools, native=False)
    assert system[0]["content"].startswith("Be brief.") and "<tools>" in system[0]["content"]
    native = render_messages(history, texts, tools, native=True)
    assert native[1]["tool_calls"][0]["function"]["arguments"] == {"city": "Paris"}
    assert native[2] == {"role": "tool", "content": "21 C", "tool_call_id": "call_1"}


def test_a_template_that_renders_tools_gets_them(tokenizer):
    from gateway.serving.tokens import Tokens

    tokens = Tokens(tokenizer, [2])
    template = tokenizer.chat_template
    try:
        tokenizer.chat_template = ("{% for t in tools %}TOOL:{{ t.function.name }};{% endfor %}"
                                   "{% for m in messages %}{{ m.role }}:{{ m.content }}|{% endfor %}")
        ids = tokens.chat_prompt([ChatMessage(role="user", content="hi")], tools=[ToolDefinition(**TIME)])
    finally:
        tokenizer.chat_template = template
    assert tokenizer.decode(ids) == "TOOL:get_time;user:hi|"


# ---- parsing ------------------------------------------------------------------------------------------------------
TEXT = ('Let me look. <tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris </tool_call>", '
        '"unit": "celsius"}}\n</tool_call>\n<tool_call>\n{"name": "nope", "arguments": {}}\n</tool_call>'
        '<tool_call>\n{"name": "get_time", "arguments": {"timezone": "UTC"}}')  # the last block is never closed


def test_parser_whole_and_streamed_agree():
    content, calls = parse_all(TEXT, SCHEMAS)
    assert [c.function.name for c in calls] == ["get_weather", "get_time"]
    assert json.loads(calls[0].function.arguments)["city"] == "Paris </tool_call>"  # a tag inside a string
    assert content.startswith("Let me look.") and '"nope"' in content  # unknown function: left as content
    assert all(c.id.startswith("call_") for c in calls)
    rng = random.Random(0)
    for _ in range(30):
        cuts = sorted(rng.sample(range(1, len(TEXT)), 12))
        parser = ToolCallParser(SCHEMAS)
        parts = [parser.feed(TEXT[a:b]) for a, b in zip([0] + cuts, cuts + [len(TEXT)])] + [parser.finish()]
        assert "".join(p.content for p in parts) == content
        assert [(c.function.name, c.function.arguments) for p in parts for c in p.calls] == \
               [(c.function.name, c.function.arguments) for c in calls]
    _, one = parse_all(TEXT, SCHEMAS, max_calls=1)
    assert len(one) == 1
    assert parse_all("plain answer", SCHEMAS) == ("plain answer", [])


FORCED = ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Pa}ris", "unit": "celsius"}}\n</tool_call>\n'
          '<tool_call>\n{"name": "get_time", "arguments": {"timezone": "UTC"}}\n</tool_call>')


def test_forced_calls_stream_their_arguments_fragment_by_fragment():
    """A forced call (the grammar guarantees it) streams its arguments as they come: the fragments join to exactly
    the arguments of the whole answer, which are the generated text, and the block's closing brace is never sent."""
    content, calls = parse_all(FORCED, SCHEMAS, stream_arguments=True)
    assert content is None and [json.loads(c.function.arguments) for c in calls] == [
        {"city": "Pa}ris", "unit": "celsius"}, {"timezone": "UTC"}]
    rng = random.Random(1)
    for _ in range(30):
        cuts = sorted(rng.sample(range(1, len(FORCED)), 20))
        parser = ToolCallParser(SCHEMAS, stream_arguments=True)
        parts = [parser.feed(FORCED[a:b]) for a, b in zip([0] + cuts, cuts + [len(FORCED)])] + [parser.finish()]
        pieces = [p for part in parts for p in part.chunks]
        assert not "".join(part.content for part in parts)
        for index, call in enumerate(calls):
            mine = [p for p in pieces if p.index == index]
            assert mine[0].id.startswith("call_") and mine[0].function.name == call.function.name
            assert all(p.id is None and p.function.name is None for p in mine[1:])
            assert "".join(p.function.arguments for p in mine) == call.function.arguments
    parser = ToolCallParser(SCHEMAS, stream_arguments=True)  # token by token (here: character by character)
    pieces = [p for char in FORCED for p in parser.feed(char).chunks] + parser.finish().chunks
    for index, call in enumerate(calls):
        fragments = [p.function.arguments for p in pieces if p.index == index and p.id is None]
        assert len(fragments) > 5 and "".join(fragments) == call.function.arguments


CUT = call_text("get_weather", {"city": "Paris", "unit": "celsius"}) + call_text("get_time", {"timezone": "UTC"})


def _assembled(parts):
    """(content, [[id, name, arguments] per call index]) of a stream's parsed pieces."""
    calls: dict = {}
    for part in parts:
        for piece in part.chunks:
            entry = calls.setdefault(piece.index, [None, "", ""])
            if piece.id is not None:
                assert entry[0] is None and piece.id.startswith("call_")
                entry[0] = piece.id
            entry[1] += piece.function.name or ""
            entry[2] += piece.function.arguments or ""
    return "".join(part.content for part in parts), [calls[i] for i in sorted(calls)]


@pytest.mark.parametrize("names", [SCHEMAS, ["get_weather", "get_time"][:1]], ids=["required", "named"])
def test_forced_calls_cut_anywhere_are_partial_calls(names):
    """Issue 39: forced output cut after any character (max_tokens) is never markup as content but the calls so far,
    the last one partial (its arguments a prefix of the whole call's), the same whole and streamed piece by piece;
    the name is known from the first character when one tool is forced, once the header tells them apart else."""
    text = CUT if len(names) > 1 else CUT[:CUT.index("<tool_call>", 1)]
    _, full = parse_all(text, names, stream_arguments=True)
    for cut in range(1, len(text) + 1):
        content, calls = parse_all(text[:cut], names, stream_arguments=True)
        assert content is None and calls, (cut, content)
        parser = ToolCallParser(names, stream_arguments=True)
        streamed = _assembled([parser.feed(char) for char in text[:cut]] + [parser.finish()])
        assert streamed[0] == "" and [c[1:] for c in streamed[1]] == \
               [[c.function.name, c.function.arguments] for c in calls], cut
        last, whole = calls[-1], full[len(calls) - 1]
        assert whole.function.arguments.startswith(last.function.arguments), (cut, last)
        assert last.function.name in ("", whole.function.name), (cut, last)
        opened = text[:cut].count(CALL_OPEN) == len(calls)  # (else the last call's opening tag is cut)
        body = text[:cut].rsplit(CALL_OPEN, 1)[-1].lstrip() if opened else ""
        if len(names) == 1 or len(body) > len('{"name": "get_'):  # (past where get_weather and get_time part)
            assert last.function.name == whole.function.name, (cut, last)
    assert [(c.function.name, c.function.arguments) for c in parse_all(text, names, stream_arguments=True)[1]] == \
           [(c.function.name, c.function.arguments) for c in full]
    _, one = parse_all(CUT[:CUT.index("<tool_call>", 1) + 3], SCHEMAS, max_calls=1, stream_arguments=True)
    assert len(one) == 1 and json.loads(one[0].function.arguments)["city"] == "Paris"


@pytest.mark.parametrize("parallel", [True, False], ids=["parallel", "one"])
def test_after_a_forced_call_only_the_end_or_the_opening_tag(tokenizer, grammar_tokenizer, parallel):
    """Issue 39: after a call, `required` allows the end of the turn and, with parallel calls, the opening tag of
    another call right away: not the newline the model writes there (which meant prose), nor anything else."""
    tools = [ToolDefinition(**t) for t in TOOLS]
    constraint = GrammarConstraint(grammar_tokenizer, tool_grammar(tools, "required", parallel))
    for token in tokenizer.encode(call_text("get_time", {"timezone": "UTC"}), add_special_tokens=False):
        constraint.advance(token)
    allowed = constraint.mask().nonzero().flatten().tolist()
    assert tokenizer.eos_token_id in allowed and tokenizer.encode("\n", add_special_tokens=False)[0] not in allowed
    others = [tokenizer.decode([t]) for t in allowed if t != tokenizer.eos_token_id]
    assert (others and all((CALL_OPEN + "\n").startswith(t) for t in others)) if parallel else not others, others


# ---- the app over a scripted model ----------------------------------------------------------------------------------


def test_fake_app_tool_calls_whole_and_streamed(tokenizer):
    client = tool_app(tokenizer)
    r = client.post("/v1/chat/completions", json=tool_body())
    assert r.status_code == 200, r.text
    validate(oas.CHAT_COMPLETION, r.json())
    choice = r.json()["choices"][0]
    assert choice["finish_reason"] == "tool_calls" and choice["message"]["content"] == "Checking."
    calls = choice["message"]["tool_calls"]
    assert [c["function"]["name"] for c in calls] == ["get_weather", "get_time"]
    for call in calls:
        Draft202012Validator(SCHEMAS[call["function"]["name"]]).validate(json.loads(call["function"]["arguments"]))
    chunks = sse(client, "/v1/chat/completions", tool_body())
    got: dict = {}
    for chunk in chunks:
        validate(oas.CHAT_COMPLETION_CHUNK, chunk)
        for piece in chunk["choices"][0]["delta"].get("tool_calls", []):
            entry = got.setdefault(piece["index"], {"name": "", "arguments": "", "id": None})
            if "id" in piece:
                assert entry["id"] is None and piece["type"] == "function" and piece["function"]["name"]
                entry["id"], entry["name"] = piece["id"], piece["function"]["name"]
            entry["arguments"] += piece.get("function", {}).get("arguments", "")
    assert [(g["name"], g["arguments"]) for _, g in sorted(got.items())] == \
           [(c["function"]["name"], c["function"]["arguments"]) for c in calls]
    assert chunks[-1]["choices"][0]["finish_reason"] == "tool_calls"
    one = client.post("/v1/chat/completions", json=tool_body(parallel_tool_calls=False)).json()
    assert len(one["choices"][0]["message"]["tool_calls"]) == 1
    none = client.post("/v1/chat/completions", json=tool_body(tool_choice="none")).json()["choices"][0]
    assert "tool_calls" not in none["message"] and CALL_OPEN in none["message"]["content"]


def test_fake_app_forced_call_cut_by_a_stop_string_or_the_limit(tokenizer):
    """A forced call cut short comes back as a partial call, streamed and whole alike: by `max_tokens` with
    `finish_reason: "length"`, by a stop string with `stop` (not `tool_calls`: the call is not whole)."""
    client = tool_app(tokenizer, SCRIPT[len("Checking. "):])
    forced = tool_body(tool_choice={"type": "function", "function": {"name": "get_weather"}})
    for extra, reason, arguments in (({"stop": ["Paris"]}, "stop", '{"city": "'),
                                     ({"max_tokens": 3}, "length", ""), ({}, "tool_calls", None)):
        whole = client.post("/v1/chat/completions", json={**forced, **extra}).json()["choices"][0]
        chunks = sse(client, "/v1/chat/completions", {**forced, **extra})
        streamed = [p for c in chunks for p in c["choices"][0]["delta"].get("tool_calls", []) if c["choices"]]
        assert whole["finish_reason"] == chunks[-1]["choices"][0]["finish_reason"] == reason, whole
        assert whole["message"]["content"] is None and len(whole["message"]["tool_calls"]) == 1, whole
        call = whole["message"]["tool_calls"][0]["function"]
        assert call["name"] == streamed[0]["function"]["name"] == "get_weather"
        assert call["arguments"] == "".join(p["function"]["arguments"] for p in streamed)
        assert call["arguments"] == arguments if arguments is not None else json.loads(call["arguments"])["unit"]


def test_strict_schemas_that_cannot_be_strict_are_400s(tokenizer):
    """A `strict` function whose schema lets other keys in (or has an untyped property) is a 400 naming its
    parameters, whatever the tool_choice, as OpenAI checks strict schemas."""
    client = tool_app(tokenizer)
    for parameters in ({"type": "object", "properties": {"a": {"type": "string"}}, "additionalProperties": True},
                       {"type": "object", "properties": {"a": {"description": "anything"}}}):
        tool = {"type": "function", "function": {"name": "f", "parameters": parameters, "strict": True}}
        for choice in ("auto", "required"):
            r = client.post("/v1/chat/completions", json=tool_body(tools=[TIME, tool], tool_choice=choice))
            assert r.status_code == 400 and r.json()["error"]["param"] == "tools.1.function.parameters", r.text


# ---- end to end on the bundled model ----------------------------------------------------------------------------
def _check_calls(message, allowed):
    assert message.tool_calls, message
    for call in message.tool_calls:
        assert call.id.startswith("call_") and call.type == "function" and call.function.name in allowed
        Draft202012Validator(SCHEMAS[call.function.name]).validate(json.loads(call.function.arguments))


@pytest.mark.parametrize("sampling", [dict(temperature=0), dict(temperature=1.0, seed=5)], ids=["greedy", "sampled"])
def test_named_function_is_forced(client, sampling):
    choice = {"type": "function", "function": {"name": "get_time"}}
    r = client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, tool_choice=choice, max_tokens=80,
                                       **sampling)
    assert r.choices[0].finish_reason == "tool_calls"
    _check_calls(r.choices[0].message, {"get_time"})
    assert len(r.choices[0].message.tool_calls) == 1
    validate(oas.CHAT_COMPLETION, r.model_dump(exclude_unset=True))


def test_required_calls_one_of_the_tools(client):
    r = client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, tool_choice="required",
                                       parallel_tool_calls=False, max_tokens=80, temperature=0.8, seed=2, n=2)
    for choice in r.choices:
        assert choice.finish_reason == "tool_calls"
        _check_calls(choice.message, set(SCHEMAS))
        assert len(choice.message.tool_calls) == 1


def test_streamed_forced_call_matches_the_whole_one(client):
    kwargs = dict(model=MODEL, messages=ASK, tools=TOOLS, tool_choice="required", parallel_tool_calls=False,
                  max_tokens=120, temperature=0)
    whole = client.chat.completions.create(**kwargs)
    _check_calls(whole.choices[0].message, set(SCHEMAS))
    calls: dict = {}
    finish, fragments = None, 0
    for chunk in client.chat.completions.create(stream=True, **kwargs):
        validate(oas.CHAT_COMPLETION_CHUNK, chunk.model_dump(exclude_unset=True))
        for c in chunk.choices:
            finish = c.finish_reason or finish
            for piece in c.delta.tool_calls or []:
                entry = calls.setdefault(piece.index, ["", ""])
                entry[0] += piece.function.name or "" if piece.function else ""
                entry[1] += piece.function.arguments or "" if piece.function else ""
                fragments += bool(piece.function and piece.function.arguments)
    expected = [[c.function.name, c.function.arguments] for c in whole.choices[0].message.tool_calls]
    assert whole.choices[0].finish_reason == finish == "tool_calls"
    assert [calls[i] for i in sorted(calls)] == expected
    assert fragments > 1  # a forced call's arguments stream as they are generated


def test_history_with_tool_calls_and_results(client):
    messages = ASK + [
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_abc", "type": "function",
             "function": {"name": "get_weather", "arguments": json.dumps({"city": "Paris", "unit": "celsius"})}}]},
        {"role": "tool", "tool_call_id": "call_abc", "content": json.dumps({"temperature": 21, "sky": "clear"})},
    ]
    r = client.chat.completions.create(model=MODEL, messages=messages, tools=TOOLS, max_tokens=40, temperature=0)
    validate(oas.CHAT_COMPLETION, r.model_dump(exclude_unset=True))
    message = r.choices[0].message
    assert message.content or message.tool_calls
    if message.tool_calls:  # auto: whatever the model chose, a parsed call names a tool and has object arguments
        assert r.choices[0].finish_reason in ("tool_calls", "length")
        for call in message.tool_calls:
            assert call.function.name in SCHEMAS and isinstance(json.loads(call.function.arguments), dict)


# ---- issue 39 end to end: cut calls, repeated calls, strict schemas ------------------------------------------------
PARIS = [{"role": "user", "content": "What is the weather in Paris?"}]
NOW = {"type": "function", "function": {"name": "get_time_now", "description": "The current time",
                                        "parameters": {"type": "object", "properties": {}}}}


@pytest.mark.parametrize("choice", ["required", "named"])
def test_forced_call_cut_by_max_tokens_is_a_partial_call(client, tokenizer, grammar_tokenizer, choice):
    """Issue 39's request (get_weather only, `required`, one call) and a named function among two tools: cut by
    max_tokens, the answer is a `tool_calls` entry with the function's name and the arguments generated so far (text
    the function's grammar takes as a beginning), `finish_reason: "length"`, no content, streamed and whole alike."""
    named = {"type": "function", "function": {"name": "get_weather"}}
    base = dict(model=MODEL, messages=PARIS, temperature=0, tools=[WEATHER] if choice == "required" else TOOLS,
                tool_choice="required" if choice == "required" else named, parallel_tool_calls=False)
    for cut in (3, 24) if choice == "required" else (8,):
        got = both_ways(client, max_tokens=cut, **base)
        assert got["finish_reason"] == "length" and got["content"] is None and got["completion_tokens"] == cut
        assert len(got["tool_calls"]) == 1 and got["tool_calls"][0][0] == "get_weather", got
        arguments = got["tool_calls"][0][1]
        constraint = GrammarConstraint(grammar_tokenizer, json_schema_grammar(closed_schema(SCHEMAS["get_weather"])))
        for token in tokenizer.encode(arguments, add_special_tokens=False):
            constraint.advance(token)  # (ValueError where the text leaves the schema)
        assert bool(arguments) == (cut == 24), got  # 24 tokens reach past the markup into the arguments


def test_required_with_parallel_calls_calls_once(client):
    """Issue 39: `required` with parallel calls allowed and a tool without arguments: the model's newline after the
    call no longer starts another one (it made eight identical calls); one call, ended by the model."""
    got = both_ways(client, model=MODEL, messages=[{"role": "user", "content": "What time is it?"}], tools=[NOW],
                    tool_choice="required", max_tokens=60, temperature=0)
    assert got["finish_reason"] == "tool_calls" and got["tool_calls"] == [["get_time_now", "{}"]], got


@pytest.mark.parametrize("strict", [True, False], ids=["strict", "closed"])
def test_strict_tool_arguments_have_every_property_and_no_other(client, strict):
    """A forced call to a function whose schema requires nothing and leaves other keys open: with `strict` the
    arguments have exactly the declared properties (OpenAI's strict mode); without, no undeclared key."""
    tool = {"type": "function", "function": {**FORECAST["function"], "strict": strict}}
    got = both_ways(client, model=MODEL, messages=PARIS, tools=[tool], max_tokens=60, temperature=0,
                    tool_choice={"type": "function", "function": {"name": "get_forecast"}})
    assert got["finish_reason"] == "tool_calls" and len(got["tool_calls"]) == 1, got
    value = json.loads(got["tool_calls"][0][1])
    Draft202012Validator(FORECAST["function"]["parameters"]).validate(value)
    declared = set(FORECAST["function"]["parameters"]["properties"])
    assert set(value) == declared if strict else set(value) <= declared, value
