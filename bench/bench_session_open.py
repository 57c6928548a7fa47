"""What a session's life costs besides its decode steps (issue 46): N sessions on a tiny random Llama (hidden 64, 4
blocks) over 2 servers (0:2 and 2:4) opened, prefilled with a 20-token prompt in one `step_round` and closed, wave
after wave, by a client whose session parts travel in session channels (`channel`: one `rpc_sessions` stream per
server) and by one that opens a stream per part (`stream`, `session_channels=False`), on the same servers, waves
alternating. Reports, per session, the CPU milliseconds of the client's Python process, of its p2pd (with its DHT
process), and of each server (its process tree), and each wave's wall time. Prints one JSON object.

    .venv/bin/python bench/bench_session_open.py --sessions 64 --waves 10
"""
from __future__ import annotations

import argparse
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

SPANS = ("0:2", "2:4")
MODES = {"channel": True, "stream": False}  # mode -> the client's session_channels


def _descendants(pid: int) -> List[int]:
    try:
        return [child.pid for child in psutil.Process(pid).children(recursive=True)]
    except psutil.NoSuchProcess:
        return []


def wave(model, n: int, prompt_ids: torch.Tensor) -> None:
    """Open n sessions, prefill each with the prompt in one round (which opens them), close them."""
    sessions = [model.inference_session(max_length=64) for _ in range(n)]
    try:
        x = sessions[0].head.embed(prompt_ids)  # [1, seq, hidden]
        outs = rounds.step_round([(s.session, x, None) for s in sessions])
        errors = [o for o in outs if isinstance(o, BaseException)]
        if errors:
            raise errors[0]
    finally:
        for s in sessions:
            s.close()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sessions", type=int, default=64, help="sessions per wave")
    parser.add_argument("--waves", type=int, default=10, help="measured waves per mode (alternating)")
    parser.add_argument("--prompt_tokens", type=int, default=20, help="tokens of each session's prompt")
    args = parser.parse_args()
    result: dict = {"bench": "session_open", "model": "tiny random llama (hidden 64, 4 blocks)", "spans": list(SPANS),
                    "sessions": args.sessions, "waves": args.waves, "prompt_tokens": args.prompt_tokens,
                    "torch_threads_per_process": 1}
    work, path = tiny_checkpoint("open")
    prefix = f"open-{uuid.uuid4().hex[:8]}"
    models: Dict[str, object] = {}
    servers: List[ManagedProcess] = []
    boot = start_bootstrap(threads=1, log_dir=str(work))
    try:
        servers = start_servers(str(path), [boot.maddr], list(SPANS), prefix,
                                ["--max_sessions_per_peer", str(4 * args.sessions)], threads=1, log_dir=str(work))
        from swarm import AutoDistributedModelForCausalLM

        me = os.getpid()
        others = {pid for p in [boot, *servers] for pid in [p.proc.pid, *_descendants(p.proc.pid)]}
        for mode, channels in MODES.items():
            models[mode] = AutoDistributedModelForCausalLM.from_pretrained(
                str(path), initial_peers=[boot.maddr], dht_prefix=prefix, session_channels=channels)
        client_kids = [pid for pid in _descendants(me) if pid not in others]  # the clients' DHT processes, p2pds
        prompt_ids = torch.arange(1, args.prompt_tokens + 1)[None]  # [1, prompt_tokens]
        for model in models.values():  # warm-up: routes, streams, the servers' first passes
            for _ in range(2):
                wave(model, args.sessions, prompt_ids)
        spent: Dict[str, Dict[str, List[float]]] = {mode: {} for mode in MODES}
        for _ in range(args.waves):
            for mode, model in models.items():
                before = {"client": psutil.Process(me).cpu_times(),
                          "p2pd": sum(cpu_seconds(pid) for pid in client_kids),
                          "servers": [cpu_seconds(s.proc.pid, tree=True) for s in servers]}
                began = time.perf_counter()
                wave(model, args.sessions, prompt_ids)
                wall = time.perf_counter() - began
                client = psutil.Process(me).cpu_times()
                row = spent[mode]
                row.setdefault("wall_ms", []).append(1e3 * wall)
                row.setdefault("client_ms", []).append(
                    1e3 * (client.user + client.system - before["client"].user - before["client"].system))
                row.setdefault("client_p2pd_ms", []).append(
                    1e3 * (sum(cpu_seconds(pid) for pid in client_kids) - before["p2pd"]))
                for i, s in enumerate(servers):
                    row.setdefault(f"server{i}_ms", []).append(
                        1e3 * (cpu_seconds(s.proc.pid, tree=True) - before["servers"][i]))
        for mode, row in spent.items():
            result[mode] = {"wave_wall_ms_median": round(statistics.median(row.pop("wall_ms")), 1)}
            for key, values in row.items():  # per session: the median wave's CPU / sessions
                result[mode][f"{key}_per_session"] = round(statistics.median(values) / args.sessions, 3)
    finally:
        for model in models.values():
            model.shutdown()  # type: ignore[attr-defined]
        terminate_all(servers + [boot])
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
