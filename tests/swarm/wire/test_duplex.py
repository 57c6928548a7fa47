"""`swarm.wire.duplex.call_stream` between two real p2p daemons: replies flow while the requests stream stays open,
and when the connection closes (the serving peer's daemon dies: a server process killed with its p2pd; or the
connection between two live peers is dropped) the replies end at once, while the caller's request queue is still
open. hivemind's own call would wait for the requests to end first, and a session's never do until it closes: its
step waited the whole `step_timeout` (120 s) for a reply that could not come, while the server, alive, answered
every liveness ping on a new connection and logged nothing (the 120 s stalls of loaded test runs)."""
from __future__ import annotations

import asyncio
import contextlib

from hivemind.p2p import P2P
from hivemind.proto import runtime_pb2

from swarm.runtime.aio import iterate_queue
from swarm.wire.duplex import call_stream

HANDLE = "test_duplex.echo"


async def _echo(requests, context):
    async for request in requests:
        yield runtime_pb2.ExpertResponse(metadata=request.metadata)


@contextlib.asynccontextmanager
async def _peers(handler=_echo):
    """Two real p2p daemons, the server's with `handler` under HANDLE; both shut down after."""
    server = await P2P.create()
    client = await P2P.create(initial_peers=await server.get_visible_maddrs())
    try:
        await server.add_protobuf_handler(HANDLE, handler, runtime_pb2.ExpertRequest, stream_input=True,
                                          stream_output=True)
        yield server, client
    finally:
        await client.shutdown()
        await server.shutdown()


async def _open(client, server, queue: asyncio.Queue):
    return await call_stream(client, server.peer_id, HANDLE, iterate_queue(queue), runtime_pb2.ExpertResponse)


async def _answered(client, server, queue: asyncio.Queue, metadata: bytes = b"0"):
    """A stream opened and one request answered: its replies, still open."""
    replies = await _open(client, server, queue)
    queue.put_nowait(runtime_pb2.ExpertRequest(metadata=metadata))
    assert (await asyncio.wait_for(replies.__anext__(), 60)).metadata == metadata
    return replies


async def _ended(replies) -> bool:
    """Whether the replies end (the wait is only a guard against a hang, far above any real detection)."""
    try:
        await asyncio.wait_for(replies.__anext__(), 60)
    except StopAsyncIteration:
        return True
    return False


def test_replies_end_when_the_peer_dies_though_the_requests_go_on():
    async def run():
        async with _peers() as (server, client):
            queue: asyncio.Queue = asyncio.Queue()
            replies = await _open(client, server, queue)
            got = []
            for i in range(3):  # a conversation: each reply comes while the requests are still open
                queue.put_nowait(runtime_pb2.ExpertRequest(metadata=b"%d" % i))
                got.append((await asyncio.wait_for(replies.__anext__(), 60)).metadata)
            assert got == [b"0", b"1", b"2"]
            await server.shutdown()  # its daemon goes: the connection closes
            assert await _ended(replies) and queue.empty()  # the replies ended with the requests still open
            await replies.aclose()

    asyncio.run(run())


def test_replies_just_end_when_requests_are_written_into_the_closed_connection():
    """A request written after the peer died (a broken pipe or a reset for the writer, whichever side sees the
    close first) does not turn the end of the replies into an error: a dead server reads the same every time."""
    async def run():
        async with _peers() as (server, client):
            queue: asyncio.Queue = asyncio.Queue()
            replies = await _answered(client, server, queue)
            await server.shutdown()
            for _ in range(20):  # into the closed connection
                queue.put_nowait(runtime_pb2.ExpertRequest(metadata=b"x" * 65536))
                await asyncio.sleep(0.01)
            assert await _ended(replies)
            await replies.aclose()

    asyncio.run(run())


def test_replies_end_when_the_connection_between_live_peers_closes():
    async def run():
        async with _peers() as (server, client):
            queue: asyncio.Queue = asyncio.Queue()
            replies = await _answered(client, server, queue)
            await client._client.disconnect(server.peer_id)  # both daemons live on; their connection closes
            assert await _ended(replies) and queue.empty()
            # the peer is still there: a new stream reaches it over a new connection
            again = await _open(client, server, queue)
            queue.put_nowait(runtime_pb2.ExpertRequest(metadata=b"1"))
            assert (await asyncio.wait_for(again.__anext__(), 60)).metadata == b"1"
            queue.put_nowait(None)
            await again.aclose()

    asyncio.run(run())


def test_an_error_of_the_handler_is_raised():
    async def failing(requests, context):
        async for _ in requests:
            raise ValueError("no such step")
        yield  # pragma: no cover

    async def run():
        async with _peers(failing) as (server, client):
            queue: asyncio.Queue = asyncio.Queue()
            replies = await _open(client, server, queue)
            queue.put_nowait(runtime_pb2.ExpertRequest(metadata=b"x"))
            try:
                await asyncio.wait_for(replies.__anext__(), 60)
                raise AssertionError("no error raised")
            except Exception as e:  # noqa: BLE001
                assert "no such step" in str(e), e
            queue.put_nowait(None)

    asyncio.run(run())


def test_closing_the_replies_before_the_first_closes_the_stream():
    """`aclose` on replies never read (an async generator that never started runs no `finally`): the stream
    closes, so the serving side's handler sees its requests end instead of holding the stream open."""
    ended = asyncio.Event()

    async def watching(requests, context):
        try:
            async for request in requests:
                yield runtime_pb2.ExpertResponse(metadata=request.metadata)
        finally:
            ended.set()

    async def run():
        async with _peers(watching) as (server, client):
            queue: asyncio.Queue = asyncio.Queue()  # stays open: only the close can end the stream
            replies = await _open(client, server, queue)
            queue.put_nowait(runtime_pb2.ExpertRequest(metadata=b"0"))
            await asyncio.sleep(0)
            await replies.aclose()
            await asyncio.wait_for(ended.wait(), 60)  # (only a guard against a hang)
            async for _ in replies:  # closed: nothing more comes
                raise AssertionError("a reply after aclose")

    asyncio.run(run())


class _Writer:
    """A stream writer that keeps what is written, one entry per write."""

    def __init__(self):
        self.writes = []

    def write(self, data) -> None:
        self.writes.append(bytes(data))

    async def drain(self) -> None:
        pass


def test_one_write_carries_hivemind_s_bytes():
    """`send_protobuf` writes exactly what hivemind's writes, in one write below ONE_WRITE_BYTES."""
    from swarm.wire.duplex import ONE_WRITE_BYTES, send_protobuf

    for size in (0, 100, ONE_WRITE_BYTES + 10):
        message = runtime_pb2.ExpertRequest(uid="u", metadata=b"x" * size)
        ours, theirs = _Writer(), _Writer()
        asyncio.run(send_protobuf(message, ours))
        asyncio.run(P2P.send_protobuf(message, theirs))
        assert b"".join(ours.writes) == b"".join(theirs.writes)
        assert len(ours.writes) == (1 if size < ONE_WRITE_BYTES else len(theirs.writes))
