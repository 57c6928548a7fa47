"""DHT records: what a block server announces about itself, and reading the swarm's state back.

One DHT key per block of a model (`"{prefix}.{block_index}"`), one sub-key per server (its peer id), whose
value is a `ServerInfo` dict: the server's state, its span, throughput, free KV cache, release (`version`), the
protocol versions and named capabilities it supports (`swarm.wire.capabilities`), the RTTs it
measured to servers that host its next blocks, its resource limits (`ServerLimits`) and whether peers dial it
directly or through a relay (`reachable`, `swarm.wire.reachability`) and what its prefix cache holds (`prefixes`,
`swarm.wire.prefix_pages`). Records expire unless
refreshed; a server going away stores `offline` with a short expiration. Records that fail validation, or that are
"unknown" (a malformed release, no protocol version in common: `ServerInfo.problem`), are ignored with one log line
per peer (a bad peer cannot break a reader). A reader ignores fields it does not know (`extra="ignore"`): fields are
added to records freely, and the first release reads this release's records (`docs/compatibility.md`).

What a read costs (it grows with the swarm, so it is kept small): hivemind answers a find with the whole value
of each key asked (every server's record under it) from every node visited that holds it, plus a list of that
node's nearest neighbours. So:
- a server's RTTs to the next servers (`next_pings`, more than half of a record's bytes) and the summary of its
  prefix cache (`prefixes`, `swarm.wire.prefix_pages`: at most about 2.5 KB) go only into the record under its span's
  last block, the one routing reads them from (`online_spans` keeps each span's last record);
- reads and stores visit at most `DHT_BEAM` nodes per key (hivemind's default is its bucket size, 20: every node
  of a small swarm), enough to reach the `num_replicas` (5) nodes nearest to a key that hold it;
- the peers keep no DHT cache (`swarm.runtime.swarm_key.NO_DHT_CACHE`): every read asks for the latest values
  anyway, and cached copies only multiplied what each read downloads;
- a check that needs one block reads one key (`fetch_spans_at`).
"""
from __future__ import annotations

import enum
import logging
import re
from dataclasses import dataclass
from functools import partial
from typing import Annotated, Dict, FrozenSet, List, Literal, Optional, Sequence, Tuple

from hivemind import DHT
from hivemind.p2p import PeerID
from hivemind.utils import get_dht_time
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    StringConstraints,
    ValidationError,
    ValidatorFunctionWrapHandler,
    field_validator,
)

from swarm.wire.capabilities import (
    CAPABILITY_PATTERN,
    known_capabilities,
    parse_release,
    protocol_problem,
    unknown_capabilities,
)
from swarm.wire.prefix_pages import PrefixSummary

logger = logging.getLogger(__name__)

RECORD_VERSION = 1
DHT_BEAM = 8  # nodes a read or store visits per key (hivemind stores each key on its 5 nearest nodes)


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
    # added in 0.2.0 (issue 45): a first-release peer ignores them (extra="ignore" above), and a record without them
    # is a first-release server's (`swarm.wire.capabilities`)
    protocol: int = Field(default=1, ge=1, le=1 << 16, description="the newest protocol version the server speaks")
    min_protocol: int = Field(default=1, ge=1, le=1 << 16, description="the oldest one it speaks")
    capabilities: Optional[Tuple[Annotated[str, StringConstraints(pattern=CAPABILITY_PATTERN)], ...]] = Field(
        default=None, max_length=128, description="the named features the server supports (swarm.wire.capabilities); "
                                                  "None: a first-release server (it supports the first release's)")
    # added in 0.2.x (issue 47): what the server's prefix cache holds (`swarm.wire.prefix_pages`), only in the record
    # under the span's last block; None: nothing (an older server, its cache off, or a summary this release does not
    # read: a newer version or a malformed one is dropped, the record still counts)
    prefixes: Optional[PrefixSummary] = Field(default=None, description="the prompt-prefix pages the server holds")

    @field_validator("prefixes", mode="wrap")
    @classmethod
    def _readable_prefixes(cls, value: object, handler: ValidatorFunctionWrapHandler) -> Optional[PrefixSummary]:
        try:
            return handler(value)
        except ValidationError as e:
            logger.debug(f"a record's prefix summary is dropped: {str(e).splitlines()[0]}")
            return None

    @property
    def capability_set(self) -> FrozenSet[str]:
        """The capabilities this release knows that the server supports."""
        return known_capabilities(self.capabilities)

    def problem(self) -> Optional[str]:
        """Why this record is read as "unknown" (skipped by routing), or None: a malformed release string or no
        protocol version in common with this peer."""
        if self.version and parse_release(self.version) is None:
            return f"malformed release {self.version[:40]!r}"
        return protocol_problem(self.min_protocol, self.protocol)


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


