"""A snapshot of one model's swarm for people: who serves which blocks, how fast, with how much free cache.

`build_status(records, ...)` (pure) turns the DHT block records (`swarm.wire.records`) and optional RTTs into a
`SwarmStatus`: one `ServerStatus` per server still in the swarm (online or joining; a server that announced
`offline` has left and is not listed; one that does not answer a ping is `unreachable`) and one `BlockStatus` per
block (how many online, reachable servers hold it and their summed throughput). `collect_status(manager, model)`
reads the records through a client's `SwarmManager`, pings each server from here and asks each server with a prefix
cache for its counters (`rpc_prefix_cache`: pages held, hit, computed, evicted; `SwarmStatusView`: the client
model's `swarm_status`; `prefix_cache_reports`: those counters alone, for the gateway's `/metrics`). The gateway's
`/status` page
and `/status.json` (`gateway.api.status`) and the `swarmgate status` command (`main` here: a table in the terminal,
or `--json`) show the same snapshot. Every string in it comes from untrusted records: whoever renders it escapes it.
"""
from __future__ import annotations

import asyncio
import json
import math
import sys
import time
from typing import Any, Dict, List, Optional, Sequence

from pydantic import BaseModel, Field

from swarm.runtime import aio
from swarm.wire.call_messages import PrefixCacheReport
from swarm.wire.records import ServerInfo, ServerState, online_spans

UNREACHABLE = "unreachable"


class PrefixPages(BaseModel):
    page_tokens: int
    held: int  # pages kept now
    hit: int  # pages adopted by new sessions
    computed: int  # pages of declared prompts that sessions computed (stored or not)
    evicted: int  # pages dropped for room


class ServerStatus(BaseModel):
    peer_id: str
    public_name: str = ""
    start: int
    end: int
    state: str  # joining, online, or unreachable (announces online but did not answer the ping)
    throughput: float  # decode steps per second for one block, as announced
    cache_tokens_left: int
    quant_type: str
    dtype: str
    adapters: List[str] = Field(default_factory=list)
    version: str = ""  # the server's release (`swarm.wire.capabilities`), as its record announces it
    protocol: str = "1"  # the protocol versions it speaks ("1", "1..2")
    rtt_ms: Optional[float] = None  # round trip of an info call from here; None: not measured or unreachable
    reachable: str = "direct"  # direct, or relayed: behind a NAT, dialed through a relay peer
    # its prefix cache's counters since it started (`server.compute.prefix_cache`); None: no prefix cache, or it
    # did not answer
    prefix_pages: Optional[PrefixPages] = None


class BlockStatus(BaseModel):
    index: int
    servers: int  # online, reachable servers holding this block
    throughput: float  # their summed throughput (decode steps/s)


class SwarmStatus(BaseModel):
    model: str
    prefix: str
    num_blocks: int
    blocks_covered: int
    missing: List[int]
    servers: List[ServerStatus]
    blocks: List[BlockStatus]
    updated: float = Field(description="unix time of the snapshot")


def build_status(records: Sequence[Dict[str, ServerInfo]], model: str, prefix: str,
                 rtts: Optional[Dict[str, float]] = None, now: Optional[float] = None,
                 prefix_reports: Optional[Dict[str, PrefixCacheReport]] = None) -> SwarmStatus:
    """The snapshot of `records` (`fetch_block_records`' result); `rtts` (seconds, inf: no answer) per peer id;
    `prefix_reports`: the prefix cache counters of the servers that answered `rpc_prefix_cache`."""
    rtts, prefix_reports = rtts or {}, prefix_reports or {}
    num_blocks = len(records)
    servers: List[ServerStatus] = []
    per_block = [[0, 0.0] for _ in range(num_blocks)]
    for span in online_spans(list(records), include_joining=True):
        info = span.info
        rtt = rtts.get(span.peer_id)
        state = info.state.value
        if rtt is not None and math.isinf(rtt) and info.state == ServerState.ONLINE:
            state = UNREACHABLE
        servers.append(ServerStatus(
            peer_id=span.peer_id, public_name=info.public_name, start=span.start, end=span.end, state=state,
            throughput=info.throughput, cache_tokens_left=info.cache_tokens_left, quant_type=info.quant_type,
            dtype=info.dtype, adapters=list(info.adapters), version=info.version, reachable=info.reachable,
            protocol=(str(info.protocol) if info.min_protocol == info.protocol
                      else f"{info.min_protocol}..{info.protocol}"),
            rtt_ms=None if rtt is None or math.isinf(rtt) else round(rtt * 1000, 2),
            prefix_pages=_pages(prefix_reports.get(span.peer_id))))
        if state == ServerState.ONLINE.value:
            for block in range(span.start, span.end):
                per_block[block][0] += 1
                per_block[block][1] += info.throughput
    blocks = [BlockStatus(index=i, servers=int(n), throughput=round(t, 3)) for i, (n, t) in enumerate(per_block)]
    missing = [b.index for b in blocks if b.servers == 0]
    return SwarmStatus(model=model, prefix=prefix, num_blocks=num_blocks, blocks_covered=num_blocks - len(missing),
                       missing=missing, servers=servers, blocks=blocks, updated=time.time() if now is None else now)


