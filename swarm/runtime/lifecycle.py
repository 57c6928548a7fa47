"""How a swarmgate process ends: stop signals, and leaving no descendant behind.

Every process kind (`dht`, `server`, `gateway`, `up`) stops within seconds of SIGTERM or SIGINT, whether the signal
reached it alone or its whole process group (Ctrl-C in a terminal, systemd, supervisors). Its DHT process and
p2pd run in a process group of their own (`swarm.runtime.dht_process`) and do not get a group's signal; they may
still be gone first (killed on their own, by an OOM killer or a supervisor that signals every process).

- `become_subreaper()`: on Linux, descendants orphaned by a child that died first (p2pd, when the DHT process was
  killed) are re-parented to this process instead of init, so that `reap_descendants` still finds them.
- `reap_descendants(timeout)`: SIGTERM every descendant still running, SIGKILL those that do not exit in time, and
  wait for them (no zombies). Each process's `main` calls it last.
- `quiet_lost_connections(loop)`: once stopping, a connection lost in a background task (p2pd killed by the same
  signal) is logged at debug level instead of as an error with a traceback.
- `finish(code, timeout)`: the end of a `swarmgate` process (`launch.cli`), once its subcommand returned:
  reaps the descendants, gives other non-daemon threads up to `timeout` s (worker threads stuck on a dead peer
  must not hold the exit), flushes logs and stdio and exits with `code` without the interpreter's finalization
  (freeing a loaded model and C++ destructors took ~4 s on a busy machine, after everything had stopped).
- `on_stop_signals(callback)`: SIGTERM and SIGINT call `callback` once; a second signal means "now": the process
  reaps its descendants and exits at once with status 1.

Temporary directories go with the process: the `torch-shm-dir-*` of a reaped `torch_shm_manager` (the daemon torch
starts for hivemind's shared-memory futures, which leaves its directory behind when it ends) and multiprocessing's
own `pymp-*` (removed by an exit hook that `os._exit` skips). Until they were, every server, gateway and bootstrap
start left two directories in /tmp (a test run: ~400).
"""
from __future__ import annotations

import asyncio
import ctypes
import logging
import multiprocessing
import os
import shutil
import signal
import sys
import threading
import time
from typing import Any, Callable, Dict, List, NoReturn

import psutil

logger = logging.getLogger("swarmgate.lifecycle")

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)
_PR_SET_CHILD_SUBREAPER = 36


def become_subreaper() -> bool:
    """Adopt orphaned descendants (Linux `prctl(PR_SET_CHILD_SUBREAPER)`); False where unsupported."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return libc.prctl(_PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


def descendants() -> List[psutil.Process]:
    try:
        return psutil.Process().children(recursive=True)
    except psutil.Error:
        return []


def shm_manager_dirs(procs: List[psutil.Process]) -> List[str]:
    """The directories of the `torch_shm_manager` daemons among `procs` (where each listens)."""
    dirs = set()
    for proc in procs:
        try:
            if proc.name() != "torch_shm_manager":
                continue
            for connection in proc.net_connections(kind="unix"):
                path = connection.laddr if isinstance(connection.laddr, str) else ""
                if os.path.basename(os.path.dirname(path)).startswith("torch-shm-dir-"):
                    dirs.add(os.path.dirname(path))
        except psutil.Error:
            continue
    return sorted(dirs)


def reap_descendants(timeout: float = 2.0) -> int:
    """Terminate every descendant still running (SIGKILL after `timeout` s) and reap them, removing the directories
    of the torch shared-memory managers among them; returns how many."""
    procs = descendants()
    if not procs:
        return 0
    leftovers = shm_manager_dirs(procs)
    for proc in procs:
        try:
            proc.terminate()
        except psutil.Error:
            pass
    _, alive = psutil.wait_procs(procs, timeout=timeout)
    for proc in alive:
        try:
            proc.kill()
        except psutil.Error:
            pass
    if alive:
        psutil.wait_procs(alive, timeout=1.0)
        logger.warning(f"killed {len(alive)} child process(es) that did not exit on SIGTERM")
    for path in leftovers:
        shutil.rmtree(path, ignore_errors=True)
    return len(procs)


def remove_multiprocessing_tempdir() -> None:
    """Remove multiprocessing's temporary directory of this process, if it made one (its exit hook would have)."""
    tempdir = getattr(multiprocessing.current_process(), "_config", {}).get("tempdir")
    if tempdir and os.path.basename(tempdir).startswith("pymp-"):
        shutil.rmtree(tempdir, ignore_errors=True)


def on_stop_signals(callback: Callable[[], None]) -> None:
    """SIGTERM/SIGINT call `callback` (from the main thread, in a signal handler: keep it to setting a flag or
    scheduling work thread-safely); a second stop signal reaps the descendants and exits with status 1."""
    received = threading.Event()

    def handler(signum, _frame) -> None:
        if received.is_set():
            logger.warning(f"second {signal.Signals(signum).name}: exiting now")
            reap_descendants(timeout=1.0)
            remove_multiprocessing_tempdir()
            os._exit(1)
        received.set()
        callback()

    for sig in STOP_SIGNALS:
        signal.signal(sig, handler)


def quiet_lost_connections(loop: asyncio.AbstractEventLoop) -> None:
    """From now on, unretrieved connection errors of background tasks on `loop` are debug messages."""
    def handler(loop: asyncio.AbstractEventLoop, context: Dict[str, Any]) -> None:
        if isinstance(context.get("exception"), (ConnectionError, FileNotFoundError, EOFError)):
            logger.debug(f"while stopping: {context.get('message')}: {context['exception']!r}")
            return
        loop.default_exception_handler(context)

    loop.set_exception_handler(handler)


def finish(code: int, timeout: float = 2.0) -> NoReturn:
    """Reap the descendants, wait up to `timeout` s for non-daemon threads, flush, `os._exit(code)`."""
    reap_descendants()
    deadline = time.monotonic() + timeout
    for thread in threading.enumerate():
        if thread is not threading.current_thread() and not thread.daemon:
            thread.join(max(0.0, deadline - time.monotonic()))
    lingering = [t.name for t in threading.enumerate() if t.is_alive() and not t.daemon
                 and t is not threading.current_thread()]
    if lingering:
        logger.warning(f"threads still running at exit ({', '.join(lingering)}): exiting without waiting for them")
    remove_multiprocessing_tempdir()
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
