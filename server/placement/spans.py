"""Choosing and moving this server's span of blocks: sizing, placement at start, rebalancing later.

- Sizing (`plan`): how many blocks fit in the device's free memory with their share of the KV cache budget
  (`server.placement.memory.plan_capacity`; `--num_blocks` / `--attn_cache_tokens` override, `--block_indices` pins).
- Placement (`place`): `--block_indices`, or the least-served window of the swarm (`placement.choose_best_span`
  over the throughput of joining and online servers), announced as joining and re-checked a few times after
  random short delays, so that servers started at the same moment do not all take the same blocks.
- Rebalancing (`maybe_rebalance`, `move`): move when `placement.should_move` says the swarm's weakest block
  would get more than 1/`--balance_quality` faster, after a random delay and a second look; a move announces
  the old blocks offline and the new ones joining, takes no new sessions, lets running ones finish within
  `--drain_timeout`, unloads, loads the new blocks and announces online.
- Hole watch (`check_holes`, `fill_hole`): a server without pinned blocks looks for blocks nobody serves every
  `--hole_check_period` (times servers/100 in swarms of more than 100, so that the swarm's DHT reads stay
  bounded); if moving would cover some, it waits its turn (`placement.hole_fill_turn`, `hole_fill_delay`), looks
  again and moves. The first server in turn moves at once; the others find the hole served (joining counts).
  Before each check it pings the servers that alone serve some block (`server.placement.liveness`): the records of one
  that does not answer (SIGKILLed, crashed) are left out of the hole watch's, the move's and the rebalancing's view, so
  its hole is filled without waiting for its record to expire.
  A look reads every block's key only in swarms of up to `HOLE_FULL_READ_SWARM` servers, or when its last full
  read is `full_read_due`; in between it reads only the keys of the blocks that at most `THIN_SERVERS` servers
  served at that read (`placement.thin_blocks`: where the last servers of a block can leave before the next full
  read), and reads everything as soon as one of those has nobody. A full read costs O(servers) bytes, so a
  server's hole-watch traffic stays flat as the swarm grows instead of growing with it.

The functions work on a `SpanHost` (the server process, `server.server.Server`).
"""
from __future__ import annotations

import logging
import random
import time
from typing import Any, Optional, Protocol, Tuple

import torch

from server.compute.loading import packed_rows_for
from server.config import ServerConfig
from server.placement.announce import Announcer
from server.placement.liveness import HolderLiveness
from server.placement.memory import Capacity, free_memory_bytes, plan_capacity
from server.placement.policy import (
    block_throughputs,
    choose_best_span,
    hole_fill_turn,
    should_move,
    thin_blocks,
    uncovered_blocks,
)
from server.rpc.handler import BlockHandler
from swarm.modeling.families import family_for
from swarm.runtime.config import parse_span
from swarm.wire.records import ServerState

logger = logging.getLogger("swarmgate.server")

JOIN_CHECKS = 3  # re-checks of the initial placement before loading
HOLE_FILL_SLOT = 3.0  # seconds between the turns of servers that could fill a hole (> a DHT store plus a read)
HOLE_WATCH_SWARM = 100  # servers up to which each checks every --hole_check_period; more: each checks less often
HOLE_FULL_READ_SWARM = 8  # servers up to which every hole check reads every block's key
THIN_SERVERS = 2  # between full reads a hole check reads the blocks served by at most this many servers


def jittered(mean: float, rng: random.Random) -> float:
    """A random delay around `mean` (uniform in [0.5, 1.5] x mean): servers started together drift apart."""
    return mean * rng.uniform(0.5, 1.5)


class SpanHost(Protocol):
    """What choosing and moving a span needs from the server process."""

    config: ServerConfig
    num_blocks_total: int
    pinned: bool
    capacity: Optional[Capacity]
    record: Announcer
    rng: random.Random
    handler: Optional[BlockHandler]
    moves: int
    liveness: HolderLiveness

    @property
    def p2p(self) -> Any:
        """The p2pd handle now, for pinging the servers that alone serve some block (None: none yet)."""

    @property
    def peer_id(self) -> str: ...

    def stopping(self) -> bool: ...

    async def sleep(self, seconds: float) -> bool: ...

    async def announce(self, state: ServerState) -> None: ...

    async def load_blocks(self) -> None: ...

    async def unload_blocks(self) -> None: ...


