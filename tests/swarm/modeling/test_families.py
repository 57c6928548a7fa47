"""Other model families on tiny random checkpoints the test builds itself: a real server per family,
greedy tokens and logits compared with `transformers` running the same checkpoint locally."""
from __future__ import annotations

import pytest
import torch

from launch.topology import start_servers, terminate_all
from swarm import AutoDistributedModelForCausalLM
from tests.fixtures.family_configs import llama_like_configs


@pytest.mark.parametrize("family", ["llama", "mistral", "qwen2"])
def test_tiny_family_through_the_swarm(family, tmp_path, bootstrap):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    config = llama_like_configs()[family]
    reference = AutoModelForCausalLM.from_config(config).eval()
    path = tmp_path / f"tiny-{family}"
    reference.save_pretrained(path)
    prefix = f"tfam-{family}"
    # the split itself is tested on SmolLM2
    servers = start_servers(str(path), [bootstrap.maddr], ["0:4"], prefix, threads=1)
    model = AutoDistributedModelForCausalLM.from_pretrained(str(path), initial_peers=[bootstrap.maddr],
                                                            dht_prefix=prefix)
    try:
        ids = torch.randint(2, 500, (2, 7))
        ours = model.generate(ids, max_new_tokens=12, min_new_tokens=12, do_sample=False)
        with torch.no_grad():
            ref = reference.generate(ids, max_new_tokens=12, min_new_tokens=12, do_sample=False)
            ref_logits = reference(ours).logits
        assert ours.tolist() == ref.tolist()
        assert (model(ours).logits - ref_logits).abs().max().item() < 1e-3
    finally:
        model.shutdown()
        terminate_all(servers)


def test_unsupported_family_is_a_clear_error(tmp_path):
    from transformers import GPT2Config

    from swarm.modeling.checkpoint import Checkpoint
    from swarm.modeling.families import FAMILIES, UnsupportedModelError, family_for

    GPT2Config(n_layer=2, n_embd=64, n_head=4).save_pretrained(tmp_path)
    with pytest.raises(UnsupportedModelError) as error:
        family_for(Checkpoint(str(tmp_path)).load_config())
    message = str(error.value)
    assert "\n" not in message and "'gpt2' is not supported" in message
    assert all(repr(name) in message for name in FAMILIES) and "'mixtral'" in message


def test_a_server_of_an_unknown_model_type_fails_with_one_line(tmp_path, capsys):
    from transformers import GPT2Config

    from server.server import main

    GPT2Config(n_layer=2, n_embd=64, n_head=4).save_pretrained(tmp_path)
    assert main([str(tmp_path), "--initial_peers", "/ip4/127.0.0.1/tcp/1/p2p/QmUnused"]) == 1
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and "'gpt2' is not supported" in lines[0] and "'mixtral'" in lines[0], lines
