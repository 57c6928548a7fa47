"""One background asyncio loop per client process, so that synchronous code (the model, the gateway's worker
threads) can drive P2P streams: `run(coro, timeout)` blocks the caller until the coroutine finishes there. At
interpreter exit the loop's remaining tasks are cancelled and awaited, then the loop stops.

Which event loop (`loop_factory`): uvloop where it is installed (a dependency, as it is hivemind's), else asyncio's;
`SWARMGATE_EVENT_LOOP` (auto, uvloop, asyncio) or a process's `--event_loop` flag (`use_loop`) chooses. uvloop's
transports and callbacks are C: with it (and uvicorn's httptools parser) the gateway's client loop spent ~0.35 ms and
its API loop ~0.3 ms less CPU per request (bench/bench_threads.py, docs/benchmarks.md). `run_main` runs a process's
main coroutine on the chosen loop (what `asyncio.run` does on asyncio's)."""
from __future__ import annotations

import asyncio
import atexit
import os
import sys
import threading
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Any, Callable, Coroutine, Optional, TypeVar

from swarm.runtime.threads import serial_torch_here

T = TypeVar("T")
_lock = threading.Lock()
_loop: Optional[asyncio.AbstractEventLoop] = None

LOOP_ENV = "SWARMGATE_EVENT_LOOP"
EVENT_LOOPS = ("auto", "uvloop", "asyncio")
_chosen: Optional[str] = None  # `use_loop`'s choice, else the environment's


def parse_event_loop(text: str) -> str:
    """An event loop choice (auto, uvloop, asyncio); a ValueError naming them otherwise (or uvloop where it is not
    installed)."""
    kind = str(text).strip().lower()
    if kind not in EVENT_LOOPS:
        raise ValueError(f"unknown event loop {text!r}: use auto, uvloop or asyncio")
    if kind == "uvloop" and _uvloop() is None:
        raise ValueError("event loop uvloop: uvloop is not installed (pip install uvloop, or use auto or asyncio)")
    return kind


def _uvloop():
    try:
        import uvloop
    except ImportError:
        return None
    return uvloop


def use_loop(kind: str) -> None:
    """This process's event loops from now on (its client loop, if not started yet, and `run_main`'s)."""
    global _chosen
    _chosen = parse_event_loop(kind)


def loop_factory(kind: Optional[str] = None) -> Callable[[], asyncio.AbstractEventLoop]:
    """The maker of `kind`'s event loops (default: `use_loop`'s choice, else `SWARMGATE_EVENT_LOOP`, else auto:
    uvloop where installed)."""
    kind = parse_event_loop(kind or _chosen or os.environ.get(LOOP_ENV, "").strip() or "auto")
    uvloop = _uvloop() if kind != "asyncio" else None
    return uvloop.new_event_loop if uvloop is not None else asyncio.new_event_loop


def run_main(coro: Coroutine[Any, Any, T], kind: Optional[str] = None) -> T:
    """`asyncio.run(coro)` on the chosen event loop (`loop_factory`): a process's main loop."""
    factory = loop_factory(kind)
    if sys.version_info >= (3, 11):
        with asyncio.Runner(loop_factory=factory) as runner:
            return runner.run(coro)
    if factory is not asyncio.new_event_loop:  # (3.10: no Runner; the policy makes asyncio.run's loop)
        import uvloop

        uvloop.install()
    return asyncio.run(coro)


def _serve(loop: asyncio.AbstractEventLoop) -> None:
    # the loop only (de)serializes; tensor work stays on the calling threads (swarm.runtime.threads)
    serial_torch_here()
    loop.run_forever()


def get_loop() -> asyncio.AbstractEventLoop:
    global _loop
    with _lock:
        if _loop is None or _loop.is_closed():
            _loop = loop_factory()()
            threading.Thread(target=_serve, args=(_loop,), name="swarm-client-loop", daemon=True).start()
            atexit.register(_stop, _loop)
        return _loop


async def _cancel_all() -> None:
    tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)


def _stop(loop: asyncio.AbstractEventLoop, timeout: float = 2.0) -> None:
    """At exit: cancel what still runs on the loop (P2P readers, streams) and stop it, so that no task is
    destroyed while pending (asyncio's `Task was destroyed but it is pending!`)."""
    if loop.is_closed() or not loop.is_running():
        return
    try:
        asyncio.run_coroutine_threadsafe(_cancel_all(), loop).result(timeout)
    except Exception:
        pass
    loop.call_soon_threadsafe(loop.stop)


def run(coro: Coroutine[Any, Any, T], timeout: Optional[float] = None) -> T:
    loop = get_loop()
    if threading.current_thread().name == "swarm-client-loop":
        raise RuntimeError("swarm.runtime.aio.run() called from the client loop itself; await the coroutine instead")
    future = asyncio.run_coroutine_threadsafe(coro, loop)
    try:
        return future.result(timeout)
    except FutureTimeout:
        if future.done():  # the coroutine's own timeout (e.g. an asyncio.wait_for inside it): raised as it was
            raise
        future.cancel()
        raise TimeoutError(f"operation did not finish within {timeout}s") from None


async def iterate_queue(queue: "asyncio.Queue"):
    """Yield items put into `queue` until a None arrives (feeds a P2P request stream from plain code)."""
    while True:
        item = await queue.get()
        if item is None:
            return
        yield item


def call_on(loop: asyncio.AbstractEventLoop, fn: Callable[[], Any]) -> None:
    """Run `fn` on `loop`: at once from the loop's own thread, else scheduled there (thread-safe); nothing once the
    loop has closed (whatever `fn` would end went with it)."""
    try:
        here = asyncio.get_running_loop() is loop
    except RuntimeError:
        here = False
    if here:
        fn()
    elif not loop.is_closed():
        try:
            loop.call_soon_threadsafe(fn)
        except RuntimeError:  # closed meanwhile
            pass
