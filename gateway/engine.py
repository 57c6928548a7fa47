"""Running one request's generation over the swarm, on a worker thread, as a stream of events.

`Engine.start(job)` submits the generation to the engine's thread pool and returns a `Generation`, an async
iterator of `ChoiceDelta` events (text deltas that never split a character nor leak a stop string, with the
tokens they cover for logprobs, and each choice's `finish_reason`), then one `Done` with the token counts.
A failure becomes a `GenerationFailed` event carrying an `APIError`. `Generation.cancel()` (the client went
away) stops the loop before its next step, and the session is closed, which frees the servers' cache.

The n choices of a request run as one batched session ([n, len] per step). Sessions are obtained and
released in exactly one place, `SessionProvider`, which keeps conversations' sessions in a
`gateway.session_pool.SessionPool` between requests when the pool is on: a new turn then sends only the
tokens that the servers do not hold yet (`Done.cached_tokens` says how many prompt tokens were reused).
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
from swarm.wire.protocol import RemoteError
from swarm.client.routing import RoutingError
from swarm.client.session import SessionError
from swarm.runtime.threads import serial_torch_here

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
    cached_tokens: int = 0  # prompt tokens a pooled session already held (not sent to the servers again)


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
    owner: Optional[str] = None  # session pool namespace (a hash of the API key); None: never pooled
    cancel: threading.Event = field(default_factory=threading.Event)


class Cancelled(Exception):
    pass


# ---- sessions -------------------------------------------------------------------------------------------------
@dataclass
class Lease:
    """A session lent to one generation. `cached_tokens`: leading prompt tokens the servers already held (0 for
    a fresh session); `owner`: the pool namespace it may go back to (None: closed after the request)."""

    session: Any
    n: int
    needed: int  # tokens per row the generation may hold: prompt + max_tokens
    owner: Optional[str] = None
    cached_tokens: int = 0
    reused: bool = False


def out_of_cache(error: BaseException) -> bool:
    """Whether a failure carries a server's "out of cache" reply (as the error, its cause or in its text)."""
    seen = set()
    e: Optional[BaseException] = error
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        if isinstance(e, RemoteError) and e.code == "out_of_cache":
            return True
        if "out_of_cache" in str(e) or "out of cache" in str(e):
            return True
        e = e.__cause__ or e.__context__
    return False


