"""Routing that prefers servers holding a session's prompt prefix (issue 47). Pure: no network, no clocks.

A session that declares its prompt (`InferenceSession.prefix`, a `PrefixDecl`: salt and tokens) adopts, at its
opening, the leading pages of that prompt that every server of its chain holds (`swarm.client.transport.prefix`: the
least of them). Servers announce what their prefix caches hold in their DHT records (`ServerInfo.prefixes`, a
`swarm.wire.prefix_pages.PrefixSummary`: per block range, the page digests held, most recently used first). The client
computes its prompt's page digests for an announced range (`page_digests`: salt, adapter, range and page size are in
the hash, so pages of other salts or adapters never match) and counts the leading pages found: what a hop over that
range on that server would adopt (`held_tokens`; at most all but the prompt's last token, which is always sent).

`find_prefix_chain` takes the chain `find_inference_chain` finds (the least expected time per decode step) and the
cheapest chain made only of holder hops at each level of held tokens (a hop per announced range, exact DP over the
same cost model: `chain_cost`), and keeps the one with the least expected time for the whole session:

    total(chain) = decode_steps x chain_cost(chain) - saved(chain)
    saved(chain) = held tokens x sum over hops of hop blocks / (throughput x prefill_tokens_per_step)

(`decode_steps`: the session's length less its prompt, at least 1; `RoutingCosts.prefill_tokens_per_step`: the prompt
tokens a block computes in the time of one decode step). So a holder is preferred when it is as fast, and a slower
one only while the prefill it saves outweighs its extra decode time; never one more than `prefix_max_slowdown` slower
per step than the fastest chain (a summary may be stale: a page evicted since costs a cold prefill on a slow chain).
Ties go to the chain holding more, then to the fastest one. A record without a summary holds nothing; a session
without a declared prompt is routed by `find_inference_chain` alone.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Collection, Dict, Iterator, List, Mapping, Optional, Sequence, Tuple

import numpy as np

from swarm.client.transport.coverage import usable_spans
from swarm.client.transport.routing import (
    _EMPTY_RTTS,
    RouteHop,
    RoutingCosts,
    _block_cost,
    _clean_rtt,
    _half_client_rtt,
    _relay_cost,
    chain_cost,
    find_inference_chain,
)
from swarm.wire import protocol as P
from swarm.wire.prefix_pages import held_pages, iter_page_digests
from swarm.wire.records import ServerSpan


@dataclass(frozen=True)
class PrefixCosts:
    """How prefix holders are weighed against the fastest chain (see the module doc)."""

    prefill_tokens_per_step: float = 16.0  # prompt tokens a block computes in the time of one decode step
    prefix_max_slowdown: float = 0.25  # a holder chain is never more than this fraction slower per step


class _Digests:
    """A prompt's page digests for one range and page size, computed as far as they are read (most servers' records
    do not hold its first page: one hash each)."""

    def __init__(self, pages: Iterator[bytes]):
        self._pages, self._done = pages, []  # type: Tuple[Iterator[bytes], List[bytes]]

    def __iter__(self) -> Iterator[bytes]:
        index = 0
        while True:
            if index == len(self._done):
                page = next(self._pages, None)
                if page is None:
                    return
                self._done.append(page)
            yield self._done[index]
            index += 1


class HeldPrefix:
    """How many leading tokens of one declared prompt a server holds for a block range (digests computed once per
    range and page size, as far as they are read)."""

    def __init__(self, prefix: P.PrefixDecl, adapter: Optional[str], session_length: int):
        self.prefix, self.adapter = prefix, adapter
        # the server keys at most the session's length of the declaration (`server.rpc.prefix`)
        tokens = prefix.tokens[:session_length] if session_length > 0 else prefix.tokens
        self.tokens = np.asarray(tokens, dtype=np.int64)
        self._digests: Dict[Tuple[int, int, int], _Digests] = {}

    def held_tokens(self, span: ServerSpan, first: int, last: int) -> int:
        summary = span.info.prefixes
        if summary is None or len(self.tokens) < 2:
            return 0
        key = (first, last, summary.page_tokens)
        if key not in self._digests:
            self._digests[key] = _Digests(iter_page_digests(self.prefix.salt, self.adapter, first, last,
                                                            summary.page_tokens, self.tokens))
        pages = held_pages(summary, first, last, self._digests[key])
        return min(pages * summary.page_tokens, len(self.tokens) - 1)

    def chain_held(self, chain: Sequence[RouteHop], spans: Mapping[str, ServerSpan]) -> int:
        """What the chain would adopt: the least any of its hops holds."""
        return min((self.held_tokens(spans[hop.peer_id], hop.start, hop.end) if hop.peer_id in spans else 0
                    for hop in chain), default=0)


def _saved_seconds(chain: Sequence[RouteHop], spans: Mapping[str, ServerSpan], held: int, costs: PrefixCosts) -> float:
    per_token = sum(hop.length / (spans[hop.peer_id].info.throughput * costs.prefill_tokens_per_step) for hop in chain)
    return held * per_token


def _holder_chain(candidates: Sequence[Tuple[ServerSpan, int, int]], start: int, end: int,
                  client_rtts: Mapping[str, float], cache_tokens_needed: int,
                  costs: RoutingCosts) -> Optional[List[RouteHop]]:
    """The cheapest chain over [start, end) made only of `candidates` (span, first, last) hops, by the cost model of
    `find_inference_chain` (a DP over hops ordered by their first block), or None."""
    ordered = sorted(candidates, key=lambda c: (c[1], c[2], c[0].peer_id))
    best: List[float] = [math.inf] * len(ordered)
    parent: List[Optional[int]] = [None] * len(ordered)
    ending: Dict[int, List[int]] = {}  # block boundary -> the hops (seen so far) that end there
    for i, (span, first, last) in enumerate(ordered):
        own = (last - first) * _block_cost(span, cache_tokens_needed, costs) + _relay_cost(span, costs)
        if first == start:
            best[i] = _half_client_rtt(span.peer_id, client_rtts, costs) + costs.hop_overhead + own
        ending.setdefault(last, []).append(i)
        for j in ending.get(first, ()):  # (hops are ordered by their first block: all that end at `first` came)
            sender = ordered[j][0]
            if sender.peer_id == span.peer_id or best[j] == math.inf:
                continue
            rtt = _clean_rtt(sender.info.next_pings.get(span.peer_id))
            cost = best[j] + (costs.default_rtt if rtt is None else rtt) / 2 + costs.hop_overhead + own
            if cost < best[i]:
                best[i], parent[i] = cost, j
    finals = [(best[i] + _half_client_rtt(ordered[i][0].peer_id, client_rtts, costs) + costs.hop_overhead, i)
              for i in range(len(ordered)) if ordered[i][2] == end and best[i] < math.inf]
    if not finals:
        return None
    _, index = min(finals)
    hops: List[RouteHop] = []
    at: Optional[int] = index
    while at is not None:
        span, first, last = ordered[at]
        info = span.info
        hops.append(RouteHop(span.peer_id, first, last, info.limits, info.dtype, info.capability_set))
        at = parent[at]
    hops.reverse()
    return hops


def find_prefix_chain(
    spans: Sequence[ServerSpan],
    start: int,
    end: int,
    *,
    prefix: Optional[P.PrefixDecl] = None,
    client_rtts: Mapping[str, float] = _EMPTY_RTTS,
    cache_tokens_needed: int = 0,
    banned: Collection[str] = (),
    costs: RoutingCosts = RoutingCosts(),
    prefix_costs: PrefixCosts = PrefixCosts(),
    allowed_quant_types: Optional[Collection[str]] = None,
    adapter: Optional[str] = None,
    session_length: int = 0,
    needs: Collection[str] = (),
) -> List[RouteHop]:
    """`find_inference_chain`'s chain, or a chain of servers that hold a longer leading part of `prefix` where that
    is not slower for the whole session (see the module doc). The arguments are `find_inference_chain`'s."""
    fastest = find_inference_chain(spans, start, end, client_rtts=client_rtts, cache_tokens_needed=cache_tokens_needed,
                                   banned=banned, costs=costs, allowed_quant_types=allowed_quant_types,
                                   adapter=adapter, session_length=session_length, needs=needs)
    if prefix is None or not prefix.tokens:
        return fastest
    usable = usable_spans(spans, start, end, banned, allowed_quant_types, adapter, session_length, needs)
    held = HeldPrefix(prefix, adapter, session_length)
    candidates: List[Tuple[ServerSpan, int, int, int]] = []
    for span in usable.values():
        summary = span.info.prefixes
        for announced in summary.ranges if summary is not None else ():
            first, last = announced.first, announced.last
            if start <= first and last <= end and span.start <= first and last <= span.end:
                tokens = held.held_tokens(span, first, last)
                if tokens > 0:
                    candidates.append((span, first, last, tokens))
    if not candidates:
        return fastest

    def cost(chain: Sequence[RouteHop]) -> float:
        return chain_cost(chain, spans, client_rtts=client_rtts, cache_tokens_needed=cache_tokens_needed, costs=costs)

    steps = max(1, session_length - len(held.tokens))
    fastest_cost = cost(fastest)
    best = fastest
    best_held = held.chain_held(fastest, usable)
    best_total = steps * fastest_cost - _saved_seconds(fastest, usable, best_held, prefix_costs)
    for level in sorted({c[3] for c in candidates}, reverse=True):
        chain = _holder_chain([(s, f, t) for s, f, t, tokens in candidates if tokens >= level], start, end,
                              client_rtts, cache_tokens_needed, costs)
        if chain is None:
            continue
        chain_held = held.chain_held(chain, usable)
        per_step = cost(chain)
        if per_step > fastest_cost * (1 + prefix_costs.prefix_max_slowdown):
            continue
        total = steps * per_step - _saved_seconds(chain, usable, chain_held, prefix_costs)
        if (total, -chain_held) < (best_total, -best_held):
            best, best_total, best_held = chain, total, chain_held
    return best
