"""The compute thread of a process: one worker thread runs all tensor work in priority order, and batches.

A block server's RPC handlers live on the asyncio loop and must never block it; they `submit` a function with a
priority (decode steps, then prefill chunks, then forward/backward passes) and await its result. A client's
threads (one per conversation in the gateway) `call` it and block. One worker keeps torch's intra-op threads
for a single pass at a time, so concurrent sessions do not thrash the cores, and it is the only thread of the
process that starts OpenMP teams (`swarm.threads`). `submit_batchable` / `call_batchable` queue an item under a
batch key: when the worker reaches such an item it takes every queued item with the same key and runs them
through one call of the batch function (concurrent sessions' decode steps, or their LM heads, become one pass).
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import itertools
import logging
import queue
import threading
import time
from typing import Any, Callable, Hashable, List, Optional

import torch

from swarm.threads import FreeCores, set_threads_here

logger = logging.getLogger(__name__)

PRIORITY_DECODE = 0
PRIORITY_PREFILL = 1
PRIORITY_FORWARD = 2
PRIORITY_INFERENCE = PRIORITY_DECODE
OVERLAP_MEMORY = 1.0  # seconds after tasks last overlapped during which threads adapt to the free cores


class TaskPool:
    def __init__(self, name: str = "compute", max_batch: int = 64, adapt_threads: bool = True):
        self._queue: "queue.PriorityQueue" = queue.PriorityQueue()
        self._adapt = adapt_threads
        self._cores: Optional[FreeCores] = None  # set on the worker thread (its configured torch threads)
        self._last_overlap = float("-inf")  # when tasks last waited for one another
        self._counter = itertools.count()
        self.max_batch = max_batch
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()
        self.tasks_done = 0
        self.batches_done = 0
        self.largest_batch = 0

    def submit(self, priority: int, fn: Callable[..., Any], *args, **kwargs) -> "asyncio.Future":
        """From an asyncio loop: run `fn(*args, **kwargs)` on the worker; await the returned future."""
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

    def call(self, priority: int, fn: Callable[..., Any], *args, **kwargs) -> Any:
        """From plain code: run `fn(*args, **kwargs)` on the worker and return its result (blocks)."""
        if threading.current_thread() is self._thread:
            return fn(*args, **kwargs)
        future: concurrent.futures.Future = concurrent.futures.Future()
        self._queue.put((priority, next(self._counter), None, None, future, fn, args, kwargs))
        return future.result()

    def call_batchable(self, priority: int, key: Hashable, batch_fn: Callable[[List[Any]], List[Any]],
                       item: Any) -> Any:
        """From plain code: `batch_fn([items...])[i]` with other queued items of `key` (blocks)."""
        if threading.current_thread() is self._thread:
            return batch_fn([item])[0]
        future: concurrent.futures.Future = concurrent.futures.Future()
        self._queue.put((priority, next(self._counter), key, None, future, batch_fn, (item,), {}))
        return future.result()

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

    def _adapt_threads(self) -> None:
        """Fewer torch threads while this pool serves concurrent work and other processes keep cores busy.

        A single session's steps never overlap here (the processes of a chain take turns): they keep all threads.
        """
        if self._cores is None:
            return
        now = time.monotonic()
        if not self._queue.empty():
            self._last_overlap = now
        wanted = self._cores.threads() if now - self._last_overlap < OVERLAP_MEMORY else self._cores.max_threads
        if wanted != self._threads:
            set_threads_here(wanted)  # this worker's count only: other threads of the process keep theirs
            self._threads = wanted

    def _run(self) -> None:
        if self._adapt:  # torch threads for each task: the cores other processes leave free
            self._cores = FreeCores(torch.get_num_threads())
            self._threads = self._cores.max_threads
        while True:
            task = self._queue.get()
            self._adapt_threads()
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
                _deliver(loop, future, result, error)
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
                _deliver(t[3], t[4], result, error)

    def is_alive(self) -> bool:
        """Whether the worker thread still runs (a dead one is replaced by the server's self-healing)."""
        return self._thread.is_alive()

    def shutdown(self) -> None:
        self._queue.put((float("inf"), next(self._counter), None, None, None, None, None, None))


def _deliver(loop: Optional[asyncio.AbstractEventLoop], future, result: Any, error: Optional[BaseException]) -> None:
    """Complete an asyncio future on its loop, or a concurrent future (plain callers) right here."""
    if loop is None:
        _resolve(future, result, error)
    else:
        loop.call_soon_threadsafe(_resolve, future, result, error)


def _resolve(future, result: Any, error: Optional[BaseException]) -> None:
    if future.cancelled():
        return
    if error is not None:
        future.set_exception(error)
    else:
        future.set_result(result)


_shared: Optional[TaskPool] = None
_shared_lock = threading.Lock()


def client_pool() -> TaskPool:
    """The compute thread of a client process (the client model's embeddings, LM head and sampling), shared by
    all its models and sessions; started on first use and replaced if it died."""
    global _shared
    with _shared_lock:
        if _shared is None or not _shared.is_alive():
            _shared = TaskPool(name="client-compute")
        return _shared