class SessionProvider:
    """Where sessions come from and go back to: the one place sessions are opened, reused and closed.

    Without a pool every request opens a fresh session and closes it at the end. With a `SessionPool`
    (`gateway.session_pool`), an n=1 request first looks for a pooled session of its owner that holds a
    prefix of its prompt (`cached_tokens` of them are not sent again); otherwise it opens a fresh one with
    `max_length` = prompt + max_tokens + `headroom` (capped by the context), so that later turns of the
    conversation fit in it. A generation that ended normally gives its session back to the pool, keyed by the
    tokens the servers hold. Requests with n > 1 never use the pool (their batched sessions are closed).

    The first step (`prefill`) is where reuse can go wrong, and it falls back without an error the client did
    not cause: if a reused session fails (its servers dropped it, a server died), it is closed and the prompt
    goes to a fresh session; if opening a fresh session fails while the pool holds sessions (typically a
    server with no cache left: "out_of_cache"), pooled sessions are closed, least recently used first, until
    their reserved cache covers the new session, and the open is tried once more. Servers banned by the
    failed attempt are un-banned first: a server out of cache, or one that timed a pooled session out, is
    not broken.
    """

    def __init__(self, model, pool=None, metrics: Optional[Metrics] = None, headroom: int = 0,
                 context: Optional[int] = None, sweep_interval: Optional[float] = None):
        self.model, self.pool, self.metrics = model, pool, metrics
        self.headroom, self.context = headroom, context
        self._stop = threading.Event()
        if pool is not None:
            interval = sweep_interval or min(5.0, max(0.05, pool.ttl / 4))
            threading.Thread(target=self._sweep, args=(interval,), name="session-pool-ttl", daemon=True).start()

    def _sweep(self, interval: float) -> None:
        while not self._stop.wait(interval):
            try:
                self.pool.expire()
            except Exception as e:  # never let the sweeper die
                logger.warning(f"expiring pooled sessions failed: {e}")

    def open(self, max_length: int):
        return self.model.inference_session(max_length=max_length)

    def acquire(self, prompt_ids: List[int], n: int, max_tokens: int, owner: Optional[str] = None) -> Lease:
        """A session for `n` rows of `prompt_ids` plus up to `max_tokens` new tokens each."""
        needed = len(prompt_ids) + max_tokens
        if self.pool is None or n != 1 or owner is None or self.pool.closed:
            return Lease(self.open(needed), n, needed)
        found = self.pool.checkout(owner, prompt_ids, needed)
        if found is not None:
            if self.metrics is not None:
                self.metrics.pool_hits.inc()
            return Lease(found.session, n, needed, owner, cached_tokens=found.reused_tokens, reused=True)
        if self.metrics is not None:
            self.metrics.pool_misses.inc()
        return Lease(self.open(self._pooled_length(needed)), n, needed, owner)

    def _pooled_length(self, needed: int) -> int:
        length = needed + self.headroom
        return max(needed, min(length, self.context)) if self.context else length

    def prefill(self, lease: Lease, ids: torch.Tensor) -> torch.Tensor:
        """The first step of a generation (the prompt), with the fallbacks described above."""
        banned_before = set(self._banned()) if self.pool is not None else set()
        try:
            logits = lease.session.feed(ids)
        except Exception as e:
            if not lease.reused and (self.pool is None or len(self.pool) == 0):
                raise
            self._close(lease.session)
            if lease.reused:
                logger.warning(f"a pooled session failed on reuse ({type(e).__name__}: {e}); "
                               f"sending the whole prompt to a fresh session")
                self._count_eviction("failed")
                lease.reused, lease.cached_tokens = False, 0
            else:
                reason = "out_of_cache" if out_of_cache(e) else "open_failed"
                freed = self.pool.evict_lru(lease.n * self._pooled_length(lease.needed), reason)
                logger.warning(f"opening a session failed ({type(e).__name__}: {e}); closed pooled sessions "
                               f"holding {freed} cache tokens, trying once more")
            self._unban(set(self._banned()) - banned_before)
            length = self._pooled_length(lease.needed) if lease.owner is not None else lease.needed
            lease.session = self.open(length)
            logits = lease.session.feed(ids)
        if lease.cached_tokens and self.metrics is not None:
            self.metrics.pool_reused_tokens.inc(lease.cached_tokens)
        return logits

    def release(self, lease: Lease, reusable: bool) -> None:
        """`reusable`: the generation ended normally, so the servers hold what `session.token_ids` says."""
        session = lease.session
        token_ids = getattr(session, "token_ids", None)
        if (not reusable or lease.owner is None or self.pool is None or token_ids is None
                or token_ids.shape[0] != 1):
            self._close(session)
            return
        self.pool.checkin(lease.owner, session, token_ids[0].tolist(), lease.n * int(session.max_length))

    def shutdown(self) -> None:
        self._stop.set()
        if self.pool is not None:
            self.pool.clear("shutdown")

    # ---- helpers --------------------------------------------------------------------------------------------------
    def _close(self, session) -> None:
        try:
            session.close()
        except Exception as e:  # closing is best effort: the servers time idle sessions out anyway
            logger.warning(f"closing a session failed: {e}")

    def _count_eviction(self, reason: str) -> None:
        if self.metrics is not None:
            self.metrics.count_eviction(reason)

    def _banned(self) -> List[str]:
        banned = getattr(getattr(self.model, "manager", None), "banned", None)
        try:
            return list(banned()) if callable(banned) else []
        except Exception:
            return []

    def _unban(self, peers) -> None:
        mark_ok = getattr(getattr(self.model, "manager", None), "mark_ok", None)
        for peer in peers if callable(mark_ok) else ():
            mark_ok(peer)


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
        self.executor = ThreadPoolExecutor(max_workers=max_workers, thread_name_prefix="generation",
                                           initializer=serial_torch_here)  # tensor work: swarm.runtime.taskpool.client_pool
        self.vocab_size = min(int(model.config.vocab_size), tokens.vocab_size)
        self._active: Dict[int, GenerationJob] = {}

    def start(self, job: GenerationJob, on_finish: Optional[Callable[[], None]] = None) -> "Generation":
        """Start the generation now; `on_finish` runs on the event loop once the worker is done."""
        return Generation(self, job, asyncio.get_running_loop(), on_finish)

    def shutdown(self) -> None:
        """Cancel every running generation (their sessions close), stop taking work, close pooled sessions."""
        for job in list(self._active.values()):
            job.cancel.set()
        self.executor.shutdown(wait=False, cancel_futures=True)
        self.sessions.shutdown()

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
            lease = self.sessions.acquire(job.prompt_ids, n, params.max_tokens, job.owner)
        except BaseException:
            self._active.pop(id(job), None)
            raise
        self.metrics.active_sessions.inc()
        reusable, last = False, None
        try:
            for step in range(params.max_tokens):
                if job.cancel.is_set():
                    raise Cancelled()
                if job.deadline is not None and time.monotonic() > job.deadline:
                    raise APIError(504, "The generation took longer than the gateway's generation_timeout.",
                                   "timeout_error", code="generation_timeout")
                # [n, vocab], float32; the first step sends the prompt (less what a pooled session holds)
                logits = self.sessions.prefill(lease, ids) if step == 0 else lease.session.feed(ids)
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
                self.sessions.release(lease, reusable)
            except Exception as e:  # closing is best effort: the servers time idle sessions out anyway
                logger.warning(f"closing the session of request {job.request_id} failed: {e}")
        self.metrics.prompt_tokens.inc(prompt_len)
        self.metrics.completion_tokens.inc(sum(generated))
        if lease.cached_tokens:
            logger.info(f"request {job.request_id}: {lease.cached_tokens} of {prompt_len} prompt tokens were "
                        f"already held by a pooled session")
        emit(Done(prompt_len, sum(generated), lease.cached_tokens))


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
