"""A property-based HTTP test of the whole API (issue 23): schemathesis generates requests for every operation of the
gateway's own OpenAPI description (FastAPI's /openapi.json, from the request models of `gateway.schemas`, with
`model` narrowed to the served names by `gateway.api.openapi`): the documented examples, then generated valid and
invalid requests; each answer must be: no 5xx; a 200 of /v1/chat/completions, /v1/completions or /v1/models that
validates against OpenAI's schemas (tests/fixtures/openai_schemas.py; streamed answers chunk by chunk, ending with
[DONE]); an error of the OpenAI error schema; and the process still up at the end.

Bounded: a fixed number of examples per operation, derandomized (the same requests every run), no shrinking, and
generation kept small (max_tokens / max_completion_tokens at most 3, n at most 2, at most 4 prompts). Run once
in-process over the scripted model (fast) and once against a real gateway process on the test swarm (slow)."""
from __future__ import annotations

import json
from typing import Any, Dict, List

import pytest
import schemathesis
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st
from hypothesis.errors import Unsatisfiable
from schemathesis import GenerationMode

from tests.fixtures import openai_responses_schemas as ors
from tests.fixtures import openai_schemas as oas
from tests.fixtures.gateway_fixtures import gateway, one_torch_thread  # noqa: F401
from tests.fixtures.openai_checks import validate

SMALL = 3
JSON_SCHEMAS = {
    ("POST", "/v1/chat/completions"): (oas.CHAT_COMPLETION, oas.CHAT_COMPLETION_CHUNK),
    ("POST", "/v1/completions"): (oas.COMPLETION, oas.COMPLETION_CHUNK),
    ("GET", "/v1/models"): (oas.MODEL_LIST, None),
    ("POST", "/v1/responses"): (ors.RESPONSE, ors.STREAM_EVENT),
}
OUTPUT_TOKENS = 16  # the Responses API's least max_output_tokens (OpenAI's)


def bounded(case) -> None:
    """Keep generation small: clip token budgets, n and the number of prompts (invalid values are left as they are,
    to be answered 400)."""
    body = case.body
    if not isinstance(body, dict):
        return
    for key in ("max_tokens", "max_completion_tokens") if "input" not in body else ():  # (chat and completions)
        value = body.get(key)
        if value is None or (isinstance(value, int) and not isinstance(value, bool) and value > SMALL):
            body[key] = SMALL
    value = body.get("max_output_tokens")
    if "input" in body and (value is None or (isinstance(value, int) and not isinstance(value, bool)
                                              and value > OUTPUT_TOKENS)):
        body["max_output_tokens"] = OUTPUT_TOKENS
    if isinstance(body.get("n"), int) and not isinstance(body["n"], bool) and body["n"] > 2:
        body["n"] = 2
    if isinstance(body.get("best_of"), int) and not isinstance(body["best_of"], bool) and body["best_of"] > 2:
        body["best_of"] = 2
    if isinstance(body.get("prompt"), list):
        body["prompt"] = body["prompt"][:4]


def sse_events(text: str, done: bool = True) -> List[Any]:
    """The JSON events of a stream; `done`: it ends with [DONE] (the chat endpoints; the Responses API's do not)."""
    data = [line[6:] for line in text.splitlines() if line.startswith("data: ")]
    if not done:
        return [json.loads(d) for d in data]
    assert data and data[-1] == "[DONE]", text[-500:]
    return [json.loads(d) for d in data[:-1]]


def check_response(method: str, path: str, case, response) -> None:
    status = response.status_code
    assert status < 500, f"{method} {path} -> {status}: {response.text[:500]}\nbody: {case.body!r}"
    schemas = JSON_SCHEMAS.get((method, path))
    if status >= 400:
        if path.startswith("/v1/"):
            validate(oas.ERROR_RESPONSE, response.json())
        return
    if schemas is None:
        return
    whole, chunk = schemas
    content_type = response.headers.get("content-type", "")  # schemathesis: a list of values
    if "text/event-stream" in (content_type if isinstance(content_type, str) else ",".join(content_type)):
        responses = path == "/v1/responses"
        for event in sse_events(response.text, done=not responses):
            validate(oas.ERROR_RESPONSE if "error" in event and not responses else chunk, event)
    else:
        validate(whole, response.json())


def run_property_test(schema, examples: int, **call_kwargs: Any) -> Dict[str, int]:
    """Every operation of `schema`: its documented examples (the request models' `examples`), then `examples`
    generated cases, valid ones (positive) and invalid ones (negative; none for an operation without inputs).
    Returns the count of answers by operation and status ("POST /v1/completions 200": 7)."""
    statuses: Dict[str, int] = {}
    operations = [result.ok() for result in schema.get_all_operations()]
    assert {op.path for op in operations} >= {"/v1/chat/completions", "/v1/completions", "/v1/models"}

    def run(operation, strategy, count: int) -> None:
        method, path = operation.method.upper(), operation.path

        @settings(max_examples=count, deadline=None, derandomize=True, database=None,
                  phases=[Phase.explicit, Phase.generate], suppress_health_check=list(HealthCheck))
        @given(case=strategy)
        def check(case):
            bounded(case)
            response = case.call(**call_kwargs)
            key = f"{method} {path} {response.status_code}"
            statuses[key] = statuses.get(key, 0) + 1
            check_response(method, path, case, response)

        check()

    for operation in operations:
        documented = operation.get_strategies_from_examples()
        if documented:
            run(operation, st.one_of(documented), 2 * len(documented))
        run(operation, operation.as_strategy(generation_mode=GenerationMode.POSITIVE), examples)
        try:
            run(operation, operation.as_strategy(generation_mode=GenerationMode.NEGATIVE), examples)
        except Unsatisfiable:  # no invalid input exists (GET /health takes none)
            pass
    return statuses


def test_property_in_process(tokenizer):
    """The same properties over the in-process app and its scripted model (fast: no swarm)."""
    from tests.fixtures.tool_calls import tool_app

    with tool_app(tokenizer, "Hello there, world!") as client:
        schema = schemathesis.openapi.from_asgi("/openapi.json", client.app)
        statuses = run_property_test(schema, examples=12)
    print(json.dumps(statuses, indent=1))
    for path in ("/v1/chat/completions", "/v1/completions"):  # both valid and invalid requests were made
        assert statuses.get(f"POST {path} 200") and statuses.get(f"POST {path} 400"), statuses


def test_property_against_a_real_gateway(gateway):
    import httpx

    schema = schemathesis.openapi.from_url(gateway.url + "/openapi.json")
    statuses = run_property_test(schema, examples=15, base_url=gateway.url, timeout=120)
    print(json.dumps(statuses, indent=1))
    for path in ("/v1/chat/completions", "/v1/completions"):
        assert statuses.get(f"POST {path} 200") and statuses.get(f"POST {path} 400"), statuses
    assert gateway.proc.proc.poll() is None  # still running
    assert httpx.get(gateway.url + "/health", timeout=30).status_code == 200
