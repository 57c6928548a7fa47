"""Shutdown benchmark: seconds from SIGTERM to the exit of each process kind, sent to the process alone or to its
whole process group, idle and (server, gateway) with a streamed generation running.

Starts its own bootstrap peer and a block server (0:30) that the gateways use, then for each case a fresh process
(`launch.topology`, one intra-op thread each): a bootstrap peer, a server under its own DHT prefix (with a
gateway streaming from it for the loaded case), a gateway. The time is measured from the signal to the process's
exit (its DHT process and p2pd stopped, descendants reaped). Prints one JSON object: the median per case and
the slowest exit seen.

Usage (from the repository root): .venv/bin/python bench/bench_shutdown.py [--runs 2]
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import sys
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from launch import topology  # noqa: E402
from launch.topology import ManagedProcess  # noqa: E402


def _stream(url: str, started: threading.Event) -> None:
    import httpx

    body = {"model": "smollm2-135m-instruct", "prompt": "Once upon a time", "max_tokens": 2000, "stream": True,
            "ignore_eos": True}
    try:
        with httpx.stream("POST", url + "/v1/completions", json=body, timeout=120) as response:
            for i, _ in enumerate(response.iter_lines()):
                if i >= 6:
                    started.set()
    except httpx.HTTPError:
        pass


def _load(url: str) -> None:
    started = threading.Event()
    threading.Thread(target=_stream, args=(url, started), daemon=True).start()
    if not started.wait(120):
        raise RuntimeError("no tokens streamed")


def _time_exit(proc: ManagedProcess, group: bool) -> float:
    began = time.monotonic()
    if group:
        os.killpg(proc.proc.pid, signal.SIGTERM)
    else:
        proc.proc.send_signal(signal.SIGTERM)
    proc.proc.wait(60)
    took = time.monotonic() - began
    proc.kill()
    return took


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=2)
    args = parser.parse_args()
    from swarm.modeling.prepare import prepare_model

    path = str(prepare_model())
    bootstrap = topology.start_bootstrap(name="bench-sd-dht", threads=1)
    peers = [bootstrap.maddr]
    base = f"bench-sd-{os.getpid()}"
    shared = topology.start_server(path, peers, "0:30", f"{base}-gw", threads=1, name="bench-sd-shared")
    shared.wait_ready(180)
    times: dict = {}
    try:
        for run in range(args.runs):
            for group in (False, True):
                mode = "group" if group else "process alone"
                dht = topology.start_bootstrap(name="bench-sd-dht2", threads=1)
                times.setdefault(f"dht, SIGTERM to the {mode}", []).append(_time_exit(dht, group))
                for load in (False, True):
                    what = " under load" if load else ""
                    prefix = f"{base}-{run}-{mode}-{int(load)}"
                    server = topology.start_server(path, peers, "0:30", prefix, threads=1, name="bench-sd-server")
                    server.wait_ready(180)
                    gateway = None
                    if load:
                        gateway = topology.start_gateway(path, peers, prefix, name="bench-sd-load", threads=1)
                        _load(gateway.ready["url"])
                    times.setdefault(f"server, SIGTERM to the {mode}{what}", []).append(_time_exit(server, group))
                    if gateway is not None:
                        gateway.terminate()
                    gateway = topology.start_gateway(path, peers, f"{base}-gw", name="bench-sd-gateway", threads=1)
                    if load:
                        _load(gateway.ready["url"])
                    times.setdefault(f"gateway, SIGTERM to the {mode}{what}", []).append(_time_exit(gateway, group))
    finally:
        shared.terminate()
        bootstrap.terminate()
    result = {"benchmark": "shutdown", "runs": args.runs,
              **{f"seconds to exit: {k}": round(statistics.median(v), 2) for k, v in times.items()},
              "slowest exit (s)": round(max(max(v) for v in times.values()), 2)}
    print(json.dumps(result))


if __name__ == "__main__":
    main()
