"""A peer answers each request in the message version it came in (issue 45, `docs/compatibility.md`).

The wire speaks only version 1 so far, so the mechanism runs here over a parametrized range, `codec.SPOKEN` =
(1, 2), with a test-only message type whose field changed its name in version 2: `encode` writes older versions
through the message's `downgrade`, `decode` reads them through its `upgrade`, and the server's real handler
(`server.rpc.handler.BlockHandler`, in this process) answers a request of either version in that version."""
from __future__ import annotations

import asyncio
import json
from types import SimpleNamespace
from typing import Literal

import pytest
import torch

from server.rpc.handler import BlockHandler
from swarm.wire import codec
from swarm.wire import protocol as P


class Greeting(P.Message):
    """Test-only: version 1 called the field `name`, version 2 calls it `who`."""

    type: Literal["greeting"] = "greeting"
    who: str

    @classmethod
    def upgrade(cls, raw: dict, version: int) -> dict:
        if version < 2:
            raw["who"] = raw.pop("name")
        return raw

    def downgrade(self, data: dict, version: int) -> dict:
        if version < 2:
            data["name"] = data.pop("who")
        return data


@pytest.fixture
def two_versions(monkeypatch):
    monkeypatch.setattr(codec, "SPOKEN", (1, 2))  # the machinery reads it there


def test_a_message_is_written_and_read_in_each_spoken_version(two_versions):
    newest = Greeting(v=2, who="ada")
    assert json.loads(P.encode(newest)) == {"v": 2, "type": "greeting", "who": "ada"}
    old_bytes = P.encode(newest, version=1)
    assert json.loads(old_bytes) == {"v": 1, "type": "greeting", "name": "ada"}
    request = P.decode(old_bytes, Greeting)  # a v1 peer's message, in this release's fields, keeping its version
    assert (request.v, request.who) == (1, "ada")
    reply = Greeting(v=request.v, who="hello " + request.who)  # a reply built with the request's version
    assert json.loads(P.encode(reply)) == {"v": 1, "type": "greeting", "name": "hello ada"}
    assert P.decode(P.encode(newest), Greeting) == newest
    for bad in (0, 3):
        with pytest.raises(P.ProtocolError, match=f"unsupported protocol version {bad}; this peer speaks 1..2"):
            P.encode(newest, version=bad)
        with pytest.raises(P.ProtocolError, match="unsupported protocol version"):
            P.decode(json.dumps({"v": bad, "type": "greeting", "who": "x"}).encode(), Greeting)
    assert P.request_version(old_bytes) == 1 and P.request_version(b'{"v": 7}') == 2
    assert P.request_version(b"not json") == 2


def test_this_release_speaks_version_1_only():
    step = P.StepResult(position=3, step_id=1)
    assert P.encode(step) == step.model_dump_json().encode()  # the hot path: no rewriting
    assert P.decode_reply(P.encode(step)) == step
    with pytest.raises(P.ProtocolError, match="unsupported protocol version 2; this peer speaks 1..1"):
        P.encode(step, version=2)
    with pytest.raises(P.ProtocolError, match="unsupported protocol version 2"):
        P.decode_reply(json.dumps({"v": 2, "type": "result", "position": 3}).encode())
    with pytest.raises(P.ProtocolError, match="unsupported protocol version 2"):
        P.decode(P.encode(P.OpenSession(session_id="s", start=0, end=1, max_length=4)).replace(b'"v":1', b'"v":2'),
                 P.OpenSession)


def _handler() -> BlockHandler:
    """The server's real handler over a stand-in span of blocks 0:2 (only the checks before any compute run)."""
    span = SimpleNamespace(start=0, end=2, hidden_size=8, adapters=(), kv_arena=None)
    return BlockHandler(span, "m", "0.2.0", budget=None, pool=None, max_length=64,  # type: ignore[arg-type]
                        alloc_timeout=1.0, step_timeout=5.0)


@pytest.mark.parametrize("version", [1, 2])
def test_the_server_answers_each_request_in_its_version(two_versions, version):
    handler = _handler()
    context = SimpleNamespace(remote_id="peer")
    # blocks 5:9 are not served here: an error reply, in the version the request came in
    forward = P.make_request(P.ForwardRequest(v=version, start=5, end=9), [torch.zeros(1, 1, 8)])
    reply = asyncio.run(handler.rpc_forward(forward, context))  # type: ignore[arg-type]
    assert json.loads(reply.metadata)["v"] == version
    assert "not served here" in str(P.decode_reply(reply.metadata, forward=True))

    async def inference():
        async def requests():
            yield P.make_request(P.OpenSession(v=version, session_id="s", start=5, end=9, max_length=8))
        return [r async for r in handler.rpc_inference(requests(), context)]  # type: ignore[arg-type]

    [opened] = asyncio.run(inference())
    assert json.loads(opened.metadata)["v"] == version
    assert P.decode_reply(opened.metadata).code == "bad_request"  # type: ignore[union-attr]


def test_a_request_in_an_unspoken_version_is_answered_in_the_newest(two_versions):
    handler = _handler()
    metadata = json.dumps({"v": 3, "type": "forward", "start": 0, "end": 1}).encode()
    request = P.make_request(P.ForwardRequest(start=0, end=1), [torch.zeros(1, 1, 8)])
    request.metadata = metadata
    reply = asyncio.run(handler.rpc_forward(request, SimpleNamespace(remote_id="peer")))  # type: ignore[arg-type]
    assert json.loads(reply.metadata)["v"] == 2
    assert "unsupported protocol version 3; this peer speaks 1..2" in reply.metadata.decode()
