"""Session channels (`rpc_sessions`, issue 46) on real processes: the bundled model split 0:15 and 15:30 over two
servers. Sessions whose parts travel in one channel per server give the outputs of sessions on streams of their own;
closing a channel frees its sessions on the servers; a malformed frame or a refused part leaves the channel and its
other parts going; a server that does not announce the capability gets a stream per part; a peer's channel past the
cap is refused with its reason; a client that dies leaves no session nor stream behind. (The outbox's bound and the
teardown of a cancelled channel: tests/server/test_channel_unit.py.)"""
from __future__ import annotations

import asyncio
import dataclasses
import time
import uuid
from typing import Dict, List, Tuple

import pytest
import torch
from hivemind.proto import runtime_pb2

from swarm import AutoDistributedModelForCausalLM
from swarm.client.transport import channel as client_channel
from swarm.client.transport.channel import Part
from swarm.client.transport.span_stream import SpanStream
from swarm.runtime import aio
from swarm.wire import channel as C
from swarm.wire import protocol as P
from tests.fixtures.numerics import assert_close_at_scale

HIDDEN = 576
PROMPTS = ["The history of the Roman Empire begins", "Hi", "def fibonacci(n):", "Once upon a time"]


@pytest.fixture(scope="module")
def clients(quiet_swarm, model_path):
    """A client with session channels (the default) and one without."""
    swarm = quiet_swarm
    made = [AutoDistributedModelForCausalLM.from_pretrained(model_path, initial_peers=swarm["initial_peers"],
                                                            dht_prefix=swarm["prefix"], session_channels=channels)
            for channels in (True, False)]
    yield made
    for client in made:
        client.shutdown()


def _peers(client) -> Dict[Tuple[int, int], str]:
    """(start, end) -> the peer serving it."""
    return {(hop.start, hop.end): hop.peer_id for hop in client.manager.make_inference_chain(0, 30)}


def _stats_when(client, peer: str, done, timeout: float = 30.0) -> P.ServerStats:
    deadline = time.monotonic() + timeout
    while True:
        stats = client.manager.server_info(peer)
        if done(stats) or time.monotonic() > deadline:
            return stats
        time.sleep(0.1)


def test_sessions_in_channels_give_the_outputs_of_sessions_on_their_own_streams(clients, tokenizer):
    """Four sessions of each client, prefilled and stepped greedily together: the same outputs at every step; the
    channel client's parts are parts of one channel per server, the other's are streams."""
    with_channels, without = clients
    ids = [tokenizer(text, return_tensors="pt")["input_ids"] for text in PROMPTS]
    a = [with_channels.inference_session(max_length=48) for _ in ids]
    b = [without.inference_session(max_length=48) for _ in ids]
    try:
        head = a[0].head
        last = []
        for sa, sb, p in zip(a, b, ids):
            out = sa.session.step(head.embed(p))
            assert_close_at_scale(out, sb.session.step(head.embed(p)), what="prefill")
            last.append(out[:, -1])
        for _ in range(3):
            tokens = [head.head(x).argmax(-1, keepdim=True) for x in last]  # [1, 1]
            last = []
            for sa, sb, t in zip(a, b, tokens):
                out = sa.session.step(head.embed(t))
                assert_close_at_scale(out, sb.session.step(head.embed(t)), what="decode")
                last.append(out[:, -1])
        assert all(isinstance(s._responses, Part) for sa in a for s in sa.session._streams)
        assert not any(isinstance(s._responses, Part) for sb in b for s in sb.session._streams)
        channels = client_channel.CHANNELS.current(with_channels.manager)
        assert sorted(channels) == sorted({s.hop.peer_id for sa in a for s in sa.session._streams})
        assert {s._responses.channel for sa in a for s in sa.session._streams} == set(channels.values())
        assert not client_channel.CHANNELS.current(without.manager)
    finally:
        for s in a + b:
            s.close()


def test_closing_a_channel_frees_its_sessions_on_the_servers(clients, tokenizer):
    with_channels, _ = clients
    peers = list(_peers(with_channels).values())
    # (the earlier tests' sessions close in the background: the quiet swarm holds none once they did)
    base = {peer: _stats_when(with_channels, peer, lambda s: s.sessions_open == 0).sessions_open for peer in peers}
    sessions = [with_channels.inference_session(max_length=32) for _ in range(3)]
    head = sessions[0].head
    for s in sessions:
        s.session.step(head.embed(tokenizer("Hello there", return_tensors="pt")["input_ids"]))
    for peer in peers:
        assert _stats_when(with_channels, peer, lambda s: s.sessions_open >= base[peer] + 3).sessions_open == \
            base[peer] + 3
    client_channel.close_session_channels(with_channels.manager)  # the channels end: every part's stream with them
    for peer in peers:
        stats = _stats_when(with_channels, peer, lambda s: s.sessions_open == base[peer])
        assert stats.sessions_open == base[peer], stats
    for s in sessions:
        s.close()


