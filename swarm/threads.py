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
import os
import sys
import threading
from typing import Optional

logger = logging.getLogger(__name__)

DEFAULT_SPINCOUNT = 30000
_lock = threading.Lock()
_libgomp: Optional[ctypes.CDLL] = None
_looked = False


def _find_libgomp() -> Optional[ctypes.CDLL]:
    """The libgomp that torch loaded (its own copy in torch/lib), if torch runs on OpenMP."""
    global _libgomp, _looked
    with _lock:
        if not _looked:
            _looked = True
            try:
                with open("/proc/self/maps") as maps:
                    paths = {line.split()[-1] for line in maps if "libgomp" in line}
                for path in sorted(paths):
                    lib = ctypes.CDLL(path)
                    lib.omp_get_max_threads.restype = ctypes.c_int
                    _libgomp = lib
                    break
            except OSError as e:  # not Linux, or an unreadable maps file: nothing to do
                logger.debug(f"libgomp not found: {e}")
        return _libgomp


def tune_openmp_env() -> bool:
    """Set `GOMP_SPINCOUNT` (unless the user did) while it can still take effect: before torch loads libgomp."""
    if "torch" in sys.modules or "GOMP_SPINCOUNT" in os.environ or "OMP_WAIT_POLICY" in os.environ:
        return False
    os.environ["GOMP_SPINCOUNT"] = str(DEFAULT_SPINCOUNT)
    return True


def serial_torch_here() -> bool:
    """Make tensor work started by the calling thread run on this thread only (no OpenMP team).

    Affects only the calling thread: other threads keep torch's configured number of threads. Returns whether
    it could be applied (False where torch does not use libgomp).
    """
    import torch

    torch.get_num_threads()  # torch sets each thread's OpenMP thread count lazily, once: let it happen first
    lib = _find_libgomp()
    if lib is None:
        return False
    lib.omp_set_num_threads(1)
    return lib.omp_get_max_threads() == 1
