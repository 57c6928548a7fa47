"""Speculative decoding (swarm/client/decoding/speculative.py, drafting.py): exactness and distribution.

In process (fast): `generate(speculative=...)` over a stand-in session that runs the local transformers model, so the
loop, the acceptance rule and the rewinds are checked against transformers' greedy output token for token (n-gram
drafts on repetitive text, a draft model); the sampling rule's output distribution on a tiny vocabulary. Through
real swarms (slow): the client on the 0:15 + 15:30 swarm, greedy and exact; the gateway's speculative requests
are in tests/gateway/test_gateway.py (its module gateway) and tests/gateway/test_gateway_unit.py (a scripted model);
failover in tests/e2e/test_failover.py (a server killed mid-generation during a speculative run).
"""
from __future__ import annotations

import json

import pytest
import torch
from torch import nn

from swarm.client.decoding.drafting import DraftLength, NgramDrafter, SpeculativeConfig
from swarm.client.decoding.sampling import Sampler, SamplingParams
from swarm.client.decoding.speculative import Speculator, accept_drafts
from swarm.client.model.causal_lm import DistributedModelForCausalLM
from tests.fixtures.client_doubles import StubSession

REPEAT = ("Repeat this paragraph exactly.\n\nThe quick brown fox jumps over the lazy dog. The dog sleeps in the "
          "sun all day long, and the fox runs around the field.\n\nThe quick brown fox")


# ---- the loop over a local stand-in session -----------------------------------------------------------------------
class _LocalSession(StubSession):
    """Holds token ids like `ModelSession`; every feed runs the local model over all of them (no cache)."""

    def __init__(self, model: nn.Module, max_length: int):
        self.model, self.max_length = model, max_length
        self.token_ids = None
        self.fed: list = []  # the lengths of the steps' new tokens (the rewinds make them short)

    def feed_and_pick(self, ids, pick, num_logits=1):
        held = 0 if self.token_ids is None else self.token_ids.shape[1]
        assert ids.shape[1] > held and (held == 0 or torch.equal(ids[:, :held], self.token_ids))
        self.fed.append(ids.shape[1] - held)
        logits = self.model(ids).logits[:, -num_logits:]  # [1, n, vocab]
        logits = logits[:, -1] if num_logits == 1 else logits
        self.token_ids = ids.clone()
        return logits, pick(logits)

    def rewind(self, length):
        self.token_ids = self.token_ids[:, :length]

    def close(self):
        pass


class _LocalModel(DistributedModelForCausalLM):
    def __init__(self, reference):
        nn.Module.__init__(self)
        self.reference, self.generation_config = reference, reference.generation_config
        self.config = reference.config
        self.last_speculation = None
        self.sessions: list = []

    def inference_session(self, max_length):
        self.sessions.append(_LocalSession(self.reference, max_length))
        return self.sessions[-1]


@pytest.fixture(scope="module")
def local(reference_model):
    return _LocalModel(reference_model)


@pytest.fixture(scope="module")
def repeat_ids(tokenizer):
    return tokenizer([REPEAT], return_tensors="pt")["input_ids"]


def test_ngram_greedy_equals_transformers_with_scores(local, reference_model, repeat_ids):
    settings = dict(max_new_tokens=24, do_sample=False, return_dict_in_generate=True, output_scores=True,
                    repetition_penalty=1.05)
    ref = reference_model.generate(repeat_ids, **settings)
    ours = local.generate(repeat_ids, speculative="ngram", num_draft_tokens=6, **settings)
    assert ours.sequences.tolist() == ref.sequences.tolist()
    assert len(ours.scores) == len(ref.scores)
    for a, b in zip(ours.scores, ref.scores):
        assert torch.allclose(a, b, atol=1e-3)
    stats = local.last_speculation
    assert stats.accepted > 0 and stats.proposed >= stats.accepted
    assert max(local.sessions[-1].fed) > 1  # steps carried drafts


