"""The latency lab: a local swarm whose peers talk over emulated wide-area links, with real TCP traffic.

Every peer (the bootstrap peer `dht`, each server `s0`, `s1`, ...) runs in its own network namespace
(`launch.netns`) and listens on `127.0.0.1:PEER_PORT` *inside* it, where nothing outside the namespace can
reach it. The only way in is its relay (`launch.relay`), which runs in the same namespace on the host's
bridge address `ADDR:RELAY_PORT`; the peer announces that address (`--announce_maddrs`) and nothing else, so
libp2p's identify and DHT hand out only relay addresses, and a direct connection that bypasses the delay cannot
happen (there is no route to the listener). The client side (this process's client model, and gateways started
with `add_gateway`) stays in the root namespace, named `CLIENT`; its p2p daemon listens on loopback only, and it
reaches the peers through their relays from the bridge address `.254`.

A relay delays each connection by the link between its peer and the connecting side, which it tells by source
address, both ways: so every link is pairwise (`links={("client", "s1"): 50}`, one-way ms; others get
`latency_ms`). A connection is shared by both directions of a peer pair, so links are symmetric. `set_links`
changes them on a running swarm (the relays re-read their tables; the DHT records' measured pings refresh with
the servers' `--update_period`).

    with LatencyLab(model_path, ["0:15", "15:30"], latency_ms=25) as lab:
        model = AutoDistributedModelForCausalLM.from_pretrained(model_path, initial_peers=lab.initial_peers,
                                                                 dht_prefix=lab.prefix)

By hand: `swarmgate lab --spans 0:15 15:30 --latency_ms 25 --links client-s1=50` (root; `LabConfig`) keeps one
up and prints its `--initial_peers` until Ctrl-C.
"""
from __future__ import annotations

import json
import math
import os
import signal
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Dict, List, Mapping, Optional, Sequence, Tuple

from pydantic import Field, field_validator, model_validator

from launch.netns import Host, NetLab
from launch.relay import RELOADED, LinkTable
from launch.topology import ManagedProcess, start_gateway, start_server, terminate_all, thread_env, wait_all
from swarm.runtime import lifecycle
from swarm.runtime.config import ProcessConfig, config_from_argv, parse_span

CLIENT = "client"  # the root namespace: this process and gateways
RELAY_PORT = 4000  # each peer's relay, on its host's bridge address
PEER_PORT = 4001  # each peer, on 127.0.0.1 in its namespace
LinkSpec = Mapping[Tuple[str, str], float]