def plan(config: ServerConfig, model_config, dtype: torch.dtype, num_blocks_total: int,
         quant_type: str = "none") -> Capacity:
    """How many blocks to serve and the KV cache budget, from the flags and the device's free memory."""
    if config.block_indices is not None:
        start, end = parse_span(config.block_indices)
        if end > num_blocks_total:
            raise ValueError(f"--block_indices {config.block_indices} is outside the model's 0:{num_blocks_total}")
        num_blocks: Optional[int] = end - start
    else:
        num_blocks = config.num_blocks
    # a tensor-parallel span spreads its weights and cache over its devices: their free memory together
    free = sum(free_memory_bytes(device) for device in config.devices)
    packed = () if config.tensor_parallel_devices else packed_rows_for(config.packed_rows, config.device, dtype,
                                                                       quant_type, family_for(model_config))
    capacity = plan_capacity(model_config, dtype, free, num_blocks=num_blocks,
                             attn_cache_tokens=config.attn_cache_tokens, quant_type=quant_type,
                             packed_copies=len(packed))
    needed = capacity.num_blocks * (capacity.block_bytes + capacity.attn_cache_tokens * capacity.token_bytes)
    where = " + ".join(config.devices)
    if needed > free:
        logger.warning(f"{capacity.num_blocks} blocks with a {capacity.attn_cache_tokens}-token cache need "
                       f"{needed / 2**20:.0f} MiB but only {free / 2**20:.0f} MiB are free on {where}")
    logger.info(f"capacity: {capacity.num_blocks} blocks of {capacity.block_bytes / 2**20:.1f} MiB ({quant_type}), "
                f"KV cache budget {capacity.attn_cache_tokens} tokens ({capacity.token_bytes} bytes/token/block), "
                f"{free / 2**30:.1f} GiB free on {where}")
    return capacity


async def announce_span_change(host: SpanHost, start: int, end: int, state: ServerState) -> None:
    """Move the record: blocks left behind are announced offline, the new ones with `state`."""
    await host.record.leave_blocks(start, end)
    await host.announce(state)


async def place(host: SpanHost) -> Tuple[int, int]:
    """Choose blocks, announce them as joining and re-check after random delays (concurrent joiners)."""
    record, config = host.record, host.config
    if host.pinned:
        assert config.block_indices is not None  # what `pinned` means
        record.start, record.end = parse_span(config.block_indices)
        await host.announce(ServerState.JOINING)
        return record.start, record.end
    spans = await record.spans()
    assert host.capacity is not None, "plan() sizes the server before place()"
    record.start, record.end = choose_best_span(block_throughputs(spans, host.num_blocks_total),
                                                host.capacity.num_blocks)
    await host.announce(ServerState.JOINING)
    settle = min(2.0, config.update_period)
    for _ in range(JOIN_CHECKS):
        await host.sleep(jittered(settle / 2, host.rng))
        move, target = should_move(await record.spans(), host.num_blocks_total, host.peer_id,
                                   balance_quality=config.balance_quality)
        if not move or target is None:
            break
        logger.info(f"another server took blocks {record.start}:{record.end} at the same time: joining {target} "
                    "instead")
        await announce_span_change(host, *target, ServerState.JOINING)
    return record.start, record.end


def hole_check_interval(period: float, num_servers: int, rng: random.Random) -> float:
    """Seconds to the next hole check: `jittered(period)`, stretched by servers/HOLE_WATCH_SWARM past that many
    servers (the swarm as a whole still checks about HOLE_WATCH_SWARM/period times a second)."""
    return jittered(period * max(1.0, num_servers / HOLE_WATCH_SWARM), rng)


def _decide(host: SpanHost, spans) -> Tuple[bool, Optional[Tuple[int, int]]]:
    return should_move(spans, host.num_blocks_total, host.peer_id, balance_quality=host.config.balance_quality)


async def maybe_rebalance(host: SpanHost) -> bool:
    """Move to other blocks if that would help the swarm enough (looking twice); True if it moved."""
    move, target = _decide(host, host.liveness.without_dead(await host.record.spans()))
    if not move:
        return False
    # another server may be reaching the same decision now: wait a little, then look again
    await host.sleep(host.rng.uniform(0.0, min(2.0, host.config.balance_period / 4)))
    if host.stopping():
        return False
    return await fill_hole(host, why="rebalancing")


