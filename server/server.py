"""A block server process: join the DHT, size and place itself, serve RPCs, announce, rebalance, leave cleanly.

Lifecycle:
1. Start a DHT peer (bootstrapping from `--initial_peers`, or a new swarm).
2. Size: how many blocks fit in the device's free memory with their share of the KV cache budget
   (`server.memory.plan_capacity`; `--num_blocks` / `--attn_cache_tokens` override, `--block_indices` pins).
3. Throughput: `--throughput auto|eval|<number>` (`server.throughput`: measured once on one block, cached on disk).
4. Place: `--block_indices`, or the least-served window of the swarm (`placement.choose_best_span` over the
   throughput of joining and online servers). It is announced as `joining`, then re-checked a few times after
   random short delays, so that servers started at the same moment do not all take the same blocks.
5. Load only those blocks, register the RPC handlers on the DHT's P2P daemon, announce `online`, print
   `SWARMGATE_READY {json}` (supervisors and tests wait for it).
6. Serve, supervised: refresh the record every `--update_period` (sooner when the free cache changed a lot);
   at random intervals around `--balance_period`, ask `placement.should_move` whether moving would raise the
   swarm's weakest block by more than 1/`--balance_quality`, re-check after a random delay, and if so move
   gracefully (announce the old blocks offline and the new ones joining, take no new sessions, let running
   ones finish within `--drain_timeout`, unload, load the new blocks, announce online). If the serving loop
   dies (an exception while announcing, rebalancing or loading), it is restarted with back-off: blocks that
   are missing are reloaded, a dead compute thread is replaced, and the record is announced again.
7. On SIGINT/SIGTERM: stop taking sessions, announce `offline`, shut down and exit 0.
"""
from __future__ import annotations

import asyncio
import gc
import json
import logging
import random
import signal
import sys
import threading
import time
from typing import Dict, List, Optional, Sequence, Tuple

import hivemind
import torch
from hivemind.utils import get_dht_time
from pydantic import Field, field_validator, model_validator

from server.blocks import BlockSpan, resolve_dtype
from server.cache import CacheBudget
from server.handler import BlockHandler
from server.memory import Capacity, free_memory_bytes, plan_capacity
from server.pings import measure_next_pings
from server.placement import block_throughputs, choose_best_span, should_move
from swarm.runtime.taskpool import PRIORITY_FORWARD, TaskPool
from server.throughput import get_throughput, parse_throughput_mode
from swarm import __version__
from swarm.runtime import malloc
from swarm.modeling.checkpoint import Checkpoint
from swarm.wire.dtypes import DTYPES
from swarm.runtime.cpu_turns import CpuTurns, cpu_turns_enabled
from swarm.runtime.threads import serial_torch_here
from swarm.runtime.config import ProcessConfig, parse_span
from swarm.modeling.disk_cache import parse_size
from swarm.wire.records import (ServerInfo, ServerSpan, ServerState, declare_blocks, dht_prefix_for, fetch_block_records,
                           online_spans)

logger = logging.getLogger("swarmgate.server")

JOIN_CHECKS = 3  # re-checks of the initial placement before loading
MAX_RESTART_DELAY = 30.0


