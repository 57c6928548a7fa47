"""Relay benchmark: tokens/s of one greedy session through a direct chain and through a chain whose second server
sits behind a NAT and is dialed through a relay (network namespaces, as tests/e2e/test_nat.py; needs root).

A public host runs the bootstrap peer (the relay) and a server of blocks 0:15; blocks 15:30 are served first by a
directly reachable server on a second public host, then (that one stopped) by a server on a `home` host that
nobody can connect to (`NetLab.refuse_inbound`), which serves through the relay. The client runs in the root
namespace (it reaches every host over the bridge; no added latency). Prints one JSON object: decode tokens/s of
each chain (after a warm-up run), the reachability each 15:30 server announced, and whether the texts agreed.

Usage (from the repository root): .venv/bin/python bench/bench_relay.py [--tokens N]
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from swarm.launch.netns import NetLab  # noqa: E402
from swarm.launch.topology import start_bootstrap, start_server, wait_all  # noqa: E402

PREFIX = "bench-relay"


def tokens_per_second(model, ids, tokens: int):
    model.generate(ids, max_new_tokens=4, do_sample=False)  # warm-up: routes, sessions, packed weights
    began = time.perf_counter()
    out = model.generate(ids, max_new_tokens=tokens, min_new_tokens=tokens, do_sample=False)
    return tokens / (time.perf_counter() - began), out[0].tolist()


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--tokens", type=int, default=48)
    args = parser.parse_args()
    reason = NetLab.unavailable()
    if reason:
        print(json.dumps({"skipped": reason}))
        return 0
    from transformers import AutoTokenizer

    from swarm import AutoDistributedModelForCausalLM
    from swarm.modeling.prepare import prepare_model

    model_path = str(prepare_model())
    ids = AutoTokenizer.from_pretrained(model_path)("A short story about a lighthouse:", return_tensors="pt")[
        "input_ids"]
    result: dict = {"tokens": args.tokens}
    with NetLab(public=True) as lab:
        hosts = {name: lab.add_host(name) for name in ("public", "direct", "home")}
        lab.refuse_inbound(hosts["home"])
        procs = []
        try:
            boot = start_bootstrap(hosts["public"].address, 0, name="bench-relay-dht", threads=1,
                                   wrap=hosts["public"].wrap)
            procs.append(boot)
            first = start_server(model_path, [boot.maddr], "0:15", PREFIX, name="bench-relay-first",
                                 host=hosts["public"].address, threads=1, wrap=hosts["public"].wrap)
            second = start_server(model_path, [boot.maddr], "15:30", PREFIX, name="bench-relay-direct",
                                  host=hosts["direct"].address, threads=1, wrap=hosts["direct"].wrap)
            procs += [first, second]
            wait_all([first, second])
            texts = {}
            for chain in ("direct", "relayed"):
                if chain == "relayed":
                    second.terminate()
                    second = start_server(model_path, [boot.maddr], "15:30", PREFIX, name="bench-relay-home",
                                          host=hosts["home"].address, threads=1, wrap=hosts["home"].wrap)
                    procs.append(second)
                    wait_all([second])
                print(f"measuring the {chain} chain", file=sys.stderr, flush=True)
                model = AutoDistributedModelForCausalLM.from_pretrained(
                    model_path, initial_peers=[boot.maddr], dht_prefix=PREFIX, update_period=5)
                try:
                    rate, texts[chain] = tokens_per_second(model, ids, args.tokens)
                finally:
                    model.shutdown()
                result[f"{chain}_tokens_per_s"] = round(rate, 2)
                result[f"{chain}_server_reachable"] = second.ready["reachable"]
            result["same_tokens"] = texts["direct"] == texts["relayed"]
        finally:
            for proc in reversed(procs):
                if os.environ.get("BENCH_RELAY_LOGS"):
                    print(f"--- {proc.name}\n{proc.log_tail(15)}", file=sys.stderr)
                proc.kill()
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
