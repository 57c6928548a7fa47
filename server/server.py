"""A block server process: the supervisor that wires the server's parts together and keeps them running.

Lifecycle (each step's module in brackets):
1. Start a DHT peer, bootstrapping from `--initial_peers` or as a new swarm; ask peers to dial it back: behind a NAT,
   restart it as a relayed DHT client, or exit 1 when relays are off (`server.network`: the server's network identity,
   one `ServerNetwork`).
2. Size: how many blocks fit, and the KV cache budget (`server.placement.spans.plan`).
3. Throughput: `--throughput auto|eval|<number>` (`server.placement.throughput`: measured once on one block, cached on
   disk).
4. Place: pinned `--block_indices` or the least-served window, re-checked against concurrent joiners
   (`server.placement.spans.place`).
5. Load only those blocks, register the RPC handlers (`server.rpc.handler`) on the DHT's P2P daemon, announce
   `online`, print `SWARMGATE_READY {json}` (supervisors and tests wait for it) with the addresses p2pd tells now
   (`server.network.reachable.own_maddrs`, waited for: a relay reservation may come late). A DHT step of the
   start (placing, announcing) that fails is tried again with back-off (`server.retry`, one line): only errors the
   volunteer can fix, or the DHT process dying, end a server.
6. Serve, supervised: refresh the record every `--update_period`, sooner when the free cache changed a lot
   (`server.placement.announce`); at random intervals around `--balance_period`, move if that helps the swarm enough
   (`server.placement.spans.maybe_rebalance`); every few seconds (`--hole_check_period`) look for blocks nobody serves
   and, when this server's turn comes, move into them (`server.placement.spans.check_holes`, `fill_hole`). If the
   serving loop dies (an exception while announcing, rebalancing or loading), it is restarted with back-off: blocks that
   are missing are reloaded, a dead compute thread is replaced, and the record is announced again. A relayed server
   checks its relay slot every `--relay_check_period` and renews a lost one (`server.network.relay_watch`).
7. On SIGINT/SIGTERM (to the process or its whole group: the DHT process and p2pd are in a group of their own and
   do not get a group's signal, `swarm.runtime.dht_process`): stop taking sessions, announce `offline` (before the
   DHT peer stops: clients stop routing to the server at once), stop the compute thread, the DHT process and
   p2pd, reap any descendant left (`swarm.runtime.lifecycle`) and exit 0, within a few seconds; a second signal
   exits at once.

The typed configuration is `server.config.ServerConfig`. `main(argv, server_class)` lets a test run the normal
entry point with a subclass (e.g. a handler that injects faults, `tests/fixtures/faulty_server.py`).
"""
from __future__ import annotations

import asyncio
import gc
import json
import logging
import random
import sys
import threading
import time
from typing import Any, Optional, Tuple, Type

import torch
from hivemind.p2p import P2P

from server.compute.blocks import BlockSpan
from server.compute.cache import CacheBudget
from server.compute.loading import resolve_dtype
from server.compute.prefix_cache import PrefixCache
from server.config import ServerConfig
from server.network.identity import ServerNetwork
from server.network.reachable import Unreachable
from server.placement import spans
from server.placement.announce import Announcer
from server.placement.liveness import HolderLiveness
from server.placement.memory import Capacity
from server.placement.throughput import get_throughput
from server.retry import backoff, until_done
from server.rpc.handler import BlockHandler
from server.rpc.limits import RpcLimits
from swarm import __version__
from swarm.modeling.checkpoint import Checkpoint
from swarm.modeling.disk_cache import parse_size
from swarm.modeling.families import family_for
from swarm.modeling.lora_files import AdapterSource, open_adapter
from swarm.modeling.prepare import resolve_model
from swarm.modeling.quantize import check_quant_support, resolve_quant_type
from swarm.modeling.shape import ModelShape
from swarm.modeling.tensor_parallel import TensorParallelError, check_splittable
from swarm.runtime import aio, lifecycle, malloc
from swarm.runtime.config import parse_span
from swarm.runtime.cpu_turns import turns_for
from swarm.runtime.dht_traffic import read_dht_traffic_async
from swarm.runtime.swarm_key import proof_for
from swarm.runtime.taskpool import PRIORITY_FORWARD, TaskPool
from swarm.runtime.threads import serial_torch_here
from swarm.wire.records import ModelRecord, ServerState, dht_prefix_for

__all__ = ["Server", "ServerConfig", "main"]

logger = logging.getLogger("swarmgate.server")

