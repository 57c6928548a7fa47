"""Decode speed over wide-area links (the latency lab, `launch.latency_lab`): tokens/s and time to first
token for 1 and 8 concurrent sessions, 2 and 3 servers, one-way latencies of 5, 25 and 50 ms (every link), with
and without server-to-server push; and the routing choice when two chains of different latency serve the same
blocks. Needs root (network namespaces). Prints one JSON object.

Two modes (`--modes`): `generate`, each session's own `generate` on its own thread (its steps on its own streams,
pushed with `Step.push_chain`); `rounds`, every session stepped together in one round per token (`step_round`, as
the gateway's engine does: one message per server per round, the rows pushed server to server in one `RoundPush`
with `round_push`). In rounds mode a row's first round opens its sessions, its second attaches them on every
server's round stream, and the rest are pushed.

Each topology's swarm starts once; the relays' latencies change between cells (`LatencyLab.set_links`). Each
cell is measured right after the same cell at 0 ms (the same relays, no delay: loopback), whose ms per token is the
cell's `compute` (paired, because the load of a shared machine drifts over minutes); `hops_per_token` is
(ms per token - compute) / latency, the one-way trips a token really costs (`est_hops`: the model's), and
`hops_per_token_fastest` the same from the fastest token of each (the least disturbed by load). Each figure
comes with its estimate: per token,
`(k + 1) * latency + compute` with push (client -> s1 -> ... -> sk -> client), `2k * latency + compute` without
(the client relays every hop); tokens/s = 1 / that (times the sessions for the aggregate). Decode rates are
measured after the first new token; TTFT is from the call to the first new token (prefill of a 13-token prompt
plus the chain's open round trips). `ms_per_token` is the median gap between two tokens of a session (robust to the
stalls of a shared machine; `max_gap_ms` shows them), `tokens_per_s` the aggregate over the wall time.

Routing: server `s0` serves 15:30; `s1` (fast, 5 ms to everyone) and `s2` (slow: 50 ms to the client and to
`s0`) both serve 0:15. The client must take `s1`; reported: the chain it took (1 session and 8), the client's
measured RTTs and the servers' `next_pings` from their DHT records (they must show the slow links).

    python bench/bench_wan.py                      # the full grid (about 15 min on 2 loaded cores)
    python bench/bench_wan.py --quick              # 2 servers, 25 ms, fewer tokens
    python bench/bench_wan.py --latencies 5,25 --servers 3 --sessions 1 --no-routing

Extension point: `variants(args)` lists the client settings a row compares (now push on / off: each a label, the
client model's `from_pretrained` kwargs and extra `generate` kwargs), and `generate_kwargs(args, variant)` is the one
place the timed generate call's arguments come from; a `--speculative` dimension adds variants there.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Dict, List, NamedTuple, Optional

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from bench.harness import Clock  # noqa: E402
from launch.latency_lab import CLIENT, LatencyLab  # noqa: E402
from swarm.modeling.prepare import prepare_model  # noqa: E402

TOPOLOGIES = {2: ["0:15", "15:30"], 3: ["0:10", "10:20", "20:30"]}
PROMPT = torch.tensor([[1, 504, 3458, 314, 4086, 28, 260, 1345, 2024, 30, 1530, 260, 1029]])
SERVER_ARGS = ["--throughput", "1"]  # no throughput measurement at start: equal servers, routing by latency


class Variant(NamedTuple):
    label: str  # the row key's part, e.g. "push"
    client: dict  # `from_pretrained` kwargs of its client model
    generate: dict  # extra `generate` kwargs
    rounds: bool = False  # every session in one round per token (`step_round`) instead of its own `generate`


def variants(args) -> List[Variant]:
    """The client settings each row compares."""
    return [Variant(("push" if push else "no_push") + ("_rounds" if mode == "rounds" else ""), {"use_push": push},
                    {}, mode == "rounds") for mode in args.modes for push in args.push]


def generate_kwargs(args, variant: Optional[Variant] = None) -> dict:
    """The arguments of every timed `generate` call (greedy, a fixed number of new tokens)."""
    return {"max_new_tokens": args.tokens, "min_new_tokens": args.tokens, "do_sample": False,
            **(variant.generate if variant else {})}


def one_session(model, args, prompt: torch.Tensor, variant: Optional[Variant], barrier=None) -> dict:
    """Time to first new token and decode timings of one greedy generation."""
    clock = Clock()
    if barrier is not None:
        barrier.wait()
    start = time.perf_counter()
    model.generate(prompt, streamer=clock, **generate_kwargs(args, variant))
    new = clock.times[1:]  # arrival of each new token
    return {"start": start, "first": new[0], "last": new[-1], "decoded": len(new) - 1,
            "gaps": [b - a for a, b in zip(new, new[1:])]}


def _prompts(sessions: int) -> List[torch.Tensor]:
    prompts = [PROMPT.clone() for _ in range(sessions)]
    for i, p in enumerate(prompts):
        p[0, 1] = 504 + i  # different sessions, different contents
    return prompts


def run_round_cell(model, args, sessions: int) -> dict:
    """`run_cell` for `sessions` stepped together, one `step_round` per token (greedy picks on the client)."""
    from swarm.client.transport import rounds

    opened = [model.inference_session(max_length=PROMPT.shape[1] + args.tokens + 1) for _ in range(sessions)]
    try:
        head = opened[0].head
        inputs = [head.embed(p) for p in _prompts(sessions)]
        start = time.perf_counter()
        times = []
        for _ in range(args.tokens):
            outs = rounds.step_round([(s.session, x, None) for s, x in zip(opened, inputs)])
            bad = [out for out in outs if isinstance(out, BaseException)]
            if bad:
                raise RuntimeError(f"a round failed: {bad[0]!r}")
            tokens = head.head(torch.cat([out[:, -1] for out in outs])).argmax(-1)  # [sessions]
            times.append(time.perf_counter())
            inputs = [head.embed(t.view(1, 1)) for t in tokens]
    finally:
        for s in opened:
            s.close()
    gaps = [b - a for a, b in zip(times, times[1:])]
    return {"tokens_per_s": round(sessions * len(gaps) / (times[-1] - times[0]), 2),
            "ms_per_token": round(1000 * statistics.median(gaps), 1), "min_gap_ms": round(1000 * min(gaps), 1),
            "max_gap_ms": round(1000 * max(gaps), 1), "ttft_ms": round(1000 * (times[0] - start), 1)}


def run_cell(model, args, sessions: int, variant: Optional[Variant] = None) -> dict:
    """Aggregate decode tokens/s (after each session's first new token, over the wall time), the median and the
    longest gap between two tokens of a session, and the median TTFT of `sessions` concurrent generations."""
    if variant is not None and variant.rounds:
        return run_round_cell(model, args, sessions)
    prompts = _prompts(sessions)
    if sessions == 1:
        runs = [one_session(model, args, prompts[0], variant)]
    else:
        barrier = threading.Barrier(sessions)
        with ThreadPoolExecutor(sessions) as pool:
            runs = list(pool.map(lambda p: one_session(model, args, p, variant, barrier), prompts))
    decoded = sum(r["decoded"] for r in runs)
    wall = max(r["last"] for r in runs) - min(r["first"] for r in runs)
    gaps = [g for r in runs for g in r["gaps"]]
    return {"tokens_per_s": round(decoded / wall, 2), "ms_per_token": round(1000 * statistics.median(gaps), 1),
            "min_gap_ms": round(1000 * min(gaps), 1), "max_gap_ms": round(1000 * max(gaps), 1),
            "ttft_ms": round(1000 * statistics.median(r["first"] - r["start"] for r in runs), 1)}


def estimate(latency_ms: float, servers: int, push: bool, compute_ms: float, sessions: int) -> dict:
    hops = servers + 1 if push else 2 * servers
    per_token = hops * latency_ms + compute_ms
    return {"est_ms_per_token": round(per_token, 1), "est_tokens_per_s": round(sessions * 1000 / per_token, 2)}


def trips(cell: dict, base: dict, key: str, latency_ms: float) -> Optional[float]:
    """One-way trips per token: the time `key` gained over the 0 ms `base`, in latencies."""
    return round((cell[key] - base[key]) / latency_ms, 2) if latency_ms else None


def bench_topology(path: str, servers: int, args) -> Dict[str, dict]:
    from swarm import AutoDistributedModelForCausalLM

    rows: Dict[str, dict] = {}
    with LatencyLab(path, TOPOLOGIES[servers], latency_ms=0, server_args=SERVER_ARGS,
                    prefix=f"wan{servers}") as lab:
        models = [(v, AutoDistributedModelForCausalLM.from_pretrained(path, initial_peers=lab.initial_peers,
                                                                      dht_prefix=lab.prefix, **v.client))
                  for v in variants(args)]
        try:
            for variant, model in models:
                model.generate(PROMPT, max_new_tokens=3)  # warm-up: connections, routes
                if variant.rounds:  # and batches of every size: servers pack their weights for them at first
                    run_round_cell(model, args, max(args.sessions))
            for latency in args.latencies:
                for variant, model in models:
                    for sessions in args.sessions:
                        # paired: the same cell without delay just before, so that both see the same load
                        lab.set_links(0)
                        base = run_cell(model, args, sessions, variant)
                        compute = base["ms_per_token"]
                        lab.set_links(latency)
                        cell = run_cell(model, args, sessions, variant)
                        push = variant.client.get("use_push", True)
                        cell.update(compute_ms_per_token=compute,
                                    hops_per_token=trips(cell, base, "ms_per_token", latency),
                                    hops_per_token_fastest=trips(cell, base, "min_gap_ms", latency),
                                    est_hops=servers + 1 if push else 2 * servers,
                                    **estimate(latency, servers, push, compute, sessions))
                        key = f"{servers}_servers/{latency:g}ms/{variant.label}/{sessions}_sessions"
                        rows[key] = cell
                        print(key, json.dumps(cell), file=sys.stderr, flush=True)
        finally:
            for _, model in models:
                model.shutdown()
    return rows


def bench_routing(path: str, args) -> dict:
    """Two servers for 0:15 (s1 fast, s2 slow) before one for 15:30 (s0): which does the client take?"""
    from swarm import AutoDistributedModelForCausalLM

    fast, slow = 5.0, 50.0
    links = {(CLIENT, "s2"): slow, ("s2", "s0"): slow}
    with LatencyLab(path, latency_ms=fast, links=links, prefix="wanroute",
                    server_args=[*SERVER_ARGS, "--update_period", "5"]) as lab:
        lab.add_server("15:30")  # s0 first, so that s1 and s2 can ping it
        lab.add_servers(["0:15", "0:15"])
        time.sleep(12)  # two record refreshes of s1 and s2: their next_pings include s0
        model = AutoDistributedModelForCausalLM.from_pretrained(path, initial_peers=lab.initial_peers,
                                                                dht_prefix=lab.prefix)
        try:
            spans = model.manager.update(force=True)
            with model.inference_session(max_length=PROMPT.shape[1] + args.tokens) as session:
                model.generate(PROMPT, session=session, max_new_tokens=2)
                took = [lab.name_of(hop.peer_id) for hop in session.session.chain]
            cell = run_cell(model, args, 1)
            chains: Dict[str, int] = {}
            barrier = threading.Barrier(8)

            def open_chain(_):
                with model.inference_session(max_length=PROMPT.shape[1] + 4) as s:
                    barrier.wait()
                    model.generate(PROMPT, session=s, max_new_tokens=2)
                    return "+".join(str(lab.name_of(h.peer_id)) for h in s.session.chain)

            with ThreadPoolExecutor(8) as pool:
                for chain in pool.map(open_chain, range(8)):
                    chains[chain] = chains.get(chain, 0) + 1
            rtts = {lab.name_of(p): round(1000 * r, 1) for p, r in model.manager.rtts.items()}
            pings = {f"{lab.name_of(s.peer_id)}->{lab.name_of(p)}": round(1000 * r, 1)
                     for s in spans for p, r in s.info.next_pings.items()}
            lab.set_links(0, {})  # the same chain without delay: the estimate's compute
            compute = run_cell(model, args, 1)["ms_per_token"]
        finally:
            model.shutdown()
    return {"fast": "s1", "slow": "s2", "took": "+".join(map(str, took)), "took_fast": took[0] == "s1",
            "chains_of_8_sessions": chains, "client_rtt_ms": rtts, "next_pings_ms": pings,
            **cell, "compute_ms_per_token": compute, **estimate(fast, 2, True, compute, 1)}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--latencies", default="5,25,50", help="one-way latencies (ms), comma-separated")
    parser.add_argument("--servers", default="2,3", help="numbers of servers (2: 0:15/15:30; 3: thirds)")
    parser.add_argument("--sessions", default="1,8", help="concurrent sessions per row, comma-separated")
    parser.add_argument("--push", default="on,off", help="push settings to measure: on, off or on,off")
    parser.add_argument("--modes", default="generate,rounds",
                        help="generate (each session alone), rounds (all in one round per token) or both")
    parser.add_argument("--tokens", type=int, default=16, help="new tokens per generation")
    parser.add_argument("--no-routing", dest="routing", action="store_false", help="skip the routing case")
    parser.add_argument("--quick", action="store_true", help="2 servers, 25 ms, 8 tokens (overrides the above)")
    args = parser.parse_args(argv)
    if args.quick:
        args.latencies, args.servers, args.tokens = "25", "2", 8
    args.latencies = [float(x) for x in args.latencies.split(",") if x]
    args.servers = [int(x) for x in args.servers.split(",") if x]
    args.sessions = [int(x) for x in args.sessions.split(",") if x]
    args.push = [{"on": True, "off": False}[x] for x in args.push.split(",") if x]
    args.modes = [x for x in args.modes.split(",") if x]
    if not args.modes or any(mode not in ("generate", "rounds") for mode in args.modes):
        parser.error("--modes: generate, rounds or generate,rounds")
    if any(s not in TOPOLOGIES for s in args.servers):
        parser.error(f"--servers: choose among {sorted(TOPOLOGIES)}")
    why = LatencyLab.unavailable()
    if why:
        print(json.dumps({"skipped": why}))
        return 0
    path = str(prepare_model())
    started = time.monotonic()
    result: dict = {"tokens_per_generation": args.tokens, "rows": {}}
    for servers in args.servers:
        result["rows"].update(bench_topology(path, servers, args))
    if args.routing:
        result["routing"] = bench_routing(path, args)
    result["wall_s"] = round(time.monotonic() - started, 1)
    result["markdown"] = markdown(result)
    print(json.dumps(result))
    return 0


def markdown(result: dict) -> List[str]:
    """docs/benchmarks.md's section: every row next to its estimate, and the routing case."""
    lines = ["", f"The latency lab (`launch/latency_lab.py`): every link the same one-way latency, "
                 f"{result['tokens_per_generation']} new tokens per generation, greedy. Estimate: one-way trips per "
                 "token x latency + the same chain's compute at 0 ms (measured just before); with push a token "
                 "makes k + 1 one-way trips over k servers, without push 2k.", "",
             "| servers | one-way ms | push | sessions | tok/s | ms/token | estimate ms/token (trips) | "
             "measured / estimate | TTFT ms | compute ms/token at 0 ms | measured trips/token |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for key, row in result["rows"].items():
        servers, latency, push, sessions = key.split("/")
        lines.append(f"| {servers.split('_')[0]} | {latency.removesuffix('ms')} | {push.replace('_', ' ')} | "
                     f"{sessions.split('_')[0]} | {row['tokens_per_s']} | {row['ms_per_token']} | "
                     f"{row['est_ms_per_token']} ({row['est_hops']}) | "
                     f"{round(row['ms_per_token'] / row['est_ms_per_token'], 2)} | {row['ttft_ms']} | "
                     f"{row['compute_ms_per_token']} | {row['hops_per_token']} |")
    routing = result.get("routing")
    if routing:
        lines += ["", f"Two chains for 0:15 (s1 behind {routing['client_rtt_ms'].get('s1')} ms client RTT, s2 behind "
                      f"{routing['client_rtt_ms'].get('s2')} ms): the client took {routing['took']} "
                      f"(fast: {routing['took_fast']}); 8 concurrent sessions: {routing['chains_of_8_sessions']}; "
                      f"{routing['tokens_per_s']} tok/s vs estimate {routing['est_tokens_per_s']}."]
    return lines + [""]


if __name__ == "__main__":
    sys.exit(main())
