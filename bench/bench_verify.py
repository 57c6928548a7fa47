"""The cost of spot-checking servers' outputs (`swarm.client.verify`): decode tokens/s with checks at 0%, 5% and
100% of steps.

Starts its own bootstrap peer and two honest servers over all blocks (each can referee the other), generates
`--new` greedy tokens after a short prompt with `verify=False` and with `verify=True` at each check probability
(every new server is also checked once), and prints one JSON object: tokens/s per setting (best of `--runs`),
the slowdown relative to no checks, and the verifier's counters. The probability that a server corrupting every
step escapes p-rate checks for n steps is (1 - p)^n: at 5%, under 1% after 90 steps.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.harness import BenchSwarm  # noqa: E402

PROMPT = "Write a short story about a lighthouse keeper who finds a message in a bottle:"


def run(swarm: BenchSwarm, probability, new: int, runs: int) -> dict:
    from transformers import AutoTokenizer

    from swarm import AutoDistributedModelForCausalLM
    from swarm.client.verify import verifier_for

    kwargs = {} if probability is None else dict(verify=True, verify_probability=probability)
    model = AutoDistributedModelForCausalLM.from_pretrained(swarm.path, initial_peers=swarm.initial_peers,
                                                            dht_prefix=swarm.prefix, **kwargs)
    ids = AutoTokenizer.from_pretrained(swarm.path)(PROMPT, return_tensors="pt")["input_ids"]
    try:
        best = 0.0
        for _ in range(runs):
            began = time.perf_counter()
            model.generate(ids, max_new_tokens=new, min_new_tokens=new, do_sample=False)
            best = max(best, new / (time.perf_counter() - began))
        verifier = verifier_for(model.manager)
        return {"tokens_per_s": round(best, 3), "verifier": verifier.stats.as_dict() if verifier else None}
    finally:
        model.shutdown()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--new", type=int, default=64, help="new tokens per generation")
    parser.add_argument("--runs", type=int, default=2, help="generations per setting (best kept)")
    args = parser.parse_args()
    results = {}
    with BenchSwarm("bench-verify", ["0:30", "0:30"]) as swarm:
        for name, probability in [("off", None), ("p0", 0.0), ("p5", 0.05), ("p100", 1.0)]:
            results[name] = run(swarm, probability, args.new, args.runs)
    base = results["off"]["tokens_per_s"]
    for entry in results.values():
        entry["slowdown"] = round(1 - entry["tokens_per_s"] / base, 4) if base else None
    print(json.dumps({"benchmark": "verify", "new_tokens": args.new, "runs": args.runs, "cpus": os.cpu_count(),
                      "note": "two servers over all 30 blocks on one shared machine; p0 = only the first check of "
                              "each new server", "results": results}))


if __name__ == "__main__":
    main()
