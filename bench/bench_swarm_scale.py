"""Many real servers with churn on one machine: a tiny random Llama-shaped checkpoint (16 blocks), servers that place
themselves (`--num_blocks` of mixed sizes, mixed `--throughput`), a bootstrap peer, a gateway and a bounded load
generator (concurrent streaming chats); every `--churn_every` s one random server is killed (SIGKILL or SIGTERM
at random) and a new one joins.

Reports one JSON object: requests served and failed, TTFT and inter-token percentiles, holes (blocks no ONLINE
server announces, sampled every 2 s) and how long each lasted, DHT records, rebalancing moves (from the servers'
logs), RSS/PSS and CPU per process kind (each server counted with its DHT child and p2pd), idle RSS/PSS per server
before the load; and draws docs/swarm-scale.png (coverage per block over time with the churn events, served
requests per second).
DHT records: the unexpired (block, server) records under the model's keys, any state. Not measured yet: DHT
traffic per server, routing time per request.

Usage: python bench/bench_swarm_scale.py [--servers 8] [--duration 90] [--churn_every 20] [--concurrency 2]
(the lead's full run: --servers 40 --duration 900 --churn_every 15 --concurrency 8)
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import statistics
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path
from typing import Dict, List

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import hivemind  # noqa: E402
import httpx  # noqa: E402
import psutil  # noqa: E402

from bench.load_client import Stream, stream_chat, wave_stats  # noqa: E402
from swarm.launch import topology  # noqa: E402
from swarm.launch.topology import ManagedProcess, start_gateway, start_server, terminate_all, wait_all  # noqa: E402
from swarm.modeling.prepare import prepare_model  # noqa: E402
from swarm.wire.records import fetch_block_records, online_spans  # noqa: E402
from tests.tiny_checkpoints import save_tiny  # noqa: E402

BLOCKS = 16
SIZES = (2, 4, 6, 8)


def tree_usage(proc: ManagedProcess) -> Dict[str, float]:
    """RSS and PSS (MB; PSS splits pages shared with other processes, e.g. a forked DHT child's, among them) and
    CPU seconds of a process and its descendants (the DHT child, p2pd, a torch_shm_manager if any)."""
    try:
        root = psutil.Process(proc.proc.pid)
        members = [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:
        return {"rss_mb": 0.0, "pss_mb": 0.0, "cpu_s": 0.0}
    rss = pss = cpu = 0.0
    for member in members:
        try:
            memory = member.memory_full_info()
            rss, pss = rss + memory.rss / 2**20, pss + memory.pss / 2**20
            times = member.cpu_times()
            cpu += times.user + times.system
        except psutil.NoSuchProcess:
            pass
    return {"rss_mb": round(rss, 1), "pss_mb": round(pss, 1), "cpu_s": round(cpu, 1)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--servers", type=int, default=8)
    parser.add_argument("--duration", type=float, default=90.0, help="seconds of load and churn")
    parser.add_argument("--churn_every", type=float, default=20.0, help="seconds between kills (0: no churn)")
    parser.add_argument("--concurrency", type=int, default=2, help="chats in flight at once")
    parser.add_argument("--tokens", type=int, default=16, help="completion tokens per chat")
    parser.add_argument("--update_period", type=float, default=10.0, help="servers' --update_period")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--plot", default="docs/swarm-scale.png")
    args = parser.parse_args()
    rng = random.Random(args.seed)
    work = Path(tempfile.mkdtemp(prefix="swarm-scale-"))
    path = work / "tiny-llama-16"
    save_tiny("llama", path, str(prepare_model("smollm2-135m-instruct")), num_hidden_layers=BLOCKS)
    prefix = f"scale-{uuid.uuid4().hex[:8]}"
    boot = topology.start_bootstrap(threads=1, log_dir=str(work))
    servers: List[ManagedProcess] = []
    everyone: List[ManagedProcess] = []
    counter = [0]

    def new_server() -> ManagedProcess:
        counter[0] += 1
        flags = ["--num_blocks", str(rng.choice(SIZES)), "--throughput", f"{10 ** rng.uniform(0, 2):.1f}",
                 "--update_period", str(args.update_period), "--attn_cache_tokens", "2048"]
        proc = start_server(str(path), [boot.maddr], None, prefix, flags, threads=1, log_dir=str(work),
                            name=f"server{counter[0]:03d}")
        everyone.append(proc)
        return proc

    dht = hivemind.DHT(initial_peers=[boot.maddr], client_mode=True, start=True)
    gateway = None
    timeline: List[dict] = []
    churn: List[dict] = []
    streams: List[Stream] = []
    stop = threading.Event()
    try:
        began = time.monotonic()
        servers = wait_all([new_server() for _ in range(args.servers)], 600)
        start_s = round(time.monotonic() - began, 1)
        gateway = start_gateway(str(path), [boot.maddr], prefix, threads=1, log_dir=str(work))
        time.sleep(2 * args.update_period)  # idle: every server announced, nothing in flight
        idle = [tree_usage(p) for p in servers]
        t0 = time.monotonic()

        def monitor():
            while not stop.is_set():
                records = fetch_block_records(dht, prefix, BLOCKS)
                spans = online_spans(records)
                coverage = [sum(1 for s in spans if s.start <= b < s.end) for b in range(BLOCKS)]
                timeline.append({"t": round(time.monotonic() - t0, 1), "coverage": coverage,
                                 "records": sum(len(block) for block in records)})
                stop.wait(2.0)

        def churner():
            while args.churn_every > 0 and not stop.wait(args.churn_every):
                victim = rng.choice(servers)
                how = rng.choice([signal.SIGKILL, signal.SIGTERM])
                victim.kill() if how == signal.SIGKILL else victim.terminate()
                servers.remove(victim)
                servers.append(new_server())
                churn.append({"t": round(time.monotonic() - t0, 1), "killed": victim.name, "how": how.name})

        async def load():
            url = gateway.ready["url"]
            body = {"model": gateway.ready["model"], "messages": [{"role": "user", "content": "Tell me about rivers."}],
                    "max_tokens": args.tokens, "temperature": 0}
            async with httpx.AsyncClient(timeout=120) as http:
                async def worker():
                    while time.monotonic() - t0 < args.duration:
                        streams.append(await stream_chat(http, url, body))
                await asyncio.gather(*(worker() for _ in range(args.concurrency)))

        threads = [threading.Thread(target=monitor, daemon=True), threading.Thread(target=churner, daemon=True)]
        for thread in threads:
            thread.start()
        asyncio.run(load())
        stop.set()
        for thread in threads:
            thread.join(120)
        usage = {p.name: tree_usage(p) for p in servers}
        gateway_usage, boot_usage = tree_usage(gateway), tree_usage(boot)
    finally:
        stop.set()
        dht.shutdown()
        terminate_all([p for p in [gateway, *everyone] if p is not None])
        boot.terminate()

    holes, open_at = [], {}
    for sample in timeline:
        for block, count in enumerate(sample["coverage"]):
            if count == 0:
                open_at.setdefault(block, sample["t"])
            elif block in open_at:
                holes.append(round(sample["t"] - open_at.pop(block), 1))
    holes += [round(timeline[-1]["t"] - t, 1) for t in open_at.values()] if timeline else []
    moves = sum(p.log_path.read_text(errors="replace").count("rebalancing: moving") for p in everyone)
    stats = wave_stats(streams)
    served = sum(1 for s in streams if s.error is None and s.status == 200)
    errors = sorted({(s.error or f"HTTP {s.status}")[:160] for s in streams if s.error or s.status != 200})
    result = {"servers": args.servers, "blocks": BLOCKS, "duration_s": args.duration, "churn_every_s": args.churn_every,
              "concurrency": args.concurrency, "start_all_servers_s": start_s, "requests": stats["streams"],
              "failed": stats["failed"], "requests_per_s": round(served / args.duration, 2),
              "chunks_per_s": round(sum(len(s.times) for s in streams) / args.duration, 1), "ttft_ms": stats["ttft_ms"],
              "itl_ms": stats["itl_ms"], "kills": len(churn),
              "dht_records_max": max((t["records"] for t in timeline), default=0),
              "dht_records_per_server": round(statistics.fmean(t["records"] for t in timeline) / args.servers, 2)
              if timeline else 0.0, "block_holes": len(holes),
              "hole_seconds_max": max(holes) if holes else 0.0, "moves": moves,
              "idle_server_rss_mb_median": round(statistics.median(u["rss_mb"] for u in idle), 1),
              "idle_server_pss_mb_median": round(statistics.median(u["pss_mb"] for u in idle), 1),
              "server_rss_mb_median": round(statistics.median(u["rss_mb"] for u in usage.values()), 1),
              "server_cpu_s_median": round(statistics.median(u["cpu_s"] for u in usage.values()), 1),
              "gateway": gateway_usage, "bootstrap": boot_usage, "errors": errors[:5], "logs": str(work)}
    plot(timeline, churn, streams, args.plot)
    print(json.dumps(result))
    return 0


def plot(timeline: List[dict], churn: List[dict], streams: List[Stream], out: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    if not timeline:
        return
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(10, 6), sharex=True)
    times = [s["t"] for s in timeline]
    grid = [[s["coverage"][b] for s in timeline] for b in range(BLOCKS)]
    image = top.imshow(grid, aspect="auto", origin="lower", cmap="viridis", interpolation="nearest",
                       extent=(times[0], times[-1], -0.5, BLOCKS - 0.5))
    fig.colorbar(image, ax=top, label="ONLINE servers")
    for event in churn:
        top.axvline(event["t"], color="red" if event["how"] == "SIGKILL" else "orange", lw=1)
    top.set_ylabel("block")
    top.set_title("coverage per block (red: SIGKILL, orange: SIGTERM)")
    first = min((s.sent for s in streams), default=0.0)
    ends = [s.ended - first for s in streams if s.error is None and s.status == 200]
    if ends:
        bins = range(0, int(max(ends)) + 6, 5)
        bottom.hist(ends, bins=bins, weights=[1 / 5] * len(ends))
    bottom.set_ylabel("served requests / s")
    bottom.set_xlabel("seconds (load generator's clock)")
    fig.tight_layout()
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=90)
    plt.close(fig)


if __name__ == "__main__":
    sys.exit(main())
