"""The server's prefix cache: the KV of prompt prefixes kept in pages after their sessions end, so that a new session
whose prompt starts the same way adopts them instead of computing them again (issue 47).

A block's keys and values at a position depend only on the tokens before it (and the adapter), so a page, the KV of
positions [i P, (i + 1) P) of one session's blocks [first, last), is named by a hash chain over the prompt's tokens:
h_0 = H(version, salt, adapter, first, last, P), h_i+1 = H(h_i, token ids of page i) (`page_digests`, in
`swarm.wire.prefix_pages`: clients compute it too, to read the servers' record summaries). The salt comes from the
client (the gateway's is a hash of the API key by default): pages of different salts or adapters are never shared. A
page holds per layer its keys (and values, unless they are views of the keys: DeepSeek's latent cache)
[1, kv_heads, P, head_dim], and the span's outputs at its positions [1, P, hidden]: a session that adopts pages
keeps those (and returns them to its client, at the opening or when asked: `server.rpc.prefix`), which keeps them as
the next span's input history (failover replay, spot-checks).

Pages live inside the server's cache budget (`server.compute.cache.CacheBudget`): a page costs the cache tokens (a
position in every block of the span, the unit sessions reserve in: `token_bytes` bytes) its tensors take, keys, values
and outputs (`page_cost`; about P for its KV, and 10% more for the outputs of the bundled model's 15-block spans). A
page is stored only where the budget has room (evicting older pages first, never while a session waits for room), and
the least recently used pages are evicted before a session would have to wait or be refused (`CacheBudget.reclaim`).
Adoption copies the pages into the new session's own buffers (`adopt`; at a server, `adopt_later`: the copy is done
by the session's first step or in idle time, whichever comes first): a session's KV stays one preallocated buffer
per block (a slot of the decode arena on the CPU, `server.compute.kv_arena`), which every attention path reads as it
is; the copy of a 1,024-token prefix of the bundled model's 30 blocks (46 MB) takes milliseconds against seconds of
prefill, and shared read-only pages measured slower here for any session that decodes more than 11 to 23 tokens
(`bench/bench_prefix_pages.py`).

Several sessions that declare the same prefix at once compute it once (single-flight): the first claims the pages
it lacks (`claim`: "in flight"), the others wait for its pages instead of computing them too (`wait_for`), then adopt
them. It never deadlocks: a waiter holds no claim while it waits at a server (it claims what is left after its wait),
clients open their hops in chain order (so a session computing a page at one server never waits at an earlier one
for a session that waits for it), the claimant's cache reservation was taken before its claim, and a page the budget
has no room for is given up like any other (its waiters then compute it themselves). It never waits long for what it
could compute itself: the wait is bounded (`wait`, the server's `--prefix_wait`), and a claim goes as soon as its
claimant will not compute it (its stream ended, a step of it failed, a rewind cut its prompt before it): its waiters
then compute the page themselves. `pages_computed` counts every page of a declared prompt a session computed (stored
or not), so a page computed by two sessions counts twice.

Declined explicitly (`PrefixCache.declines`): sessions of more than one row (beams, batches), with deep prompts, over
blocks with a sliding window (ring buffers), or of a model whose rotary picks its factors by the sequence's length
(LongRoPE: the prefix's keys depend on the whole length).
"""
from __future__ import annotations

import asyncio
import collections
import functools
import logging
import weakref
from dataclasses import dataclass
from typing import Dict, List, Optional, OrderedDict, Sequence, Tuple

import torch

from server.compute.cache import CacheBudget, SessionKV
from swarm.wire.prefix_pages import DIGEST_VERSION, page_digests  # noqa: F401 - (shared with clients)

logger = logging.getLogger(__name__)

PageKey = Tuple[int, int, bytes]  # (first block, last block, digest)


@dataclass
class Page:
    keys: List[torch.Tensor]  # per layer (or shard) [1, kv_heads, P, head_dim]
    values: Optional[List[torch.Tensor]]  # the same, None where the values are views of the keys
    outputs: torch.Tensor  # the span's outputs at the page's positions [1, P, hidden]
    cost: int = 0  # cache tokens it holds in the budget (set when stored)


@dataclass
class PrefixCounters:
    pages_hit: int = 0  # pages adopted by new sessions
    pages_computed: int = 0  # pages of declared prompts that sessions computed (not adopted), stored or not
    pages_evicted: int = 0  # pages dropped for room (or for a session that needed it)
    sessions_declined: int = 0  # sessions that declared a prefix the cache declines (`declines`)


