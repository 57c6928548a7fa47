"""`generate`'s settings (issue 23): each `GenerationConfig` field is applied through the one token-selection path
with transformers' own processors, or rejected with an error naming it. Fast: no processes; `generate` runs on the
local reference model through a stand-in session."""
from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn
from transformers import GenerationConfig
from transformers.generation import logits_process as lp

from swarm.client.decoding.sampling import UNSUPPORTED_GENERATION_SETTINGS, SamplingParams, build_processors
from swarm.client.model.causal_lm import DistributedModelForCausalLM
from tests.fixtures.client_doubles import StubSession

EOS = 2
# (generate settings, transformers' processors for a prompt of 5 tokens and 10 new ones)
APPLIED = [
    (dict(no_repeat_ngram_size=2), lambda: [lp.NoRepeatNGramLogitsProcessor(2)]),
    (dict(bad_words_ids=[[7], [3, 4], [EOS]]), lambda: [lp.NoBadWordsLogitsProcessor([[7], [3, 4], [EOS]], EOS)]),
    (dict(min_length=9), lambda: [lp.MinLengthLogitsProcessor(9, EOS)]),
    (dict(sequence_bias={(3, 4): 2.5, (9,): -1.0}),
     lambda: [lp.SequenceBiasLogitsProcessor({(3, 4): 2.5, (9,): -1.0})]),
    (dict(forced_bos_token_id=11), lambda: [lp.ForcedBOSTokenLogitsProcessor(11)]),
    (dict(forced_eos_token_id=EOS), lambda: [lp.ForcedEOSTokenLogitsProcessor(15, EOS)]),
    (dict(remove_invalid_values=True), lambda: [lp.InfNanRemoveLogitsProcessor()]),
    (dict(exponential_decay_length_penalty=(1, 1.5)), lambda: [lp.ExponentialDecayLengthPenalty((1, 1.5), EOS, 5)]),
    (dict(suppress_tokens=[4, 5]), lambda: [lp.SuppressTokensLogitsProcessor([4, 5])]),
    (dict(begin_suppress_tokens=[6]), lambda: [lp.SuppressTokensAtBeginLogitsProcessor([6], 5)]),
    (dict(renormalize_logits=True), lambda: [lp.LogitNormalization()]),
    (dict(do_sample=True, typical_p=0.8), lambda: [lp.TypicalLogitsWarper(0.8)]),
    (dict(do_sample=True, epsilon_cutoff=0.02), lambda: [lp.EpsilonLogitsWarper(0.02)]),
    (dict(do_sample=True, eta_cutoff=0.02), lambda: [lp.EtaLogitsWarper(0.02)]),
    (dict(do_sample=True, top_h=0.5), lambda: [lp.TopHLogitsWarper(0.5)]),
    (dict(do_sample=True, min_p=0.1), lambda: [lp.MinPLogitsWarper(0.1)]),
    # together, in transformers' order
    (dict(do_sample=True, temperature=0.7, top_k=20, typical_p=0.9, repetition_penalty=1.3, no_repeat_ngram_size=3,
          bad_words_ids=[[5]], suppress_tokens=[8], renormalize_logits=True),
     lambda: [lp.RepetitionPenaltyLogitsProcessor(1.3), lp.NoRepeatNGramLogitsProcessor(3),
              lp.NoBadWordsLogitsProcessor([[5]], EOS), lp.SuppressTokensLogitsProcessor([8]),
              lp.TemperatureLogitsWarper(0.7), lp.TopKLogitsWarper(20), lp.TypicalLogitsWarper(0.9),
              lp.LogitNormalization()]),
]


def _config(**settings: Any) -> GenerationConfig:
    # top_k=0: GenerationConfig's default top_k (50) is not what these cases compare
    return GenerationConfig(eos_token_id=EOS, top_k=settings.pop("top_k", 0), **settings)


@pytest.mark.parametrize("settings,theirs", APPLIED, ids=[",".join(s) for s, _ in APPLIED])
def test_each_applied_setting_builds_transformers_processors(settings, theirs):
    ours = build_processors(SamplingParams.from_generation_config(_config(**settings), 10), prompt_len=5)
    reference = lp.LogitsProcessorList(theirs())
    assert [type(p) for p in ours] == [type(p) for p in reference]
    torch.manual_seed(0)
    for length in (5, 6, 9, 14):  # the first new token, later ones, the last one (forced eos)
        ids = torch.randint(0, 12, (3, length))
        scores = torch.randn(3, 50)
        scores[0, 1] = float("nan") if settings.get("remove_invalid_values") else scores[0, 1]
        expected = reference(ids, scores.clone())
        assert torch.allclose(ours(ids, scores.clone()), expected, equal_nan=True), (settings, length)


def test_greedy_leaves_the_sampling_warpers_out():
    greedy = SamplingParams.from_generation_config(_config(typical_p=0.5, epsilon_cutoff=0.1, eta_cutoff=0.1,
                                                           top_h=0.4, min_p=0.2), 10)
    assert len(build_processors(greedy)) == 0


def test_defaults_change_nothing_for_the_gateway():
    assert len(build_processors(SamplingParams(max_tokens=4))) == 0  # no field added since applies by default


def test_end_token_ids_are_the_stop_ids_and_the_eos_ids_unless_ignored():
    params = SamplingParams(max_tokens=4, stop_token_ids=[7, 2])
    assert params.end_token_ids([2, 0]) == [0, 2, 7]
    params.ignore_eos = True
    assert params.end_token_ids([2, 0]) == [2, 7]
    assert SamplingParams(max_tokens=4, ignore_eos=True).end_token_ids([0]) == []


