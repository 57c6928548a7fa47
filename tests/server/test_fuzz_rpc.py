"""Property-based fuzzing (hypothesis) of every RPC of a real block server over real P2P streams.

Malformed, truncated, oversize and out-of-order messages go to the inference stream, forward, push and info
RPCs of real server processes, while an honest session generates greedily through the same servers. The
properties: every reply is a well-formed `StepResult` or an `ErrorReply` with a clear code (never `internal`),
the server keeps answering, the honest session's tokens equal the local reference, and once the streams close
no session or cache token is left held. The number of examples is bounded (`EXAMPLES` in tests/fixtures/rpc_fuzzing.py).
"""
from __future__ import annotations

import asyncio
import json

import torch
from hivemind.proto import runtime_pb2
from hypothesis import given
from hypothesis import strategies as st

from swarm.client.transport.manager import SwarmManager
from swarm.runtime import aio
from swarm.wire import protocol as P
from swarm.wire import rounds as R
from tests.fixtures.rpc_fuzzing import (  # noqa: F401  (fuzz_env and honest_reference: fixtures)
    CLEAR_CODES,
    FUZZ,
    HIDDEN,
    HonestSessions,
    fuzz_env,
    honest_reference,
    wait_idle,
)

PROBE_ID = 10**9  # the step id of the last, always valid, step of a conversation (fuzzed ids stay below)


# ---- messages --------------------------------------------------------------------------------------------------
def _tensor(draw, batch=None, seq=None, hidden=HIDDEN) -> runtime_pb2.Tensor:
    batch = draw(st.integers(0, 3)) if batch is None else batch
    seq = draw(st.integers(0, 5)) if seq is None else seq
    dtype = draw(st.sampled_from(["float32", "float16", "bfloat16"]))
    x = torch.randn(batch, seq, hidden).to(getattr(torch, dtype))
    if x.numel() and draw(st.booleans()) and draw(st.booleans()):
        x.view(-1)[draw(st.integers(0, x.numel() - 1))] = draw(st.sampled_from([float("nan"), float("inf"), -1e30]))
    proto = P.serialize_tensor(x)
    corruption = draw(st.sampled_from(["none"] * 6 + ["truncate", "extend", "huge_shape", "max_dim", "dtype",
                                                      "compressed"]))
    if corruption == "truncate":
        proto.buffer = proto.buffer[:draw(st.integers(0, max(0, len(proto.buffer) - 1)))]
    elif corruption == "extend":
        proto.buffer = proto.buffer + b"\x00" * draw(st.integers(1, 64))
    elif corruption == "huge_shape":
        del proto.size[:]
        proto.size.extend([1, draw(st.integers(10**5, 2**31 - 1)), hidden])
    elif corruption == "max_dim":
        proto.size[0] = 2**32 - 1  # unsigned on the wire: the largest first dimension
    elif corruption == "dtype":
        proto.dtype = draw(st.sampled_from(["int64", "float64", "uint8", "", "bool", "x" * 300]))
    elif corruption == "compressed":
        proto.compression = runtime_pb2.CompressionType.FLOAT16
    return proto


@st.composite
def open_message(draw) -> runtime_pb2.ExpertRequest:
    fields = dict(session_id=draw(st.text(min_size=1, max_size=20)),
                  start=draw(st.sampled_from([0, 0, 0, 3, 15, 29])), end=draw(st.sampled_from([15, 15, 15, 10, 30])),
                  max_length=draw(st.sampled_from([1, 8, 32, 10**6])), batch_size=draw(st.integers(1, 3)))
    return P.make_request(P.OpenSession(**fields))


@st.composite
def step_message(draw, batch=None) -> runtime_pb2.ExpertRequest:
    chain = draw(st.sampled_from([[], [], [P.PushTarget(peer_id="not-a-peer", stream_key="x:15")]]))
    step = P.Step(start_position=draw(st.integers(0, 40)), step_id=draw(st.integers(0, 10**6)), push_chain=chain)
    request = runtime_pb2.ExpertRequest(metadata=P.encode(step))
    for _ in range(draw(st.sampled_from([1, 1, 1, 1, 0, 2]))):
        request.tensors.append(_tensor(draw, batch=batch))
    return request


