"""The inference stream's side of the prefix cache (`server.compute.prefix_cache`): what a session that declared its
prompt (`OpenSession.prefix`) adopts when it opens, which of its positions are still that prompt, and the pages it
stores after its steps; and `rpc_prefix_cache`, the cache's counters.

At the opening (`_prefix_open`): the session's page keys are computed from the declared tokens; the leading pages
the cache holds (waiting, up to the cache's `wait` s, for pages that another session is computing now: single-flight)
are the session's (copied into its cache by its first step, or in idle time before it: `PrefixCache.adopt_later`),
and the session claims the pages nobody holds or computes. The reply to the
OpenSession says how many positions the session holds (`StepResult.position`) and carries the span's outputs at them,
unless the client asked for them later (`OpenSession.prefix_outputs` False): then the session keeps them (the pages'
own output tensors, read-only: no copy) and `rpc_prefix_outputs` sends them to the peer that opened the session when
it needs them (a failover replay of the next span, a caller that wants every position's output). Shipping them at
every opening was most of an adopting session's cost (2.4 MB per server for the bundled model's 1,024 positions,
serialized on both sides while other sessions wait: docs/benchmarks.md, bench_prefix).

After each step (`_prefix_after_step`): the positions that are still the declared prompt (`PrefixState.written`:
written in order from 0 by the session's steps; a step that starts before the session's end, after its first one,
rewrites positions with what may be other tokens: the declaration ends there) have their outputs kept, and every
page they complete is counted as computed and stored (where the budget has room). The stream's end, and a step of it
that fails, give up its claims (`_prefix_close`): its waiters compute those pages themselves.

`prefix_summary`: what the cache holds, for the server's DHT record (clients' routing prefers holders of a prefix).
"""
from __future__ import annotations

import asyncio
import logging
import weakref
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional

import torch
from hivemind.p2p import P2PContext
from hivemind.proto import runtime_pb2

from server.compute.blocks import BlockSpan
from server.compute.prefix_cache import PageKey, PrefixCache, fill_when_idle, page_digests
from server.rpc.limits import LimitError, RpcLimits
from swarm.runtime.swarm_key import NOT_A_MEMBER
from swarm.runtime.taskpool import PRIORITY_IDLE, PRIORITY_PREFILL, TaskPool
from swarm.wire import protocol as P
from swarm.wire.prefix_pages import PrefixSummary, summarize

logger = logging.getLogger(__name__)

REPLY_ROOM = 64 << 10  # bytes of a reply kept for its metadata


@dataclass
class PrefixState:
    """One session's use of the prefix cache."""
    keys: List[PageKey]  # its declared prompt's full pages
    limit: int  # positions that may still be the declared prompt
    claimed: List[int] = field(default_factory=list)  # indexes of the pages this session computes for others
    written: int = 0  # positions [0, written) hold the declared prompt
    next_page: int = 0  # the first page not stored (nor adopted) yet
    outputs: Optional[torch.Tensor] = None  # [1, limit, hidden]: the span's outputs at the declared positions
    stepped: bool = False  # a step ran since the opening
    # the span's outputs at the positions adopted at the opening, one [1, P, hidden] per page (read-only), kept for
    # `rpc_prefix_outputs` when the opening's reply did not carry them
    adopted: List[torch.Tensor] = field(default_factory=list)
    filling: Optional["asyncio.Future"] = None  # the idle-time copy of the adopted pages (`fill_when_idle`)


