"""An engine round's pick (`swarm.client.decoding.round_pick.pick_round`) against the per-request path it replaces
(`Sampler.choose`, one row at a time): rows of many requests picked together get the tokens and logprobs each gets
alone, a seeded row the same draws whatever else is in the round, and a row whose processors raise fails alone."""
from __future__ import annotations

import torch

from swarm.client.decoding.round_pick import argmax_rows, pick_round
from swarm.client.decoding.sampling import Sampler, SamplingParams

VOCAB = 500


def settings():
    """Requests of every kind a round mixes: greedy, sampled with warpers, penalties, logit bias, logprobs."""
    return [
        SamplingParams(max_tokens=8, temperature=0),
        SamplingParams(max_tokens=8, temperature=0, logprobs=True, top_logprobs=3, logit_bias={7: 30.0}),
        SamplingParams(max_tokens=8, temperature=0.8, seed=11),
        SamplingParams(max_tokens=8, temperature=1.3, top_p=0.9, top_k=40, seed=12, logprobs=True, top_logprobs=2),
        SamplingParams(max_tokens=8, temperature=1.0, presence_penalty=0.7, frequency_penalty=0.3,
                       repetition_penalty=1.2, seed=13),
        SamplingParams(max_tokens=8, temperature=0.7, min_p=0.05, seed=14, logit_bias={3: -100.0}),
    ]


def test_a_round_picks_what_each_row_picks_alone():
    torch.manual_seed(0)
    params = settings()
    steps, prompt = 6, 5
    ids = torch.randint(0, VOCAB, (len(params), prompt))
    alone = [Sampler(p, prompt, VOCAB, 0) for p in params]
    together = [Sampler(p, prompt, VOCAB, 0) for p in params]
    for step in range(steps):
        logits = torch.randn(len(params), VOCAB) * 3
        expected = [s.choose(ids[i], logits[i], steps - step) for i, s in enumerate(alone)]
        got = pick_round([(s, ids[i]) for i, s in enumerate(together)], logits)
        assert [c.token_id for c in got] == [c.token_id for c in expected]  # type: ignore[union-attr]
        for g, e in zip(got, expected):
            assert g.logprob == e.logprob and g.top == e.top  # type: ignore[union-attr]
        ids = torch.cat([ids, torch.tensor([[c.token_id] for c in expected])], dim=1)
    assert ids[1, prompt:].eq(7).all()  # the logit bias took hold, so the test can tell processors ran


def test_a_seeded_row_draws_the_same_whatever_else_is_in_the_round():
    torch.manual_seed(1)
    params = SamplingParams(max_tokens=8, temperature=1.0, seed=5)
    ids = torch.randint(0, VOCAB, (1, 4))
    logits = torch.randn(6, 8, VOCAB)  # 8 steps of the seeded row (row 0) and 5 other rows
    alone, crowded = Sampler(params, 4, VOCAB), Sampler(params, 4, VOCAB)
    others = [Sampler(SamplingParams(max_tokens=8, temperature=1.0, seed=100 + k), 4, VOCAB) for k in range(5)]
    solo_tokens, crowd_tokens = [], []
    for step in range(8):
        solo_tokens.append(pick_round([(alone, ids[0])], logits[0, step][None])[0].token_id)  # type: ignore
        rows = [(s, ids[0]) for s in others[:step % 6]] + [(crowded, ids[0])]  # 0..5 others before it
        crowd_tokens.append(pick_round(rows, torch.cat([logits[1:1 + step % 6, step], logits[0, step][None]])
                                       )[-1].token_id)  # type: ignore[union-attr]
    assert solo_tokens == crowd_tokens
    assert len(set(solo_tokens)) > 1  # sampled, not a constant


def test_a_row_whose_processors_raise_fails_alone():
    class Broken:
        def __call__(self, input_ids, scores):
            raise ValueError("a user's processor failed")

    params = SamplingParams(max_tokens=4, temperature=0)
    good, bad = Sampler(params, 2, VOCAB), Sampler(params, 2, VOCAB)
    bad.processors.append(Broken())
    logits = torch.randn(3, VOCAB)
    ids = torch.zeros(2, dtype=torch.long)
    got = pick_round([(good, ids), (bad, ids), (good, ids)], logits)
    assert isinstance(got[1], ValueError)
    assert [got[0].token_id, got[2].token_id] == logits[[0, 2]].argmax(-1).tolist()  # type: ignore[union-attr]


def test_the_round_argmax_is_torchs_on_ties_nan_and_views():
    """`argmax_rows` (NumPy's on the CPU) gives torch's indices: the first of tied maxima, a NaN as the largest,
    rows of -inf, float64, a column-cut view (the rounds' `[:, :vocab_size]`); and an all-greedy round (no gathered
    copy) picks each row's argmax."""
    torch.manual_seed(2)
    logits = torch.randn(8, VOCAB)
    logits[1, [3, 9, 400]] = 50.0  # ties: the first
    logits[2, 17], logits[2, 5] = float("nan"), 99.0  # a NaN wins
    logits[3, [4, 6]] = float("nan")  # the first NaN
    logits[4] = float("-inf")
    logits[5, VOCAB - 1] = 1e9  # cut off by the view below
    for scores in (logits, logits.double(), logits[:, :VOCAB - 2], logits[::2]):
        assert argmax_rows(scores) == scores.argmax(dim=-1).tolist()
    assert argmax_rows(logits)[:5] == [int(logits[0].argmax()), 3, 17, 4, 0]
    greedy = [Sampler(SamplingParams(max_tokens=4, temperature=0), 2, VOCAB) for _ in range(8)]
    got = pick_round([(s, torch.zeros(2, dtype=torch.long)) for s in greedy], logits)
    assert [c.token_id for c in got] == logits.argmax(dim=-1).tolist()  # type: ignore[union-attr]
