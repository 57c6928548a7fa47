"""One server's part of a client inference session: `SpanStream` holds blocks [start, end) of the session on one
server over one bidirectional stream (open, queue steps, read replies in order, a late one waited for while the
server answers liveness pings: `liveness.wait_while_alive`, close), that stream being a part of the client's
session channel to the server where it has one (`channel`); `SessionError` is what a session raises when it
cannot go on.

`swarm.client.transport.session.InferenceSession` chains one `SpanStream` per server and replaces a failed one.
"""
from __future__ import annotations

import asyncio
import secrets
from typing import Callable, Optional, Union

import torch

from swarm.client.transport.channel import Part, session_channel
from swarm.client.transport.liveness import wait_while_alive
from swarm.client.transport.manager import SwarmManager
from swarm.client.transport.routing import RouteHop
from swarm.runtime import aio
from swarm.wire import protocol as P
from swarm.wire.dtypes import DTYPES
from swarm.wire.duplex import Replies


class SessionError(RuntimeError):
    """The session cannot go on (bad use, or the swarm failed past the retry bound)."""


class SpanStream:
    """The part of a session held by one server: blocks [hop.start, hop.end) over one bidirectional stream."""

    def __init__(self, manager: SwarmManager, hop: RouteHop, session_id: str, max_length: int, batch_size: int,
                 adapter: Optional[str] = None, prompts: Optional[torch.Tensor] = None,
                 prefix: Optional[P.PrefixDecl] = None, outputs_later: bool = False):
        """`prefix`: the session's prompt, declared to a server that announces `prefix_cache` (its prefix pages);
        `outputs_later`: the server keeps its outputs at the positions it holds of it (where it announces
        `prefix_outputs`) until `held_outputs_now` asks for them, instead of sending them with the opening's reply."""
        self.manager, self.hop = manager, hop
        self.prefix = prefix if prefix is not None and "prefix_cache" in hop.capabilities else None
        self.outputs_later = outputs_later and self.prefix is not None and "prefix_outputs" in hop.capabilities
        # what the server held of the declared prompt when it opened (positions), with its outputs there
        # [batch, held, hidden] (read only by an `open` that waits for the reply; None where the server keeps them:
        # `outputs_later`)
        self.held = 0
        self.held_outputs: Optional[torch.Tensor] = None
        self.prompts = prompts  # deep prompts of this hop's blocks [hop.length, 1, pre_seq_len, hidden], or None
        self.session_id, self.max_length, self.batch_size = session_id, max_length, batch_size
        self.key = P.stream_key(session_id, hop.start)  # the part's name on its server
        self.adapter = adapter
        self.position = 0  # tokens the server holds for this session
        self._queue: "asyncio.Queue[Optional[object]]" = asyncio.Queue()
        self._put: Callable[[Optional[object]], None] = self._queue.put_nowait  # a message out (None: the end)
        self._responses: Optional[Union[Replies, Part]] = None
        self._pending: Optional[asyncio.Future] = None  # the next reply, possibly awaited across time-outs
        self.open_pending = False  # OpenSession sent, its reply not read yet (read before the first step's)
        # the server was found gone on another stream (this part's round stream: `rounds.RoundStream`): the next
        # reply raises it at once, so that the session fails the server over without waiting on it again
        self.failed: Optional[BaseException] = None
        self.push_token = secrets.token_urlsafe(24)  # only the previous server of the chain learns it
        self._push_target: Optional[P.PushTarget] = None
        # hidden states go out in the server's dtype (what it computes in anyway): a bfloat16 server gets half the
        # bytes of the client's float32; None where the server announced none the wire knows (sent as they are)
        self.wire_dtype = DTYPES.get(hop.dtype) if hop.dtype else None

    async def _next_reply(self, timeout: Optional[float] = None):
        if self.failed is not None:
            self._abandon_pending()
            raise self.failed
        if self._pending is None:
            assert self._responses is not None, "the stream is not open"
            self._pending = asyncio.ensure_future(self._responses.__anext__())
        try:
            if timeout is None:
                response = await wait_while_alive(self.manager, self.hop.peer_id, self._pending)
            else:
                # shield: a short wait (for a push) that times out must not lose the reply still on its way
                response = await asyncio.wait_for(asyncio.shield(self._pending), timeout=timeout)
            self._pending = None
        except asyncio.TimeoutError:
            if timeout is None:
                self._abandon_pending()
            raise
        except StopAsyncIteration:
            self._pending = None
            raise P.RemoteError("closed", "the server closed the session", self.hop.peer_id) from None
        except Exception:
            self._abandon_pending()
            raise
        return P.unpack_reply(response, self.hop.peer_id)

    def _abandon_pending(self) -> None:
        """Give up on the reply still awaited from a failed server (cancelled: it would end, unread, in an
        exception that asyncio reports as never retrieved)."""
        if self._pending is not None and not self._pending.done():
            self._pending.cancel()
        self._pending = None

    async def open(self, wait: bool = True) -> None:
        """Open the stream and the server's session. With `wait=False` the OpenSession reply is read before the
        first step's reply instead (the step goes out without waiting a round trip); its error, if any, then
        surfaces as that step's failure."""
        if self.in_channel:  # a part of the client's session channel to this server (`channel`)
            part = await session_channel(self.manager, self.hop.peer_id).open_part()
            self._responses, self._put = part, part.put
        else:
            self._responses = await self.manager.stub(self.hop.peer_id).rpc_inference(aio.iterate_queue(self._queue))
        opened = P.OpenSession(session_id=self.session_id, start=self.hop.start, end=self.hop.end,
                               max_length=self.max_length, batch_size=self.batch_size, adapter=self.adapter,
                               prompts=self.prompts is not None, push_token=self.push_token if self.pushes else None,
                               compression=self.compression, prefix=self.prefix,
                               prefix_outputs=not self.outputs_later)
        P.check_capabilities(opened, self.hop.capabilities, self.hop.peer_id)  # routing chose a server that takes it
        self._put(P.make_request(opened, [] if self.prompts is None else [self.prompts]))
        if wait:
            reply, tensors = await self._next_reply()
            held = getattr(reply, "position", 0)
            if self.prefix is not None and held > 0:
                if self.outputs_later and tensors:
                    raise P.RemoteError("bad_reply", "the server sent outputs with its opening's reply, asked to keep "
                                                     "them", self.hop.peer_id)
                if not self.outputs_later:
                    self.held_outputs = self._checked_outputs(tensors, held)
                self.held = held
                self.position = held
        else:
            self.open_pending = True

    def _checked_outputs(self, tensors: list, positions: int) -> torch.Tensor:
        """The one tensor of a reply that carries this span's outputs at positions [0, positions)."""
        if len(tensors) != 1 or tensors[0].ndim != 3 or list(tensors[0].shape[:2]) != [self.batch_size, positions]:
            raise P.RemoteError("bad_reply", f"the server holds {positions} prefix positions but sent outputs "
                                             f"{[list(t.shape) for t in tensors]}", self.hop.peer_id)
        return tensors[0]

    async def held_outputs_now(self, positions: int) -> torch.Tensor:
        """This span's outputs at the first `positions` prefix positions its server adopted at the opening and kept
        (`outputs_later`), from the server (`rpc_prefix_outputs`): [batch, positions, hidden]. Raises what the call
        raises (the server gone, an error reply)."""
        assert self.outputs_later and 0 < positions <= self.held, "the server kept no such outputs"
        asked = P.PrefixOutputsRequest(stream_key=self.key, positions=positions)
        P.check_capabilities(asked, self.hop.capabilities, self.hop.peer_id)
        response = await self.manager.stub(self.hop.peer_id).rpc_prefix_outputs(
            P.make_request(asked), timeout=self.manager.config.request_timeout)
        reply, tensors = P.unpack_reply(response, self.hop.peer_id)
        if getattr(reply, "position", None) != positions:
            raise P.RemoteError("bad_reply", f"asked for {positions} positions' outputs, the reply says "
                                             f"{getattr(reply, 'position', None)}", self.hop.peer_id)
        return self._checked_outputs(tensors, positions)

    def drop_channel(self) -> None:
        """End the session channel this part is in (its server did not answer: every part in it fails over at once,
        and the next opening there takes a new channel rather than one that waits on a frozen server)."""
        if isinstance(self._responses, Part):
            self._responses.channel.close()

    @property
    def in_channel(self) -> bool:
        """Whether this part goes in the client's session channel to its server (it announces `session_channels`
        and the client's `session_channels` option is on) rather than on a stream of its own."""
        return self.manager.config.session_channels and "session_channels" in self.hop.capabilities

    @property
    def pushes(self) -> bool:
        """Whether the server takes part in server-to-server push (it announces `push`): only then does its session
        get a push token and its steps a push chain, and only then is it a push's target."""
        return "push" in self.hop.capabilities

    @property
    def push_target(self) -> P.PushTarget:
        """This part as the previous server's push target (made once per token: a round names it at every step)."""
        target = self._push_target
        if target is None or target.push_token != self.push_token:
            target = self._push_target = P.PushTarget(peer_id=self.hop.peer_id, stream_key=self.key,
                                                      push_token=self.push_token)
        return target

    @property
    def compression(self):
        """The client's compression, for a server that announces the capability (None otherwise: the field is
        left out of OpenSession and the tensors travel raw, as a server from before it expects)."""
        wanted = self.manager.config.compression
        return wanted if wanted is not None and "compression" in self.hop.capabilities else None

    def send(self, hidden: torch.Tensor, start_position: int, step_id: int, push_chain=(),
             edits: Optional[dict] = None) -> None:
        """Queue a step: hidden [batch, seq, hidden] for positions start_position.. (returns at once); `edits`:
        the step's `P.RowEdits` fields (beam parents, padding)."""
        step = P.Step(start_position=start_position, step_id=step_id, push_chain=list(push_chain), **(edits or {}))
        P.check_capabilities(step, self.hop.capabilities, self.hop.peer_id)  # the session keeps to servers with it
        if self.wire_dtype is not None and hidden.is_floating_point():
            hidden = hidden.to(self.wire_dtype)
        self._put(P.make_request(step, [hidden], compression=self.compression or "none"))

    async def receive(self, start_position: int, seq: int, timeout: Optional[float] = None):
        """The reply to the step at start_position: (output [batch, seq, hidden], pushed)."""
        if self.open_pending:
            await self._next_reply(timeout)  # the OpenSession reply (an error reply raises here)
            self.open_pending = False
        reply, tensors = await self._next_reply(timeout)
        if reply.position != start_position + seq or len(tensors) != 1:
            raise P.RemoteError("bad_reply", f"server reported position {reply.position}", self.hop.peer_id)
        self.position = reply.position
        return tensors[0], reply.pushed

    async def step(self, hidden: torch.Tensor, start_position: int, step_id: int,
                   edits: Optional[dict] = None) -> torch.Tensor:
        self.send(hidden, start_position, step_id, edits=edits)
        output, _ = await self.receive(start_position, hidden.shape[1])
        return output

    async def close(self) -> None:
        self._put(None)
        if self._pending is not None:
            self._pending.cancel()
        if self._responses is not None:
            try:
                await asyncio.wait_for(self._responses.aclose(), timeout=5)
            except Exception:  # the stream may already be gone
                pass
