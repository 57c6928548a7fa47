"""The client's view of one model's swarm: its DHT peer, the servers' spans, bans, routing and stubs.

`SwarmManager` joins the DHT as a client, reads the block records (refreshing them periodically, and at once
when a route cannot be built), and turns them into chains of servers with `swarm.client.transport.routing` (and
`swarm.client.transport.prefix_routing`, which prefers the servers that hold a session's declared prompt). Servers that
failed are banned with exponential back-off so that routing avoids them for a while; but when every server of some block
is banned and the failed ones are relayed servers that could not be reached (a server behind a NAT whose relay
restarted: it renews its slot), they may be tried again after a short back-off (1, 2, 4, ... s, up to
`ban_timeout`), so that a session waits for them for up to `sole_retry_patience` seconds instead of failing
(`sole_retry_wait`, `swarm.client.transport.session`). A server that a call fails on and whose record, read again at
once, is no longer online left the swarm (a graceful stop announces `offline`): it drops out of the view without a ban
(`departed`), so a view read before it stopped costs no failed try. `settle_failures` applies that rule for
every caller (inference sessions, forward passes, training calls). With
`allowed_quant_types`, servers announcing another weight format (`quant_type`) are never routed to (nor pinged);
`spans` keeps every server seen, `allowed_spans()` those a route may use. `on_route`, when set, is called after
each inference chain is built with its `RouteTiming`: the seconds spent getting the swarm view (reading the DHT
records and pinging the servers when the view was due for a refresh, else only the lock) and in
`find_inference_chain`.
"""
from __future__ import annotations

import asyncio
import logging
import math
import threading
import time
from dataclasses import dataclass
from typing import (
    TYPE_CHECKING,
    Any,
    Callable,
    Collection,
    Dict,
    FrozenSet,
    List,
    Optional,
    Sequence,
    Set,
    Tuple,
)

import hivemind
from hivemind.p2p import P2P, PeerID
from hivemind.proto import runtime_pb2
from pydantic import BaseModel, ConfigDict, Field, SecretStr, field_validator, model_validator

from swarm.client.transport.prefix_routing import find_prefix_chain
from swarm.client.transport.routing import (
    QUANT_TYPES,
    RouteHop,
    RoutingError,
    choose_forward_chain,
    choose_training_chain,
    find_inference_chain,
    normalize_quant_types,
    quant_allowed,
    served_adapters,
)
from swarm.runtime import aio
from swarm.runtime.swarm_key import SwarmKey, join_dht, proof_for
from swarm.wire import protocol as P
from swarm.wire.compression import COMPRESSION_HELP, Compression
from swarm.wire.records import ServerSpan, ServerState, fetch_block_records, online_spans

if TYPE_CHECKING:
    import torch

    from swarm.runtime.dht_traffic import DHTTraffic

logger = logging.getLogger(__name__)

SOLE_RETRY_BASE = 1.0  # seconds before a banned server that alone serves some blocks is tried again (doubled)
MAX_STUBS = 4096  # the most peers whose RPC stubs are kept (`SwarmManager.stub`)


def unreachable(error: Optional[BaseException]) -> bool:
    """Whether `error` says a server could not be reached (a lost connection, a time-out, no answer to a liveness
    ping), rather than that it answered with a refusal (out of cache, a bad request) or broke the protocol."""
    if error is None or isinstance(error, P.ProtocolError):
        return False
    return not isinstance(error, P.RemoteError) or error.code == "unreachable"


