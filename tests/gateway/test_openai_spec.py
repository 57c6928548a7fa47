"""Every response of /v1/chat/completions, /v1/completions and /v1/models (streamed chunks included) and every
error body validates against the OpenAI API's schemas (tests/fixtures/openai_schemas.py), over the in-process app and
scripted fake model of tests/fixtures/fake_model.py (issue 23)."""
from __future__ import annotations

import json
from typing import Any

import pytest
from jsonschema import Draft202012Validator

from tests.fixtures import openai_schemas as oas
from tests.fixtures.fake_model import chat_body, fake_app  # noqa: F401  (the in-process app over a fake model)
from tests.fixtures.gateway_fixtures import one_torch_thread  # noqa: F401  (autouse: one torch thread in this module)
from tests.fixtures.openai_checks import sse, validate


def test_schemas_reject_what_the_spec_rejects():
    """The schemas are not vacuous: the gaps of issue 23 and wrong enums fail them."""
    good = {"id": "c", "object": "chat.completion", "created": 1, "model": "m", "choices": [
        {"index": 0, "finish_reason": "stop", "logprobs": None,
         "message": {"role": "assistant", "content": "x", "refusal": None}}]}
    validate(oas.CHAT_COMPLETION, good)
    validator = Draft202012Validator(oas.CHAT_COMPLETION)
    no_refusal = json.loads(json.dumps(good))
    del no_refusal["choices"][0]["message"]["refusal"]
    assert not validator.is_valid(no_refusal)
    assert not validator.is_valid({**good, "system_fingerprint": None})
    assert not validator.is_valid({**good, "object": "chat.completion.chunk"})
    bad_reason = json.loads(json.dumps(good))
    bad_reason["choices"][0]["finish_reason"] = "eos"
    assert not validator.is_valid(bad_reason)
    no_logprob_refusal = json.loads(json.dumps(good))
    no_logprob_refusal["choices"][0]["logprobs"] = {"content": []}
    assert not validator.is_valid(no_logprob_refusal)
    error = Draft202012Validator(oas.ERROR_RESPONSE)
    assert error.is_valid({"error": {"message": "m", "type": "t", "param": None, "code": None}})
    assert not error.is_valid({"error": {"message": "m", "type": "t"}})
    assert not error.is_valid({"detail": "Not Found"})


@pytest.mark.parametrize("extra", [{}, {"logprobs": True, "top_logprobs": 3}, {"logprobs": True}])
def test_chat_completion_validates(fake_app, extra):
    client, _ = fake_app()
    for n in (1, 2):
        r = client.post("/v1/chat/completions", json=chat_body(temperature=0, max_tokens=4, n=n, **extra))
        assert r.status_code == 200, r.text
        body = r.json()
        validate(oas.CHAT_COMPLETION, body)
        assert len(body["choices"]) == n
        if extra.get("logprobs"):
            content = body["choices"][0]["logprobs"]["content"]
            assert content and len(content[0]["top_logprobs"]) == extra.get("top_logprobs", 0)


@pytest.mark.parametrize("extra", [{}, {"logprobs": True, "top_logprobs": 2}])
def test_chat_completion_stream_validates(fake_app, extra):
    client, _ = fake_app()
    for n in (1, 2):
        for stop in ([], ["world"]):
            chunks = sse(client, "/v1/chat/completions", chat_body(
                temperature=0, max_tokens=6, n=n, stop=stop, stream_options={"include_usage": True}, **extra))
            for chunk in chunks:
                validate(oas.CHAT_COMPLETION_CHUNK, chunk)
            assert len({c["id"] for c in chunks}) == 1 and len({c["created"] for c in chunks}) == 1
            *content, last = chunks
            assert last["choices"] == [] and last["usage"]["total_tokens"] > 0  # the final usage chunk
            assert all(c.get("usage") is None for c in content)
            reasons = {c["choices"][0]["index"]: c["choices"][0]["finish_reason"] for c in content
                       if c["choices"] and c["choices"][0]["finish_reason"] is not None}
            assert sorted(reasons) == list(range(n))
    chunks = sse(client, "/v1/chat/completions", chat_body(temperature=0, max_tokens=3))  # no usage chunk
    for chunk in chunks:
        validate(oas.CHAT_COMPLETION_CHUNK, chunk)
    assert all(chunk["choices"] for chunk in chunks)


COMPLETION_BODIES = [
    {},
    {"logprobs": 2},
    {"logprobs": 0},
    {"echo": True},
    {"echo": True, "logprobs": 1},
    {"prompt": ["a b", "c"], "n": 2, "logprobs": 1},
    {"stop": ["two"]},
]


@pytest.mark.parametrize("extra", COMPLETION_BODIES)
def test_completion_validates(fake_app, extra):
    client, _ = fake_app(text="one two three four five")
    body = {"model": "fake", "prompt": "a b", "max_tokens": 4, "temperature": 0, **extra}
    r = client.post("/v1/completions", json=body)
    assert r.status_code == 200, r.text
    validate(oas.COMPLETION, r.json())
    for choice in r.json()["choices"]:
        if "logprobs" in extra:
            lp = choice["logprobs"]
            assert lp["tokens"] and len(lp["tokens"]) == len(lp["token_logprobs"]) == len(lp["top_logprobs"])
        else:
            assert choice["logprobs"] is None