def _pages(report: Optional[PrefixCacheReport]) -> Optional[PrefixPages]:
    if report is None or not report.enabled:
        return None
    return PrefixPages(page_tokens=report.page_tokens, held=report.pages_held, hit=report.pages_hit,
                       computed=report.pages_computed, evicted=report.pages_evicted)


def collect_status(manager, model: str, ping: bool = True) -> SwarmStatus:
    """A fresh snapshot through a `swarm.client.transport.manager.SwarmManager` (its DHT peer), pinging every server
    listed (a server that does not answer within 2 s is `unreachable`) and reading the prefix cache counters of those
    that announce `prefix_cache`."""
    from swarm.wire.records import fetch_block_records

    records = fetch_block_records(manager.dht, manager.prefix, manager.num_blocks)
    rtts: Dict[str, float] = {}
    reports: Dict[str, PrefixCacheReport] = {}
    if ping:
        spans = online_spans(records, include_joining=True)
        rtts = manager.measure_rtts([span.peer_id for span in spans])
        with_cache = sorted({span.peer_id for span in spans if "prefix_cache" in span.info.capability_set
                             and not math.isinf(rtts.get(span.peer_id, math.inf))})
        reports = aio.run(_prefix_reports(manager, with_cache), timeout=PREFIX_REPORT_TIMEOUT + 10)
    return build_status(records, model, manager.prefix, rtts, prefix_reports=reports)


PREFIX_REPORT_TIMEOUT = 2.0  # seconds for each server's `rpc_prefix_cache` in a snapshot


async def _prefix_reports(manager, peer_ids: List[str]) -> Dict[str, PrefixCacheReport]:
    async def one(peer_id: str) -> Optional[PrefixCacheReport]:
        try:
            return await asyncio.wait_for(manager.prefix_cache(peer_id), PREFIX_REPORT_TIMEOUT)
        except Exception:  # noqa: BLE001 - a status page lists what it could read
            return None

    found = await asyncio.gather(*(one(peer) for peer in peer_ids))
    return {peer: report for peer, report in zip(peer_ids, found) if report is not None}


def prefix_cache_reports(manager) -> Dict[str, PrefixCacheReport]:
    """The prefix cache counters (`rpc_prefix_cache`) of every online server that announces `prefix_cache`, by peer
    id: those that answer within `PREFIX_REPORT_TIMEOUT` s (all asked at once)."""
    from swarm.wire.records import fetch_block_records

    records = fetch_block_records(manager.dht, manager.prefix, manager.num_blocks)
    peers = sorted({span.peer_id for span in online_spans(records) if "prefix_cache" in span.info.capability_set})
    return aio.run(_prefix_reports(manager, peers), timeout=PREFIX_REPORT_TIMEOUT + 10)


class SwarmStatusView:
    """`ClientModel.swarm_status` for a client model holding a `SwarmManager` as `self.manager` (a mixin)."""

    manager: Any

    def swarm_status(self, model_name: str) -> SwarmStatus:
        """A fresh snapshot of the swarm (records read now, every server pinged) for status pages."""
        return collect_status(self.manager, model_name)

    def server_prefix_caches(self) -> Dict[str, PrefixCacheReport]:
        """Each online server's prefix cache counters by peer id, read now (`prefix_cache_reports`)."""
        return prefix_cache_reports(self.manager)


# ---- the terminal view ----------------------------------------------------------------------------------------------
def _clean(text: str, width: int) -> str:
    """Untrusted text for a terminal: printable characters only (no escape sequences), cut to `width`."""
    text = "".join(c if c.isprintable() else "?" for c in text)
    return text if len(text) <= width else text[: width - 1] + "…"