class LatencyLab:
    """A bootstrap peer and one server per span, each behind its own delaying relay in its own namespace."""

    def __init__(self, model: str, spans: Sequence[str] = (), latency_ms: float = 0.0, links: Optional[LinkSpec] = None,
                 *, jitter_ms: float = 0.0, bandwidth: Optional[float] = None, prefix: Optional[str] = None,
                 server_args: Sequence[str] = (), threads: Optional[int] = 1, log_dir: Optional[str] = None,
                 ready_timeout: float = 300, public: bool = False):
        self.model, self.spans, self.server_args = model, list(spans), list(server_args)
        self.prefix = prefix or f"lab{os.getpid()}"
        self.threads, self.ready_timeout = threads, ready_timeout
        self.log_dir = log_dir or tempfile.mkdtemp(prefix="swarmgate-lab-")
        self.latency_ms, self.links = latency_ms, self._normalized(links or {})
        self.jitter_ms, self.bandwidth = jitter_ms, bandwidth
        self.net = NetLab(public=public)  # public-looking addresses: needed for libp2p relays (`add_server(home=)`)
        self.hosts: Dict[str, Host] = {}
        self.relays: Dict[str, ManagedProcess] = {}
        self.peers: Dict[str, ManagedProcess] = {}  # name -> bootstrap peer or server
        self.gateways: List[ManagedProcess] = []
        self._version = 1

    @staticmethod
    def unavailable() -> Optional[str]:
        """Why the lab cannot run here (None when it can)."""
        return NetLab.unavailable()

    @staticmethod
    def _normalized(links: LinkSpec) -> Dict[frozenset, float]:
        return {frozenset(pair): float(ms) for pair, ms in links.items()}

    # ---- links ------------------------------------------------------------------------------------------------
    def link_ms(self, a: str, b: str) -> float:
        """The one-way latency (ms) between peers `a` and `b` (`CLIENT`: the root namespace)."""
        return self.links.get(frozenset((a, b)), self.latency_ms)

    def address(self, name: str) -> str:
        return f"{self.net.subnet}.254" if name == CLIENT else self.hosts[name].address

    def _table(self, name: str) -> LinkTable:
        others = [CLIENT, *(n for n in self.hosts if n != name)]
        return LinkTable(version=self._version, delays={self.address(o): self.link_ms(name, o) / 1000 for o in others},
                         default=self.latency_ms / 1000, jitter=self.jitter_ms / 1000, bandwidth=self.bandwidth)

    def _table_path(self, name: str) -> str:
        return os.path.join(self.log_dir, f"links-{name}.json")

    def _write_table(self, name: str) -> None:
        tmp = self._table_path(name) + ".tmp"
        Path(tmp).write_text(self._table(name).model_dump_json())
        os.replace(tmp, self._table_path(name))

    def set_links(self, latency_ms: Optional[float] = None, links: Optional[LinkSpec] = None,
                  timeout: float = 10) -> None:
        """New latencies for a running lab (`links` replaces the pairwise ones); returns once every relay uses
        them (new chunks; those in flight keep their release time)."""
        if latency_ms is not None:
            self.latency_ms = latency_ms
        if links is not None:
            self.links = self._normalized(links)
        self._version += 1
        for name, relay in self.relays.items():
            self._write_table(name)
            relay.signal(signal.SIGHUP)
        deadline = time.monotonic() + timeout
        for name, relay in self.relays.items():
            while f"{RELOADED}{self._version}" not in relay.log_path.read_text(errors="replace"):
                if time.monotonic() > deadline:
                    raise TimeoutError(f"relay of {name} did not reload its links:\n{relay.log_tail()}")
                time.sleep(0.05)

    # ---- processes --------------------------------------------------------------------------------------------
    def _add_host(self, name: str) -> Host:
        """A namespace and the relay in front of its peer (started, ready)."""
        host = self.hosts[name] = self.net.add_host(name)
        self._write_table(name)
        relay = ManagedProcess(["--listen", f"{host.address}:{RELAY_PORT}", "--target", f"127.0.0.1:{PEER_PORT}",
                                "--links", self._table_path(name)], f"relay-{name}", log_dir=self.log_dir,
                               module="launch.relay", wrap=host.wrap)
        self.relays[name] = relay
        relay.wait_ready(60)
        for other in self.hosts:  # the others' tables gain this host's address
            if other != name:
                self._write_table(other)
                self.relays[other].signal(signal.SIGHUP)
        return host

    def announce(self, name: str) -> List[str]:
        return ["--announce_maddrs", f"/ip4/{self.address(name)}/tcp/{RELAY_PORT}"]

    def maddr(self, name: str) -> str:
        """The multiaddr others reach peer `name` at (through its relay)."""
        return f"/ip4/{self.address(name)}/tcp/{RELAY_PORT}/p2p/{self.peers[name].peer_id}"

    @property
    def initial_peers(self) -> List[str]:
        return [self.maddr("dht")]

    @property
    def servers(self) -> List[ManagedProcess]:
        return [p for name, p in self.peers.items() if name != "dht"]

    def start(self) -> "LatencyLab":
        self.net.__enter__()
        host = self._add_host("dht")
        self.peers["dht"] = ManagedProcess(["dht", "--host_maddrs", f"/ip4/127.0.0.1/tcp/{PEER_PORT}",
                                            *self.announce("dht")], "dht", env=thread_env(self.threads),
                                           log_dir=self.log_dir, wrap=host.wrap)
        wait_all([self.peers["dht"]], 60)
        if self.spans:
            self.add_servers(self.spans)
        return self

    def add_server(self, span: Optional[str], extra: Sequence[str] = (), name: Optional[str] = None,
                   wait: bool = True, home: bool = False) -> ManagedProcess:
        """A server in a new namespace `name` (default `s<index>`), behind its own relay. `home`: a server behind
        a NAT instead: it announces no address (its delaying relay is never dialed), so the dial-back check fails
        and it serves through a libp2p relay (the bootstrap peer `dht`: needs `public=True`); its traffic then
        crosses two delayed links, its own to `dht` and the other side's."""
        name = name or f"s{len(self.servers)}"
        host = self._add_host(name)
        proc = start_server(self.model, self.initial_peers, span, self.prefix,
                            [*self.server_args, *extra, *([] if home else self.announce(name))], name=name,
                            threads=self.threads, log_dir=self.log_dir, wrap=host.wrap, port=PEER_PORT)
        self.peers[name] = proc
        if wait:
            proc.wait_ready(self.ready_timeout)
        return proc

    def add_servers(self, spans: Sequence[Optional[str]], extra: Sequence[str] = ()) -> List[ManagedProcess]:
        procs = [self.add_server(span, extra, wait=False) for span in spans]
        for proc in procs:
            proc.wait_ready(self.ready_timeout)
        return procs

    def add_gateway(self, extra: Sequence[str] = (), name: Optional[str] = None) -> ManagedProcess:
        """A gateway on the client side (root namespace, loopback), ready; its URL is `.ready["url"]`."""
        proc = start_gateway(self.model, self.initial_peers, self.prefix, extra,
                             name=name or f"gateway{len(self.gateways)}", threads=self.threads,
                             log_dir=self.log_dir, timeout=None)
        self.gateways.append(proc)
        wait_all([proc], self.ready_timeout)
        return proc

    def name_of(self, peer_id: str) -> Optional[str]:
        return next((name for name, p in self.peers.items() if p.ready and p.peer_id == peer_id), None)

    def close(self) -> None:
        """Stop gateways and servers, then the bootstrap peer and the relays; remove the namespaces."""
        procs = [*self.gateways, *self.servers]
        for stage in (procs, [p for n, p in self.peers.items() if n == "dht"], list(self.relays.values())):
            terminate_all(stage, 8)
        self.net.close()

    def __enter__(self) -> "LatencyLab":
        try:
            return self.start()
        except BaseException:
            self.close()
            raise

    def __exit__(self, *exc) -> None:
        self.close()


