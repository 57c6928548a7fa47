"""Client-side routing: which servers run which blocks of a request.

This module owns the choice of a *chain* of servers for a range of transformer blocks, given the spans the
swarm announces (`swarm.wire.records.ServerSpan`). It is pure: no network, no DHT access, no clocks.

* `find_inference_chain` picks the chain with the least expected time per decode step (latency-oriented,
  used for generation sessions). The cost model, in seconds:

  - client -> first server: RTT/2 (from `client_rtts`, else `RoutingCosts.default_rtt`) + `hop_overhead`;
  - server A -> server B: `A.info.next_pings[B]`/2 if A measured it, else `default_rtt`/2, + `hop_overhead`;
  - last server -> client: RTT/2 + `hop_overhead`;
  - each hop into a server that announces `reachable: relayed` (dialed through a relay): + `relay_overhead`;
  - each block: 1/throughput of the server running it, plus `cache_penalty` per block run on a server whose
    free KV cache is smaller than `cache_tokens_needed` (so such servers are used only for blocks that
    nothing else covers).

  The search is a shortest path over (server, block) nodes. Because blocks only move forward, the graph is
  layered by block boundary and is solved exactly layer by layer (Dijkstra on a DAG reduces to this). At
  each boundary only servers covering that boundary are considered, and transfers over unmeasured links
  (all with the same default cost) are relaxed through the cheapest sender instead of all pairs, so a
  boundary costs O(k log k + measured pings) for k covering servers rather than O(k^2). In a large swarm only
  the `MAX_SERVERS_PER_BLOCK` cheapest servers of each block (by block cost) are searched, so k stays bounded:
  with more servers than that on a block, the chain found is the best over those.

* `choose_training_chain` spreads training passes (`swarm.client.transport.remote_autograd`) for throughput: at each
  boundary the covering server with the least expected time for one more request, (its requests in flight + 1)
  / throughput, so that concurrent sub-batches go to all the servers of a span, not only the fastest chain.

* `choose_forward_chain` spreads forward passes without a cache (`rpc_forward`) over the swarm: at each
  boundary it picks one covering server at random, weighted by throughput, and uses it as far as it reaches.

Only ONLINE spans are used, banned peers are skipped, and with `allowed_quant_types` (a client's choice of
weight formats, `QUANT_TYPES`; None: any) servers whose record announces another `quant_type` are skipped too.
With `adapter` (a LoRA adapter's name) only servers whose record lists it in `adapters` are used: a session with
an adapter never runs a block on a server without it.
With `needs` (capability names, `swarm.wire.capabilities`) only servers whose record announces all of them are used
(a first-release record: the first release's capabilities); each hop carries its server's capabilities.
A block that no usable server covers raises `RoutingError` naming the blocks, and saying when servers of other
quant types do serve them, or that no server holds the adapter there (`swarm.client.transport.coverage`: which spans are
usable, and that error).
"""
from __future__ import annotations

import heapq
import itertools
import math
import random
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Collection, Dict, FrozenSet, Iterable, List, Mapping, Optional, Sequence, Tuple, Union

from swarm.client.transport.coverage import RoutingError, quant_allowed, raise_if_uncovered, usable_spans
from swarm.wire.capabilities import FIRST_RELEASE_CAPABILITIES
from swarm.wire.dtypes import QUANT_TYPES
from swarm.wire.records import ServerLimits, ServerSpan

__all__ = [
    "QUANT_TYPES",
    "normalize_quant_types",
    "quant_allowed",
    "RoutingError",
    "RouteHop",
    "RoutingCosts",
    "find_inference_chain",
    "choose_forward_chain",
    "choose_training_chain",
    "chain_cost",
    "served_adapters",
]

_EMPTY_RTTS: Mapping[str, float] = MappingProxyType({})
MAX_SERVERS_PER_BLOCK = 64  # find_inference_chain searches only the cheapest this many servers of each block

# the weight formats a server may announce in its record's `quant_type` (`swarm.wire.records.ServerInfo`)


def normalize_quant_types(value: Union[None, str, Iterable[str]]) -> Optional[Tuple[str, ...]]:
    """A client's `allowed_quant_types` as a tuple of known formats in `QUANT_TYPES` order (None: any format).

    Accepts a list, or one string ("nf4", "none,int8"); raises ValueError naming the bad value and the choices."""
    if value is None:
        return None
    items = [value] if isinstance(value, str) else list(value)
    names: List[str] = []
    for item in items:
        if not isinstance(item, str):
            raise ValueError(f"allowed_quant_types: {item!r} is not a string; choose from {', '.join(QUANT_TYPES)}")
        names.extend(part.strip().lower() for part in item.replace(",", " ").split())
    unknown = [name for name in names if name not in QUANT_TYPES]
    if unknown:
        raise ValueError(f"allowed_quant_types: unknown quant type(s) {', '.join(map(repr, unknown))}; "
                         f"choose from {', '.join(QUANT_TYPES)} (or leave it unset for any)")
    if not names:
        raise ValueError(f"allowed_quant_types is empty: name at least one of {', '.join(QUANT_TYPES)} "
                         f"(or leave it unset for any)")
    return tuple(q for q in QUANT_TYPES if q in names)


