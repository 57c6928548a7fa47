"""Where a generation's session comes from and goes back to: `SessionProvider`, over a `ClientModel`.

A generation gets a `Lease` (`acquire`), sends its prompt through `prefill` (with the fallbacks described on
`SessionProvider`), steps with `step`, and hands the session back with `release`: to the conversation pool
(`gateway.serving.session_pool.SessionPool`) when it ended normally and may be reused, else it is closed. Both `prefill`
and `step` take an optional `pick`, run with the LM head in the client's batched head task (`feed_and_pick`).
A request for a LoRA adapter gets a session with that adapter; pooled sessions are kept per (owner, adapter)
(`pool_namespace`), so a conversation's cache is never reused across adapters.
"""
from __future__ import annotations

import hashlib
import logging
import threading
from dataclasses import dataclass
from typing import Any, Callable, List, Optional, Tuple, cast

import torch

from gateway.metrics import Metrics
from gateway.serving.verification import distrusted_in
from swarm.client.api import ClientModel, GenerationSession, OutputsRetracted, RemoteError, RoundSession

logger = logging.getLogger("swarmgate.gateway")


@dataclass
class Lease:
    """A session lent to one generation. `cached_tokens`: leading prompt tokens the servers already held (a pooled
    session's, or a fresh session's adopted from the servers' prefix caches: `prefix_salt`; else 0); `owner`: the
    pool namespace it may go back to (None: closed after the request)."""

    session: GenerationSession
    n: int
    needed: int  # tokens per row the generation may hold: prompt + max_tokens
    owner: Optional[str] = None
    cached_tokens: int = 0
    reused: bool = False
    adapter: Optional[str] = None  # the session's LoRA adapter (None: the base model)

    # the session as the decode loop sees it (`swarm.client.decoding.loop.DecodeSession`): `prefill` may replace it
    @property
    def max_length(self) -> int:
        return self.session.max_length

    def rewind(self, length: int) -> None:
        self.session.rewind(length)

    def settle(self) -> None:
        self.session.settle()


def pool_namespace(owner: str, adapter: Optional[str]) -> str:
    """The pool namespace of an owner's sessions with `adapter`: the base model's is the owner itself."""
    return owner if adapter is None else f"{owner}\x00lora:{adapter}"


def prefix_salt(sharing: str, owner: Optional[str]) -> Optional[str]:
    """The salt of a session's prefix pages on the servers under `--prefix_sharing` (None: its prompt is not
    declared): per_key, a hash of the owner (a hash of the API key, `gateway.api.auth.owner_of`, with the adapter's
    namespace), so that only the same key's conversations share pages; global, one salt for all."""
    if sharing == "global":
        return "global"
    if sharing == "off" or owner is None:
        return None
    return "key:" + hashlib.sha256(owner.encode("utf-8")).hexdigest()[:32]


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
    (`gateway.serving.session_pool`), an n=1 request first looks for a pooled session of its owner that holds a
    prefix of its prompt (`cached_tokens` of them are not sent again); otherwise it opens a fresh one with
    `max_length` = prompt + max_tokens + `headroom` (capped by the context), so that later turns of the
    conversation fit in it. A generation that ended normally gives its session back to the pool, keyed by the
    tokens the servers hold. Requests with n > 1 never use the pool (their batched sessions are closed). A pooled