def parse_link(text: str) -> Tuple[Tuple[str, str], float]:
    """'A-B=MS' (e.g. 'client-s1=50') -> (("client", "s1"), 50.0); ValueError with a readable message otherwise."""
    pair, _, ms = text.partition("=")
    a, _, b = pair.partition("-")
    try:
        value = float(ms)
    except ValueError:
        value = -1.0
    if not (a and b) or not math.isfinite(value) or value < 0:  # (nan, inf: a link that never delivers)
        raise ValueError(f"expected A-B=MS with a finite MS >= 0 (e.g. client-s1=50), got {text!r}")
    return (a, b), value


class LabConfig(ProcessConfig):
    model: Optional[str] = Field(default=None, description="model for the servers (default: the bundled one)")
    spans: List[str] = Field(default_factory=lambda: ["0:15", "15:30"], description="one server (s0, s1, ...) per "
                                                                                    "span start:end")
    latency_ms: float = Field(default=25.0, ge=0, allow_inf_nan=False,
                              description="one-way latency of every link (ms)")
    links: List[str] = Field(default_factory=list, description="links with their own latency, A-B=MS (peers: "
                                                               "client, dht, s0, s1, ...), e.g. client-s1=50")
    jitter_ms: float = Field(default=0.0, ge=0, allow_inf_nan=False,
                             description="uniform +- jitter per chunk (ms); bytes stay in order")
    bandwidth: Optional[float] = Field(default=None, gt=0, description="cap in bytes/s per direction of a connection")
    gateway: bool = Field(default=False, description="also start a gateway on the client side (loopback)")
    log_dir: Optional[str] = Field(default=None, description="where the processes' logs and link tables go "
                                                             "(default: a new temporary directory)")

    @field_validator("spans")
    @classmethod
    def _spans(cls, value: List[str]) -> List[str]:
        for span in value:
            parse_span(span)
        return value

    @field_validator("links")
    @classmethod
    def _links(cls, value: List[str]) -> List[str]:
        for link in value:
            parse_link(link)
        return value

    @model_validator(mode="after")
    def _link_peers(self) -> "LabConfig":
        peers = {"client", "dht"} | {f"s{i}" for i in range(len(self.spans))}
        for link in self.links:
            unknown = sorted(set(parse_link(link)[0]) - peers)
            if unknown:
                raise ValueError(f"link {link!r} names {', '.join(unknown)}: the peers are {', '.join(sorted(peers))}")
        return self


def main(argv=None) -> int:
    config = config_from_argv(LabConfig, argv, "swarmgate lab",
                              "Keep a local swarm up whose links have a wide-area latency: each peer in its own "
                              "network namespace behind a delaying relay (needs root).")
    why = LatencyLab.unavailable()
    if why:
        print(f"error: {why}", file=sys.stderr)
        return 1
    from swarm.modeling.prepare import prepare_model

    model = config.model or str(prepare_model())
    stop = threading.Event()
    lifecycle.on_stop_signals(stop.set)
    with LatencyLab(model, config.spans, config.latency_ms, dict(map(parse_link, config.links)),
                    jitter_ms=config.jitter_ms, bandwidth=config.bandwidth, threads=None,
                    log_dir=config.log_dir) as lab:
        gateway = (lab.add_gateway().ready or {}).get("url") if config.gateway else None
        print(json.dumps({"initial_peers": lab.initial_peers, "dht_prefix": lab.prefix, "logs": lab.log_dir,
                          "peers": {n: {"address": lab.address(n), "peer_id": p.peer_id} for n, p in lab.peers.items()},
                          "gateway": gateway}), flush=True)
        print(f"join with: --initial_peers {lab.initial_peers[0]} --dht_prefix {lab.prefix}. Ctrl-C stops it.",
              flush=True)
        stop.wait()
    return 0


if __name__ == "__main__":
    sys.exit(main())
