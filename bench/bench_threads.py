"""Where the gateway's CPU goes, thread by thread (issue 46): per request and per further token.

The same swarm as `bench/bench_overhead.py` (a tiny random Llama, hidden 64, 4 blocks, the bundled tokenizer, on 2
real servers 0:2 and 2:4 and a real gateway with engine rounds, one intra-op thread each). After a warm-up (one
stream, then `--streams` 2-token streams), `--pairs` times: a wave of `--streams` 1-token streams (all per-request
work: HTTP, chat template, session open and close, the prompt's step, the first pick, SSE start and end), then one
of `--streams` x `--new_tokens` tokens. Each thread's CPU time comes from `/proc/<pid>/task/<tid>/schedstat` (ns)
before and after each wave, its name from `py-spy dump` (taken once after the warm-up; numbered pool threads are
summed under one name). Per request = the 1-token wave's CPU / streams; per further token = (the long wave's less the
1-token wave's) / (streams x (new_tokens - 1)). Linux only (procfs), py-spy in the environment.

Prints one JSON object: per pair each wave's per-thread milliseconds, and per thread the per-request and per-token
figures of every pair.

Usage (from the repository root): .venv/bin/python bench/bench_threads.py [--pairs 2] [--streams 64]
    [--new_tokens 32]
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Dict, List

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from bench.bench_overhead import TINY, wave  # noqa: E402
from bench.harness import cpu_seconds  # noqa: E402
from launch.topology import Topology  # noqa: E402
from swarm.modeling.prepare import prepare_model  # noqa: E402
from tests.fixtures.tiny_checkpoints import save_tiny  # noqa: E402


def thread_ns(pid: int) -> Dict[int, int]:
    """tid -> CPU nanoseconds so far (schedstat's first field), for every thread of `pid` alive now."""
    out = {}
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{tid}/schedstat") as f:
                out[int(tid)] = int(f.read().split()[0])
        except OSError:  # the thread ended meanwhile
            pass
    return out


def thread_names(pid: int) -> Dict[int, str]:
    """tid -> the Python thread's name (py-spy dump); pool threads' numbers dropped (`generation_3` -> `generation`)."""
    dump = subprocess.run([os.path.join(os.path.dirname(sys.executable), "py-spy"), "dump", "-p", str(pid)],
                          capture_output=True, text=True, timeout=60).stdout
    names = {}
    for m in re.finditer(r'^Thread (0x[0-9A-Fa-f]+|\d+) \(\w+\): "([^"]*)"', dump, re.M):
        tid = int(m.group(1), 16) if m.group(1).startswith("0x") else int(m.group(1))
        names[tid] = re.sub(r"_\d+$", "", m.group(2))
    return names


def measure(url: str, served: str, pid: int, names: Dict[int, str], streams: int, tokens: int) -> Dict[str, object]:
    """One wave: its per-thread CPU ms (threads unknown to py-spy: `other`) and the Python process's."""
    before, process_before = thread_ns(pid), cpu_seconds(pid)
    got = asyncio.run(wave(url, served, streams, tokens))
    after, process_after = thread_ns(pid), cpu_seconds(pid)
    per: Dict[str, float] = {}
    for tid, ns in after.items():
        name = names.get(tid, "other")
        per[name] = per.get(name, 0.0) + (ns - before.get(tid, 0)) / 1e6
    return {"tokens": got["tokens"], "errors": got["errors"],
            "process_ms": round(1000 * (process_after - process_before), 1),
            "threads_ms": {k: round(v, 1) for k, v in sorted(per.items(), key=lambda kv: -kv[1]) if v >= 0.5}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pairs", type=int, default=2, help="pairs of waves (1 token, then new_tokens)")
    parser.add_argument("--streams", type=int, default=64, help="concurrent streams in every wave")
    parser.add_argument("--new_tokens", type=int, default=32, help="tokens every stream of the long waves generates")
    args = parser.parse_args()
    if args.new_tokens < 2:
        parser.error("--new_tokens must be at least 2 (the long wave less the 1-token wave)")
    torch.set_num_threads(1)
    pairs: List[Dict[str, object]] = []
    with tempfile.TemporaryDirectory(prefix="bench-threads-") as tmp:
        path = Path(tmp) / TINY
        save_tiny("llama", path, str(prepare_model("smollm2-135m-instruct")))
        with Topology(str(path), ["0:2", "2:4"], f"threads-{os.getpid()}",
                      ["--max_sessions_per_peer", str(max(128, 2 * args.streams))], name="bench-threads",
                      threads=1) as swarm:
            gateway = swarm.add_gateway(extra=["--max_concurrent", str(max(32, args.streams)),
                                               "--max_queue", str(max(64, args.streams))])
            assert gateway.ready is not None
            url, pid = gateway.ready["url"], gateway.proc.pid
            for count in (1, args.streams):  # warm-up: routes, streams, the head, the worker threads
                asyncio.run(wave(url, path.name, count, 2))
            names = thread_names(pid)
            for _ in range(args.pairs):
                short = measure(url, path.name, pid, names, args.streams, 1)
                long = measure(url, path.name, pid, names, args.streams, args.new_tokens)
                pairs.append({"one_token": short, "long": long})
                print(json.dumps(pairs[-1]), file=sys.stderr, flush=True)
    further = args.streams * (args.new_tokens - 1)
    per_thread: Dict[str, Dict[str, List[float]]] = {}
    for pair in pairs:
        short_ms, long_ms = pair["one_token"]["threads_ms"], pair["long"]["threads_ms"]  # type: ignore[index]
        for name in set(short_ms) | set(long_ms):
            row = per_thread.setdefault(name, {"ms_per_request": [], "ms_per_token": []})
            row["ms_per_request"].append(round(short_ms.get(name, 0.0) / args.streams, 3))
            row["ms_per_token"].append(round((long_ms.get(name, 0.0) - short_ms.get(name, 0.0)) / further, 4))
    print(json.dumps({"bench": "threads", "streams": args.streams, "new_tokens": args.new_tokens, "pairs": pairs,
                      "per_thread": dict(sorted(per_thread.items(), key=lambda kv: -sum(kv[1]["ms_per_token"])))}))


if __name__ == "__main__":
    main()
