"""The prefix cache's parts without processes (issue 47): page keys by salt, adapter and tokens; pages inside the cache
budget, evicted least recently used before a session waits or is refused; adoption copies a page's KV and outputs
exactly; the stream side stores only positions that are still the declared prompt (a rewind ends it). The real
swarm: tests/e2e/test_prefix_cache.py."""
from __future__ import annotations

import asyncio
import weakref
from types import SimpleNamespace

import pytest
import torch

from server.compute.cache import CacheBudget, OutOfCacheError, SessionKV
from server.compute.prefix_cache import PrefixCache, fill_when_idle, page_digests
from server.rpc.limits import RpcLimits
from server.rpc.prefix import PrefixHandler
from swarm.runtime.taskpool import TaskPool
from swarm.wire import protocol as P

TOKENS = list(range(100, 164))


def test_page_keys_differ_by_salt_adapter_and_blocks_and_chain_the_tokens():
    base = page_digests("a", None, 0, 4, 16, TOKENS)
    assert len(base) == 4 and base == page_digests("a", None, 0, 4, 16, TOKENS)
    for other in (page_digests("b", None, 0, 4, 16, TOKENS), page_digests("a", "lora", 0, 4, 16, TOKENS),
                  page_digests("a", None, 0, 3, 16, TOKENS), page_digests("a", None, 0, 4, 32, TOKENS)[:1]):
        assert not set(other) & set(base)  # never shared
    changed = TOKENS[:40] + [7] + TOKENS[41:]  # page 2 differs, so does every page after it
    mixed = page_digests("a", None, 0, 4, 16, changed)
    assert mixed[:2] == base[:2] and not set(mixed[2:]) & set(base)
    assert page_digests("a", None, 0, 4, 16, TOKENS[:31]) == base[:1]  # full pages only


def _kv(length: int = 64) -> SessionKV:
    return SessionKV(2, 1, 2, 8, length, torch.float32, torch.device("cpu"))


def _page(cache: PrefixCache, filled: SessionKV, index: int):
    return cache.cut(filled, index, cache.page_tokens, torch.randn(1, 64, 8))


def test_pages_are_evicted_least_recently_used_before_a_session_waits():
    """Pages inside the budget, each charged its keys, values and outputs (here 64 positions' KV, 256 bytes each, and
    outputs of 32 bytes each: 72 cache tokens), evicted least recently used before a session waits or is refused."""
    async def scenario():
        cost = 72
        budget = CacheBudget(4 * cost)
        cache = PrefixCache(budget, page_tokens=64)
        filled = _kv()
        assert cache.cost_in(filled, torch.zeros(1, 1, 8)) == cost
        keys = [(0, 2, bytes([i])) for i in range(4)]
        assert cache.room_for(4, cost) == 4
        for i, key in enumerate(keys):
            assert cache.store(key, _page(cache, filled, 0))
        assert budget.free_tokens == 0 and cache.tokens == 4 * cost and cache.room_for(1, cost) == 1  # the oldest went
        cache.counters.pages_evicted = 0
        cache.store((0, 2, b"new"), _page(cache, filled, 0))
        assert cache.held([keys[1]]) == 1  # touched: now the most recently used
        await budget.reserve("s", 128, timeout=0)  # no wait: two pages go for it
        assert cache.counters.pages_evicted == 2 and keys[1] in cache.pages and keys[2] not in cache.pages
        assert budget.used_tokens == 2 * cost + 128 and len(cache.pages) == 2
        with pytest.raises(OutOfCacheError):
            await budget.reserve("t", 4 * cost, timeout=0.1)  # every page went, the session's 128 still held
        assert len(cache.pages) == 0 and budget.used_tokens == 128 and cache.tokens == 0
        waiter = asyncio.create_task(budget.reserve("u", 4 * cost, timeout=5))
        await asyncio.sleep(0.05)
        assert budget.waiting == 1 and cache.room_for(1, cost) == 0  # no page takes room while a session waits
        await budget.release("s")
        await waiter
        assert budget.used_tokens == 4 * cost
        # with the span's bytes per cache token known, a page costs its bytes (a session part over fewer blocks
        # than the span: fewer tokens than P)
        assert PrefixCache(CacheBudget(1024), 64, token_bytes=512).page_cost(16384, 2048) == 36

    asyncio.run(scenario())


