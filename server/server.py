"""A block server process: join the DHT, pick and load blocks, serve RPCs, announce, leave cleanly.

Lifecycle: start a DHT peer (bootstrapping from `--initial_peers`, or a new swarm), choose a block range
(`--block_indices`, or `--num_blocks` placed on the first span not yet covered), announce it as `joining`, load
only those blocks, register the RPC handlers on the DHT's P2P daemon, announce `online` and refresh the record
before it expires. On SIGINT/SIGTERM: stop taking sessions, announce `offline`, shut down and exit 0.
A line `SWARMGATE_READY {json}` on stdout tells supervisors (and tests) that the server serves.
"""
from __future__ import annotations

import asyncio
import json
import logging
import os
import signal
import sys
from typing import List, Optional, Tuple

import hivemind
import torch
from hivemind.utils import get_dht_time
from pydantic import Field, field_validator

from server.blocks import BlockSpan
from server.cache import CacheBudget
from server.handler import BlockHandler
from server.scheduler import TaskPool
from swarm import __version__
from swarm.checkpoint import Checkpoint
from swarm.config import ProcessConfig, parse_span
from swarm.records import (ServerInfo, ServerState, declare_blocks, dht_prefix_for, fetch_block_records,
                           online_spans)

logger = logging.getLogger("swarmgate.server")


class ServerConfig(ProcessConfig):
    model: str = Field(description="model to serve: bundled name, local checkpoint directory or hub repo id")
    new_swarm: bool = Field(default=False, description="start a new swarm (no initial peers)")
    initial_peers: List[str] = Field(default_factory=list, description="multiaddrs of peers to join")
    host_maddrs: List[str] = Field(default_factory=lambda: ["/ip4/0.0.0.0/tcp/0"],
                                   description="multiaddrs to listen on")
    announce_maddrs: List[str] = Field(default_factory=list, description="multiaddrs to announce to others")
    port: Optional[int] = Field(default=None, description="shortcut: listen on /ip4/0.0.0.0/tcp/PORT")
    identity_path: Optional[str] = Field(default=None, description="private key file for a fixed peer id")
    block_indices: Optional[str] = Field(default=None, description="serve blocks start:end")
    num_blocks: Optional[int] = Field(default=None, gt=0, description="serve this many blocks (placed automatically)")
    device: str = Field(default="cpu", description="torch device (cpu, cuda, cuda:1, ...)")
    torch_dtype: str = Field(default="auto", description="auto, float32, float16 or bfloat16")
    attn_cache_tokens: int = Field(default=16384, gt=0, description="KV cache budget in tokens (batch x length)")
    max_length: int = Field(default=8192, gt=0, description="longest session (tokens) accepted")
    alloc_timeout: float = Field(default=5.0, ge=0, description="seconds a new session waits for cache")
    step_timeout: float = Field(default=300.0, gt=0, description="seconds an idle session is kept open")
    update_period: float = Field(default=120.0, gt=0, description="seconds between DHT record refreshes")
    expiration: Optional[float] = Field(default=None, description="record lifetime (default 2x update_period)")
    throughput: float = Field(default=1.0, gt=0, description="announced decode steps/s per block")
    dht_prefix: Optional[str] = Field(default=None, description="DHT key prefix (default: from the model name)")
    cache_dir: Optional[str] = Field(default=None, description="download cache for hub checkpoints")
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
        if value not in ("auto", "float32", "float16", "bfloat16"):
            raise ValueError("must be auto, float32, float16 or bfloat16")
        return value


def choose_first_uncovered(records, num_blocks_total: int, length: int) -> Tuple[int, int]:
    """The first block no server announces, as a span of `length` blocks (clipped to the model's end)."""
    covered = [bool(servers) for servers in records]
    start = next((i for i, c in enumerate(covered) if not c), 0)
    start = min(start, num_blocks_total - length)
    return start, start + length