class ServerConfig(ProcessConfig):
    model: str = Field(description="model to serve: bundled name, local checkpoint directory or hub repo id")
    new_swarm: bool = Field(default=False, description="start a new swarm (no initial peers)")
    initial_peers: List[str] = Field(default_factory=list, description="multiaddrs of peers to join")
    host_maddrs: List[str] = Field(default_factory=lambda: ["/ip4/0.0.0.0/tcp/0"],
                                   description="multiaddrs to listen on")
    announce_maddrs: List[str] = Field(default_factory=list, description="multiaddrs to announce to others")
    port: Optional[int] = Field(default=None, description="shortcut: listen on /ip4/0.0.0.0/tcp/PORT")
    identity_path: Optional[str] = Field(default=None, description="private key file for a fixed peer id")
    block_indices: Optional[str] = Field(default=None, description="serve blocks start:end (pinned: no rebalancing)")
    num_blocks: Optional[int] = Field(default=None, gt=0,
                                      description="serve this many blocks (default: as many as fit in free memory)")
    device: str = Field(default="cpu", description="torch device (cpu, cuda, cuda:1, ...)")
    torch_dtype: str = Field(default="auto", description="auto, float32, float16 or bfloat16")
    cuda_graphs: bool = Field(default=True, description="on CUDA devices, replay each session's single-token decode "
                                                         "step as a CUDA graph (Llama-style models)")
    decode_gather_ms: float = Field(default=20.0, ge=0, le=1000,
                                    description="longest wait (ms) for the decode steps of other active sessions to "
                                                "join a batch (at most half a batch's compute time; a group that "
                                                "drifted a whole pass behind waits up to one round to merge; 0: "
                                                "never wait)")
    attn_cache_tokens: Optional[int] = Field(
        default=None, gt=0, description="KV cache budget in tokens (batch x length); default: up to 16384, less if "
                                        "memory is short")
    max_length: int = Field(default=8192, gt=0, description="longest session (tokens) accepted")
    alloc_timeout: float = Field(default=5.0, ge=0, description="seconds a new session waits for cache")
    step_timeout: float = Field(default=300.0, gt=0, description="seconds an idle session is kept open")
    update_period: float = Field(default=120.0, gt=0, description="seconds between DHT record refreshes")
    expiration: Optional[float] = Field(default=None, description="record lifetime (default 2x update_period)")
    throughput: str = Field(default="auto", description="decode steps/s per block to announce: auto (cached "
                                                       "measurement, or measure once), eval (measure again) or a number")
    balance_period: float = Field(default=120.0, gt=0, description="mean seconds between checks whether moving to "
                                                                   "other blocks would help the swarm (randomized)")
    balance_quality: float = Field(default=0.75, gt=0, le=1, description="move only if the swarm's weakest block "
                                                                         "would get more than 1/this times faster")
    drain_timeout: float = Field(default=60.0, ge=0, description="seconds running sessions get to finish before "
                                                                 "the server moves to other blocks")
    dht_prefix: Optional[str] = Field(default=None, description="DHT key prefix (default: from the model name)")
    cache_dir: Optional[str] = Field(default=None, description="download cache for hub checkpoints")
    max_disk_space: Optional[str] = Field(default=None, description="size limit of the download cache (e.g. 50GB); "
                                                                     "least recently used files are evicted")
    num_threads: Optional[int] = Field(default=None, gt=0, description="torch intra-op threads")
    log_level: str = Field(default="INFO", description="logging level")

    @field_validator("block_indices")
    @classmethod
    def _valid_span(cls, value):
        if value is not None:
            parse_span(value)
        return value

    @field_validator("torch_dtype")
    @classmethod
    def _valid_dtype(cls, value):
        if value != "auto" and value not in DTYPES:
            raise ValueError(f"must be auto, {', '.join(DTYPES)}")
        return value

    @field_validator("throughput", mode="before")
    @classmethod
    def _valid_throughput(cls, value):
        mode = parse_throughput_mode(value)
        return mode if isinstance(mode, str) else repr(mode)

    @field_validator("max_disk_space", mode="before")
    @classmethod
    def _valid_size(cls, value):
        if value is not None:
            parse_size(value)
            return str(value)
        return value

    @model_validator(mode="after")
    def _consistent_blocks(self):
        if self.block_indices is not None and self.num_blocks is not None:
            start, end = parse_span(self.block_indices)
            if end - start != self.num_blocks:
                raise ValueError(f"num_blocks {self.num_blocks} disagrees with block_indices {self.block_indices}")
        return self


def swarm_spans(dht: hivemind.DHT, prefix: str, num_blocks: int) -> List[ServerSpan]:
    """Every server's span as the DHT announces it, joining servers included (they count for placement)."""
    return online_spans(fetch_block_records(dht, prefix, num_blocks), include_joining=True)


