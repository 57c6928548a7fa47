"""A discrete-event simulation of a volunteer swarm of 100 to 10,000 servers, driving the project's own placement,
rebalancing, hole-filling and routing code (`server.placement.policy`, `swarm.client.transport.routing`; no copies).

The model (one run, `simulate`):
- Servers join as a Poisson process and stay for a heavy-tailed time (Pareto, shape `--uptime_shape`, mean
  `--mean_uptime_min`), so the swarm hovers around `--servers`. Each has a throughput drawn log-uniformly over two
  orders of magnitude (1..100 decode steps/s per block) and serves 4, 8, 16 or 32 of the model's `--blocks` blocks.
- The DHT is what servers and clients see: a record per server (span, state, throughput). Joining: the server
  takes `choose_best_span` of the records, announces JOINING and serves (ONLINE) after a load time of
  `LOAD_BASE_S + LOAD_PER_BLOCK_S` per block. Leaving: a graceful leave (`--graceful` of them) announces OFFLINE at
  once; a crash leaves the record until it expires, between 1 and 2 `update_period`s later (the record lives 2
  update periods from its last refresh).
- Rebalancing, as `server.placement.spans`: every `jittered(balance_period)` a server asks `move_target` (the decision
  of `should_move` on per-block totals) and, after a random delay of up to min(2 s, balance_period/4), asks again;
  a move announces the new span JOINING and serves it after the load time.
- Hole watch (`hole_check_period` > 0, `server.placement.spans.check_holes`): every jittered hole_check_period x
  max(1, servers/100) a server looks for blocks nobody serves; if moving would cover some, it waits its turn
  (`hole_fill_turn`, `hole_fill_delay`), asks again and moves.
- Sessions arrive every `--route_every` s and are routed with `find_inference_chain` over the ONLINE records;
  a chain through a server that has gone (its record not yet expired) or a hole (`RoutingError`) is a failed
  first try.

It reports the swarm's throughput (the bottleneck: the weakest block's total ONLINE throughput of live servers,
also as a fraction of the ideal, total capacity spread evenly), holes (blocks no live server serves), moves per
hour, routing and decision wall times, and the DHT work per server per minute the settings imply. The baseline is
the reference system's policy: least-served span, balance_quality 0.75, 120 s checks, 120 s update period, no hole
watch. `--grid` runs the settings sweep behind docs/swarm-simulation.md and draws its plots; `--seeds K` repeats
each setting over K seeds and reports mean, std, min and max; `--sweep` runs the recommended settings and their
baselines over 5 seeds (docs/swarm-simulation-seeds.json).

Usage: python bench/bench_swarm_sim.py [--servers 1000] [--hours 1] [--seeds 1] [--grid | --sweep]
"""
from __future__ import annotations

import argparse
import heapq
import itertools
import json
import os
import random
import statistics
import sys
import time
from dataclasses import asdict, dataclass, field, replace
from typing import Dict, List, Optional, Set, Tuple

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from server.placement.policy import choose_best_span, hole_fill_turn, move_target, uncovered_blocks  # noqa: E402
from server.placement.spans import HOLE_FULL_READ_SWARM, hole_check_interval, hole_fill_delay  # noqa: E402
from swarm.client.transport.routing import RoutingError, find_inference_chain  # noqa: E402
from swarm.wire.records import ServerInfo, ServerSpan, ServerState  # noqa: E402

LOAD_BASE_S, LOAD_PER_BLOCK_S = 10.0, 2.0  # a volunteer's load time: start-up plus reading each block's weights
SPAN_LENGTHS = (4, 8, 16, 32)
WARM_UP_S = 600.0  # the first 10 minutes (the initial servers loading) are left out of the figures
RECORD_BYTES = 350  # one server's record under one block key (msgpack of ServerInfo with a few next pings)


@dataclass(frozen=True)
class Policy:
    """The settings under test (the flags of `swarmgate server` of the same names)."""

    name: str = "baseline"
    balance_quality: float = 0.75
    balance_period: float = 120.0
    update_period: float = 120.0
    hole_check_period: float = 0.0  # 0: no hole watch (the reference system)


BASELINE = Policy()
RECOMMENDED = Policy("hole watch", hole_check_period=5.0)


@dataclass
class Server:
    peer: str
    length: int
    throughput: float
    start: int = 0
    end: int = 0
    online: bool = False  # serving its span (loaded); False while loading
    alive: bool = True
    epoch: int = 0  # bumped on every move and on leaving: stale events of an older epoch are ignored
    span: Optional[ServerSpan] = None  # its record in the DHT (None: no record)


