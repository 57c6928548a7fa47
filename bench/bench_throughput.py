"""Aggregate decode tokens/s for 1, 2, 4, 8 and 16 concurrent sessions, time to first token against prompt
length (64 ... 1024 tokens), and memory (peak RSS) of the client and of each server, on a 2-server swarm
(blocks 0:15 + 15:30, float32) on loopback. Prints one JSON object.

Concurrent sessions each run 32 greedy decode steps (`generate` on an open session) from a 100-token prompt in
their own thread; the aggregate
rate counts all sessions' decode tokens over the wall time of the decode phase. The local single-session
decode rate of `transformers` is measured in the same run for the ratio.
"""
from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import psutil  # noqa: E402
import torch  # noqa: E402

from bench.harness import Clock  # noqa: E402
from launch.topology import Topology  # noqa: E402
from swarm.modeling.prepare import prepare_model  # noqa: E402

DECODE_STEPS = 32


def peak_rss_mb(pid: int) -> float:
    """Peak RSS (VmHWM) of one process, in MB."""
    for line in open(f"/proc/{pid}/status"):
        if line.startswith("VmHWM:"):
            return round(int(line.split()[1]) / 1024, 1)
    return 0.0


def tree_pss_mb(pid: int) -> float:
    """Current proportional set size of a process and its children (shared pages split fairly), in MB."""
    proc = psutil.Process(pid)
    total = 0
    for p in [proc] + proc.children(recursive=True):
        try:
            total += p.memory_full_info().pss
        except (psutil.Error, OSError):
            pass
    return round(total / 2**20, 1)


def local_decode_rate(path, prompt) -> float:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    best = 0.0
    with torch.inference_mode():
        model.generate(prompt[:, :8], max_new_tokens=2)
        for _ in range(2):
            clock = Clock()
            model.generate(prompt, max_new_tokens=DECODE_STEPS + 1, min_new_tokens=DECODE_STEPS + 1, do_sample=False,
                           streamer=clock)
            best = max(best, DECODE_STEPS / (clock.times[-1] - clock.times[1]))  # after the first new token
    return best


def concurrent_rate(model, prompt, sessions: int) -> float:
    barrier = threading.Barrier(sessions)
    times = []

    def run(i):
        with model.inference_session(max_length=prompt.shape[1] + DECODE_STEPS + 1) as s:
            ids = prompt.clone()
            ids[0, 0] = 100 + i  # different sessions, different contents
            s.feed(ids)  # the prompt
            barrier.wait()
            start = time.perf_counter()
            # DECODE_STEPS single-token steps (the first re-sends the prompt's last token for its logits)
            model.generate(ids, session=s, max_new_tokens=DECODE_STEPS, min_new_tokens=DECODE_STEPS, do_sample=False)
            times.append((start, time.perf_counter()))

    with ThreadPoolExecutor(sessions) as pool:
        list(pool.map(run, range(sessions)))
    wall = max(t[1] for t in times) - min(t[0] for t in times)
    return sessions * DECODE_STEPS / wall


def ttft(model, length: int) -> float:
    ids = torch.randint(100, 10000, (1, length))
    best = float("inf")
    for _ in range(2):
        with model.inference_session(max_length=length + 1) as s:
            start = time.perf_counter()
            s.feed(ids)
            best = min(best, time.perf_counter() - start)
    return best


def main() -> None:
    from swarm import AutoDistributedModelForCausalLM

    path = str(prepare_model())
    prompt = torch.randint(100, 10000, (1, 100))
    result = {}
    with Topology(path, ["0:15", "15:30"], prefix="bench-tp", server_args=["--attn_cache_tokens", "65536"],
                  name="bench-tp", ready_timeout=300) as topology:
        servers = topology.servers
        model = AutoDistributedModelForCausalLM.from_pretrained(path, initial_peers=topology.initial_peers,
                                                                dht_prefix="bench-tp")
        model.generate(prompt[:, :8], max_new_tokens=2)
        result["client_peak_rss_mb_after_load"] = peak_rss_mb(psutil.Process().pid)
        rates = {}
        for n in (1, 2, 4, 8, 16):
            rates[str(n)] = round(concurrent_rate(model, prompt, n), 2)
        result["aggregate_decode_tokens_per_s"] = rates
        result["ttft_s_by_prompt_length"] = {str(n): round(ttft(model, n), 3) for n in (64, 128, 256, 512, 1024)}
        stats = [model.manager.server_info(s.peer_id) for s in servers]
        result["largest_decode_batch"] = max(s.largest_batch for s in stats)
        result["client_peak_rss_mb"] = peak_rss_mb(psutil.Process().pid)
        result["client_pss_mb_with_dht_children"] = tree_pss_mb(psutil.Process().pid)
        result["server_peak_rss_mb"] = [peak_rss_mb(s.proc.pid) for s in servers]
        result["server_pss_mb_with_children"] = [tree_pss_mb(s.proc.pid) for s in servers]
        model.shutdown()
    # in a process of its own: its model must not count in the client's memory, and OpenMP teams of one process
    # slow each other down (swarm/runtime/threads.py)
    out = subprocess.run([sys.executable, __file__, "--local_only"], capture_output=True, text=True, check=True)
    local_rate = float(out.stdout.split()[-1])
    result["local_decode_tokens_per_s"] = round(local_rate, 2)
    result["ratio_8_sessions_over_local_single"] = round(result["aggregate_decode_tokens_per_s"]["8"] / local_rate, 2)
    print(json.dumps(result))


if __name__ == "__main__":
    if "--local_only" in sys.argv:
        torch.manual_seed(0)
        print(local_decode_rate(str(prepare_model()), torch.randint(100, 10000, (1, 100))))
    else:
        main()
