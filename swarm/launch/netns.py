"""A lab of hosts for tests and benchmarks: one Linux network namespace per host, joined by veth pairs to a bridge.

`NetLab` (a context manager) makes a bridge in the root namespace with the address `.254` of a private /24
(so that the test process can reach every host), and `add_host(name)` a namespace with loopback up and one
interface `eth0` at the next address. `host.wrap` is the command prefix that runs a process in it
(`ip netns exec NS`, see `swarm.launch.topology`); `lab.cut(host)` takes the host's link down on the bridge
side, like pulling its cable (no RST reaches anyone), and `lab.mend(host)` brings it back. `close()` removes
every namespace and the bridge, also after a failure half-way. Needs root and `ip`; `NetLab.unavailable()`
says why not, for a skip.
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
    def __init__(self, tag: Optional[str] = None):
        self.tag = tag or f"{os.getpid() % 10000:04d}{random.randrange(36 ** 2):02x}"[:6]
        self.subnet = f"10.{random.randrange(200, 250)}.{random.randrange(1, 250)}"
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

    def close(self) -> None:
        for host in self.hosts:
            ip("netns", "del", host.netns, check=False)  # takes its end of the veth pair, and so the pair, along
            ip("link", "del", host.link, check=False)
        self.hosts.clear()
        if self._bridge_up:
            ip("link", "del", self.bridge, check=False)
            self._bridge_up = False
