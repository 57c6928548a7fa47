"""Prometheus metrics of one gateway (its own registry, so that several apps can live in one process).

Requests by endpoint and status, time to first token and inter-token latency histograms, prompt and
completion token counters, active sessions, queue length, the conversation session pool (hits, misses, prompt
tokens reused, evictions by reason, pooled sessions and the cache they reserve), prompt tokens adopted from the
servers' prefix caches (`--prefix_sharing`) and each server's own prefix cache counters by `peer_id` (pages held, hit,
computed, evicted; sessions declined: `rpc_prefix_cache` of every online server, read at a scrape and kept
`PREFIX_SECONDS` so that many scrapers cost the servers one call each per period),
speculative decoding's drafted and accepted tokens, requests and tokens by API key name and requests refused by a
key's limits (`gateway.api.quota`),
the time spent building each inference chain (`swarmgate_route_seconds` by part: `view` is reading the swarm's DHT
records and pinging servers when the client's view was due for a refresh, `search` is
`find_inference_chain`, `total` both; a request builds one at admission and one per session it opens or fails
over), and the swarm's coverage
(blocks served by at least one online server, out of the model's blocks), refreshed from the client's cached
view at each scrape, and with `--verify_rate` the spot-checks of servers' outputs (`swarm.client.transport.verify`, read
at each scrape): checks done and passed, servers outvoted (`mismatches`, each then distrusted), checks impossible
because one server alone covers a span (`unverifiable`), disagreements without a majority, the distrusted servers
by peer id, and the tokens the gateway picked again after a retraction.

A gateway serving several models (`gateway.api.models`) has one `Metrics` per model: the first model's also counts
what is gateway-wide (`GATEWAY_WIDE`: requests, admission, API keys, the store), and `render_models` writes each model's
own series with a `model` label (with one model, the text is `render()`'s, without that label).
"""
from __future__ import annotations

import logging
import threading
import time
from typing import Any, Callable, Dict, Iterator, Optional, Sequence, Tuple

from prometheus_client import (
    CONTENT_TYPE_LATEST,  # noqa: F401  (re-exported for the /metrics route)
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.metrics_core import Metric

logger = logging.getLogger(__name__)

PREFIX_SECONDS = 2.0  # how long one reading of the servers' prefix cache counters serves scrapes
_ROUTE_BUCKETS = (0.0001, 0.0003, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1, 2, 5, 10)
# families counted once per gateway (on the first model's Metrics), not per model
GATEWAY_WIDE = frozenset({"swarmgate_requests", "swarmgate_running_requests", "swarmgate_queue_length",
                          "swarmgate_key_requests", "swarmgate_key_tokens", "swarmgate_rate_limited",
                          "swarmgate_store_errors"})
_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1, 1.5, 2, 3, 5, 10, 20, 60)


