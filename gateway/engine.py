"""Running one request's generation over the swarm, on a worker thread, as a stream of events.

`Engine.start(job)` submits the generation to the engine's thread pool and returns a `Generation`, an async
iterator of `ChoiceDelta` events (text deltas that never split a character nor leak a stop string, with the
tokens they cover for logprobs, and each choice's `finish_reason`), then one `Done` with the token counts.
A failure becomes a `GenerationFailed` event carrying an `APIError`. `Generation.cancel()` (the client went
away) stops the loop before its next step, and the session is closed, which frees the servers' cache.

The n choices of a request run as one batched session ([n, len] per step). Sessions are obtained and
released in exactly one place, `SessionProvider`; a pool that keeps conversations' caches can replace it.
"""
from __future__ import annotations

import asyncio
import logging
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional

import torch
from hivemind.p2p import P2PDaemonError, P2PHandlerError

from gateway.errors import APIError, internal, unavailable
from gateway.jsonmode import JsonConstraint
from gateway.metrics import Metrics
from gateway.sampling import Sampler, SamplingParams, TokenChoice
from gateway.textstream import TextStream
from gateway.tokens import Tokens
from swarm.protocol import RemoteError
from swarm.routing import RoutingError
from swarm.session import SessionError

logger = logging.getLogger("swarmgate.gateway")


# ---- events ---------------------------------------------------------------------------------------------------
@dataclass
class ChoiceDelta:
    index: int
    text: str
    tokens: List[TokenChoice] = field(default_factory=list)
    finish_reason: Optional[str] = None


@dataclass
class Done:
    prompt_tokens: int
    completion_tokens: int


@dataclass
class GenerationFailed:
    error: APIError


@dataclass
class GenerationJob:
    prompt_ids: List[int]
    params: SamplingParams
    n: int = 1
    request_id: str = field(default_factory=lambda: uuid.uuid4().hex)
    arrived: float = field(default_factory=time.monotonic)
    deadline: Optional[float] = None  # time.monotonic() after which the generation is abandoned
    cancel: threading.Event = field(default_factory=threading.Event)


class Cancelled(Exception):
    pass


# ---- sessions -------------------------------------------------------------------------------------------------
class SessionProvider:
    """Where sessions come from: a fresh session per request, closed when the request ends."""

    def __init__(self, model):
        self.model = model

    def acquire(self, input_ids: torch.Tensor, max_length: int):
        """A session able to hold `max_length` tokens per row of `input_ids` [n, prompt_len]."""
        return self.model.inference_session(max_length=max_length)

    def release(self, session, reusable: bool) -> None:
        """`reusable`: the generation ended normally (a pool may keep the session); closed here."""
        session.close()


def swarm_error(e: BaseException) -> APIError:
    """The client-facing error for a failure of the swarm (routing, a server, a timeout)."""
    if isinstance(e, APIError):
        return e
    if isinstance(e, RoutingError):
        return unavailable(f"The swarm cannot serve this model right now: {e}", code="swarm_unavailable")
    if isinstance(e, (SessionError, RemoteError, P2PDaemonError, P2PHandlerError, TimeoutError, OSError)):
        return unavailable(f"The swarm failed during generation: {type(e).__name__}: {e}", code="swarm_error")
    logger.error("generation failed", exc_info=e)
    return internal()


