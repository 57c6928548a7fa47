"""Soak benchmark: 16 streaming chats through the gateway for a long run while servers are killed and restarted.

Starts its own bootstrap peer, four block servers (two per span, 0:15 and 15:30, so that a killed server's
sessions have somewhere to fail over to) and a gateway (`--max_concurrent 16`, a short session-pool TTL) as
processes (`bench/harness.py`). `--chats` client threads each stream chat completions (`POST
/v1/chat/completions`, `stream: true`, httpx, a few dozen tokens each) back to back for `--minutes`; every
`--kill_every` minutes one server (each in turn) gets SIGKILL and a replacement for the same span is started.

Every request either succeeds (the stream ends with `data: [DONE]` and no error event) or fails, counted by kind
(`http_<status>`, `stream_error:<type>`, `truncated`, `timeout`, `connection`), with one sample message per kind,
and the sessions the gateway failed over to another server (the "re-routed" lines of its log).
At the start and the end it reads the RSS (the process and its children: DHT child, p2p daemon) of every process;
after the load stops it waits for the gateway's pooled sessions to expire (`--pool_ttl`) and reads every live
server's KV cache in use and open sessions through `rpc_info` (`ServerStats.cache_tokens_used`): both must be 0.
Prints one JSON object.

Usage (from the repository root): .venv/bin/python bench/bench_soak.py [--minutes 30] [--kill_every 5]
"""
from __future__ import annotations

import argparse
import json
import os
import random
import signal
import sys
import threading
import time
from collections import Counter
from typing import Dict, List, Optional

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.harness import tree_rss  # noqa: E402

SPANS = ["0:15", "0:15", "15:30", "15:30"]
TOPICS = ["the moon", "a lighthouse", "bread", "rivers", "a bicycle", "winter", "bees", "a library", "tea",
          "volcanoes", "chess", "the sea", "trains", "autumn leaves", "a market", "clocks"]


def tree_rss_mb(pid: int) -> Optional[float]:
    """RSS of a process and its descendants in MB (None if it is gone)."""
    total = tree_rss(pid)
    return None if total is None else round(total / 2**20, 1)


def own_rss_mb() -> float:
    import psutil

    return round(psutil.Process().memory_info().rss / 2**20, 1)


