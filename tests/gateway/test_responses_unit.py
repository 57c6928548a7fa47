"""The Responses API (`gateway.responses`) in process, over the scripted fake model of
tests/fixtures/fake_model.py (no swarm): every Response object and stream event validates against OpenAI's schemas
(tests/fixtures/openai_responses_schemas.py), streamed and whole responses agree, tools / text.format /
previous_response_id / store behave, and bad requests are 400s naming the parameter. The real swarm, the `openai` SDK
and the Agents SDK: tests/gateway/test_responses.py."""
from __future__ import annotations

import json
from typing import Any, Dict, List, Tuple

import pytest
from jsonschema import Draft202012Validator

from tests.fixtures import openai_responses_schemas as ors
from tests.fixtures import openai_schemas as oas
from tests.fixtures.fake_model import fake_app  # noqa: F401  (the in-process app over a fake model)
from tests.fixtures.gateway_fixtures import one_torch_thread  # noqa: F401  (autouse: one torch thread in this module)
from tests.fixtures.openai_checks import check, check_event, validate

UNIT = {"type": "string", "enum": ["celsius", "fahrenheit"]}
TOOLS = [{"type": "function", "name": "get_weather", "description": "The weather in a city", "strict": True,
          "parameters": {"type": "object", "properties": {"city": {"type": "string"}, "unit": UNIT},
                         "required": ["city", "unit"], "additionalProperties": False}},
         {"type": "function", "name": "get_time", "parameters": {
             "type": "object", "properties": {"timezone": {"type": "string"}}, "required": ["timezone"]}}]
CAT = {"type": "object", "properties": {"name": {"type": "string"}}, "required": ["name"],
       "additionalProperties": False}


@pytest.fixture(scope="module")
def app(tokenizer):
    from tests.fixtures.tool_calls import tool_app

    with tool_app(tokenizer) as client:  # "Checking." then two <tool_call> blocks (tests/fixtures/tool_calls.py SCRIPT)
        yield client


def body(**extra: Any) -> Dict[str, Any]:
    return {"model": "fake", "input": "What is the weather like in Paris today?", "max_output_tokens": 80,
            "temperature": 0, **extra}


def stream(client, request: Dict[str, Any]) -> List[Dict[str, Any]]:
    """The events of a streamed response (each `event:` line names its data's type; no [DONE])."""
    with client.stream("POST", "/v1/responses", json={**request, "stream": True}) as r:
        assert r.status_code == 200, r.read()
        assert r.headers["content-type"].startswith("text/event-stream")
        lines = [line for line in r.iter_lines() if line]
    names = [line[7:] for line in lines if line.startswith("event: ")]
    events = [json.loads(line[6:]) for line in lines if line.startswith("data: ")]
    assert names == [e["type"] for e in events]
    return events


def check_stream(events: List[Dict[str, Any]]) -> Dict[str, Any]:
    """Validate every event and the stream's order; returns the final Response."""
    for event in events:
        check_event(event)
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    assert [e["type"] for e in events[:2]] == ["response.created", "response.in_progress"]
    assert events[-1]["type"] in ("response.completed", "response.incomplete", "response.failed")
    deltas: Dict[Tuple[int, str], str] = {}
    for e in events:
        if e["type"] in ("response.output_text.delta", "response.function_call_arguments.delta"):
            deltas[(e["output_index"], e["type"])] = deltas.get((e["output_index"], e["type"]), "") + e["delta"]
        elif e["type"] == "response.output_text.done":
            assert deltas.get((e["output_index"], "response.output_text.delta"), "") == e["text"]
        elif e["type"] == "response.function_call_arguments.done":
            assert deltas.get((e["output_index"], "response.function_call_arguments.delta"), "") == e["arguments"]
    final = events[-1]["response"]
    done = [e["item"] for e in events if e["type"] == "response.output_item.done"]
    assert final["output"] == done
    return final


def shape(response: Dict[str, Any]) -> List[Tuple[str, ...]]:
    """A response's output without ids: (message, text) and (function_call, name, arguments) items."""
    return [("message", "".join(p["text"] for p in item["content"])) if item["type"] == "message"
            else ("function_call", item["name"], item["arguments"]) for item in response["output"]]


