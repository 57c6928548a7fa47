"""This server's record in the DHT: what the server announces and when, and reading the swarm back.

A record (`swarm.wire.records.ServerInfo`: state, span, throughput, dtype, quant_type, LoRA adapters, free cache,
RTTs to the next servers, the release, protocol versions and capabilities: `swarm.wire.capabilities`) is stored
under each block the server holds, always with the full lifetime (`--expiration`, default twice `--update_period`),
since the DHT keeps whichever value of a key expires later. `Announcer` keeps what was last announced, so that the
supervisor refreshes the record every `--update_period`, or sooner when the free cache changed by a tenth of the
budget or the prefix cache holds other pages (its summary, `swarm.wire.prefix_pages`, goes in the online record);
moving the span announces the blocks left behind as offline. A full read that finds servers of a newer
release logs one line, once. Reading the swarm back: `spans` (every block's key; the last result kept as `view`),
`unserved` (a few blocks' keys: the hole watch between full reads), and the next servers' RTTs read block `end`'s
key alone. While online, the server's model (`ModelRecord`) is also announced under the one `MODELS_KEY`, where a
gateway started with `--model all` finds every model of the swarm. The record reads the DHT peer, and how the server
is reached, from the server's network (`DHTPeer`: `server.network.identity.ServerNetwork`, which alone replaces them).
"""
from __future__ import annotations

import asyncio
import logging
import time
from functools import partial
from typing import Callable, Dict, FrozenSet, List, Optional, Protocol, Sequence, Tuple

import hivemind
import torch
from hivemind.utils import get_dht_time

from server.placement.pings import measure_next_pings
from swarm import __version__
from swarm.runtime.swarm_key import SwarmKey, proof_for
from swarm.wire.capabilities import MIN_PROTOCOL_VERSION, OWN_CAPABILITIES, PROTOCOL_VERSION, parse_release
from swarm.wire.prefix_pages import PrefixSummary
from swarm.wire.reachability import Reachable
from swarm.wire.records import (
    ModelRecord,
    ServerInfo,
    ServerLimits,
    ServerSpan,
    ServerState,
    block_key,
    declare_blocks,
    declare_model,
    fetch_block_records,
    fetch_spans_at,
    online_spans,
)

logger = logging.getLogger("swarmgate.server")

OFFLINE_RETRIES = 3  # stores again of an offline record under the blocks whose store failed


class DHTPeer(Protocol):
    """What the record needs of the server's network: the DHT peer now, and how the server is reached."""

    @property
    def dht(self) -> Optional[hivemind.DHT]: ...

    @property
    def reachable(self) -> Reachable: ...


def swarm_spans(dht: hivemind.DHT, prefix: str, num_blocks: int) -> List[ServerSpan]:
    """Every server's span as the DHT announces it, joining servers included (they count for placement)."""
    return online_spans(fetch_block_records(dht, prefix, num_blocks), include_joining=True)