def hole_fill_delay(turn: int, period: float, num_servers: int, rng: random.Random) -> float:
    """Seconds a server whose turn to fill a hole is `turn` (`placement.hole_fill_turn`) waits before it looks again:
    turn 0 a moment; a later turn the longest hole-check interval (by then turn 0 has seen the hole too, and moved)
    plus `turn` slots, each longer than a DHT store and read."""
    if turn == 0:
        return rng.uniform(0.0, HOLE_FILL_SLOT / 4)
    longest_check = 1.5 * period * max(1.0, num_servers / HOLE_WATCH_SWARM)
    return longest_check + turn * HOLE_FILL_SLOT + rng.uniform(0.0, HOLE_FILL_SLOT / 4)


def full_read_due(age: float, period: float, num_servers: int) -> bool:
    """Whether a hole check reads every block's key, its last full read being `age` s old: always in swarms of up to
    HOLE_FULL_READ_SWARM servers; in larger ones once that read is period x servers/HOLE_FULL_READ_SWARM old."""
    return num_servers <= HOLE_FULL_READ_SWARM or age >= period * num_servers / HOLE_FULL_READ_SWARM


async def check_holes(host: SpanHost) -> Tuple[Optional[float], int]:
    """(seconds until this server looks again and moves into the swarm's hole, or None: no hole, or moving would
    not cover any; the number of servers the records show)."""
    view = host.record.view
    if view is not None:
        seen_at, seen = view
        num_servers = len({span.peer_id for span in seen})
        if not full_read_due(time.monotonic() - seen_at, host.config.hole_check_period, num_servers):
            thin = thin_blocks(seen, host.num_blocks_total, THIN_SERVERS)
            if not thin or not await host.record.unserved(thin):
                return None, num_servers
    spans = await host.record.spans()
    num_servers = len({span.peer_id for span in spans})
    spans = host.liveness.without_dead(spans, await host.liveness.probe(host.p2p, spans, host.num_blocks_total,
                                                                        host.peer_id))
    turn = hole_fill_turn(spans, host.num_blocks_total, host.peer_id, balance_quality=host.config.balance_quality)
    if turn is None:
        return None, num_servers
    delay = hole_fill_delay(turn, host.config.hole_check_period, num_servers, host.rng)
    holes = uncovered_blocks(block_throughputs(spans, host.num_blocks_total))
    logger.info(f"hole watch: nobody serves blocks {holes[0]}..{holes[-1]} ({len(holes)}); my turn to fill it is "
                f"#{turn}: looking again in {delay:.1f}s")
    return delay, num_servers


async def fill_hole(host: SpanHost, why: str = "hole watch") -> bool:
    """Look again and move if that still helps (another server may have moved first); True if it moved."""
    move, target = _decide(host, host.liveness.without_dead(await host.record.spans()))
    if not move or target is None:
        logger.info(f"{why}: someone else moved first; staying")
        return False
    await move_to(host, *target)
    return True


async def move_to(host: SpanHost, start: int, end: int) -> None:
    """Drain, unload, load `start:end` and announce it online."""
    record, config = host.record, host.config
    old = (record.start, record.end)
    logger.info(f"rebalancing: moving from blocks {old[0]}:{old[1]} to {start}:{end}")
    if host.handler is not None:
        host.handler.accepting = False
    await announce_span_change(host, start, end, ServerState.JOINING)
    deadline = time.monotonic() + config.drain_timeout
    while host.handler is not None and host.handler.budget.num_sessions > 0 and time.monotonic() < deadline:
        if time.monotonic() - record.last_announce > config.update_period:
            await host.announce(ServerState.JOINING)
        await host.sleep(0.2)
    if host.handler is not None and host.handler.budget.num_sessions > 0:
        logger.warning(f"rebalancing: {host.handler.budget.num_sessions} sessions still open after "
                       f"{config.drain_timeout:.0f}s; moving anyway")
    await host.unload_blocks()
    await host.load_blocks()
    host.moves += 1
    await host.announce(ServerState.ONLINE)
    logger.info(f"rebalancing: now serving blocks {start}:{end} (was {old[0]}:{old[1]})")
