"""A long-lived bidirectional protobuf stream to a peer's handler that ends as soon as the peer's side closes:
`call_stream`, used for the session streams (`rpc_inference`), round streams (`rpc_round`) and push streams
(`rpc_push`).

hivemind's own stream call (`P2P.iterate_protobuf_handler`), on reading the end of the connection, first waits for
the caller's request iterator to end before it ends the replies. A session's requests come from a queue that stays
open while the session lives, so a stream whose server process died (p2pd closes the connection at once) would
yield nothing until the step's time-out (120 s): the reader would wait on a writer that waits on the queue. Here
the replies end the moment the connection does (the writer is cancelled), so a dead server is seen at once, as a
stream that ended; a server that goes silent without closing anything (a frozen host, a cut link) is the
liveness pings' case (`swarm.client.transport.liveness`).

Framing and the end-of-stream mark are hivemind's (`P2P.send_protobuf` / `receive_protobuf`; a request goes out in
one write of the same bytes, `send_protobuf`), so either side may be hivemind's own code.
"""
from __future__ import annotations

import asyncio
from typing import AsyncIterator, Awaitable, Callable, Type

from google.protobuf.message import Message
from hivemind.p2p import P2P, P2PHandlerError, PeerID

ONE_WRITE_BYTES = 1 << 16  # larger messages are written as hivemind writes them (no copy into one buffer)


async def call_stream(p2p: P2P, peer_id: PeerID, handle_name: str, requests: AsyncIterator[Message],
                      response_type: Type[Message]) -> "Replies":
    """Open a stream to `handle_name` at `peer_id`, write `requests` into it (then the end-of-stream mark), and
    return the replies as an async iterator that ends when the peer closes its side (whatever is left to write is
    dropped) and raises `P2PHandlerError` for an error the peer's handler reported. Close the iterator
    (`aclose`) to close the stream early."""
    _, reader, writer = await p2p.call_binary_stream_handler(peer_id, handle_name)

    async def write() -> None:
        async for request in requests:
            await send_protobuf(request, writer)
        await P2P.send_protobuf(P2P.END_OF_STREAM, writer)

    writing = asyncio.ensure_future(write())
    # its failure (writing into a connection the peer closed) is read here, or raised below once the replies end
    writing.add_done_callback(lambda task: task.cancelled() or task.exception())

    def end() -> None:
        writing.cancel()
        writer.close()

    async def read() -> AsyncIterator[Message]:
        try:
            while True:
                try:
                    response, error = await P2P.receive_protobuf(response_type, reader)
                except (asyncio.IncompleteReadError, ConnectionError):  # the peer closed its side (or the daemon
                    break  # reset the connection): nothing more will come
                if error is not None:
                    raise P2PHandlerError(f"Failed to call handler `{handle_name}` at {peer_id}: {error.message}")
                yield response
            failure = writing.exception() if writing.done() and not writing.cancelled() else None
            if failure is not None and not isinstance(failure, ConnectionError):
                # the requests' own failure, as hivemind's call (writing into the connection the peer closed is
                # not one: the replies just end, whichever side saw the close first)
                raise failure
        finally:
            end()

    return Replies(read(), end)


async def send_protobuf(message: Message, writer: asyncio.StreamWriter) -> None:
    """`P2P.send_protobuf`'s bytes (the message marker, the length, the message) in ONE write: hivemind's three
    writes cost three system calls on a socket whose buffer is empty, as the session, round and push streams' are."""
    data = message.SerializeToString()
    if len(data) > ONE_WRITE_BYTES:  # (a large message: hivemind's writes, without the copy)
        writer.write(P2P.MESSAGE_MARKER)
        await P2P.send_raw_data(data, writer)
        return
    writer.write(P2P.MESSAGE_MARKER + len(data).to_bytes(P2P.HEADER_LEN, P2P.BYTEORDER) + data)
    await writer.drain()


class Replies:
    """`call_stream`'s replies: an async iterator whose `aclose` closes the stream even before the first reply was
    asked for (an async generator that never started runs no `finally` when closed), and never fails: the stream is
    closed whatever the generator's own close says (one still running, one that broke on its own)."""

    def __init__(self, replies: AsyncIterator[Message], end: Callable[[], None]):
        self._replies, self._end = replies, end

    def __aiter__(self) -> "Replies":
        return self

    def __anext__(self) -> Awaitable[Message]:
        return self._replies.__anext__()

    async def aclose(self) -> None:
        try:
            await self._replies.aclose()  # type: ignore[attr-defined]
        except Exception:  # noqa: BLE001 - closed below all the same
            pass
        finally:
            self._end()
