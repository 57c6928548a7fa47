"""Many real servers with churn on one machine: a tiny random Llama-shaped checkpoint (16 blocks), servers that place
themselves (`--num_blocks` of mixed sizes, mixed `--throughput`), a bootstrap peer, a gateway and a bounded load
generator (concurrent streaming chats); every `--churn_every` s one random server is killed (SIGKILL or SIGTERM
at random) and a new one joins.

Reports one JSON object: requests served and failed, TTFT and inter-token percentiles, holes (blocks no ONLINE
server announces, sampled every 2 s) and how long each lasted, DHT records, rebalancing moves (from the servers'
logs), RSS/PSS and CPU per process kind (each server counted with its DHT child and p2pd), idle RSS/PSS per server
before the load; and draws docs/swarm-scale.png (coverage per block over time with the churn events, served
requests per second).
DHT records: the unexpired (block, server) records under the model's keys, any state. DHT traffic per server per
minute: each online server's counters (`rpc_dht_traffic`: its DHT peer's RPC messages and their protobuf bytes,
sent and received, counted in the DHT process by `swarm.runtime.dht_traffic`, as of its last announcement) is read
every `--update_period` s; a server's rate is its counters' growth between its first and last reading (servers
read over at least one period), reported as the median and max over servers. Routing time: the gateway's
`swarmgate_route_seconds` histogram (read from /metrics at the end): every inference chain built (one at
admission, one per session opened or failed over), with its view part (DHT records read and servers pinged when
the client's view was due) and its search part (`find_inference_chain`).

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
from prometheus_client.parser import text_string_to_metric_families  # noqa: E402

from bench.load_client import Stream, stream_chat, wave_stats  # noqa: E402
from launch import topology  # noqa: E402
from launch.topology import ManagedProcess, start_gateway, start_server, terminate_all, wait_all  # noqa: E402
from swarm.client.transport.manager import ClientConfig, SwarmManager  # noqa: E402
from swarm.modeling.prepare import prepare_model  # noqa: E402
from swarm.runtime import aio  # noqa: E402
from swarm.runtime.dht_traffic import DHTTraffic  # noqa: E402
from swarm.runtime.swarm_key import NO_DHT_CACHE  # noqa: E402
from swarm.wire.records import fetch_block_records, online_spans  # noqa: E402
from tests.fixtures.tiny_checkpoints import save_tiny  # noqa: E402

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


def read_traffic(manager: SwarmManager, peer_ids: List[str]) -> Dict[str, DHTTraffic]:
    """Each server's DHT traffic counters (`rpc_dht_traffic`; servers that do not answer are left out)."""
    async def one(peer_id: str):
        try:
            return await asyncio.wait_for(manager.dht_traffic(peer_id), 10)
        except Exception:
            return None

    async def every():
        return await asyncio.gather(*(one(p) for p in peer_ids))

    return {p: t for p, t in zip(peer_ids, aio.run(every(), timeout=30)) if t is not None}


def traffic_rates(readings: Dict[str, List[tuple]], min_span: float) -> dict:
    """Per server per minute (median and max over servers read at least `min_span` s apart): DHT messages and
    bytes sent and received, and RPCs made and served by kind (medians)."""
    rates: List[Dict[str, float]] = []
    for series in readings.values():
        (t0, first), (t1, last) = series[0], series[-1]
        if t1 - t0 < min_span:
            continue
        per_min = 60.0 / (t1 - t0)
        rate = {key: (getattr(last, key) - getattr(first, key)) * per_min
                for key in ("sent_messages", "sent_bytes", "received_messages", "received_bytes")}
        for field in ("calls_made", "calls_served"):
            for kind in getattr(last, field):
                rate[f"{field}.{kind}"] = (getattr(last, field).get(kind, 0) - getattr(first, field).get(kind, 0)
                                           ) * per_min
        rates.append(rate)
    if not rates:
        return {"servers_measured": 0}
    keys = sorted({key for rate in rates for key in rate})
    result: dict = {"servers_measured": len(rates)}
    for key in keys:
        values = [rate.get(key, 0.0) for rate in rates]
        result[key] = {"median": round(statistics.median(values), 1), "max": round(max(values), 1)}
    return result