def test_stop_strings_and_eos_inside_an_accepted_block(local, reference_model, repeat_ids, tokenizer):
    settings = dict(max_new_tokens=30, do_sample=False, stop_strings=[" runs"], tokenizer=tokenizer)
    ref = reference_model.generate(repeat_ids, **settings)
    ours = local.generate(repeat_ids, speculative="ngram", num_draft_tokens=8, **settings)
    assert ours.tolist() == ref.tolist() and ours.shape[1] < repeat_ids.shape[1] + 30
    # an end-of-sequence id that the repetition reaches: generation ends on it, as transformers' does
    eos = int(ref[0, repeat_ids.shape[1] + 15])
    ref = reference_model.generate(repeat_ids, max_new_tokens=30, do_sample=False, eos_token_id=eos,
                                   pad_token_id=eos)
    ours = local.generate(repeat_ids, max_new_tokens=30, do_sample=False, eos_token_id=eos, pad_token_id=eos,
                          prompt_lookup_num_tokens=8)  # transformers' name for n-gram speculation
    assert local.last_speculation.accepted > 0
    assert ours.tolist() == ref.tolist()


def test_draft_model_greedy_is_exact(local, reference_model, repeat_ids, model_path, tmp_path, tokenizer):
    from tests.fixtures.tiny_checkpoints import save_tiny

    ref = reference_model.generate(repeat_ids, max_new_tokens=16, do_sample=False)
    # the target itself as its draft: nearly every draft accepted
    ours = local.generate(repeat_ids, max_new_tokens=16, do_sample=False, speculative="draft_model",
                          draft_model=model_path, num_draft_tokens=5)
    assert ours.tolist() == ref.tolist()
    assert local.last_speculation.acceptance > 0.5
    # a tiny random model of the same tokenizer: drafts mostly rejected, the output the same
    save_tiny("llama", tmp_path / "draft", model_path, max_position_embeddings=1024)
    ours = local.generate(repeat_ids, max_new_tokens=16, do_sample=False, speculative="draft_model",
                          draft_model=str(tmp_path / "draft"))
    assert ours.tolist() == ref.tolist()
    assert local.last_speculation.proposed > 0


def test_speculative_config_and_draft_length():
    assert SpeculativeConfig.of(None) is None and SpeculativeConfig.of("off") is None
    assert SpeculativeConfig.of("ngram", 3).num_draft_tokens == 3
    with pytest.raises(ValueError, match="draft_model"):
        SpeculativeConfig("draft_model")
    with pytest.raises(ValueError, match="speculative must be"):
        SpeculativeConfig("medusa")
    length = DraftLength(8)
    for _ in range(5):
        length.update(length.k, 0)  # nothing accepted: down to one token, and drafting pauses
    assert length.k == 1 and length.idle == 8
    assert [length.take_turn() for _ in range(9)] == [False] * 8 + [True]
    for _ in range(5):
        length.update(length.k, length.k)  # everything accepted: up to the maximum
    assert length.k == 8 and length.misses == 0 and length.take_turn()
    # a sliding window of 8: servers keep 2 windows, a rewind may reach back about one; drafts stay below it
    assert Speculator(SpeculativeConfig("ngram", 12), 100, sliding_window=8).length.maximum == 7
    drafter = NgramDrafter(2)
    assert drafter.draft(torch.tensor([5, 6, 7, 8, 5, 6]), 3)[0] == [7, 8, 5]
    assert drafter.draft(torch.tensor([1, 2, 3]), 3)[0] == []


# ---- the sampling rule: the output distribution -------------------------------------------------------------------
def _chi_square(counts: torch.Tensor, probs: torch.Tensor) -> float:
    expected = probs * counts.sum()
    keep = expected > 0
    assert counts[~keep].sum() == 0  # nothing drawn where the probability is 0
    return float(((counts[keep] - expected[keep]) ** 2 / expected[keep]).sum())


CHI2_DF4_P001 = 18.47  # chi-square critical value, 4 degrees of freedom, p = 0.001


