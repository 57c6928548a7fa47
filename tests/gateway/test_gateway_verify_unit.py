"""The gateway's side of spot-checks (`gateway.serving.verification`) without a swarm: the real `Engine.run` over a
stand-in session that lies for a few steps and then retracts them (what `swarm.client.model.model_session.ModelSession`
raises when a check outvotes a server): the response is the honest text, text is never emitted before a full check
covers it, streams wait at most `holdback` tokens, and a pooled session through a distrusted server is not reused. The
whole path on real processes is in `tests/gateway/test_gateway_verify.py`."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from gateway.errors import APIError
from gateway.metrics import Metrics
from gateway.serving.engine import Engine
from gateway.serving.events import ChoiceDelta
from gateway.serving.runs import GenerationJob
from gateway.serving.session_pool import SessionPool
from gateway.serving.sessions import SessionProvider
from gateway.serving.tokens import Tokens
from swarm.client.decoding.sampling import SamplingParams
from swarm.client.transport.verify import OutputsRetracted, VerifyStats
from tests.fixtures.client_doubles import StubClientModel, StubSession

PICK = 50  # the stand-in "model" picks among PICK ids
VOCAB = 1100


def honest_next(token: int) -> int:
    return (token + 1) % PICK + 1000  # ids of whole words, none repeated within PICK tokens


class LyingSession(StubSession):
    """Holds the ids it is fed (like `ModelSession`). From feed `lie_from` on its outputs are wrong (another next
    token); at feed `reveal` it retracts them: holds only the positions before the first wrong one and raises
    `OutputsRetracted`. Records, at each feed, whether a full check was asked and how many tokens had been emitted."""

    def __init__(self, max_length: int, lie_from=None, reveal=None, emitted=None, peers=("peer-A",)):
        self.max_length, self.lie_from, self.reveal = max_length, lie_from, reveal
        self.token_ids = None
        self.feeds, self.lie_position = 0, None
        self.full_checks, self.emitted, self.emitted_at_feed = [], emitted, []
        self.asked, self.closed, self.peers = False, False, list(peers)

    @property
    def check_pending(self) -> bool:
        return self.asked

    def check_next_step(self) -> bool:
        self.asked = True
        return True

    def servers(self):
        return self.peers

    def feed(self, ids: torch.Tensor) -> torch.Tensor:
        self.feeds += 1
        self.full_checks.append(self.asked)
        sent = sum(len(e.tokens) for e in self.emitted or () if isinstance(e, ChoiceDelta) and e.index == 0)
        self.emitted_at_feed.append((ids.shape[1], sent))
        if self.feeds == self.lie_from:
            self.lie_position = ids.shape[1] - 1  # this step's output (at the last fed position) is the first lie
        if self.feeds == self.reveal:
            self.token_ids = ids[:, :self.lie_position].clone()
            raise OutputsRetracted(self.lie_position)  # (a full check asked for stays asked, as in InferenceSession)
        self.asked = False
        self.token_ids = ids.clone()
        lying = self.lie_position is not None and self.feeds >= self.lie_from and self.feeds < (self.reveal or 1 << 30)
        logits = torch.full((ids.shape[0], VOCAB), -10.0)
        for row in range(ids.shape[0]):
            token = honest_next(int(ids[row, -1]))
            logits[row, token + 1 if lying else token] = 10.0
        return logits

    def feed_and_pick(self, ids, pick):
        logits = self.feed(ids)
        return logits, pick(logits)

    def close(self):
        self.closed = True


class StubModel(StubClientModel):
    """The part of `swarm.client.api.ClientModel` the engine uses, with spot-checks on (`verify_stats`)."""

    def __init__(self, **session_kwargs):
        self.config = SimpleNamespace(vocab_size=VOCAB, max_position_embeddings=2048)
        self.stats = VerifyStats()
        self.session_kwargs = session_kwargs
        self.sessions = []

    def verify_stats(self):
        return self.stats

    def inference_session(self, max_length, adapter=None):
        self.sessions.append(LyingSession(max_length, **self.session_kwargs))
        return self.sessions[-1]

    def banned_peers(self):
        return []


@pytest.fixture(scope="module")
def tokens(tokenizer):
    return Tokens(tokenizer)


def run(model, tokens, prompt, max_tokens, stream, holdback=4, provider=None, owner=None, n=1, stop=()):
    """The real `Engine.run`; returns (each choice's emitted token ids, the events)."""
    metrics = Metrics()
    provider = provider or SessionProvider(model, metrics=metrics)
    engine = Engine(model, tokens, metrics, max_workers=1, sessions=provider, verify_holdback=holdback)
    events: list = []
    model.session_kwargs["emitted"] = events
    params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True, stop_token_ids=list(stop))
    try:
        engine.run(GenerationJob(prompt, params, n, owner=owner, stream=stream), events.append)
    finally:
        engine.executor.shutdown(wait=False)
    out = [[c.token_id for e in events if isinstance(e, ChoiceDelta) and e.index == i for c in e.tokens]
           for i in range(n)]
    return out, events, metrics


