"""Batches of prompts of different lengths, left-padded with an attention mask, on real processes (issue 23): the
servers hide the padding keys and shift each row's positions, in prefill and in batched decode, so greedy and
sampled generation equal local transformers on the same padded batch; a bad mask or bad padding is a clear error
on that call only."""
from __future__ import annotations

import pytest
import torch

from swarm import AutoDistributedModelForCausalLM
from swarm.client.decoding.rows import held_prefix, left_padding

SPANS = ("0:15", "15:30")
PROMPTS = [
    "The history of the Roman Empire begins",
    "Hi",
    "Three things every gardener should know about soil are the",
]
NEW = 12


@pytest.fixture(scope="module")
def model(swarms, model_path):
    swarm = swarms.get(SPANS)
    client = AutoDistributedModelForCausalLM.from_pretrained(model_path, initial_peers=swarm["initial_peers"],
                                                             dht_prefix=swarm["prefix"])
    yield client
    client.shutdown()


@pytest.fixture(scope="module")
def batch(tokenizer):
    enc = tokenizer(PROMPTS, return_tensors="pt", padding=True, padding_side="left")
    assert len(set(enc["attention_mask"].sum(dim=1).tolist())) == len(PROMPTS)  # really of different lengths
    return enc


def test_greedy_on_a_padded_batch_equals_transformers(model, batch, reference_model):
    ours = model.generate(**batch, max_new_tokens=NEW, do_sample=False)
    ref = reference_model.generate(**batch, max_new_tokens=NEW, do_sample=False)
    assert ours.tolist() == ref.tolist()
    # each row alone (no padding) gives the same new tokens: the padding changes nothing
    for row, prompt_ids in enumerate(batch["input_ids"]):
        real = prompt_ids[batch["attention_mask"][row].bool()][None]
        alone = model.generate(real, max_new_tokens=NEW, min_new_tokens=NEW, do_sample=False)
        n = int((ours[row, batch["input_ids"].shape[1]:] != reference_model.generation_config.pad_token_id).sum())
        assert alone[0, real.shape[1]:real.shape[1] + n].tolist() == ours[row, -NEW:][:n].tolist()


def test_sampling_and_processors_on_a_padded_batch_equal_transformers(model, batch, reference_model):
    settings = dict(max_new_tokens=NEW, do_sample=True, top_k=30, temperature=0.8, repetition_penalty=1.2,
                    no_repeat_ngram_size=3)
    torch.manual_seed(5)
    ours = model.generate(**batch, **settings)
    torch.manual_seed(5)
    ref = reference_model.generate(**batch, **settings)
    assert ours.tolist() == ref.tolist()


def test_a_padded_session_continues_across_turns(model, batch, reference_model):
    """A second generate on the same session sends only the new tokens (same padding), and still equals
    transformers on the whole padded input."""
    first = model.generate(**batch, max_new_tokens=4, min_new_tokens=4, do_sample=False)
    mask = torch.cat([batch["attention_mask"], torch.ones(first.shape[0], 4, dtype=torch.long)], dim=1)
    with model.inference_session(max_length=first.shape[1] + 8) as session:
        model.generate(first[:, :-4], attention_mask=mask[:, :-4], session=session, max_new_tokens=1,
                       do_sample=False)
        sent = []  # the sequence length of each step the session sends from here on
        step = session.session.step
        session.session.step = lambda hidden, **kw: (sent.append(hidden.shape[1]), step(hidden, **kw))[1]
        ours = model.generate(first, attention_mask=mask, session=session, max_new_tokens=6, do_sample=False)
        assert sent[0] == 4  # only the new tokens went out the second time
    ref = reference_model.generate(first, attention_mask=mask, max_new_tokens=6, do_sample=False)
    assert ours.tolist() == ref.tolist()


def test_bad_masks_are_clear_errors(model, batch):
    ids, mask = batch["input_ids"], batch["attention_mask"]
    right = mask.flip(1)
    with pytest.raises(ValueError, match="only left padding"):
        model.generate(ids, attention_mask=right, max_new_tokens=2)
    with pytest.raises(ValueError, match="shape"):
        model.generate(ids, attention_mask=mask[:, 1:], max_new_tokens=2)
    with pytest.raises(ValueError, match="no real token"):
        model.generate(ids, attention_mask=torch.zeros_like(mask), max_new_tokens=2)
    # the model goes on
    assert model.generate(ids, attention_mask=mask, max_new_tokens=1).shape == (len(PROMPTS), ids.shape[1] + 1)


