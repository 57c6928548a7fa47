"""The hivemind DHT peer as a child process that never outlives, nor hangs, its parent.

`hivemind.DHT` runs its node in a forked child (which starts p2pd as its own child). `DHTProcess` is that class
with the shutdown paths made safe for every process kind (server, gateway, bootstrap peer):

- The child runs in a process group of its own (and so does the p2pd it starts): a stop signal sent to the
  parent's whole group (Ctrl-C in a terminal, `kill -TERM -PGID`, supervisors) reaches the parent only, which can
  still use its DHT peer to say goodbye (a server announces `offline`) before it stops the child. Before, the
  group's SIGTERM killed the child and p2pd at once and the server's last announcement failed (issue 45).
- In the child: the signal handling inherited from the parent is reset (an asyncio loop's handlers would make the
  child ignore SIGTERM and write to the parent's wake-up socket): SIGTERM sent to the child itself ends it, SIGINT
  is ignored (hivemind's choice: the parent decides). A watchdog thread ends the child, and p2pd with it, if its
  parent disappears (the parent SIGKILLed: no group signal reaches the child any more).
- In the parent: when the child dies for any reason (e.g. SIGTERM to the whole process group), every call to
  that DHT still waiting fails at once instead of blocking its thread forever (which would also block the exit),
  and so does every later call. Only that DHT's calls: a process may run several DHT peers (a test's reader next
  to an in-process server), and one peer stopping must not fail the others' calls.
- `p2pd_extra`: p2pd flags that `hivemind.P2P.create` does not expose (relay service limits,
  `swarm.runtime.relays`), added to the child's p2pd command line.
- In the child: every DHT RPC message sent and received is counted (`swarm.runtime.dht_traffic`).
- `shutdown(timeout)` (also at interpreter exit): asks the child to stop, SIGKILLs it (and its p2pd) after
  `timeout` seconds, and never raises when the child is already gone.
"""
from __future__ import annotations

import atexit
import logging
import multiprocessing.connection
import os
import signal
import threading
import time
import weakref
from typing import Any, Callable, Dict, Optional

import hivemind
import psutil
from hivemind.utils.mpfuture import MPFuture

from swarm.runtime import dht_traffic, p2p_listen

logger = logging.getLogger("swarmgate.dht")

SHUTDOWN_TIMEOUT = 2.0  # seconds the child gets to stop cleanly before it is killed
PARENT_CHECK_PERIOD = 1.0
ANSWER_GRACE = 0.3  # seconds for a dead child's last answers to arrive before its waiting calls are failed


class DHTGone(RuntimeError):
    """A DHT call whose DHT process is no longer running."""


def _fail(future: MPFuture, reason: str) -> bool:
    if future.done():
        return False
    try:
        future.set_exception(DHTGone(reason))
        return True
    except Exception:  # finished meanwhile
        return False


class _CallsPipe:
    """The parent's end of one DHT's command pipe, noting the future of every call sent through it."""

    def __init__(self, pipe, gone: Callable[[], bool]):
        self._pipe, self._gone = pipe, gone
        self._lock = threading.Lock()
        self._pending: "weakref.WeakValueDictionary[int, MPFuture]" = weakref.WeakValueDictionary()

    def send(self, message) -> None:
        futures = [v for v in message[2].values() if isinstance(v, MPFuture)] if len(message) == 3 else []
        with self._lock:
            for future in futures:
                self._pending[id(future)] = future
        if futures and self._gone():  # nobody will ever answer: fail now instead of waiting forever
            for future in futures:
                _fail(future, "the DHT process has exited")
            return
        self._pipe.send(message)

    def fail_pending(self, reason: str) -> int:
        """Fail this DHT's calls still waiting for an answer (its process is gone)."""
        with self._lock:
            futures = list(self._pending.values())
            self._pending.clear()
        return sum(_fail(future, reason) for future in futures)

    def __getattr__(self, name):
        return getattr(self._pipe, name)


def _kill_own_children() -> None:
    for child in psutil.Process().children(recursive=True):
        try:
            child.kill()
        except psutil.Error:
            pass


