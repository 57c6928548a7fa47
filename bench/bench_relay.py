"""Relay benchmark: tokens/s of one greedy session through a direct chain and through a chain whose second server
sits behind a NAT and is dialed through a relay (network namespaces, as tests/e2e/test_nat.py; needs root).

A public host runs the bootstrap peer (the relay) and a server of blocks 0:15; blocks 15:30 are served first by a
directly reachable server on a second public host, then (that one stopped) by a server on a `home` host that
nobody can connect to (`NetLab.refuse_inbound`), which serves through the relay. The client runs in the root
namespace (it reaches every host over the bridge; no added latency). Prints one JSON object: decode tokens/s of
each chain (after a warm-up run), the reachability each 15:30 server announced, and whether the texts agreed.

With `--lab`, the same two chains run in the latency lab (`launch.latency_lab`, public-looking addresses)
at each of `--latencies` (one-way ms on every link, default 5 and 25): the 15:30 server is first a lab server behind
its own delaying relay (direct), then a `home` server (`LatencyLab.add_server(home=True)`) that announces no
address and serves through the bootstrap peer's libp2p relay, so each of its messages crosses two delayed links
(its own to the bootstrap peer and the sender's). Each cell is measured right after the same chain at 0 ms, whose
rate is the cell's compute-bound reference (a shared machine's load drifts).

Usage (from the repository root): .venv/bin/python bench/bench_relay.py [--tokens N] [--lab [--latencies 5,25]]
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from launch.netns import NetLab  # noqa: E402
from launch.topology import start_bootstrap, start_server, wait_all  # noqa: E402

PREFIX = "bench-relay"


def tokens_per_second(model, ids, tokens: int):
    model.generate(ids, max_new_tokens=4, do_sample=False)  # warm-up: routes, sessions, packed weights
    began = time.perf_counter()
    out = model.generate(ids, max_new_tokens=tokens, min_new_tokens=tokens, do_sample=False)
    return tokens / (time.perf_counter() - began), out[0].tolist()


def lab_rates(model_path: str, ids, tokens: int, latencies) -> dict:
    """tok/s of the direct and the relayed chain in the latency lab, at 0 ms and at each latency."""
    from launch.latency_lab import LatencyLab
    from swarm import AutoDistributedModelForCausalLM

    result: dict = {"tokens": tokens, "latencies_ms": list(latencies)}
    texts = {}
    with LatencyLab(model_path, ["0:15"], latency_ms=0, public=True, prefix="bench-relay-lab",
                    server_args=["--throughput", "1"]) as lab:
        second = lab.add_server("15:30", name="direct")
        for chain in ("direct", "relayed"):
            if chain == "relayed":
                second.terminate()
                second = lab.add_server("15:30", name="home", home=True)
            result[f"{chain}_server_reachable"] = second.ready["reachable"]
            print(f"measuring the {chain} chain", file=sys.stderr, flush=True)
            model = AutoDistributedModelForCausalLM.from_pretrained(
                model_path, initial_peers=lab.initial_peers, dht_prefix=lab.prefix, update_period=5)
            try:
                for latency in latencies:
                    for ms, key in ((0, f"{chain}_0ms_before_{latency:g}ms"), (latency, f"{chain}_{latency:g}ms")):
                        lab.set_links(ms)
                        rate, texts[chain, ms] = tokens_per_second(model, ids, tokens)
                        result[f"{key}_tokens_per_s"] = round(rate, 2)
                        print(f"{chain} {ms} ms: {rate:.2f} tok/s", file=sys.stderr, flush=True)
            finally:
                model.shutdown()
    result["same_tokens"] = len({tuple(t) for t in texts.values()}) == 1
    return result


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--tokens", type=int, default=48)
    parser.add_argument("--lab", action="store_true", help="in the latency lab, at --latencies")
    parser.add_argument("--latencies", default="5,25", help="one-way ms, comma-separated (with --lab)")
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
    if args.lab:
        result = lab_rates(model_path, ids, args.tokens, [float(x) for x in args.latencies.split(",")])
        result["load_average"] = os.getloadavg()[0]
        print(json.dumps(result))
        return 0
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
