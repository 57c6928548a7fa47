"""The private swarm a benchmark runs on: a bootstrap peer, block servers, optionally a gateway and a direct
client model, all started here and stopped (client first, then the processes in reverse order) on exit.

    with BenchSwarm("bench-gw", ["0:15", "15:30"]) as swarm:
        url = swarm.start_gateway("bench-gateway")
        model = swarm.client_model()
"""
from __future__ import annotations

import os
import sys
from typing import List, Optional, Sequence

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from tests.procs import SwarmProcess, start_bootstrap, start_servers  # noqa: E402


class BenchSwarm:
    def __init__(self, name: str, spans: Sequence[str], server_args: Sequence[str] = ()):
        from swarm.modeling.prepare import prepare_model

        self.path = str(prepare_model())
        self.prefix = f"{name}-{os.getpid()}"
        self.spans, self.server_args = list(spans), list(server_args)
        self.procs: List[SwarmProcess] = []
        self.servers: List[SwarmProcess] = []
        self.model = None

    def __enter__(self) -> "BenchSwarm":
        try:
            self.bootstrap = start_bootstrap()
            self.procs.append(self.bootstrap)
            self.servers = start_servers(self.path, self.bootstrap.maddr, self.spans, self.prefix, self.server_args)
            self.procs.extend(self.servers)
        except BaseException:
            self.__exit__()
            raise
        return self

    def start_gateway(self, name: str) -> SwarmProcess:
        """A gateway process on a free port (one torch thread); its URL is `.ready["url"]`."""
        gateway = SwarmProcess(["gateway", self.path, "--initial_peers", self.bootstrap.maddr, "--dht_prefix",
                                self.prefix, "--port", "0", "--num_threads", "1"], name)
        self.procs.append(gateway)
        gateway.wait_ready(180)
        return gateway

    def client_model(self):
        """The direct client model (in this process) on this swarm."""
        from swarm import AutoDistributedModelForCausalLM

        self.model = AutoDistributedModelForCausalLM.from_pretrained(
            self.path, initial_peers=[self.bootstrap.maddr], dht_prefix=self.prefix)
        return self.model

    def __exit__(self, *exc) -> Optional[bool]:
        if self.model is not None:
            self.model.shutdown()
        for proc in reversed(self.procs):
            proc.terminate()
        return None