def honest(prompt, max_tokens):
    out, last = [], prompt[-1]
    for _ in range(max_tokens):
        last = honest_next(last)
        out.append(last)
    return out


@pytest.mark.parametrize("ending", ["length", "stop"])
@pytest.mark.parametrize("stream", [True, False])
def test_retracted_picks_are_redone_and_never_emitted(tokens, stream, ending):
    prompt = [5, 6, 7]
    model = StubModel(lie_from=4, reveal=6)  # lies at feeds 4 and 5, caught at feed 6
    stop = [honest(prompt, 12)[9]] if ending == "stop" else []  # the tenth pick ends it
    out, _, metrics = run(model, tokens, prompt, 12, stream, holdback=8, n=2, stop=stop)
    expected = honest(prompt, 12)[:9] if stop else honest(prompt, 12)
    assert out == [expected] * 2  # the wrong picks never went out; the text is the honest one
    session = model.sessions[0]
    assert metrics.registry.get_sample_value("swarmgate_verify_retracted_tokens_total") == 2
    # the last step checks every span: the one max_tokens makes the last, or one more after a stop (it feeds the
    # last picks only to check them)
    assert session.full_checks[-1]
    assert session.token_ids.shape[1] == len(prompt) + (10 if stop else 11)
    if not stream:  # held to the end: one full check
        assert sum(session.full_checks) == 1


def test_streams_wait_at_most_holdback_tokens_for_a_full_check(tokens):
    prompt, holdback = [9, 8], 3
    model = StubModel()
    out, _, _ = run(model, tokens, prompt, 10, True, holdback=holdback)
    assert out == [honest(prompt, 10)]
    session = model.sessions[0]
    for length, emitted in session.emitted_at_feed:  # tokens picked but not yet emitted, as each step starts
        picked = length - len(prompt)
        assert picked - emitted <= holdback
    assert any(session.full_checks[:-1]), "a full check before the end released the text"


def test_a_retraction_into_sent_text_fails_the_request(tokens):
    # a lie older than the last full check (the stand-in's checks pass everything; the client's cannot miss it)
    model = StubModel(lie_from=2, reveal=9)
    with pytest.raises(APIError) as failure:
        run(model, tokens, [1, 2], 12, True, holdback=2)
    assert failure.value.status == 502 and failure.value.code == "outputs_retracted"


