"""The compute thread of a process: one worker thread runs all tensor work in priority order, and batches.

A block server's RPC handlers live on the asyncio loop and must never block it; they `submit` a function with a
priority (decode steps, then prefill chunks, then forward passes, then training passes cut
into one-block pieces, then idle-time work that whoever needs it first does on the spot) and await its result. A
client's threads (one per conversation in the gateway) `call` it and block. One worker keeps torch's intra-op threads
for a single pass at a time, so concurrent sessions do not thrash the cores, and it is the only thread of the
process that starts OpenMP teams (`swarm.runtime.threads`). `submit_batchable` / `call_batchable` queue an item under a
batch key: when the worker reaches such an item it takes every queued item with the same key and runs them
through one call of the batch function (concurrent sessions' decode steps, or their LM heads, become one pass).
An item may carry a cost and a budget (a prefill chunk: its tokens, and the server's `--prefill_batch_tokens`): a batch
then takes the queued items in arrival order only while their costs fit the budget of its first item (the first
always goes) and leaves the rest queued, so that each pass's results are delivered when that pass ends, other work
(decode steps) goes between passes, and an item is never overtaken by later ones of its key (no starvation).

Steps of concurrent sessions reach a process a little apart (pushed one by one from the previous server). An idle
worker that started on the first alone would split the sessions into groups that then stay apart, each a pass
of its own. So batchable items name their source (a session), and `Gatherer` remembers each source's step
period: the worker waits briefly (at most `GATHER_MAX` seconds and half a batch's compute time) for the sources
that are due in this round, and stops waiting as soon as all of them are in. Groups that drifted a whole pass
apart are merged: a group smaller than the other (on a tie, the group without the lowest source) waits, while
the worker has nothing else to do, up to the other group's expected arrival (at most one of its own periods,
and not again for a few periods), so it joins them from then on.

Where the process knows which sources will come, it says so: a client session `expect`s its head item for the
time its step is in the swarm (`in_flight`). A batch of that key then waits for exactly the sources still in flight
(at most `EXPECT_MAX` and one of their periods past the first item), and for no one else: concurrent sessions that
drifted apart in the servers meet again at the head, every round, instead of running separate passes through the
swarm, and a session that is not stepping (between requests, or prefilling a long prompt) holds nobody up.

Processes on one machine take turns for CPU work (`swarm.runtime.cpu_turns`): each task runs under the machine-wide turn
with all threads. Without turns, a worker uses fewer threads while its tasks overlap and other processes keep
cores busy (`swarm.runtime.threads.FreeCores`).
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import itertools
import logging
import queue
import threading
import time
from typing import Any, Callable, Hashable, List, Optional

import torch

from swarm.runtime.cpu_turns import CpuTurns, turns_for
from swarm.runtime.threads import FreeCores, set_threads_here

logger = logging.getLogger(__name__)

PRIORITY_DECODE = 0
PRIORITY_PREFILL = 1
PRIORITY_FORWARD = 2
PRIORITY_TRAINING = 3  # training forward/backward pieces (one block of a sub-batch each): below all inference
# work that only fills idle time, because whoever needs it first does it on the spot (a prefix adoption's copy:
# `server.compute.prefix_cache.PrefixCache.adopt_later`)
PRIORITY_IDLE = 4
PRIORITY_INFERENCE = PRIORITY_DECODE
OVERLAP_MEMORY = 1.0  # seconds after tasks last overlapped during which threads adapt to the free cores
GATHER_MAX = 0.020  # longest wait (seconds) for a batch's missing sources
DUE_PERIODS = 2.0  # a source is due while its last item is younger than this many of its step periods
SAME_GROUP = 0.25  # missing sources expected within this share of a period belong to the present group
MERGE_BACKOFF = 8.0  # periods after a merging wait before the next one may start
EXPECT_MAX = 0.25  # longest wait (seconds) of a batch for sources whose items are known to be on their way


class Gatherer:
    """Per batch key: the sources (sessions) seen, their step periods, and the batch function's compute time."""

    def __init__(self, gather_max: float = GATHER_MAX):
        self.gather_max = gather_max
        self._seen: dict = {}  # key -> {source: (last time, period)}
        self._compute: dict = {}  # key -> moving average of one batch's seconds
        self._lock = threading.Lock()  # `forget` comes from other threads
        self._no_merge_until: dict = {}  # key -> time before which no merging wait starts again
        self._expected: dict = {}  # key -> {source: since when its item is on its way} (`expect`)
        self._tracked: set = set()  # keys whose sources say when they will come: no guessing from periods

    def expect(self, key: Hashable, source: Hashable, now: Optional[float] = None) -> None:
        """`source`'s next item of `key` is on its way (a session's step is in the swarm)."""
        with self._lock:
            self._tracked.add(key)
            self._expected.setdefault(key, {})[source] = time.monotonic() if now is None else now

    def unexpect(self, key: Hashable, source: Hashable) -> None:
        """`source` will not send the item it was expected to (its step failed), or the item arrived."""
        with self._lock:
            self._expected.get(key, {}).pop(source, None)

    def tracked(self, key: Hashable) -> bool:
        with self._lock:
            return key in self._tracked

    def in_flight(self, key: Hashable, present: set, now: float) -> dict:
        """Sources of a tracked `key` whose items are on their way and not in `present`, with until when a batch
        waits for them: `EXPECT_MAX` after the first present item and at most one period of the present sources;
        a source on its way for two periods already is late (say, failing over) and not waited for."""
        with self._lock:
            expected = {s: t for s, t in self._expected.get(key, {}).items() if s not in present}
            seen = self._seen.get(key, {})
            periods = [seen[s][1] for s in present if s in seen and seen[s][1] is not None]
        period = min(periods) if periods else None
        limit = EXPECT_MAX if period is None else min(EXPECT_MAX, period)
        late = 2 * (period or EXPECT_MAX)  # on its way for longer (a failover replaying history): nobody waits
        return {s: min(now + limit, since + late) for s, since in expected.items() if since + late > now}

    def note(self, key: Hashable, sources: List[Hashable], now: float) -> None:
        with self._lock:
            seen = self._seen.setdefault(key, {})
            for source in sources:
                if source is None:
                    continue
                last = seen.get(source)
                seen[source] = (now, None if last is None else now - last[0])
            if len(seen) > 64:  # forget sources that went quiet
                for source in [s for s, (t, _) in seen.items() if now - t > 10.0]:
                    del seen[source]

    def forget(self, source: Hashable) -> None:
        """A source ended (its session closed): nobody waits for it any more."""
        with self._lock:
            for seen in self._seen.values():
                seen.pop(source, None)
            for expected in self._expected.values():
                expected.pop(source, None)

    def due(self, key: Hashable, present: set, now: float) -> dict:
        """Sources of `key` expected in this round that are not in `present`, with their expected arrival."""
        with self._lock:
            return {source: last + period for source, (last, period) in self._seen.get(key, {}).items()
                    if source not in present and period is not None and now - last < DUE_PERIODS * period}

    def deadline(self, key: Hashable, present: set, missing: dict, now: float) -> float:
        """Until when a batch of the `present` sources waits for the `missing` ones (see the module docstring).

        Missing sources expected within `SAME_GROUP` of a period are this round's stragglers (the present group's,
        still on their way): the short wait is for them. The others form a group a pass or more apart; if the
        present group (stragglers included) is the smaller one, it waits for that group's arrival, at most one of
        its periods, and not again for `MERGE_BACKOFF` periods (a wait that did not merge never repeats round
        after round)."""
        short = now + self.wait_limit(key)
        if not missing or self.gather_max <= 0:
            return now
        with self._lock:
            seen = self._seen.get(key, {})
            periods = [seen[s][1] for s in present if s in seen and seen[s][1] is not None]
            if not periods or now < self._no_merge_until.get(key, 0.0):
                return short
            period = min(periods)
            later = {s: t for s, t in missing.items() if t - now > SAME_GROUP * period}
            group = set(present) | (set(missing) - set(later))
            if not later or len(group) > len(later) or (
                    len(group) == len(later) and min(map(hash, later)) > min(map(hash, group))):
                return short
            self._no_merge_until[key] = now + MERGE_BACKOFF * period
        # the other group's arrival (plus the short wait for its stragglers), at most one of our periods from now
        return max(short, min(max(later.values()) + self.wait_limit(key), now + period))

    def concurrent(self, now: float) -> bool:
        """Whether two or more sources of some key are active (concurrent sessions)."""
        with self._lock:
            return any(sum(1 for last, period in seen.values()
                           if period is not None and now - last < DUE_PERIODS * period) >= 2
                       for seen in self._seen.values())

    def wait_limit(self, key: Hashable) -> float:
        return min(self.gather_max, 0.5 * self._compute.get(key, self.gather_max))

    def computed(self, key: Hashable, seconds: float) -> None:
        old = self._compute.get(key)
        self._compute[key] = seconds if old is None else 0.8 * old + 0.2 * seconds


