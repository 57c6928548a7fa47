"""Server-to-server push: a decode step crosses the chain once (client -> A -> B -> C -> client).

Outgoing: `PushSender` keeps one long-lived `rpc_push` stream per next server and writes `PushStep`s into it;
a stream that breaks is dropped and reopened on the next push. Incoming: `PushRouter` maps a session part's
stream key to its input queue, so that a push lands in the same queue as the client's own steps; the
session takes whichever copy of a step arrives first and drops the other (by step id). A push is accepted only
with the session part's push token (`OpenSession.push_token`, a secret the client passes down its chain inside
`PushTarget`s): a peer that knows or guesses a stream key cannot inject hidden states into another session.
"""
from __future__ import annotations

import asyncio
import hmac
import logging
from typing import AsyncIterator, Callable, Dict, Optional, Tuple, TypeVar

import torch
from hivemind.p2p import P2P, PeerID
from hivemind.proto import runtime_pb2

from server.rpc.limits import LimitError
from swarm.runtime.aio import iterate_queue
from swarm.wire import protocol as P
from swarm.wire.duplex import call_stream

logger = logging.getLogger(__name__)
T = TypeVar("T")


def token_matches(expected: Optional[str], given: str) -> bool:
    """Whether `given` is a session part's push token (`OpenSession.push_token`; a part opened without one takes
    none), compared in constant time."""
    return expected is not None and hmac.compare_digest(expected.encode(), given.encode())


async def proven_pushes(requests: AsyncIterator[runtime_pb2.ExpertRequest], peer: object,
                        admits: Callable[[str], bool], parse: Callable[[runtime_pb2.ExpertRequest], T], what: str
                        ) -> AsyncIterator[Tuple[runtime_pb2.ExpertRequest, T]]:
    """A push stream's requests with what `parse` makes of them: nothing unless the first one's uid proves
    membership (`admits(uid)`, for the whole stream); one that `parse` refuses (`P.ProtocolError`, `LimitError`)
    is logged as a malformed `what` and skipped, and the stream goes on."""
    admitted = False
    async for request in requests:
        if not admitted:
            if not admits(request.uid):
                return
            admitted = True
        try:
            parsed = parse(request)
        except (P.ProtocolError, LimitError) as e:
            logger.warning(f"malformed {what} from {peer}: {e}")
            continue
        yield request, parsed


class PushRefused(ValueError):
    """A push into a live session part without its push token; the text is safe to send back to the pusher."""


class PushRouter:
    """Incoming pushes -> the input queue of the session part they name, if they carry its push token."""

    def __init__(self):
        self._queues: Dict[str, Tuple[asyncio.Queue, Optional[str], str]] = {}  # key -> (queue, token, owner)

    def register(self, key: str, queue: asyncio.Queue, token: Optional[str] = None, owner: str = "") -> bool:
        """Route pushes for `key` carrying `token` to `queue` (no token: refuse every push). False if another peer's
        session part holds `key`; the same `owner` (the client's peer id) reopening its part supersedes the old
        stream, which gets the end-of-input mark (None) and ends: a client that re-opens a part at once after
        closing it (or after its stream broke) may come before the server has seen the old one end."""
        entry = self._queues.get(key)
        if entry is not None:
            old_queue, _, old_owner = entry
            if old_owner != owner:
                return False
            _end(old_queue)
        self._queues[key] = (queue, token, owner)
        return True

    def unregister(self, key: str, queue: Optional[asyncio.Queue] = None) -> None:
        """Forget `key` (only if it still routes to `queue`, when given: a superseded part leaves its successor)."""
        entry = self._queues.get(key)
        if entry is not None and (queue is None or entry[0] is queue):
            del self._queues[key]

    def deliver(self, key: str, token: str, request) -> bool:
        """Whether the push went into its session's queue (False: no such session now, or its queue is full);
        PushRefused if the session is live but the token is not its own."""
        entry = self._queues.get(key)
        if entry is None:
            return False
        queue, expected, _ = entry
        if expected is None:
            raise PushRefused(f"session part {key} takes no pushes (its client gave no push token)")
        if not token_matches(expected, token):
            raise PushRefused(f"push into session part {key} refused: its push token does not match (only the "
                              f"previous server of the session's chain may push to it)")
        try:
            queue.put_nowait(("push", request))
        except asyncio.QueueFull:  # the session is that far behind: the client's own copy of the step will do
            return False
        return True