def test_schemas_reject_what_the_spec_rejects():
    good = {"id": "resp_1", "object": "response", "created_at": 1, "error": None, "incomplete_details": None,
            "instructions": None, "model": "m", "tools": [], "output": [], "parallel_tool_calls": True,
            "metadata": {}, "tool_choice": "auto", "temperature": 1, "top_p": 1}
    validate(ors.RESPONSE, good)  # (checks the schema against the meta-schema, as below)
    for schema in (ors.STREAM_EVENT, *ors.STREAM_EVENTS.values()):
        Draft202012Validator.check_schema(schema)
    validator = Draft202012Validator(ors.RESPONSE)
    for broken in ({k: v for k, v in good.items() if k != "error"}, {**good, "status": "done"},
                   {**good, "user": None}, {**good, "output": [{"type": "message", "id": "m", "role": "assistant"}]},
                   {**good, "usage": {"input_tokens": 1, "output_tokens": 1, "total_tokens": 2}},
                   {**good, "error": {"code": "swarm_error", "message": "x"}}):
        assert not validator.is_valid(broken), broken
    events = Draft202012Validator(ors.STREAM_EVENT)
    delta = {"type": "response.output_text.delta", "item_id": "m", "output_index": 0, "content_index": 0,
             "delta": "x", "logprobs": [], "sequence_number": 3}
    assert events.is_valid(delta)
    assert not events.is_valid({k: v for k, v in delta.items() if k != "logprobs"})
    assert not events.is_valid({k: v for k, v in delta.items() if k != "sequence_number"})
    assert not events.is_valid({**delta, "type": "response.text.delta"})


@pytest.mark.parametrize("extra", [
    {}, {"tool_choice": "none"}, {"tool_choice": "required"}, {"parallel_tool_calls": False},
    {"tool_choice": {"type": "function", "name": "get_time"}},
    {"instructions": "Be brief.", "input": [{"role": "developer", "content": "Use tools."}, {
        "type": "message", "role": "user", "content": [{"type": "input_text", "text": "Weather in Paris?"}]}]},
    {"text": {"format": {"type": "json_schema", "name": "cat", "schema": CAT, "strict": True}}, "tools": None},
    {"metadata": {"k": "v"}, "user": "u1", "store": False, "max_output_tokens": 16},
], ids=lambda v: json.dumps(v)[:48])
def test_responses_and_events_validate_and_agree(app, extra):
    request = {k: v for k, v in {**body(tools=TOOLS), **extra}.items() if v is not None}
    r = app.post("/v1/responses", json=request)
    assert r.status_code == 200, r.text
    whole = r.json()
    check(ors.RESPONSE, whole)
    final = check_stream(stream(app, request))
    assert shape(final) == shape(whole) and final["usage"] == whole["usage"]
    assert whole["status"] == ("incomplete" if extra.get("max_output_tokens") == 16 else "completed")
    calls = [item for item in whole["output"] if item["type"] == "function_call"]
    choice = extra.get("tool_choice", "auto")
    if choice == "none" or "text" in extra:
        assert not calls
    elif isinstance(choice, dict):
        assert [c["name"] for c in calls] == ["get_time"]
    elif extra.get("parallel_tool_calls") is False:
        assert len(calls) == 1
    elif choice == "required":  # the grammar forces calls where the script would write text first
        assert calls and whole["output"][0]["type"] == "function_call"
    elif "max_output_tokens" not in extra:
        assert [c["name"] for c in calls] == ["get_weather", "get_time"]
    for call in calls:
        json.loads(call["arguments"])
        assert call["call_id"].startswith("call_") and call["status"] == "completed"
    assert whole["metadata"] == extra.get("metadata", {}) and whole.get("user") == extra.get("user")
    assert whole["store"] is extra.get("store", True)
    usage = whole["usage"]
    assert usage["total_tokens"] == usage["input_tokens"] + usage["output_tokens"] > 0
    assert usage["output_tokens_details"]["reasoning_tokens"] == 0


