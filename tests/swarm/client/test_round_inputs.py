"""An engine round's inputs (`swarm.client.model.model_session.round_inputs`): the decode steps of many sessions
embedded in one lookup give each session exactly what its own `round_input` gives (in process: the sessions' servers
are never called, as a decode step sends only what the servers do not hold yet); a prompt's `feed_states` (no LM
head) against `feed`, with a stand-in for the servers."""
from __future__ import annotations

import pytest
import torch
from torch import nn

from swarm.client.model.head import ClientHead
from swarm.client.model.model_session import ModelSession, round_inputs
from tests.fixtures.synthetic_swarm import fake_manager, span

HIDDEN, VOCAB = 16, 50


def _head(embed_norm: bool) -> ClientHead:
    torch.manual_seed(3)
    return ClientHead(nn.Embedding(VOCAB, HIDDEN), nn.LayerNorm(HIDDEN), nn.Linear(HIDDEN, VOCAB, bias=False), HIDDEN,
                      embed_norm=nn.LayerNorm(HIDDEN) if embed_norm else None)


def _session(head: ClientHead, ids: torch.Tensor, held: int) -> ModelSession:
    """A session whose servers hold the first `held` positions of `ids`."""
    session = ModelSession(head, fake_manager([span("a", 0, 30)], None), max_length=64)
    session.token_ids = ids[:, :held].clone()
    session.session.position = held
    return session


def test_many_sessions_inputs_in_one_lookup_are_each_ones_own():
    torch.manual_seed(4)
    for embed_norm in (False, True):  # (a family that norms its embeddings: the norm is per position too)
        head = _head(embed_norm)
        rows = [torch.randint(0, VOCAB, (batch, length)) for batch, length in ((1, 5), (3, 9), (1, 2), (2, 7))]
        # decode steps (the last token new), and one session whose servers hold less (two tokens new, its own group)
        helds = [5 - 1, 9 - 1, 2 - 1, 7 - 2]
        alone = [_session(head, ids, held).round_input(ids) for ids, held in zip(rows, helds)]
        together = round_inputs([(_session(head, ids, held), ids) for ids, held in zip(rows, helds)])
        assert [tuple(h.shape) for h in together] == [(1, 1, HIDDEN), (3, 1, HIDDEN), (1, 1, HIDDEN), (2, 2, HIDDEN)]
        for mine, theirs in zip(together, alone):
            assert isinstance(mine, torch.Tensor) and torch.equal(mine, theirs)


def test_a_session_that_fails_its_rewind_fails_alone():
    head = _head(False)
    ids = torch.randint(0, VOCAB, (1, 6))
    good, bad, other = _session(head, ids, 5), _session(head, ids, 5), _session(head, ids, 5)

    def broken(*_):
        raise RuntimeError("this session's own failure")

    bad.reusable_prefix = broken  # type: ignore[method-assign]
    got = round_inputs([(good, ids), (bad, ids), (other, ids)])
    assert isinstance(got[1], RuntimeError)
    for k in (0, 2):
        assert isinstance(got[k], torch.Tensor) and torch.equal(got[k], head.embed(ids[:, 5:]))


def test_a_prompts_states_give_the_logits_its_feed_gives():
    """`feed_states` (an engine round's prompt: no LM head, the round runs it) returns the last position's states
    whose head is `feed`'s logits, and holds the same ids afterwards; a failed step still leaves the held ids at the
    servers' position. The servers are a stand-in here (`InferenceSession.step` returns a function of its input)."""
    head = _head(False)
    ids = torch.randint(0, VOCAB, (2, 7))

    def fake_servers(session: ModelSession, fail: bool = False) -> ModelSession:
        def step(hidden, hypo_ids=None, left_padding=None):
            if fail:
                session.session.position = 3
                raise RuntimeError("a server failed")
            session.session.position += hidden.shape[1]
            return torch.tanh(hidden * 1.5)  # [batch, new, hidden]
        session.session.step = step  # type: ignore[method-assign]
        return session

    states_session, feed_session = fake_servers(_session(head, ids, 0)), fake_servers(_session(head, ids, 0))
    states = states_session.feed_states(ids)
    assert tuple(states.shape) == (2, HIDDEN)
    assert torch.equal(head.head(states), feed_session.feed(ids))
    assert torch.equal(states_session.token_ids, ids) and torch.equal(feed_session.token_ids, ids)
    failing = fake_servers(_session(head, ids, 0), fail=True)
    with pytest.raises(RuntimeError, match="a server failed"):
        failing.feed_states(ids)
    assert torch.equal(failing.token_ids, ids[:, :3])
