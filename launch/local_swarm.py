"""`swarmgate up`: the private-swarm topology of a YAML file (bootstrap peer, block servers, gateway) as local
processes, for machines without Docker; the same topology as `docker-compose.yml`.

This module is the YAML config and the CLI glue; the processes are started by `launch.topology`. `up`
starts the bootstrap peer, then the servers (joining the bootstrap), then the gateway, prints their addresses,
and on Ctrl-C / SIGTERM (or when one of them exits) stops them all within seconds (SIGTERM, then SIGKILL;
a second Ctrl-C kills them at once).
"""
from __future__ import annotations

import sys
import threading
from typing import List, Optional

from pydantic import BaseModel, ConfigDict, Field

from launch.topology import Topology
from swarm.runtime import lifecycle
from swarm.runtime.config import ProcessConfig, config_from_argv, parse_span


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


def _server_extra(entry: ServerEntry) -> List[str]:
    if entry.block_indices:
        parse_span(entry.block_indices)
    return (["--num_blocks", str(entry.num_blocks)] if entry.num_blocks else []) + entry.args


def up(config: UpConfig) -> int:
    from swarm.modeling.prepare import bundled_model_path

    bundled = bundled_model_path(config.model, create=True)  # convert once, before servers race to do it
    if bundled is not None:
        print(f"model: {config.model} -> {bundled}", flush=True)
    stop = threading.Event()
    lifecycle.on_stop_signals(stop.set)  # a second Ctrl-C kills everything at once
    swarm = Topology(config.model, name="", host=config.host, dht_port=config.dht_port, log_dir=config.log_dir,
                     ready_timeout=config.ready_timeout)
    try:
        swarm.start()
        print(f"bootstrap peer: {swarm.initial_peers[0]}", flush=True)
        servers = [swarm.add_server(entry.block_indices, _server_extra(entry), name=f"server{i}", wait=False)
                   for i, entry in enumerate(config.servers)]
        for server in servers:
            info = server.wait_ready(config.ready_timeout)
            print(f"server {server.name}: blocks {info['start']}:{info['end']} peer {info['peer_id']}", flush=True)
        if config.gateway.enabled:
            gateway = swarm.add_gateway("gateway", config.gateway.args, host=config.gateway.host,
                                        port=config.gateway.port)
            url = (gateway.ready or {}).get("url")
            print(f"gateway: {url}/v1  (OpenAI-compatible; try {url}/health)", flush=True)
        print(f"logs in {config.log_dir}/. Press Ctrl-C to stop.", flush=True)
        while not stop.is_set():
            exited = swarm.exited()
            if exited is not None:
                print(f"{exited.name} exited with {exited.proc.returncode}; stopping. Its log:\n{exited.log_tail()}",
                      flush=True)
                return 1
            stop.wait(1.0)
        return 0
    except (RuntimeError, TimeoutError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr, flush=True)
        return 1
    finally:
        swarm.close()
        print("stopped all processes", flush=True)


def main(argv=None) -> int:
    config = config_from_argv(UpConfig, argv, "swarmgate up",
                              "Start a local swarm (bootstrap, servers, gateway) and keep it up.",
                              yaml_only=("servers", "gateway"))
    return up(config)