def test_json_schema_output_is_forced(tokenizer):
    from tests.fixtures.tool_calls import tool_app

    request = {"model": "fake", "input": "A cat", "max_output_tokens": 24,
               "text": {"format": {"type": "json_schema", "name": "cat", "schema": CAT, "strict": True}}}
    with tool_app(tokenizer, '{"name": "Tom"}') as client:
        out = client.post("/v1/responses", json=request).json()
        check(ors.RESPONSE, out)
        assert json.loads(out["output"][0]["content"][0]["text"]) == {"name": "Tom"}
        assert out["text"]["format"]["name"] == "cat"


def test_previous_response_id_store_get_delete(fake_app):
    client, _ = fake_app(text="Hello there.", api_keys=["key-a", "key-b"])
    a, b = ({"Authorization": f"Bearer {k}"} for k in ("key-a", "key-b"))
    first = client.post("/v1/responses", json={"model": "fake", "input": "Hi", "max_output_tokens": 16}, headers=a)
    assert first.status_code == 200, first.text
    rid = first.json()["id"]
    assert client.get(f"/v1/responses/{rid}", headers=a).json() == first.json()
    assert client.get(f"/v1/responses/{rid}", headers=b).status_code == 404  # another key's
    second = client.post("/v1/responses", headers=a, json={
        "model": "fake", "input": "And then?", "previous_response_id": rid, "max_output_tokens": 16})
    assert second.status_code == 200 and second.json()["previous_response_id"] == rid
    grew = second.json()["usage"]["input_tokens"] - first.json()["usage"]["input_tokens"]
    assert grew > first.json()["usage"]["output_tokens"]  # the first turn's input and output came first
    r = client.post("/v1/responses", headers=b, json={"model": "fake", "input": "x", "previous_response_id": rid})
    assert r.status_code == 400 and r.json()["error"]["code"] == "previous_response_not_found"
    assert client.delete(f"/v1/responses/{rid}", headers=b).status_code == 404
    assert client.delete(f"/v1/responses/{rid}", headers=a).json() == {"id": rid, "object": "response",
                                                                       "deleted": True}
    validate(oas.ERROR_RESPONSE, client.get(f"/v1/responses/{rid}", headers=a).json())
    unstored = client.post("/v1/responses", headers=a, json={"model": "fake", "input": "Hi", "store": False,
                                                             "max_output_tokens": 16}).json()
    assert unstored["store"] is False and client.get(f"/v1/responses/{unstored['id']}", headers=a).status_code == 404
    off, _ = fake_app(text="Hello there.", responses_store_max=0)
    assert off.post("/v1/responses", json={"model": "fake", "input": "Hi", "max_output_tokens": 16}).json()["store"] \
        is False


def test_store_is_bounded_and_expires(tmp_path):
    """The Responses API's store over the state store (a real SQLite file; both backends: tests/gateway/test_store.py):
    conversations come back as chat messages, bounded, per owner, expired after the TTL."""
    from gateway.api.responses.store import ResponseStore
    from gateway.schemas import ChatMessage
    from gateway.store import open_store

    now = [1000.0]
    store = ResponseStore(open_store(f"sqlite:///{tmp_path}/s.sqlite3"), max_entries=2, ttl=10, clock=lambda: now[0])
    conversation = [ChatMessage(role="user", content="hi"), ChatMessage(role="assistant", content="hello")]
    for i in range(3):
        now[0] += 0.1
        store.put("o", {"id": f"r{i}"}, conversation)
    assert store.get("o", "r0") is None and store.get("o", "r2").conversation == conversation and len(store) == 2
    assert store.get("other", "r2") is None and not store.delete("other", "r2")
    now[0] = 1010.5
    assert store.get("o", "r1") is None and len(store) == 0


