"""docs/openai_api.md's tables of request parameters against the gateway's behaviour (issue 23).

Each row marked 400 is sent with its example value and must be a 400 whose `param` names it; each supported (or
no-effect) row with an example is answered; the tables and the request models list the same parameters (so no field
is dropped silently and no documented parameter is missing from the models). In-process app over a scripted model
(tests/fixtures/tool_calls.py's `tool_app`); no swarm."""
from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Dict, List, NamedTuple, Optional

import pytest

from gateway.api.responses.schemas import ResponsesRequest
from gateway.schemas import ChatCompletionRequest, CompletionRequest
from tests.fixtures.gateway_fixtures import one_torch_thread  # noqa: F401

DOC = Path(__file__).resolve().parents[2] / "docs" / "openai_api.md"
ENDPOINTS = {"chat": "/v1/chat/completions", "completions": "/v1/completions", "responses": "/v1/responses"}
BASE = {"chat": {"model": "fake", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3},
        "completions": {"model": "fake", "prompt": "a", "max_tokens": 3},
        "responses": {"model": "fake", "input": "hi", "max_output_tokens": 16}}
NEEDS = {"top_logprobs": {"logprobs": True}}  # what a supported example needs beside it


class Row(NamedTuple):
    endpoint: str
    name: str
    status: str
    example: Optional[str]


def table_rows() -> List[Row]:
    rows, endpoint = [], None
    for line in DOC.read_text().splitlines():
        if line.startswith("## "):
            endpoint = {v: k for k, v in ENDPOINTS.items()}[line[3:].strip()]
        match = re.match(r"^\| `([^`]+)` \| (\w+) \| ([\w ]+) \| (.*?) \|.*\|$", line)
        if match and endpoint:
            example = match.group(4).strip()
            rows.append(Row(endpoint, match.group(1), match.group(3).strip(),
                            example[1:-1] if example.startswith("`") else None))
    return rows


ROWS = table_rows()


def _ids(row: Row) -> str:
    return f"{row.endpoint}:{row.name}"


@pytest.fixture(scope="module")
def app(tokenizer):
    from tests.fixtures.tool_calls import tool_app

    with tool_app(tokenizer, "Hello there.") as client:  # one event loop for the module's requests
        yield client


def test_the_tables_list_every_field_of_the_request_models():
    assert len(ROWS) > 100 and {r.status for r in ROWS} == {"supported", "no effect", "400"}
    for endpoint, model in (("chat", ChatCompletionRequest), ("completions", CompletionRequest),
                            ("responses", ResponsesRequest)):
        documented = {r.name for r in ROWS if r.endpoint == endpoint and "[" not in r.name}
        fields = {f.alias or name for name, f in model.model_fields.items()}
        assert fields - documented == set(), f"{endpoint}: fields missing from docs/openai_api.md"
        assert documented - fields == set(), f"{endpoint}: documented parameters the request model lacks"


@pytest.mark.parametrize("row", [r for r in ROWS if r.status == "400" and r.example], ids=_ids)
def test_rejected_rows_are_400s_naming_the_parameter(app, row):
    body = {**BASE[row.endpoint], row.name: json.loads(row.example)}
    r = app.post(ENDPOINTS[row.endpoint], json=body)
    assert r.status_code == 400, (row, r.text)
    error: Dict = r.json()["error"]
    assert error["param"] == row.name and error["type"] == "invalid_request_error", error
    assert row.name in error["message"] or row.name == "best_of", error


@pytest.mark.parametrize("row", [r for r in ROWS if r.status != "400" and r.example], ids=_ids)
def test_supported_rows_are_answered(app, row):
    body = {**BASE[row.endpoint], **NEEDS.get(row.name, {}), row.name: json.loads(row.example)}
    r = app.post(ENDPOINTS[row.endpoint], json=body)
    assert r.status_code == 200, (row, r.text)
