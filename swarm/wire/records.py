"""DHT records: what a block server announces about itself, and reading the swarm's state back.

One DHT key per block of a model (`"{prefix}.{block_index}"`), one sub-key per server (its peer id), whose
value is a `ServerInfo` dict: the server's state, its span, throughput, free KV cache, version, the RTTs it
measured to servers that host its next blocks, its resource limits (`ServerLimits`) and whether peers dial it
directly or through a relay (`reachable`, `swarm.wire.reachability`). Records expire unless
refreshed; a server going away stores `offline` with a short expiration. Records that fail validation are ignored
(a bad peer cannot break a reader).
"""
from __future__ import annotations

import enum
import logging
import re
from dataclasses import dataclass
from functools import partial
from typing import Dict, List, Literal, Optional, Sequence

from hivemind import DHT
from hivemind.p2p import PeerID
from hivemind.utils import get_dht_time
from pydantic import BaseModel, ConfigDict, Field, ValidationError

logger = logging.getLogger(__name__)

RECORD_VERSION = 1


class ServerState(str, enum.Enum):
    JOINING = "joining"
    ONLINE = "online"
    OFFLINE = "offline"


class ServerLimits(BaseModel):
    """The resource limits a server enforces on its RPCs (`server.rpc.limits.RpcLimits` and `--max_length`), announced
    so that clients fit their requests to them before sending (chunk sizes, session lengths)."""

    model_config = ConfigDict(extra="ignore", frozen=True)

    max_length: int = Field(gt=0, description="most tokens one session may hold (`--max_length`)")
    max_sessions_per_peer: int = Field(gt=0)
    max_streams: int = Field(gt=0, description="inference streams and training calls open at once, all peers")
    max_message_bytes: int = Field(gt=0, description="largest RPC message (metadata and tensor buffers)")
    max_step_tokens: int = Field(gt=0, description="most tokens (batch x sequence) in one step, forward or "
                                                   "training call")
    max_queued_steps: int = Field(gt=0)


class ServerInfo(BaseModel):
    """The value a server stores under each of its blocks' keys."""

    model_config = ConfigDict(extra="ignore", frozen=True)  # newer servers may add fields

    record_version: int = RECORD_VERSION
    state: ServerState
    start: int = Field(ge=0)
    end: int = Field(gt=0)
    throughput: float = Field(default=1.0, gt=0, description="decode steps per second for one block")
    cache_tokens_left: int = Field(default=0, ge=0)
    version: str = ""
    public_name: str = Field(default="", max_length=128, description="the operator's name for this server "
                                                                     "(untrusted text: escape it where shown)")
    dtype: str = "float32"
    quant_type: str = "none"  # the served linear weights: none, int8 or nf4 (`swarmgate server --quant_type`)
    # the names of the LoRA adapters the server holds for its blocks (`swarmgate server --adapters`)
    adapters: tuple[str, ...] = ()
    # devices each of its blocks is split across (`swarmgate server --tensor_parallel_devices`; 1: not split)
    tensor_parallel: int = Field(default=1, ge=1)
    next_pings: Dict[str, float] = Field(default_factory=dict, description="peer id -> RTT in seconds")
    limits: Optional[ServerLimits] = Field(default=None, description="the server's resource limits (None: an "
                                                                     "older server that does not announce them)")
    reachable: Literal["direct", "relayed"] = Field(default="direct", description="direct: peers dial it; relayed: "
                                                                                  "it is behind a NAT and served "
                                                                                  "through a relay peer")


@dataclass(frozen=True)
class ServerSpan:
    """One server as seen by a client: the contiguous blocks [start, end) it serves right now."""

    peer_id: str
    start: int
    end: int
    info: ServerInfo

    @property
    def length(self) -> int:
        return self.end - self.start


def dht_prefix_for(model_name_or_path: str) -> str:
    """A DHT-safe prefix derived from a model name or checkpoint directory (servers and clients must agree)."""
    name = model_name_or_path.rstrip("/").split("/")[-1] if "/" in model_name_or_path else model_name_or_path
    name = re.sub(r"[^A-Za-z0-9_-]+", "-", name).strip("-").lower()
    return name or "model"


def block_key(prefix: str, index: int) -> str:
    return f"{prefix}.{index}"


async def _store_records(dht: DHT, node, *, keys, subkey, value, expiration_time):
    return await node.store_many(
        keys=keys, values=[value] * len(keys), expiration_time=expiration_time, subkeys=[subkey] * len(keys)
    )


def declare_blocks(
    dht: DHT, prefix: str, blocks: Sequence[int], info: ServerInfo, expiration_time: float, wait: bool = True
):
    """Store `info` under each block's key with this server's peer id as sub-key."""
    keys = [block_key(prefix, i) for i in blocks]
    subkey = dht.peer_id.to_base58()
    value = info.model_dump(mode="json")
    coro = partial(_store_records, keys=keys, subkey=subkey, value=value, expiration_time=expiration_time)
    return dht.run_coroutine(coro, return_future=not wait)


async def _get_records(dht: DHT, node, *, keys):
    # latest values, not whatever this node cached: a server's offline record must replace its online one
    return await node.get_many(keys, sufficient_expiration_time=float("inf"))


def fetch_block_records(dht: DHT, prefix: str, num_blocks: int) -> List[Dict[str, ServerInfo]]:
    """For each block, the valid, unexpired records of the servers that announce it: [{peer_id: ServerInfo}]."""
    keys = [block_key(prefix, i) for i in range(num_blocks)]
    found = dht.run_coroutine(partial(_get_records, keys=keys))
    now = get_dht_time()
    result: List[Dict[str, ServerInfo]] = []
    for index, key in enumerate(keys):
        entry = found.get(key)
        servers: Dict[str, ServerInfo] = {}
        if entry is not None and isinstance(entry.value, dict):
            for subkey, item in entry.value.items():
                if item.expiration_time < now:
                    continue
                try:
                    info = ServerInfo.model_validate(item.value)
                    PeerID.from_base58(subkey)
                except (ValidationError, ValueError, TypeError) as e:
                    logger.debug(f"ignoring malformed record for {key}/{subkey}: {e}")
                    continue
                if info.start <= index < info.end:
                    servers[subkey] = info
        result.append(servers)
    return result


def online_spans(records: List[Dict[str, ServerInfo]], include_joining: bool = False) -> List[ServerSpan]:
    """Each server's contiguous run of announced blocks (starting at its declared start) as a ServerSpan."""
    states = {ServerState.ONLINE} | ({ServerState.JOINING} if include_joining else set())
    spans: Dict[str, ServerSpan] = {}
    for index, servers in enumerate(records):
        for peer_id, info in servers.items():
            if info.state not in states:
                continue
            span = spans.get(peer_id)
            if span is None:
                spans[peer_id] = ServerSpan(peer_id, index, index + 1, info)
            elif span.end == index:
                spans[peer_id] = ServerSpan(peer_id, span.start, index + 1, info)
    return sorted(spans.values(), key=lambda s: (s.start, s.end, s.peer_id))


def server_states(records: List[Dict[str, ServerInfo]]) -> Dict[str, Optional[ServerState]]:
    """peer id -> the state it announces (the first record found), for status pages and tests."""
    states: Dict[str, Optional[ServerState]] = {}
    for servers in records:
        for peer_id, info in servers.items():
            states.setdefault(peer_id, info.state)
    return states