def routing_times(metrics_text: str, requests: int) -> dict:
    """The gateway's `swarmgate_route_seconds` histogram: routes built, routes and ms per request, mean ms of each
    part, and p50/p95 of the total (the upper bound of the bucket that holds it)."""
    count: Dict[str, float] = {}
    total: Dict[str, float] = {}
    buckets: List[tuple] = []
    for family in text_string_to_metric_families(metrics_text):
        if family.name != "swarmgate_route_seconds":
            continue
        for sample in family.samples:
            part = sample.labels.get("part", "")
            if sample.name.endswith("_count"):
                count[part] = sample.value
            elif sample.name.endswith("_sum"):
                total[part] = sample.value
            elif sample.name.endswith("_bucket") and part == "total":
                buckets.append((float(sample.labels["le"]), sample.value))
    routes = int(count.get("total", 0))
    if routes == 0:
        return {"routes": 0}

    def quantile(q: float) -> float:
        return next((round(le * 1000, 2) for le, seen in sorted(buckets) if seen >= q * routes), float("inf"))

    return {"routes": routes, "routes_per_request": round(routes / max(requests, 1), 2),
            "ms_per_request": round(1000 * total["total"] / max(requests, 1), 2),
            "mean_ms": {part: round(1000 * total[part] / count[part], 3) for part in ("view", "search", "total")},
            "total_p50_ms_le": quantile(0.5), "total_p95_ms_le": quantile(0.95)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--servers", type=int, default=8, help="server processes kept running (each kill is replaced)")
    parser.add_argument("--duration", type=float, default=90.0, help="seconds of load and churn")
    parser.add_argument("--churn_every", type=float, default=20.0, help="seconds between kills (0: no churn)")
    parser.add_argument("--concurrency", type=int, default=2, help="chats in flight at once")
    parser.add_argument("--tokens", type=int, default=16, help="completion tokens per chat")
    parser.add_argument("--update_period", type=float, default=10.0, help="servers' --update_period")
    parser.add_argument("--seed", type=int, default=0, help="seed of the sizes, throughputs and kills")
    parser.add_argument("--plot", default="docs/swarm-scale.png", help="where to draw the PNG")
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

    dht = hivemind.DHT(initial_peers=[boot.maddr], client_mode=True, start=True, **NO_DHT_CACHE)  # as every peer
    manager = SwarmManager(ClientConfig(initial_peers=[boot.maddr], measure_rtt=False), prefix, BLOCKS, dht=dht)
    traffic: Dict[str, List[tuple]] = {}  # peer id -> [(seconds since the load began, DHTTraffic)]
    metrics_text = ""
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

        online: List[str] = []  # the peer ids of the latest sample's online servers

        def monitor():
            while not stop.is_set():
                records = fetch_block_records(dht, prefix, BLOCKS)
                spans = online_spans(records)
                online[:] = sorted({s.peer_id for s in spans})
                coverage = [sum(1 for s in spans if s.start <= b < s.end) for b in range(BLOCKS)]
                timeline.append({"t": round(time.monotonic() - t0, 1), "coverage": coverage,
                                 "records": sum(len(block) for block in records)})
                stop.wait(2.0)

        def traffic_reader():  # its own thread: a killed server still listed may take the info call's time-out
            while not stop.wait(args.update_period):
                now = time.monotonic() - t0
                for peer_id, counters in read_traffic(manager, list(online)).items():
                    traffic.setdefault(peer_id, []).append((now, counters))

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

        threads = [threading.Thread(target=f, daemon=True) for f in (monitor, churner, traffic_reader)]
        for thread in threads:
            thread.start()
        asyncio.run(load())
        stop.set()
        for thread in threads:
            thread.join(120)
        usage = {p.name: tree_usage(p) for p in servers}
        metrics_text = httpx.get(gateway.ready["url"] + "/metrics", timeout=30).text
        gateway_usage, boot_usage = tree_usage(gateway), tree_usage(boot)
    finally:
        stop.set()
        manager.shutdown()
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
              "dht_traffic_per_server_per_min": traffic_rates(traffic, args.update_period),
              "routing": routing_times(metrics_text, stats["streams"]),
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
