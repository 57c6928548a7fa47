"""examples/prompt_tuning.py on a real 2-server swarm: soft prompts learn a task this test defines (answer
" purple" to any question), the loss falls by a clear margin, the tuned model answers as trained through
`generate` (inference sessions carrying the prompts), and the prompts survive save / load."""
from __future__ import annotations

import pytest
import torch

from swarm import AutoDistributedModelForCausalLM
from tests.fixtures.training import TASK, example  # noqa: F401  (example: a module fixture)


def client(model_path, swarm, **kwargs):
    return AutoDistributedModelForCausalLM.from_pretrained(
        model_path, initial_peers=swarm["initial_peers"], dht_prefix=swarm["prefix"], pad_head_rows=False, **kwargs)


@pytest.mark.parametrize("mode, epochs", [("ptune", 12), ("deep_ptune", 8)])
def test_prompt_tuning_learns_the_task(example, swarms, model_path, tokenizer, tmp_path, mode, epochs):
    swarm = swarms.get(("0:15", "15:30"))
    torch.manual_seed(0)
    model = client(model_path, swarm, tuning_mode=mode, pre_seq_len=4)
    try:
        before = [example.answer(model, tokenizer, prompt, max_new_tokens=2) for prompt, _ in TASK]
        assert not all(a.strip().lower().startswith("purple") for a in before), before
        losses = example.train(model, tokenizer, TASK, epochs=epochs, lr=0.1, log=None)
        assert losses[-1] < 0.25 * losses[0], losses
        after = [example.answer(model, tokenizer, prompt, max_new_tokens=2) for prompt, _ in TASK]
        assert all(a.strip().lower().startswith("purple") for a in after), (after, losses)
        assert model.ptune is not None
        model.ptune.save(str(tmp_path / "prompts.safetensors"))
    finally:
        model.shutdown()
    fresh = client(model_path, swarm, tuning_mode=mode, pre_seq_len=4)
    try:
        assert fresh.ptune is not None
        fresh.ptune.load(str(tmp_path / "prompts.safetensors"))
        assert example.answer(fresh, tokenizer, TASK[0][0], max_new_tokens=2) == after[0]
        with pytest.raises(ValueError, match="prompts of length"):
            client_other = client(model_path, swarm, tuning_mode=mode, pre_seq_len=5)
            try:
                assert client_other.ptune is not None
                client_other.ptune.load(str(tmp_path / "prompts.safetensors"))
            finally:
                client_other.shutdown()
    finally:
        fresh.shutdown()