session whose chain includes a server that spot-checks distrusted since is closed instead of reused ("distrusted").

    The first step (`prefill`) is where reuse can go wrong, and it falls back without an error the client did
    not cause: if a reused session fails (its servers dropped it, a server died), it is closed and the prompt
    goes to a fresh session; if opening a fresh session fails while the pool holds sessions (typically a
    server with no cache left: "out_of_cache"), pooled sessions are closed, least recently used first, until
    their reserved cache covers the new session, and the open is tried once more. Servers banned by the
    failed attempt are un-banned first: a server out of cache, or one that timed a pooled session out, is
    not broken.
    """

    def __init__(self, model: ClientModel, pool=None, metrics: Optional[Metrics] = None, headroom: int = 0,
                 context: Optional[int] = None, sweep_interval: Optional[float] = None,
                 prefix_sharing: str = "per_key"):
        """`prefix_sharing` (`--prefix_sharing`): which fresh sessions may adopt each other's prompt prefixes on the
        servers (`prefix_salt`)."""
        self.model, self.pool, self.metrics = model, pool, metrics
        self.prefix_sharing = prefix_sharing
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

    def open(self, max_length: int, adapter: Optional[str] = None) -> GenerationSession:
        if adapter is None:
            return self.model.inference_session(max_length=max_length)
        return self.model.inference_session(max_length=max_length, adapter=adapter)

    def acquire(self, prompt_ids: List[int], n: int, max_tokens: int, owner: Optional[str] = None,
                adapter: Optional[str] = None) -> Lease:
        """A session for `n` rows of `prompt_ids` plus up to `max_tokens` new tokens each (with LoRA `adapter`)."""
        needed = len(prompt_ids) + max_tokens
        if self.pool is None or n != 1 or owner is None or self.pool.closed:
            return Lease(self._fresh(needed, adapter, owner, n), n, needed, adapter=adapter)
        owner = pool_namespace(owner, adapter)
        found = self.pool.checkout(owner, prompt_ids, needed)
        if found is not None and distrusted_in(self.model, found.session):  # its states may be a liar's: drop it
            logger.warning("a pooled session runs through a distrusted server: closed, not reused")
            self._close(found.session)
            self._count_eviction("distrusted")
            found = None
        if found is not None:
            if self.metrics is not None:
                self.metrics.pool_hits.inc()
            return Lease(found.session, n, needed, owner, cached_tokens=found.reused_tokens, reused=True,
                         adapter=adapter)
        if self.metrics is not None:
            self.metrics.pool_misses.inc()
        return Lease(self._fresh(self._pooled_length(needed), adapter, owner, n), n, needed, owner, adapter=adapter)

    def _fresh(self, max_length: int, adapter: Optional[str], owner: Optional[str], n: int) -> GenerationSession:
        """A new session whose prompt is declared to the servers' prefix caches with the owner's salt (`prefix_salt`:
        none for a session of several rows, nor without an owner under per_key)."""
        session = self.open(max_length, adapter)
        session.prefix_salt = prefix_salt(self.prefix_sharing, owner) if n == 1 else None
        return session

    def _pooled_length(self, needed: int) -> int:
        length = needed + self.headroom
        return max(needed, min(length, self.context)) if self.context else length

    def prefill(self, lease: Lease, ids: torch.Tensor, pick: Optional[Callable[[torch.Tensor], Any]] = None,
                num_logits: int = 1, states: bool = False) -> Tuple[torch.Tensor, Any]:
        """The first step of a generation (the prompt), with the fallbacks described above: (logits [n, vocab],
        what `pick(logits)` returned, or None without a pick). `num_logits` > 1: a speculative step's. `states`:
        no LM head, (the last position's states [n, hidden], None) instead (`step`)."""
        banned_before = set(self.model.banned_peers()) if self.pool is not None else set()
        try:
            out = self.step(lease, ids, pick, num_logits, states)
        except OutputsRetracted:  # a lying server caught and left: the session is sound, the run picks again
            raise
        except Exception as e:
            if not lease.reused and (self.pool is None or len(self.pool) == 0):
                raise
            # a full check asked of the failed session (spot-checks holding text back) is asked of the next one
            check = lease.session.check_pending
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
            for peer in set(self.model.banned_peers()) - banned_before:
                self.model.unban(peer)
            length = self._pooled_length(lease.needed) if lease.owner is not None else lease.needed
            salt = getattr(lease.session, "prefix_salt", None)  # (the failed session's: same owner, same rows)
            lease.session = self.open(length, lease.adapter)
            lease.session.prefix_salt = salt
            if check:
                lease.session.check_next_step()
            out = self.step(lease, ids, pick, num_logits, states)
        if lease.cached_tokens and self.metrics is not None:
            self.metrics.pool_reused_tokens.inc(lease.cached_tokens)
        adopted = getattr(lease.session, "adopted_tokens", 0)
        if adopted and not lease.reused:  # the servers held them from an earlier conversation: cached too
            lease.cached_tokens = adopted
            if self.metrics is not None:
                self.metrics.prefix_adopted_tokens.inc(adopted)
        return out

    @staticmethod
    def step(lease: Lease, ids: torch.Tensor, pick: Optional[Callable[[torch.Tensor], Any]] = None,
             num_logits: int = 1, states: bool = False) -> Tuple[torch.Tensor, Any]:
        """A later step: the servers hold `ids` [n, len]; (logits [n, vocab], pick(logits) or None). With
        `num_logits` n > 1 (a speculative step: last token + drafts), `pick` gets the last n positions' logits.
        `states`: no LM head: (the last position's states [n, hidden], None), whose head and pick an engine round
        runs with its other rows (`ModelSession.feed_states`; `gateway.serving.runs`)."""
        if states:
            return cast(RoundSession, lease.session).feed_states(ids), None
        if num_logits > 1:
            return lease.session.feed_and_pick(ids, pick, num_logits=num_logits)
        if pick is None:
            return lease.session.feed(ids), None
        return lease.session.feed_and_pick(ids, pick)

    def release(self, lease: Lease, reusable: bool) -> None:
        """`reusable`: the generation ended normally, so the servers hold what `session.token_ids` says."""
        session = lease.session
        token_ids = session.token_ids
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
