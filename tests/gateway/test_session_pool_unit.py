"""The conversation session pool without a swarm: matching, exclusivity, LRU, TTL, limits, key isolation, and
`SessionProvider`'s fallbacks (a reused session that fails, a swarm out of cache), driven by the real `Engine.run`
over a stub of the client model (`swarm.client.api.ClientModel`) whose sessions hold tokens like `ModelSession`
does; then the whole app in-process over that stub (usage and metrics)."""
from __future__ import annotations

import threading

import pytest
import torch

from gateway.metrics import Metrics
from gateway.serving.engine import Engine
from gateway.serving.events import ChoiceDelta
from gateway.serving.runs import GenerationJob
from gateway.serving.session_pool import SessionPool, common_prefix
from gateway.serving.sessions import Lease, SessionProvider, out_of_cache
from gateway.serving.tokens import Tokens
from swarm.client.decoding.sampling import SamplingParams
from swarm.client.transport.session import SessionError
from swarm.wire.protocol import RemoteError
from tests.fixtures.pool_doubles import FakeModel, FakeSession


class Clock:
    def __init__(self):
        self.now = 1000.0

    def __call__(self):
        return self.now


def pooled(max_length: int, tokens) -> FakeSession:
    s = FakeSession(max_length)
    s.token_ids = torch.tensor([tokens])
    return s


def make_pool(**kwargs):
    clock = Clock()
    evictions = []
    defaults = dict(max_sessions=4, max_tokens=10_000, ttl=60.0)
    defaults.update(kwargs)
    pool = SessionPool(**defaults, on_evict=lambda reason, n: evictions.extend([reason] * n), clock=clock)
    return pool, clock, evictions


# ---- the pool ---------------------------------------------------------------------------------------------------
def test_common_prefix():
    t = torch.tensor
    assert common_prefix(t([1, 2, 3]), t([1, 2, 4])) == 2
    assert common_prefix(t([1, 2]), t([1, 2, 3])) == 2
    assert common_prefix(t([5]), t([1])) == 0
    assert common_prefix(t([], dtype=torch.long), t([1])) == 0


def test_longest_prefix_wins_and_checkout_is_exclusive():
    pool, clock, _ = make_pool()
    a = pooled(100, [1, 2, 3, 4])
    b = pooled(100, [1, 2, 3, 4, 5, 6])
    pool.checkin("u", a, [1, 2, 3, 4], 100)
    clock.now += 1
    pool.checkin("u", b, [1, 2, 3, 4, 5, 6], 100)  # a is a prefix of b: superseded
    assert a.closed and len(pool) == 1
    c = pooled(100, [1, 2, 9, 9])
    pool.checkin("u", c, [1, 2, 9, 9], 100)
    got = pool.checkout("u", [1, 2, 3, 4, 5, 6, 7, 8], needed=20)
    assert got.session is b and got.reused_tokens == 6 and got.held_tokens == 6
    assert len(pool) == 1  # b left the pool: a second request cannot get it
    again = pool.checkout("u", [1, 2, 3, 4, 5, 6, 7, 8], needed=20)
    assert again.session is c and again.reused_tokens == 2  # diverged, but shares half of what c holds


def test_diverged_entries_are_reused_only_for_a_large_share():
    pool, _, _ = make_pool()
    conversation = list(range(1, 21))  # 20 tokens held
    pool.checkin("u", pooled(100, conversation), conversation, 100)
    # shares only a 3-token "system prompt" with it: a new conversation does not rewind this one's cache
    assert pool.checkout("u", [1, 2, 3, 50, 51, 52], needed=10) is None
    # the same conversation with its last message edited: most of it is reused (the session rewinds)
    got = pool.checkout("u", conversation[:15] + [99, 98], needed=30)
    assert got is not None and got.reused_tokens == 15


