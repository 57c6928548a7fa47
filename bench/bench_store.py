"""State store benchmark (issue 48): the latency the store adds to a request, and conversation affinity through two
gateways.

1. Latency: the store calls a generation request of a key with limits makes, timed on a real SQLite file and a real
   `redis-server` on this machine (started here, no persistence): before its first token `authenticate` + `admit`
   (on the request's path), after it `finish` + `record_usage` (on a store thread, off the path), and a Responses turn's
   `get_response` + `put_response` (a 2 kB document). One store object shared by every thread, as in a gateway. At
   1 concurrent request (sequential) and 100 (100 threads started together after one untimed request each, each
   its requests in a row: the store saturated, so mostly queueing). p50 / p99 in milliseconds.
2. Affinity: a swarm (two block servers) and two gateways on one Redis; conversations of several turns, each under a
   key of its own, through the Responses API (`previous_response_id`), every turn to the gateway its key hashes to
   (affinity, as `hash $http_authorization` in nginx) or to the other gateway than the previous turn (none: what a
   round-robin balancer does to a conversation). The cached-token share is the sum of `cached_tokens` over the sum of
   input tokens of every turn after the first.

Usage (from the repository root): .venv/bin/python bench/bench_store.py [--requests 300] [--conversations 4]
[--turns 4] [--skip_affinity]. Prints one JSON object.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import threading
import time
import uuid
import zlib
from typing import Dict, List

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from gateway.store import KeyLimits, open_store  # noqa: E402
from tests.fixtures.redis_server import RedisServer, ensure_redis_server  # noqa: E402


def _percentiles(samples: List[float]) -> Dict[str, float]:
    ordered = sorted(samples)
    return {"p50_ms": round(statistics.median(ordered) * 1000, 3),
            "p99_ms": round(ordered[min(len(ordered) - 1, int(len(ordered) * 0.99))] * 1000, 3)}


def time_store(url: str, requests: int, concurrency: int) -> Dict[str, Dict[str, float]]:
    store = open_store(url)
    name = f"bench-{uuid.uuid4().hex[:8]}"
    key = store.create_key(name, KeyLimits(rpm=10**9, tpm=10**12, max_streams=10**6))
    limits = store.authenticate(key).limits
    document = {"response": {"id": "x", "output": ["word " * 300]}, "conversation": []}
    timings: Dict[str, List[float]] = {"on_path": [], "off_path": [], "responses": []}
    lock = threading.Lock()

    def one(i: int, timed: bool = True) -> None:
        lease = uuid.uuid4().hex
        t0 = time.perf_counter()
        store.authenticate(key)
        store.admit(name, limits, 100, lease, 600)
        t1 = time.perf_counter()
        store.finish(name, 20, lease)
        store.record_usage(name, "model", 100, 0, 20)
        t2 = time.perf_counter()
        rid = f"resp_{uuid.uuid4().hex}"
        store.put_response(key, rid, document, ttl=600, max_entries=100_000)
        store.get_response(key, rid)
        t3 = time.perf_counter()
        if not timed:
            return
        with lock:
            timings["on_path"].append(t1 - t0)
            timings["off_path"].append(t2 - t1)
            timings["responses"].append(t3 - t2)

    per_thread = max(1, requests // concurrency)
    start = threading.Barrier(concurrency)

    def thread() -> None:
        one(-1, timed=False)  # its connection made (Redis) and warm, untimed
        start.wait()  # then every thread's requests at once
        for i in range(per_thread):
            one(i)

    threads = [threading.Thread(target=thread) for _ in range(concurrency)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    store.close()
    return {part: _percentiles(samples) for part, samples in timings.items()}


def affinity(redis_url: str, conversations: int, turns: int) -> Dict[str, float]:
    import httpx

    from bench.harness import BenchSwarm

    store = open_store(redis_url)
    out: Dict[str, float] = {}
    with BenchSwarm("bench-store", ["0:15", "15:30"]) as swarm:
        gateways = [swarm.add_gateway(f"gateway-{i}", ["--database_url", redis_url, "--max_concurrent", "2"],
                                      wait=False) for i in range(2)]
        urls = [g.wait_ready(300)["url"] for g in gateways]
        reader = store.create_key(f"bench-reader-{uuid.uuid4().hex[:6]}", KeyLimits())
        listed = httpx.get(urls[0] + "/v1/models", timeout=60, headers={"Authorization": f"Bearer {reader}"})
        if listed.status_code != 200:
            raise RuntimeError(f"/v1/models: {listed.status_code} {listed.text}")
        model_id = listed.json()["data"][0]["id"]
        for mode in ("affinity", "none"):
            cached = prompt = 0
            for c in range(conversations):
                key = store.create_key(f"conv-{mode}-{c}-{uuid.uuid4().hex[:6]}", KeyLimits())
                home = zlib.crc32(key.encode()) % 2
                previous = None
                for t in range(turns):
                    gateway = home if mode == "affinity" else (c + t) % 2
                    body = {"model": model_id, "max_output_tokens": 16,
                            "temperature": 0, "input": f"Turn {t} of conversation {c} ({mode}): tell me about "
                                                       f"{['tides', 'bees', 'comets', 'owls'][t % 4]}."}
                    if previous is not None:
                        body["previous_response_id"] = previous
                    r = httpx.post(urls[gateway] + "/v1/responses", json=body, timeout=300,
                                   headers={"Authorization": f"Bearer {key}"})
                    if r.status_code != 200:
                        raise RuntimeError(f"turn {t} of conversation {c} ({mode}): {r.status_code} {r.text}")
                    usage = r.json()["usage"]
                    previous = r.json()["id"]
                    if t > 0:
                        cached += usage["input_tokens_details"]["cached_tokens"]
                        prompt += usage["input_tokens"]
            out[f"cached_share_{mode}"] = round(cached / max(1, prompt), 3)
            out[f"input_tokens_{mode}"] = prompt
    store.close()
    return out


def markdown(result: Dict[str, object]) -> List[str]:
    """The section of docs/benchmarks.md (`make bench` writes a `markdown` key's lines as they are)."""
    lines = ["", f"The store's calls per request, {result['requests']} requests per case, on this machine (2 shared "
                 "cores); p50 / p99 in ms. On the path: `authenticate` + `admit` before the first token; off the "
                 "path: `finish` + `record_usage` on a store thread; Responses: `get_response` + `put_response`.", "",
             "| backend | concurrent | on the path | off the path | Responses get + put |", "|---|---|---|---|---|"]
    for backend in ("sqlite", "redis"):
        for c in (1, 100):
            cells = [f"{result[f'{backend}_c{c}_{part}_p50_ms']} / {result[f'{backend}_c{c}_{part}_p99_ms']}"
                     for part in ("on_path", "off_path", "responses")]
            lines.append(f"| {backend} | {c} | " + " | ".join(cells) + " |")
    if "cached_share_affinity" in result:
        lines += ["", "Cached-token share of turns 2+ through two gateways on one Redis (Responses API, "
                      "`previous_response_id`):", "", "| routing | cached / input tokens | input tokens |",
                  "|---|---|---|",
                  f"| affinity (each key to one gateway) | {result['cached_share_affinity']} | "
                  f"{result['input_tokens_affinity']} |",
                  f"| none (each turn to the other gateway) | {result['cached_share_none']} | "
                  f"{result['input_tokens_none']} |"]
    return lines + [""]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=300, help="requests per backend and concurrency")
    parser.add_argument("--conversations", type=int, default=4)
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument("--skip_affinity", action="store_true", help="only the store's latency (no swarm)")
    args = parser.parse_args()
    server = RedisServer(ensure_redis_server())
    server.start()
    result: Dict[str, object] = {"bench": "store", "requests": args.requests}
    try:
        with tempfile.TemporaryDirectory() as tmp:
            backends = {"sqlite": f"sqlite:///{tmp}/bench.sqlite3", "redis": server.url()}
            for backend, url in backends.items():
                for concurrency in (1, 100):
                    for part, numbers in time_store(url, args.requests, concurrency).items():
                        for stat, value in numbers.items():
                            result[f"{backend}_c{concurrency}_{part}_{stat}"] = value
        if not args.skip_affinity:
            result.update(affinity(server.url(), args.conversations, args.turns))
    finally:
        server.stop()
    result["markdown"] = markdown(result)
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
