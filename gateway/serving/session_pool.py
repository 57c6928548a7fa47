"""The conversation session pool: inference sessions kept open between requests, found again by their tokens.

A chat client resends the whole conversation every turn. After a request the gateway keeps its inference
session here, keyed by the exact token ids whose states the servers hold (prompt plus generated tokens, less
the last generated token, which is never fed). A later request whose prompt starts with those tokens checks
the session out and sends only the rest; the longest match wins. Where the prompt diverges partway (the
chat template renders an earlier answer differently from what was generated, or the user edited history),
the session is rewound to the common prefix (`ModelSession.feed` does it: a step below the servers' cache
length overwrites from there).

Rules (`SessionPool`, no network, thread-safe; a clock and the close function are injected for tests):
- Namespaces: an entry is only found by the same owner (a hash of the API key; anonymous is one owner).
- Exclusive: `checkout` removes the entry; a session is in the pool or in one request, never both.
- Fit: the servers reserved `max_length` tokens at open, so an entry is only handed out if its
  `max_length` holds the new prompt plus `max_tokens`. An entry that the prompt continues exactly but that
  is too small is closed at once ("outgrown": the new, larger session will replace it), which frees the
  servers' cache for that new session.
- Diverged matches: an entry whose tokens the prompt does not continue to the end is taken only when the
  common prefix covers at least `MIN_DIVERGED_SHARE` of what it holds: a new conversation that shares only a
  system prompt with another does not rewind (destroy) that conversation's cache.
- `checkin` drops the owner's entries whose tokens are a prefix of the new entry's ("superseded": the new
  one serves every request they would), then evicts least recently used entries while there are more
  than `max_sessions` or their reserved cache exceeds `max_tokens`.
- Idle entries older than `ttl` seconds are closed (`expire`, run periodically by the owner of the pool;
  keep `ttl` below the servers' idle timeout, or they close the sessions first). `evict_lru(tokens)` closes
  entries, least recently used first, until at least that much reserved cache is freed (used when the
  swarm has no room to open a new session).
Closing happens outside the lock; `on_evict(reason, count)` is told about every eviction.
"""
from __future__ import annotations

import itertools
import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple, Union

import numpy as np
import torch

logger = logging.getLogger("swarmgate.gateway")

Ids = Union[np.ndarray, torch.Tensor]
MIN_DIVERGED_SHARE = 0.5  # a diverged entry is reused only if the common prefix covers this share of it


def common_prefix(a: Ids, b: Ids) -> int:
    """Length of the common prefix of two 1-D id arrays (a torch tensor is read as a NumPy array): ~2 us where torch's
    ops took ~8, and a request's checkout and checkin compare it with every pooled entry of its owner (issue 46)."""
    a, b = np.asarray(a), np.asarray(b)
    n = min(a.shape[0], b.shape[0])
    if n == 0:
        return 0
    differ = a[:n] != b[:n]
    first = int(differ.argmax())
    return first if differ[first] else n


def ids_array(ids: Sequence[int]) -> np.ndarray:
    """[n] int64"""
    return np.fromiter(ids, dtype=np.int64, count=len(ids))


@dataclass(eq=False)  # entries compare by identity
class PoolEntry:
    session: Any
    owner: str
    tokens: np.ndarray  # [held] int64: the ids whose states the servers hold
    reserved: int  # cache tokens the servers reserved for it (batch x max_length)
    last_used: float
    serial: int = field(default=0)

    @property
    def max_length(self) -> int:
        return int(self.session.max_length)


@dataclass
class Checkout:
    session: Any
    reused_tokens: int  # leading prompt tokens the servers already hold (the session rewinds to this)
    held_tokens: int  # what the session held when it was checked out