# ---- the engine -----------------------------------------------------------------------------------------------
class Engine:
    def __init__(self, model, tokens: Tokens, metrics: Metrics, max_workers: int,
                 sessions: Optional[SessionProvider] = None):
        self.model, self.tokens, self.metrics = model, tokens, metrics
        self.sessions = sessions or SessionProvider(model)
        self.executor = ThreadPoolExecutor(max_workers=max_workers, thread_name_prefix="generation")
        self.vocab_size = min(int(model.config.vocab_size), tokens.vocab_size)
        self._active: Dict[int, GenerationJob] = {}

    def start(self, job: GenerationJob, on_finish: Optional[Callable[[], None]] = None) -> "Generation":
        """Start the generation now; `on_finish` runs on the event loop once the worker is done."""
        return Generation(self, job, asyncio.get_running_loop(), on_finish)

    def shutdown(self) -> None:
        """Cancel every running generation (their sessions close) and stop taking work."""
        for job in list(self._active.values()):
            job.cancel.set()
        self.executor.shutdown(wait=False, cancel_futures=True)

    # ---- the worker ---------------------------------------------------------------------------------------------
    def run(self, job: GenerationJob, emit: Callable[[Any], None]) -> None:
        params, n, prompt_len = job.params, job.n, len(job.prompt_ids)
        constraint = (lambda: JsonConstraint(self.tokens.token_bytes, self.tokens.encode, self.tokens.first_bytes)
                      ) if params.json_mode else None
        samplers = [Sampler(params, prompt_len, self.vocab_size, i, constraint() if constraint else None)
                    for i in range(n)]
        texts = [TextStream(self.tokens.decode, params.stop) for _ in range(n)]
        stop_ids = set(params.stop_token_ids) | (set() if params.ignore_eos else set(self.tokens.eos_token_ids))
        pad = self.tokens.eos_token_ids[0] if self.tokens.eos_token_ids else 0
        pending: List[List[TokenChoice]] = [[] for _ in range(n)]
        finished = [False] * n
        forced = [False] * n
        generated = [0] * n
        ids = torch.tensor([job.prompt_ids] * n, dtype=torch.long)

        def finish(i: int, text: str, reason: str) -> None:
            finished[i] = True
            emit(ChoiceDelta(i, text, pending[i], reason))
            pending[i] = []

        self._active[id(job)] = job
        try:
            session = self.sessions.acquire(ids, prompt_len + params.max_tokens)
        except BaseException:
            self._active.pop(id(job), None)
            raise
        self.metrics.active_sessions.inc()
        reusable, last = False, None
        try:
            for _ in range(params.max_tokens):
                if job.cancel.is_set():
                    raise Cancelled()
                if job.deadline is not None and time.monotonic() > job.deadline:
                    raise APIError(504, "The generation took longer than the gateway's generation_timeout.",
                                   "timeout_error", code="generation_timeout")
                logits = session.feed(ids)  # [n, vocab], float32
                now = time.monotonic()
                if last is None:
                    self.metrics.time_to_first_token.observe(now - job.arrived)
                else:
                    self.metrics.inter_token_latency.observe(now - last)
                last = now
                next_tokens = []
                for i in range(n):
                    if finished[i]:
                        next_tokens.append(pad)
                        continue
                    choice = samplers[i].choose(ids[i], logits[i], params.max_tokens - generated[i])
                    generated[i] += 1
                    forced[i] |= choice.forced
                    token = choice.token_id
                    next_tokens.append(token)
                    if token in stop_ids:
                        finish(i, texts[i].flush(), "stop")
                        continue
                    pending[i].append(choice)
                    delta, hit_stop = texts[i].add(token)
                    if hit_stop:
                        finish(i, delta, "stop")
                    elif samplers[i].constraint is not None and samplers[i].constraint.complete:
                        finish(i, delta + texts[i].flush(), "length" if forced[i] else "stop")
                    elif generated[i] >= params.max_tokens:
                        finish(i, delta + texts[i].flush(), "length")
                    elif delta:
                        emit(ChoiceDelta(i, delta, pending[i]))
                        pending[i] = []
                if all(finished):
                    break
                ids = torch.cat([ids, torch.tensor(next_tokens, dtype=torch.long)[:, None]], dim=1)
            reusable = True
        finally:
            self._active.pop(id(job), None)
            self.metrics.active_sessions.dec()
            try:
                self.sessions.release(session, reusable)
            except Exception as e:  # closing is best effort: the servers time idle sessions out anyway
                logger.warning(f"closing the session of request {job.request_id} failed: {e}")
        self.metrics.prompt_tokens.inc(prompt_len)
        self.metrics.completion_tokens.inc(sum(generated))
        emit(Done(prompt_len, sum(generated)))


_END = object()


class Generation:
    """The async side of one running generation: iterate it for events; `cancel()` stops it."""

    def __init__(self, engine: Engine, job: GenerationJob, loop: asyncio.AbstractEventLoop,
                 on_finish: Optional[Callable[[], None]]):
        self.job = job
        self._queue: "asyncio.Queue[Any]" = asyncio.Queue()

        def emit(event: Any) -> None:
            try:
                loop.call_soon_threadsafe(self._queue.put_nowait, event)
            except RuntimeError:  # the event loop is gone (shutdown): nobody is listening
                job.cancel.set()

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