# One key for the whole DHT, one sub-key per server: the model each online server serves (`ModelRecord`), so that a
# gateway started with `--model all` finds every model of the swarm. Added in 0.2.x (issue 48): older servers do
# not announce it (their models are not found that way; naming them still works).
MODELS_KEY = "_swarmgate.models"


class ModelRecord(BaseModel):
    """What a server announces under `MODELS_KEY`: the model it was started with (a bundled name, hub id or
    directory), the DHT prefix its blocks are announced under, and the model's number of blocks."""

    model_config = ConfigDict(extra="ignore", frozen=True)

    model: str = Field(min_length=1, max_length=512)
    prefix: str = Field(min_length=1, max_length=256)
    num_blocks: int = Field(gt=0, le=1 << 16)


def declare_model(dht: DHT, record: ModelRecord, expiration_time: float, wait: bool = True):
    """Store this server's `record` under `MODELS_KEY` (its peer id as sub-key)."""
    coro = partial(_store_records, keys=[MODELS_KEY], subkey=dht.peer_id.to_base58(),
                   values=[record.model_dump(mode="json")], expiration_time=expiration_time)
    return dht.run_coroutine(coro, return_future=not wait)


def fetch_models(dht: DHT) -> List[ModelRecord]:
    """The models online servers announce (valid, unexpired records; one per DHT prefix, sorted by model)."""
    found = dht.run_coroutine(partial(_get_records, keys=[MODELS_KEY])).get(MODELS_KEY)
    now = get_dht_time()
    models: Dict[str, ModelRecord] = {}
    if found is not None and isinstance(found.value, dict):
        for subkey, item in found.value.items():
            if item.expiration_time < now:
                continue
            try:
                record = ModelRecord.model_validate(item.value)
            except (ValidationError, ValueError, TypeError):
                _note_once(str(subkey), "model", f"ignoring the model record of {subkey}: it does not parse")
                continue
            models.setdefault(record.prefix, record)
    return sorted(models.values(), key=lambda r: (r.model, r.prefix))


async def _store_records(dht: DHT, node, *, keys, subkey, values, expiration_time):
    return await node.store_many(keys=keys, values=values, expiration_time=expiration_time,
                                 subkeys=[subkey] * len(keys), beam_size=DHT_BEAM)


def record_values(info: ServerInfo, blocks: Sequence[int]) -> List[dict]:
    """The value stored under each of `blocks`: `info`, without its `next_pings` and `prefixes` but under the span's
    last block."""
    full = info.model_dump(mode="json")
    lean = info.model_copy(update={"next_pings": {}, "prefixes": None}).model_dump(mode="json")
    return [full if index == info.end - 1 else lean for index in blocks]


def declare_blocks(
    dht: DHT, prefix: str, blocks: Sequence[int], info: ServerInfo, expiration_time: float, wait: bool = True
):
    """Store `info` under each block's key with this server's peer id as sub-key (its `next_pings` and `prefixes`
    only under the last block of its span, where routing reads them)."""
    blocks = list(blocks)
    keys = [block_key(prefix, i) for i in blocks]
    subkey = dht.peer_id.to_base58()
    values = record_values(info, blocks)
    coro = partial(_store_records, keys=keys, subkey=subkey, values=values, expiration_time=expiration_time)
    return dht.run_coroutine(coro, return_future=not wait)


async def _get_records(dht: DHT, node, *, keys):
    # latest values (merged over the nodes visited), not the first found: an offline record must replace the online
    # one, and a node that joined near a key lately may hold only the records stored since
    return await node.get_many(keys, sufficient_expiration_time=float("inf"), beam_size=DHT_BEAM)


def fetch_block_records(dht: DHT, prefix: str, num_blocks: int,
                        blocks: Optional[Sequence[int]] = None) -> List[Dict[str, ServerInfo]]:
    """For each block, the valid, unexpired records of the servers that announce it: [{peer_id: ServerInfo}].
    `blocks`: read only these blocks' keys (the others' entries are left empty)."""
    wanted = range(num_blocks) if blocks is None else sorted({i for i in blocks if 0 <= i < num_blocks})
    keys = [block_key(prefix, i) for i in range(num_blocks)]
    found = dht.run_coroutine(partial(_get_records, keys=[keys[i] for i in wanted])) if wanted else {}
    now = get_dht_time()
    result: List[Dict[str, ServerInfo]] = []
    stamps: List[Dict[str, float]] = []  # per block: peer id -> its record's expiration time
    for index, key in enumerate(keys):
        entry = found.get(key)
        servers: Dict[str, ServerInfo] = {}
        stamps.append({})
        if entry is not None and isinstance(entry.value, dict):
            for subkey, item in entry.value.items():
                if item.expiration_time < now:
                    continue
                try:
                    PeerID.from_base58(subkey)
                except (ValueError, TypeError):
                    continue  # not a peer's record at all
                try:
                    info = ServerInfo.model_validate(item.value)
                except (ValidationError, ValueError, TypeError) as e:
                    _note_once(subkey, "malformed", f"ignoring server {subkey}: its record does not parse "
                                                    f"({str(e).splitlines()[0]})")
                    continue
                problem = info.problem()
                if problem is not None:
                    _note_once(subkey, "unknown", f"ignoring server {subkey} (release {info.version[:40]!r}): "
                                                  f"{problem}")
                    continue
                unknown = unknown_capabilities(info.capabilities)
                if unknown:
                    _note_once(subkey, "capabilities", f"server {subkey} (release {info.version[:40]!r}) announces "
                                                       f"capabilities this release does not know: "
                                                       f"{', '.join(unknown[:8])} (ignored)", level=logging.DEBUG)
                if info.start <= index < info.end:
                    servers[subkey] = info
                    stamps[-1][subkey] = item.expiration_time
        result.append(servers)
    newest = _newest_announcement(result, stamps)
    unread = [i for i in wanted if found.get(keys[i]) is None]
    if unread and len(unread) < len(wanted):
        _fill_unread(result, unread, newest)
    return result