class SessionPool:
    def __init__(self, max_sessions: int, max_tokens: int, ttl: float,
                 close: Callable[[Any], None] = lambda session: session.close(),
                 on_evict: Optional[Callable[[str, int], None]] = None,
                 clock: Callable[[], float] = time.monotonic):
        self.max_sessions, self.max_tokens, self.ttl = max_sessions, max_tokens, ttl
        self._close, self._on_evict, self._clock = close, on_evict or (lambda reason, count: None), clock
        self._entries: List[PoolEntry] = []
        self._lock = threading.Lock()
        self._serial = itertools.count()
        self.closed = False

    # ---- inspection -----------------------------------------------------------------------------------------------
    def __len__(self) -> int:
        return len(self._entries)

    @property
    def reserved_tokens(self) -> int:
        """Cache tokens the pooled sessions reserve on the servers (each server of their chains)."""
        with self._lock:
            return self._reserved()

    @property
    def held_tokens(self) -> int:
        """Tokens whose states the pooled sessions hold."""
        with self._lock:
            return sum(int(e.tokens.shape[0]) for e in self._entries)

    def _reserved(self) -> int:
        return sum(e.reserved for e in self._entries)

    def entries(self) -> List[PoolEntry]:
        with self._lock:
            return list(self._entries)

    # ---- the two operations ---------------------------------------------------------------------------------------
    def checkout(self, owner: str, prompt_ids: Sequence[int], needed: int) -> Optional[Checkout]:
        """The owner's pooled session that holds the longest prefix of `prompt_ids` and has room for `needed`
        tokens, removed from the pool; None when there is none (the caller opens a fresh session)."""
        prompt = ids_array(prompt_ids)
        with self._lock:
            evicted = self._take_expired()
            outgrown: List[Tuple[PoolEntry, str]] = []
            best, best_key = None, None
            for entry in self._entries:
                if entry.owner != owner:
                    continue
                held = int(entry.tokens.shape[0])
                common = common_prefix(entry.tokens, prompt)
                reuse = min(common, prompt.shape[0] - 1)  # the last prompt token is always sent (its logits)
                if reuse <= 0:
                    continue
                continues = common == held
                if not continues and reuse < MIN_DIVERGED_SHARE * held:
                    continue
                if entry.max_length < needed:
                    if continues:
                        outgrown.append((entry, "outgrown"))
                    continue
                key = (reuse, entry.last_used, entry.serial)
                if best_key is None or key > best_key:
                    best, best_key = entry, key
            for entry, _ in outgrown:
                self._entries.remove(entry)
            evicted += outgrown
            if best is not None:
                self._entries.remove(best)
        self._finish(evicted)
        if best is None or best_key is None:
            return None
        return Checkout(best.session, best_key[0], int(best.tokens.shape[0]))

    def checkin(self, owner: str, session: Any, tokens: Sequence[int], reserved: int) -> bool:
        """Keep `session`, whose servers hold exactly `tokens`, for later requests of `owner`. Returns False
        (and closes it) when it cannot be kept: the pool is closed or disabled, or it alone is over the limit."""
        held = ids_array(tokens)  # [n]
        if self.closed or self.max_sessions <= 0 or reserved > self.max_tokens or held.shape[0] == 0:
            reason = "shutdown" if self.closed else "capacity"
            self._finish([(PoolEntry(session, owner, held, reserved, 0.0), reason)])
            return False
        entry = PoolEntry(session, owner, held, reserved, self._clock(), next(self._serial))
        evicted: List[Tuple[PoolEntry, str]] = []
        with self._lock:
            evicted += self._take_expired()
            for other in list(self._entries):
                if other.owner == owner and common_prefix(other.tokens, held) == other.tokens.shape[0]:
                    self._entries.remove(other)
                    evicted.append((other, "superseded"))
            self._entries.append(entry)
            self._entries.sort(key=lambda e: (e.last_used, e.serial))  # least recently used first
            while len(self._entries) > self.max_sessions or self._reserved() > self.max_tokens:
                evicted.append((self._entries.pop(0), "capacity"))
        self._finish(evicted)
        return True

    # ---- hygiene --------------------------------------------------------------------------------------------------
    def expire(self) -> int:
        """Close the entries idle for longer than the TTL; returns how many."""
        with self._lock:
            evicted = self._take_expired()
        self._finish(evicted)
        return len(evicted)

    def evict_lru(self, tokens: int, reason: str) -> int:
        """Close entries, least recently used first, until their reserved cache adds up to `tokens` (or the pool
        is empty); returns the reserved cache freed."""
        evicted: List[Tuple[PoolEntry, str]] = []
        freed = 0
        with self._lock:
            self._entries.sort(key=lambda e: (e.last_used, e.serial))
            while self._entries and freed < tokens:
                entry = self._entries.pop(0)
                freed += entry.reserved
                evicted.append((entry, reason))
        self._finish(evicted)
        return freed

    def clear(self, reason: str = "shutdown") -> int:
        """Close every pooled session; with reason "shutdown" the pool also stops taking sessions."""
        if reason == "shutdown":
            self.closed = True
        with self._lock:
            evicted = [(e, reason) for e in self._entries]
            self._entries = []
        self._finish(evicted)
        return len(evicted)

    def _take_expired(self) -> List[Tuple[PoolEntry, str]]:
        now = self._clock()
        expired = [(e, "ttl") for e in self._entries if now - e.last_used > self.ttl]
        for entry, _ in expired:
            self._entries.remove(entry)
        return expired

    def _finish(self, evicted: List[Tuple[PoolEntry, str]]) -> None:
        counts: Dict[str, int] = {}
        for entry, reason in evicted:
            try:
                self._close(entry.session)
            except Exception as e:  # closing is best effort: the servers time idle sessions out anyway
                logger.warning(f"closing a pooled session ({reason}) failed: {e}")
            counts[reason] = counts.get(reason, 0) + 1
        for reason, count in counts.items():
            self._on_evict(reason, count)
