"""One generation: a request's n choices, run as one batched session ([n, len] per step) on a worker thread; its
decode steps after the prompt run in the engine rounds (`gateway.serving.rounds`) when it can. There the prompt is
stepped on the worker thread for its last states only (`SessionProvider.prefill(states=True)`), and its first pick
is made in the next round's one LM head and pick with every other row (no LM head of its own).

`GenerationJob` describes the work (prompt, `SamplingParams`, n, deadline, pool owner, cancel flag);
`GenerationRun(job, emit, sessions, tokens, metrics, vocab_size).run()` leases a session
(`gateway.serving.sessions.SessionProvider`), runs the client's one decode loop over it (`swarm.client.api.DecodeLoop`:
the loop `DistributedModelForCausalLM.generate` runs too), emits `gateway.serving.events` as it goes, and releases the
session (back to the pool when it ended normally). The run is the loop's policy for the gateway: one `Sampler` per
choice, picking inside the client's batched LM-head task (`feed_and_pick`) as the direct client does (on this worker
thread with a grammar: its matcher stays with the request); each token taken as text (stop strings, end of
sequence, max_tokens) and streamed; text held back until spot-checked and picks redone after a retraction
(`gateway.serving.verification.RunVerification`); the cancel flag and the deadline checked before every step. With
`job.speculative` (one choice, no grammar, no spot-checks) the loop sends the last token and its drafts and the
accepted tokens are taken one by one as plain steps' would be.
"""
from __future__ import annotations

import logging
import threading
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, Callable, List, Optional, Tuple

import torch

from gateway.errors import APIError
from gateway.metrics import Metrics
from gateway.serving.events import Cancelled, ChoiceDelta, Done
from gateway.serving.rounds import EngineRounds, Member, Step
from gateway.serving.sessions import Lease, SessionProvider
from gateway.serving.textstream import TextStream
from gateway.serving.tokens import Tokens
from gateway.serving.verification import RunVerification, verification_on
from swarm.client.api import (
    DecodeLoop,
    GrammarConstraint,
    OutputsRetracted,
    RowSamplers,
    Sampler,
    SamplingParams,
    SpeculativeConfig,
    Speculator,
    TokenChoice,
    round_capable,
)

logger = logging.getLogger("swarmgate.gateway")


@dataclass
class GenerationJob:
    prompt_ids: List[int]
    params: SamplingParams
    n: int = 1
    request_id: str = field(default_factory=lambda: uuid.uuid4().hex)
    arrived: float = field(default_factory=time.monotonic)
    deadline: Optional[float] = None  # time.monotonic() after which the generation is abandoned
    owner: Optional[str] = None  # session pool namespace (a hash of the API key); None: never pooled
    adapter: Optional[str] = None  # the LoRA adapter the request named as its model (None: the base model)
    cancel: threading.Event = field(default_factory=threading.Event)
    stream: bool = False  # streamed to the client (with spot-checks, its text is held back at most a few tokens)
    speculative: Optional[SpeculativeConfig] = None  # drafting (n=1 without a grammar nor spot-checks; else plain)
    usage: Optional[Tuple[int, int, int]] = None  # once run, finished or not: (prompt, cached, generated) tokens


