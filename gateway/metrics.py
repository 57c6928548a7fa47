"""Prometheus metrics of one gateway (its own registry, so that several apps can live in one process).

Requests by endpoint and status, time to first token and inter-token latency histograms, prompt and
completion token counters, active sessions, queue length, and the swarm's coverage (blocks served by at
least one online server, out of the model's blocks), refreshed from the client's cached view at each scrape.
"""
from __future__ import annotations

from typing import Callable, Optional, Tuple

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client import CONTENT_TYPE_LATEST  # noqa: F401  (re-exported for the /metrics route)

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
        self.prompt_tokens = Counter("swarmgate_prompt_tokens", "prompt tokens of admitted requests", registry=r)
        self.completion_tokens = Counter("swarmgate_completion_tokens", "generated tokens", registry=r)
        self.active_sessions = Gauge("swarmgate_active_sessions", "inference sessions open in the swarm",
                                     registry=r)
        self.running = Gauge("swarmgate_running_requests", "generations running", registry=r)
        self.queue_length = Gauge("swarmgate_queue_length", "requests waiting for a generation slot", registry=r)
        self.blocks_covered = Gauge("swarmgate_swarm_blocks_covered", "blocks served by an online server",
                                    registry=r)
        self.blocks_total = Gauge("swarmgate_swarm_blocks_total", "blocks of the model", registry=r)
        self.servers_online = Gauge("swarmgate_swarm_servers_online", "online servers of the model", registry=r)
        self.coverage_source = coverage  # () -> (blocks covered, blocks total, servers online)

    def observe_admission(self, admission) -> None:
        self.running.set(admission.running)
        self.queue_length.set(admission.waiting)

    def render(self) -> bytes:
        if self.coverage_source is not None:
            try:
                covered, total, servers = self.coverage_source()
                self.blocks_covered.set(covered)
                self.blocks_total.set(total)
                self.servers_online.set(servers)
            except Exception:  # the swarm view is best effort here; /health reports failures
                pass
        return generate_latest(self.registry)