def coverage_bar(status: SwarmStatus) -> str:
    """One character per block: the number of servers holding it (9+ as '+'), '.' where none does."""
    return "".join("." if b.servers == 0 else (str(b.servers) if b.servers < 10 else "+") for b in status.blocks)


def _pages_cell(pages: Optional[PrefixPages]) -> str:
    return "-" if pages is None else f"{pages.hit}/{pages.computed}/{pages.evicted}"


def format_table(status: SwarmStatus) -> str:
    lines = [f"model {_clean(status.model, 80)} (DHT prefix {_clean(status.prefix, 60)}): "
             f"{status.blocks_covered}/{status.num_blocks} blocks served by {len(status.servers)} server(s)",
             f"coverage [{coverage_bar(status)}]"]
    if status.missing:
        lines.append(f"missing blocks: {', '.join(str(i) for i in status.missing)}")
    header = ("peer id", "name", "blocks", "state", "reach", "steps/s", "free cache", "quant", "adapters", "release",
              "proto", "rtt ms", "prefix pages hit/computed/evicted")
    rows = [(_clean(s.peer_id, 56), _clean(s.public_name, 24), f"{s.start}:{s.end}", s.state, s.reachable,
             f"{s.throughput:.1f}",
             str(s.cache_tokens_left), _clean(s.quant_type, 8), _clean(",".join(s.adapters) or "-", 24),
             _clean(s.version or "-", 16), s.protocol, "-" if s.rtt_ms is None else f"{s.rtt_ms:.1f}",
             _pages_cell(s.prefix_pages))
            for s in status.servers]
    widths = [max(len(row[i]) for row in [header, *rows]) for i in range(len(header))]
    lines.append("  ".join(h.ljust(w) for h, w in zip(header, widths)))
    lines += ["  ".join(c.ljust(w) for c, w in zip(row, widths)) for row in rows]
    return "\n".join(lines)


def main(argv=None) -> int:
    """`swarmgate status MODEL --initial_peers ...`: the swarm's snapshot as a table (or JSON), without a gateway."""
    from swarm.client.transport.manager import ClientConfig, SwarmManager
    from swarm.modeling.checkpoint import Checkpoint
    from swarm.modeling.prepare import resolve_model
    from swarm.runtime.config import config_from_argv, setup_logging
    from swarm.runtime.swarm_key import SwarmKeySettings
    from swarm.wire.records import dht_prefix_for

    class StatusConfig(SwarmKeySettings):  # a private swarm's members answer only peers with its key
        model: str = Field(description="the model: bundled name, local checkpoint directory or hub repo id (its "
                                       "config gives the number of blocks)")
        initial_peers: List[str] = Field(default_factory=list, description="multiaddrs of peers of the swarm")
        dht_prefix: Optional[str] = Field(default=None, description="DHT key prefix (default: from the model name)")
        json_output: bool = Field(default=False, description="print the snapshot as JSON instead of a table")
        ping: bool = Field(default=True, description="measure each server's RTT from here")
        log_level: str = Field(default="WARNING", description="logging level")
        revision: Optional[str] = Field(default=None, description="a hub model's branch, tag or commit (default: main)")
        token: Optional[str] = Field(default=None, description="a gated or private hub model's access token "
                                                               "(default: huggingface_hub's own, HF_TOKEN or the "
                                                               "stored login)")

    config = config_from_argv(StatusConfig, argv, "swarmgate status", "Print the state of a model's swarm.",
                              positional="model", section="status")
    setup_logging(config.log_level)
    if not config.initial_peers:
        print("error: --initial_peers is required: the multiaddr(s) of a peer of the swarm", file=sys.stderr)
        return 2
    manager = None
    try:
        num_blocks = Checkpoint(resolve_model(config.model), revision=config.revision,
                                token=config.token).load_config().num_hidden_layers
        prefix = config.dht_prefix or dht_prefix_for(config.model)
        client = ClientConfig(initial_peers=config.initial_peers, measure_rtt=False,
                              swarm_key_file=config.swarm_key_file, swarm_key=config.swarm_key)
        manager = SwarmManager(client, prefix, num_blocks)
        status = collect_status(manager, config.model, ping=config.ping)
        print(json.dumps(status.model_dump(mode="json"), indent=1) if config.json_output else format_table(status))
        return 0
    except (ValueError, RuntimeError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    finally:
        if manager is not None:
            manager.shutdown()
