"""One generation: a request's n choices, run as one batched session ([n, len] per step) on a worker thread.

`GenerationJob` describes the work (prompt, `SamplingParams`, n, deadline, pool owner, cancel flag);
`GenerationRun(job, emit, sessions, tokens, metrics, vocab_size).run()` leases a session
(`gateway.serving.sessions.SessionProvider`), steps it until every choice finished, emits `gateway.serving.events` as it
goes, and releases the session (back to the pool when it ended normally). The tokens are chosen by
`swarm.client.generation` (the path `DistributedModelForCausalLM.generate` uses): one `Sampler` per choice, picking
inside the client's batched LM-head task (`feed_and_pick`) as the direct client does. With `job.speculative` (one
choice, no grammar) a step sends the last token and its drafts and yields the accepted tokens
(`swarm.client.speculative`), each taken (text, stop strings, end of sequence, max_tokens) and streamed as a plain
step's token would be.
"""
from __future__ import annotations

import logging
import threading
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, Callable, List, Optional

import torch

from gateway.errors import APIError
from gateway.metrics import Metrics
from gateway.serving.events import Cancelled, ChoiceDelta, Done
from gateway.serving.sessions import SessionProvider
from gateway.serving.textstream import TextStream
from gateway.serving.tokens import Tokens
from gateway.serving.verification import RunVerification, verification_on
from swarm.client.drafting import SpeculativeConfig
from swarm.client.generation import RowSamplers, Sampler, SamplingParams, TokenChoice
from swarm.client.grammar import GrammarConstraint
from swarm.client.speculative import Speculator
from swarm.client.verify import OutputsRetracted

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