class TaskPool:
    def __init__(self, name: str = "compute", max_batch: int = 64, adapt_threads: bool = True,
                 gather_max: float = GATHER_MAX, turns: Optional[CpuTurns] = None):
        self._queue: "queue.PriorityQueue" = queue.PriorityQueue()
        self.gatherer = Gatherer(gather_max)
        # with machine-wide turns (swarm.runtime.cpu_turns) every task runs alone, with all threads
        self.turns = turns
        adapt_threads = adapt_threads and turns is None
        self._adapt = adapt_threads
        self._cores: Optional[FreeCores] = None  # set on the worker thread (its configured torch threads)
        self._threads = 0  # the worker thread's current torch thread count (set with `_cores`)
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
                         item: Any, source: Hashable = None, cost: int = 1,
                         budget: Optional[int] = None) -> "asyncio.Future":
        """Queue `item`; it runs as `batch_fn([items...])[i]` together with other queued items of `key`.
        `source` (a session) lets the worker wait briefly for the other sources due in the same round. `budget`:
        a batch that starts with this item takes the next queued items of `key` (in arrival order) only while the
        sum of their `cost`s stays within it; None: every queued item (up to `max_batch`)."""
        loop = asyncio.get_running_loop()
        future = loop.create_future()
        self._queue.put((priority, next(self._counter), key, loop, future, batch_fn, (item, source, cost, budget), {}))
        return future

    def call(self, priority: int, fn: Callable[..., Any], *args, **kwargs) -> Any:
        """From plain code: run `fn(*args, **kwargs)` on the worker and return its result (blocks)."""
        if threading.current_thread() is self._thread:
            return fn(*args, **kwargs)
        future: concurrent.futures.Future = concurrent.futures.Future()
        self._queue.put((priority, next(self._counter), None, None, future, fn, args, kwargs))
        return future.result()

    def call_batchable(self, priority: int, key: Hashable, batch_fn: Callable[[List[Any]], List[Any]],
                       item: Any, source: Hashable = None, cost: int = 1, budget: Optional[int] = None) -> Any:
        """From plain code: `batch_fn([items...])[i]` with other queued items of `key` (blocks); `cost` and
        `budget` as in `submit_batchable`."""
        if threading.current_thread() is self._thread:
            self.gatherer.unexpect(key, source)
            return batch_fn([item])[0]
        future: concurrent.futures.Future = concurrent.futures.Future()
        self._queue.put((priority, next(self._counter), key, None, future, batch_fn, (item, source, cost, budget), {}))
        self.gatherer.unexpect(key, source)  # it is here (a batch still waiting sees it as present)
        return future.result()

    def _take_batch(self, first) -> list:
        """`first` plus every queued task with the same batch key, waiting briefly for the sources due in this
        round (others are put back); with a budget (`first`'s), only the tasks that fit it, in arrival order: the
        first that does not fit and all after it stay queued."""
        key = first[2]
        batch, others = [first], []  # type: list, list
        budget = first[6][3]
        spent = first[6][2]  # of the budget (the first task always goes)
        missing: Optional[dict] = None
        short = deadline = 0.0
        tracked = self.gatherer.tracked(key)
        while len(batch) < self.max_batch:
            try:
                task = self._queue.get_nowait()
            except queue.Empty:
                present = {t[6][1] for t in batch}
                now = time.monotonic()
                if missing is None and tracked:  # the sources on their way, no guessing
                    missing = self.gatherer.in_flight(key, present, now)
                    deadline = max(missing.values(), default=now)
                    short = now + self.gatherer.wait_limit(key)  # other work queued: the wait stays short
                elif missing is None:  # decided once the queue is drained: who is here, who is due
                    missing = self.gatherer.due(key, present, now)
                    deadline = self.gatherer.deadline(key, present, missing, now)
                    short = now + self.gatherer.wait_limit(key)
                missing = {s: t for s, t in missing.items() if s not in present}
                # a long (merging) wait only while no other work is queued
                remaining = (deadline if not others else min(deadline, short)) - now
                if not missing or remaining <= 0:
                    break
                try:
                    task = self._queue.get(timeout=remaining)
                except queue.Empty:
                    break
            if task[2] is None or task[2] != key:
                others.append(task)
            elif budget is not None and spent + task[6][2] > budget:
                # the budget is reached: neither this task nor any later one of the key (they come out of the queue
                # in arrival order, so none overtakes it) joins this batch
                others.append(task)
                break
            else:
                batch.append(task)
                spent += task[6][2]
        for task in others:
            self._queue.put(task)
        self.gatherer.note(key, [t[6][1] for t in batch], time.monotonic())
        return batch

    def _adapt_threads(self) -> None:
        """Fewer torch threads while this pool serves concurrent work and other processes keep cores busy.

        A single session's steps never overlap here (the processes of a chain take turns): they keep all threads.
        """
        if self._cores is None:
            return
        now = time.monotonic()
        if not self._queue.empty() or self.gatherer.concurrent(now):
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
            if task[5] is None:  # shutdown marker (sorted last, after pending work)
                return
            self._execute(task)
            # not kept while waiting for the next task: its arguments (a session's KV cache) must die with the session
            del task

    def _execute(self, task) -> None:
        _, _, key, loop, future, fn, args, kwargs = task
        if key is None:
            if future.cancelled():
                return
            try:
                with self._turn():
                    result, error = fn(*args, **kwargs), None
            except BaseException as e:  # delivered to the awaiting handler
                result, error = None, e
            self.tasks_done += 1
            _deliver(loop, future, result, error)
            return
        batch = [t for t in self._take_batch(task) if not t[4].cancelled()]
        if not batch:
            return
        began = time.monotonic()
        try:
            with self._turn():
                results, error = fn([t[6][0] for t in batch]), None
        except BaseException as e:
            results, error = [None] * len(batch), e
        self.gatherer.computed(key, time.monotonic() - began)
        self.tasks_done += len(batch)
        self.batches_done += 1
        self.largest_batch = max(self.largest_batch, len(batch))
        for t, result in zip(batch, results):
            _deliver(t[3], t[4], result, error)

    def _turn(self):
        return self.turns if self.turns is not None else contextlib.nullcontext()

    def is_alive(self) -> bool:
        """Whether the worker thread still runs (a dead one is replaced by the server's self-healing)."""
        return self._thread.is_alive()

    def shutdown(self, wait: float = 0.0) -> None:
        """Stop after the queued tasks; wait up to `wait` s for the thread (a process must not exit while its
        compute thread is inside a torch op: C++ aborts with `terminate called without an active exception`)."""
        self._queue.put((float("inf"), next(self._counter), None, None, None, None, None, None))
        if wait > 0 and self._thread is not threading.current_thread():
            self._thread.join(wait)


def _deliver(loop: Optional[asyncio.AbstractEventLoop], future, result: Any, error: Optional[BaseException]) -> None:
    """Complete an asyncio future on its loop, or a concurrent future (plain callers) right here."""
    if loop is None:
        _resolve(future, result, error)
        return
    try:
        loop.call_soon_threadsafe(_resolve, future, result, error)
    except RuntimeError:
        if not loop.is_closed():
            raise
        # the loop is gone (its process or server is stopping): nobody awaits the result (say, an idle-time task's)


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
            _shared = TaskPool(name="client-compute", turns=turns_for())
        return _shared


def stop_client_pool(wait: float = 2.0) -> None:
    """Stop the client compute thread, if started, waiting up to `wait` s (before the process exits)."""
    with _shared_lock:
        pool = _shared
    if pool is not None and pool.is_alive():
        pool.shutdown(wait)
