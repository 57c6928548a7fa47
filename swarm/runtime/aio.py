"""One background asyncio loop per client process, so that synchronous code (the model, the gateway's worker
threads) can drive P2P streams: `run(coro, timeout)` blocks the caller until the coroutine finishes there. At
interpreter exit the loop's remaining tasks are cancelled and awaited, then the loop stops."""
from __future__ import annotations

import asyncio
import atexit
import threading
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Any, Coroutine, Optional, TypeVar

from swarm.runtime.threads import serial_torch_here

T = TypeVar("T")
_lock = threading.Lock()
_loop: Optional[asyncio.AbstractEventLoop] = None


def _serve(loop: asyncio.AbstractEventLoop) -> None:
    # the loop only (de)serializes; tensor work stays on the calling threads (swarm.runtime.threads)
    serial_torch_here()
    loop.run_forever()


def get_loop() -> asyncio.AbstractEventLoop:
    global _loop
    with _lock:
        if _loop is None or _loop.is_closed():
            _loop = asyncio.new_event_loop()
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
