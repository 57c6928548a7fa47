"""Memory (RSS) of block servers and the gateway, phase by phase, on a 2-server swarm (0:15 + 15:30, float32).

Servers: the peak while loading, then the peak of each phase and the RSS after it: one session (100-token
prompt + 64 new tokens), 1, 2, 4, 8 and 16 concurrent sessions (100 + 32), then prompts of 64 ... 1024 tokens
(the load of bench_throughput). The gateway: the peak while loading, then 3 streamed chat completions one after
another (64 tokens each), then 8 at once. A phase's peak is VmHWM after resetting it (`/proc/PID/clear_refs`)
at the phase's start (where that cannot be reset, peaks are cumulative); "after" is the RSS a second after the
phase's sessions closed. At the end, each process's resident memory split into anonymous and file-backed
(mostly shared libraries). Prints one JSON object (MB).
"""
from __future__ import annotations

import json
import os
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402


def status_mb(pid: int) -> dict:
    """VmRSS, VmHWM (peak since the last reset), RssAnon, RssFile of a process, in MB."""
    values = {}
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            key = line.split(":")[0]
            if key in ("VmRSS", "VmHWM", "RssAnon", "RssFile"):
                values[key] = round(int(line.split()[1]) / 1024, 1)
    return values


def reset_peak(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


class Phases:
    def __init__(self, procs: dict):
        """Starts after loading: the peak so far is the load's."""
        self.procs = procs  # name -> pid
        self.result = {}
        for name, pid in procs.items():
            s = status_mb(pid)
            self.result[name] = {"load_peak": s["VmHWM"], "idle_after_load": s["VmRSS"]}
        self.resettable = all([reset_peak(pid) for pid in procs.values()])

    def end(self, phase: str) -> None:
        """Record `phase`'s peak and the RSS a second after it (its sessions closed), start the next peak."""
        time.sleep(1.0)
        for name, pid in self.procs.items():
            s = status_mb(pid)
            self.result[name][f"{phase}_peak"] = s["VmHWM"]
            self.result[name][f"{phase}_after"] = s["VmRSS"]
            reset_peak(pid)

    def split(self) -> None:
        for name, pid in self.procs.items():
            s = status_mb(pid)
            self.result[name]["anon_at_end"], self.result[name]["file_at_end"] = s["RssAnon"], s["RssFile"]


def server_phases(model, phases: Phases) -> None:
    prompt = torch.randint(100, 10000, (1, 100))
    model.generate(prompt, max_new_tokens=64, min_new_tokens=64, do_sample=False)
    phases.end("one_session")
    for n in (1, 2, 4, 8, 16):
        barrier = threading.Barrier(n)

        def run(i):
            with model.inference_session(max_length=prompt.shape[1] + 33) as s:
                ids = prompt.clone()
                ids[0, 0] = 100 + i
                s.feed(ids)
                barrier.wait()
                model.generate(ids, session=s, max_new_tokens=32, min_new_tokens=32, do_sample=False)

        with ThreadPoolExecutor(n) as pool:
            list(pool.map(run, range(n)))
    phases.end("up_to_16_sessions")
    for length in (64, 128, 256, 512, 1024):
        with model.inference_session(max_length=length + 1) as s:
            s.feed(torch.randint(100, 10000, (1, length)))
    phases.end("prompts_up_to_1024")


def gateway_phases(url: str, phases: Phases) -> None:
    import openai

    client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=300)
    served = client.models.list().data[0].id

    def chat(i: int) -> None:
        messages = [{"role": "user", "content": f"Summarise the benefits of community gardens ({i})."}]
        for _ in client.chat.completions.create(model=served, messages=messages, temperature=0, max_tokens=64,
                                                stream=True, extra_body={"ignore_eos": True}):
            pass

    for i in range(3):
        chat(i)
    phases.end("three_chats")
    with ThreadPoolExecutor(8) as pool:
        list(pool.map(chat, range(10, 18)))
    phases.end("eight_concurrent_chats")


def main() -> int:
    from harness import BenchSwarm  # bench/ is on the path when a benchmark runs as a script

    with BenchSwarm("bench-mem", ["0:15", "15:30"], ["--attn_cache_tokens", "65536"]) as swarm:
        servers = swarm.servers
        servers_phases = Phases({f"server_{s.ready['start']}_{s.ready['end']}": s.proc.pid for s in servers})
        server_phases(swarm.client_model(), servers_phases)
        servers_phases.split()
        gateway = swarm.start_gateway("bench-memory-gateway")
        url = gateway.ready["url"]
        gateway_phase = Phases({"gateway": gateway.proc.pid})
        gateway_phases(url, gateway_phase)
        gateway_phase.split()
        print(json.dumps({"benchmark": "memory_rss_mb", "peaks_reset_per_phase": servers_phases.resettable,
                          **servers_phases.result, **gateway_phase.result}))
        return 0


if __name__ == "__main__":
    sys.exit(main())
