"""One background asyncio loop per client process, so that synchronous code (the model, the gateway's worker
threads) can drive P2P streams: `run(coro, timeout)` blocks the caller until the coroutine finishes there."""
from __future__ import annotations

import asyncio
import threading
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Any, Coroutine, Optional, TypeVar

from swarm.runtime.threads import serial_torch_here

T = TypeVar("T")
_lock = threading.Lock()
_loop: Optional[asyncio.AbstractEventLoop] = None


def _serve(loop: asyncio.AbstractEventLoop) -> None:
    serial_torch_here()  # the loop only (de)serializes; tensor work stays on the calling threads (swarm.runtime.threads)
    loop.run_forever()


def get_loop() -> asyncio.AbstractEventLoop:
    global _loop
    with _lock:
        if _loop is None or _loop.is_closed():
            _loop = asyncio.new_event_loop()
            threading.Thread(target=_serve, args=(_loop,), name="swarm-client-loop", daemon=True).start()
        return _loop


def run(coro: Coroutine[Any, Any, T], timeout: Optional[float] = None) -> T:
    loop = get_loop()
    if threading.current_thread().name == "swarm-client-loop":
        raise RuntimeError("swarm.runtime.aio.run() called from the client loop itself; await the coroutine instead")
    future = asyncio.run_coroutine_threadsafe(coro, loop)
    try:
        return future.result(timeout)
    except FutureTimeout:
        future.cancel()
        raise TimeoutError(f"operation did not finish within {timeout}s") from None


async def iterate_queue(queue: "asyncio.Queue"):
    """Yield items put into `queue` until a None arrives (feeds a P2P request stream from plain code)."""
    while True:
        item = await queue.get()
        if item is None:
            return
        yield item
