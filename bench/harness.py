"""The private swarm a benchmark runs on: a `launch.topology.Topology` (bootstrap peer, block servers,
optionally a gateway, one intra-op thread each) and a direct client model, stopped (client first, then the
processes, last started first) on exit.

    with BenchSwarm("bench-gw", ["0:15", "15:30"]) as swarm:
        url = swarm.start_gateway("bench-gateway").ready["url"]
        model = swarm.client_model()

`Clock` is the streamer every benchmark times generation steps with; `cpu_seconds` the CPU time of a process (and
its descendants: a server's DHT child and p2pd) that the benchmarks measuring CPU per token read; `tree_rss` the
resident memory of a process and its descendants; `tiny_checkpoint` the tiny random Llama (hidden 64, 4 blocks, the
bundled tokenizer) that the overhead benchmarks run on, where compute is nearly nothing.
"""
from __future__ import annotations

import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable, List, Optional, Sequence, Tuple

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import psutil  # noqa: E402

from launch.topology import ManagedProcess, Topology  # noqa: E402


class Clock:
    """A `generate` streamer that notes when each chunk of tokens comes out (the first `put` is the prompt);
    `on_token(index)` is called after each, e.g. to stop a run from outside."""

    def __init__(self, on_token: Optional[Callable[[int], None]] = None):
        self.times: List[float] = []
        self.on_token = on_token

    def put(self, value) -> None:
        self.times.append(time.perf_counter())
        if self.on_token is not None:
            self.on_token(len(self.times) - 1)

    def end(self) -> None:
        pass


class BenchSwarm(Topology):
    def __init__(self, name: str, spans: Sequence[str], server_args: Sequence[str] = (), threads: Optional[int] = 1):
        """`threads`: intra-op threads of each process (None: all cores, as `swarmgate up` runs them; with the
        processes taking CPU turns, each pass then has every core, as local transformers does)."""
        from swarm.modeling.prepare import prepare_model

        self.path = str(prepare_model())
        super().__init__(self.path, spans, f"{name}-{os.getpid()}", server_args, name=name, threads=threads)
        self.client = None

    def start_gateway(self, name: str) -> ManagedProcess:
        """A gateway process on a free port (one torch thread); its URL is `.ready["url"]`."""
        return self.add_gateway(name)

    def client_model(self):
        """The direct client model (in this process) on this swarm."""
        from swarm import AutoDistributedModelForCausalLM

        self.client = AutoDistributedModelForCausalLM.from_pretrained(self.path, initial_peers=self.initial_peers,
                                                                     dht_prefix=self.prefix)
        return self.client

    def close(self) -> None:
        if self.client is not None:
            self.client.shutdown()
            self.client = None
        super().close()


def _sum_over(pid: int, tree: bool, read: Callable[[psutil.Process], float]) -> Optional[float]:
    """`read` summed over process `pid` and (`tree`) its descendants; a member that exits meanwhile counts no more,
    a process already gone None."""
    try:
        root = psutil.Process(pid)
        members = [root, *root.children(recursive=True)] if tree else [root]
    except psutil.Error:
        return None
    total = 0.0
    for member in members:
        try:
            total += read(member)
        except psutil.Error:
            pass
    return total


def cpu_seconds(pid: int, tree: bool = False) -> float:
    """User + system CPU seconds of process `pid` and (`tree`) its descendants; a process already gone 0."""
    def used(member: psutil.Process) -> float:
        times = member.cpu_times()
        return times.user + times.system

    return _sum_over(pid, tree, used) or 0.0


def tree_rss(pid: int) -> Optional[float]:
    """Resident bytes of process `pid` and its descendants (None: it is gone)."""
    return _sum_over(pid, True, lambda member: float(member.memory_info().rss))


def tiny_checkpoint(tag: str) -> Tuple[Path, Path]:
    """(a new temporary directory named after `tag`, the tiny random Llama saved in it)."""
    from swarm.modeling.prepare import prepare_model
    from tests.fixtures.tiny_checkpoints import save_tiny

    work = Path(tempfile.mkdtemp(prefix=f"bench-{tag}-"))
    path = work / "tiny-llama"
    save_tiny("llama", path, str(prepare_model("smollm2-135m-instruct")))  # hidden 64, 4 blocks
    return work, path
