"""The engine: runs requests' generations over the swarm on worker threads, as async streams of events; their decode
steps run together in engine rounds (`gateway.serving.rounds`) unless `engine_round` is off.

`Engine.start(job)` submits a generation (`gateway.serving.runs.GenerationRun`, one request's n choices as one batched
session) to the engine's thread pool and returns a `Generation`, an async iterator of `gateway.serving.events` events.
`Generation.cancel()` (the client went away) stops the loop before its next step, and the session is closed, which
frees the servers' cache. `RequestRun` runs an admitted request's jobs (one per prompt) under one admission slot.
Sessions come from one place, `gateway.serving.sessions.SessionProvider`, which keeps conversations' sessions in a pool
between requests when the pool is on (`Done.cached_tokens` says how many prompt tokens were reused).
"""
from __future__ import annotations

import asyncio
import logging
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, Dict, List, Optional

from gateway.metrics import Metrics
from gateway.serving.events import Cancelled, GenerationFailed, post, swarm_error
from gateway.serving.rounds import EngineRounds
from gateway.serving.runs import GenerationJob, GenerationRun
from gateway.serving.sessions import SessionProvider
from gateway.serving.tokens import Tokens
from swarm.client.api import ClientModel
from swarm.runtime.threads import serial_torch_here

logger = logging.getLogger("swarmgate.gateway")


class Engine:
    def __init__(self, model: ClientModel, tokens: Tokens, metrics: Metrics, max_workers: int,
                 sessions: Optional[SessionProvider] = None, verify_holdback: int = 8, engine_round: bool = True):
        self.model, self.tokens, self.metrics = model, tokens, metrics
        self.verify_holdback = verify_holdback  # with spot-checks: tokens a stream's text may wait for its check
        self.sessions = sessions or SessionProvider(model)
        # tensor work: swarm.runtime.taskpool.client_pool
        self.executor = ThreadPoolExecutor(max_workers=max_workers, thread_name_prefix="generation",
                                           initializer=serial_torch_here)
        self.vocab_size = min(int(model.config.vocab_size), tokens.vocab_size)
        self._active: Dict[int, GenerationJob] = {}
        # decode steps of every generation together (`gateway.serving.rounds`); None: each on its worker thread
        self.rounds = EngineRounds(self.vocab_size, metrics.round_rows.observe) if engine_round else None

    def start(self, job: GenerationJob, on_finish: Optional[Callable[[], None]] = None) -> "Generation":
        """Start the generation now; `on_finish` runs on the event loop once the worker is done."""
        return Generation(self, job, asyncio.get_running_loop(), on_finish)

    def shutdown(self) -> None:
        """Cancel every running generation (their sessions close), stop taking work, close pooled sessions."""
        for job in list(self._active.values()):
            job.cancel.set()
        if self.rounds is not None:
            self.rounds.shutdown()
        self.executor.shutdown(wait=False, cancel_futures=True)
        self.sessions.shutdown()

    def run(self, job: GenerationJob, emit: Callable[[Any], None]) -> None:
        """Run `job` on this (worker) thread, handing its events to `emit` (`gateway.serving.runs.GenerationRun`)."""
        self._active[id(job)] = job  # what `shutdown` cancels
        try:
            GenerationRun(job, emit, self.sessions, self.tokens, self.metrics, self.vocab_size,
                          self.verify_holdback, self.rounds).run()
        finally:
            self._active.pop(id(job), None)


_END = object()


class Generation:
    """The async side of one running generation: iterate it for events; `cancel()` stops it."""

    def __init__(self, engine: Engine, job: GenerationJob, loop: asyncio.AbstractEventLoop,
                 on_finish: Optional[Callable[[], None]]):
        self.job = job
        self._queue: "asyncio.Queue[Any]" = asyncio.Queue()

        def emit(event: Any) -> None:  # (with the other generations' of an engine round, together)
            post(loop, self._queue.put_nowait, event, job.cancel.set)  # loop gone (shutdown): nobody listens

        def work() -> None:
            try:
                engine.run(job, emit)
            except Cancelled:
                logger.info(f"request {job.request_id}: cancelled by the client")
            except BaseException as e:  # noqa: BLE001 - every failure becomes an error event
                emit(GenerationFailed(swarm_error(e)))
            finally:
                emit(_END)

        self.future = loop.run_in_executor(engine.executor, work)
        if on_finish is not None:
            self.future.add_done_callback(lambda _: on_finish())

    def cancel(self) -> None:
        self.job.cancel.set()

    def __aiter__(self):
        return self

    async def __anext__(self):
        event = await self._queue.get()
        if event is _END:
            self._queue.put_nowait(_END)  # later calls end too
            raise StopAsyncIteration
        return event


class RequestRun:
    """An admitted request: its jobs (one per prompt) run one after another under one admission slot.

    Iterate `events()` for `(job_index, event)`; `close()` (client gone, response finished) cancels the
    running generation; the slot is released once closed and no worker is left."""

    def __init__(self, engine: Engine, slot, jobs: List[GenerationJob]):
        self.engine, self.slot, self.jobs = engine, slot, jobs
        self.current: Optional[Generation] = None
        self.closed = False

    async def events(self):
        try:
            for k, job in enumerate(self.jobs):
                if self.closed:
                    return
                self.slot.worker_started()
                self.current = self.engine.start(job, on_finish=self.slot.worker_done)
                async for event in self.current:
                    yield k, event
                    if isinstance(event, GenerationFailed):
                        return
        finally:
            self.close()

    def close(self) -> None:
        self.closed = True
        if self.current is not None:
            self.current.cancel()
        self.slot.close()