json_values = st.recursive(st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=10),
                           lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=8), inner,
                                                                                       max_size=3), max_leaves=8)


@st.composite
def garbage_message(draw) -> runtime_pb2.ExpertRequest:
    kind = draw(st.sampled_from(["bytes", "json", "wrong_type", "push", "huge_metadata"]))
    if kind == "bytes":
        metadata = draw(st.binary(max_size=64))
    elif kind == "json":
        value = draw(st.dictionaries(st.sampled_from(["v", "type", "start_position", "step_id", "session_id",
                                                      "start", "end", "max_length", "push_chain", "x"]),
                                     json_values, max_size=6))
        metadata = json.dumps(value).encode()
    elif kind == "wrong_type":
        metadata = P.encode(draw(st.sampled_from([P.ForwardRequest(start=0, end=15), P.ForwardResult(),
                                                  P.ErrorReply(code="x", message="y"), P.StepResult(position=3)])))
    elif kind == "push":
        metadata = P.encode(P.PushStep(stream_key="s:0", start_position=0, step_id=draw(st.integers(0, 99))))
    else:
        metadata = b'{"v": 1, "type": "step", "start_position": 0, "pad": "' + b"a" * (1 << 20) + b'"}'
    request = runtime_pb2.ExpertRequest(metadata=metadata)
    if draw(st.booleans()):
        request.tensors.append(_tensor(draw))
    return request


@st.composite
def conversation(draw) -> tuple:
    """(messages, batch of the first OpenSession or None): mostly a valid opening, then anything."""
    first = draw(st.one_of(open_message(), open_message(), open_message(), step_message(), garbage_message()))
    try:
        batch = P.decode(first.metadata, P.OpenSession).batch_size
    except P.ProtocolError:
        batch = None
    rest = draw(st.lists(st.one_of(step_message(batch=batch), step_message(), garbage_message()), max_size=6))
    return [first, *rest], batch


# ---- talking to the server -------------------------------------------------------------------------------------
async def _talk(manager: SwarmManager, peer_id: str, requests: list) -> list:
    """Send `requests` on one inference stream, then end our side; every reply until the server ends it."""
    async def gen():
        for request in requests:
            yield request

    replies = []
    try:
        async for response in await manager.stub(peer_id).rpc_inference(gen()):
            replies.append(P.decode_reply(response.metadata))
    except (BrokenPipeError, ConnectionResetError):
        pass  # the server refused the session and closed while we were still writing
    return replies


def _check_replies(replies: list, requests: list, batch) -> None:
    assert len(replies) <= len(requests)
    for reply in replies:
        assert isinstance(reply, (P.StepResult, P.ErrorReply)), reply
        if isinstance(reply, P.ErrorReply):
            assert reply.code in CLEAR_CODES and len(reply.message) > 5, reply
    if batch is None:  # not an opening: one clear error, then the server ends the stream
        assert len(replies) == 1 and isinstance(replies[0], P.ErrorReply), replies


# ---- the properties --------------------------------------------------------------------------------------------
def test_fuzzed_inference_streams(fuzz_env, honest_reference):
    manager, swarm, model = fuzz_env
    peers = [s.peer_id for s in swarm["servers"]]
    ids, expected = honest_reference

    @FUZZ
    @given(conversation(), st.sampled_from([0, 0, 1]))
    def fuzz(case, server):
        requests, batch = case
        if batch is not None:  # end with an always-valid step: an open session must still work after all that
            probe = P.make_request(P.Step(start_position=0, step_id=PROBE_ID), [torch.randn(batch, 1, HIDDEN)])
            requests = [*requests, probe]
        replies = aio.run(asyncio.wait_for(_talk(manager, peers[server], requests), 120))
        _check_replies(replies, requests, batch)
        if replies and isinstance(replies[0], P.StepResult):  # the session opened: the probe got through
            assert isinstance(replies[-1], P.StepResult) and replies[-1].step_id == PROBE_ID, replies
            assert replies[-1].position == 1

    with HonestSessions(model, ids) as honest:
        fuzz()
    assert honest.error is None, honest.error
    assert honest.outputs and all(out == expected for out in honest.outputs)
    for peer in peers:
        stats = wait_idle(manager, peer)
        assert (stats.sessions_open, stats.cache_tokens_used) == (0, 0), stats


