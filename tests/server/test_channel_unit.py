"""A block server's session channel (`server.rpc.channel.ChannelHandler`) in one event loop, with each part's session
replaced by an echo (`_session_stream`): a client that reads no reply stops the work behind its replies at the
outbox's bound; a channel that ends (its stream closed, its handler cancelled) ends every part and lets each
part's teardown run to its end; a peer's channel past `MAX_CHANNELS_PER_PEER` is refused on part 0; malformed
frames get part-0 errors. The real server's behaviour is in tests/e2e/test_channels.py."""
from __future__ import annotations

import asyncio
from types import SimpleNamespace
from typing import List, Optional

import pytest
from hivemind.proto import runtime_pb2

from server.rpc.channel import MAX_CHANNELS_PER_PEER, OUTBOX_REPLIES, ChannelHandler
from server.rpc.limits import RpcLimits, StreamLimiter
from swarm.wire import channel as C
from swarm.wire import protocol as P


class EchoChannels(ChannelHandler):
    """Parts whose session echoes each request (counted in `computed`); its teardown takes a loop turn and is
    recorded in `torn_down`."""

    def __init__(self):
        self.limits = RpcLimits()
        self.streams = StreamLimiter(self.limits)
        self.computed = 0
        self.torn_down = 0

    def _admits(self, context, proof: str) -> bool:
        return proof != "outsider"

    async def _session_stream(self, requests, context):
        try:
            async for request in requests:
                self.computed += 1
                yield runtime_pb2.ExpertResponse(metadata=request.metadata)
        finally:
            await asyncio.sleep(0.01)  # a teardown that awaits (a cache reservation given back)
            self.torn_down += 1


CONTEXT = SimpleNamespace(remote_id="peer-a")


def data(part: int, body: bytes = b"{}", uid: str = "") -> runtime_pb2.ExpertRequest:
    return runtime_pb2.ExpertRequest(uid=uid, metadata=C.frame(C.DATA, part, body))


async def frames(items: List[runtime_pb2.ExpertRequest], hold: asyncio.Event, taken: Optional[list] = None):
    for item in items:
        await asyncio.sleep(0)  # (one frame a loop turn, as from a connection)
        if taken is not None:
            taken.append(item)
        yield item
    await hold.wait()  # the client's side stays open


async def settle() -> None:
    for _ in range(20):
        await asyncio.sleep(0.01)


def test_a_client_that_reads_no_reply_stops_the_work_and_the_reading_behind_it():
    """300 messages to one part, one reply read: the part computes until the outbox is full, its queue passes
    `--max_queued_steps` (a flood: the part is ended with an error), and the frame reader, whose error reply waits for
    room, stops reading the client's frames; reading the replies lets everything go out."""
    async def run():
        handler, hold, taken = EchoChannels(), asyncio.Event(), []
        replies = handler._channel(frames([data(1, b"%d" % i) for i in range(300)], hold, taken), CONTEXT)
        first = await replies.__anext__()
        assert C.unframe(first.metadata) == (C.FrameHeader(C.DATA, 1), b"0")
        await settle()
        assert handler.computed <= OUTBOX_REPLIES + 2, handler.computed  # the outbox, one read, one waiting
        assert len(taken) < 300 - OUTBOX_REPLIES, len(taken)  # the frames behind it wait in the connection
        rest = [C.unframe(r.metadata) for r in await asyncio.wait_for(_all(replies, hold), 10)]
        codes = [P.decode(b, P.ErrorReply).code for h, b in rest if b.startswith(b"{")]
        assert codes == ["over_limit"] and rest[-1][0] == C.FrameHeader(C.END, 1)
        assert handler.torn_down == 1 and handler.streams.streams == 0

    asyncio.run(run())


async def _all(replies, hold: asyncio.Event) -> list:
    got = []
    async for reply in replies:
        got.append(reply)
        if C.unframe(reply.metadata)[0].kind == C.END:
            hold.set()  # the client's side ends once its part did
    return got


@pytest.mark.parametrize("how", ["closed", "cancelled"])
def test_a_channel_that_ends_lets_every_part_finish_its_teardown(how):
    async def run():
        handler, hold = EchoChannels(), asyncio.Event()
        replies = handler._channel(frames([data(n) for n in range(1, 6)], hold), CONTEXT)

        async def read():
            async for _ in replies:
                pass

        reader = asyncio.ensure_future(read())
        await settle()
        assert handler.computed == 5 and handler.streams.streams == 5
        if how == "closed":  # hivemind closes the handler's generator
            reader.cancel()
            await asyncio.gather(reader, return_exceptions=True)
            await replies.aclose()
        else:  # the task that iterates it is cancelled, twice
            reader.cancel()
            await asyncio.sleep(0)
            reader.cancel()
            await asyncio.gather(reader, return_exceptions=True)
        await settle()
        assert handler.torn_down == 5 and handler.streams.streams == 0

    asyncio.run(run())


def test_malformed_frames_get_errors_on_part_0_and_the_channel_goes_on():
    async def run():
        handler, hold = EchoChannels(), asyncio.Event()
        bad = [runtime_pb2.ExpertRequest(metadata=b"garbage"), data(0),
               runtime_pb2.ExpertRequest(metadata=C.frame(C.END, 7)), data(2, b"ok")]
        replies = handler._channel(frames(bad, hold), CONTEXT)
        got = [C.unframe((await replies.__anext__()).metadata) for _ in range(3)]
        assert [(h.part, h.kind) for h, _ in got] == [(0, C.DATA), (0, C.DATA), (2, C.DATA)]
        assert [P.decode(b, P.ErrorReply).code for _, b in got[:2]] == ["bad_request", "bad_request"]
        assert got[2][1] == b"ok"  # (the END for unknown part 7 was dropped)
        hold.set()
        await replies.aclose()

    asyncio.run(run())


def test_an_outsider_s_channel_is_refused_on_part_0():
    async def run():
        handler, hold = EchoChannels(), asyncio.Event()
        hold.set()
        replies = handler._channel(frames([data(1, uid="outsider")], hold), CONTEXT)
        got = [C.unframe(r.metadata) async for r in replies]
        assert [(h.part, P.decode(b, P.ErrorReply).code) for h, b in got] == [(0, "forbidden")]
        assert handler.computed == 0

    asyncio.run(run())


def test_a_peer_s_channel_past_the_cap_is_refused():
    async def run():
        handler, hold = EchoChannels(), asyncio.Event()
        open_ = [handler.rpc_sessions(frames([data(1)], hold), CONTEXT) for _ in range(MAX_CHANNELS_PER_PEER)]
        for replies in open_:
            await replies.__anext__()
        assert handler.channels == {"peer-a": MAX_CHANNELS_PER_PEER}
        ninth = handler.rpc_sessions(frames([], asyncio.Event()), CONTEXT)
        header, body = C.unframe((await ninth.__anext__()).metadata)
        assert (header.part, P.decode(body, P.ErrorReply).code) == (0, "over_limit")
        await ninth.aclose()
        other = handler.rpc_sessions(frames([data(1)], hold), SimpleNamespace(remote_id="peer-b"))
        await other.__anext__()  # another peer's is not
        hold.set()
        for replies in open_ + [other]:
            await replies.aclose()
        assert handler.channels == {}

    asyncio.run(run())