@pytest.mark.parametrize("extra", COMPLETION_BODIES)
def test_completion_stream_validates(fake_app, extra):
    """The spec gives streamed completion chunks the shape of CreateCompletionResponse (but for a null
    finish_reason before a choice ends: see `openai_schemas.COMPLETION_CHUNK`)."""
    client, _ = fake_app(text="one two three four five")
    body = {"model": "fake", "prompt": "a b", "max_tokens": 4, "temperature": 0, **extra}
    for stream_options in (None, {"include_usage": True}):
        chunks = sse(client, "/v1/completions", {**body, "stream_options": stream_options})
        for chunk in chunks:
            validate(oas.COMPLETION_CHUNK, chunk)
        assert len({c["id"] for c in chunks}) == 1
        last = {}  # each choice's last chunk: the spec's own shape, finish_reason included
        for chunk in chunks:
            for choice in chunk["choices"]:
                last[choice["index"]] = {**chunk, "choices": [choice]}
        assert sorted(last) == list(range(len(last))) and last
        for chunk in last.values():
            validate(oas.COMPLETION, {k: v for k, v in chunk.items() if k != "usage"})
        if stream_options:
            assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["total_tokens"] > 0
        else:
            assert all("usage" not in c for c in chunks)


def test_models_validate(fake_app):
    client, _ = fake_app()
    r = client.get("/v1/models")
    assert r.status_code == 200
    validate(oas.MODEL_LIST, r.json())
    assert [m["id"] for m in r.json()["data"]] == ["fake"]


def _assert_error(r, status: int, param: Any = ...) -> dict:
    assert r.status_code == status, r.text
    validate(oas.ERROR_RESPONSE, r.json())
    error = r.json()["error"]
    if param is not ...:
        assert error["param"] == param
    return error


def test_error_bodies_validate(fake_app):
    client, _ = fake_app(api_keys=["k"])
    auth = {"Authorization": "Bearer k"}
    _assert_error(client.post("/v1/chat/completions", json=chat_body()), 401)
    _assert_error(client.post("/v1/completions", json={"model": "fake", "prompt": "a"},
                              headers={"Authorization": "Bearer nope"}), 401)
    _assert_error(client.get("/v1/models"), 401)
    for path, body in (("/v1/chat/completions", chat_body()), ("/v1/completions", {"model": "fake", "prompt": "a"})):
        _assert_error(client.post(path, json={**body, "temperature": -1}, headers=auth), 400, "temperature")
        _assert_error(client.post(path, json={**body, "n": "many"}, headers=auth), 400, "n")
        _assert_error(client.post(path, json={**body, "model": "other"}, headers=auth), 404, "model")
        no_model = {k: v for k, v in body.items() if k != "model"}
        _assert_error(client.post(path, json=no_model, headers=auth), 400, "model")
        _assert_error(client.post(path, content=b"{not json", headers={**auth, "Content-Type": "application/json"}),
                      400)
        _assert_error(client.post(path, json={**body, "max_tokens": 10_000}, headers=auth), 400)
    _assert_error(client.post("/v1/chat/completions", json=chat_body(functions=[]), headers=auth), 400, "functions")
    _assert_error(client.get("/v1/no-such-route", headers=auth), 404)
    _assert_error(client.put("/v1/models", headers=auth), 405)


def test_swarm_errors_validate(fake_app):
    client, _ = fake_app(covered=False)
    _assert_error(client.post("/v1/chat/completions", json=chat_body()), 503)
    client, _ = fake_app(fail_at=3)
    _assert_error(client.post("/v1/completions", json={"model": "fake", "prompt": "a", "max_tokens": 8}), 503)
    events = sse(client, "/v1/chat/completions", chat_body(temperature=0, max_tokens=8))
    *chunks, error = events
    for chunk in chunks:
        validate(oas.CHAT_COMPLETION_CHUNK, chunk)
    validate(oas.ERROR_RESPONSE, error)  # a mid-stream failure is an error event of the error schema


@pytest.mark.parametrize("extra", [
    {}, {"n": 2, "logprobs": True}, {"tool_choice": "required"}, {"parallel_tool_calls": False},
    {"tool_choice": {"type": "function", "function": {"name": "get_time"}}}, {"tool_choice": "none"},
    {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object"}}}},
], ids=lambda v: str(v)[:40])
def test_tool_call_responses_and_chunks_validate(tokenizer, extra):
    """Tool calls (message.tool_calls, delta.tool_calls) and structured output validate, whole and streamed."""
    from tests.fixtures.tool_calls import tool_app, tool_body

    client = tool_app(tokenizer)
    r = client.post("/v1/chat/completions", json=tool_body(**extra))
    assert r.status_code == 200, r.text
    validate(oas.CHAT_COMPLETION, r.json())
    chunks = sse(client, "/v1/chat/completions", tool_body(**extra, stream_options={"include_usage": True}))
    for chunk in chunks:
        validate(oas.CHAT_COMPLETION_CHUNK, chunk)
    if extra.get("tool_choice", "auto") != "none" and "response_format" not in extra:
        assert any("tool_calls" in c["delta"] for chunk in chunks for c in chunk["choices"])
        assert all(c["message"]["tool_calls"] for c in r.json()["choices"])