@dataclass
class Stats:
    samples: List[dict] = field(default_factory=list)
    moves: int = 0
    hole_moves: int = 0
    joins: int = 0
    leaves: int = 0
    sessions: int = 0
    failed_dead: int = 0
    failed_hole: int = 0
    route_s: List[float] = field(default_factory=list)
    decide_s: List[float] = field(default_factory=list)
    hole_checks: int = 0
    balance_checks: int = 0


class Swarm:
    """The simulated swarm: servers, the DHT's records and the event queue."""

    def __init__(self, policy: Policy, num_servers: int, num_blocks: int, seed: int, mean_uptime_s: float,
                 uptime_shape: float, graceful: float, route_every: float):
        self.policy, self.num_blocks, self.rng = policy, num_blocks, random.Random(seed)  # the volunteers' world
        self.jitter = random.Random(seed + 1)  # the servers' random delays: runs of one seed see the same world
        self.target, self.mean_uptime, self.shape, self.graceful = num_servers, mean_uptime_s, uptime_shape, graceful
        self.route_every = route_every
        self.now = 0.0
        self.events: List[Tuple[float, int, str, str, int]] = []
        self.counter = itertools.count()
        self.servers: Dict[str, Server] = {}
        self.view_tp = [0.0] * num_blocks  # per-block throughput of the records (JOINING or ONLINE)
        self.view_count = [0] * num_blocks
        self.recorded: Set[str] = set()  # peers with a record
        self.stats = Stats()
        self.hole_since: Dict[int, float] = {}
        self.hole_durations: List[float] = []

    # ---- the DHT's records ------------------------------------------------------------------------------
    def put_record(self, server: Server, state: ServerState) -> None:
        self.drop_record(server)
        info = ServerInfo(state=state, start=server.start, end=server.end, throughput=server.throughput,
                          cache_tokens_left=1 << 16)
        server.span = ServerSpan(server.peer, server.start, server.end, info)
        for index in range(server.start, server.end):
            self.view_tp[index] += server.throughput
            self.view_count[index] += 1
        self.recorded.add(server.peer)

    def drop_record(self, server: Server) -> None:
        if server.span is None:
            return
        for index in range(server.span.start, server.span.end):
            self.view_count[index] -= 1
            self.view_tp[index] = self.view_tp[index] - server.throughput if self.view_count[index] else 0.0
        server.span = None
        self.recorded.discard(server.peer)

    def without(self, server: Server) -> List[float]:
        totals = list(self.view_tp)
        for index in range(server.start, server.end):
            totals[index] = totals[index] - server.throughput if self.view_count[index] > 1 else 0.0
        return totals

    # ---- events ---------------------------------------------------------------------------------------------
    def at(self, delay: float, kind: str, peer: str = "", epoch: int = 0) -> None:
        heapq.heappush(self.events, (self.now + delay, next(self.counter), kind, peer, epoch))

    def uptime(self) -> float:
        scale = self.mean_uptime * (self.shape - 1) / self.shape  # Pareto x_m for the wanted mean
        return scale / (1.0 - self.rng.random()) ** (1 / self.shape)

    def load_time(self, server: Server) -> float:
        return LOAD_BASE_S + LOAD_PER_BLOCK_S * server.length

    def join(self) -> None:
        index = next(self.counter)
        server = Server(f"peer{index:07d}", self.rng.choice(SPAN_LENGTHS), 10 ** self.rng.uniform(0, 2))
        server.length = min(server.length, self.num_blocks)
        began = time.perf_counter()
        server.start, server.end = choose_best_span(self.view_tp, server.length)
        self.stats.decide_s.append(time.perf_counter() - began)
        self.servers[server.peer] = server
        self.put_record(server, ServerState.JOINING)
        self.stats.joins += 1
        self.at(self.load_time(server), "online", server.peer, server.epoch)
        self.at(self.uptime(), "leave", server.peer)
        self.at(self.policy.balance_period * self.jitter.uniform(0.5, 1.5), "balance", server.peer)
        if self.policy.hole_check_period > 0:
            self.at(self.hole_interval(), "hole_check", server.peer)

    def hole_interval(self) -> float:
        return hole_check_interval(self.policy.hole_check_period, len(self.recorded), self.jitter)

    def decide(self, server: Server) -> Optional[Tuple[int, int]]:
        self.stats.balance_checks += 1
        began = time.perf_counter()
        target = move_target(self.without(server), (server.start, server.end), server.throughput,
                             balance_quality=self.policy.balance_quality)
        self.stats.decide_s.append(time.perf_counter() - began)
        return target

    def move(self, server: Server, target: Tuple[int, int], for_hole: bool) -> None:
        server.start, server.end = target
        server.online = False
        server.epoch += 1
        self.put_record(server, ServerState.JOINING)
        self.stats.moves += 1
        self.stats.hole_moves += for_hole
        self.at(self.load_time(server), "online", server.peer, server.epoch)

    def handle(self, kind: str, peer: str, epoch: int) -> None:
        server = self.servers.get(peer) if peer else None
        if kind == "join":
            self.join()
            self.at(self.rng.expovariate(self.target / self.mean_uptime), "join")
        elif kind == "sample":
            self.sample()
            self.at(60.0, "sample")
        elif kind == "route":
            self.route()
            self.at(self.route_every, "route")
        elif kind == "expire" and server is not None:
            self.drop_record(server)
            del self.servers[peer]
        elif server is None or not server.alive:
            return
        elif kind == "leave":
            server.alive, server.online = False, False
            server.epoch += 1
            self.stats.leaves += 1
            if self.rng.random() < self.graceful:
                self.drop_record(server)
                del self.servers[peer]
            else:  # the record stays until it expires: 2 update periods after its last refresh
                self.at(self.policy.update_period * self.rng.uniform(1.0, 2.0), "expire", peer)
        elif kind == "online" and epoch == server.epoch:
            server.online = True
            self.put_record(server, ServerState.ONLINE)
        elif kind == "balance":
            self.at(self.policy.balance_period * self.jitter.uniform(0.5, 1.5), "balance", peer)
            if server.online and self.decide(server) is not None:
                delay = self.jitter.uniform(0.0, min(2.0, self.policy.balance_period / 4))
                self.at(delay, "recheck", peer, server.epoch)
        elif kind in ("recheck", "hole_fill") and epoch == server.epoch and server.online:
            target = self.decide(server)
            if target is not None:
                self.move(server, target, kind == "hole_fill")
        elif kind == "hole_check":
            self.at(self.hole_interval(), "hole_check", peer)
            self.stats.hole_checks += 1
            if uncovered_blocks(self.view_tp) and server.online and self.decide(server) is not None:
                spans = [s.span for s in self.servers.values() if s.span is not None]
                turn = hole_fill_turn(spans, self.num_blocks, peer, balance_quality=self.policy.balance_quality)
                if turn is not None:
                    delay = hole_fill_delay(turn, self.policy.hole_check_period, len(self.recorded), self.jitter)
                    self.at(delay, "hole_fill", peer, server.epoch)

    # ---- measurements ---------------------------------------------------------------------------------------
    def live_totals(self) -> List[float]:
        totals = [0.0] * self.num_blocks
        for server in self.servers.values():
            if server.alive and server.online:
                for index in range(server.start, server.end):
                    totals[index] += server.throughput
        return totals

    def sample(self) -> None:
        totals = self.live_totals()
        holes = [index for index, value in enumerate(totals) if value <= 0]
        for index in holes if self.now >= WARM_UP_S else ():
            self.hole_since.setdefault(index, self.now)
        for index in [index for index in self.hole_since if index not in holes]:
            self.hole_durations.append(self.now - self.hole_since.pop(index))
        live = [s for s in self.servers.values() if s.alive]
        capacity = sum(s.throughput * s.length for s in live) / self.num_blocks
        self.stats.samples.append({"t_min": round(self.now / 60, 1), "servers": len(live),
                                   "records": len(self.recorded), "bottleneck": round(min(totals), 2),
                                   "ideal": round(capacity, 2), "holes": len(holes), "moves": self.stats.moves})

    def route(self) -> None:
        spans = [s.span for s in self.servers.values() if s.span is not None]
        self.stats.sessions += 1
        began = time.perf_counter()
        try:
            chain = find_inference_chain(spans, 0, self.num_blocks)
        except RoutingError:
            self.stats.failed_hole += 1
            return
        finally:
            self.stats.route_s.append(time.perf_counter() - began)
        if any(not self.servers[hop.peer_id].alive for hop in chain):
            self.stats.failed_dead += 1

    def run(self, seconds: float) -> None:
        for _ in range(self.target):  # a swarm that already exists: its servers joined one after another
            self.join()
        self.at(0.0, "join")
        self.at(0.0, "sample")
        self.at(self.route_every / 2, "route")
        while self.events and self.events[0][0] <= seconds:
            self.now, _, kind, peer, epoch = heapq.heappop(self.events)
            self.handle(kind, peer, epoch)