def test_a_chain_is_evicted_from_its_end_so_its_first_pages_stay_adoptable():
    """A chain's pages are touched first page last (`touch`, `held`): eviction drops its last pages first, never a
    first page whose absence would leave the later ones held but never adopted."""
    cost = 72
    budget = CacheBudget(4 * cost)
    cache = PrefixCache(budget, page_tokens=64)
    filled = _kv()
    chain = [(0, 2, bytes([i])) for i in range(4)]
    for key in chain:  # stored in prompt order, as a session's steps complete them
        assert cache.store(key, _page(cache, filled, 0))
    cache.touch(chain)
    assert cache.evict(cost) == cost and set(cache.pages) == set(chain[:3]) and cache.held(chain) == 3
    assert cache.evict(cost) == cost and cache.held(chain) == 2  # (held touched it again: still from the end)
    assert set(cache.pages) == set(chain[:2])


def _two_pages():
    """A cache of 16-token pages, a session part filled with 32 random positions, its outputs there, its two pages."""
    cache = PrefixCache(CacheBudget(1024), page_tokens=16)
    filled = _kv()
    filled.begin_step(0)
    for buf in filled.keys + filled.values:
        buf.normal_()
    filled.end_step(32)
    outputs = torch.randn(1, 32, 8)  # [1, positions, hidden]
    return cache, filled, outputs, [cache.cut(filled, i, 16, outputs) for i in range(2)]


def test_adoption_copies_a_pages_keys_values_and_outputs():
    cache, filled, outputs, pages = _two_pages()
    fresh = _kv()
    adopted = cache.adopt(fresh, pages, 16)
    # the pages' own outputs, one [1, P, hidden] per page (no copy: the session keeps them for rpc_prefix_outputs)
    assert fresh.length == 32 and [a.data_ptr() for a in adopted] == [p.outputs.data_ptr() for p in pages]
    assert torch.equal(torch.cat(adopted, dim=1), outputs)
    for a, b in zip(fresh.keys + fresh.values, filled.keys + filled.values):
        assert torch.equal(a[:, :, :32], b[:, :, :32])


def test_a_copy_left_pending_is_done_once_by_the_first_step_or_in_idle_time(caplog):
    """`adopt_later`: the session holds the pages at once; their copy is done by whatever touches its cache first (a
    step's `begin_step`, a beam reorder) or by the idle-time task, once: the task after a step changes nothing. A
    closed session's task does nothing; a failed copy leaves the session holding nothing (its next step refused)."""
    cache, filled, outputs, pages = _two_pages()

    def holds_pages(kv: SessionKV) -> bool:
        return all(torch.equal(a[:, :, :32], b[:, :, :32]) for a, b in zip(kv.keys + kv.values,
                                                                           filled.keys + filled.values))

    stepped = _kv()
    for buf in stepped.keys + stepped.values:
        buf.fill_(float("nan"))  # (what uncopied positions would hold: not the pages)
    adopted = cache.adopt_later(stepped, pages, 16)
    assert stepped.length == 32 and stepped.pending is not None and not holds_pages(stepped)
    assert [a.data_ptr() for a in adopted] == [p.outputs.data_ptr() for p in pages]
    stepped.begin_step(32)  # the first step: the copy, then its own positions
    assert stepped.pending is None and holds_pages(stepped)
    for buf in stepped.keys + stepped.values:
        buf[:, :, 32:40].normal_()
    stepped.end_step(8)
    own = [buf[:, :, 32:40].clone() for buf in stepped.keys + stepped.values]
    fill_when_idle(weakref.ref(stepped))  # the idle task came after the step: nothing left to do
    assert holds_pages(stepped) and stepped.length == 40
    assert all(torch.equal(a, buf[:, :, 32:40]) for a, buf in zip(own, stepped.keys + stepped.values))

    idle = _kv()
    cache.adopt_later(idle, pages, 16)
    fill_when_idle(weakref.ref(idle))
    assert idle.pending is None and holds_pages(idle) and idle.length == 32
    reordered = _kv()
    cache.adopt_later(reordered, pages, 16)
    reordered.reorder(torch.tensor([0]), 32)
    assert reordered.pending is None and holds_pages(reordered)
    closed = _kv()
    cache.adopt_later(closed, pages, 16)
    ref = weakref.ref(closed)
    del closed
    fill_when_idle(ref)  # (nothing: the session is gone)

    def broken(kv: SessionKV) -> None:
        raise RuntimeError("no memory")

    failing = _kv()
    cache.adopt_later(failing, pages, 16)
    failing.pending = broken
    with caplog.at_level("ERROR"):
        fill_when_idle(weakref.ref(failing))
    assert "adopted prefix" in caplog.text and failing.length == 0 and failing.pending is None
    failing.pending = broken
    with pytest.raises(RuntimeError):
        failing.begin_step(0)  # on a step: its error


