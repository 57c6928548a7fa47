"""The compute queue of a block server: one worker thread runs tensor work in priority order, and batches.

RPC handlers live on the asyncio loop and must never block it; they `submit` a function with a priority
(decode steps, then prefill chunks, then forward/backward passes) and await its result. One worker keeps
torch's intra-op threads for a single pass at a time, so concurrent sessions do not thrash the cores.
`submit_batchable` queues an item under a batch key: when the worker reaches such an item it takes every
queued item with the same key and runs them through one call of the batch function (concurrent sessions'
decode steps become one forward pass).
"""
from __future__ import annotations

import asyncio
import itertools
import logging
import queue
import threading
from typing import Any, Callable, Hashable, List, Optional

logger = logging.getLogger(__name__)

PRIORITY_DECODE = 0
PRIORITY_PREFILL = 1
PRIORITY_FORWARD = 2
PRIORITY_INFERENCE = PRIORITY_DECODE


class TaskPool:
    def __init__(self, name: str = "compute", max_batch: int = 64):
        self._queue: "queue.PriorityQueue" = queue.PriorityQueue()
        self._counter = itertools.count()
        self.max_batch = max_batch
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()
        self.tasks_done = 0
        self.batches_done = 0
        self.largest_batch = 0

    def submit(self, priority: int, fn: Callable[..., Any], *args, **kwargs) -> "asyncio.Future":
        loop = asyncio.get_running_loop()
        future = loop.create_future()
        self._queue.put((priority, next(self._counter), None, loop, future, fn, args, kwargs))
        return future

    def submit_batchable(self, priority: int, key: Hashable, batch_fn: Callable[[List[Any]], List[Any]],
                         item: Any) -> "asyncio.Future":
        """Queue `item`; it runs as `batch_fn([items...])[i]` together with other queued items of `key`."""
        loop = asyncio.get_running_loop()
        future = loop.create_future()
        self._queue.put((priority, next(self._counter), key, loop, future, batch_fn, (item,), {}))
        return future

    def _take_batch(self, first) -> list:
        """`first` plus every queued task with the same batch key (others are put back)."""
        batch, others = [first], []
        while len(batch) < self.max_batch:
            try:
                task = self._queue.get_nowait()
            except queue.Empty:
                break
            (batch if task[2] is not None and task[2] == first[2] else others).append(task)
        for task in others:
            self._queue.put(task)
        return batch

    def _run(self) -> None:
        while True:
            task = self._queue.get()
            _, _, key, loop, future, fn, args, kwargs = task
            if fn is None:  # shutdown marker (sorted last, after pending work)
                return
            if key is None:
                if future.cancelled():
                    continue
                try:
                    result, error = fn(*args, **kwargs), None
                except BaseException as e:  # delivered to the awaiting handler
                    result, error = None, e
                self.tasks_done += 1
                loop.call_soon_threadsafe(_resolve, future, result, error)
                continue
            batch = [t for t in self._take_batch(task) if not t[4].cancelled()]
            if not batch:
                continue
            try:
                results, error = fn([t[6][0] for t in batch]), None
            except BaseException as e:
                results, error = [None] * len(batch), e
            self.tasks_done += len(batch)
            self.batches_done += 1
            self.largest_batch = max(self.largest_batch, len(batch))
            for t, result in zip(batch, results):
                t[3].call_soon_threadsafe(_resolve, t[4], result, error)

    def is_alive(self) -> bool:
        """Whether the worker thread still runs (a dead one is replaced by the server's self-healing)."""
        return self._thread.is_alive()

    def shutdown(self) -> None:
        self._queue.put((float("inf"), next(self._counter), None, None, None, None, None, None))


def _resolve(future: "asyncio.Future", result: Any, error: Optional[BaseException]) -> None:
    if future.cancelled():
        return
    if error is not None:
        future.set_exception(error)
    else:
        future.set_result(result)
