"""A client's session channels: many session parts' streams in one `rpc_sessions` stream per server
(`swarm.wire.channel`, capability `session_channels`).

`SpanStream.open` takes a part of the manager's channel to its server (`session_channel(manager, peer).open_part()`)
instead of opening a P2P stream of its own, where the server announces the capability and the client's
`session_channels` option is on: the part's messages then go out framed with its number (`Part.put`, None ends the
part) and its replies come back through `Part` (an async iterator, as a stream's replies: it ends when the server
ends the part or the channel ends). Everything else about a session part (its opening, steps, pushes, liveness
pings, failover) is as on its own stream: a channel that breaks ends every part in it, as a server that died ends
each of their streams, and each session fails over on its own. A channel is opened on first use and kept; one that
ended is replaced by the next part's opening. A server that refuses a whole channel (a private swarm's outsider,
a peer past its channels) says why on part 0, and every part of it fails with that reason. A session that finds its
server unreachable ends the channel (`SpanStream.drop_channel`): its other parts fail over at once, and the next
opening there does not wait on a frozen server again.
"""
from __future__ import annotations

import asyncio
import logging
from typing import Any, Dict, Optional, Union

from hivemind.proto import runtime_pb2

from swarm.client.transport.manager import SwarmManager
from swarm.client.transport.per_peer import PerPeer
from swarm.runtime import aio
from swarm.wire import channel as C
from swarm.wire import protocol as P

logger = logging.getLogger(__name__)

REFUSALS = ("forbidden", "over_limit")  # a server's reasons to refuse a whole channel (sent on part 0)


class Part:
    """One session part's stream in a channel: `put(request)` sends a message (None: ends the part's stream);
    iterating gives its replies until the part ends; `aclose` ends it from this side."""

    def __init__(self, channel: "SessionChannel", number: int):
        self.channel, self.number = channel, number
        # its replies; None: its end; an exception: the channel's end, with the server's reason (raised)
        self.replies: "asyncio.Queue[Union[None, runtime_pb2.ExpertResponse, BaseException]]" = asyncio.Queue()
        self.sent_end = False
        self.ended = False  # the server's END (or the channel's end) was read

    def put(self, request: Optional[runtime_pb2.ExpertRequest]) -> None:
        if self.sent_end:
            return
        if request is None:
            self.sent_end = True
            self.channel.send(runtime_pb2.ExpertRequest(metadata=C.frame(C.END, self.number)))
            return
        request.metadata = C.frame(C.DATA, self.number, request.metadata)
        self.channel.send(request)

    def __aiter__(self) -> "Part":
        return self

    async def __anext__(self) -> runtime_pb2.ExpertResponse:
        if self.ended:
            raise StopAsyncIteration
        reply = await self.replies.get()
        if reply is None or isinstance(reply, BaseException):
            self.ended = True
            if reply is not None:
                raise reply
            raise StopAsyncIteration
        return reply

    async def aclose(self) -> None:
        self.put(None)
        self.channel.forget(self.number)