async def _read_frames(responses, count: int, timeout: float = 30.0) -> List[Tuple[C.FrameHeader, object, list]]:
    """The next `count` frames: (header, decoded reply or None for END, tensors)."""
    frames = []
    for _ in range(count):
        response = await asyncio.wait_for(responses.__anext__(), timeout=timeout)
        header, body = C.unframe(response.metadata)
        reply = P.decode_reply(body) if header.kind == C.DATA else None
        frames.append((header, reply, [P.deserialize_tensor(t) for t in response.tensors]))
    return frames


def _data(part: int, message: P.Message, tensors=()) -> runtime_pb2.ExpertRequest:
    request = P.make_request(message, list(tensors))
    request.metadata = C.frame(C.DATA, part, request.metadata)
    return request


def test_a_bad_frame_or_a_refused_part_leaves_the_channel_and_its_other_parts_going(clients):
    """Raw frames on one channel: garbage and part 0 get errors on part 0; a part refused at its opening gets its
    error and its END; the good part beside them opens, steps, and ends when asked, and the channel goes on; the server
holds nothing after the channel closes."""
    with_channels, _ = clients
    peer = _peers(with_channels)[(0, 15)]
    base = _stats_when(with_channels, peer, lambda s: s.sessions_open == 0)

    async def conversation():
        queue: asyncio.Queue = asyncio.Queue()
        responses = await with_channels.manager.stub(peer).rpc_sessions(aio.iterate_queue(queue))
        try:
            session = uuid.uuid4().hex
            queue.put_nowait(runtime_pb2.ExpertRequest(metadata=b"not a frame"))
            queue.put_nowait(_data(0, P.OpenSession(session_id=session, start=0, end=15, max_length=16,
                                                    batch_size=1)))
            got = await _read_frames(responses, 2)
            assert [(h.part, r.code) for h, r, _ in got] == [(0, "bad_request"), (0, "bad_request")], got
            queue.put_nowait(_data(1, P.OpenSession(session_id=session, start=0, end=15, max_length=16,
                                                    batch_size=1)))
            (h, reply, _), = await _read_frames(responses, 1)
            assert (h.part, h.kind, reply.position) == (1, C.DATA, 0), reply
            queue.put_nowait(_data(2, P.OpenSession(session_id=session + "x", start=0, end=16, max_length=16,
                                                    batch_size=1)))  # blocks this server does not hold
            got = await _read_frames(responses, 2)
            assert [(h.part, h.kind) for h, _, _ in got] == [(2, C.DATA), (2, C.END)], got
            assert got[0][1].code == "bad_request", got[0][1]
            hidden = torch.randn(1, 2, HIDDEN)
            queue.put_nowait(_data(1, P.Step(start_position=0), [hidden]))
            (h, reply, tensors), = await _read_frames(responses, 1)
            assert (h.part, reply.position) == (1, 2) and list(tensors[0].shape) == [1, 2, HIDDEN], reply
            assert torch.isfinite(tensors[0]).all()
            queue.put_nowait(_data(2, P.Step(start_position=0), [hidden]))  # a part that ended: dropped
            queue.put_nowait(runtime_pb2.ExpertRequest(metadata=C.frame(C.END, 1)))  # (no END comes back)
            queue.put_nowait(_data(3, P.OpenSession(session_id=session + "y", start=0, end=15, max_length=16,
                                                    batch_size=1)))  # the channel goes on
            (h, reply, _), = await _read_frames(responses, 1)
            assert (h.part, h.kind, reply.position) == (3, C.DATA, 0), reply
        finally:
            queue.put_nowait(None)
            await responses.aclose()

    aio.run(conversation(), timeout=120)
    stats = _stats_when(with_channels, peer, lambda s: s.sessions_open == base.sessions_open)
    assert (stats.sessions_open, stats.cache_tokens_used) == (base.sessions_open, base.cache_tokens_used), stats