def test_a_pooled_session_through_a_distrusted_server_is_not_reused(tokens):
    model = StubModel()
    metrics = Metrics()
    pool = SessionPool(4, 10_000, 60.0, on_evict=metrics.count_eviction)
    provider = SessionProvider(model, pool, metrics, headroom=32)
    prompt = [3, 4, 5]
    out, _, _ = run(model, tokens, prompt, 4, False, provider=provider, owner="u")
    assert len(pool) == 1
    model.stats.distrusted.append("peer-A")  # the checks outvoted a server of that session since
    run(model, tokens, prompt + out[0] + [11], 4, False, provider=provider, owner="u")
    assert model.sessions[0].closed and len(model.sessions) == 2
    assert metrics.registry.get_sample_value("swarmgate_pool_evictions_total", {"reason": "distrusted"}) == 1


def test_a_liar_caught_by_the_holdback_check_is_retracted_before_its_text_goes_out(tokens):
    prompt = [20, 21]
    model = StubModel(lie_from=3, reveal=5)  # feed 5 is the full check a stream asks for after 4 held tokens
    out, _, metrics = run(model, tokens, prompt, 10, True, holdback=4)
    session = model.sessions[0]
    assert session.full_checks[4], "the fifth feed was the hold-back check"
    assert out == [honest(prompt, 10)]
    assert metrics.registry.get_sample_value("swarmgate_verify_retracted_tokens_total") == 2
    assert session.full_checks[5] and session.emitted_at_feed[6][1] > 0, "the re-run full check released the text"


# ---- a first step that fails over to a fresh session (gateway.serving.sessions.SessionProvider.prefill) --------------
class FailOnce(LyingSession):
    fail = False

    def feed(self, ids):
        if self.fail:
            self.fail = False
            raise RuntimeError("the servers dropped the pooled session")
        return super().feed(ids)


class Model(StubModel):
    def inference_session(self, max_length, adapter=None):
        self.sessions.append(FailOnce(max_length, **self.session_kwargs))
        return self.sessions[-1]


def test_a_first_step_failing_over_to_a_fresh_session_keeps_its_full_check(tokens):
    """max_tokens=1 through a pooled session that fails on reuse: the fresh session gets the full check asked of the
    failed one, so the token's text is released only once checked."""
    model = Model()
    metrics = Metrics()
    pool = SessionPool(4, 10_000, 60.0, on_evict=metrics.count_eviction)
    provider = SessionProvider(model, pool, metrics, headroom=32)
    prompt = [3, 4, 5]
    out, _, _ = run(model, tokens, prompt, 4, False, provider=provider, owner="u")  # pools a session
    model.sessions[0].fail = True
    out, _, _ = run(model, tokens, prompt + out[0] + [11], 1, True, provider=provider, owner="u")
    fresh = model.sessions[1]
    assert fresh.full_checks == [True], "the released token was never covered by a full check"


class RetractAtPrefill(LyingSession):
    retract = False

    def feed(self, ids):
        if self.retract and self.feeds == 0:  # a check in the prompt's 2nd chunk found the 1st chunk's outputs wrong
            self.feeds += 1
            self.token_ids = ids[:, :1].clone()
            raise OutputsRetracted(1)
        return super().feed(ids)


def test_a_retraction_in_the_first_step_is_not_a_failure_to_open(tokens):
    """A lie caught in a prompt's step: the run picks again on the same (repaired) session; nobody's pooled session
    is closed for it, as a failure to open a session would do."""
    class M(StubModel):
        def inference_session(self, max_length, adapter=None):
            self.sessions.append(RetractAtPrefill(max_length, **self.session_kwargs))
            self.sessions[-1].retract = len(self.sessions) == 2  # the second request's fresh session
            return self.sessions[-1]
    model = M()
    metrics = Metrics()
    pool = SessionPool(4, 10_000, 60.0, on_evict=metrics.count_eviction)
    provider = SessionProvider(model, pool, metrics, headroom=32)
    run(model, tokens, [3, 4, 5], 4, False, provider=provider, owner="alice")  # alice's conversation is pooled
    assert len(pool) == 1
    run(model, tokens, [7, 8, 9], 4, False, provider=provider, owner="bob")
    assert not model.sessions[0].closed, "alice's pooled session was closed because bob's prefill was retracted"
