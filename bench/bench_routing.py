"""Routing benchmark: time `find_inference_chain` and `choose_forward_chain` on a random 1000-server swarm.

Builds a seeded swarm of 1000 servers over 80 blocks (random spans of 5..30 blocks, log-normal throughputs,
some full caches, ~10% joining, a few measured next-server pings each, client RTTs to all), then prints one
JSON object with the median wall time of each call. No assertions on time.

Usage (from the repository root): .venv/bin/python bench/bench_routing.py [--servers N] [--blocks B] [--runs R]
"""
from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import time
from typing import Dict, List

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from swarm.client.transport.routing import choose_forward_chain, find_inference_chain  # noqa: E402
from swarm.wire.records import ServerInfo, ServerSpan, ServerState  # noqa: E402


def build_swarm(rng: random.Random, num_servers: int, num_blocks: int) -> List[ServerSpan]:
    names = [f"server-{index:04d}" for index in range(num_servers)]
    spans: List[ServerSpan] = []
    for name in names:
        start = rng.randrange(num_blocks)
        end = min(num_blocks, start + rng.randint(5, 30))
        info = ServerInfo(
            state=ServerState.ONLINE if rng.random() < 0.9 else ServerState.JOINING,
            start=start,
            end=end,
            throughput=rng.lognormvariate(0.0, 0.7),
            cache_tokens_left=rng.choice([0, 4096, 65536]),
            next_pings={other: rng.uniform(0.001, 0.1) for other in rng.sample(names, 8)},
        )
        spans.append(ServerSpan(name, start, end, info))
    # make sure the whole model is covered so that routing never fails
    info = ServerInfo(state=ServerState.ONLINE, start=0, end=num_blocks, throughput=0.5, cache_tokens_left=65536)
    spans.append(ServerSpan("server-full", 0, num_blocks, info))
    return spans


def time_ms(function, runs: int) -> float:
    samples = []
    for _ in range(runs):
        started = time.perf_counter()
        function()
        samples.append((time.perf_counter() - started) * 1000)
    return statistics.median(samples)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--servers", type=int, default=1000)
    parser.add_argument("--blocks", type=int, default=80)
    parser.add_argument("--runs", type=int, default=9)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    rng = random.Random(args.seed)
    spans = build_swarm(rng, args.servers, args.blocks)
    client_rtts: Dict[str, float] = {span.peer_id: rng.uniform(0.001, 0.2) for span in spans}

    def inference():
        return find_inference_chain(spans, 0, args.blocks, client_rtts=client_rtts, cache_tokens_needed=2048)

    forward_rng = random.Random(args.seed + 1)

    def forward():
        return choose_forward_chain(spans, 0, args.blocks, rng=forward_rng)

    inference_ms = time_ms(inference, args.runs)
    forward_ms = time_ms(forward, args.runs * 5)
    result = {
        "servers": args.servers,
        "blocks": args.blocks,
        "runs": args.runs,
        "inference_chain_ms": round(inference_ms, 3),
        "inference_chain_hops": len(inference()),
        "forward_chain_ms": round(forward_ms, 3),
        "forward_chain_hops": len(forward()),
    }
    print(json.dumps(result))


if __name__ == "__main__":
    main()
