"""Client inference sessions: one long-lived stream per server of the chain, positions tracked end to end.

`InferenceSession.step(hidden [batch, seq, hidden]) -> [batch, seq, hidden]` sends the new positions through
every server of the chain; each server keeps the session's KV cache, so only new tokens travel. Long inputs
are cut into chunks that fit one message. `rewind(position)` makes the next step overwrite from an earlier
position (the servers drop the rest of their cache). The inputs sent to each span are kept so that a failed
span can be rebuilt on a replacement server by replaying them.
"""
from __future__ import annotations

import asyncio
import logging
import uuid
from typing import AsyncIterator, List, Optional

import torch

from swarm import aio
from swarm import protocol as P
from swarm.manager import SwarmManager
from swarm.routing import RouteHop

logger = logging.getLogger(__name__)


class SessionError(RuntimeError):
    """The session cannot go on (bad use, or the swarm failed past the retry bound)."""


class SpanStream:
    """The part of a session held by one server: blocks [hop.start, hop.end) over one bidirectional stream."""

    def __init__(self, manager: SwarmManager, hop: RouteHop, session_id: str, max_length: int, batch_size: int):
        self.manager, self.hop = manager, hop
        self.session_id, self.max_length, self.batch_size = session_id, max_length, batch_size
        self.position = 0  # tokens the server holds for this session
        self._queue: "asyncio.Queue[Optional[object]]" = asyncio.Queue()
        self._responses: Optional[AsyncIterator] = None
        self._step_id = 0

    async def _requests(self):
        while True:
            item = await self._queue.get()
            if item is None:
                return
            yield item

    async def _next_reply(self, forward: bool = False):
        try:
            response = await asyncio.wait_for(self._responses.__anext__(), timeout=self.manager.config.step_timeout)
        except StopAsyncIteration:
            raise P.RemoteError("closed", "the server closed the session", self.hop.peer_id) from None
        return P.unpack_reply(response, self.hop.peer_id)

    async def open(self) -> None:
        stub = self.manager.stub(self.hop.peer_id)
        self._responses = await stub.rpc_inference(self._requests())
        opened = P.OpenSession(session_id=self.session_id, start=self.hop.start, end=self.hop.end,
                               max_length=self.max_length, batch_size=self.batch_size)
        self._queue.put_nowait(P.make_request(opened))
        await self._next_reply()

    async def step(self, hidden: torch.Tensor, start_position: int) -> torch.Tensor:
        """hidden: [batch, seq, hidden] for positions start_position..; returns this span's output."""
        self._step_id += 1
        self._queue.put_nowait(P.make_request(P.Step(start_position=start_position, step_id=self._step_id), [hidden]))
        reply, tensors = await self._next_reply()
        if reply.position != start_position + hidden.shape[1] or len(tensors) != 1:
            raise P.RemoteError("bad_reply", f"server reported position {reply.position}", self.hop.peer_id)
        self.position = reply.position
        return tensors[0]

    async def close(self) -> None:
        self._queue.put_nowait(None)
        if self._responses is not None:
            try:
                await asyncio.wait_for(self._responses.aclose(), timeout=5)
            except Exception:  # the stream may already be gone
                pass


class InferenceSession:
    """A session over the whole block stack (or blocks [start, end)), usable as a context manager."""

    def __init__(self, manager: SwarmManager, max_length: int, start: int = 0, end: Optional[int] = None):
        if max_length <= 0:
            raise ValueError("max_length must be positive")
        self.manager, self.max_length = manager, max_length
        self.start, self.end = start, manager.num_blocks if end is None else end
        self.session_id = uuid.uuid4().hex
        self.position = 0
        self.batch_size: Optional[int] = None
        self._streams: List[SpanStream] = []
        self._closed = False

    # ---- public, synchronous ------------------------------------------------------------------------------
    def step(self, hidden: torch.Tensor) -> torch.Tensor:
        return aio.run(self.astep(hidden))

    def rewind(self, position: int) -> None:
        """Make the next step start at `position` (<= current position); later positions are forgotten."""
        if not 0 <= position <= self.position:
            raise ValueError(f"cannot rewind to {position}: the session holds {self.position} tokens")
        self.position = position

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            aio.run(self._close_streams(), timeout=30)

    def __enter__(self) -> "InferenceSession":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    @property
    def chain(self) -> List[RouteHop]:
        return [s.hop for s in self._streams]

    # ---- async --------------------------------------------------------------------------------------------
    async def _open(self, batch_size: int) -> None:
        hops = await asyncio.get_running_loop().run_in_executor(
            None, lambda: self.manager.make_inference_chain(self.start, self.end, batch_size * self.max_length)
        )
        streams = [SpanStream(self.manager, hop, self.session_id, self.max_length, batch_size) for hop in hops]
        results = await asyncio.gather(*(s.open() for s in streams), return_exceptions=True)
        errors = [r for r in results if isinstance(r, BaseException)]
        if errors:
            await asyncio.gather(*(s.close() for s in streams), return_exceptions=True)
            raise errors[0]
        self._streams, self.batch_size = streams, batch_size

    async def _close_streams(self) -> None:
        await asyncio.gather(*(s.close() for s in self._streams), return_exceptions=True)
        self._streams = []

    def _chunk_len(self, batch: int, hidden_size: int, itemsize: int) -> int:
        return max(1, self.manager.config.max_chunk_bytes // (batch * hidden_size * itemsize))

    async def astep(self, hidden: torch.Tensor) -> torch.Tensor:
        if self._closed:
            raise SessionError("this inference session is closed")
        if hidden.ndim != 3:
            raise ValueError(f"hidden states must be [batch, seq, hidden], got shape {list(hidden.shape)}")
        batch, seq, hidden_size = hidden.shape
        if self.position + seq > self.max_length:
            raise SessionError(
                f"this step would hold {self.position + seq} tokens, past the session's max_length {self.max_length}"
            )
        if self.batch_size is None:
            await self._open(batch)
        elif batch != self.batch_size:
            raise ValueError(f"batch size {batch} differs from the session's {self.batch_size}")
        outputs = []
        chunk = self._chunk_len(batch, hidden_size, hidden.element_size())
        for offset in range(0, seq, chunk):
            x = hidden[:, offset:offset + chunk]
            for stream in self._streams:
                x = await stream.step(x, self.position)
            outputs.append(x)
            self.position += x.shape[1]
        return torch.cat(outputs, dim=1) if len(outputs) > 1 else outputs[0]
