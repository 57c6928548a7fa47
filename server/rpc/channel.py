"""Session channels on a block server: `ChannelHandler.rpc_sessions`, many session parts' streams in one stream.

A client that opens many sessions keeps one `rpc_sessions` stream to this server (`swarm.wire.channel`: each
message behind a frame header naming its part). Each part is run exactly as a session on its own `rpc_inference`
stream (`InferenceHandler._session_stream`, each under the same `--max_streams` admission; an idle channel holds no
such slot, and a peer holds at most `MAX_CHANNELS_PER_PEER` channels): a part's first frame is its
`OpenSession`, its replies go back framed with its number, and its stream ends with an `END` frame from either side
(the client's: the session closes, and no `END` comes back; the server's: the session was refused, timed out or
ended). Parts run side by side, each in its own task, so one part's wait (an opening held for another session's
prefix pages, a cache reservation, a long prefill) never holds another's frames. When the channel ends (the client
closes it, or the connection breaks), every part's stream ends with it and the sessions free what they hold (their
teardown is never cancelled). Replies wait in a bounded outbox (`_Outbox`): a client that stops reading them stops
the parts (and the frame reader) behind them, as a stream of its own would.

The channel's first frame proves the caller's membership (a private swarm) for the channel and all its parts. A
malformed frame gets an `ErrorReply` on part 0 and the channel goes on; a frame for a part that has ended is
dropped (the client learns of the end from its `END` frame); a part past `--max_sessions_per_peer` + 64 live parts
of the channel is refused.
"""
from __future__ import annotations

import asyncio
import logging
from contextlib import aclosing
from typing import AsyncGenerator, AsyncIterator, Dict, Optional

from hivemind.p2p import P2PContext
from hivemind.proto import runtime_pb2

from server.rpc.inference import InferenceHandler
from server.rpc.limits import LimitError, StreamLimiter
from server.rpc.refusal import admitted, drain_refused
from swarm.runtime import aio
from swarm.runtime.swarm_key import NOT_A_MEMBER
from swarm.wire import channel as C
from swarm.wire import protocol as P

logger = logging.getLogger(__name__)

EXTRA_PARTS = 64  # live parts a channel may hold past --max_sessions_per_peer (parts still being refused, closing)
MAX_CHANNELS_PER_PEER = StreamLimiter.MAX_CHANNELS_PER_PEER
OUTBOX_REPLIES = 64  # replies waiting to go out before the parts (and the frame reader) wait for the client


class _Part:
    """One virtual stream of a channel: its requests' queue (None: its end) and the task that serves it."""

    def __init__(self) -> None:
        self.inputs: "asyncio.Queue[Optional[runtime_pb2.ExpertRequest]]" = asyncio.Queue()
        self.task: Optional[asyncio.Task] = None
        self.ended = False  # its end was put into `inputs`
        self.client_ended = False  # by the client's END frame (which then needs no END back)


class _Outbox:
    """The channel's replies on their way out, at most `size` waiting: a part (or the frame reader) whose reply finds
    it full waits, so that a client that does not read its replies stops the work behind them, as on a stream of its
    own (whose handler waits at its `yield`). Once the channel's stream is gone (`close`), replies are dropped."""

    def __init__(self, size: int):
        self.queue: "asyncio.Queue[Optional[runtime_pb2.ExpertResponse]]" = asyncio.Queue()
        self.size = size
        self.room = asyncio.Event()
        self.closed = False

    async def put(self, reply: Optional[runtime_pb2.ExpertResponse]) -> None:
        while not self.closed and self.queue.qsize() >= self.size and reply is not None:
            self.room.clear()
            await self.room.wait()
        if not self.closed:
            self.queue.put_nowait(reply)

    async def get(self) -> Optional[runtime_pb2.ExpertResponse]:
        reply = await self.queue.get()
        self.room.set()
        return reply

    def close(self) -> None:
        self.closed = True
        self.room.set()


