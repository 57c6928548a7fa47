"""Prefill over a capped link: the time of a 1,000-token prompt through a two-server swarm whose every link is
capped at 50 Mbit/s per direction, with activation compression none / float16 / blockwise8 (`swarm.wire.compression`).

The cap is the latency lab's (`launch.latency_lab`, needs root): each peer sits in its own network namespace
behind a TCP relay (`launch.relay`) that releases each chunk after the bytes before it have left at the link's
rate (`LinkTable.bandwidth`, bytes/s, each direction of each connection), so client -> s0, s0 -> client,
client -> s1, s1 -> client (a prefill is not pushed between servers) all run at the cap. Only the relays shape the
traffic: the p2p daemons' own framing and the processes' CPU are real. Each compression is measured in turn with
the cap and without it (the same relays, no cap: the compute and framing time), `--repeats` times, alternating, so
that a shared machine's drifting load hits all alike; a row reports the median and the fastest of each and their
differences, the time the capped link added (the fastest runs are the least disturbed by other processes). A
prefill is `generate(prompt, max_new_tokens=1)` (the prompt's forward pass through both servers, plus one token's
sampling) on a fresh client per compression (its sessions ask the servers for it).

Usage (from the repository root, as root): .venv/bin/python bench/bench_link_cap.py [--mbit 50] [--repeats 3]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from launch.latency_lab import LatencyLab  # noqa: E402
from swarm.wire.compression import COMPRESSIONS  # noqa: E402

PROMPT_TOKENS = 1000


def set_cap(lab: LatencyLab, bytes_per_s):
    lab.bandwidth = bytes_per_s
    lab.set_links()  # the relays read their tables again (the cap is part of them)


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--mbit", type=float, default=50.0, help="link cap, Mbit/s per direction")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--tokens", type=int, default=PROMPT_TOKENS)
    args = parser.parse_args()
    why = LatencyLab.unavailable()
    if why:
        print(json.dumps({"skipped": why}))
        return 0
    from swarm import AutoDistributedModelForCausalLM
    from swarm.modeling.prepare import prepare_model

    path = str(prepare_model())
    generator = torch.Generator().manual_seed(0)
    prompt = torch.randint(100, 40000, (1, args.tokens), generator=generator)
    cap = args.mbit * 1e6 / 8
    times: dict = {(kind, capped): [] for kind in COMPRESSIONS for capped in (False, True)}
    tokens: dict = {}
    with LatencyLab(path, ["0:15", "15:30"], latency_ms=0, server_args=["--throughput", "1"],
                    prefix="linkcap") as lab:
        # no liveness pings: on a loaded machine a 1,000-token prefill may outlast them, and a failover would
        # measure a replay
        models = {kind: AutoDistributedModelForCausalLM.from_pretrained(
            path, initial_peers=lab.initial_peers, dht_prefix=lab.prefix, compression=kind, liveness_interval=None)
            for kind in COMPRESSIONS}
        try:
            for kind, model in models.items():  # warm-up: routes, sessions, packed weights
                model.generate(prompt[:, :16], max_new_tokens=1, do_sample=False)
            for repeat in range(args.repeats):
                for kind, model in models.items():
                    for capped in (False, True):
                        set_cap(lab, cap if capped else None)
                        began = time.perf_counter()
                        out = model.generate(prompt, max_new_tokens=1, min_new_tokens=1, do_sample=False)
                        times[kind, capped].append(time.perf_counter() - began)
                        tokens.setdefault(kind, out[0, -1].item())
                        print(f"repeat {repeat} {kind} capped={capped}: {times[kind, capped][-1]:.2f}s",
                              file=sys.stderr, flush=True)
        finally:
            for model in models.values():
                model.shutdown()
    rows = []
    for kind in COMPRESSIONS:
        free, capped = statistics.median(times[kind, False]), statistics.median(times[kind, True])
        fastest_free, fastest_capped = min(times[kind, False]), min(times[kind, True])
        rows.append({"compression": kind, "uncapped_s": round(free, 2), "capped_s": round(capped, 2),
                     "link_added_s": round(capped - free, 2), "fastest_uncapped_s": round(fastest_free, 2),
                     "fastest_capped_s": round(fastest_capped, 2),
                     "fastest_link_added_s": round(fastest_capped - fastest_free, 2),
                     "all_uncapped_s": [round(t, 2) for t in times[kind, False]],
                     "all_capped_s": [round(t, 2) for t in times[kind, True]], "next_token": tokens[kind]})
    print(json.dumps({"prompt_tokens": args.tokens, "mbit_per_s": args.mbit, "repeats": args.repeats,
                      "load_average": os.getloadavg()[0], "rows": rows}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
