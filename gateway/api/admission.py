"""Admission control: at most `max_concurrent` generations run, at most `max_queue` requests wait.

A request that finds every slot busy and the queue full is refused at once with 429 and `Retry-After`; one
that waits longer than `queue_timeout` gets 503. `acquire` and `release` run on the event loop; the slot is
released when the generation's worker thread has finished (and its session is closed), not when the HTTP
response ends, so that the swarm never holds more sessions than there are slots.
"""
from __future__ import annotations

import asyncio
from typing import Callable, Optional

from gateway.errors import rate_limited, unavailable
from swarm.runtime import malloc


class Admission:
    def __init__(self, max_concurrent: int, max_queue: int, queue_timeout: float, retry_after: int,
                 on_change: Optional[Callable[["Admission"], None]] = None):
        self.max_concurrent, self.max_queue = max_concurrent, max_queue
        self.queue_timeout, self.retry_after = queue_timeout, retry_after
        self.running = 0
        self.waiting = 0
        self._semaphore: Optional[asyncio.Semaphore] = None
        self._on_change = on_change or (lambda _: None)

    @property
    def semaphore(self) -> asyncio.Semaphore:
        if self._semaphore is None:
            self._semaphore = asyncio.Semaphore(self.max_concurrent)
        return self._semaphore

    async def acquire(self) -> None:
        # `waiting` includes requests that already hold their slot but have not resumed yet (requests arriving in
        # the same event-loop turn): count running and waiting together, or a burst overfills the queue
        if self.running + self.waiting >= self.max_concurrent + self.max_queue:
            raise rate_limited(
                f"The gateway is at capacity ({self.running} generations running, {self.waiting} waiting); "
                f"retry after {self.retry_after}s.", self.retry_after)
        self.waiting += 1
        self._on_change(self)
        try:
            await asyncio.wait_for(self.semaphore.acquire(), self.queue_timeout)
        except asyncio.TimeoutError:
            raise unavailable(f"No generation slot became free within {self.queue_timeout:.0f}s.",
                              code="queue_timeout") from None
        finally:
            self.waiting -= 1
        self.running += 1
        self._on_change(self)

    def release(self) -> None:
        self.running -= 1
        self.semaphore.release()
        self._on_change(self)
        if self.running == 0:
            malloc.trim()  # the last generation finished: what it freed back to the OS (swarm.runtime.malloc)


class Slot:
    """One admitted request's slot: released once the request is closed and none of its workers runs; then
    `on_release` runs (on the event loop)."""

    def __init__(self, admission: Admission, on_release: Optional[Callable[[], None]] = None):
        self.admission, self.on_release = admission, on_release
        self.workers = 0
        self.closed = False
        self.released = False

    def worker_started(self) -> None:
        self.workers += 1

    def worker_done(self) -> None:
        self.workers -= 1
        self._maybe_release()

    def close(self) -> None:
        self.closed = True
        self._maybe_release()

    def _maybe_release(self) -> None:
        if self.closed and self.workers == 0 and not self.released:
            self.released = True
            self.admission.release()
            if self.on_release is not None:
                self.on_release()