def test_row_helpers():
    ids = torch.tensor([[5, 6, 7], [5, 6, 8]])
    assert left_padding(None, ids) is None
    assert left_padding(torch.ones(2, 3), ids) is None
    assert left_padding(torch.tensor([[0, 1, 1], [1, 1, 1]]), ids) == [1, 0]
    with pytest.raises(ValueError, match="0 \\(padding\\) and 1"):
        left_padding(torch.tensor([[2, 1, 1], [1, 1, 1]]), ids)
    held = torch.tensor([[1, 2, 3], [1, 2, 4], [1, 9, 9]])
    assert held_prefix(None, held) == (0, None)
    assert held_prefix(held, torch.cat([held, held[:, :1]], dim=1)) == (3, None)  # a decode step: same rows
    # each new row continues the held row it shares most with: the held rows are reordered, not recomputed
    reuse, parents = held_prefix(held, torch.tensor([[1, 2, 4, 0], [1, 2, 4, 0], [1, 2, 3, 0]]))
    assert (reuse, parents) == (3, [1, 1, 0])
    assert held_prefix(held, torch.tensor([[1, 2, 3, 0], [7, 7, 7, 7], [1, 9, 9, 9]])) == (0, None)


def test_forward_on_a_padded_batch_equals_transformers(model, batch, reference_model):
    """`model(input_ids, attention_mask)` (no cache): the padding keys are hidden, positions as transformers'
    forward leaves them; the logits of every real position equal transformers'."""
    ours = model(batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    with torch.no_grad():
        ref = reference_model(**batch).logits
        unmasked = reference_model(batch["input_ids"]).logits
    real = batch["attention_mask"].bool()
    assert (ours[real] - ref[real]).abs().max().item() < 1e-3
    assert (ours[real] - unmasked[real]).abs().max().item() > 1e-1  # the mask matters: the test can fail


def test_session_cache_rows_reorder_and_padding():
    """`SessionKV` alone: a reorder moves every layer's rows of the kept positions (and their padding); padded
    rows' positions count from their first real token and their padding keys are hidden."""
    from server.compute.cache import SessionKV, padded_key_mask

    kv = SessionKV(2, 3, 1, 2, 6, torch.float32, torch.device("cpu"))
    for layer in range(2):
        kv.keys[layer].copy_(torch.arange(3.0).view(3, 1, 1, 1).expand(3, 1, 6, 2) + 10 * layer)
        kv.values[layer].copy_(kv.keys[layer])
    kv.set_padding([0, 2, 1])
    kv.reorder(torch.tensor([1, 1, 0]), length=4)
    assert kv.keys[1][:, 0, :4, 0].tolist() == [[11.0] * 4, [11.0] * 4, [10.0] * 4]
    assert kv.keys[1][:, 0, 4:, 0].tolist() == [[10.0] * 2, [11.0] * 2, [12.0] * 2]  # past `length`: untouched
    assert kv.padding is not None and kv.padding.tolist() == [2, 2, 0]
    assert kv.position_ids(1, 3).tolist() == [[0, 0, 1], [0, 0, 1], [1, 2, 3]]
    hidden = kv.key_mask(3, 1, torch.float32)[:, 0, 0] < 0  # [rows, keys]: which keys a step at 3 cannot see
    assert hidden.tolist() == [[True, True, False, False], [True, True, False, False], [False] * 4]
    # a padding query sees itself only (no empty softmax row); without padding the mask is causal
    assert (padded_key_mask(torch.tensor([2]), 0, 3, torch.float32, torch.device("cpu"))[0, 0] < 0).tolist() == [
        [False, True, True], [True, False, True], [True, True, False]]
    kv.set_padding([0, 0, 0])
    assert kv.padding is None and kv.position_ids(2, 2).tolist() == [[2, 3]] * 3