_CLIENT: Optional[str] = None  # "parent" marker: the activations came from the client


@dataclass(frozen=True)
class RouteHop:
    """One hop of a chain: run blocks [start, end) on `peer_id`."""

    peer_id: str
    start: int
    end: int
    limits: Optional[ServerLimits] = field(default=None, compare=False)  # what the server announced
    dtype: Optional[str] = field(default=None, compare=False)  # the server's announced serving dtype (`ServerInfo`)
    # what the server supports (`swarm.wire.capabilities`): a client sends an optional field only where announced
    capabilities: FrozenSet[str] = field(default=FIRST_RELEASE_CAPABILITIES, compare=False)

    @property
    def length(self) -> int:
        return self.end - self.start


@dataclass(frozen=True)
class RoutingCosts:
    """Constants of the inference cost model (all in seconds)."""

    hop_overhead: float = 0.002  # fixed cost of every network hop (client->server, server->server, server->client)
    default_rtt: float = 0.01  # used when no RTT measurement is known for a link
    cache_penalty: float = 1000.0  # added per block run on a server whose free cache is too small
    # added to every hop into a server behind a NAT (`reachable: relayed`): its RTTs are measured through the relay
    # like any other link's, so this only makes a direct chain win when it is as fast
    relay_overhead: float = 0.001


def _check_range(start: int, end: int) -> None:
    if start < 0 or end <= start:
        raise ValueError(f"invalid block range [{start}, {end})")


