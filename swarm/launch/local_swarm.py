"""`swarmgate up`: the private-swarm topology of a YAML file (bootstrap peer, block servers, gateway) as local
processes, for machines without Docker; the same topology as `docker-compose.yml`.

`ManagedProcess` runs one `swarmgate` subcommand with its output in a log file and waits for its
`SWARMGATE_READY {json}` line; `up` starts the bootstrap peer, then the servers (joining the bootstrap), then
the gateway, prints their addresses, and on Ctrl-C / SIGTERM stops them all (SIGTERM, then SIGKILL).
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import List, Optional

from pydantic import BaseModel, ConfigDict, Field

from swarm.runtime.config import ProcessConfig, config_from_argv, parse_span

READY = "SWARMGATE_READY "
REPO = Path(__file__).resolve().parents[2]


class ManagedProcess:
    """A `swarmgate` subcommand in its own process session, logging to a file."""

    def __init__(self, args: List[str], name: str, env: Optional[dict] = None, log_dir: Optional[str] = None):
        self.name = name
        if log_dir:
            Path(log_dir).mkdir(parents=True, exist_ok=True)
            self.log_path = Path(log_dir) / f"{name}.log"
        else:
            self.log_path = Path(tempfile.mkstemp(prefix=f"swarmgate-{name}-", suffix=".log")[1])
        self._log = open(self.log_path, "w")
        full_env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
        self.proc = subprocess.Popen([sys.executable, "-m", "swarm.launch.cli", *args], stdout=self._log,
                                     stderr=subprocess.STDOUT, env=full_env, cwd=REPO, start_new_session=True)
        self.ready: Optional[dict] = None

    def log_tail(self, n: int = 40) -> str:
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])

    def wait_ready(self, timeout: float = 180) -> dict:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for line in self.log_path.read_text(errors="replace").splitlines():
                if line.startswith(READY):
                    self.ready = json.loads(line[len(READY):])
                    return self.ready
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.name} exited with {self.proc.returncode}:\n{self.log_tail()}")
            time.sleep(0.2)
        raise TimeoutError(f"{self.name} not ready after {timeout}s:\n{self.log_tail()}")

    @property
    def peer_id(self) -> str:
        assert self.ready is not None
        return self.ready["peer_id"]

    @property
    def maddr(self) -> str:
        assert self.ready is not None
        return next((m for m in self.ready["maddrs"] if "127.0.0.1" in m), self.ready["maddrs"][0])

    def terminate(self, timeout: float = 30) -> Optional[int]:
        """SIGTERM and wait; then SIGKILL whatever is left of its process group (e.g. a DHT child)."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                pass
        returncode = self.proc.poll()
        self.kill()
        self._log.close()
        return returncode

    def kill(self) -> None:
        """SIGKILL the whole process group (the process, its DHT child and that child's p2p daemon)."""
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            pass


class ServerEntry(BaseModel):
    model_config = ConfigDict(extra="forbid")
    block_indices: Optional[str] = None
    num_blocks: Optional[int] = None
    args: List[str] = Field(default_factory=list, description="extra `swarmgate server` flags")


class GatewayEntry(BaseModel):
    model_config = ConfigDict(extra="forbid")
    enabled: bool = True
    host: str = "127.0.0.1"
    port: int = 8000
    args: List[str] = Field(default_factory=list, description="extra `swarmgate gateway` flags")


class UpConfig(ProcessConfig):
    model: str = Field(default="smollm2-135m-instruct", description="model for all servers and the gateway")
    host: str = Field(default="127.0.0.1", description="address the bootstrap peer and servers listen on")
    dht_port: int = Field(default=31337, ge=0, description="bootstrap peer's TCP port (0: any free port)")
    servers: List[ServerEntry] = Field(default_factory=lambda: [ServerEntry(block_indices="0:15"),
                                                                ServerEntry(block_indices="15:30")],
                                       description="one entry per block server (YAML only)")
    gateway: GatewayEntry = Field(default_factory=GatewayEntry, description="the HTTP gateway (YAML only)")
    log_dir: str = Field(default=".cache/swarmgate-logs", description="where each process writes its log")
    ready_timeout: float = Field(default=600, gt=0, description="seconds to wait for each process to be ready")


def _server_args(config: UpConfig, entry: ServerEntry, peer: str) -> List[str]:
    args = ["server", config.model, "--initial_peers", peer, "--host_maddrs", f"/ip4/{config.host}/tcp/0"]
    if entry.block_indices:
        parse_span(entry.block_indices)
        args += ["--block_indices", entry.block_indices]
    if entry.num_blocks:
        args += ["--num_blocks", str(entry.num_blocks)]
    return args + entry.args


def up(config: UpConfig) -> int:
    from swarm.modeling.prepare import bundled_model_path

    bundled = bundled_model_path(config.model, create=True)  # convert once, before servers race to do it
    if bundled is not None:
        print(f"model: {config.model} -> {bundled}", flush=True)
    procs: List[ManagedProcess] = []
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    try:
        dht = ManagedProcess(["dht", "--host_maddrs", f"/ip4/{config.host}/tcp/{config.dht_port}"], "dht",
                             log_dir=config.log_dir)
        procs.append(dht)
        dht.wait_ready(60)
        peer = dht.maddr
        print(f"bootstrap peer: {peer}", flush=True)
        servers = [ManagedProcess(_server_args(config, entry, peer), f"server{i}", log_dir=config.log_dir)
                   for i, entry in enumerate(config.servers)]
        procs += servers
        for server in servers:
            info = server.wait_ready(config.ready_timeout)
            print(f"server {server.name}: blocks {info['start']}:{info['end']} peer {info['peer_id']}", flush=True)
        if config.gateway.enabled:
            gateway = ManagedProcess(["gateway", config.model, "--initial_peers", peer, "--host", config.gateway.host,
                                      "--port", str(config.gateway.port), *config.gateway.args], "gateway",
                                     log_dir=config.log_dir)
            procs.append(gateway)
            info = gateway.wait_ready(config.ready_timeout)
            print(f"gateway: {info.get('url')}/v1  (OpenAI-compatible; try {info.get('url')}/health)", flush=True)
        print(f"logs in {config.log_dir}/. Press Ctrl-C to stop.", flush=True)
        while not stop.is_set():
            for p in procs:
                if p.proc.poll() is not None:
                    print(f"{p.name} exited with {p.proc.returncode}; stopping. Its log:\n{p.log_tail()}", flush=True)
                    return 1
            stop.wait(1.0)
        return 0
    except (RuntimeError, TimeoutError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr, flush=True)
        return 1
    finally:
        for p in reversed(procs):
            p.terminate()
        print("stopped all processes", flush=True)


def main(argv=None) -> int:
    config = config_from_argv(UpConfig, argv, "swarmgate up",
                              "Start a local swarm (bootstrap, servers, gateway) and keep it up.",
                              yaml_only=("servers", "gateway"))
    return up(config)