class PrefixCache:
    """Pages of prompt prefixes by `PageKey`, least recently used first, their cache tokens held in `budget`."""

    def __init__(self, budget: CacheBudget, page_tokens: int = 64, wait: float = 30.0,
                 token_bytes: Optional[int] = None):
        if page_tokens <= 0:
            raise ValueError("page_tokens must be positive")
        if wait < 0:
            raise ValueError("wait must be >= 0")
        # wait: longest wait (s) of an opening session for the pages other sessions are computing (0: never wait)
        self.budget, self.page_tokens, self.wait = budget, page_tokens, wait
        # bytes of one cache token (the span's KV at one position: `BlockSpan.cache_bytes_per_token`); None: a
        # page's own KV is P tokens' worth (what a session over the whole span holds)
        self.token_bytes = token_bytes
        self.held_tokens = 0  # cache tokens the pages hold
        self.pages: OrderedDict[PageKey, Page] = collections.OrderedDict()
        self.counters = PrefixCounters()
        # pages a session is computing now: their event (set when done) and when they were claimed (loop time)
        self._claims: Dict[PageKey, Tuple[asyncio.Event, float]] = {}
        budget.reclaim = self.evict

    @property
    def tokens(self) -> int:
        return self.held_tokens

    def page_cost(self, kv_bytes: int, output_bytes: int) -> int:
        """Cache tokens of a page whose KV takes `kv_bytes` and whose outputs take `output_bytes` (both over its P
        positions): its bytes in cache tokens, rounded up (at least 1)."""
        if self.token_bytes:
            return max(1, -(-(kv_bytes + output_bytes) // self.token_bytes))
        return max(1, -(-self.page_tokens * (kv_bytes + output_bytes) // max(kv_bytes, 1)))

    def cost_in(self, kv: SessionKV, outputs: torch.Tensor) -> int:
        """The cost of a page cut from `kv` with outputs like `outputs` [1, >= 1, hidden] (`page_cost`)."""
        buffers = kv.keys + ([] if kv.values_in_keys is not None else kv.values)
        kv_bytes = sum(buf.numel() // buf.shape[2] * buf.element_size() for buf in buffers) * self.page_tokens
        return self.page_cost(kv_bytes, outputs.shape[-1] * outputs.element_size() * self.page_tokens)

    @staticmethod
    def bytes_of(page: Page) -> Tuple[int, int]:
        """(its KV's bytes, its outputs' bytes)."""
        tensors = page.keys + (page.values or [])
        return sum(t.numel() * t.element_size() for t in tensors), page.outputs.numel() * page.outputs.element_size()

    @staticmethod
    def declines(kv: SessionKV, batch_size: int, prompts: bool, by_length: bool) -> Optional[str]:
        """Why a session cannot use the prefix cache (None: it can)."""
        if batch_size != 1:
            return "sessions of more than one row"
        if prompts:
            return "deep prompts"
        if any(window is not None for window in kv.windows):
            return "sliding-window blocks"
        if by_length:
            return "a rotary that picks its factors by length"
        return None

    # ---- lookup and adoption --------------------------------------------------------------------------------
    def held(self, keys: Sequence[PageKey]) -> int:
        """How many leading pages of `keys` are cached (those touched: `touch`)."""
        count = 0
        for key in keys:
            if key not in self.pages:
                break
            count += 1
        self.touch(keys[:count])
        return count

    def touch(self, keys: Sequence[PageKey]) -> None:
        """Mark the held pages of a chain `keys` most recently used, its first page last: eviction, least recently
        used first, then drops a chain from its end, never a first page that the later ones need to be adopted."""
        for key in reversed(keys):
            if key in self.pages:
                self.pages.move_to_end(key)

    async def wait_for(self, keys: Sequence[PageKey], timeout: float) -> int:
        """The leading pages of `keys` cached, after waiting (up to `timeout` s in all) for those that other
        sessions are computing now; a claim older than `timeout` is not waited for (a claimant that stalls, or
        steps slowly on purpose, holds up at most the newcomers of its first `timeout` seconds)."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while True:
            count = self.held(keys)
            if count == len(keys) or keys[count] not in self._claims:
                return count
            event, claimed_at = self._claims[keys[count]]
            left = min(deadline, claimed_at + timeout) - loop.time()
            if left <= 0:
                return count
            try:
                await asyncio.wait_for(event.wait(), left)
            except asyncio.TimeoutError:
                return self.held(keys)

    def claim(self, keys: Sequence[PageKey]) -> List[PageKey]:
        """Claim the pages of `keys` neither cached nor claimed: other sessions wait for them (`wait_for`)."""
        claimed = [key for key in keys if key not in self.pages and key not in self._claims]
        now = asyncio.get_running_loop().time()
        for key in claimed:
            self._claims[key] = (asyncio.Event(), now)
        return claimed

    def unclaim(self, keys: Sequence[PageKey]) -> None:
        """The claimant is done with `keys` (stored, or it will not compute them): waiters go on."""
        for key in keys:
            claim = self._claims.pop(key, None)
            if claim is not None:
                claim[0].set()

    def pages_of(self, keys: Sequence[PageKey]) -> List[Page]:
        return [self.pages[key] for key in keys]

    @staticmethod
    def adopt(kv: SessionKV, pages: Sequence[Page], page_tokens: int) -> List[torch.Tensor]:
        """Copy `pages` into the first positions of `kv` (which then holds them); returns their outputs, one
        [1, P, hidden] per page (the pages' own tensors, never written: read-only). (Runs on the compute thread.)"""
        outputs = PrefixCache.adopt_later(kv, pages, page_tokens)
        kv.ready()
        return outputs

    @staticmethod
    def adopt_later(kv: SessionKV, pages: Sequence[Page], page_tokens: int) -> List[torch.Tensor]:
        """`kv` holds `pages` from now on, their copy into its buffers left pending (`SessionKV.ready`: the session's
        first step does it on the compute thread, unless `fill_when_idle` did it before); returns their outputs as
        `adopt` does. (Any thread: it only notes the positions; the pages' tensors stay alive with the session until
        the copy, even if the cache evicts them meanwhile.)

        Why later: a session's opening then waits for no compute. When many sessions adopt at once (a burst of users
        after a cached system prompt), a server copies for the sessions whose questions it computes now, in the same
        pass, and the others' copies wait for idle time, instead of every opening's copy going before any question
        (on the CPU most of a copy is the kernel's first touch of the slot's pages, ~16 ms for the bundled model's
        1,024 positions on a 15-block span: docs/benchmarks.md, bench_prefix_pages)."""
        held = len(pages) * page_tokens
        kv.begin_step(0)
        kv.end_step(held)
        if pages:
            kv.pending = functools.partial(_copy_pages, pages=list(pages), held=held)
        return [page.outputs for page in pages]

    # ---- storing and evicting -------------------------------------------------------------------------------
    @staticmethod
    @torch.inference_mode()
    def cut(kv: SessionKV, index: int, page_tokens: int, outputs: torch.Tensor) -> Page:
        """A copy of page `index` of `kv` (positions it holds) and of its outputs [1, >= P, hidden] at those
        positions. (Runs on the compute thread.)"""
        lo, hi = index * page_tokens, (index + 1) * page_tokens
        return Page(keys=[buf[:, :, lo:hi].clone() for buf in kv.keys],
                    values=None if kv.values_in_keys is not None else [buf[:, :, lo:hi].clone() for buf in kv.values],
                    outputs=outputs[:, lo:hi].clone())

    def room_for(self, count: int, cost: Optional[int] = None) -> int:
        """How many of `count` new pages of `cost` cache tokens each (default: P) the budget takes now, evicting
        older pages for them (none while a session waits for room: sessions come first)."""
        if self.budget.waiting or count <= 0:
            return 0
        cost = cost or self.page_tokens
        need = count * cost
        if self.budget.free_tokens < need:
            self.evict(need - self.budget.free_tokens)
        return min(count, self.budget.free_tokens // cost)

    def store(self, key: PageKey, page: Page) -> bool:
        """Keep `page` under `key` (its cost, `page_cost` of its tensors, taken from the budget); False where there is
        no room."""
        if key in self.pages:
            self.pages.move_to_end(key)
            return True
        page.cost = self.page_cost(*self.bytes_of(page))
        if not self.budget.take(page.cost):
            return False
        self.pages[key] = page
        self.held_tokens += page.cost
        return True

    def evict(self, tokens: int) -> int:
        """Drop least recently used pages until `tokens` cache tokens are free'd (or none is left); returns the
        tokens freed."""
        freed = 0
        while freed < tokens and self.pages:
            _, page = self.pages.popitem(last=False)
            self.budget.give(page.cost)
            self.held_tokens -= page.cost
            freed += page.cost
            self.counters.pages_evicted += 1
        return freed

    def clear(self) -> None:
        self.evict(self.tokens)


@torch.inference_mode()
def _copy_pages(kv: SessionKV, pages: List[Page], held: int) -> None:
    """The pages' keys (and values) into positions [0, held) of `kv`'s buffers."""
    # one `cat` per layer into the buffer's first positions (16 pages x 15 blocks x K/V of the bundled model: 30
    # calls, not 480 `copy_`s: ~1 ms less per adoption on one thread, bench/bench_prefix_pages.py)
    for buf, parts in zip(kv.keys, zip(*(page.keys for page in pages))):  # buf [1, kv_heads, length, dim]
        torch.cat(parts, dim=2, out=buf[:, :, :held])  # parts: per page [1, kv_heads, P, head_dim]
    if all(page.values is not None for page in pages):
        for buf, parts in zip(kv.values, zip(*(page.values or [] for page in pages))):
            torch.cat(parts, dim=2, out=buf[:, :, :held])


def fill_when_idle(session: "weakref.ref[SessionKV]") -> None:
    """A task for idle time (`PRIORITY_IDLE`): the pending fill of a session's cache, if the session is still open and
    its first step has not done it (a failure is logged: that session holds nothing now, `SessionKV.ready`)."""
    kv = session()
    if kv is None:
        return
    try:
        kv.ready()
    except Exception:  # noqa: BLE001 - that session's next step is refused; the server goes on
        logger.exception("copying an adopted prefix into a session's cache failed")