class ChannelHandler(InferenceHandler):
    """The session channel RPC of `server.rpc.handler.BlockHandler`."""

    async def rpc_sessions(
        self, requests: AsyncIterator[runtime_pb2.ExpertRequest], context: P2PContext
    ) -> AsyncIterator[runtime_pb2.ExpertResponse]:
        """One client's session channel: up to `MAX_CHANNELS_PER_PEER` per peer; not counted under `--max_streams`
        itself (an idle channel holds nothing), each of its parts is."""
        peer = str(context.remote_id)
        try:
            self.streams.open_channel(peer)
        except LimitError as e:
            yield self._channel_error("over_limit", str(e))
            await drain_refused(requests)
            return
        try:
            async with aclosing(self._channel(requests, context)) as replies:
                async for reply in replies:
                    yield reply
        finally:
            self.streams.close_channel(peer)

    @property
    def channels(self) -> Dict[str, int]:
        """peer -> its session channels open here"""
        return self.streams.channels

    async def _channel(self, requests: AsyncIterator[runtime_pb2.ExpertRequest], context: P2PContext
                       ) -> AsyncGenerator[runtime_pb2.ExpertResponse, None]:
        outbox = _Outbox(OUTBOX_REPLIES)
        parts: Dict[int, _Part] = {}
        reader = asyncio.ensure_future(self._read_frames(requests, context, parts, outbox))
        try:
            while True:
                reply = await outbox.get()
                if reply is None:
                    return
                yield reply
        finally:
            # the stream is gone (or the client's side ended and every part finished): the reader ends every part,
            # whose teardown runs to its end (never cancelled: a cancelled one could skip giving back its cache),
            # their last replies dropped
            outbox.close()
            reader.cancel()
            await asyncio.gather(reader, return_exceptions=True)

    async def _read_frames(self, requests: AsyncIterator[runtime_pb2.ExpertRequest], context: P2PContext,
                           parts: Dict[int, _Part], outbox: _Outbox) -> None:
        """Hand the channel's frames to their parts until the client's side ends; then end every part and, once
        they all finished, the channel (None into the outbox)."""
        proof: Optional[str] = None
        last_part = 0  # parts are numbered upwards: an ended part's number never opens a part again
        peer_limit = self.limits.max_sessions_per_peer + EXTRA_PARTS
        try:
            async for request in requests:
                if proof is None:  # the first frame proves membership for the channel and all its parts
                    if not self._admits(context, request.uid):
                        await outbox.put(self._channel_error("forbidden", NOT_A_MEMBER))
                        await drain_refused(requests)
                        return
                    proof = request.uid
                try:
                    header, body = C.unframe(request.metadata)
                    if header.part == 0:
                        raise P.ProtocolError("part 0 is the channel's own: a part is numbered from 1")
                except P.ProtocolError as e:
                    await outbox.put(self._channel_error("bad_request", str(e)))
                    continue
                part = parts.get(header.part)
                if part is None:
                    if header.part <= last_part or header.kind == C.END:
                        continue  # a frame for a part that ended (its END already went out): dropped
                    last_part = header.part
                    if len(parts) >= peer_limit:
                        await outbox.put(self._framed(header.part, P.error_response(
                            "over_limit", f"this channel already has {len(parts)} session parts open")))
                        await outbox.put(self._end_frame(header.part))
                        continue
                    part = parts[header.part] = _Part()
                    request.uid = proof  # its opening is admitted as the channel was
                    part.task = asyncio.ensure_future(self._serve_part(header.part, part, context, parts, outbox))
                if part.ended:
                    continue
                if header.kind == C.END:
                    part.ended = part.client_ended = True
                    part.inputs.put_nowait(None)
                elif part.inputs.qsize() >= self.limits.max_queued_steps:  # a client that does not wait for replies
                    part.ended = True
                    await outbox.put(self._framed(header.part, P.error_response(
                        "over_limit", f"more than {self.limits.max_queued_steps} messages of this session wait; "
                                      f"session closed")))
                    part.inputs.put_nowait(None)
                else:
                    request.metadata = body
                    part.inputs.put_nowait(request)
        except Exception as e:  # noqa: BLE001 - the connection broke: the parts end as if the client closed them
            logger.debug(f"session channel ended: {e}")
        finally:
            for part in list(parts.values()):
                if not part.ended:
                    part.ended = True
                    part.inputs.put_nowait(None)
            tasks = [part.task for part in list(parts.values()) if part.task is not None]
            if tasks:  # (shielded: a cancelled reader leaves the parts' teardown running)
                await asyncio.shield(asyncio.gather(*tasks, return_exceptions=True))
            await outbox.put(None)

    async def _serve_part(self, number: int, part: _Part, context: P2PContext, parts: Dict[int, _Part],
                          outbox: _Outbox) -> None:
        """One part's stream: `rpc_inference`'s handler over its frames, its replies framed, then its END."""
        requests = aio.iterate_queue(part.inputs)
        try:
            async for reply in admitted(self.streams, requests, lambda: self._session_stream(requests, context)):
                await outbox.put(self._framed(number, reply))
        except Exception:  # noqa: BLE001 - this part alone ends
            logger.exception(f"session channel part {number} failed")
        finally:
            parts.pop(number, None)
            if not part.client_ended:  # (the client that ended it has forgotten it)
                await outbox.put(self._end_frame(number))

    @staticmethod
    def _framed(number: int, reply: runtime_pb2.ExpertResponse) -> runtime_pb2.ExpertResponse:
        reply.metadata = C.frame(C.DATA, number, reply.metadata)
        return reply

    @staticmethod
    def _end_frame(number: int) -> runtime_pb2.ExpertResponse:
        return runtime_pb2.ExpertResponse(metadata=C.frame(C.END, number))

    @classmethod
    def _channel_error(cls, code: str, message: str) -> runtime_pb2.ExpertResponse:
        return cls._framed(0, P.error_response(code, message))