class Metrics:
    def __init__(self, coverage: Optional[Callable[[], Tuple[int, int, int]]] = None):
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter("swarmgate_requests", "HTTP requests by endpoint and status code",
                                ["endpoint", "status"], registry=r)
        self.time_to_first_token = Histogram("swarmgate_time_to_first_token_seconds",
                                             "time from request arrival to its first generated token",
                                             buckets=_LATENCY_BUCKETS, registry=r)
        self.inter_token_latency = Histogram("swarmgate_inter_token_latency_seconds",
                                             "time between consecutive decode steps of a generation",
                                             buckets=_LATENCY_BUCKETS, registry=r)
        self.round_rows = Histogram("swarmgate_round_rows", "rows (choices of every generation) picked together in "
                                    "one engine round (gateway.serving.rounds)",
                                    buckets=(1, 2, 4, 8, 16, 32, 64, 128, 256, 512), registry=r)
        self.prompt_tokens = Counter("swarmgate_prompt_tokens", "prompt tokens of admitted requests", registry=r)
        self.completion_tokens = Counter("swarmgate_completion_tokens", "generated tokens", registry=r)
        self.active_sessions = Gauge("swarmgate_active_sessions",
                                     "inference sessions in use by running generations (pooled ones not counted)",
                                     registry=r)
        self.pool_hits = Counter("swarmgate_pool_hits", "requests that continued a pooled session", registry=r)
        self.pool_misses = Counter("swarmgate_pool_misses",
                                   "pool-eligible requests (n=1) that found no pooled session to continue",
                                   registry=r)
        self.pool_reused_tokens = Counter("swarmgate_pool_reused_tokens",
                                          "prompt tokens not sent again because a pooled session held them",
                                          registry=r)
        self.pool_evictions = Counter("swarmgate_pool_evictions",
                                      "pooled sessions closed, by reason (ttl, capacity, outgrown, superseded, "
                                      "out_of_cache, open_failed, failed, distrusted, shutdown)", ["reason"],
                                      registry=r)
        self.prefix_adopted_tokens = Counter(
            "swarmgate_prefix_adopted_tokens", "prompt tokens of fresh sessions that the servers held already from "
            "earlier conversations' prefix pages (--prefix_sharing), not computed again", registry=r)
        self.pool_sessions = Gauge("swarmgate_pool_sessions", "idle sessions kept in the pool", registry=r)
        self.pool_cache_tokens = Gauge("swarmgate_pool_cache_tokens",
                                       "KV cache tokens the pooled sessions reserve on the servers (max_length each)",
                                       registry=r)
        self.pool_held_tokens = Gauge("swarmgate_pool_held_tokens", "tokens whose states the pooled sessions hold",
                                      registry=r)
        self.draft_tokens = Counter("swarmgate_speculative_draft_tokens",
                                    "tokens drafted and sent for verification (speculative decoding)", registry=r)
        self.accepted_draft_tokens = Counter("swarmgate_speculative_accepted_tokens",
                                             "drafted tokens the swarm's verification accepted", registry=r)
        self.running = Gauge("swarmgate_running_requests", "generations running", registry=r)
        self.queue_length = Gauge("swarmgate_queue_length", "requests waiting for a generation slot", registry=r)
        self.blocks_covered = Gauge("swarmgate_swarm_blocks_covered", "blocks served by an online server",
                                    registry=r)
        self.blocks_total = Gauge("swarmgate_swarm_blocks_total", "blocks of the model", registry=r)
        self.servers_online = Gauge("swarmgate_swarm_servers_online", "online servers of the model", registry=r)
        self.verify_retracted_tokens = Counter(
            "swarmgate_verify_retracted_tokens", "tokens picked from outputs that spot-checks found wrong, dropped and "
                                                 "picked again (per choice row)", registry=r)
        self.route_seconds = Histogram("swarmgate_route_seconds",
                                       "seconds to build one inference chain, by part (view: the swarm's records read "
                                       "and servers pinged when due; search: find_inference_chain; total)",
                                       ["part"], buckets=_ROUTE_BUCKETS, registry=r)
        self.key_requests = Counter("swarmgate_key_requests", "generation requests by API key name (`anonymous`, "
                                    "`config-<hash>` for --api_keys keys)", ["key"], registry=r)
        self.key_tokens = Counter("swarmgate_key_tokens", "tokens by API key name and kind (prompt, cached, "
                                  "completion), cut and cancelled requests included", ["key", "kind"], registry=r)
        self.rate_limited = Counter("swarmgate_rate_limited", "requests refused by a key's limit (requests, tokens, "
                                                              "streams)", ["key", "limit"], registry=r)
        self.store_errors = Counter("swarmgate_store_errors", "usage writes the state store failed (logged)",
                                    registry=r)
        self.coverage_source = coverage  # () -> (blocks covered, blocks total, servers online)
        # () -> swarm.client.transport.verify.VerifyStats or None (off)
        self.verify_source: Optional[Callable[[], Any]] = None
        r.register(_VerifyCollector(self))
        # () -> {peer id: swarm.wire.call_messages.PrefixCacheReport} (the client model's `server_prefix_caches`)
        self.prefix_source: Optional[Callable[[], Dict[str, Any]]] = None
        self.prefix_collector = _PrefixCollector(self)
        r.register(self.prefix_collector)
        self.pool: Optional[Any] = None  # the SessionPool, read at each scrape

    def count_eviction(self, reason: str, count: int = 1) -> None:
        self.pool_evictions.labels(reason=reason).inc(count)

    def count_speculation(self, drafted: int, accepted: int) -> None:
        self.draft_tokens.inc(drafted)
        self.accepted_draft_tokens.inc(accepted)

    def observe_route(self, timing) -> None:
        """One inference chain built (`swarm.client.transport.manager.RouteTiming`; the manager's `on_route`)."""
        self.route_seconds.labels(part="view").observe(timing.view_s)
        self.route_seconds.labels(part="search").observe(timing.search_s)
        self.route_seconds.labels(part="total").observe(timing.total_s)

    def observe_admission(self, admission) -> None:
        self.running.set(admission.running)
        self.queue_length.set(admission.waiting)

    def render(self) -> bytes:
        self.refresh()
        return generate_latest(self.registry)

    def refresh(self) -> None:
        """Read the gauges kept elsewhere (the pool, the swarm's coverage) before a scrape."""
        if self.pool is not None:
            self.pool_sessions.set(len(self.pool))
            self.pool_cache_tokens.set(self.pool.reserved_tokens)
            self.pool_held_tokens.set(self.pool.held_tokens)
        if self.coverage_source is not None:
            try:
                covered, total, servers = self.coverage_source()
                self.blocks_covered.set(covered)
                self.blocks_total.set(total)
                self.servers_online.set(servers)
            except Exception:  # the swarm view is best effort here; /health reports failures
                pass