MAX_RESTART_DELAY = 30.0
DHT_DEATH_GRACE = 2.0  # seconds a server whose DHT process died waits for its own stop signal
OFFLINE_TIMEOUT = 2.5  # seconds to announce offline when stopping
UNLOAD_TIMEOUT = 1.0  # seconds to unregister the RPC handlers, to close the P2P handle
POOL_STOP_TIMEOUT = 2.0  # seconds the compute thread gets to finish its queued work


class Server:
    """The server process: owns its network identity (`ServerNetwork`: the DHT peer, p2pd, reachability, relay), the
    record (`Announcer`), the loaded span and its RPC handler, and the compute thread; implements
    `server.placement.spans.SpanHost` and, for the relay watch, `server.network.relay_watch.Rehost`."""

    handler_class: Type[BlockHandler] = BlockHandler  # a test subclass may swap in a fault-injecting handler

    def __init__(self, config: ServerConfig):
        self.config = config
        self.checkpoint = Checkpoint(resolve_model(config.model), cache_dir=config.cache_dir,
                                     max_disk_space=parse_size(config.max_disk_space), revision=config.revision,
                                     token=config.token)
        self.model_config = self.checkpoint.load_config()
        family = family_for(self.model_config)  # an unknown model type: one line naming the supported families
        self.num_blocks_total = self.model_config.num_hidden_layers
        # a checkpoint published quantized (`swarm.modeling.checkpoint_quant`): an unknown format, or tensors not as
        # its config says, is one line naming the tensor before the DHT starts. Checked from the safetensors headers
        # of a pinned span's blocks, else of every block that may be placed here (a hub repo's: fetched alone)
        if self.checkpoint.quantization() is not None:  # (config.json only: others read no weight map here)
            self.checkpoint.expect_prefix(family.base_prefix)
            first, last = parse_span(config.block_indices) if config.block_indices else (0, self.num_blocks_total)
            prefixes = tuple(family.block_tensor_prefix(i) for i in range(first, min(last, self.num_blocks_total)))
            self.checkpoint.check_quantized(lambda name: name.startswith(prefixes))
        self.prefix = config.dht_prefix or dht_prefix_for(config.model)
        self.device = torch.device(config.span_device)
        self.dtype = resolve_dtype(config.torch_dtype, self.model_config, self.device)
        # before the DHT starts: a quantization this machine's bitsandbytes cannot run is a one-line error
        self.quant_type = resolve_quant_type(config.quant_type, self.device)
        check_quant_support(self.quant_type, self.device, self.dtype)
        if config.tensor_parallel_devices:  # a model that cannot be split: TensorParallelError (exit 2)
            check_splittable(family_for(self.model_config), ModelShape.from_config(self.model_config),
                             len(config.tensor_parallel_devices), self.quant_type)
        # LoRA adapters, checked against the model before the DHT starts (a bad one is a one-line error)
        self.adapters = [open_adapter(AdapterSource.parse(text), self.model_config, cache_dir=config.cache_dir,
                                      max_disk_space=parse_size(config.max_disk_space)) for text in config.adapters]
        self.pinned = config.block_indices is not None
        self.rng = random.Random()
        self.network = ServerNetwork(config)  # the DHT peer, p2pd, reachability, relay: replaced only by it
        self.handler: Optional[BlockHandler] = None
        # the one thread that does this process's tensor work (swarm.runtime.threads)
        self.pool: Optional[TaskPool] = None
        self.capacity: Optional[Capacity] = None
        self.record = Announcer(self.prefix, config.expiration or 2 * config.update_period, self.num_blocks_total,
                                self.dtype, self._free_cache_tokens, quant_type=self.quant_type,
                                adapters=[files.name for files in self.adapters], peer=self.network)
        self.record.model = ModelRecord(model=config.model, prefix=self.prefix, num_blocks=self.num_blocks_total)
        # observable counters (tests, logs)
        self.moves = self.restarts = 0
        self._stop = asyncio.Event()
        self._loop: Optional[asyncio.AbstractEventLoop] = None
        self.record.swarm_key = config.load_swarm_key()  # a private swarm's: handlers and pings use it
        self.liveness = HolderLiveness()  # the hole watch's pings of servers that alone serve some block
        self.record.public_name = config.public_name
        self.record.tensor_parallel = max(1, len(config.tensor_parallel_devices))

    @property
    def peer_id(self) -> str:
        return self.network.peer_id

    @property
    def p2p(self) -> Any:
        """The p2pd handle now (`ServerNetwork.p2p`), for placement's pings."""
        return self.network.p2p

    def request_stop(self) -> None:
        """Ask a running server to shut down (thread-safe)."""
        if self._loop is not None:
            self._loop.call_soon_threadsafe(self._stop.set)

    def stopping(self) -> bool:
        return self._stop.is_set()

    async def sleep(self, seconds: float) -> bool:
        """Sleep unless asked to stop; True if stopping."""
        try:
            await asyncio.wait_for(self._stop.wait(), timeout=max(0.0, seconds))
        except asyncio.TimeoutError:
            pass
        return self._stop.is_set()

    def _free_cache_tokens(self) -> int:
        if self.handler is not None:  # kept prefix pages are evicted for a session that needs their room
            cache = self.handler.prefix_cache
            return self.handler.budget.free_tokens + (cache.tokens if cache is not None else 0)
        return self.capacity.attn_cache_tokens if self.capacity is not None else 0

    async def announce(self, state: ServerState) -> None:
        """Store the record under each block of the span (every announcement goes through here), then note the DHT
        peer's traffic counters for the info RPC."""
        await self.record.announce(state)
        dht = self.network.dht
        if self.handler is not None and dht is not None:
            try:
                self.handler.dht_traffic = await read_dht_traffic_async(dht)
            except Exception as e:  # the counters are informative only
                logger.debug(f"reading the DHT traffic failed: {e}")

    # ---- blocks and handlers ------------------------------------------------------------------------------
    async def load_blocks(self) -> None:
        """Load the span's blocks on the compute thread and serve them (register the RPC handlers)."""
        began = time.monotonic()
        start, end = self.record.start, self.record.end
        span = await self._compute_pool().submit(PRIORITY_FORWARD, BlockSpan.load, self.checkpoint, start, end,
                                                 self.config.torch_dtype, self.config.device, self.quant_type,
                                                 self.adapters, self.config.packed_rows,
                                                 self.config.tensor_parallel_devices)
        malloc.trim()  # what loading (and measuring the throughput) freed: unfused checkpoint tensors
        if self.config.cuda_graphs and span.enable_cuda_graphs():
            logger.info("decode steps of up to 16 sessions replay CUDA graphs")
        if self.config.kv_arena and span.enable_kv_arena(self.config.max_length):
            logger.info("decode batches attend over a shared KV arena")
        assert self.capacity is not None, "plan() sizes the server before it loads blocks"
        limits = RpcLimits(max_sessions_per_peer=self.config.max_sessions_per_peer, max_streams=self.config.max_streams,
                           max_message_bytes=self.config.max_message_bytes, max_step_tokens=self.config.max_step_tokens,
                           max_queued_steps=self.config.max_queued_steps)
        self.record.limits = limits.announced(self.config.max_length)
        handler = self.handler_class(span, self.config.model, __version__, CacheBudget(self.capacity.attn_cache_tokens),
                                     self._compute_pool(), max_length=self.config.max_length,
                                     alloc_timeout=self.config.alloc_timeout, step_timeout=self.config.step_timeout,
                                     swarm_key=self.record.swarm_key,
                                     limits=limits, prefill_batch_tokens=self.config.prefill_pass_tokens)
        handler.compression = self.config.compression
        if self.config.prefix_cache == "on":
            handler.prefix_cache = PrefixCache(handler.budget, self.config.prefix_page_tokens,
                                               self.config.prefix_wait, span.cache_bytes_per_token())
        await handler.add_p2p_handlers(await self.network.handle())
        self.handler = handler
        self.record.prefix_summary = handler.prefix_summary  # (announced: clients route to holders of a prefix)
        logger.info(f"loaded and serving blocks {start}:{end} in {time.monotonic() - began:.1f}s")

    def _compute_pool(self) -> TaskPool:
        """The compute thread (a new one if it died): loading, measuring and inference all run on it."""
        if self.pool is None or not self.pool.is_alive():
            self.pool = TaskPool(gather_max=self.config.decode_gather_ms / 1000, turns=turns_for(self.device.type))
        return self.pool

    async def unload_blocks(self) -> None:
        """Stop serving the span (its RPC handlers and push streams end) and free its memory."""
        handler, self.handler = self.handler, None
        self.record.prefix_summary = lambda: None  # (its pages go with it)
        if handler is None:
            return
        handler.accepting = False
        try:
            await handler.remove_p2p_handlers(self.network.p2p)
        finally:
            del handler
            gc.collect()
            malloc.trim()
            if self.device.type == "cuda":
                torch.cuda.empty_cache()

    async def _heal(self) -> None:
        """Make sure the blocks are loaded and served, and that the compute thread is alive."""
        self._check_dht_alive()
        if self.handler is None:
            logger.info(f"blocks {self.record.start}:{self.record.end} are not loaded: loading them")
            await self.load_blocks()
            return
        if not self.handler.pool.is_alive():
            logger.warning("the compute thread died: starting a new one")
            self.handler.pool = self._compute_pool()

    # ---- the relay watch's renewal (`server.network.relay_watch.Rehost`) ---------------------------------
    async def detach_handlers(self, p2p: P2P) -> None:
        if self.handler is not None:
            await self.handler.remove_p2p_handlers(p2p)

    async def attach_handlers(self, p2p: P2P) -> None:
        if self.handler is not None:
            await self.handler.add_p2p_handlers(p2p)

    async def reannounce(self) -> None:
        await self.announce(ServerState.ONLINE)

    def _check_dht_alive(self) -> None:
        if self.network.dht_died():
            raise SystemExit("the DHT peer process died; exiting so that a supervisor restarts the server")

    # ---- the supervised serving loop ----------------------------------------------------------------------
    async def _serve_loop(self) -> None:
        await self._heal()
        await self.record.measure_next_pings(self.p2p, self.peer_id)
        await self.announce(ServerState.ONLINE)
        period = self.config.update_period
        tick = min(period, 1.0)
        never = float("inf")
        next_balance = (time.monotonic() + spans.jittered(self.config.balance_period, self.rng)
                        if not self.pinned else never)
        hole_period = self.config.hole_check_period if not self.pinned else 0.0
        next_hole_check = time.monotonic() + spans.jittered(hole_period, self.rng) if hole_period > 0 else never
        fill_at = never  # this server's turn to fill a hole it saw
        while not await self.sleep(min(tick, max(0.0, min(next_balance, next_hole_check, fill_at) - time.monotonic()))):
            now = time.monotonic()
            if now >= fill_at:
                fill_at = never
                await spans.fill_hole(self)
            if now >= next_hole_check and fill_at == never:
                delay, num_servers = await spans.check_holes(self)
                fill_at = never if delay is None else time.monotonic() + delay
                next_hole_check = time.monotonic() + spans.hole_check_interval(hole_period, num_servers, self.rng)
            await self.network.watch_relay(self)
            if now >= next_balance:
                await spans.maybe_rebalance(self)
                next_balance = time.monotonic() + spans.jittered(self.config.balance_period, self.rng)
            since = time.monotonic() - self.record.last_announce
            budget = self.capacity.attn_cache_tokens if self.capacity is not None else None
            changed = self.record.cache_changed(budget) or self.record.prefixes_changed()
            if since >= period or (changed and since >= period / 4):
                await self._heal()
                if since >= period:
                    await self.record.measure_next_pings(self.p2p, self.peer_id)
                await self.announce(ServerState.ONLINE)

    async def _supervise(self) -> None:
        failures = 0
        last: Optional[Tuple[type, str]] = None  # the previous failure: the same one again is logged in one line
        while not self._stop.is_set():
            began = time.monotonic()
            try:
                await self._serve_loop()
                return
            except asyncio.CancelledError:
                raise
            except Exception as e:
                if self.network.dht_died():
                    # a stop signal sent to the whole group reaches the DHT process too, maybe first
                    if await self.sleep(DHT_DEATH_GRACE):
                        return
                    raise SystemExit("the DHT peer process died; exiting so that a supervisor restarts the "
                                     "server") from None
                self.restarts += 1
                failures = 1 if time.monotonic() - began > 10 * self.config.update_period else failures + 1
                delay = backoff(failures, min(MAX_RESTART_DELAY, self.config.update_period))
                if (type(e), str(e)) == last:
                    logger.warning(f"the serving loop died again ({type(e).__name__}: {e}); restarting in "
                                   f"{delay:.1f}s")
                else:
                    logger.exception(f"the serving loop died ({type(e).__name__}: {e}); restarting in {delay:.1f}s")
                last = (type(e), str(e))
                await self.sleep(delay)

    # ---- main ---------------------------------------------------------------------------------------------
    async def run(self) -> int:
        loop = self._loop = asyncio.get_running_loop()
        serial_torch_here()  # tensor work runs on the compute thread; the loop only validates and moves messages
        if threading.current_thread() is threading.main_thread():
            lifecycle.on_stop_signals(self.request_stop)
        self.capacity = await loop.run_in_executor(None, spans.plan, self.config, self.model_config, self.dtype,
                                                   self.num_blocks_total, self.quant_type)
        await self.network.start()
        try:
            # before placing or loading blocks: behind a NAT, a relay (or exit 1 with one line: Unreachable)
            await self.network.settle()
            self.record.throughput, source = await self._compute_pool().submit(
                PRIORITY_FORWARD, lambda: get_throughput(self.config.throughput, self.checkpoint, self.config.device,
                                                         self.dtype, self.config.torch_dtype,
                                                         quant_type=self.quant_type,
                                                         tensor_parallel=self.config.tensor_parallel_devices))
            logger.info(f"throughput: {self.record.throughput:.1f} decode steps/s per block ({source})")
            self.liveness.proof = proof_for(self.record.swarm_key, self.peer_id)
            await until_done("placing this server's blocks", lambda: spans.place(self), sleep=self.sleep,
                             check=self._check_dht_alive, max_delay=MAX_RESTART_DELAY)
            if self._stop.is_set():
                await self._leave()
                return 0
            await self.load_blocks()
            await until_done("announcing this server online", lambda: self.announce(ServerState.ONLINE),
                             sleep=self.sleep, check=self._check_dht_alive, max_delay=MAX_RESTART_DELAY)
            if self._stop.is_set():
                await self._leave()
                return 0
            start, end = self.record.start, self.record.end
            maddrs = await self.network.own_maddrs()
            if not maddrs:  # serving anyway: the relay watch renews a lost slot; clients find a server by its id
                logger.warning("p2pd tells no address of this server yet: serving anyway")
            ready = {"peer_id": self.peer_id, "start": start, "end": end, "maddrs": maddrs, "prefix": self.prefix,
                     "throughput": self.record.throughput, "attn_cache_tokens": self.capacity.attn_cache_tokens,
                     "quant_type": self.quant_type, "adapters": [files.name for files in self.adapters],
                     "tensor_parallel_devices": self.config.tensor_parallel_devices,
                     "reachable": self.record.reachable}
            print("SWARMGATE_READY " + json.dumps(ready), flush=True)
            logger.info(f"serving blocks {start}:{end} of {self.config.model} as {ready['peer_id']}")
            await self._supervise()
            await self._leave()
            return 0
        finally:
            await self._close()

    async def _leave(self) -> None:
        """Stop taking sessions, announce offline when the DHT peer still can, stop serving; each step bounded
        (the whole shutdown fits in a few seconds, also when p2pd or the DHT process is already gone)."""
        logger.info("shutting down: announcing offline")
        lifecycle.quiet_lost_connections(asyncio.get_running_loop())
        if self.handler is not None:
            self.handler.accepting = False
        if self.network.dht_running():
            try:
                # same lifetime as the online record: the DHT keeps whichever value expires later
                await asyncio.wait_for(self.announce(ServerState.OFFLINE), OFFLINE_TIMEOUT)
                logger.info("announced offline")
            except Exception as e:
                logger.warning(f"could not announce offline ({type(e).__name__}: {e}); the record expires instead")
        else:
            logger.warning("the DHT process is gone: cannot announce offline; the record expires instead")
        try:
            await asyncio.wait_for(self.unload_blocks(), UNLOAD_TIMEOUT)
        except Exception as e:  # p2pd is gone (its socket with it): nothing left to unregister from
            logger.info(f"stopped serving without unregistering the handlers ({type(e).__name__}: {e})")

    async def _close(self) -> None:
        """Stop the compute thread, then the network (the P2P handle, the DHT process: `ServerNetwork.close`)."""
        if self.pool is not None:
            await asyncio.get_running_loop().run_in_executor(None, self.pool.shutdown, POOL_STOP_TIMEOUT)
        await self.network.close()


def main(argv=None, server_class: Type[Server] = Server) -> int:
    from swarm.runtime.config import config_from_argv, setup_logging

    config = config_from_argv(ServerConfig, argv, "swarmgate server", "Serve a range of a model's blocks to the swarm.",
                              positional="model", section="server")
    setup_logging(config.log_level)
    if config.num_threads:
        torch.set_num_threads(config.num_threads)
    try:
        server = server_class(config)
        return aio.run_main(server.run(), config.event_loop)
    except TensorParallelError as e:  # a model or device list that cannot be split: a usage error, before the DHT
        logger.error(f"server failed: --tensor_parallel_devices: {e}")
        print(f"error: --tensor_parallel_devices: {e}", file=sys.stderr)
        return 2
    except Unreachable as e:  # one line: what was tried and which flags help
        print(f"error: {e}", file=sys.stderr)
        return 1
    except (ValueError, RuntimeError, OSError) as e:
        logger.error(f"server failed: {e}")
        print(f"error: {e}", file=sys.stderr)
        return 1