class GenerationRun:
    """Runs `job` to its end on the calling (worker) thread, handing events to `emit`; the decode loop's policy
    (`swarm.client.decoding.loop.DecodePolicy`) for the gateway."""

    def __init__(self, job: GenerationJob, emit: Callable[[Any], None], sessions: SessionProvider, tokens: Tokens,
                 metrics: Metrics, vocab_size: int, verify_holdback: int = 8,
                 rounds: Optional[EngineRounds] = None):
        self.sessions, self.metrics, self.rounds = sessions, metrics, rounds
        # spot-checks: text events wait until checked; picks made from retracted outputs are redone
        self.verification = RunVerification(self, emit, verification_on(sessions.model),
                                            verify_holdback if job.stream else None, len(job.prompt_ids),
                                            metrics.verify_retracted_tokens.inc)
        self.job, self.emit = job, self.verification.emit
        params, n = job.params, job.n
        self.params, self.n = params, n
        grammar = params.grammar
        self.samplers = RowSamplers([Sampler(params, len(job.prompt_ids), vocab_size, i,
                                             GrammarConstraint(tokens.grammar_tokenizer, grammar) if grammar else None)
                                     for i in range(n)])
        # Where tokens are picked. Normally in the client's batched LM-head task (`feed_and_pick`), like the direct
        # client: concurrent requests' picks run there in one task, with no hand-over back to this thread first.
        # Structured output picks here, on the worker: each step's grammar mask (llguidance, ~0.1 ms) and the
        # matcher's state stay on this request's thread instead of holding up every other session's head.
        self.pick_in_head = grammar is None
        self.texts = [TextStream(tokens.decode, params.stop, tokens.decode_stream()) for _ in range(n)]
        self.stop_ids = set(params.end_token_ids(tokens.eos_token_ids))
        self.pad = tokens.eos_token_ids[0] if tokens.eos_token_ids else 0
        self.pending: List[List[TokenChoice]] = [[] for _ in range(n)]
        self.finished = [False] * n
        self.generated = [0] * n
        self.last_step: Optional[float] = None
        self.lease: Optional[Lease] = None  # the session lent to this run (`run`)
        # speculative decoding: one choice, no grammar (its matcher advances token by token), no spot-checks (their
        # snapshots and retractions are per token); else plain steps
        speculative = job.speculative if n == 1 and grammar is None and not self.verification.enabled else None
        self.speculator = None if speculative is None else Speculator(
            speculative, vocab_size, list(tokens.eos_token_ids),
            getattr(sessions.model.config, "sliding_window", None))  # (the Hugging Face config: set or not)
        self.draft_sampling = None if params.greedy else self.samplers.samplers[0]

    def run(self) -> None:
        job, params, sessions, metrics = self.job, self.params, self.sessions, self.metrics
        prompt_len = len(job.prompt_ids)
        if params.max_tokens == 0:  # `echo` with `max_tokens: 0`: nothing to generate, no session
            for i in range(self.n):
                self._finish(i, "", "length")
            metrics.prompt_tokens.inc(prompt_len)
            job.usage = (prompt_len, 0, 0)
            self.emit(Done(prompt_len, 0, 0))
            return
        ids = torch.tensor([job.prompt_ids] * self.n, dtype=torch.long)
        lease = self.lease = sessions.acquire(job.prompt_ids, self.n, params.max_tokens, job.owner,
                                              adapter=job.adapter)
        metrics.active_sessions.inc()
        reusable = False

        def feed(ids: torch.Tensor, pick: Any, num_logits: int, first: bool) -> Tuple[torch.Tensor, Any]:
            # logits [n, vocab] float32; the first step sends the prompt (less what a pooled session holds)
            return (sessions.prefill if first else sessions.step)(lease, ids, pick, num_logits)

        try:
            loop = DecodeLoop(lease, feed, self, prompt_len, params.max_tokens, self.pad, self.speculator)
            if self.in_rounds(lease):
                member = Member(self, lease, loop, ids)
                if not loop.ended(ids):  # the prompt, on this thread (the session pool's fallbacks are here)
                    if callable(getattr(lease.session, "feed_states", None)):
                        # its states only: the first pick joins the next round's LM head and pick (issue 46)
                        self.before_step()
                        member.remaining = loop.remaining(ids)
                        states, _ = sessions.prefill(lease, ids, states=True)  # [n, hidden]
                        member.step = Step(states, landed=True)
                    else:
                        member.ids = ids = loop.step(ids)
                if member.step is not None or self.in_rounds(lease):  # (a fallback's session is of the same kind)
                    ids = self.rounds.run(member)  # type: ignore[union-attr]
                lease.settle()
            else:
                loop.run(ids)
            reusable = True
        finally:
            metrics.active_sessions.dec()
            job.usage = (prompt_len, lease.cached_tokens, sum(self.generated))  # cut or cancelled: what was done
            try:
                servers = lease.session.servers()  # who served it (after any failover), before the lease ends
            except Exception:  # noqa: BLE001 - only reported
                servers = []
            try:
                sessions.release(lease, reusable)
            except Exception as e:  # closing is best effort: the servers time idle sessions out anyway
                logger.warning(f"closing the session of request {job.request_id} failed: {e}")
        completion = sum(self.generated)
        metrics.prompt_tokens.inc(prompt_len)
        metrics.completion_tokens.inc(completion)
        if lease.cached_tokens:
            logger.info(f"request {job.request_id}: {lease.cached_tokens} of {prompt_len} prompt tokens were "
                        f"already held by {'a pooled session' if lease.reused else 'the servers (prefix pages)'}")
        self.emit(Done(prompt_len, completion, lease.cached_tokens, servers))

    def in_rounds(self, lease: Lease) -> bool:
        """Whether this run's decode steps go to the engine rounds (`gateway.serving.rounds`: not speculative
        decoding nor spot-checked runs, which keep their own loop on this thread)."""
        return self.rounds is not None and self.speculator is None and not self.verification.enabled and \
            round_capable(lease.session)

    # ---- the decode loop's policy (`swarm.client.decoding.loop.DecodePolicy`)
    # --------------------------------------------
    def picker(self, ids: torch.Tensor, remaining: List[Optional[int]]
               ) -> Callable[[torch.Tensor], List[Optional[TokenChoice]]]:
        return self.samplers.picker(ids, remaining)

    def verifier(self, ids: torch.Tensor, drafts: List[int], probs: Optional[torch.Tensor]
                 ) -> Callable[[torch.Tensor], List[List[Optional[TokenChoice]]]]:
        sampler = self.samplers.samplers[0]

        def pick(logits: torch.Tensor) -> List[List[Optional[TokenChoice]]]:  # logits [1, k + 1, vocab]
            accepted = sampler.verify(ids[0], drafts, probs, logits[0])
            self.metrics.count_speculation(len(drafts), len(accepted) - 1)
            return [[choice] for choice in accepted]

        return pick

    @staticmethod
    def tokens(picks: List[Optional[TokenChoice]]) -> List[Optional[int]]:
        return [None if choice is None else choice.token_id for choice in picks]

    def take(self, ids: torch.Tensor, picks: List[Optional[TokenChoice]], logits: torch.Tensor) -> None:
        for i, choice in enumerate(picks):
            if choice is not None and not self.finished[i]:
                self._take(i, choice)

    def retract(self, retracted: OutputsRetracted, ids: torch.Tensor) -> torch.Tensor:
        return self.verification.retract(retracted, ids)

    def before_step(self) -> None:
        if self.job.cancel.is_set():
            raise Cancelled()
        if self.job.deadline is not None and time.monotonic() > self.job.deadline:
            raise APIError(504, "The generation took longer than the gateway's generation_timeout.",
                           "timeout_error", code="generation_timeout")
        assert self.lease is not None
        self.verification.before_step(self.lease.session, all(self.finished))

    def after_step(self, ids: torch.Tensor, positions: int) -> None:
        now = time.monotonic()
        if self.last_step is None:
            self.metrics.time_to_first_token.observe(now - self.job.arrived)
        else:
            self.metrics.inter_token_latency.observe((now - self.last_step) / positions)
        self.last_step = now
        self.verification.after_step(ids)

    @property
    def unsettled(self) -> bool:
        return self.verification.unsettled  # (one more step checks what was picked)

    # ---- helpers ----------------------------------------------------------------------------------------------------
    def left(self, i: int) -> int:
        """The tokens choice i may still generate: the run's one `max_tokens` rule (a choice with none left ends with
        `length`; `RunVerification` checks the step that leaves every choice none). The loop's own bound,
        `DecodeLoop.max_new`, is the same number: it stops stepping there for every front end."""
        return self.params.max_tokens - self.generated[i]

    def _take(self, i: int, choice: TokenChoice) -> None:
        """Choice i's next token: count it, emit its text, finish the choice where it ends."""
        self.generated[i] += 1
        token, text = choice.token_id, self.texts[i]
        if token in self.stop_ids:
            self._finish(i, text.flush(), "stop")
            return
        self.pending[i].append(choice)
        delta, hit_stop = text.add(token)
        constraint = self.samplers.samplers[i].constraint
        if hit_stop:
            self._finish(i, delta, "stop")
        elif constraint is not None and constraint.complete:
            self._finish(i, delta + text.flush(), "stop")  # the structured output is complete
        elif self.left(i) <= 0:
            self._finish(i, delta + text.flush(), "length")
        elif delta:
            self.emit(ChoiceDelta(i, delta, self.pending[i]))
            self.pending[i] = []

    def _finish(self, i: int, text: str, reason: str) -> None:
        self.finished[i] = True
        self.emit(ChoiceDelta(i, text, self.pending[i], reason))
        self.pending[i] = []