def simulate(policy: Policy, *, servers: int, hours: float, blocks: int = 80, seed: int = 1,
             mean_uptime_min: float = 60.0, uptime_shape: float = 1.5, graceful: float = 0.5,
             route_every: float = 60.0) -> dict:
    """One run; a JSON-ready summary with the samples over time."""
    swarm = Swarm(policy, servers, blocks, seed, mean_uptime_min * 60, uptime_shape, graceful, route_every)
    began = time.perf_counter()
    swarm.run(hours * 3600)
    wall = time.perf_counter() - began
    stats, warm = swarm.stats, [s for s in swarm.stats.samples if s["t_min"] >= 10]  # after the first 10 minutes
    hole_minutes = sum(1 for s in warm if s["holes"]) / max(1, len(warm))
    durations = swarm.hole_durations + [swarm.now - since for since in swarm.hole_since.values()]
    # reads of every block's key: balance checks, and the hole watch's full reads
    # (server.placement.spans.full_read_due); the hole checks in between read only the thin blocks' keys, the next-ping
    # measurement block `end`'s key
    checks_per_min = 60 / policy.balance_period
    if policy.hole_check_period > 0:
        checks_per_min += 60 / (policy.hole_check_period * max(1.0, servers / 100, servers / HOLE_FULL_READ_SWARM))
    mean_length = statistics.fmean(SPAN_LENGTHS)
    return {
        "policy": asdict(policy), "servers": servers, "blocks": blocks, "hours": hours, "seed": seed,
        "bottleneck_mean": round(statistics.fmean(s["bottleneck"] for s in warm), 2),
        "bottleneck_of_ideal": round(statistics.fmean(s["bottleneck"] / s["ideal"] for s in warm if s["ideal"]), 3),
        "minutes_with_holes_frac": round(hole_minutes, 3),
        "hole_block_minutes": sum(s["holes"] for s in warm),
        "hole_duration_p50_s": round(statistics.median(durations), 1) if durations else 0.0,
        "hole_duration_max_s": round(max(durations), 1) if durations else 0.0,
        "moves_per_hour": round(stats.moves / hours, 1),
        "moves_per_server_hour": round(stats.moves / hours / servers, 4),
        "hole_moves": stats.hole_moves,
        "joins": stats.joins, "leaves": stats.leaves,
        "sessions": stats.sessions, "failed_first_try_dead": stats.failed_dead, "failed_hole": stats.failed_hole,
        "route_ms_p50": round(1000 * statistics.median(stats.route_s), 2) if stats.route_s else None,
        "decide_ms_p50": round(1000 * statistics.median(stats.decide_s), 3),
        "dht_fetches_per_server_min": round(checks_per_min, 2),
        "dht_stores_per_server_min": round(60 / policy.update_period * mean_length, 2),
        "records_per_fetch": round(servers * mean_length),
        "kbytes_per_fetch": round(servers * mean_length * RECORD_BYTES / 1024),
        "wall_s": round(wall, 1),
        "samples": stats.samples,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--servers", type=int, default=1000)
    parser.add_argument("--hours", type=float, default=1.0)
    parser.add_argument("--blocks", type=int, default=80)
    parser.add_argument("--seed", type=int, default=1, help="the (first) seed of the volunteers' world")
    parser.add_argument("--seeds", type=int, default=1, help="runs per setting, seeds --seed, --seed + 1, ...: with "
                                                             "more than one, each measure's mean, std, min and max")
    parser.add_argument("--grid", action="store_true", help="the settings sweep of docs/swarm-simulation.md (long)")
    parser.add_argument("--sweep", action="store_true", help="the recommended settings and their baselines over "
                                                             "--seeds seeds (default 5; docs/swarm-simulation.md)")
    parser.add_argument("--out", default="docs", help="where --grid and --sweep write their JSON (and plots)")
    args = parser.parse_args()
    if args.seeds < 1:
        parser.error("--seeds must be at least 1")
    if args.grid:
        from bench.swarm_sim_grid import run_grid

        run_grid(args.out, simulate, BASELINE, RECOMMENDED, replace)
        return 0
    seeds = list(range(args.seed, args.seed + (5 if args.sweep and args.seeds == 1 else args.seeds)))
    if args.sweep:
        from bench.swarm_sim_grid import run_seeds

        summaries = run_seeds(args.out, simulate, BASELINE, replace, seeds)
        print(json.dumps({"runs": len(summaries) * len(seeds), "seeds": seeds, "settings": summaries}))
        return 0
    keys = ["bottleneck_of_ideal", "minutes_with_holes_frac", "hole_block_minutes", "hole_duration_max_s",
            "moves_per_hour", "failed_first_try_dead", "failed_hole", "route_ms_p50", "decide_ms_p50", "wall_s"]
    summary = {}
    for policy in (BASELINE, RECOMMENDED):
        runs = [simulate(policy, servers=args.servers, hours=args.hours, blocks=args.blocks, seed=seed)
                for seed in seeds]
        if len(runs) == 1:
            summary.update({f"{policy.name}.{key}": runs[0][key] for key in keys})
        else:
            from bench.swarm_sim_grid import spread

            summary.update({f"{policy.name}.{key}": value for key, value in spread(runs, keys).items()})
    print(json.dumps({"servers": args.servers, "hours": args.hours, "seeds": seeds, **summary}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
