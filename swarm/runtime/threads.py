"""Which threads of a process may run torch's parallel (OpenMP) work.

torch's CPU kernels run on OpenMP (libgomp). libgomp gives every thread that starts a parallel region its own
team of worker threads, and once a process has more worker threads than cores it stops spinning between
parallel regions: every region then pays a futex wake-up. On 2 cores a 15-block decode step costs 15 ms when one
thread of the process does all tensor work and 28 ms when a second thread has ever started a team.

So our processes keep tensor work on one thread (a server's compute thread, a client's calling thread), and the
threads that only move messages (event loops) call `serial_torch_here()`: what little tensor work they do
(validation, (de)serialization) then runs on that thread alone and never starts a team.

Idle OpenMP workers also spin before they sleep: 300,000 pause loops by default, 10-20 ms on current Xeons. In a
swarm on one machine the processes take turns (client, server 1, server 2, ...), and each one's spinning workers
would steal the cores from the next. `tune_openmp_env()` (called before torch is imported) lowers the spin to
`DEFAULT_SPINCOUNT`, about a millisecond: enough to bridge the gaps between the kernels of one step.
"""
from __future__ import annotations

import ctypes
import logging
import math
import os
import sys
import threading
from typing import Optional

logger = logging.getLogger(__name__)

DEFAULT_SPINCOUNT = 30000
_lock = threading.Lock()
_libs: dict = {}


def _loaded_library(fragment: str, symbol: str) -> Optional[ctypes.CDLL]:
    """A shared library this process loaded (by a fragment of its path) that exports `symbol`, or None."""
    with _lock:
        if fragment not in _libs:
            _libs[fragment] = None
            try:
                with open("/proc/self/maps") as maps:
                    paths = {line.split()[-1] for line in maps if fragment in line}
                for path in sorted(paths):
                    lib = ctypes.CDLL(path)
                    if hasattr(lib, symbol):
                        _libs[fragment] = lib
                        break
            except OSError as e:  # not Linux, or an unreadable maps file: nothing to do
                logger.debug(f"{fragment} not found: {e}")
        return _libs[fragment]


def tune_openmp_env() -> bool:
    """Set `GOMP_SPINCOUNT` (unless the user did) while it can still take effect: before torch loads libgomp."""
    if "torch" in sys.modules or "GOMP_SPINCOUNT" in os.environ or "OMP_WAIT_POLICY" in os.environ:
        return False
    os.environ["GOMP_SPINCOUNT"] = str(DEFAULT_SPINCOUNT)
    return True


def set_threads_here(count: int) -> bool:
    """Make tensor work started by the calling thread use `count` threads (1: this thread alone, no team).

    Affects only the calling thread (OpenMP's and MKL's thread-local counts), unlike `torch.set_num_threads`,
    which also changes MKL's count for the whole process. Returns whether it could be applied (False where torch
    does not use libgomp).
    """
    import torch

    torch.get_num_threads()  # torch sets each thread's OpenMP thread count lazily, once: let it happen first
    gomp = _loaded_library("libgomp", "omp_set_num_threads")
    if gomp is None:
        return False
    gomp.omp_set_num_threads(count)
    mkl = _loaded_library("libtorch_cpu", "mkl_set_num_threads_local")  # MKL (in torch) has its own thread count
    if mkl is not None:
        # in torch's build this symbol is the Fortran-style entry point (same address as `..._local_`): by pointer
        mkl.mkl_set_num_threads_local(ctypes.byref(ctypes.c_int(count)))
    gomp.omp_get_max_threads.restype = ctypes.c_int
    return gomp.omp_get_max_threads() == count


def serial_torch_here() -> bool:
    """Make tensor work started by the calling thread run on this thread only (no OpenMP team)."""
    return set_threads_here(1)


SHARE_SLACK = 0.25  # others busy on a core less than this share of the time leave it free


class FreeCores:
    """How many threads a compute thread should use now: the cores that other processes leave free.

    Processes of a swarm on one machine (a client and servers on loopback, or a gateway next to a server) take
    turns while one session decodes, but all compute at once under concurrent sessions. Then every process using
    all cores oversubscribes them: an OpenMP barrier waits for a worker the OS has descheduled, and each kernel
    costs a time slice. So before each task the compute thread asks `threads()`: from `/proc/stat` (all cores'
    busy time) minus this process's own CPU time over the last `interval` seconds, it estimates the cores other
    processes keep busy and answers the cores they leave, a core counting as taken once others keep it busy more
    than `SHARE_SLACK` of the time (concurrent sessions do not take turns: sharing a core with a busy process
    costs far more than using one core fewer): at least 1, at most `max_threads`. On a machine of its own the
    answer stays `max_threads`. A lone session's chain does not ask (`swarm.runtime.taskpool`): it keeps all threads.
    """

    def __init__(self, max_threads: int, interval: float = 0.1, smoothing: float = 0.5):
        import time

        self._clock = time.monotonic
        self.max_threads = max(1, max_threads)
        self.cores = os.cpu_count() or 1
        self.interval, self.smoothing = interval, smoothing
        self.others = 0.0  # cores kept busy by other processes (smoothed)
        self.current = self.max_threads
        self._hz = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
        self._last = self._sample()

    def _sample(self) -> Optional[tuple]:
        try:
            with open("/proc/stat") as f:
                fields = [int(v) for v in f.readline().split()[1:]]
        except (OSError, ValueError):
            return None
        busy = sum(fields) - fields[3] - (fields[4] if len(fields) > 4 else 0)  # all but idle and iowait
        return self._clock(), busy / self._hz, sum(os.times()[:2])

    def threads(self) -> int:
        if self._last is None or self.max_threads == 1:
            return self.current
        if self._clock() - self._last[0] < self.interval:
            return self.current
        sample = self._sample()
        if sample is None:
            return self.current
        wall = sample[0] - self._last[0]
        others = max(0.0, (sample[1] - self._last[1]) - (sample[2] - self._last[2])) / wall
        self._last = sample
        self.others = self.smoothing * self.others + (1 - self.smoothing) * others
        self.current = max(1, min(self.max_threads, math.floor(self.cores - self.others + SHARE_SLACK)))
        return self.current