def _watch_parent(parent_pid: int) -> None:
    while True:
        time.sleep(PARENT_CHECK_PERIOD)
        if os.getppid() != parent_pid:
            _kill_own_children()  # p2pd
            os._exit(0)


def _add_p2pd_flags(extra: Dict[str, Any]) -> None:
    """In the DHT child only: every p2pd it starts gets the `extra` flags too (e.g. the relay service's limits)."""
    from hivemind.p2p import P2P

    make = P2P._make_process_args

    def with_extra(*args, **kwargs):
        return make(*args, **{**kwargs, **extra})

    P2P._make_process_args = staticmethod(with_extra)


def _own_group(pid: int) -> None:
    """Make process `pid` (0: this one) the leader of a new process group; harmless when it already is one, or
    when the child has already exited."""
    try:
        os.setpgid(pid, 0)
    except (OSError, AttributeError):  # the child exited or exec'd already; a platform without process groups
        pass


class DHTProcess(hivemind.DHT):
    """`hivemind.DHT` (same arguments) with the child's signals reset, a parent watchdog in the child, pending calls
    failed when the child dies, and a `shutdown` that always ends the child within its timeout."""

    def __init__(self, *args, start: bool, await_ready: bool = True, p2pd_extra: Optional[Dict[str, Any]] = None,
                 **kwargs):
        p2p_listen.install()  # a burst of incoming streams is not reset by p2pd (its module docstring)
        super().__init__(*args, start=False, **kwargs)
        self._p2pd_extra = dict(p2pd_extra or {})  # p2pd flags hivemind does not expose (swarm.runtime.relays)
        # before the child starts: its watcher may fail the calls (readiness included) as soon as it has started
        self._calls = _CallsPipe(getattr(self, "_outer_pipe"), self._child_gone)
        setattr(self, "_outer_pipe", self._calls)  # hivemind sends every call through it
        self._calls._pending[id(self._ready)] = self._ready
        if start:
            self.run_in_background(await_ready=await_ready)

    def _child_gone(self) -> bool:
        return self._popen is not None and self._popen.poll() is not None

    def start(self) -> None:
        super().start()
        _own_group(self.pid)  # both sides set it: no window where a group signal still reaches the child
        threading.Thread(target=self._watch_child, name="dht-process-watch", daemon=True).start()
        atexit.register(self.shutdown)  # a client that never calls shutdown() still stops its DHT and p2pd

    def _watch_child(self) -> None:
        multiprocessing.connection.wait([self.sentinel])
        time.sleep(ANSWER_GRACE)  # answers the child sent just before it exited (e.g. why it failed to start)
        failed = self._calls.fail_pending("the DHT process has exited")
        if failed:
            logger.debug(f"the DHT process exited; failed {failed} pending call(s)")

    def run(self) -> None:  # in the child
        _own_group(0)  # before p2pd starts: it inherits this group
        try:
            signal.set_wakeup_fd(-1)
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
            signal.signal(signal.SIGINT, signal.SIG_IGN)
        except ValueError:  # not the child's main thread (cannot happen with fork; kept safe)
            pass
        threading.Thread(target=_watch_parent, args=(os.getppid(),), name="parent-watch", daemon=True).start()
        if self._p2pd_extra:
            _add_p2pd_flags(self._p2pd_extra)
        dht_traffic.install()  # count every DHT RPC message (read with dht_traffic.read_dht_traffic)
        super().run()

    def shutdown(self, timeout: float = SHUTDOWN_TIMEOUT) -> None:
        atexit.unregister(self.shutdown)  # nothing left to stop at exit (and the process object may be freed)
        if self.is_alive():
            try:
                self._outer_pipe.send(("_shutdown", [], {}))
            except (OSError, ValueError):  # the child is exiting, or the pipe was closed by an earlier shutdown
                pass
            self.join(timeout)
        if self.is_alive():
            logger.warning(f"the DHT process did not stop within {timeout:.0f}s; killing it")
            try:
                for child in psutil.Process(self.pid).children(recursive=True):
                    child.kill()
            except psutil.Error:
                pass
            self.kill()
            self.join(1.0)
        self._calls.fail_pending("the DHT peer was shut down")