def test_custom_processors_merge_as_in_transformers():
    custom = lp.NoRepeatNGramLogitsProcessor(3)
    extra = lp.SuppressTokensLogitsProcessor([1])
    params = SamplingParams.from_generation_config(_config(do_sample=True, temperature=0.5,
                                                           no_repeat_ngram_size=2), 4)
    ours = build_processors(params, 5, custom=[custom, extra])
    assert list(ours)[:2] == [custom, extra] and isinstance(ours[2], lp.TemperatureLogitsWarper)


_REJECTED_VALUES = {"output_attentions": True, "output_hidden_states": True, "encoder_repetition_penalty": 1.5,
                    "encoder_no_repeat_ngram_size": 2, "guidance_scale": 1.5, "watermarking_config": {"bias": 2.0},
                    "token_healing": True, "penalty_alpha": 0.6, "dola_layers": "high",
                    "num_beam_groups": 2, "constraints": ["x"],
                    "force_words_ids": [[1]], "use_mtp": True}


@pytest.mark.parametrize("name", sorted(UNSUPPORTED_GENERATION_SETTINGS))
def test_each_rejected_setting_names_itself(name):
    config = _config()
    setattr(config, name, _REJECTED_VALUES[name])
    with pytest.raises(NotImplementedError, match=name):
        SamplingParams.from_generation_config(config, 4)


# ---- generate itself, on the local reference model through a stand-in session ---------------------------------
class _LocalSession(StubSession):
    def __init__(self, model: nn.Module, max_length: int):
        self.model, self.max_length = model, max_length

    def feed_and_pick(self, ids, pick):
        logits = self.model(ids).logits[:, -1]
        return logits, pick(logits)

    def close(self) -> None:
        pass


class _LocalModel(DistributedModelForCausalLM):
    def __init__(self, reference):
        nn.Module.__init__(self)
        self.reference, self.generation_config = reference, reference.generation_config

    def inference_session(self, max_length):
        return _LocalSession(self.reference, max_length)


@pytest.fixture(scope="module")
def local(reference_model):
    return _LocalModel(reference_model)


@pytest.fixture(scope="module")
def prompt(tokenizer):
    return tokenizer(["The history of the Roman Empire begins"], return_tensors="pt")["input_ids"]


GENERATE_CASES = [
    dict(do_sample=False, no_repeat_ngram_size=2),
    dict(do_sample=False, bad_words_ids=[[13], [314, 4385]], suppress_tokens=[28]),
    dict(do_sample=False, forced_eos_token_id=0, min_length=14, exponential_decay_length_penalty=(2, 1.1)),
    dict(do_sample=True, typical_p=0.9, num_return_sequences=3),
    dict(do_sample=True, epsilon_cutoff=3e-4, eta_cutoff=1e-3, temperature=0.8, num_return_sequences=2),
]


@pytest.mark.parametrize("settings", GENERATE_CASES, ids=lambda s: ",".join(s))
def test_generate_settings_match_transformers(settings, local, reference_model, prompt):
    torch.manual_seed(1)
    ours = local.generate(prompt, max_new_tokens=10, **settings)
    torch.manual_seed(1)
    ref = reference_model.generate(prompt, max_new_tokens=10, **settings)
    assert ours.tolist() == ref.tolist()


def test_generate_returns_scores_and_logits_like_transformers(local, reference_model, prompt):
    settings = dict(max_new_tokens=6, do_sample=False, no_repeat_ngram_size=2, return_dict_in_generate=True,
                    output_scores=True, output_logits=True)
    ours, ref = local.generate(prompt, **settings), reference_model.generate(prompt, **settings)
    assert ours.sequences.tolist() == ref.sequences.tolist()
    assert len(ours.scores) == len(ref.scores) == len(ours.logits) == 6
    for a, b in zip(ours.scores + ours.logits, ref.scores + ref.logits):
        assert torch.allclose(a, b, atol=1e-4)
    assert torch.equal(local.generate(prompt, max_new_tokens=3, return_dict_in_generate=True).sequences,
                       local.generate(prompt, max_new_tokens=3))


def test_stop_strings_and_max_time(local, reference_model, prompt, tokenizer):
    with pytest.raises(ValueError, match="stop_strings.*tokenizer="):
        local.generate(prompt, max_new_tokens=4, stop_strings=["Rome"])
    ref = reference_model.generate(prompt, max_new_tokens=20, do_sample=False, stop_strings=[" the"],
                                   tokenizer=tokenizer)
    ours = local.generate(prompt, max_new_tokens=20, do_sample=False, stop_strings=[" the"], tokenizer=tokenizer)
    assert ours.tolist() == ref.tolist() and ours.shape[1] < prompt.shape[1] + 20
    assert local.generate(prompt, max_new_tokens=20, do_sample=False, max_time=0.0).shape[1] == prompt.shape[1] + 1


def test_greedy_with_several_return_sequences_is_transformers_error(local, prompt):
    with pytest.raises(ValueError, match="num_return_sequences"):
        local.generate(prompt, max_new_tokens=4, do_sample=False, num_return_sequences=2)


@pytest.mark.parametrize("name,value", [("output_attentions", True), ("output_hidden_states", True),
                                        ("guidance_scale", 2.0), ("encoder_repetition_penalty", 1.2)])
def test_generate_rejects_what_it_cannot_apply(name, value, local, prompt):
    with pytest.raises(NotImplementedError, match=name):
        local.generate(prompt, max_new_tokens=2, **{name: value})
