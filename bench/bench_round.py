"""Rounds vs per-session steps (issue 46): N sessions on a tiny random Llama (hidden 64, 4 blocks) over 2 servers
(blocks 0:2 and 2:4), stepped one token at a time either with `step_round` (one message per server per round) or
with every session's own `astep` at once (the sessions' own streams, with server-to-server push). Compute is nearly
nothing, so what is measured is the per-step overhead: the median and p90 latency of a round, the client's and the
servers' CPU milliseconds per token (each server process with its DHT child and p2pd), and the messages the
servers counted (`rpc_round_stats`). Prints one JSON object.

    .venv/bin/python bench/bench_round.py --sessions 16 64 --rounds 30
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import time
import uuid
from typing import Dict, List

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import psutil  # noqa: E402
import torch  # noqa: E402

from bench.harness import cpu_seconds, tiny_checkpoint  # noqa: E402
from launch.topology import ManagedProcess, start_bootstrap, start_servers, terminate_all  # noqa: E402
from swarm.client.transport import rounds  # noqa: E402
from swarm.runtime import aio  # noqa: E402

SPANS = ("0:2", "2:4")


def run_mode(mode: str, sessions, head, rounds_n: int, servers: List[ManagedProcess], manager) -> Dict[str, float]:
    """`rounds_n` decode steps of every session in `mode` ("round": step_round; "astep": each session's astep, all at
    once on the client loop)."""
    x = head.embed(torch.tensor([[42]]))  # [1, 1, hidden]: the same token each step (compute is not measured)
    me = psutil.Process()
    pids = [s.proc.pid for s in servers]
    peers = sorted({st.hop.peer_id for s in sessions for st in s.session._streams})

    def one_round() -> None:
        if mode == "round":
            outs = rounds.step_round([(s.session, x, None) for s in sessions])
        else:
            async def together():
                return await asyncio.gather(*(s.session.astep(x) for s in sessions), return_exceptions=True)
            outs = aio.run(together())
        errors = [o for o in outs if isinstance(o, BaseException)]
        if errors:
            raise errors[0]

    for _ in range(3):  # warm-up
        one_round()
    stats0 = {p: aio.run(rounds.round_stats(manager, p)) for p in peers}
    client0, servers0 = me.cpu_times(), [cpu_seconds(pid, tree=True) for pid in pids]
    latencies = []
    for _ in range(rounds_n):
        began = time.perf_counter()
        one_round()
        latencies.append(time.perf_counter() - began)
    client1, servers1 = me.cpu_times(), [cpu_seconds(pid, tree=True) for pid in pids]
    stats1 = {p: aio.run(rounds.round_stats(manager, p)) for p in peers}
    tokens = rounds_n * len(sessions)
    latencies.sort()
    return {
        "round_ms_median": round(1e3 * statistics.median(latencies), 2),
        "round_ms_p90": round(1e3 * latencies[int(0.9 * (len(latencies) - 1))], 2),
        "tokens_per_s": round(tokens / sum(latencies), 1),
        "client_cpu_ms_per_token": round(1e3 * ((client1.user + client1.system) - (client0.user + client0.system))
                                         / tokens, 3),
        "server_cpu_ms_per_token": [round(1e3 * (b - a) / tokens, 3) for a, b in zip(servers0, servers1)],
        "round_messages_per_round": [round((stats1[p].messages - stats0[p].messages) / rounds_n, 2) for p in peers],
        "session_messages_per_round": [round((stats1[p].session_steps - stats0[p].session_steps) / rounds_n, 2)
                                       for p in peers],
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sessions", type=int, nargs="+", default=[16, 64], help="concurrent sessions, per run")
    parser.add_argument("--rounds", type=int, default=30, help="measured decode rounds per mode")
    args = parser.parse_args()
    work, path = tiny_checkpoint("round")
    prefix = f"round-{uuid.uuid4().hex[:8]}"
    boot = start_bootstrap(threads=1, log_dir=str(work))
    servers: List[ManagedProcess] = []
    model = None
    result: dict = {"bench": "round", "model": "tiny random llama (hidden 64, 4 blocks)", "spans": list(SPANS),
                    "rounds": args.rounds, "torch_threads_per_process": 1, "runs": []}
    try:
        servers = start_servers(str(path), [boot.maddr], list(SPANS), prefix, threads=1, log_dir=str(work))
        from swarm import AutoDistributedModelForCausalLM

        model = AutoDistributedModelForCausalLM.from_pretrained(str(path), initial_peers=[boot.maddr],
                                                                dht_prefix=prefix)
        for n in args.sessions:
            sessions = [model.inference_session(max_length=2 * args.rounds + 32) for _ in range(n)]
            try:
                head = sessions[0].head
                prompt = head.embed(torch.tensor([[1, 2, 3, 4]]))
                opened = rounds.step_round([(s.session, prompt, None) for s in sessions])  # opens each (astep)
                assert not any(isinstance(o, BaseException) for o in opened), opened
                run = {"sessions": n}
                for mode in ("astep", "round"):
                    run[mode] = run_mode(mode, sessions, head, args.rounds, servers, model.manager)
                run["round_speedup"] = round(run["astep"]["round_ms_median"] / run["round"]["round_ms_median"], 2)
                result["runs"].append(run)
            finally:
                for s in sessions:
                    s.close()
    finally:
        if model is not None:
            rounds.close_round_streams(model.manager)
            model.shutdown()
        terminate_all(servers + [boot])
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