class ClientConfig(BaseModel):
    """How a client talks to the swarm (given to `from_pretrained` as keyword arguments)."""

    model_config = ConfigDict(extra="forbid")

    initial_peers: List[str] = Field(default_factory=list, description="multiaddrs of DHT peers to join")
    dht_prefix: Optional[str] = Field(default=None, description="DHT key prefix (default: from the model name)")
    request_timeout: float = Field(default=60.0, gt=0, description="seconds for a forward or info call")
    step_timeout: float = Field(default=120.0, gt=0, description="seconds for one inference step")
    liveness_interval: Optional[float] = Field(
        default=5.0, gt=0, description="while a step's reply is late, ping its server every this many seconds; one "
                                       "unanswered within liveness_timeout fails the server over (a cut link sends no "
                                       "error); None: wait the whole step_timeout")
    liveness_timeout: float = Field(default=10.0, gt=0, description="seconds a liveness ping may take")
    update_period: float = Field(default=30.0, gt=0, description="seconds between refreshes of the swarm view")
    max_retries: int = Field(default=3, ge=0, description="times a failed step is re-routed before giving up")
    ban_timeout: float = Field(default=15.0, gt=0, description="first ban of a failed server, doubled each time")
    sole_retry_patience: float = Field(default=60.0, ge=0, description="seconds a session keeps retrying the "
                                       "unreachable relayed servers of blocks that no other server covers (back-off "
                                       "1, 2, 4, ... s up to ban_timeout: a relayed server whose relay restarted "
                                       "renews its slot) before it fails; 0: fail after max_retries")
    max_chunk_bytes: int = Field(default=2 << 20, gt=0, description="largest hidden-state message sent at once")
    measure_rtt: bool = Field(default=True, description="ping servers at each refresh and route by latency")
    max_pings: int = Field(default=64, gt=0, description="most servers pinged per refresh")
    use_push: bool = Field(default=True, description="servers push decode steps straight to the next server")
    session_channels: bool = Field(default=True, description="open sessions' parts in one stream per server (a "
                                   "session channel, where the server announces it) instead of a stream each")
    push_timeout: float = Field(default=1.0, gt=0, description="seconds to wait for a pushed decode step before "
                                                                "sending it to the next server directly")
    training_sub_batch_tokens: int = Field(default=1024, gt=0, description="most tokens per training sub-batch: "
                                           "a larger batch is split and its parts sent to servers in parallel")
    training_timeout: float = Field(default=300.0, gt=0, description="seconds for one training forward or backward "
                                                                      "call to one server")
    verify: bool = Field(default=False, description="spot-check servers' outputs on independent servers "
                                                    "(swarm.client.transport.verify): every new server, then each "
                                                    "span with verify_probability per step; outvoted servers are "
                                                    "never used")
    verify_probability: float = Field(default=0.05, ge=0, le=1, description="chance that a span's output is checked "
                                                                            "at a step (with verify)")
    compression: Optional[Compression] = Field(default=None, description=COMPRESSION_HELP + " for this client's "
                                                                                           "sessions (None: each "
                                                                                           "server's --compression)")
    allowed_quant_types: Optional[List[str]] = Field(
        default=None, description=f"weight formats of the servers a route may use, of {', '.join(QUANT_TYPES)} "
                                  f"(a server's announced quant_type); None: any, so a mixed swarm works")

    swarm_key: Optional[SecretStr] = Field(default=None, description="a private swarm's shared secret (see "
                                                                     "swarm.runtime.swarm_key)")
    swarm_key_file: Optional[str] = Field(default=None, description="a file holding the private swarm's key")

    @field_validator("allowed_quant_types", mode="before")
    @classmethod
    def _valid_quant_types(cls, value: Any) -> Optional[List[str]]:
        normalized = normalize_quant_types(value)  # ValueError naming the bad value and the choices
        return None if normalized is None else list(normalized)

    @model_validator(mode="after")
    def _loadable_key(self):
        if self.swarm_key is not None and self.swarm_key_file is not None:
            raise ValueError("give the swarm key once: swarm_key or swarm_key_file, not both")
        self.load_swarm_key()
        return self

    def load_swarm_key(self) -> Optional[SwarmKey]:
        if self.swarm_key_file is not None:
            return SwarmKey.from_file(self.swarm_key_file)
        return None if self.swarm_key is None else SwarmKey(self.swarm_key.get_secret_value())


def needs_for(adapter: Optional[str] = None, training: bool = False, prompts: bool = False,
              left_padding: bool = False, rope_length: bool = False, beam: bool = False) -> FrozenSet[str]:
    """The capabilities (`swarm.wire.capabilities`) a request needs from every server of its chain: a LoRA
    `adapter`, `training` passes, deep `prompts`, a left-padded batch, LongRoPE's `rope_length`, `beam` search's
    cache reorders (the fields each one sets: `swarm.wire.capabilities.FIELD_CAPABILITIES`)."""
    needs = {"training"} if training else set()
    if adapter is not None:
        needs.add("train_adapters" if training else "adapters")
    for wanted, name in ((prompts, "deep_prompts"), (left_padding, "left_padding"), (rope_length, "rope_length"),
                         (beam, "beam_reorder")):
        if wanted:
            needs.add(name)
    return frozenset(needs)


