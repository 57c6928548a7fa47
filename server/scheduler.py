"""The compute queue of a block server: one worker thread runs tensor work in priority order.

RPC handlers live on the asyncio loop and must never block it; they `submit` a function with a priority
(inference steps before forward/backward passes) and await its result. One worker keeps torch's intra-op
threads for a single pass at a time, so concurrent sessions do not thrash the cores.
"""
from __future__ import annotations

import asyncio
import itertools
import logging
import queue
import threading
from typing import Any, Callable

logger = logging.getLogger(__name__)

PRIORITY_INFERENCE = 0
PRIORITY_FORWARD = 1


class TaskPool:
    def __init__(self, name: str = "compute"):
        self._queue: "queue.PriorityQueue" = queue.PriorityQueue()
        self._counter = itertools.count()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()
        self.tasks_done = 0

    def submit(self, priority: int, fn: Callable[..., Any], *args, **kwargs) -> "asyncio.Future":
        loop = asyncio.get_running_loop()
        future = loop.create_future()
        self._queue.put((priority, next(self._counter), loop, future, fn, args, kwargs))
        return future

    def _run(self) -> None:
        while True:
            _, _, loop, future, fn, args, kwargs = self._queue.get()
            if fn is None:  # shutdown marker (sorted last, after pending work)
                return
            if future.cancelled():
                continue
            try:
                result, error = fn(*args, **kwargs), None
            except BaseException as e:  # delivered to the awaiting handler
                result, error = None, e
            self.tasks_done += 1
            loop.call_soon_threadsafe(_resolve, future, result, error)

    def shutdown(self) -> None:
        self._queue.put((float("inf"), next(self._counter), None, None, None, None, None))


def _resolve(future: "asyncio.Future", result: Any, error: BaseException | None) -> None:
    if future.cancelled():
        return
    if error is not None:
        future.set_exception(error)
    else:
        future.set_result(result)