class GenerationRun:
    """Runs `job` to its end on the calling (worker) thread, handing events to `emit`."""

    def __init__(self, job: GenerationJob, emit: Callable[[Any], None], sessions: SessionProvider, tokens: Tokens,
                 metrics: Metrics, vocab_size: int, verify_holdback: int = 8):
        self.sessions, self.metrics = sessions, metrics
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
        self.stop_ids = set(params.stop_token_ids) | (set() if params.ignore_eos else set(tokens.eos_token_ids))
        self.pad = tokens.eos_token_ids[0] if tokens.eos_token_ids else 0
        self.pending: List[List[TokenChoice]] = [[] for _ in range(n)]
        self.finished = [False] * n
        self.generated = [0] * n
        # speculative decoding: one choice, no grammar (its matcher advances token by token), no spot-checks (their
        # snapshots and retractions are per token); else plain steps
        speculative = job.speculative if n == 1 and grammar is None and not self.verification.enabled else None
        self.speculator = None if speculative is None else Speculator(
            speculative, vocab_size, list(tokens.eos_token_ids), getattr(sessions.model.config, "sliding_window", None))

    def run(self) -> None:
        job, params, sessions, metrics = self.job, self.params, self.sessions, self.metrics
        prompt_len = len(job.prompt_ids)
        if params.max_tokens == 0:  # `echo` with `max_tokens: 0`: nothing to generate, no session
            for i in range(self.n):
                self._finish(i, "", "length")
            metrics.prompt_tokens.inc(prompt_len)
            self.emit(Done(prompt_len, 0, 0))
            return
        ids = torch.tensor([job.prompt_ids] * self.n, dtype=torch.long)
        lease = sessions.acquire(job.prompt_ids, self.n, params.max_tokens, job.owner, adapter=job.adapter)
        metrics.active_sessions.inc()
        reusable, last, step = False, None, 0
        try:
            while not all(self.finished) or self.verification.unsettled:  # (unsettled: one more step checks)
                if job.cancel.is_set():
                    raise Cancelled()
                if job.deadline is not None and time.monotonic() > job.deadline:
                    raise APIError(504, "The generation took longer than the gateway's generation_timeout.",
                                   "timeout_error", code="generation_timeout")
                remaining = [None if self.finished[i] else params.max_tokens - self.generated[i]
                             for i in range(self.n)]
                blocks = self._speculative_step(lease, ids, remaining[0], step) if self.speculator else None
                if blocks is None:  # a plain step: one token per choice
                    pick = self.samplers.picker(ids, remaining)
                    head_pick = pick if self.pick_in_head else None
                    self.verification.before_step(lease.session, all(self.finished))
                    # logits [n, vocab], float32; the first step sends the prompt (less what a pooled session holds)
                    try:
                        logits, choices = (sessions.prefill if step == 0 else sessions.step)(lease, ids, head_pick)
                    except OutputsRetracted as retracted:  # a lying server was caught: pick from there again
                        ids = self.verification.retract(retracted, ids)
                        continue
                    blocks = [choices if self.pick_in_head else pick(logits)]
                    # a view of the head batch's whole logits [rows, vocab] (6 MB at 32 streams): held until this
                    # run's next step, such views keep a round's batch alive into the next one
                    del logits
                step += 1
                now = time.monotonic()
                if last is None:
                    metrics.time_to_first_token.observe(now - job.arrived)
                else:
                    metrics.inter_token_latency.observe((now - last) / len(blocks))
                last = now
                for choices in blocks:  # each token of a speculative block in turn, as plain steps would
                    next_tokens = [self.pad if choice is None or self.finished[i] else self._take(i, choice)
                                   for i, choice in enumerate(choices)]
                    ids = torch.cat([ids, torch.tensor(next_tokens, dtype=torch.long)[:, None]], dim=1)
                    if all(self.finished):
                        break
                self.verification.after_step(ids)
            reusable = True
        finally:
            metrics.active_sessions.dec()
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
                        f"already held by a pooled session")
        self.emit(Done(prompt_len, completion, lease.cached_tokens, servers))

    def _speculative_step(self, lease, ids: torch.Tensor, remaining: Optional[int], step: int
                          ) -> Optional[List[List[Optional[TokenChoice]]]]:
        """One step of [last token + drafts] for the single choice (`swarm.client.speculative`): its tokens, each as
        a step's choices; None when there is nothing to draft (the caller takes a plain step)."""
        assert self.speculator is not None and remaining is not None
        sampler = self.samplers.samplers[0]
        sampling = None if self.params.greedy else sampler
        drafts, probs = self.speculator.drafts(ids[0], remaining, lease.session.max_length - ids.shape[1], sampling)
        if not drafts:
            return None
        fed = torch.cat([ids, torch.tensor([drafts], dtype=torch.long)], dim=1)  # [1, seq + k]

        def pick(logits: torch.Tensor) -> List[TokenChoice]:  # logits [1, k + 1, vocab]
            return sampler.verify(ids[0], drafts, probs, logits[0])

        feed = self.sessions.prefill if step == 0 else self.sessions.step
        _, accepted = feed(lease, fed, pick, num_logits=len(drafts) + 1)
        self.speculator.record(len(drafts), len(accepted) - 1)
        self.metrics.count_speculation(len(drafts), len(accepted) - 1)
        lease.session.rewind(ids.shape[1] + len(accepted) - 1)  # every server drops the rejected drafts
        return [[choice] for choice in accepted]

    def _take(self, i: int, choice: TokenChoice) -> int:
        """Choice i's next token: count it, emit its text, finish the choice where it ends. Returns the token."""
        self.generated[i] += 1
        token, text = choice.token_id, self.texts[i]
        if token in self.stop_ids:
            self._finish(i, text.flush(), "stop")
            return token
        self.pending[i].append(choice)
        delta, hit_stop = text.add(token)
        constraint = self.samplers.samplers[i].constraint
        if hit_stop:
            self._finish(i, delta, "stop")
        elif constraint is not None and constraint.complete:
            self._finish(i, delta + text.flush(), "stop")  # the structured output is complete
        elif self.generated[i] >= self.params.max_tokens:
            self._finish(i, delta + text.flush(), "length")
        elif delta:
            self.emit(ChoiceDelta(i, delta, self.pending[i]))
            self.pending[i] = []
        return token

    def _finish(self, i: int, text: str, reason: str) -> None:
        self.finished[i] = True
        self.emit(ChoiceDelta(i, text, self.pending[i], reason))
        self.pending[i] = []