class Server:
    def __init__(self, config: ServerConfig):
        self.config = config
        self.checkpoint = Checkpoint(config.model, cache_dir=config.cache_dir)
        self.model_config = self.checkpoint.load_config()
        self.num_blocks_total = self.model_config.num_hidden_layers
        self.prefix = config.dht_prefix or dht_prefix_for(config.model)
        self.expiration = config.expiration or 2 * config.update_period
        self.dht: Optional[hivemind.DHT] = None
        self.handler: Optional[BlockHandler] = None
        self.start = self.end = 0
        self._stop = asyncio.Event()

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

    def _info(self, state: ServerState) -> ServerInfo:
        free = self.handler.budget.free_tokens if self.handler is not None else self.config.attn_cache_tokens
        return ServerInfo(state=state, start=self.start, end=self.end, throughput=self.config.throughput,
                          cache_tokens_left=free, version=__version__,
                          dtype=str(self.handler.span.dtype).replace("torch.", "") if self.handler else "float32")

    async def _announce(self, state: ServerState, expiration: Optional[float] = None) -> None:
        info = self._info(state)
        when = get_dht_time() + (expiration if expiration is not None else self.expiration)
        blocks = list(range(self.start, self.end))
        await asyncio.get_running_loop().run_in_executor(
            None, lambda: declare_blocks(self.dht, self.prefix, blocks, info, when)
        )

    def _choose_blocks(self) -> Tuple[int, int]:
        c = self.config
        if c.block_indices is not None:
            start, end = parse_span(c.block_indices)
            if end > self.num_blocks_total:
                raise ValueError(f"--block_indices {c.block_indices} is outside the model's 0:{self.num_blocks_total}")
            return start, end
        length = min(c.num_blocks or self.num_blocks_total, self.num_blocks_total)
        records = fetch_block_records(self.dht, self.prefix, self.num_blocks_total)
        return choose_first_uncovered(records, self.num_blocks_total, length)

    # ---- main ---------------------------------------------------------------------------------------------
    async def run(self) -> int:
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, self._stop.set)
        self.dht = await loop.run_in_executor(None, self._start_dht)
        try:
            self.start, self.end = await loop.run_in_executor(None, self._choose_blocks)
            await self._announce(ServerState.JOINING)
            span = await loop.run_in_executor(
                None, BlockSpan.load, self.checkpoint, self.start, self.end, self.config.torch_dtype, self.config.device
            )
            budget = CacheBudget(self.config.attn_cache_tokens)
            pool = TaskPool()
            self.handler = BlockHandler(span, self.config.model, __version__, budget, pool,
                                        max_length=self.config.max_length, alloc_timeout=self.config.alloc_timeout,
                                        step_timeout=self.config.step_timeout)
            p2p = await self.dht.replicate_p2p()
            await self.handler.add_p2p_handlers(p2p)
            await self._announce(ServerState.ONLINE)
            ready = {"peer_id": self.dht.peer_id.to_base58(), "start": self.start, "end": self.end,
                     "maddrs": [str(m) for m in self.dht.get_visible_maddrs()], "prefix": self.prefix}
            print("SWARMGATE_READY " + json.dumps(ready), flush=True)
            logger.info(f"serving blocks {self.start}:{self.end} of {self.config.model} as {ready['peer_id']}")
            while not self._stop.is_set():
                try:
                    await asyncio.wait_for(self._stop.wait(), timeout=self.config.update_period)
                except asyncio.TimeoutError:
                    await self._announce(ServerState.ONLINE)
            logger.info("shutting down: announcing offline")
            self.handler.accepting = False
            await self._announce(ServerState.OFFLINE, expiration=self.config.update_period)
            await self.handler.remove_p2p_handlers(p2p)
            pool.shutdown()
            return 0
        finally:
            await loop.run_in_executor(None, self.dht.shutdown)


def main(argv=None) -> int:
    from swarm.config import ConfigError, build_parser, load_config

    parser = build_parser(ServerConfig, "swarmgate server", "Serve a range of a model's blocks to the swarm.",
                          positional="model")
    args = parser.parse_args(argv)
    try:
        config = load_config(ServerConfig, args, section="server")
    except ConfigError as e:
        parser.error(str(e))
    logging.basicConfig(level=config.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if config.num_threads:
        torch.set_num_threads(config.num_threads)
    try:
        server = Server(config)
        return asyncio.run(server.run())
    except (ValueError, RuntimeError, OSError) as e:
        logger.error(f"server failed: {e}")
        print(f"error: {e}", file=sys.stderr)
        return 1