@dataclass(frozen=True)
class RouteTiming:
    """Where the time of building one inference chain went (seconds; a retry after a RoutingError adds to both)."""

    view_s: float  # `update()`: the DHT records read and servers pinged when a refresh was due (or forced)
    search_s: float  # `find_inference_chain` itself

    @property
    def total_s(self) -> float:
        return self.view_s + self.search_s


class SwarmManager:
    def __init__(self, config: ClientConfig, prefix: str, num_blocks: int, dht: Optional[hivemind.DHT] = None):
        if not config.initial_peers and dht is None:
            raise ValueError("initial_peers is required: the multiaddr(s) of a peer of the swarm")
        self.config, self.prefix, self.num_blocks = config, prefix, num_blocks
        key = config.load_swarm_key()
        self.dht = dht or join_dht(key, initial_peers=config.initial_peers, client_mode=True)
        self._own_dht = dht is None
        self._closed = False  # shutdown() ran
        # what `shutdown` ends first, e.g. `swarm.client.transport.rounds`' round streams (registered by their module)
        self.on_shutdown: List[Callable[[], None]] = []
        self.p2p: P2P = aio.run(self.dht.replicate_p2p(), timeout=60)
        self.member_proof = proof_for(key, self.p2p.peer_id)  # sent with every block RPC (private swarms)
        self._stubs: Dict[str, P.ProvedStub] = {}  # peer id -> its stub (`stub`: stateless, made once)
        self.spans: List[ServerSpan] = []
        self._last_update = 0.0
        # peer id -> (banned until, consecutive failures, may be retried from: when nothing else covers its blocks)
        self._bans: Dict[str, Tuple[float, int, float]] = {}
        # servers outvoted by spot-checks (swarm.client.transport.verify): never routed to
        self.distrusted: Set[str] = set()
        self.rtts: Dict[str, float] = {}  # peer id -> client RTT in seconds, measured at each refresh
        # late replies given up on because their server did not answer a liveness ping (`liveness.wait_while_alive`)
        self.liveness_failures = 0
        self._lock = threading.Lock()
        self.on_route: Optional[Callable[[RouteTiming], None]] = None  # told how long each inference chain took

    # ---- swarm view ---------------------------------------------------------------------------------------
    def update(self, force: bool = False) -> List[ServerSpan]:
        with self._lock:
            if force or time.monotonic() - self._last_update > self.config.update_period or not self.spans:
                records = fetch_block_records(self.dht, self.prefix, self.num_blocks)
                self.spans = online_spans(records)
                self._last_update = time.monotonic()
                if self.config.measure_rtt:
                    # banned servers are not routed to anyway; a silent one would hold the refresh up for the
                    # ping's whole time-out (a failover refreshes here before it re-routes)
                    banned = set(self.banned())
                    self.rtts.update(aio.run(self._ping(s.peer_id for s in self._allowed(self.spans)
                                                        if s.peer_id not in banned)))
            return self.spans

    def _allowed(self, spans: List[ServerSpan]) -> List[ServerSpan]:
        return [span for span in spans if quant_allowed(span, self.config.allowed_quant_types)]

    def allowed_spans(self, force: bool = False) -> List[ServerSpan]:
        """The online spans of servers whose weight format this client accepts (`allowed_quant_types`)."""
        return self._allowed(self.update(force=force))

    async def _ping(self, peer_ids, timeout: float = 2.0) -> Dict[str, float]:
        """RTT (seconds) of an info call to each server; unreachable ones get infinity (routing avoids them)."""
        async def one(peer_id: str) -> float:
            start = time.perf_counter()
            try:
                await asyncio.wait_for(self.info(peer_id), timeout)
            except Exception:
                return float("inf")
            return time.perf_counter() - start

        peer_ids = list(dict.fromkeys(peer_ids))[: self.config.max_pings]
        results = await asyncio.gather(*(one(p) for p in peer_ids))
        return dict(zip(peer_ids, results))

    def measure_rtts(self, peer_ids, timeout: float = 2.0) -> Dict[str, float]:
        """RTT (seconds) of an info call to each server now (infinity: no answer within `timeout`)."""
        return aio.run(self._ping(peer_ids, timeout), timeout=timeout + 10)

    def banned(self) -> List[str]:
        now = time.monotonic()
        return [peer for peer, (until, _, _) in self._bans.items() if until > now] + sorted(self.distrusted)

    def ban(self, peer_id: str, error: Optional[BaseException] = None) -> float:
        """Keep routing away from a failed server for `ban_timeout` x 2^(failures so far) seconds. A server that
        could not be reached (`error` a lost connection or a time-out, not an error reply) may be tried again
        after a short back-off when nothing else serves some of its blocks (`sole_retry_wait`). Failures reported
        while the server is banned are the same incident (sessions whose steps were in flight on it when it failed:
        a round's rows all fail together) and leave the ban as it is: only a failure of a later try counts again
        (after the ban, or a sole server's retry after its back-off)."""
        until, failures, retry_at = self._bans.get(peer_id, (0.0, 0, 0.0))
        now = time.monotonic()
        if now < until and now < retry_at:
            return until - now
        duration = self.config.ban_timeout * (2 ** failures)
        retry = min(self.config.ban_timeout, SOLE_RETRY_BASE * 2 ** failures) if unreachable(error) else math.inf
        self._bans[peer_id] = (now + duration, failures + 1, now + retry)
        logger.warning(f"banning server {peer_id} for {duration:.0f}s")
        return duration

    def _sole_banned(self, spans: List[ServerSpan], start: int, end: int) -> Dict[str, float]:
        """Banned (not distrusted) ONLINE relayed servers of blocks in [start, end) that no unbanned ONLINE server
        covers: peer id -> when it may be tried again (monotonic seconds). Only servers behind a NAT (`reachable:
        relayed`): one that cannot be reached may be renewing its relay slot (`server.network.relay_watch`), while a
        directly reachable server that cannot be reached is most likely gone (and a session should fail fast)."""
        banned = set(self.banned())
        covered: Set[int] = set()
        for span in self._allowed(spans):
            if span.peer_id not in banned and span.info.state == ServerState.ONLINE:
                covered.update(range(max(span.start, start), min(span.end, end)))
        holes = set(range(start, end)) - covered
        return {span.peer_id: self._bans[span.peer_id][2] for span in self._allowed(spans)
                if span.peer_id in self._bans and span.peer_id in banned and span.peer_id not in self.distrusted
                and span.info.state == ServerState.ONLINE and span.info.reachable == "relayed"
                and holes.intersection(range(max(span.start, start), min(span.end, end)))}

    def sole_retry_wait(self, start: int = 0, end: Optional[int] = None) -> Optional[float]:
        """Seconds until a banned server that alone serves some of blocks [start, end) may be tried again (0: now),
        or None when no banned server could fill what the unbanned ones leave uncovered."""
        retry_at = [at for at in self._sole_banned(self.spans, start, self.num_blocks if end is None else end).values()
                    if at < math.inf]
        return max(0.0, min(retry_at) - time.monotonic()) if retry_at else None

    def departed(self, peer_ids: Collection[str]) -> Set[str]:
        """Of `peer_ids` (servers a call just failed on), those that left: the view, refreshed now rather than at
        its next `update_period`, no longer lists them ONLINE (a graceful stop announces `offline` first). So a
        client whose view was read before a server stopped drops it at its first failed call, and the caller
        neither bans it nor counts a failed try (`settle_failures`)."""
        if not peer_ids:
            return set()
        online = {span.peer_id for span in self.update(force=True)}
        return {peer for peer in peer_ids if peer not in online}

    def settle_failures(self, failures: Sequence[Tuple[str, Optional[BaseException]]]) -> Set[str]:
        """The one rule for servers that calls just failed on (`(peer id, error)` pairs; an error of None bans with
        no short back-off for a block's only servers): those that left (`departed`) are dropped from the view and
        neither banned nor to be counted as a failed try; the others are banned (`ban`). Returns those that left;
        the caller counts a try only when some failure is not among them. Blocks on a DHT read: call it from an
        executor in async code. If the records cannot be read again, every failure counts, as before the rule."""
        peers = list(dict.fromkeys(peer for peer, _ in failures))
        try:
            left = self.departed(peers)
        except Exception as e:
            logger.info(f"could not read the swarm's records again: {e}")
            left = set()
        for peer, error in failures:
            if peer in left:
                logger.info(f"server {peer} left the swarm (its record is no longer online); routing around it")
            else:
                self.ban(peer, error)
        return left

    def mark_ok(self, peer_id: str) -> None:
        self._bans.pop(peer_id, None)

    def _route(self, fn, start: int, end: int, **kwargs) -> List[RouteHop]:
        kwargs["allowed_quant_types"] = self.config.allowed_quant_types
        spent = [0.0, 0.0]  # seconds: getting the swarm view, searching
        try:
            try:
                return self._timed_route(spent, False, fn, start, end, **kwargs)
            except RoutingError:
                return self._timed_route(spent, True, fn, start, end, **kwargs)
        finally:
            if fn in (find_inference_chain, find_prefix_chain) and self.on_route is not None:
                try:
                    self.on_route(RouteTiming(view_s=spent[0], search_s=spent[1]))
                except Exception as e:  # an observer must never break routing
                    logger.debug(f"on_route failed: {e}")

    def _timed_route(self, spent: List[float], force: bool, fn, start: int, end: int, **kwargs) -> List[RouteHop]:
        began = time.perf_counter()
        spans = self.update(force=force)
        viewed = time.perf_counter()
        spent[0] += viewed - began
        banned = self.banned()
        try:
            try:
                return fn(spans, start, end, banned=banned, **kwargs)
            except RoutingError:
                # blocks only banned servers cover: those past their short back-off are tried again; servers whose
                # last ping went unanswered (infinite RTT) count as unmeasured rather than unreachable
                now = time.monotonic()
                retry = {peer for peer, at in self._sole_banned(spans, start, end).items() if at <= now}
                rtts = kwargs.get("client_rtts") or {}
                silent = {peer for peer, rtt in rtts.items() if rtt == math.inf}
                if not retry and not silent:
                    raise
                if retry:
                    logger.info(f"retrying server(s) {sorted(retry)}: nothing else serves some of blocks "
                                f"{start}:{end}")
                if "client_rtts" in kwargs:
                    kwargs["client_rtts"] = {p: rtt for p, rtt in rtts.items() if p not in retry | silent}
                return fn(spans, start, end, banned=[p for p in banned if p not in retry], **kwargs)
        finally:
            spent[1] += time.perf_counter() - viewed

    def make_inference_chain(self, start: int = 0, end: Optional[int] = None, cache_tokens_needed: int = 0,
                             adapter: Optional[str] = None, session_length: int = 0,
                             needs: Collection[str] = (), prefix: Optional[P.PrefixDecl] = None) -> List[RouteHop]:
        """`adapter`: only through servers that hold this LoRA adapter (None: any server); `session_length`: only
        through servers whose announced limits take a session that long; `needs`: only through servers that
        announce these capabilities too (`needs_for`); `prefix`: the prompt the session declares, whose holders
        are preferred where that is not slower (`swarm.client.transport.prefix_routing`)."""
        end = self.num_blocks if end is None else end
        needs = needs_for(adapter=adapter) | frozenset(needs)
        if prefix is not None:
            return self._route(find_prefix_chain, start, end, cache_tokens_needed=cache_tokens_needed,
                               client_rtts=dict(self.rtts), adapter=adapter, session_length=session_length,
                               needs=needs, prefix=prefix)
        return self._route(find_inference_chain, start, end, cache_tokens_needed=cache_tokens_needed,
                           client_rtts=dict(self.rtts), adapter=adapter, session_length=session_length, needs=needs)

    def make_forward_chain(self, start: int = 0, end: Optional[int] = None, adapter: Optional[str] = None,
                           needs: Collection[str] = ()) -> List[RouteHop]:
        end = self.num_blocks if end is None else end
        return self._route(choose_forward_chain, start, end, adapter=adapter,
                           needs=needs_for(adapter=adapter) | frozenset(needs))

    def served_adapters(self, force: bool = False) -> List[str]:
        """The LoRA adapters that servers of an allowed quant type serve over every block."""
        return served_adapters(self.update(force=force), self.num_blocks, self.banned(),
                               self.config.allowed_quant_types)

    def make_training_chain(self, start: int, end: int, load: Optional[Dict[str, int]] = None,
                            adapter: Optional[str] = None, prompts: bool = False) -> List[RouteHop]:
        """A chain for one training sub-batch over blocks [start, end), spread by `load` (requests in flight);
        `adapter`: only through servers that hold this LoRA adapter; `prompts`: the calls carry deep prompts."""
        return self._route(choose_training_chain, start, end, load=dict(load or {}), adapter=adapter,
                           needs=needs_for(adapter=adapter, training=True, prompts=prompts))

    def training_route_without(self, peer_id: str, start: int, end: int, adapter: Optional[str] = None,
                               prompts: bool = False) -> bool:
        """Whether a training chain over blocks [start, end) (as `make_training_chain` asks) can be routed without
        `peer_id` (nor the banned servers) in the view read again now (a server that left no longer counts, nor
        does one that joined go unseen): False where it alone serves some of them. Blocks on a DHT read."""
        try:
            choose_training_chain(self.update(force=True), start, end, banned=[*self.banned(), peer_id],
                                  allowed_quant_types=self.config.allowed_quant_types, adapter=adapter,
                                  needs=needs_for(adapter=adapter, training=True, prompts=prompts))
        except RoutingError:
            return False
        return True

    # ---- RPC ----------------------------------------------------------------------------------------------
    def stub(self, peer_id: str):
        """A stub for `peer_id` whose calls carry this peer's membership proof (private swarms). Made once per peer
        (a stub holds no state; its base58 peer id decoded every time was ~5% of the client loop's work per request:
        two streams opened and a step per session, issue 46)."""
        stub = self._stubs.get(peer_id)
        if stub is None:
            if len(self._stubs) >= MAX_STUBS:  # (peers come and go over days: keep the dict bounded)
                self._stubs.clear()
            stub = self._stubs[peer_id] = P.ProvedStub(P.BlockRPC.get_stub(self.p2p, PeerID.from_base58(peer_id)),
                                                       self.member_proof)
        return stub

    async def info(self, peer_id: str) -> P.ServerStats:
        response = await self.stub(peer_id).rpc_info(runtime_pb2.ExpertUID(uid=""), timeout=self.config.request_timeout)
        return P.parse_stats(response)

    async def dht_traffic(self, peer_id: str) -> "Optional[DHTTraffic]":
        """The server's DHT traffic counters (`rpc_dht_traffic`; None: not read yet). A server from before the RPC
        fails the call."""
        response = await self.stub(peer_id).rpc_dht_traffic(runtime_pb2.ExpertUID(uid=""),
                                                            timeout=self.config.request_timeout)
        return P.parse_dht_traffic(response)

    async def prefix_cache(self, peer_id: str) -> P.PrefixCacheReport:
        """The server's prefix cache counters (`rpc_prefix_cache`); a server without `prefix_cache` fails the call."""
        response = await self.stub(peer_id).rpc_prefix_cache(runtime_pb2.ExpertUID(uid=""),
                                                             timeout=self.config.request_timeout)
        return P.decode(response.serialized_info, P.PrefixCacheReport)

    def server_info(self, peer_id: str) -> P.ServerStats:
        return aio.run(self.info(peer_id), timeout=self.config.request_timeout + 5)

    async def forward(self, hop: RouteHop, hidden: "torch.Tensor", adapter: Optional[str] = None,
                      left_padding: Optional[List[int]] = None, rope_length: Optional[int] = None) -> "torch.Tensor":
        """hidden [batch, seq, hidden] through the hop's blocks (no cache), with LoRA `adapter`; `left_padding`:
        keys never attended; `rope_length`: `ForwardRequest.rope_length` (None: left out)."""
        message = P.ForwardRequest(start=hop.start, end=hop.end, adapter=adapter, left_padding=left_padding,
                                   rope_length=rope_length)
        P.check_capabilities(message, hop.capabilities, hop.peer_id)  # never an optional field it does not know
        request = P.make_request(message, [hidden])
        response = await self.stub(hop.peer_id).rpc_forward(request, timeout=self.config.request_timeout)
        _, tensors = P.unpack_reply(response, hop.peer_id, forward=True)
        return tensors[0]

    def shutdown(self) -> None:
        """Close the P2P handle and stop the DHT process (and its p2pd) this manager started; once (later calls do
        nothing). Safe from any thread, the client loop's included (a finalizer may run there)."""
        if self._closed:
            return
        self._closed = True
        for close in self.on_shutdown:
            try:
                close()
            except Exception:  # noqa: BLE001 - the rest of the shutdown goes on
                logger.exception("a shutdown hook failed")
        try:  # close our handle on the daemon so that its reader tasks end instead of dying pending at exit
            if threading.current_thread().name == "swarm-client-loop":
                aio.get_loop().create_task(self.p2p.shutdown())
            else:
                aio.run(self.p2p.shutdown(), timeout=5)
        except Exception:
            pass
        if self._own_dht:
            self.dht.shutdown()