class PrefixHandler:
    """The prefix-cache part of `server.rpc.handler.BlockHandler` (`prefix_cache` None: off)."""

    span: BlockSpan
    pool: TaskPool
    limits: RpcLimits
    prefix_cache: Optional[PrefixCache] = None

    open_parts: Dict[str, Any]  # stream key -> the open session part (`server.rpc.inference._Stream`)

    def _admits(self, context: P2PContext, proof: str) -> bool:
        raise NotImplementedError

    async def _prefix_open(self, kv, opened: P.OpenSession) -> "tuple[Optional[PrefixState], Optional[torch.Tensor]]":
        """(the session's prefix state, the outputs of the positions it adopted [1, held, hidden] for the opening's
        reply, or None: none adopted, or the client asked for them later: `PrefixState.adopted` keeps them)."""
        cache, decl = self.prefix_cache, opened.prefix
        if cache is None or decl is None:
            return None, None
        why = cache.declines(kv, opened.batch_size, opened.prompts, self.span.by_length)
        if why is not None:
            cache.counters.sessions_declined += 1
            logger.debug(f"prefix cache declines a session: {why}")
            return None, None
        size = cache.page_tokens
        limit = min(len(decl.tokens), opened.max_length)
        keys: List[PageKey] = [(opened.start, opened.end, digest) for digest in
                               page_digests(decl.salt, opened.adapter, opened.start, opened.end, size,
                                            decl.tokens[:limit])]
        state = PrefixState(keys=keys, limit=limit)
        count = await cache.wait_for(keys, cache.wait) if keys else 0
        # the adopted positions' outputs go in the reply: at most what one message may carry (float32 at most)
        fits = (self.limits.max_message_bytes - REPLY_ROOM) // (4 * self.span.hidden_size) // size
        count = min(count, max(fits, 0))
        claimed = set(cache.claim(keys[count:]))  # (before the copy's wait: nobody else starts computing them)
        state.claimed = [i for i in range(count, len(keys)) if keys[i] in claimed]
        outputs = None
        if count:
            # the session holds the pages now; their copy into its cache is done by its first step, or in idle time
            # before it (`PrefixCache.adopt_later`): the opening's reply waits for no compute
            state.adopted = cache.adopt_later(kv, cache.pages_of(keys[:count]), size)
            state.filling = self.pool.submit(PRIORITY_IDLE, fill_when_idle, weakref.ref(kv))
            cache.counters.pages_hit += count
            state.next_page, state.written = count, count * size
            if opened.prefix_outputs:  # sent in the reply: not kept
                outputs, state.adopted = torch.cat(state.adopted, dim=1), []
        return state, outputs

    async def _prefix_after_step(self, kv, state: Optional[PrefixState], start: int, held_before: int,
                                 output: torch.Tensor) -> None:
        """Note a step over positions [start, start + seq) (the session held `held_before` before it) and store the
        pages it completed."""
        if self.prefix_cache is None or state is None:
            return
        try:
            await self._note_step(self.prefix_cache, kv, state, start, held_before, output)
        except Exception:  # noqa: BLE001 - the step's output stands; its pages are not kept
            logger.exception("storing prefix pages failed")
            state.limit = 0
            self._prefix_close(state)  # nor will it compute them: its waiters go on

    async def _note_step(self, cache: PrefixCache, kv, state: PrefixState, start: int, held_before: int,
                         output: torch.Tensor) -> None:
        seq, size = output.shape[1], cache.page_tokens
        if kv.padding is not None:  # left-padded rows: other positions than the prompt's
            state.limit = 0
        if state.stepped and start < held_before:  # a rewind: what follows may be other tokens
            state.limit = min(state.limit, start)
        state.stepped = True
        if start <= state.written:
            state.written = min(start + seq, state.limit) if start < state.limit else min(state.written, state.limit)
            end = min(start + seq, state.limit)
            if end > start:
                if state.outputs is None:
                    state.outputs = torch.empty(1, state.limit, output.shape[-1], dtype=output.dtype)
                state.outputs[:, start:end] = output[:1, :end - start].to("cpu")
        complete = min(state.written // size, len(state.keys))
        cache.counters.pages_computed += max(complete - state.next_page, 0)  # (stored below or not)
        todo = [i for i in range(state.next_page, complete) if state.keys[i] not in cache.pages]
        state.next_page = max(state.next_page, complete)
        outputs = state.outputs
        cache.touch(state.keys[:complete])  # the chain's held pages first: the room made below is others' pages
        room = cache.room_for(len(todo), cache.cost_in(kv, outputs) if todo and outputs is not None else None)
        if room:
            assert outputs is not None  # (pages complete only where the steps' outputs were kept)
            pages = await self.pool.submit(PRIORITY_PREFILL, lambda: [cache.cut(kv, i, size, outputs)
                                                                      for i in todo[:room]])
            for i, page in zip(todo[:room], pages):
                if i > 0 and state.keys[i - 1] not in cache.pages:
                    break  # a page after a gap could never be adopted: it would only hold budget
                cache.store(state.keys[i], page)
            cache.touch(state.keys[:complete])  # (the chain's first page most recently used: evicted last)
        # claims this session has done with: stored, past its written positions, or past its declared prompt
        done = [i for i in state.claimed if i < complete or (i + 1) * size > state.limit]
        cache.unclaim([state.keys[i] for i in done])
        state.claimed = [i for i in state.claimed if i not in done]

    def _prefix_close(self, state: Optional[PrefixState]) -> None:
        """The session will not compute the pages it claimed (its stream ended, or a step failed and the client may
        go elsewhere): sessions waiting for them go on and compute them themselves."""
        if self.prefix_cache is not None and state is not None:
            self.prefix_cache.unclaim([state.keys[i] for i in state.claimed])
            state.claimed = []

    def prefix_summary(self) -> Optional[PrefixSummary]:
        """What the cache holds, for the server's DHT record (`swarm.wire.prefix_pages`: the most recently used pages
        first; None: nothing held, or the cache is off)."""
        cache = self.prefix_cache
        if cache is None:
            return None
        return summarize(reversed(cache.pages), cache.page_tokens)

    def prefix_report(self) -> P.PrefixCacheReport:
        cache = self.prefix_cache
        if cache is None:
            return P.PrefixCacheReport(enabled=False)
        c = cache.counters
        return P.PrefixCacheReport(enabled=True, page_tokens=cache.page_tokens, pages_held=len(cache.pages),
                                   pages_hit=c.pages_hit, pages_computed=c.pages_computed,
                                   pages_evicted=c.pages_evicted, sessions_declined=c.sessions_declined)

    async def rpc_prefix_cache(self, request: runtime_pb2.ExpertUID, context: P2PContext) -> runtime_pb2.ExpertInfo:
        if not self._admits(context, request.uid):
            raise PermissionError(NOT_A_MEMBER)
        return runtime_pb2.ExpertInfo(serialized_info=P.encode(self.prefix_report()))

    async def rpc_prefix_outputs(self, request: runtime_pb2.ExpertRequest, context: P2PContext
                                 ) -> runtime_pb2.ExpertResponse:
        """The outputs at the first `positions` positions that an open session part adopted at its opening
        (`PrefixState.adopted`), for the peer that opened it; an `ErrorReply` for anything else."""
        version = P.request_version(request.metadata)
        if not self._admits(context, request.uid):
            return P.error_response("forbidden", NOT_A_MEMBER, version)
        try:
            self.limits.check_message(request)
            asked = P.decode(request.metadata, P.PrefixOutputsRequest)
            if request.tensors:
                raise P.ProtocolError(f"PrefixOutputsRequest carries no tensors, got {len(request.tensors)}")
            stream = self.open_parts.get(asked.stream_key)
            if stream is None or stream.peer != str(context.remote_id):
                raise P.ProtocolError(f"no session part {asked.stream_key} of this peer is open here")
            adopted = stream.prefix.adopted if stream.prefix is not None else []
            held = sum(t.shape[1] for t in adopted)
            if asked.positions > held:
                raise P.ProtocolError(f"the session part kept the outputs of {held} adopted positions, not "
                                      f"{asked.positions}")
        except LimitError as e:
            return P.error_response("over_limit", str(e), version)
        except P.ProtocolError as e:
            return P.error_response("bad_request", str(e), version)
        outputs = torch.cat(adopted, dim=1)[:, :asked.positions]  # [1, positions, hidden]
        return P.make_response(P.StepResult(position=asked.positions), [outputs], compression=stream.compression,
                               version=version)
