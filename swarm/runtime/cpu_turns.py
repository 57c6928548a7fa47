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

A task waits for its turn at most `SWARMGATE_CPU_TURN_WAIT` seconds (default 30): a holder that is stopped or frozen
(SIGSTOP, a debugger, a host that hangs) would otherwise stop the compute of every other such process on the
machine. The task then runs without a turn, and so do the process's next tasks, at once, until the holder lets go
(a waiter thread keeps waiting for it and gives the turn back as soon as it gets it); turns are for speed only, so
nothing is wrong meanwhile but the sharing of cores.
"""
from __future__ import annotations

import fcntl
import logging
import os
import queue
import tempfile
import threading
from typing import Optional

ENV = "SWARMGATE_CPU_TURNS"
DOMAIN_ENV = "SWARMGATE_CPU_TURNS_DOMAIN"
WAIT_ENV = "SWARMGATE_CPU_TURN_WAIT"
DEFAULT_WAIT_S = 30.0

logger = logging.getLogger(__name__)


class _Request:
    """One task's wait for the turn, handed to the waiter thread."""

    def __init__(self) -> None:
        self.granted = threading.Event()
        self.abandoned = False  # the task gave up waiting (under `CpuTurns._guard`)


class CpuTurns:
    """The machine-wide turn of one process's compute thread (`with turns:` around each task; one thread enters)."""

    def __init__(self, path: Optional[str] = None, wait: Optional[float] = None):
        self.path = path or default_path()
        self.wait = turn_wait() if wait is None else wait
        self._fd: Optional[int] = None
        self.turns = 0  # tasks run under the turn
        self.skipped = 0  # tasks run without it: the holder did not let go within `wait`
        self._held = False
        self._guard = threading.Lock()
        self._stuck = False  # the waiter thread still waits for a turn a task gave up on
        self._requests: "queue.Queue[_Request]" = queue.Queue()
        self._waiter: Optional[threading.Thread] = None

    def __enter__(self) -> "CpuTurns":
        if self._fd is None:
            self._fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o600)
        with self._guard:
            stuck = self._stuck
        if stuck:  # the holder has not let go since a task gave up on it: no waiting again
            self.skipped += 1
            return self
        try:
            fcntl.flock(self._fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            if not self._wait_for_turn():
                self.skipped += 1
                return self
        self._held = True
        self.turns += 1
        return self

    def __exit__(self, *exc) -> None:
        assert self._fd is not None, "CpuTurns exited without entering"
        if self._held:
            self._held = False
            fcntl.flock(self._fd, fcntl.LOCK_UN)

    def _wait_for_turn(self) -> bool:
        """The turn within `wait` seconds (True), or False: the waiter thread keeps waiting for it and lets it go."""
        if self._waiter is None:
            self._waiter = threading.Thread(target=self._wait_loop, name="cpu-turn-waiter", daemon=True)
            self._waiter.start()
        request = _Request()
        self._requests.put(request)
        if request.granted.wait(self.wait):
            return True
        with self._guard:
            if request.granted.is_set():
                return True
            request.abandoned = True
            self._stuck = True
        logger.warning(f"no CPU turn within {self.wait:g} s (a process holding {self.path} is stopped or frozen?): "
                       f"computing without turns until it lets go")
        return False

    def _wait_loop(self) -> None:
        while True:
            request = self._requests.get()
            assert self._fd is not None
            fcntl.flock(self._fd, fcntl.LOCK_EX)  # (the lock belongs to the open file: the task's thread unlocks)
            with self._guard:
                if not request.abandoned:
                    request.granted.set()
                    continue
                fcntl.flock(self._fd, fcntl.LOCK_UN)
                self._stuck = False
            logger.warning("the CPU turn was let go: taking turns again")

    def close(self) -> None:
        with self._guard:
            stuck = self._stuck
        if self._fd is not None and not stuck:  # (a waiter still blocked on the file keeps it)
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


def turn_wait() -> float:
    """`SWARMGATE_CPU_TURN_WAIT` (seconds a task waits for its turn), else `DEFAULT_WAIT_S`; a bad value is an
    error naming the variable."""
    text = os.environ.get(WAIT_ENV, "").strip()
    if not text:
        return DEFAULT_WAIT_S
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not value > 0:
        raise ValueError(f"{WAIT_ENV} must be a positive number of seconds, got {text!r}")
    return value


def cpu_turns_enabled() -> bool:
    return os.environ.get(ENV, "1").strip().lower() not in ("0", "false", "no", "off")
