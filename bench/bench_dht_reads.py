"""What reading the swarm costs: the DHT traffic of idle self-placed servers per server per minute, and of one full
read of the records, for a swarm of `--servers` servers (no gateway, no load, no churn: only the servers'
announcements, next-ping measurements, hole and balance checks).

The servers are those of bench/bench_swarm_scale.py (a tiny random 16-block Llama, `--num_blocks` 2/4/6/8, mixed
throughputs, `--update_period 10`). After they are all ready and have announced twice, a client-mode DHT peer reads
every block's records three times (`one_read`: its find and store calls, bytes sent plus received, records read),
then each server's counters (`rpc_dht_traffic`) are read twice, `--window` s apart (`per_server_per_min`: the
median and max over servers of messages and bytes sent and received, and of the RPCs made and served by kind;
`traffic_rates` of bench_swarm_scale). Counted in each DHT
process (`swarm.runtime.dht_traffic`): protobuf payloads, not p2pd's framing.

Usage: python bench/bench_dht_reads.py [--servers 8] [--window 60]
"""
from __future__ import annotations

import argparse
import json
import os
import random
import sys
import tempfile
import time
import uuid
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.bench_swarm_scale import BLOCKS, SIZES, read_traffic, traffic_rates  # noqa: E402
from launch import topology  # noqa: E402
from launch.topology import start_server, terminate_all, wait_all  # noqa: E402
from swarm.client.transport.manager import ClientConfig, SwarmManager  # noqa: E402
from swarm.modeling.prepare import prepare_model  # noqa: E402
from swarm.runtime.dht_traffic import read_dht_traffic  # noqa: E402
from swarm.runtime.swarm_key import join_dht  # noqa: E402
from swarm.wire.records import fetch_block_records  # noqa: E402
from tests.fixtures.tiny_checkpoints import save_tiny  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--servers", type=int, default=8, help="idle server processes")
    parser.add_argument("--window", type=float, default=60.0, help="seconds between the two readings of the counters")
    parser.add_argument("--update_period", type=float, default=10.0, help="servers' --update_period")
    parser.add_argument("--seed", type=int, default=0, help="seed of the sizes and throughputs")
    args = parser.parse_args()
    rng = random.Random(args.seed)
    work = Path(tempfile.mkdtemp(prefix="dht-reads-"))
    path = work / "tiny-llama-16"
    save_tiny("llama", path, str(prepare_model("smollm2-135m-instruct")), num_hidden_layers=BLOCKS)
    prefix = f"reads-{uuid.uuid4().hex[:8]}"
    boot = topology.start_bootstrap(threads=1, log_dir=str(work))
    procs = []
    try:
        for i in range(args.servers):
            flags = ["--num_blocks", str(rng.choice(SIZES)), "--throughput", f"{10 ** rng.uniform(0, 2):.1f}",
                     "--update_period", str(args.update_period), "--attn_cache_tokens", "2048"]
            procs.append(start_server(str(path), [boot.maddr], None, prefix, flags, threads=1, log_dir=str(work),
                                      name=f"server{i:03d}"))
        wait_all(procs, 900)
        dht = join_dht(None, initial_peers=[boot.maddr], client_mode=True)
        manager = SwarmManager(ClientConfig(initial_peers=[boot.maddr], measure_rtt=False), prefix, BLOCKS, dht=dht)
        try:
            time.sleep(2 * args.update_period)
            reads = []
            for _ in range(3):
                before = read_dht_traffic(dht)
                records = fetch_block_records(dht, prefix, BLOCKS)
                after = read_dht_traffic(dht)
                reads.append({"finds": after.calls_made.get("find", 0) - before.calls_made.get("find", 0),
                              "stores": after.calls_made.get("store", 0) - before.calls_made.get("store", 0),
                              "bytes": after.sent_bytes + after.received_bytes - before.sent_bytes
                              - before.received_bytes, "records": sum(len(block) for block in records)})
            peers = [p.peer_id for p in procs]
            first, began = read_traffic(manager, peers), time.monotonic()
            time.sleep(args.window)
            last, per_min = read_traffic(manager, peers), 60 / (time.monotonic() - began)
        finally:
            manager.shutdown()
            dht.shutdown()
    finally:
        terminate_all(procs)
        boot.terminate()
    readings = {peer: [(0.0, first[peer]), (60.0 / per_min, last[peer])] for peer in set(first) & set(last)}
    print(json.dumps({"servers": args.servers, "update_period": args.update_period, "one_read": reads,
                      "per_server_per_min": traffic_rates(readings, 0.0)}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