def test_input_items_become_chat_messages():
    from gateway.api.responses.convert import input_messages, output_messages
    from gateway.api.responses.schemas import OutputFunctionCall, OutputMessage, OutputText, ResponsesRequest

    request = ResponsesRequest.model_validate({"model": "m", "input": [
        {"role": "user", "content": "Weather?"},
        {"type": "message", "role": "assistant", "id": "msg_1", "status": "completed",
         "content": [{"type": "output_text", "text": "Checking.", "annotations": []}]},
        {"type": "function_call", "id": "fc_1", "call_id": "c1", "name": "get_weather", "arguments": '{"city": "P"}'},
        {"type": "function_call", "call_id": "c2", "name": "get_time", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "c1", "output": "sunny"},
        {"type": "function_call_output", "call_id": "c2", "output": [{"type": "input_text", "text": "noon"}]}]})
    messages = input_messages(request)
    assert [(m.role, m.content) for m in messages] == [("user", "Weather?"), ("assistant", "Checking."),
                                                       ("tool", "sunny"), ("tool", "noon")]
    assert [(c.id, c.function.name) for c in messages[1].tool_calls] == [("c1", "get_weather"), ("c2", "get_time")]
    assert messages[2].tool_call_id == "c1"
    out = output_messages([OutputMessage(id="m", status="completed", content=[OutputText(text="Hi.")]),
                           OutputFunctionCall(id="f", call_id="c9", name="f", arguments="{}", status="completed"),
                           OutputFunctionCall(id="g", call_id="c10", name="f", arguments='{"a": ',
                                              status="incomplete")])
    assert len(out) == 1 and out[0].content == "Hi." and [c.id for c in out[0].tool_calls] == ["c9"]  # cut: left out


BAD = [
    ({"foo": 1}, "foo"),
    ({"tools": [{"type": "web_search"}]}, "tools.0.type"),
    ({"tools": [{"type": "function", "name": "bad name"}]}, "tools.0.name"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "name": "nope"}}, "tool_choice"),
    ({"tool_choice": {"type": "allowed_tools", "tools": []}, "tools": TOOLS}, "tool_choice"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"background": True}, "background"),
    ({"reasoning": {"effort": "high"}}, "reasoning"),
    ({"include": ["message.output_text.logprobs"]}, "include"),
    ({"truncation": "auto"}, "truncation"),
    ({"conversation": "conv_1"}, "conversation"),
    ({"text": {"verbosity": "low"}}, "text.verbosity"),
    ({"stream_options": {"include_obfuscation": False}}, "stream_options"),
    ({"max_output_tokens": 8}, "max_output_tokens"),
    ({"max_output_tokens": 10_000}, "input"),
    ({"temperature": 3}, "temperature"),
    ({"model": "other"}, "model"),
    ({"model": None}, "model"),
    ({"input": []}, "input"),
    ({"input": 5}, "input"),
    ({"input": [{"role": "bot", "content": "x"}]}, "input.0.role"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}, "input.0.content.0"),
    ({"input": [{"type": "function_call", "name": "f", "arguments": "{}"}]}, "input.0.call_id"),
    ({"input": [{"type": "function_call", "call_id": "c", "name": "f", "arguments": "[1]"}]}, "input.0.arguments"),
    ({"input": [{"type": "item_reference", "id": "msg_1"}]}, "input.0.type"),
    ({"previous_response_id": "resp_nope"}, "previous_response_id"),
    ({"text": {"format": {"type": "json_schema", "name": "x"}}}, "text.format.schema"),
    ({"text": {"format": {"type": "json_schema", "name": "x", "schema": {"type": "object", "allOf": [1]}}}},
     "text.format.schema"),
    ({"metadata": {f"k{i}": "v" for i in range(17)}}, "metadata"),
]


@pytest.mark.parametrize("extra, param", BAD, ids=lambda v: json.dumps(v)[:40])
def test_bad_requests_are_400s_naming_the_parameter(app, extra, param):
    r = app.post("/v1/responses", json=body(**extra))
    status = 404 if param == "model" and extra["model"] else 400
    assert r.status_code == status, r.text
    check(oas.ERROR_RESPONSE, r.json())
    assert r.json()["error"]["param"] == param, r.json()


def test_a_failure_mid_stream_is_an_error_then_response_failed(fake_app):
    client, _ = fake_app(fail_at=3)
    events = stream(client, {"model": "fake", "input": "Hi", "max_output_tokens": 16})
    for event in events:
        check_event(event)
    assert [e["type"] for e in events[-2:]] == ["error", "response.failed"]
    assert events[-1]["response"]["status"] == "failed" and events[-1]["response"]["error"]["code"] == "server_error"
    r = client.post("/v1/responses", json={"model": "fake", "input": "Hi", "max_output_tokens": 16})
    assert r.status_code == 503
    validate(oas.ERROR_RESPONSE, r.json())