def _handler(page_tokens: int) -> PrefixHandler:
    handler = PrefixHandler()
    handler.span = SimpleNamespace(by_length=False, hidden_size=8)  # type: ignore[assignment]
    handler.limits = RpcLimits()
    handler.pool = TaskPool()
    handler.prefix_cache = PrefixCache(CacheBudget(4096), page_tokens)
    return handler


def _opened(tokens, salt: str = "s") -> P.OpenSession:
    return P.OpenSession(session_id="x", start=0, end=2, max_length=64, prefix=P.PrefixDecl(salt=salt, tokens=tokens))


async def _step(handler: PrefixHandler, kv: SessionKV, state, start: int, seq: int) -> torch.Tensor:
    """A step's effect on the session's cache (its positions' keys written) and the stream side's note of it."""
    held = kv.length
    kv.begin_step(start)
    for buf in kv.keys + kv.values:
        buf[:, :, start:start + seq].normal_()
    kv.end_step(seq)
    output = torch.randn(1, seq, 8)
    await handler._prefix_after_step(kv, state, start, held, output)
    return output


def test_a_session_stores_the_declared_prompts_pages_and_the_next_adopts_them():
    async def scenario():
        handler = _handler(page_tokens=4)
        cache = handler.prefix_cache
        assert cache is not None
        first = _kv()
        state, adopted = await handler._prefix_open(first, _opened(TOKENS[:10]))
        assert adopted is None and state is not None and len(state.claimed) == 2
        out = await _step(handler, first, state, 0, 10)
        assert cache.counters.pages_computed == 2 and state.claimed == []
        second = _kv()
        state2, adopted = await handler._prefix_open(second, _opened(TOKENS[:12]))
        assert adopted is not None and torch.equal(adopted, out[:, :8]) and second.length == 8
        await state2.filling  # (the copy: in idle time, or by the session's first step)
        assert torch.equal(second.keys[1][:, :, :8], first.keys[1][:, :, :8])
        other, none = await handler._prefix_open(_kv(), _opened(TOKENS[:12], salt="t"))
        assert none is None  # another salt: nothing shared
        # the adopting session's first step starts before what it holds (the chain's least): not a rewind
        await _step(handler, second, state2, 4, 8)
        assert cache.counters.pages_computed == 3  # its third page
        # a later rewind ends the declaration: positions from there may be other tokens
        third = _kv()
        state3, _ = await handler._prefix_open(third, _opened(TOKENS[:40]))
        assert third.length == 12  # pages 0..2 adopted
        await _step(handler, third, state3, 0, 18)  # its first step may start anywhere before: page 3 stored
        assert cache.counters.pages_computed == 4
        await _step(handler, third, state3, 13, 10)  # a rewind to 13: nothing after it is the prompt
        assert cache.counters.pages_computed == 4 and state3.limit == 13
        handler._prefix_close(state3)
        assert handler.prefix_report().pages_hit == 2 + 3
        handler.pool.shutdown()

    asyncio.run(scenario())


def test_sessions_the_cache_cannot_serve_are_declined_and_run_as_before():
    """Several rows (beams, n > 1), deep prompts, sliding-window blocks (ring buffers), a rotary that picks its factors
    by length (LongRoPE): declined, counted, nothing adopted or claimed."""
    async def scenario():
        handler = _handler(page_tokens=4)
        cache = handler.prefix_cache
        assert cache is not None
        first = _kv()
        state, _ = await handler._prefix_open(first, _opened(TOKENS[:8]))
        await _step(handler, first, state, 0, 8)
        rows = P.OpenSession(session_id="y", start=0, end=2, max_length=64, batch_size=2,
                             prefix=P.PrefixDecl(salt="s", tokens=TOKENS[:8]))
        windowed = SessionKV(2, 1, 2, 8, 64, torch.float32, torch.device("cpu"), windows=[None, 16])
        prompts = P.OpenSession(session_id="z", start=0, end=2, max_length=64, prompts=True,
                                prefix=P.PrefixDecl(salt="s", tokens=TOKENS[:8]))
        assert await handler._prefix_open(SessionKV(2, 2, 2, 8, 64, torch.float32, torch.device("cpu")), rows) \
            == (None, None)
        assert await handler._prefix_open(windowed, _opened(TOKENS[:8])) == (None, None)
        assert await handler._prefix_open(_kv(), prompts) == (None, None)
        handler.span = SimpleNamespace(by_length=True, hidden_size=8)  # type: ignore[assignment]
        assert await handler._prefix_open(_kv(), _opened(TOKENS[:8])) == (None, None)
        report = handler.prefix_report()
        assert report.sessions_declined == 4 and report.pages_hit == 0 and report.pages_held == 2
        handler.pool.shutdown()

    asyncio.run(scenario())