class Announcer:
    """What this server says about itself in the DHT (span `start:end`, state, throughput, next pings)."""

    def __init__(self, prefix: str, expiration: float, num_blocks_total: int, dtype: torch.dtype,
                 free_cache_tokens: Callable[[], int], quant_type: str = "none", adapters: Sequence[str] = (),
                 peer: Optional[DHTPeer] = None):
        self.peer = peer  # the server's network (None: a record that is only built, never stored)
        self.prefix, self.expiration, self.num_blocks_total = prefix, expiration, num_blocks_total
        self.dtype, self.quant_type = dtype, quant_type
        self.adapters = tuple(adapters)  # the LoRA adapters this server holds for its blocks
        self.free_cache_tokens = free_cache_tokens
        self.start = self.end = 0
        self.public_name = ""  # the operator's `--public_name` (set by the server)
        self.tensor_parallel = 1  # devices each block is split across (set by the server)
        self.state = ServerState.JOINING
        self.throughput = 1.0
        self.swarm_key: Optional[SwarmKey] = None  # a private swarm's key (set by the server): pings prove membership
        self.next_pings: Dict[str, float] = {}  # peer id -> RTT (s) to servers that can run block `end`
        self.limits: Optional[ServerLimits] = None  # the RPC limits this server enforces (set by the server)
        self.model: Optional[ModelRecord] = None  # announced under MODELS_KEY while online (set by the server)
        # what the prefix cache holds now (`swarm.wire.prefix_pages`; set by the server), and the pages last announced
        self.prefix_summary: Callable[[], Optional[PrefixSummary]] = lambda: None
        self.announced_pages: FrozenSet[Tuple[int, int, str]] = frozenset()
        self.view: Optional[Tuple[float, List[ServerSpan]]] = None  # (monotonic time, spans) of the last full read
        self.newer_release_noted = False  # a newer release was seen in the swarm and logged (once)
        # observable counters (tests, logs) and what the last announcement said
        self.announcements = 0
        self.announced_free: Optional[int] = None
        self.last_announce = 0.0

    @property
    def dht(self) -> Optional[hivemind.DHT]:
        return self.peer.dht if self.peer is not None else None

    @property
    def reachable(self) -> Reachable:
        """`direct`, or `relayed`: behind a NAT, served through a relay (`server.network.reachable`)."""
        return self.peer.reachable if self.peer is not None else "direct"

    def info(self, state: ServerState, start: Optional[int] = None, end: Optional[int] = None) -> ServerInfo:
        return ServerInfo(state=state, public_name=self.public_name, start=self.start if start is None else start,
                          end=self.end if end is None else end, throughput=self.throughput,
                          cache_tokens_left=self.free_cache_tokens(), version=__version__,
                          protocol=PROTOCOL_VERSION, min_protocol=MIN_PROTOCOL_VERSION, capabilities=OWN_CAPABILITIES,
                          dtype=str(self.dtype).replace("torch.", ""), quant_type=self.quant_type,
                          adapters=self.adapters, next_pings=dict(self.next_pings), limits=self.limits,
                          tensor_parallel=self.tensor_parallel, reachable=self.reachable,
                          prefixes=self.prefix_summary() if state == ServerState.ONLINE else None)

    async def declare(self, blocks: Sequence[int], info: ServerInfo) -> List[int]:
        """Store `info` under each of `blocks`; returns the blocks whose store no DHT node took."""
        if not blocks:
            return []
        assert self.dht is not None, "announcing needs the DHT peer"
        # always now + the full lifetime: the DHT keeps whichever value of a key expires later
        when = get_dht_time() + self.expiration
        stored = await asyncio.get_running_loop().run_in_executor(
            None, lambda: declare_blocks(self.dht, self.prefix, list(blocks), info, when)
        )
        # hivemind answers per (key, sub-key): False or missing where no node took the value
        subkey = self.dht.peer_id.to_base58()
        return [block for block in blocks if not (stored or {}).get((block_key(self.prefix, block), subkey))]

    async def announce(self, state: ServerState) -> None:
        """Store this server's record (state, span, throughput, free cache) under each of its blocks."""
        info = self.info(state)
        failed = await self.declare(range(self.start, self.end), info)
        # a stop must leave no block announcing this server online until its record expires: the blocks whose
        # store failed are stored again (bounded by the caller's time-out); an online record is refreshed anyway
        for attempt in range(OFFLINE_RETRIES if state == ServerState.OFFLINE else 0):
            if not failed:
                break
            logger.info(f"announcing {state.value} again under blocks {failed} (no DHT node took the store)")
            await asyncio.sleep(0.1 * (attempt + 1))
            failed = await self.declare(failed, info)
        if state == ServerState.ONLINE and self.model is not None:  # for gateways started with `--model all`
            record, when = self.model, get_dht_time() + self.expiration
            await asyncio.get_running_loop().run_in_executor(
                None, lambda: declare_model(self.dht, record, when))
        self.state = state
        self.announcements += 1
        self.announced_free = info.cache_tokens_left
        self.announced_pages = self._pages(info.prefixes)
        self.last_announce = time.monotonic()

    async def leave_blocks(self, start: int, end: int) -> None:
        """Announce the blocks outside `start:end` offline and make `start:end` the span (announced next)."""
        left = [i for i in range(self.start, self.end) if not start <= i < end]
        if left:
            await self.declare(left, self.info(ServerState.OFFLINE))
        self.start, self.end = start, end

    async def spans(self) -> List[ServerSpan]:
        """Every server's span (every block's key read); kept as `view`."""
        spans = await asyncio.get_running_loop().run_in_executor(
            None, swarm_spans, self.dht, self.prefix, self.num_blocks_total)
        self.view = (time.monotonic(), spans)
        self.note_newer_releases(spans)
        return spans

    def note_newer_releases(self, spans: Sequence[ServerSpan]) -> Optional[str]:
        """Log one line, once, when servers of a newer release than this one's run in the swarm; returns it."""
        if self.newer_release_noted:
            return None
        own = parse_release(__version__)
        if own is None:
            return None
        found = {}
        for span in spans:
            seen = parse_release(span.info.version)
            if seen is not None and seen > own:
                found[seen] = span.info.version
        if not found:
            return None
        newer = [found[key] for key in sorted(found)]
        self.newer_release_noted = True
        line = (f"servers of a newer release run in this swarm ({', '.join(newer[-3:])}; this server: {__version__}): "
                f"upgrade when you can (docs/compatibility.md)")
        logger.warning(line)
        return line

    async def unserved(self, blocks: Sequence[int]) -> List[int]:
        """Which of `blocks` no JOINING or ONLINE server announces now (only their keys read)."""
        records = await asyncio.get_running_loop().run_in_executor(
            None, partial(fetch_block_records, self.dht, self.prefix, self.num_blocks_total, blocks=blocks))
        serving = (ServerState.JOINING, ServerState.ONLINE)
        return [b for b in blocks if not any(info.state in serving for info in records[b].values())]

    async def measure_next_pings(self, p2p, peer_id: str) -> None:
        """RTTs to the servers that can run the block after this span, for latency-aware routing."""
        if self.end >= self.num_blocks_total or p2p is None:
            self.next_pings = {}
            return
        try:
            # the servers that hold block `end`: that block's key alone, not the whole swarm's
            candidates = await asyncio.get_running_loop().run_in_executor(
                None, fetch_spans_at, self.dht, self.prefix, self.num_blocks_total, self.end)
            self.next_pings = await measure_next_pings(p2p, candidates, peer_id, self.end,
                                                       proof=proof_for(self.swarm_key, peer_id))
        except Exception as e:  # measuring is best effort; the record goes out anyway
            logger.debug(f"measuring next pings failed: {e}")

    @staticmethod
    def _pages(summary: Optional[PrefixSummary]) -> FrozenSet[Tuple[int, int, str]]:
        if summary is None:
            return frozenset()
        return frozenset((r.first, r.last, page) for r in summary.ranges for page in r.pages)

    def prefixes_changed(self) -> bool:
        """Whether the prefix cache holds other pages than the last announcement said (a use of held pages, which
        only reorders them, is no change)."""
        return self._pages(self.prefix_summary()) != self.announced_pages

    def cache_changed(self, budget_tokens: Optional[int]) -> bool:
        """Whether the free cache moved by a tenth of the budget since the last announcement."""
        if self.announced_free is None or budget_tokens is None:
            return True
        return abs(self.free_cache_tokens() - self.announced_free) >= 0.1 * budget_tokens