def test_fuzzed_forward_and_info(fuzz_env):
    manager, swarm, _ = fuzz_env
    peer = swarm["servers"][1].peer_id
    stub = manager.stub(peer)

    @st.composite
    def forward_request(draw):
        kind = draw(st.sampled_from(["forward", "forward", "garbage", "step"]))
        if kind == "forward":
            request = runtime_pb2.ExpertRequest(metadata=P.encode(P.ForwardRequest(
                start=draw(st.sampled_from([15, 15, 0, 20])), end=draw(st.sampled_from([30, 30, 16, 31])))))
            for _ in range(draw(st.sampled_from([1, 1, 1, 0, 2]))):
                request.tensors.append(_tensor(draw))
            return request
        return draw(garbage_message() if kind == "garbage" else step_message())

    @FUZZ
    @given(forward_request())
    def fuzz(request):
        response = aio.run(stub.rpc_forward(request, timeout=120))
        reply = P.decode_reply(response.metadata, forward=True)
        if isinstance(reply, P.ErrorReply):
            assert reply.code in CLEAR_CODES and len(reply.message) > 5, reply
        else:
            [out] = [P.deserialize_tensor(t) for t in response.tensors]
            hidden = request.tensors[0]
            assert list(out.shape) == list(hidden.size) and torch.isfinite(out).all()

    fuzz()
    stats = manager.server_info(peer)  # the info RPC still answers, whatever the uid asked for
    info = aio.run(stub.rpc_info(runtime_pb2.ExpertUID(uid="\x00" * 1000), timeout=60))
    assert P.parse_stats(info).start == stats.start == 15


def test_fuzzed_push_streams(fuzz_env, honest_reference):
    """Garbage pushed to a server (unknown stream keys, malformed steps) is dropped; the server serves on."""
    manager, swarm, model = fuzz_env
    peer = swarm["servers"][1].peer_id
    ids, expected = honest_reference

    @FUZZ
    @given(st.lists(st.one_of(garbage_message(), step_message(), st.builds(
        lambda key, n: P.make_request(P.PushStep(stream_key=key, start_position=n, step_id=n),
                                      [torch.randn(1, 1, HIDDEN)]),
        st.text(min_size=1, max_size=20), st.integers(0, 50))), max_size=8))
    def fuzz(requests):
        async def push():
            async def gen():
                for request in requests:
                    yield request

            return [r async for r in await manager.stub(peer).rpc_push(gen())]

        assert aio.run(asyncio.wait_for(push(), 60)) == []  # the receiver never answers a push

    with HonestSessions(model, ids) as honest:
        fuzz()
    assert honest.error is None, honest.error
    assert all(out == expected for out in honest.outputs)
    assert manager.server_info(peer).start == 15