def render_models(models: Sequence[Tuple[str, Metrics]]) -> bytes:
    """The Prometheus text of a gateway's models [(model id, its Metrics)], the first also holding the gateway-wide
    families: one model: its `render()`; several: each per-model sample labelled `model="<id>"`."""
    if len(models) == 1:
        return models[0][1].render()
    for _, metrics in models:
        metrics.refresh()
    registry = CollectorRegistry()
    registry.register(_ByModel(models))
    return generate_latest(registry)


class _ByModel:
    """Collects several models' registries as one: their families merged by name, each model's samples labelled."""

    def __init__(self, models: Sequence[Tuple[str, Metrics]]):
        self.models = models

    def collect(self) -> Iterator[Any]:
        families: Dict[str, Any] = {}
        for index, (name, metrics) in enumerate(self.models):
            for family in metrics.registry.collect():
                if family.name in GATEWAY_WIDE:
                    if index == 0:
                        families[family.name] = family
                    continue
                merged = families.get(family.name)
                if merged is None:
                    merged = families[family.name] = Metric(family.name, family.documentation, family.type,
                                                            family.unit)
                merged.samples += [s._replace(labels={"model": name, **s.labels}) for s in family.samples]
        yield from families.values()


_VERIFY_COUNTERS = (
    ("checks", "spans whose outputs were checked against at least one independent server"),
    ("passed", "checks that found the outputs right"),
    ("mismatches", "servers outvoted by two independent servers (each is then distrusted: banned for good)"),
    ("unverifiable", "checks impossible: no other server covers the span with the same dtype and weights"),
    ("unresolved", "disagreements without a majority (nobody banned)"),
    ("referee_failures", "calls to an independent server for a check that failed"),
    ("skipped_busy", "random checks skipped: the session had as many checks in flight as allowed"),
)


class _VerifyCollector:
    """The client verifier's counters, read at each scrape (nothing while verification is off)."""

    def __init__(self, metrics: Metrics):
        self.metrics = metrics

    def collect(self) -> Iterator[Any]:
        source = self.metrics.verify_source
        stats = source() if source is not None else None
        if stats is None:
            return
        for name, help_text in _VERIFY_COUNTERS:
            yield CounterMetricFamily(f"swarmgate_verify_{name}", help_text, value=getattr(stats, name))
        distrusted = GaugeMetricFamily("swarmgate_verify_distrusted", "servers distrusted after spot-checks (1 each)",
                                       labels=["peer_id"])
        for peer in dict.fromkeys(stats.distrusted):
            distrusted.add_metric([peer], 1)
        yield distrusted
        yield GaugeMetricFamily("swarmgate_verify_distrusted_servers", "how many servers are distrusted",
                                value=len(set(stats.distrusted)))
        yield GaugeMetricFamily("swarmgate_verify_largest_passed_divergence",
                                "the largest divergence of a check that passed (how close honest servers are)",
                                value=stats.largest_passed)


_PREFIX_COUNTERS = (
    ("pages_hit", "prefix pages a server's new sessions adopted (server.compute.prefix_cache)"),
    ("pages_computed", "prefix pages of declared prompts a server's sessions computed (a page computed twice counts "
                       "twice)"),
    ("pages_evicted", "prefix pages a server dropped for room"),
    ("sessions_declined", "sessions that declared a prefix a server's cache declines (beams, deep prompts, windows)"),
)


class _PrefixCollector:
    """Each online server's prefix cache counters, labelled by `peer_id` (its `rpc_prefix_cache` since it started),
    read at most once per `PREFIX_SECONDS` (nothing without a source, or while no server answers)."""

    def __init__(self, metrics: Metrics):
        self.metrics = metrics
        self._lock = threading.Lock()
        self._read: Optional[Tuple[float, Dict[str, Any]]] = None

    def reports(self) -> Dict[str, Any]:
        source = self.metrics.prefix_source
        if source is None:
            return {}
        with self._lock:  # one reading at a time; concurrent scrapes share it
            if self._read is None or time.monotonic() - self._read[0] > PREFIX_SECONDS:
                try:
                    reports = source()
                except Exception as e:  # noqa: BLE001 - a scrape shows the rest; /status says what is wrong
                    logger.warning(f"cannot read the servers' prefix cache counters: {e}")
                    reports = {}
                self._read = (time.monotonic(), reports)
            return self._read[1]

    def collect(self) -> Iterator[Any]:
        reports = {peer: r for peer, r in self.reports().items() if r.enabled}
        if not reports:
            return
        held = GaugeMetricFamily("swarmgate_server_prefix_pages_held", "prefix pages a server keeps now",
                                 labels=["peer_id"])
        for peer, report in sorted(reports.items()):
            held.add_metric([peer], report.pages_held)
        yield held
        for name, help_text in _PREFIX_COUNTERS:
            family = CounterMetricFamily(f"swarmgate_server_prefix_{name}", help_text, labels=["peer_id"])
            for peer, report in sorted(reports.items()):
                family.add_metric([peer], getattr(report, name))
            yield family
