"""Machine-wide turns for CPU tensor work: swarmgate processes on one machine compute one at a time.

Servers and clients that share a machine (a private swarm on one host, a gateway next to its server) would
otherwise compute at the same time under concurrent sessions, each with an OpenMP team sized for all cores: a
team whose worker shares a core with another busy process waits at every barrier for a descheduled thread, and
a step can take ten times as long. With turns, each pass (a batch of decode steps, a prefill chunk, a head) runs
alone with all threads; a lone session's chain loses nothing, as its processes take turns anyway.

`CpuTurns` is an exclusive `flock` on a file named after the user, in the temporary directory: held only while a
compute thread runs one task, released by the kernel if the process dies. CUDA work does not take turns, nor does a
process with one intra-op thread (`turns_for`): its passes have no team to wait at barriers, and turns would only
keep two such processes (a chain's servers, a test's or benchmark's one-thread swarm) off each other's idle core.
`SWARMGATE_CPU_TURNS=0` turns it off for a process (for example on a machine whose other swarmgate processes
must not be waited for). `SWARMGATE_CPU_TURNS_DOMAIN=NAME` keeps a process's turns among the processes of the same
domain only (its own lock file): swarms on one machine that should not wait for each other, such as the test
suite's parallel workers (each worker's processes take turns among themselves; tests/conftest.py).
"""
from __future__ import annotations

import fcntl
import os
import tempfile
from typing import Optional

ENV = "SWARMGATE_CPU_TURNS"
DOMAIN_ENV = "SWARMGATE_CPU_TURNS_DOMAIN"


class CpuTurns:
    def __init__(self, path: Optional[str] = None):
        self.path = path or default_path()
        self._fd: Optional[int] = None
        self.turns = 0

    def __enter__(self) -> "CpuTurns":
        if self._fd is None:
            self._fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o600)
        fcntl.flock(self._fd, fcntl.LOCK_EX)
        self.turns += 1
        return self

    def __exit__(self, *exc) -> None:
        assert self._fd is not None, "CpuTurns exited without entering"
        fcntl.flock(self._fd, fcntl.LOCK_UN)

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


def default_path() -> str:
    """The lock file of this user's turns, in `SWARMGATE_CPU_TURNS_DOMAIN`'s domain when set."""
    domain = "".join(c for c in os.environ.get(DOMAIN_ENV, "") if c.isalnum() or c in "-_")
    suffix = f"-{domain}" if domain else ""
    return os.path.join(tempfile.gettempdir(), f"swarmgate-cpu-{os.getuid()}{suffix}.lock")


def turns_for(device_type: str = "cpu", threads: Optional[int] = None) -> Optional[CpuTurns]:
    """The turns a compute thread takes for its tasks on `device_type` with `threads` intra-op threads (default:
    torch's count now), or None: not on CUDA, not with one thread, not when `SWARMGATE_CPU_TURNS` is off."""
    if device_type != "cpu" or not cpu_turns_enabled():
        return None
    if threads is None:
        import torch

        threads = torch.get_num_threads()
    return CpuTurns() if threads > 1 else None


def cpu_turns_enabled() -> bool:
    return os.environ.get(ENV, "1").strip().lower() not in ("0", "false", "no", "off")