def test_the_last_prompt_token_is_always_sent():
    pool, _, _ = make_pool()
    pool.checkin("u", pooled(100, [1, 2, 3, 4, 5]), [1, 2, 3, 4, 5], 100)
    got = pool.checkout("u", [1, 2, 3, 4, 5], needed=10)  # the same prompt again (a regeneration)
    assert got.reused_tokens == 4
    pool.checkin("u", pooled(100, [7]), [7], 100)
    assert pool.checkout("u", [7], needed=5) is None  # nothing to reuse in a 1-token prompt


def test_owners_are_isolated():
    pool, _, _ = make_pool()
    pool.checkin("key:alice", pooled(100, [1, 2, 3]), [1, 2, 3], 100)
    assert pool.checkout("key:bob", [1, 2, 3, 4], needed=10) is None
    assert pool.checkout("anonymous", [1, 2, 3, 4], needed=10) is None
    assert pool.checkout("key:alice", [1, 2, 3, 4], needed=10).reused_tokens == 3


def test_a_session_too_small_for_the_request_is_not_reused_and_outgrown_ones_close():
    pool, _, evictions = make_pool()
    small = pooled(10, [1, 2, 3, 4])
    pool.checkin("u", small, [1, 2, 3, 4], 10)
    assert pool.checkout("u", [1, 2, 3, 4, 5, 6], needed=20) is None  # continues it, but does not fit
    assert small.closed and evictions == ["outgrown"] and len(pool) == 0
    diverged = pooled(10, [1, 2, 3, 4, 8])
    pool.checkin("u", diverged, [1, 2, 3, 4, 8], 10)
    assert pool.checkout("u", [1, 2, 3, 4, 5, 6], needed=20) is None
    assert not diverged.closed and len(pool) == 1  # not the same conversation: kept


def test_lru_eviction_by_count_and_by_reserved_tokens():
    pool, clock, evictions = make_pool(max_sessions=2, max_tokens=250)
    sessions = []
    for i in range(3):
        clock.now += 1
        s = pooled(100, [10 * i + 1, 10 * i + 2])
        sessions.append(s)
        pool.checkin("u", s, [10 * i + 1, 10 * i + 2], 100)
    assert sessions[0].closed and not sessions[1].closed and evictions == ["capacity"]
    # using one makes it the most recent: the other is evicted next
    got = pool.checkout("u", [11, 12, 13], needed=50)
    clock.now += 1
    pool.checkin("u", got.session, [11, 12, 13], 100)
    clock.now += 1
    big = pooled(150, [90, 91])
    pool.checkin("u", big, [90, 91], 150)  # 100 + 150 <= 250 but 3 sessions > 2; then tokens
    assert sessions[2].closed and not sessions[1].closed and not big.closed
    assert pool.reserved_tokens == 250 and len(pool) == 2
    too_big = pooled(300, [5, 6])
    assert not pool.checkin("u", too_big, [5, 6], 300) and too_big.closed and len(pool) == 2


def test_ttl_expiry():
    pool, clock, evictions = make_pool(ttl=10)
    s = pooled(100, [1, 2, 3])
    pool.checkin("u", s, [1, 2, 3], 100)
    clock.now += 9
    assert pool.expire() == 0
    clock.now += 2
    assert pool.checkout("u", [1, 2, 3, 4], needed=10) is None  # expired entries are never handed out
    assert s.closed and evictions == ["ttl"] and len(pool) == 0


def test_evict_lru_frees_enough_and_clear_closes_everything():
    pool, clock, evictions = make_pool()
    sessions = []
    for i in range(4):
        clock.now += 1
        sessions.append(pooled(100, [i + 1]))
        pool.checkin("u", sessions[-1], [i + 1], 100 + i)
    assert pool.evict_lru(150, "out_of_cache") == 201
    assert [s.closed for s in sessions] == [True, True, False, False]
    assert pool.clear() == 2 and all(s.closed for s in sessions)
    assert evictions == ["out_of_cache"] * 2 + ["shutdown"] * 2
    late = pooled(100, [9])
    assert not pool.checkin("u", late, [9], 100) and late.closed  # closed pools take nothing