def test_a_server_without_session_channels_gets_a_stream_per_part(clients):
    """The same hop as the client's view has it, and masked as an older release's record (no `session_channels`):
    the first part goes in the channel, the second on its own stream; both step."""
    with_channels, _ = clients
    manager = with_channels.manager
    hop = manager.make_inference_chain(0, 15)[0]
    older = dataclasses.replace(hop, capabilities=hop.capabilities - {"session_channels"})

    async def both():
        parts = [SpanStream(manager, h, uuid.uuid4().hex, 16, 1) for h in (hop, older)]
        try:
            for part in parts:
                await part.open()
            outs = [await part.step(torch.randn(1, 1, HIDDEN), 0, 1) for part in parts]
            return [isinstance(part._responses, Part) for part in parts], [list(o.shape) for o in outs]
        finally:
            for part in parts:
                await part.close()

    kinds, shapes = aio.run(both(), timeout=120)
    assert kinds == [True, False] and shapes == [[1, 1, HIDDEN]] * 2


def test_a_peer_s_channel_past_the_cap_is_refused_with_its_reason(clients):
    """`MAX_CHANNELS_PER_PEER` channels of one peer to a server (the client's own among them): the next is refused on
    its part 0 (`over_limit`), and a session part opened in it fails with that reason, not as a stream that merely
    ended."""
    from server.rpc.channel import MAX_CHANNELS_PER_PEER

    with_channels, _ = clients
    manager = with_channels.manager
    peer = _peers(with_channels)[(0, 15)]
    hop = manager.make_inference_chain(0, 15)[0]

    async def channels():
        others = []
        try:
            while True:  # raw channels until one is refused (the client's own channel there, if any, counts too)
                queue: asyncio.Queue = asyncio.Queue()
                queue.put_nowait(runtime_pb2.ExpertRequest(metadata=b"?"))  # answered on part 0: the channel is up
                responses = await manager.stub(peer).rpc_sessions(aio.iterate_queue(queue))
                others.append((queue, responses))
                (h, reply, _), = await _read_frames(responses, 1)
                if reply.code == "over_limit":
                    break
                assert (h.part, reply.code) == (0, "bad_request"), reply
                assert len(others) <= MAX_CHANNELS_PER_PEER
            assert len(others) - 1 in (MAX_CHANNELS_PER_PEER - 1, MAX_CHANNELS_PER_PEER), len(others)
            last = SpanStream(manager, hop, uuid.uuid4().hex, 16, 1)
            refused = client_channel.SessionChannel(manager, peer)  # (outside the registry)
            part = await refused.open_part()
            last._responses, last._put = part, part.put
            last._put(P.make_request(P.OpenSession(session_id=last.session_id, start=0, end=15, max_length=16,
                                                    batch_size=1)))
            with pytest.raises(P.RemoteError) as raised:
                await last._next_reply()
            return raised.value.code
        finally:
            for queue, responses in others:
                queue.put_nowait(None)
                await responses.aclose()

    assert aio.run(channels(), timeout=120) == "over_limit"


def test_a_client_whose_process_dies_leaves_no_session_nor_stream_on_the_server(clients, quiet_swarm):
    """A peer of its own (its own p2pd) opens three parts in a channel and dies (its daemon shut down): the server
    frees the sessions, and its open streams are back where they were."""
    from hivemind.p2p import P2P, PeerID

    with_channels, _ = clients
    peer = _peers(with_channels)[(0, 15)]
    server = next(s for s in quiet_swarm["servers"] if s.peer_id == peer)
    base = _stats_when(with_channels, peer, lambda s: s.sessions_open == 0)

    async def doomed():
        p2p = await P2P.create(initial_peers=[server.maddr])
        try:
            stub = P.BlockRPC.get_stub(p2p, PeerID.from_base58(peer))
            queue: asyncio.Queue = asyncio.Queue()
            responses = await stub.rpc_sessions(aio.iterate_queue(queue))
            for n in (1, 2, 3):
                queue.put_nowait(_data(n, P.OpenSession(session_id=uuid.uuid4().hex, start=0, end=15, max_length=16,
                                                        batch_size=1)))
            frames = await _read_frames(responses, 3)
            assert sorted(h.part for h, _, _ in frames) == [1, 2, 3]
        finally:
            await p2p.shutdown()  # its daemon goes, with the connection: no END, no end of stream

    aio.run(doomed(), timeout=60)
    stats = _stats_when(with_channels, peer, lambda s: s.sessions_open == 0 and s.streams_open <= base.streams_open)
    held = (stats.sessions_open, stats.cache_tokens_used, stats.streams_open)
    assert held == (0, base.cache_tokens_used, base.streams_open), stats