@pytest.mark.parametrize("draft", ["one-hot", "distribution"])
def test_sampling_rule_keeps_the_target_distribution(draft):
    gen = torch.Generator().manual_seed(0)
    logits = torch.tensor([[1.0, 0.2, -0.5, 2.0, 0.0], [0.0, 1.5, 0.3, -1.0, 0.7]])  # [k + 1 = 2, vocab 5]
    p = torch.softmax(logits, dim=-1)
    q = torch.tensor([0.1, 0.1, 0.1, 0.6, 0.1])  # the draft distribution of the first position
    trials = 6000
    first, second = torch.zeros(5), torch.zeros(5)
    for _ in range(trials):
        if draft == "one-hot":
            drafts, probs = [3], None
        else:
            drafts, probs = [int(torch.multinomial(q, 1, generator=gen))], q[None]
        out = accept_drafts(drafts, logits, lambda j, row: row, greedy=False, generator=gen, draft_probs=probs)
        first[out[0][0]] += 1
        if len(out) == 2:  # the draft was accepted: the bonus token is drawn at the next position
            assert out[0][0] == drafts[0]
            second[out[1][0]] += 1
    assert _chi_square(first, p[0]) < CHI2_DF4_P001
    assert second.sum() > 500 and _chi_square(second, p[1]) < CHI2_DF4_P001


def test_sampler_verify_samples_the_processed_distribution():
    """Temperature and top-k apply before the rule: tokens outside the top 3 never come out, and the rest follow
    softmax(top3(logits) / T), drafts or not."""
    vocab = 5
    params = SamplingParams(max_tokens=8, temperature=0.7, top_k=3, seed=3)
    sampler = Sampler(params, prompt_len=1, vocab_size=vocab)
    logits = torch.tensor([[1.0, 0.2, -0.5, 2.0, 0.0]] * 2)
    expected = torch.softmax(torch.tensor([1.0, 0.2, -float("inf"), 2.0, -float("inf")]) / 0.7, dim=-1)
    counts = torch.zeros(vocab)
    for _ in range(4000):
        choices = sampler.verify(torch.tensor([1]), [4], None, logits)  # a draft top-k removes: always rejected
        assert len(choices) == 1
        counts[choices[0].token_id] += 1
    assert _chi_square(counts, expected) < 13.82  # 2 degrees of freedom, p = 0.001
    # greedy: the argmax, and the logprobs of the unprocessed distribution, as `choose` gives them
    greedy = Sampler(SamplingParams(max_tokens=8, temperature=0, logprobs=True), 1, vocab)
    choices = greedy.verify(torch.tensor([1]), [3, 1], None, torch.tensor([[0.0, 0, 0, 5, 0], [0.0, 0, 0, 5, 0],
                                                                           [0.0, 0, 0, 5, 0]]))
    assert [c.token_id for c in choices] == [3, 3]  # the first draft accepted, the second corrected
    assert choices[0].logprob == pytest.approx(float(torch.log_softmax(torch.tensor([0.0, 0, 0, 5, 0]), 0)[3]))


# ---- through real swarms -------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def swarm_model(swarms, model_path):
    from swarm import AutoDistributedModelForCausalLM

    swarm = swarms.get(("0:15", "15:30"))
    model = AutoDistributedModelForCausalLM.from_pretrained(model_path, initial_peers=swarm["initial_peers"],
                                                            dht_prefix=swarm["prefix"])
    yield model
    model.shutdown()


def test_swarm_generate_greedy_equals_transformers(swarm_model, reference_model, repeat_ids, model_path, tmp_path):
    from tests.fixtures.tiny_checkpoints import save_tiny

    ref = reference_model.generate(repeat_ids, max_new_tokens=32, do_sample=False)
    with swarm_model.inference_session(max_length=repeat_ids.shape[1] + 32) as session:
        ours = swarm_model.generate(repeat_ids, session=session, max_new_tokens=32, do_sample=False,
                                    speculative="ngram", num_draft_tokens=6)
        assert session.position <= ours.shape[1]  # the rejected drafts were rewound
    assert ours.tolist() == ref.tolist()
    assert swarm_model.last_speculation.accepted > 0
    # a tiny random draft model of the same tokenizer: its drafts are mostly rejected, the output is the same
    save_tiny("llama", tmp_path / "draft", model_path, max_position_embeddings=1024)
    ours = swarm_model.generate(repeat_ids, max_new_tokens=16, do_sample=False, speculative="draft_model",
                                draft_model=str(tmp_path / "draft"), num_draft_tokens=3)
    assert ours.tolist() == ref[:, :repeat_ids.shape[1] + 16].tolist()
    assert swarm_model.last_speculation.proposed > 0