def _clean_rtt(value: object) -> Optional[float]:
    """A usable RTT measurement (inf = unreachable is kept), or None for garbage from a bad peer."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    value = float(value)
    if math.isnan(value) or value < 0:
        return None
    return value


def _block_cost(span: ServerSpan, cache_tokens_needed: int, costs: RoutingCosts) -> float:
    cost = 1.0 / span.info.throughput
    if cache_tokens_needed > 0 and span.info.cache_tokens_left < cache_tokens_needed:
        cost += costs.cache_penalty
    return cost


def _relay_cost(span: ServerSpan, costs: RoutingCosts) -> float:
    return costs.relay_overhead if span.info.reachable == "relayed" else 0.0


def _half_client_rtt(peer_id: str, client_rtts: Mapping[str, float], costs: RoutingCosts) -> float:
    rtt = _clean_rtt(client_rtts.get(peer_id))
    return (costs.default_rtt if rtt is None else rtt) / 2


def _cheapest_per_block(usable: Dict[str, ServerSpan], start: int, end: int, cache_tokens_needed: int,
                        costs: RoutingCosts) -> Dict[str, ServerSpan]:
    """The usable spans among the `most` cheapest servers (block cost, then peer id) of at least one block of
    [start, end): the same spans when no block has more servers than that, so that in a large swarm the search
    grows with the blocks rather than with the servers (10,000 servers: seconds per chain without it)."""
    most = MAX_SERVERS_PER_BLOCK
    counts = [0] * (end - start + 1)
    for span in usable.values():
        counts[max(span.start, start) - start] += 1
        counts[min(span.end, end) - start] -= 1
    if max(itertools.accumulate(counts)) <= most:
        return usable
    cost = {peer_id: _block_cost(span, cache_tokens_needed, costs) for peer_id, span in usable.items()}
    covering: List[List[str]] = [[] for _ in range(end - start)]
    for peer_id, span in usable.items():
        for offset in range(max(span.start, start) - start, min(span.end, end) - start):
            covering[offset].append(peer_id)
    keep: set[str] = set()
    for peers in covering:
        keep.update(peers if len(peers) <= most else heapq.nsmallest(most, peers, key=lambda p: (cost[p], p)))
    return {peer_id: usable[peer_id] for peer_id in keep}


def find_inference_chain(
    spans: Sequence[ServerSpan],
    start: int,
    end: int,
    *,
    client_rtts: Mapping[str, float] = _EMPTY_RTTS,
    cache_tokens_needed: int = 0,
    banned: Collection[str] = (),
    costs: RoutingCosts = RoutingCosts(),
    allowed_quant_types: Optional[Collection[str]] = None,
    adapter: Optional[str] = None,
    session_length: int = 0,
    needs: Collection[str] = (),
) -> List[RouteHop]:
    """The chain covering blocks [start, end) with the least expected time per decode step (see module doc).
    Servers whose announced limits take no session of `session_length` tokens are skipped.

    Consecutive hops are always on different servers. Ties are broken deterministically (fewer hops first,
    then peer id order). Raises RoutingError if a block is not covered by any ONLINE, non-banned server of an
    allowed quant type (`allowed_quant_types`, None: any) that holds `adapter` (None: any server).
    """
    _check_range(start, end)
    usable = usable_spans(spans, start, end, banned, allowed_quant_types, adapter, session_length, needs)
    raise_if_uncovered(usable, start, end, spans=spans, banned=banned, allowed_quant_types=allowed_quant_types,
                        adapter=adapter, session_length=session_length, needs=needs)

    usable = _cheapest_per_block(usable, start, end, cache_tokens_needed, costs)
    num = end - start
    covering: List[List[str]] = [[] for _ in range(num)]
    for peer_id in sorted(usable):
        span = usable[peer_id]
        for offset in range(max(span.start, start) - start, min(span.end, end) - start):
            covering[offset].append(peer_id)
    block_cost = {peer_id: _block_cost(span, cache_tokens_needed, costs) for peer_id, span in usable.items()}
    relay_cost = {peer_id: _relay_cost(span, costs) for peer_id, span in usable.items()}

    # incoming[t] = {s: measured RTT s->t}, only for usable s != t
    incoming: Dict[str, Dict[str, float]] = {}
    for sender in sorted(usable):  # sorted: ties between measured links go to the lowest peer id
        for receiver, raw_rtt in usable[sender].info.next_pings.items():
            rtt = _clean_rtt(raw_rtt)
            if rtt is None or receiver == sender or receiver not in usable:
                continue
            incoming.setdefault(receiver, {})[sender] = rtt

    default_transfer = costs.default_rtt / 2 + costs.hop_overhead
    # parents[offset][t]: who held the activations before t ran block start+offset (t itself, another peer,
    # or _CLIENT); arrive[t]: least cost for t to have just computed the previous block
    parents: List[Dict[str, Optional[str]]] = []
    arrive: Dict[str, float] = {}
    for offset in range(num):
        enter: Dict[str, float] = {}
        parent: Dict[str, Optional[str]] = {}
        if offset == 0:
            for t in covering[0]:
                enter[t] = _half_client_rtt(t, client_rtts, costs) + costs.hop_overhead + relay_cost[t]
                parent[t] = _CLIENT
        else:
            order = sorted(arrive.items(), key=lambda item: (item[1], item[0]))
            for t in covering[offset]:
                best, source = math.inf, _CLIENT
                if t in arrive:  # stay on the same server: no network cost
                    best, source = arrive[t], t
                known = incoming.get(t)
                hop_in = costs.hop_overhead + relay_cost[t]
                for s, cost in order:  # cheapest sender over an unmeasured link
                    if s == t or (known is not None and s in known):
                        continue
                    if cost + default_transfer + relay_cost[t] < best:
                        best, source = cost + default_transfer + relay_cost[t], s
                    break
                if known is not None:
                    for s, rtt in known.items():
                        reached = arrive.get(s)
                        if reached is None:
                            continue
                        if reached + rtt / 2 + hop_in < best:
                            best, source = reached + rtt / 2 + hop_in, s
                if source is _CLIENT:  # unreachable (e.g. only infinite measured RTTs)
                    continue
                enter[t] = best
                parent[t] = source
        parents.append(parent)
        arrive = {t: cost + block_cost[t] for t, cost in enter.items()}

    best_total, last = math.inf, None
    for peer_id in sorted(arrive):
        total = arrive[peer_id] + _half_client_rtt(peer_id, client_rtts, costs) + costs.hop_overhead
        if total < best_total:
            best_total, last = total, peer_id
    if last is None:
        raise RoutingError(f"no finite-cost chain covers blocks [{start}, {end}) (all links unreachable)")

    hops: List[RouteHop] = []
    current: Optional[str] = last
    hop_end = end
    for offset in range(num - 1, -1, -1):
        assert current is not None
        source = parents[offset][current]
        if source != current:  # `current` received the activations right before block start+offset
            info = usable[current].info
            hops.append(RouteHop(current, start + offset, hop_end, info.limits, info.dtype, info.capability_set))
            hop_end = start + offset
            current = source
    hops.reverse()
    return hops


def chain_cost(
    chain: Sequence[RouteHop],
    spans: Sequence[ServerSpan],
    *,
    client_rtts: Mapping[str, float] = _EMPTY_RTTS,
    cache_tokens_needed: int = 0,
    costs: RoutingCosts = RoutingCosts(),
) -> float:
    """Expected seconds per decode step of `chain` under the same model as `find_inference_chain`."""
    if not chain:
        return 0.0
    by_peer: Dict[str, ServerSpan] = {}
    for span in spans:
        by_peer.setdefault(span.peer_id, span)
    total = _half_client_rtt(chain[0].peer_id, client_rtts, costs) + costs.hop_overhead
    for index, hop in enumerate(chain):
        span = by_peer[hop.peer_id]
        total += hop.length * _block_cost(span, cache_tokens_needed, costs) + _relay_cost(span, costs)
        if index + 1 < len(chain):
            rtt = _clean_rtt(span.info.next_pings.get(chain[index + 1].peer_id))
            total += (costs.default_rtt if rtt is None else rtt) / 2 + costs.hop_overhead
    total += _half_client_rtt(chain[-1].peer_id, client_rtts, costs) + costs.hop_overhead
    return total


def choose_forward_chain(
    spans: Sequence[ServerSpan],
    start: int,
    end: int,
    *,
    banned: Collection[str] = (),
    rng: Optional[random.Random] = None,
    allowed_quant_types: Optional[Collection[str]] = None,
    adapter: Optional[str] = None,
    needs: Collection[str] = (),
) -> List[RouteHop]:
    """A chain for forward passes that spreads load: at each boundary, a covering server chosen at random
    with probability proportional to its throughput, used as far as it covers. Raises RoutingError on gaps
    (servers of quant types outside `allowed_quant_types`, or without `adapter`, do not count; None: any)."""
    _check_range(start, end)
    usable = usable_spans(spans, start, end, banned, allowed_quant_types, adapter, needs=needs)
    raise_if_uncovered(usable, start, end, spans=spans, banned=banned, allowed_quant_types=allowed_quant_types,
                        adapter=adapter, needs=needs)
    rng = rng if rng is not None else random.Random()
    ordered = sorted(usable.values(), key=lambda span: (span.start, span.peer_id))

    hops: List[RouteHop] = []
    position = start
    while position < end:
        candidates = [span for span in ordered if span.start <= position < span.end]
        if hops:  # never twice in a row (can only happen with duplicate announcements)
            candidates = [span for span in candidates if span.peer_id != hops[-1].peer_id] or candidates
        weights = [span.info.throughput for span in candidates]
        chosen = rng.choices(candidates, weights=weights)[0]
        hop_end = min(chosen.end, end)
        hops.append(RouteHop(chosen.peer_id, position, hop_end, capabilities=chosen.info.capability_set))
        position = hop_end
    return hops


def served_adapters(spans: Sequence[ServerSpan], num_blocks: int, banned: Collection[str] = (),
                    allowed_quant_types: Optional[Collection[str]] = None) -> List[str]:
    """The adapters a session can be routed with: those that usable servers holding them cover blocks
    [0, num_blocks) with, sorted by name."""
    names = sorted({name for span in spans for name in span.info.adapters})
    result = []
    for name in names:
        usable = usable_spans(spans, 0, num_blocks, banned, allowed_quant_types, name)
        covered: set[int] = set()
        for span in usable.values():
            covered.update(range(max(span.start, 0), min(span.end, num_blocks)))
        if len(covered) == num_blocks:
            result.append(name)
    return result


def choose_training_chain(
    spans: Sequence[ServerSpan],
    start: int,
    end: int,
    *,
    load: Optional[Mapping[str, int]] = None,
    banned: Collection[str] = (),
    rng: Optional[random.Random] = None,
    allowed_quant_types: Optional[Collection[str]] = None,
    adapter: Optional[str] = None,
    needs: Collection[str] = (),
) -> List[RouteHop]:
    """A chain for one training sub-batch: at each boundary, the covering server with the least
    (`load[peer]` + 1) / throughput (`load`: requests this client has in flight there), then the one reaching
    furthest, ties broken at random; used as far as it covers. Raises RoutingError on gaps (servers without
    `adapter` do not count; None: any)."""
    _check_range(start, end)
    usable = usable_spans(spans, start, end, banned, allowed_quant_types, adapter, needs=needs)
    raise_if_uncovered(usable, start, end, spans=spans, banned=banned, allowed_quant_types=allowed_quant_types,
                       adapter=adapter, needs=needs)
    rng = rng if rng is not None else random.Random()
    load = load or {}
    hops: List[RouteHop] = []
    position = start
    while position < end:
        candidates = [span for span in usable.values() if span.start <= position < span.end]
        if hops:
            candidates = [span for span in candidates if span.peer_id != hops[-1].peer_id] or candidates
        rng.shuffle(candidates)
        chosen = min(candidates, key=lambda span: ((load.get(span.peer_id, 0) + 1) / max(span.info.throughput, 1e-9),
                                                   -span.end))
        hop_end = min(chosen.end, end)
        hops.append(RouteHop(chosen.peer_id, position, hop_end, capabilities=chosen.info.capability_set))
        position = hop_end
    return hops