class Chats:
    """`count` threads streaming chat completions until `stop` is set; successes, failures and tokens."""

    def __init__(self, url: str, model: str, count: int, max_tokens: int, timeout: float):
        self.url, self.model, self.count, self.max_tokens, self.timeout = url, model, count, max_tokens, timeout
        self.stop = threading.Event()
        self.lock = threading.Lock()
        self.served = 0
        self.tokens = 0
        self.failures: Counter = Counter()
        self.samples: Dict[str, str] = {}
        self.threads = [threading.Thread(target=self._run, args=(i,), daemon=True) for i in range(count)]

    def _fail(self, kind: str, message: str) -> None:
        with self.lock:
            self.failures[kind] += 1
            self.samples.setdefault(kind, message[:300])

    def _one(self, client, rng: random.Random) -> None:
        import httpx

        body = {"model": self.model, "stream": True, "temperature": 0.7, "seed": rng.randrange(1 << 30),
                "max_tokens": rng.randint(self.max_tokens // 2, self.max_tokens),
                "messages": [{"role": "user", "content": f"Write two sentences about {rng.choice(TOPICS)}."}]}
        tokens, done = 0, False
        try:
            with client.stream("POST", f"{self.url}/v1/chat/completions", json=body) as response:
                if response.status_code != 200:
                    self._fail(f"http_{response.status_code}", response.read().decode(errors="replace"))
                    return
                for line in response.iter_lines():
                    if not line.startswith("data: "):
                        continue
                    data = line[len("data: "):]
                    if data == "[DONE]":
                        done = True
                        break
                    event = json.loads(data)
                    if "error" in event:
                        error = event["error"]
                        self._fail(f"stream_error:{error.get('type') or error.get('code')}", json.dumps(error))
                        return
                    for choice in event.get("choices") or []:
                        if (choice.get("delta") or {}).get("content"):
                            tokens += 1
        except httpx.TimeoutException as e:
            self._fail("timeout", repr(e))
            return
        except httpx.TransportError as e:
            self._fail("connection", repr(e))
            return
        if not done:
            self._fail("truncated", f"the stream ended after {tokens} tokens without [DONE]")
            return
        with self.lock:
            self.served += 1
            self.tokens += tokens

    def _run(self, index: int) -> None:
        import httpx

        rng = random.Random(index)
        with httpx.Client(timeout=self.timeout) as client:
            while not self.stop.is_set():
                self._one(client, rng)

    def __enter__(self) -> "Chats":
        for thread in self.threads:
            thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop.set()
        for thread in self.threads:
            thread.join(timeout=self.timeout + 30)


def kv_held(manager, peers: List[str]) -> Dict[str, dict]:
    """peer id -> {cache_tokens_used, sessions_open} (or the error) from each server's rpc_info."""
    held = {}
    for peer in peers:
        try:
            stats = manager.server_info(peer)
            held[peer] = {"cache_tokens_used": stats.cache_tokens_used, "sessions_open": stats.sessions_open,
                          "streams_open": stats.streams_open}
        except Exception as e:
            held[peer] = {"error": repr(e)[:200]}
    return held


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--minutes", type=float, default=30.0, help="how long the chats run")
    parser.add_argument("--kill_every", type=float, default=5.0, help="minutes between two server kills")
    parser.add_argument("--chats", type=int, default=16, help="concurrent streaming chats")
    parser.add_argument("--max_tokens", type=int, default=32, help="most new tokens per request")
    parser.add_argument("--pool_ttl", type=float, default=20.0, help="the gateway's session-pool TTL (s)")
    parser.add_argument("--request_timeout", type=float, default=300.0, help="httpx timeout per request (s)")
    args = parser.parse_args()

    from harness import BenchSwarm

    from swarm.client.transport.manager import ClientConfig, SwarmManager

    began = time.monotonic()
    with BenchSwarm("bench-soak", SPANS) as swarm:
        gateway = swarm.add_gateway("bench-soak-gateway", extra=["--max_concurrent", str(args.chats),
                                                                "--pool_ttl", str(args.pool_ttl)])
        url = gateway.ready["url"]
        import httpx

        model = httpx.get(f"{url}/v1/models", timeout=60).json()["data"][0]["id"]
        manager = SwarmManager(ClientConfig(initial_peers=swarm.initial_peers), swarm.prefix, 30)
        roles = {"bootstrap": swarm.bootstrap, "gateway": gateway}
        roles.update({f"server{i}[{span}]": proc for i, (span, proc) in enumerate(zip(SPANS, swarm.servers))})
        rss_start = {name: tree_rss_mb(proc.proc.pid) for name, proc in roles.items()}
        rss_start["bench"] = own_rss_mb()  # this process alone (the others are its children)
        kills: List[dict] = []
        load_began = time.monotonic()
        with Chats(url, model, args.chats, args.max_tokens, args.request_timeout) as chats:
            deadline = load_began + args.minutes * 60
            next_kill = load_began + args.kill_every * 60
            victim = 0
            while time.monotonic() < deadline:
                time.sleep(min(5.0, max(0.0, deadline - time.monotonic())))
                if time.monotonic() < next_kill or time.monotonic() >= deadline:
                    continue
                name = [n for n in roles if n.startswith(f"server{victim}[")][0]
                span = name[name.index("[") + 1:-1]
                old = roles[name]
                old.proc.send_signal(signal.SIGKILL)
                old.kill()  # the rest of its process group (DHT child, p2p daemon)
                killed_at = time.monotonic()
                replacement = swarm.add_server(span)
                roles[name] = replacement
                kills.append({"server": name, "at_s": round(killed_at - load_began, 1),
                              "restart_s": round(time.monotonic() - killed_at, 1)})
                victim = (victim + 1) % len(SPANS)
                next_kill = killed_at + args.kill_every * 60
        load_s = time.monotonic() - load_began
        rss_end = {name: tree_rss_mb(proc.proc.pid) for name, proc in roles.items()}
        rss_end["bench"] = own_rss_mb()
        peers = [proc.peer_id for name, proc in roles.items() if name.startswith("server")]
        held_now = kv_held(manager, peers)
        wait_until = time.monotonic() + args.pool_ttl + 60
        held = kv_held(manager, peers)
        while time.monotonic() < wait_until and any(h.get("cache_tokens_used") or h.get("sessions_open")
                                                    or h.get("streams_open") or "error" in h for h in held.values()):
            time.sleep(2)
            held = kv_held(manager, peers)
        manager.shutdown()
        requests = chats.served + sum(chats.failures.values())
        result = {
            "benchmark": "soak",
            "topology": SPANS,
            "minutes": round(load_s / 60, 2),
            "kill_every_minutes": args.kill_every,
            "chats": args.chats,
            "max_tokens": args.max_tokens,
            "requests": requests,
            "requests_served": chats.served,
            "requests_failed": sum(chats.failures.values()),
            "failures_by_kind": dict(chats.failures),
            "failure_samples": chats.samples,
            "tokens_streamed": chats.tokens,
            "tokens_per_s": round(chats.tokens / load_s, 2),
            "kills": kills,
            # sessions the gateway moved to another server mid-request (its log: swarm.client.transport.session)
            "gateway_failovers": gateway.log_path.read_text(errors="replace").count(" re-routed to "),
            "rss_mb_start": rss_start,
            "rss_mb_end": rss_end,
            "kv_right_after_load": held_now,
            "kv_after_pool_ttl": held,
            "kv_tokens_held_after_load": sum(h.get("cache_tokens_used", 0) for h in held.values()),
            "sessions_open_after_load": sum(h.get("sessions_open", 0) for h in held.values()),
            "streams_open_after_load": sum(h.get("streams_open", 0) for h in held.values()),
            "cpu_count": os.cpu_count(),
            "total_s": round(time.monotonic() - began, 1),
        }
        print(json.dumps(result))
        return 0 if result["kv_tokens_held_after_load"] == 0 and result["sessions_open_after_load"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