def _end(queue: asyncio.Queue) -> None:
    """Put the end-of-input mark into a session part's queue, dropping its unprocessed steps if it is full."""
    while True:
        try:
            queue.put_nowait(None)
            return
        except asyncio.QueueFull:
            queue.get_nowait()


class _Channel:
    def __init__(self):
        self.queue: asyncio.Queue = asyncio.Queue()
        self.alive = True
        self.task: Optional[asyncio.Task] = None


class PushSender:
    """One push stream per next server and kind (`rpc_push`: a session's step; `rpc_round_push`: a round's rows),
    opened on first use and reopened after a failure."""

    def __init__(self, p2p: P2P, proof: str = ""):
        self.p2p = p2p
        self.proof = proof  # this server's membership proof in a private swarm (sent with each push)
        self._channels: Dict[Tuple[str, str], _Channel] = {}  # (rpc, peer id) -> its stream
        self.closed = False

    def _send(self, rpc: str, peer_id: str, message: P.Message, tensors: list, compression: str = "none") -> bool:
        """Queue one push on the stream of `rpc` to `peer_id`; False if no live stream took it."""
        if self.closed:
            return False  # the span is no longer served here; the client's copy of the step goes on
        channel = self._channels.get((rpc, peer_id))
        if channel is None or not channel.alive:
            try:
                PeerID.from_base58(peer_id)  # checked once per stream, not per push
            except Exception:
                return False
            channel = _Channel()
            channel.task = asyncio.ensure_future(self._run(rpc, peer_id, channel))
            self._channels[(rpc, peer_id)] = channel
        if not channel.alive:
            return False
        channel.queue.put_nowait(P.make_request(message, tensors, uid=self.proof, compression=compression))
        return True

    async def _run(self, rpc: str, peer_id: str, channel: _Channel) -> None:
        try:
            # ends as soon as the next server's side closes (`swarm.wire.duplex`): later pushes are refused at once
            # (the client sends its own copy) instead of vanishing into a dead stream
            responses = await call_stream(self.p2p, PeerID.from_base58(peer_id),
                                          P.BlockRPC._get_handle_name(None, rpc),
                                          iterate_queue(channel.queue), runtime_pb2.ExpertResponse)
            async for response in responses:  # the receiver only answers to refuse a push
                logger.warning(f"push to {peer_id} refused: {P.decode_reply(response.metadata)}")
        except Exception as e:
            logger.debug(f"{rpc} stream to {peer_id} ended: {e}")
        finally:
            channel.alive = False

    def push(self, chain: list, start_position: int, step_id: int, output: torch.Tensor,
             row_edits: Optional[dict] = None, compression: str = "none") -> bool:
        """Queue the output for chain[0] (telling it the rest of the chain and the step's row edits: beam parents,
        padding, `P.RowEdits`); False if no live stream took it."""
        if self.closed:
            return False  # the span is no longer served here; the client's copy of the step goes on
        target = chain[0]
        message = P.PushStep(stream_key=target.stream_key, push_token=target.push_token,
                             start_position=start_position, step_id=step_id, push_chain=list(chain[1:]),
                             **(row_edits or {}))
        return self._send("rpc_push", target.peer_id, message, [output], compression)

    def push_round(self, peer_id: str, message: P.Message, hidden: torch.Tensor) -> bool:
        """Queue a `RoundPush` (its rows' hidden states [tokens, hidden]) for `peer_id`; False if no live stream
        took it."""
        return self._send("rpc_round_push", peer_id, message, [hidden])

    def close(self) -> None:
        """End every push stream (the handler stops serving); later pushes are refused."""
        self.closed = True
        for channel in self._channels.values():
            channel.alive = False
            channel.queue.put_nowait(None)
        self._channels.clear()