def test_disabled_pool_closes_what_it_is_given():
    pool, _, _ = make_pool(max_sessions=0)
    s = pooled(100, [1, 2])
    assert not pool.checkin("u", s, [1, 2], 100) and s.closed


def test_concurrent_checkouts_never_share_a_session():
    pool, _, _ = make_pool(max_sessions=64)
    for i in range(8):
        pool.checkin("u", pooled(100, [1, 2, 3]), [1, 2, 3], 1)  # superseded one by one: 1 left
    assert len(pool) == 1
    for i in range(1, 8):
        pool.checkin("u", pooled(100, [1, 2, 3 + i]), [1, 2, 3 + i], 1)
    assert len(pool) == 8
    got, lock = [], threading.Lock()

    def worker():
        for _ in range(20):
            c = pool.checkout("u", [1, 2, 3, 4], needed=10)
            if c is not None:
                with lock:
                    got.append(id(c.session))

    threads = [threading.Thread(target=worker) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(got) == len(set(got)) == 8 and len(pool) == 0  # each one handed out exactly once


# ---- the provider ------------------------------------------------------------------------------------------------


def make_provider(**pool_kwargs):
    model, metrics = FakeModel(), Metrics()
    defaults = dict(max_sessions=4, max_tokens=10_000, ttl=60.0)
    defaults.update(pool_kwargs)
    pool = SessionPool(**defaults, on_evict=metrics.count_eviction)
    metrics.pool = pool
    provider = SessionProvider(model, pool, metrics, headroom=32, context=500, sweep_interval=3600)
    return provider, model, metrics, pool


_TOKENS = {}


@pytest.fixture(autouse=True)
def engine_tokens(tokenizer):
    _TOKENS.setdefault("tokens", Tokens(tokenizer))


def generate(provider, prompt, max_tokens, owner="u", n=1):
    """The real `Engine.run` over the provider (greedy, up to max_tokens: the end-of-sequence token does not stop
    it). Returns (choice 0's generated ids, the lease it ran on)."""
    leases = []
    acquire = provider.acquire

    def recording(*args, **kwargs):
        leases.append(acquire(*args, **kwargs))
        return leases[-1]

    provider.acquire = recording
    engine = Engine(provider.model, _TOKENS["tokens"], provider.metrics or Metrics(), max_workers=1,
                    sessions=provider)
    events = []
    params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    try:
        engine.run(GenerationJob(prompt, params, n, owner=owner), events.append)
    finally:
        del provider.acquire
        engine.executor.shutdown(wait=False)
    out = [c.token_id for e in events if isinstance(e, ChoiceDelta) and e.index == 0 for c in e.tokens]
    return out, leases[0]


def _metric(metrics, name, labels=None):
    return metrics.registry.get_sample_value(name, labels or {}) or 0


def test_provider_reuses_a_conversation_and_sends_only_new_tokens():
    provider, model, metrics, pool = make_provider()
    turn1 = [1, 2, 3, 4, 5]
    out1, lease1 = generate(provider, turn1, 4)
    assert lease1.cached_tokens == 0 and model.sent == 5 + 3 and lease1.session.max_length == 5 + 4 + 32
    assert len(pool) == 1 and not lease1.session.closed
    turn2 = turn1 + out1 + [9, 9]
    before = model.sent
    out2, lease2 = generate(provider, turn2, 4)
    assert lease2.session is lease1.session and lease2.cached_tokens == len(turn1) + len(out1) - 1
    assert model.sent - before == (len(turn2) - lease2.cached_tokens) + 3
    fresh, _ = generate(make_provider()[0], turn2, 4)
    assert out2 == fresh  # the same tokens as without the pool
    assert _metric(metrics, "swarmgate_pool_hits_total") == 1 and _metric(metrics, "swarmgate_pool_misses_total") == 1
    assert _metric(metrics, "swarmgate_pool_reused_tokens_total") == lease2.cached_tokens
    text = metrics.render().decode()
    assert "swarmgate_pool_sessions 1.0" in text and "swarmgate_pool_cache_tokens 41.0" in text


def test_provider_does_not_pool_n_above_1_nor_ownerless_requests():
    provider, model, _, pool = make_provider()
    generate(provider, [1, 2, 3], 3, n=2)
    generate(provider, [1, 2, 3], 3, owner=None)
    assert len(pool) == 0 and all(s.closed for s in model.sessions)
    assert [s.max_length for s in model.sessions] == [6, 6]  # no headroom reserved for them


def test_provider_falls_back_to_a_fresh_session_when_a_reused_one_fails():
    provider, model, metrics, pool = make_provider()
    out1, lease1 = generate(provider, [1, 2, 3, 4], 3)
    lease1.session.fail_first = SessionError("step failed: [timeout] no step for 300s; session closed")
    lease1.session.model = model
    turn2 = [1, 2, 3, 4] + out1 + [7]
    out2, lease2 = generate(provider, turn2, 3)
    assert lease1.session.closed and lease2.session is not lease1.session and lease2.cached_tokens == 0
    assert out2 == generate(make_provider()[0], turn2, 3)[0]
    assert model.bans == set()  # the server that timed the session out is not left banned
    assert _metric(metrics, "swarmgate_pool_evictions_total", {"reason": "failed"}) == 1


def test_provider_evicts_pooled_sessions_when_the_swarm_is_out_of_cache_and_retries_once():
    provider, model, metrics, pool = make_provider()
    generate(provider, [1, 2, 3], 2)
    generate(provider, [20, 21, 22], 2)
    assert len(pool) == 2
    cause = RemoteError("out_of_cache", "out of cache: session needs 50 tokens, 10 of 100 free", "peer-A")
    model.fail_next = [SessionError(f"cannot serve blocks 0:30 after 4 tries: {cause}")]
    out, lease = generate(provider, [40, 41], 2)  # needs 2 + 2 + 32 cache tokens: one pooled session's worth
    assert len(out) == 2 and lease.cached_tokens == 0
    # the least recently used session was closed (enough for the new one), the other kept, the new one pooled
    assert model.sessions[0].closed and not model.sessions[1].closed and len(pool) == 2
    assert model.bans == set()
    assert _metric(metrics, "swarmgate_pool_evictions_total", {"reason": "out_of_cache"}) == 1
    # with nothing pooled there is nothing to free: the failure is the client's answer
    pool.clear("test")
    model.fail_next = [SessionError("cannot serve blocks 0:30: no route")]
    with pytest.raises(SessionError):
        generate(provider, [50, 51], 2)


def test_out_of_cache_detection():
    cause = RemoteError("out_of_cache", "out of cache", "p")
    assert out_of_cache(cause)
    try:
        try:
            raise cause
        except RemoteError as e:
            raise SessionError("step failed") from e
    except SessionError as wrapped:
        assert out_of_cache(wrapped)
    assert not out_of_cache(SessionError("[timeout] no step"))


def test_provider_sweeper_expires_idle_sessions():
    model, metrics = FakeModel(), Metrics()
    pool = SessionPool(4, 10_000, ttl=0.2, on_evict=metrics.count_eviction)
    provider = SessionProvider(model, pool, metrics, headroom=8, context=100, sweep_interval=0.05)
    try:
        generate(provider, [1, 2, 3], 2)
        assert len(pool) == 1
        deadline = threading.Event()
        for _ in range(100):
            if len(pool) == 0:
                break
            deadline.wait(0.05)
        assert len(pool) == 0 and model.sessions[0].closed
        assert _metric(metrics, "swarmgate_pool_evictions_total", {"reason": "ttl"}) == 1
    finally:
        provider.shutdown()


def test_lease_defaults():
    lease = Lease(session=None, n=1, needed=10)
    assert lease.owner is None and lease.cached_tokens == 0 and not lease.reused


# ---- the app in-process -------------------------------------------------------------------------------------------
class AppModel(FakeModel):
    def __init__(self, tokenizer):
        super().__init__(vocab=len(tokenizer))
        self.vocab = len(tokenizer)

    def inference_session(self, max_length):
        s = super().inference_session(max_length)
        s.vocab, s.pick = self.vocab, 997
        return s


@pytest.fixture
def pooled_app(tokenizer):
    from starlette.testclient import TestClient

    from gateway.app import create_app
    from gateway.config import GatewayConfig

    model = AppModel(tokenizer)
    app = create_app(GatewayConfig(model="fake", api_keys=["key-a", "key-b"], pool_headroom=64), model=model,
                     tokenizer=tokenizer)
    with TestClient(app) as client:
        yield client, model
    assert all(s.closed for s in model.sessions)  # shutdown closes the pooled sessions


def test_app_reports_cached_tokens_in_usage_and_metrics(pooled_app, tokenizer):
    client, model = pooled_app
    a = {"Authorization": "Bearer key-a"}
    messages = [{"role": "user", "content": "hello there"}]
    r1 = client.post("/v1/chat/completions", headers=a, json={"model": "fake", "messages": messages,
                                                              "max_tokens": 6, "temperature": 0}).json()
    assert r1["usage"]["prompt_tokens_details"] == {"cached_tokens": 0}
    messages += [{"role": "assistant", "content": r1["choices"][0]["message"]["content"]},
                 {"role": "user", "content": "and again"}]
    sent = model.sent
    body = {"model": "fake", "messages": messages, "max_tokens": 6, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}
    with client.stream("POST", "/v1/chat/completions", headers=a, json=body) as r:
        import json

        chunks = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
    usage = chunks[-1]["usage"]
    cached = usage["prompt_tokens_details"]["cached_tokens"]
    assert cached > 10 and model.sent - sent == usage["prompt_tokens"] - cached + usage["completion_tokens"] - 1
    # another key never gets that conversation's session
    r3 = client.post("/v1/chat/completions", headers={"Authorization": "Bearer key-b"},
                     json={"model": "fake", "messages": messages, "max_tokens": 6, "temperature": 0}).json()
    assert r3["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    metrics = client.get("/metrics").text
    assert "swarmgate_pool_hits_total 1.0" in metrics and "swarmgate_pool_misses_total 2.0" in metrics
    assert f"swarmgate_pool_reused_tokens_total {float(cached)}" in metrics
    assert "swarmgate_pool_sessions 2.0" in metrics


# ---- shared prefixes (--prefix_sharing) ---------------------------------------------------------------------------
def test_fresh_sessions_declare_their_prompt_with_the_owners_salt():
    """per_key: a salt per API key (a shared cache's timing would tell one key which prompts another sent); global:
    one salt; off, several rows, or no owner: nothing declared. Reused pooled sessions declare nothing new."""
    from gateway.serving.sessions import prefix_salt

    assert prefix_salt("per_key", "key:a") != prefix_salt("per_key", "key:b")
    assert prefix_salt("per_key", "key:a") == prefix_salt("per_key", "key:a")
    assert prefix_salt("per_key", "key:a") != prefix_salt("per_key", "key:a\x00lora:x")  # (servers key adapters too)
    assert prefix_salt("global", "key:a") == prefix_salt("global", "key:b") == prefix_salt("global", None)
    assert prefix_salt("off", "key:a") is None and prefix_salt("per_key", None) is None
    for sharing, pool in (("per_key", None), ("per_key", SessionPool(max_sessions=4, max_tokens=10_000, ttl=60.0)),
                          ("global", None), ("off", None)):
        model = FakeModel()
        provider = SessionProvider(model, pool, prefix_sharing=sharing)
        one = provider.acquire([1, 2, 3], 1, 4, owner="key:a")
        several = provider.acquire([1, 2, 3], 2, 4, owner="key:a")
        assert one.session.prefix_salt == prefix_salt(sharing, "key:a")
        assert several.session.prefix_salt is None
        provider.shutdown()