def test_swarm_speculative_sampling_runs_and_stops(swarm_model, repeat_ids):
    torch.manual_seed(0)
    out = swarm_model.generate(repeat_ids, max_new_tokens=12, min_new_tokens=12, do_sample=True, temperature=0.8,
                               top_p=0.9, speculative="ngram")
    assert out.shape[1] == repeat_ids.shape[1] + 12 and swarm_model.last_speculation.steps >= 1


# ---- the gateway over a scripted model (in process) ---------------------------------------------------------------
SCRIPT = "one two three four. one two three four. one two three four. one two three four. STOP and then"


def test_gateway_speculative_requests_match_plain_ones(tokenizer):
    from starlette.testclient import TestClient

    from gateway.app import create_app
    from gateway.config import GatewayConfig
    from tests.fixtures.fake_model import FakeModel

    config = GatewayConfig(model="fake", speculative="ngram", num_draft_tokens=4)
    client = TestClient(create_app(config, model=FakeModel(tokenizer, SCRIPT), tokenizer=tokenizer))
    chat = {"model": "fake", "messages": [{"role": "user", "content": "count"}], "temperature": 0}

    def answer(**extra):
        r = client.post("/v1/chat/completions", json={**chat, **extra})
        assert r.status_code == 200, r.text
        return r.json()

    def streamed(**extra):
        with client.stream("POST", "/v1/chat/completions", json={**chat, "stream": True, **extra}) as r:
            chunks = [json.loads(line[6:]) for line in r.iter_lines()
                      if line.startswith("data: ") and line != "data: [DONE]"]
        return "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"]), len(chunks)

    def accepted() -> float:
        text = client.get("/metrics").text
        return float(next(line.split()[-1] for line in text.splitlines()
                          if line.startswith("swarmgate_speculative_accepted_tokens_total")))

    plain = answer(speculative="off")
    assert accepted() == 0
    fast = answer()  # the gateway's default: n-gram drafts
    assert fast["choices"][0]["message"] == plain["choices"][0]["message"]
    assert fast["usage"]["completion_tokens"] == plain["usage"]["completion_tokens"]
    assert accepted() > 0
    text, chunks = streamed(num_draft_tokens=6)
    assert text == plain["choices"][0]["message"]["content"] and chunks > 3  # accepted tokens stream as they come
    stop = answer(stop=[" STOP"], logprobs=True)["choices"][0]  # a stop string inside an accepted block
    assert stop["message"]["content"] == SCRIPT[:SCRIPT.index(" STOP")] and stop["finish_reason"] == "stop"
    assert "".join(t["token"] for t in stop["logprobs"]["content"]).startswith(stop["message"]["content"])
    cut = answer(max_tokens=7)["choices"][0]
    assert cut["finish_reason"] == "length" and cut["message"]["content"] == plain["choices"][0]["message"][
        "content"][:len(cut["message"]["content"])]
    r = client.post("/v1/chat/completions", json={**chat, "speculative": "draft_model"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "speculative"


def test_gateway_speculative_settings_from_cli_and_env():
    from pydantic import ValidationError

    from gateway.config import GatewayConfig
    from swarm.runtime.config import build_parser, load_config

    with pytest.raises(ValidationError, match="--draft_model"):
        GatewayConfig(model="m", speculative="draft_model")
    args = build_parser(GatewayConfig, "gw", "", positional="model").parse_args(
        ["m", "--speculative", "ngram", "--num_draft_tokens", "6"])
    config = load_config(GatewayConfig, args, environ={"SWARMGATE_NUM_DRAFT_TOKENS": "2"})
    assert (config.speculative, config.num_draft_tokens) == ("ngram", 6)
    config = load_config(GatewayConfig, None, environ={"SWARMGATE_MODEL": "m", "SWARMGATE_SPECULATIVE": "ngram"})
    assert (config.speculative, config.num_draft_tokens) == ("ngram", 4)
    assert GatewayConfig.model_validate({"model": "m", "speculative": False}).speculative == "off"  # YAML's `off`