class SessionChannel:
    """One client's channel to one server (used on the client loop; `close` from any thread)."""

    def __init__(self, manager: SwarmManager, peer_id: str):
        self.manager, self.peer_id = manager, peer_id
        self._queue: "asyncio.Queue[Optional[Any]]" = asyncio.Queue()  # framed requests to write; None: the end
        self._parts: Dict[int, Part] = {}
        self._last = 0
        self._opening: Optional[asyncio.Future] = None
        self._reader: Optional[asyncio.Task] = None
        self._loop: Optional[asyncio.AbstractEventLoop] = None
        self.closed = False
        self._ended = False
        self.exhausted = False  # its part numbers ran out: new parts go to a new channel (this one ends when idle)
        self._error: Optional[P.RemoteError] = None  # the server's last error on part 0 (its reason to end it)

    async def open_part(self) -> Part:
        """A new part of this channel (the channel's stream opened first if it is not yet); raises what opening the
        stream raises (the session then fails this server over, as for its own stream)."""
        if self.closed or self.exhausted:
            raise self._closed_error()
        if self._opening is None:
            self._loop = asyncio.get_running_loop()
            self._opening = asyncio.ensure_future(self._open())
        await asyncio.shield(self._opening)
        if self.closed:
            raise self._closed_error()
        self._last += 1
        if self._last >= C.MAX_PART:
            self.exhausted = True
        part = self._parts[self._last] = Part(self, self._last)
        return part

    async def _open(self) -> None:
        try:
            responses = await self.manager.stub(self.peer_id).rpc_sessions(aio.iterate_queue(self._queue))
        except BaseException:
            self._end()
            raise
        self._reader = asyncio.ensure_future(self._read(responses))
        if self.closed:  # closed from another thread while it opened: nothing else ends its stream
            self._end()

    async def _read(self, responses) -> None:
        """Hand the server's frames to their parts until the channel ends; then end every part."""
        try:
            async for response in responses:
                try:
                    header, body = C.unframe(response.metadata)
                except P.ProtocolError as e:
                    logger.warning(f"a malformed frame from {self.peer_id} on its session channel: {e}")
                    continue
                if header.part == 0:  # the channel's own: an error reply about a frame of ours, or why it ends
                    try:
                        error = P.decode(body, P.ErrorReply)
                    except P.ProtocolError as e:
                        logger.warning(f"a malformed reply from {self.peer_id} on its session channel: {e}")
                        continue
                    logger.warning(f"session channel to {self.peer_id}: {error.code}: {error.message}")
                    if error.code in REFUSALS:  # the server refuses the channel, then ends it
                        self._error = P.RemoteError(error.code, error.message, self.peer_id)
                    continue
                part = self._parts.get(header.part)
                if part is None:
                    continue  # a part this side already closed
                if header.kind == C.END:
                    self.forget(header.part)
                    part.replies.put_nowait(None)
                else:
                    response.metadata = body
                    part.replies.put_nowait(response)
        except Exception as e:  # noqa: BLE001 - the channel broke: its parts end, as their streams would
            logger.debug(f"session channel to {self.peer_id} ended: {e}")
        finally:
            self._end()
            try:
                await responses.aclose()
            except Exception:  # noqa: BLE001 - closing a broken stream
                pass

    def send(self, request: runtime_pb2.ExpertRequest) -> None:
        if not self.closed:
            self._queue.put_nowait(request)

    def forget(self, number: int) -> None:
        self._parts.pop(number, None)
        if self.exhausted and not self._parts:
            self._end()

    def _end(self) -> None:
        """The channel ended (on the client loop): no part gets more replies; the next opening takes a new one."""
        if self._ended:
            return
        self._ended = self.closed = True
        self._queue.put_nowait(None)
        for part in self._parts.values():  # the server's reason, if it gave one (a refused channel)
            part.replies.put_nowait(self._refusal())
        self._parts.clear()
        CHANNELS.drop(self.manager, self.peer_id, self)

    def _refusal(self) -> Optional[P.RemoteError]:
        """The server's reason to refuse this channel, as a new error (each part raises its own), or None."""
        error = self._error
        return None if error is None else P.RemoteError(error.code, error.message, self.peer_id)

    def _closed_error(self) -> P.RemoteError:
        return self._refusal() or P.RemoteError("closed", "the session channel is closed", self.peer_id)

    def close(self) -> None:
        """End the channel (its parts' sessions close on the server); from any thread."""
        if self.closed or self._loop is None:
            self.closed = True
            return
        aio.call_on(self._loop, self._end)


CHANNELS: PerPeer[SessionChannel] = PerPeer(SessionChannel, lambda channel: not (channel.closed or channel.exhausted),
                                            SessionChannel.close)


def session_channel(manager: SwarmManager, peer_id: str) -> SessionChannel:
    """The manager's session channel to `peer_id` (a new one if there is none or it ended)."""
    return CHANNELS.get(manager, peer_id)


def close_session_channels(manager: SwarmManager) -> None:
    """End the manager's session channels (`SwarmManager.shutdown` does); from any thread."""
    CHANNELS.close_all(manager)