@st.composite
def round_message(draw) -> runtime_pb2.ExpertRequest:
    """A round (`swarm.wire.rounds`): rows of session parts that do not exist or are not attached, attach entries
    with guessed tokens, tensors that fit the rows or not."""
    rows = draw(st.lists(st.tuples(st.text(min_size=1, max_size=12), st.integers(0, 40), st.integers(1, 3),
                                   st.integers(1, 4)), min_size=1, max_size=5, unique_by=lambda row: row[0]))
    attach = [R.RoundAttach(stream_key=key, token=draw(st.text(min_size=16, max_size=20)))
              for key, *_ in rows if draw(st.booleans())]
    chains = [[P.PushTarget(peer_id=draw(st.text(min_size=1, max_size=60)), stream_key="x:0",
                            push_token=draw(st.text(max_size=20)))] if draw(st.booleans()) else [] for _ in rows]
    message = R.RoundStep(round_id=draw(st.integers(0, 9)), attach=attach, rows=[
        R.RoundRow(stream_key=key, start_position=start, batch=batch, seq=seq, push_chain=chain)
        for (key, start, batch, seq), chain in zip(rows, chains)])
    tokens = message.tokens + draw(st.sampled_from([0, 0, 1, -1]))
    request = P.make_request(message, [torch.randn(max(tokens, 0), HIDDEN)])
    if draw(st.booleans()):
        request.tensors.append(_tensor(draw))
    return request


@st.composite
def round_push_message(draw) -> runtime_pb2.ExpertRequest:
    """A round push (`rpc_round_push`) into session parts that do not exist, with tensors that fit the rows or not."""
    rows = draw(st.lists(st.tuples(st.text(min_size=1, max_size=12), st.integers(0, 40), st.integers(1, 3)),
                         min_size=1, max_size=5, unique_by=lambda row: row[0]))
    message = R.RoundPush(rows=[R.RoundPushRow(stream_key=key, token=draw(st.text(min_size=16, max_size=20)),
                                               start_position=start, step_id=start, batch=1, seq=seq)
                                for key, start, seq in rows])
    tokens = message.tokens + draw(st.sampled_from([0, 0, 1, -1]))
    return P.make_request(message, [torch.randn(max(tokens, 0), HIDDEN)])


def test_fuzzed_round_push_streams(fuzz_env, honest_reference):
    """Garbage and round pushes into parts that do not exist are dropped without a reply (a refusal answers only a
    wrong token for a live part); the server serves on, and honest sessions keep their tokens."""
    manager, swarm, model = fuzz_env
    peer = swarm["servers"][1].peer_id
    ids, expected = honest_reference

    @FUZZ
    @given(st.lists(st.one_of(garbage_message(), round_push_message()), max_size=8))
    def fuzz(requests):
        async def push():
            async def gen():
                for request in requests:
                    yield request

            return [r async for r in await manager.stub(peer).rpc_round_push(gen())]

        assert aio.run(asyncio.wait_for(push(), 60)) == []

    with HonestSessions(model, ids) as honest:
        fuzz()
    assert honest.error is None, honest.error
    assert all(out == expected for out in honest.outputs)
    assert manager.server_info(peer).start == 15


def test_fuzzed_round_streams(fuzz_env, honest_reference):
    """Round streams (`server.rpc.rounds`) fed garbage and rounds of parts nobody opened: each message gets one
    reply, a `RoundResult` whose rows carry clear errors or an `ErrorReply` with a clear code; the server serves on."""
    manager, swarm, model = fuzz_env
    peer = swarm["servers"][1].peer_id
    ids, expected = honest_reference

    @FUZZ
    @given(st.lists(st.one_of(garbage_message(), round_message(), round_message()), min_size=1, max_size=6))
    def fuzz(requests):
        async def rounds():
            async def gen():
                for request in requests:
                    yield request

            return [r async for r in await manager.stub(peer).rpc_round(gen())]

        replies = aio.run(asyncio.wait_for(rounds(), 60))
        assert len(replies) == len(requests)
        for response in replies:
            if json.loads(response.metadata)["type"] == "error":
                error = P.decode(response.metadata, P.ErrorReply)
                assert error.code in CLEAR_CODES and len(error.message) > 5, error
            else:
                result = P.decode(response.metadata, R.RoundResult)
                assert all(row.code in CLEAR_CODES | {"forbidden"} for row in result.rows), result
                assert not response.tensors  # no row ran

    with HonestSessions(model, ids) as honest:
        fuzz()
    assert honest.error is None, honest.error
    assert all(out == expected for out in honest.outputs)
    assert manager.server_info(peer).start == 15