def jittered(mean: float, rng: random.Random) -> float:
    """A random delay around `mean` (uniform in [0.5, 1.5] x mean): servers started together drift apart."""
    return mean * rng.uniform(0.5, 1.5)


class Server:
    def __init__(self, config: ServerConfig):
        self.config = config
        self.checkpoint = Checkpoint(config.model, cache_dir=config.cache_dir,
                                     max_disk_space=parse_size(config.max_disk_space))
        self.model_config = self.checkpoint.load_config()
        self.num_blocks_total = self.model_config.num_hidden_layers
        self.prefix = config.dht_prefix or dht_prefix_for(config.model)
        self.expiration = config.expiration or 2 * config.update_period
        self.device = torch.device(config.device)
        self.dtype = resolve_dtype(config.torch_dtype, self.model_config, self.device)
        self.pinned = config.block_indices is not None
        self.rng = random.Random()
        self.dht: Optional[hivemind.DHT] = None
        self.p2p = None
        self.handler: Optional[BlockHandler] = None
        self.pool: Optional[TaskPool] = None  # the one thread that does this process's tensor work (swarm.runtime.threads)
        self.capacity: Optional[Capacity] = None
        self.throughput = 1.0
        self.start = self.end = 0
        self.state = ServerState.JOINING
        # observable counters (tests, logs)
        self.moves = self.restarts = self.announcements = 0
        self.next_pings: Dict[str, float] = {}  # peer id -> RTT (s) to servers that can run block `end`
        self._announced_free: Optional[int] = None
        self._last_announce = 0.0
        self._stop = asyncio.Event()
        self._loop: Optional[asyncio.AbstractEventLoop] = None

    @property
    def peer_id(self) -> str:
        return self.dht.peer_id.to_base58()

    def request_stop(self) -> None:
        """Ask a running server to shut down (thread-safe)."""
        if self._loop is not None:
            self._loop.call_soon_threadsafe(self._stop.set)

    # ---- DHT ----------------------------------------------------------------------------------------------
    def _start_dht(self) -> hivemind.DHT:
        c = self.config
        if not c.new_swarm and not c.initial_peers:
            raise ValueError("give --initial_peers to join a swarm, or --new_swarm to start one")
        host_maddrs = [f"/ip4/0.0.0.0/tcp/{c.port}"] if c.port is not None else c.host_maddrs
        return hivemind.DHT(
            initial_peers=[] if c.new_swarm else c.initial_peers, start=True, host_maddrs=host_maddrs,
            announce_maddrs=c.announce_maddrs or None, identity_path=c.identity_path, client_mode=False,
        )

    def _free_cache_tokens(self) -> int:
        if self.handler is not None:
            return self.handler.budget.free_tokens
        return self.capacity.attn_cache_tokens if self.capacity is not None else 0

    def _info(self, state: ServerState, start: Optional[int] = None, end: Optional[int] = None) -> ServerInfo:
        return ServerInfo(state=state, start=self.start if start is None else start,
                          end=self.end if end is None else end, throughput=self.throughput,
                          cache_tokens_left=self._free_cache_tokens(), version=__version__,
                          dtype=str(self.dtype).replace("torch.", ""), next_pings=dict(self.next_pings))

    async def _declare(self, blocks: Sequence[int], info: ServerInfo) -> None:
        if not blocks:
            return
        # always now + the full lifetime: the DHT keeps whichever value of a key expires later
        when = get_dht_time() + self.expiration
        await asyncio.get_running_loop().run_in_executor(
            None, lambda: declare_blocks(self.dht, self.prefix, list(blocks), info, when)
        )

    async def _announce(self, state: ServerState) -> None:
        """Store this server's record (state, span, throughput, free cache) under each of its blocks."""
        info = self._info(state)
        await self._declare(range(self.start, self.end), info)
        self.state = state
        self.announcements += 1
        self._announced_free = info.cache_tokens_left
        self._last_announce = time.monotonic()

    async def _announce_span_change(self, start: int, end: int, state: ServerState) -> None:
        """Move the record: blocks left behind are announced offline, the new ones with `state`."""
        left = [i for i in range(self.start, self.end) if not start <= i < end]
        if left:
            await self._declare(left, self._info(ServerState.OFFLINE))
        self.start, self.end = start, end
        await self._announce(state)

    async def _measure_next_pings(self) -> None:
        """RTTs to the servers that can run the block after this span, for latency-aware routing."""
        if self.end >= self.num_blocks_total or self.p2p is None:
            self.next_pings = {}
            return
        try:
            self.next_pings = await measure_next_pings(self.p2p, await self._spans(), self.peer_id, self.end)
        except Exception as e:  # measuring is best effort; the record goes out anyway
            logger.debug(f"measuring next pings failed: {e}")

    async def _spans(self) -> List[ServerSpan]:
        return await asyncio.get_running_loop().run_in_executor(
            None, swarm_spans, self.dht, self.prefix, self.num_blocks_total)

    # ---- sizing, throughput, placement --------------------------------------------------------------------
    def _plan(self) -> Capacity:
        c = self.config
        if self.pinned:
            start, end = parse_span(c.block_indices)
            if end > self.num_blocks_total:
                raise ValueError(f"--block_indices {c.block_indices} is outside the model's 0:{self.num_blocks_total}")
            num_blocks: Optional[int] = end - start
        else:
            num_blocks = c.num_blocks
        free = free_memory_bytes(c.device)
        capacity = plan_capacity(self.model_config, self.dtype, free, num_blocks=num_blocks,
                                 attn_cache_tokens=c.attn_cache_tokens)
        needed = capacity.num_blocks * (capacity.block_bytes + capacity.attn_cache_tokens * capacity.token_bytes)
        if needed > free:
            logger.warning(f"{capacity.num_blocks} blocks with a {capacity.attn_cache_tokens}-token cache need "
                           f"{needed / 2**20:.0f} MiB but only {free / 2**20:.0f} MiB are free on {c.device}")
        logger.info(f"capacity: {capacity.num_blocks} blocks of {capacity.block_bytes / 2**20:.1f} MiB, KV cache "
                    f"budget {capacity.attn_cache_tokens} tokens ({capacity.token_bytes} bytes/token/block), "
                    f"{free / 2**30:.1f} GiB free on {c.device}")
        return capacity

    async def _place(self) -> Tuple[int, int]:
        """Choose blocks, announce them as joining and re-check after random delays (concurrent joiners)."""
        if self.pinned:
            self.start, self.end = parse_span(self.config.block_indices)
            await self._announce(ServerState.JOINING)
            return self.start, self.end
        spans = await self._spans()
        self.start, self.end = choose_best_span(block_throughputs(spans, self.num_blocks_total),
                                                self.capacity.num_blocks)
        await self._announce(ServerState.JOINING)
        settle = min(2.0, self.config.update_period)
        for _ in range(JOIN_CHECKS):
            await self._sleep(jittered(settle / 2, self.rng))
            move, target = should_move(await self._spans(), self.num_blocks_total, self.peer_id,
                                       balance_quality=self.config.balance_quality)
            if not move:
                break
            logger.info(f"another server took blocks {self.start}:{self.end} at the same time: joining {target} instead")
            await self._announce_span_change(*target, ServerState.JOINING)
        return self.start, self.end

    # ---- blocks and handlers ------------------------------------------------------------------------------
    async def _load_and_register(self) -> None:
        loop = asyncio.get_running_loop()
        began = time.monotonic()
        span = await self._compute_pool().submit(PRIORITY_FORWARD, BlockSpan.load, self.checkpoint, self.start,
                                                 self.end, self.config.torch_dtype, self.config.device)
        malloc.trim()  # what loading (and measuring the throughput) freed: unfused checkpoint tensors
        if self.config.cuda_graphs and span.enable_cuda_graphs():
            logger.info("single-session decode steps replay CUDA graphs")
        handler = BlockHandler(span, self.config.model, __version__, CacheBudget(self.capacity.attn_cache_tokens),
                               self._compute_pool(), max_length=self.config.max_length, alloc_timeout=self.config.alloc_timeout,
                               step_timeout=self.config.step_timeout)
        if self.p2p is None:
            self.p2p = await self.dht.replicate_p2p()
        await handler.add_p2p_handlers(self.p2p)
        self.handler = handler
        logger.info(f"loaded and serving blocks {self.start}:{self.end} in {time.monotonic() - began:.1f}s")

    def _compute_pool(self) -> TaskPool:
        """The compute thread (a new one if it died): loading, measuring and inference all run on it."""
        if self.pool is None or not self.pool.is_alive():
            turns = CpuTurns() if self.device.type == "cpu" and cpu_turns_enabled() else None
            self.pool = TaskPool(gather_max=self.config.decode_gather_ms / 1000, turns=turns)
        return self.pool

    async def _unregister_and_unload(self) -> None:
        handler, self.handler = self.handler, None
        if handler is None:
            return
        handler.accepting = False
        try:
            await handler.remove_p2p_handlers(self.p2p)
        finally:
            del handler
            gc.collect()
            malloc.trim()
            if self.device.type == "cuda":
                torch.cuda.empty_cache()

    async def _heal(self) -> None:
        """Make sure the blocks are loaded and served, and that the compute thread is alive."""
        if self.dht is not None and not self.dht.is_alive():
            raise SystemExit("the DHT peer process died; exiting so that a supervisor restarts the server")
        if self.handler is None:
            logger.info(f"blocks {self.start}:{self.end} are not loaded: loading them")
            await self._load_and_register()
            return
        if not self.handler.pool.is_alive():
            logger.warning("the compute thread died: starting a new one")
            self.handler.pool = self._compute_pool()

    # ---- rebalancing --------------------------------------------------------------------------------------
    async def _maybe_rebalance(self) -> bool:
        decide = lambda spans: should_move(spans, self.num_blocks_total, self.peer_id,  # noqa: E731
                                           balance_quality=self.config.balance_quality)
        move, target = decide(await self._spans())
        if not move:
            return False
        # another server may be reaching the same decision now: wait a little, then look again
        await self._sleep(self.rng.uniform(0.0, min(2.0, self.config.balance_period / 4)))
        if self._stop.is_set():
            return False
        move, target = decide(await self._spans())
        if not move:
            logger.info("rebalancing: someone else moved first; staying")
            return False
        await self._move(*target)
        return True

    async def _move(self, start: int, end: int) -> None:
        old = (self.start, self.end)
        logger.info(f"rebalancing: moving from blocks {old[0]}:{old[1]} to {start}:{end}")
        if self.handler is not None:
            self.handler.accepting = False
        await self._announce_span_change(start, end, ServerState.JOINING)
        deadline = time.monotonic() + self.config.drain_timeout
        while self.handler is not None and self.handler.budget.num_sessions > 0 and time.monotonic() < deadline:
            if time.monotonic() - self._last_announce > self.config.update_period:
                await self._announce(ServerState.JOINING)
            await self._sleep(0.2)
        if self.handler is not None and self.handler.budget.num_sessions > 0:
            logger.warning(f"rebalancing: {self.handler.budget.num_sessions} sessions still open after "
                           f"{self.config.drain_timeout:.0f}s; moving anyway")
        await self._unregister_and_unload()
        await self._load_and_register()
        self.moves += 1
        await self._announce(ServerState.ONLINE)
        logger.info(f"rebalancing: now serving blocks {start}:{end} (was {old[0]}:{old[1]})")

    # ---- the supervised serving loop ----------------------------------------------------------------------
    async def _sleep(self, seconds: float) -> bool:
        """Sleep unless asked to stop; True if stopping."""
        try:
            await asyncio.wait_for(self._stop.wait(), timeout=max(0.0, seconds))
        except asyncio.TimeoutError:
            pass
        return self._stop.is_set()

    def _cache_changed(self) -> bool:
        if self._announced_free is None or self.capacity is None:
            return True
        return abs(self._free_cache_tokens() - self._announced_free) >= 0.1 * self.capacity.attn_cache_tokens

    async def _serve_loop(self) -> None:
        await self._heal()
        await self._measure_next_pings()
        await self._announce(ServerState.ONLINE)
        period = self.config.update_period
        tick = min(period, 1.0)
        next_balance = (time.monotonic() + jittered(self.config.balance_period, self.rng)
                        if not self.pinned else float("inf"))
        while not await self._sleep(min(tick, max(0.0, next_balance - time.monotonic()))):
            now = time.monotonic()
            if now >= next_balance:
                await self._maybe_rebalance()
                next_balance = time.monotonic() + jittered(self.config.balance_period, self.rng)
            since = time.monotonic() - self._last_announce
            if since >= period or (self._cache_changed() and since >= period / 4):
                await self._heal()
                if since >= period:
                    await self._measure_next_pings()
                await self._announce(ServerState.ONLINE)

    async def _supervise(self) -> None:
        failures = 0
        while not self._stop.is_set():
            began = time.monotonic()
            try:
                await self._serve_loop()
                return
            except asyncio.CancelledError:
                raise
            except Exception as e:
                self.restarts += 1
                failures = 1 if time.monotonic() - began > 10 * self.config.update_period else failures + 1
                delay = min(MAX_RESTART_DELAY, self.config.update_period, 0.5 * 2 ** (failures - 1))
                logger.exception(f"the serving loop died ({type(e).__name__}: {e}); restarting in {delay:.1f}s")
                await self._sleep(delay)

    # ---- main ---------------------------------------------------------------------------------------------
    async def run(self) -> int:
        loop = self._loop = asyncio.get_running_loop()
        serial_torch_here()  # tensor work runs on the compute thread; the loop only validates and moves messages
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGINT, signal.SIGTERM):
                loop.add_signal_handler(sig, self._stop.set)
        self.capacity = await loop.run_in_executor(None, self._plan)
        self.dht = await loop.run_in_executor(None, self._start_dht)
        try:
            self.throughput, source = await self._compute_pool().submit(
                PRIORITY_FORWARD, lambda: get_throughput(self.config.throughput, self.checkpoint, self.config.device, self.dtype,
                                             self.config.torch_dtype))
            logger.info(f"throughput: {self.throughput:.1f} decode steps/s per block ({source})")
            await self._place()
            if self._stop.is_set():
                await self._announce(ServerState.OFFLINE)
                return 0
            await self._load_and_register()
            await self._announce(ServerState.ONLINE)
            ready = {"peer_id": self.peer_id, "start": self.start, "end": self.end,
                     "maddrs": [str(m) for m in self.dht.get_visible_maddrs()], "prefix": self.prefix,
                     "throughput": self.throughput, "attn_cache_tokens": self.capacity.attn_cache_tokens}
            print("SWARMGATE_READY " + json.dumps(ready), flush=True)
            logger.info(f"serving blocks {self.start}:{self.end} of {self.config.model} as {ready['peer_id']}")
            await self._supervise()
            logger.info("shutting down: announcing offline")
            if self.handler is not None:
                self.handler.accepting = False
            # same lifetime as the online record: the DHT keeps whichever value expires later
            await self._announce(ServerState.OFFLINE)
            await self._unregister_and_unload()
            return 0
        finally:
            if self.pool is not None:
                self.pool.shutdown()
            await loop.run_in_executor(None, self.dht.shutdown)


def main(argv=None) -> int:
    from swarm.runtime.config import config_from_argv, setup_logging

    config = config_from_argv(ServerConfig, argv, "swarmgate server", "Serve a range of a model's blocks to the swarm.",
                              positional="model", section="server")
    setup_logging(config.log_level)
    if config.num_threads:
        torch.set_num_threads(config.num_threads)
    try:
        server = Server(config)
        return asyncio.run(server.run())
    except (ValueError, RuntimeError, OSError) as e:
        logger.error(f"server failed: {e}")
        print(f"error: {e}", file=sys.stderr)
        return 1