def _newest_announcement(result: List[Dict[str, ServerInfo]], stamps: List[Dict[str, float]]) -> Dict[str, ServerInfo]:
    """One announcement stores the same record, with one expiration time, under every key of a server's span; a
    store that timed out on some keys (a loaded machine) leaves the previous announcement there until the next
    refresh (`update_period`): a JOINING record under some keys of a server ONLINE under the others, which split its
    span (routing saw blocks 15:20 served and 20:30 not). A server's record with the latest expiration is its
    current announcement: an older record of it under another key is replaced by it where that announcement's span
    holds the block, and dropped where it does not (a span that moved). A key without any record of the server
    keeps what it holds (`_fill_unread` fills keys not read at all). Returns each server's newest record."""
    newest: Dict[str, Tuple[float, bool, ServerInfo]] = {}  # peer -> (expiration, from its span's last key, record)
    for index, (servers, times) in enumerate(zip(result, stamps)):
        for peer_id, info in servers.items():
            candidate = (times[peer_id], index == info.end - 1, info)
            if peer_id not in newest or candidate[:2] > newest[peer_id][:2]:
                newest[peer_id] = candidate
    for index, (servers, times) in enumerate(zip(result, stamps)):
        for peer_id in [p for p in servers if times[p] < newest[p][0]]:
            info = newest[peer_id][2]
            if info.start <= index < info.end:
                servers[peer_id] = info
            else:
                del servers[peer_id]
    return {peer_id: info for peer_id, (_, _, info) in newest.items()}


def _fill_unread(result: List[Dict[str, ServerInfo]], unread: Sequence[int], claims: Dict[str, ServerInfo]) -> None:
    """Keys that no node answered for (a read on a loaded machine or network can time out on some keys of a batch
    and not others) get the servers whose records under the span's other keys say they serve that block: one
    announcement stores the same record under every key of a span, so a key not read is not a block unserved. A key
    that was read keeps exactly what it holds (an offline record there replaces the online one). `claims`: each
    server's newest record (`_newest_announcement`)."""
    for index in unread:
        for peer_id, info in claims.items():
            if info.start <= index < info.end:
                result[index][peer_id] = info


_NOTED: Dict[tuple, None] = {}  # (peer id, kind) already logged (bounded: the oldest are forgotten)
_MAX_NOTED = 4096


def _note_once(peer_id: str, kind: str, text: str, level: int = logging.INFO) -> None:
    """Log `text` once per peer and kind: a bad record is read again at every refresh."""
    if (peer_id, kind) in _NOTED:
        return
    if len(_NOTED) >= _MAX_NOTED:
        _NOTED.pop(next(iter(_NOTED)))
    _NOTED[(peer_id, kind)] = None
    logger.log(level, text)


def fetch_spans_at(dht: DHT, prefix: str, num_blocks: int, block: int,
                   include_joining: bool = False) -> List[ServerSpan]:
    """The servers whose span holds `block`, as their record under that one key says (one key read instead of
    every block's: `ServerSpan.start`/`end` are the announced span)."""
    states = {ServerState.ONLINE} | ({ServerState.JOINING} if include_joining else set())
    records = fetch_block_records(dht, prefix, num_blocks, blocks=[block])
    return sorted((ServerSpan(peer_id, info.start, info.end, info) for peer_id, info in records[block].items()
                   if info.state in states), key=lambda s: (s.start, s.end, s.peer_id))


def online_spans(records: List[Dict[str, ServerInfo]], include_joining: bool = False) -> List[ServerSpan]:
    """Each server's contiguous run of announced blocks (starting at its declared start) as a ServerSpan, with the
    record of the run's last block (the one that carries `next_pings`)."""
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
