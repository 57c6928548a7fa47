"""A lab of hosts for tests and benchmarks: one Linux network namespace per host, joined by veth pairs to a bridge.

`NetLab` (a context manager) makes a bridge in the root namespace with the address `.254` of a private /24 (a
public-looking one with `public=True`, for libp2p's relays)
(so that the test process can reach every host), and `add_host(name)` a namespace with loopback up and one
interface `eth0` at the next address. `host.wrap` is the command prefix that runs a process in it
(`ip netns exec NS`, see `launch.topology`); `lab.cut(host)` takes the host's link down on the bridge
side, like pulling its cable (no RST reaches anyone), and `lab.mend(host)` brings it back;
`lab.refuse_inbound(host)` puts it behind a NAT (it connects out, nobody connects in: a `tc` filter drops incoming
SYNs). `close()` removes every namespace and the bridge, also after a failure half-way. Needs root and `ip`;
`NetLab.unavailable()` says why not, for a skip.
"""
from __future__ import annotations

import os
import random
import shutil
import subprocess
from dataclasses import dataclass, field
from typing import List, Optional


def ip(*args: str, netns: Optional[str] = None, check: bool = True) -> subprocess.CompletedProcess:
    command = ["ip", *(["netns", "exec", netns, "ip"] if netns else []), *args]
    result = subprocess.run(command, capture_output=True, text=True, timeout=30)
    if check and result.returncode != 0:
        raise RuntimeError(f"{' '.join(command)} failed: {result.stderr.strip()}")
    return result


@dataclass
class Host:
    name: str
    netns: str
    address: str
    link: str  # the bridge-side end of its veth pair
    wrap: List[str] = field(default_factory=list)


class NetLab:
    def __init__(self, tag: Optional[str] = None, public: bool = False):
        self.tag = tag or f"{os.getpid() % 10000:04d}{random.randrange(36 ** 2):02x}"[:6]
        # `public`: addresses outside the private ranges, since libp2p relays (and announces relay circuits) only
        # for peers with public addresses; 11.0.0.0/8 is not routed from these isolated namespaces anywhere real
        # (only the root namespace gets a route to the lab's /24, while the lab exists)
        self.subnet = f"{11 if public else 10}.{random.randrange(200, 250)}.{random.randrange(1, 250)}"
        self.bridge = f"sgbr{self.tag}"
        self.hosts: List[Host] = []
        self._bridge_up = False

    @staticmethod
    def unavailable() -> Optional[str]:
        """Why namespaces cannot be used here (None when they can): a probe namespace is made and removed."""
        if shutil.which("ip") is None:
            return "the `ip` command (iproute2) is not installed"
        if os.geteuid() != 0:
            return "network namespaces need root (ip netns add)"
        probe = f"sgprobe{os.getpid()}"
        made = ip("netns", "add", probe, check=False)
        if made.returncode != 0:
            return f"network namespaces are not permitted here: {made.stderr.strip()}"
        ip("netns", "del", probe, check=False)
        return None

    def __enter__(self) -> "NetLab":
        try:
            ip("link", "add", self.bridge, "type", "bridge")
            self._bridge_up = True
            ip("addr", "add", f"{self.subnet}.254/24", "dev", self.bridge)
            ip("link", "set", self.bridge, "up")
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def add_host(self, name: str) -> Host:
        index = len(self.hosts) + 1
        host = Host(name, f"sg{self.tag}-{name}", f"{self.subnet}.{index}", f"sgv{self.tag}{index}")
        host.wrap = ["ip", "netns", "exec", host.netns]
        self.hosts.append(host)  # registered first: close() removes whatever part of it exists
        ip("netns", "add", host.netns)
        ip("link", "add", host.link, "type", "veth", "peer", "name", f"sgp{self.tag}{index}")
        ip("link", "set", f"sgp{self.tag}{index}", "netns", host.netns)
        ip("link", "set", host.link, "master", self.bridge)
        ip("link", "set", host.link, "up")
        ip("link", "set", "lo", "up", netns=host.netns)
        ip("link", "set", f"sgp{self.tag}{index}", "name", "eth0", netns=host.netns)
        ip("addr", "add", f"{host.address}/24", "dev", "eth0", netns=host.netns)
        ip("link", "set", "eth0", "up", netns=host.netns)
        return host

    def cut(self, host: Host) -> None:
        ip("link", "set", host.link, "down")

    def mend(self, host: Host) -> None:
        ip("link", "set", host.link, "up")

    def refuse_inbound(self, host: Host) -> None:
        """Make `host` a machine behind a NAT: it opens TCP connections to anyone, nobody can open one to it. A
        `tc` filter on its eth0 takes every incoming SYN without ACK away (silently, like a home router): it is
        redirected to a veth end whose peer is down, where the kernel drops it (`act_mirred` is the tc action
        this machine's kernel has; `gact drop` may be missing)."""
        sink, peer = "sgsink0", "sgsink1"  # inside the host's namespace: removed with it
        ip("link", "add", sink, "type", "veth", "peer", "name", peer, netns=host.netns)
        ip("link", "set", sink, "up", netns=host.netns)  # the peer stays down: what reaches it is dropped
        tc = ["ip", "netns", "exec", host.netns, "tc"]
        for args in (["qdisc", "add", "dev", "eth0", "ingress"],
                     # IPv4 with a 20-byte header, TCP, flags & (SYN|ACK) == SYN (the TCP flags are byte 33)
                     ["filter", "add", "dev", "eth0", "parent", "ffff:", "protocol", "ip", "prio", "1", "u32",
                      "match", "u8", "0x45", "0xff", "at", "0", "match", "ip", "protocol", "6", "0xff",
                      "match", "u8", "0x02", "0x12", "at", "33", "action", "mirred", "egress", "redirect",
                      "dev", sink]):
            result = subprocess.run(tc + args, capture_output=True, text=True, timeout=30)
            if result.returncode != 0:
                raise RuntimeError(f"tc {' '.join(args)} failed: {result.stderr.strip()}")

    def close(self) -> None:
        for host in self.hosts:
            ip("netns", "del", host.netns, check=False)  # takes its end of the veth pair, and so the pair, along
            ip("link", "del", host.link, check=False)
        self.hosts.clear()
        if self._bridge_up:
            ip("link", "del", self.bridge, check=False)
            self._bridge_up = False