def test_concurrent_sessions_wait_for_the_pages_in_flight_and_compute_them_once():
    """Single-flight: sessions that open while another computes their prompt's pages wait for them (they do not
    compute them too), then adopt them; the pages are computed (and counted) once."""
    async def scenario():
        handler = _handler(page_tokens=4)
        cache = handler.prefix_cache
        assert cache is not None
        first = _kv()
        state, _ = await handler._prefix_open(first, _opened(TOKENS[:10]))
        assert state is not None and len(state.claimed) == 2  # its two full pages: in flight
        waiters = [asyncio.ensure_future(handler._prefix_open(_kv(), _opened(TOKENS[:13]))) for _ in range(3)]
        for _ in range(5):  # every task runs as far as it can: each waits for the event of the first's page 0
            await asyncio.sleep(0)
        assert not any(w.done() for w in waiters)
        out = await _step(handler, first, state, 0, 10)
        # the first waiter to go on adopts both pages and claims its third (the same prompt's: the others wait)
        finished, _ = await asyncio.wait(waiters, return_when=asyncio.FIRST_COMPLETED)
        done = list(finished)
        assert len(done) == 1 and sum(not w.done() for w in waiters) == 2
        leader, adopted = done[0].result()
        assert adopted is not None and torch.equal(adopted, out[:, :8]) and leader.claimed == [2]
        kv = _kv()
        kv.begin_step(0)
        kv.end_step(8)
        out2 = await _step(handler, kv, leader, 8, 5)
        for w in waiters:
            if w is not done[0]:
                state_w, adopted = await w
                assert adopted is not None and state_w.claimed == [] and state_w.next_page == 3
                assert torch.equal(adopted, torch.cat([out[:, :8], out2[:, :4]], dim=1))
        assert cache.counters.pages_computed == 3 and cache.counters.pages_hit == 2 + 2 * 3
        handler.pool.shutdown()

    asyncio.run(scenario())


def test_a_waiter_computes_the_pages_itself_when_their_claimant_will_not():
    """The claimant's stream ends (or a step of it fails) before it computed its pages: its waiters go on at once and
    the first of them claims and computes them; a claim nobody gives up is waited for `wait` s at most."""
    async def scenario():
        handler = _handler(page_tokens=4)
        cache = handler.prefix_cache
        assert cache is not None
        state, _ = await handler._prefix_open(_kv(), _opened(TOKENS[:8]))
        waiter = asyncio.ensure_future(handler._prefix_open(_kv(), _opened(TOKENS[:8])))
        for _ in range(5):
            await asyncio.sleep(0)
        assert not waiter.done()
        handler._prefix_close(state)  # the claimant's stream ended (or its step failed)
        state2, adopted = await waiter
        assert adopted is None and len(state2.claimed) == 2  # nothing held: it computes (and claims) the pages
        cache.wait = 0.05  # a claim that is never given up: the waiter stops waiting and computes the page itself
        third = _kv()
        state3, adopted = await handler._prefix_open(third, _opened(TOKENS[:8]))
        assert adopted is None and state3.claimed == []  # (still claimed by the second)
        await _step(handler, third, state3, 0, 8)
        assert cache.counters.pages_computed == 2 and len(cache.pages) == 2  # stored by whoever computed them
        # a claim older than `wait` is not waited for at all (a claimant that stalls holds up only the newcomers
        # of its first `wait` seconds)
        cache.wait = 1000.0
        stalled, _ = await handler._prefix_open(_kv(), _opened(TOKENS[:12]))
        assert len(stalled.claimed) == 1  # the third page: the first two are held
        event, _ = cache._claims[stalled.keys[2]]
        cache._claims[stalled.keys[2]] = (event, asyncio.get_running_loop().time() - 2000.0)
        # (it adopts the two pages and goes on: without the age rule it would wait the 1000 s)
        late, _ = await asyncio.wait_for(handler._prefix_open(_kv(), _opened(TOKENS[:12])), 60)
        assert late.claimed == []
        handler.pool.shutdown()

    asyncio.run(scenario())
