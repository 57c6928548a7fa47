"""Routing benchmark: time `find_inference_chain`, `find_prefix_chain` and `choose_forward_chain` on a random
1000-server swarm.

Builds a seeded swarm of 1000 servers over 80 blocks (random spans of 5..30 blocks, log-normal throughputs,
some full caches, ~10% joining, a few measured next-server pings each, client RTTs to all), then prints one
JSON object with the median wall time of each call. For `find_prefix_chain` every record carries a full prefix
summary (`swarm.wire.prefix_pages`: 8 ranges, 256 pages, the largest a record holds), and the servers of the
fastest chain without the fastest's first server (where an earlier session ran) hold the declared 1,024-token
prompt's 16 pages for their hops. No assertions on time.

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

from swarm.client.transport.prefix_routing import HeldPrefix, find_prefix_chain  # noqa: E402
from swarm.client.transport.routing import RouteHop, choose_forward_chain, find_inference_chain  # noqa: E402
from swarm.wire import protocol as P  # noqa: E402
from swarm.wire.prefix_pages import MAX_PAGES, MAX_RANGES, page_digests, summarize  # noqa: E402
from swarm.wire.records import ServerInfo, ServerSpan, ServerState  # noqa: E402

PAGE = 64
PROMPT_PAGES = 16  # a 1,024-token prompt


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


def with_prefixes(rng: random.Random, spans: List[ServerSpan], prompt: P.PrefixDecl,
                  holders: List[RouteHop]) -> List[ServerSpan]:
    """`spans` whose records announce full summaries of random pages, and the servers of chain `holders` (where an
    earlier session ran) hold `prompt` for their hops."""
    chain = {hop.peer_id: hop for hop in holders}
    out = []
    for span in spans:
        keys = []
        hop = chain.get(span.peer_id)
        if hop is not None:
            keys += [(hop.start, hop.end, d) for d in page_digests(prompt.salt, None, hop.start, hop.end, PAGE,
                                                                   prompt.tokens)]
        while len(keys) < MAX_PAGES:
            first = rng.randrange(span.start, span.end)
            keys += [(first, span.end, rng.randbytes(16)) for _ in range(MAX_PAGES // MAX_RANGES)]
        info = span.info.model_copy(update={"prefixes": summarize(keys, PAGE)})
        out.append(ServerSpan(span.peer_id, span.start, span.end, info))
    return out


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

    prompt = P.PrefixDecl(salt="bench", tokens=[rng.randrange(50_000) for _ in range(PROMPT_PAGES * PAGE + 20)])
    fastest = inference()
    runner_up = find_inference_chain(spans, 0, args.blocks, client_rtts=client_rtts, cache_tokens_needed=2048,
                                     banned=[fastest[0].peer_id])
    held_spans = with_prefixes(rng, spans, prompt, runner_up)
    length = len(prompt.tokens) + 256

    def prefix():
        return find_prefix_chain(held_spans, 0, args.blocks, prefix=prompt, client_rtts=client_rtts,
                                 cache_tokens_needed=2048, session_length=length)

    forward_rng = random.Random(args.seed + 1)

    def forward():
        return choose_forward_chain(spans, 0, args.blocks, rng=forward_rng)

    inference_ms = time_ms(inference, args.runs)
    prefix_ms = time_ms(prefix, args.runs)
    prefix_chain = prefix()
    forward_ms = time_ms(forward, args.runs * 5)
    result = {
        "servers": args.servers,
        "blocks": args.blocks,
        "runs": args.runs,
        "inference_chain_ms": round(inference_ms, 3),
        "inference_chain_hops": len(inference()),
        "prefix_chain_ms": round(prefix_ms, 3),
        "prefix_chain_hops": len(prefix_chain),
        "prefix_chain_is_holders": [hop.peer_id for hop in prefix_chain] == [hop.peer_id for hop in runner_up],
        "prefix_chain_held_tokens": HeldPrefix(prompt, None, length).chain_held(
            prefix_chain, {span.peer_id: span for span in held_spans}),
        "forward_chain_ms": round(forward_ms, 3),
        "forward_chain_hops": len(forward()),
    }
    print(json.dumps(result))


if __name__ == "__main__":
    main()
