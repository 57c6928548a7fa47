"""The Mixtral family (`swarm.modeling.families.mixtral`) against transformers' MixtralForCausalLM on tiny random
checkpoints: both layouts of the experts' tensors (the hub's per-expert names that `save_pretrained` writes, and
the fused tensors of transformers 5's modules), a prompt and greedy decoding through a `BlockSpan` (logits within
1e-4 in float32, tokens equal), and a batched decode step whose rows (sessions) go to different experts."""
from __future__ import annotations

import json

import pytest
import torch

from server.compute.blocks import BlockSpan
from swarm.modeling.checkpoint import Checkpoint
from swarm.modeling.families.mixtral import FusedMoeLayer
from swarm.modeling.model_config import model_config
from tests.fixtures.span_checks import check_batched_rows
from tests.fixtures.tiny_checkpoints import save_tiny, tensor_names

VOCAB = 512


@pytest.fixture(scope="module", params=["hub", "fused"])
def mixtral(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(f"mixtral-{request.param}")
    reference = save_tiny("mixtral", path, None, layout=request.param, vocab_size=VOCAB)
    return request.param, path, reference, BlockSpan.load(Checkpoint(str(path)), 0, 4, "float32")


def _logits(reference, hidden: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return reference.lm_head(reference.model.norm(hidden))


def test_the_checkpoint_has_the_layout(mixtral):
    layout, path, _, span = mixtral
    names = tensor_names(path)
    if layout == "hub":
        assert "model.layers.0.block_sparse_moe.experts.3.w2.weight" in names
        assert not any(".mlp." in name for name in names)
    else:
        assert {"model.layers.0.mlp.experts.gate_up_proj", "model.layers.0.mlp.gate.weight"} <= set(names)
        assert not any("block_sparse_moe" in name for name in names)
    assert all(isinstance(layer, FusedMoeLayer) for layer in span.fused)


def test_prompt_and_greedy_decoding_match_transformers(mixtral):
    _, _, reference, span = mixtral
    torch.manual_seed(1)
    ids = torch.randint(3, VOCAB, (2, 9))
    with torch.no_grad():
        expected = reference.generate(ids, max_new_tokens=10, min_new_tokens=10, do_sample=False)
        expected_logits = reference(expected).logits
    kv = span.new_session_kv(2, 32, 0, 4)
    with torch.no_grad():
        hidden = span.forward(reference.model.embed_tokens(ids), 0, kv)
    assert (_logits(reference, hidden) - expected_logits[:, :9]).abs().max().item() < 1e-4
    tokens = ids
    for position in range(9, 19):
        next_token = _logits(reference, hidden[:, -1:]).argmax(-1)  # [2, 1]
        tokens = torch.cat([tokens, next_token], dim=1)
        with torch.no_grad():
            hidden = span.forward_batch([(reference.model.embed_tokens(next_token), position, kv)], 0, 4)[0]
    assert tokens.tolist() == expected.tolist()
    # the layer modules (a pass without a cache) compute the same
    assert (_logits(reference, span.forward(reference.model.embed_tokens(expected), 0, None))
            - expected_logits).abs().max().item() < 1e-4


def test_batched_rows_route_to_their_own_experts(mixtral):
    """Four sessions' single-token steps in one pass equal each session's step alone, and their rows chose
    different experts in the same pass."""
    _, _, reference, span = mixtral
    xs = check_batched_rows(span)
    layer = span.fused[0]
    rows = layer.post_norm(torch.cat(xs).reshape(4, -1))
    chosen = torch.topk(layer.router(rows), layer.top_k, dim=-1).indices.sort(dim=-1).values
    assert len({tuple(row) for row in chosen.tolist()}) > 1  # the rows' experts differ


def test_fused_experts_are_views_of_the_layer_modules(mixtral):
    _, _, _, span = mixtral
    for layer, fused in zip(span.layers, span.fused):
        experts = layer.block_sparse_moe.experts
        pointer = fused.gate_up_weight.untyped_storage().data_ptr()
        assert all(e.w1.weight.untyped_storage().data_ptr() == pointer for e in experts)
        assert all(e.w3.weight.untyped_storage().data_ptr() == pointer for e in experts)
        assert torch.equal(experts[1].w2.weight, fused.down_weight[1])


def test_a_fused_layout_with_wrong_shapes_is_a_clear_error():
    from swarm.modeling.families.mixtral import from_fused_layout

    bad = {"mlp.gate.weight": torch.zeros(4, 8), "mlp.experts.gate_up_proj": torch.zeros(4, 8, 8),
           "mlp.experts.down_proj": torch.zeros(4, 8, 6)}
    with pytest.raises(ValueError, match="gate_up_proj"):
        from_fused_layout(bad, 4)


def test_model_config_matches_mixtral_config(tmp_path):
    from transformers import MixtralConfig

    for values in ({}, {"num_local_experts": 4, "num_experts_per_tok": 1, "sliding_window": 16, "head_dim": 32}):
        reference = MixtralConfig(hidden_size=64, num_attention_heads=4, **values)
        reference.save_pretrained(tmp_path)
        for source in ({"model_type": "mixtral", "hidden_size": 64, "num_attention_heads": 4, **values},
                       json.loads((tmp_path / "config.json").read_text())):
            ours = model_config(source)
            for key in ("num_local_experts", "num_experts_per_tok", "sliding_window", "rms_norm_eps",
                        "rope_parameters", "num_key_value_heads", "intermediate_size", "max_position_embeddings",
                        "router_jitter_noise", "bos_token_id", "eos_token_id", "tie_word_embeddings"):
                assert getattr(ours, key) == getattr(reference, key), key


@pytest.mark.parametrize("quant_type, min_cosine", [("int8", 0.999), ("nf4", 0.98)])
def test_quantized_experts(quant_type, min_cosine, tmp_path):
    """int8 / nf4 Mixtral blocks: every projection (attention, each expert's gate/up and down) a bitsandbytes
    module, router and norms in float. transformers has no bitsandbytes path for its fused 3D experts to compare
    with, so the reference is the float model: the logits stay close (a mis-wired expert would not), the fused
    path equals the pass without a cache, and batched rows equal single ones."""
    import bitsandbytes as bnb

    from server.placement.memory import block_parameter_counts
    from swarm.modeling.quantize import QuantizedMoeLayer, quantized_weight_bytes

    reference = save_tiny("mixtral", tmp_path, None, vocab_size=VOCAB)
    span = BlockSpan.load(Checkpoint(str(tmp_path)), 0, 4, "float32", quant_type=quant_type)
    assert all(isinstance(layer, QuantizedMoeLayer) for layer in span.layers)
    layer = span.layers[0]
    assert not any(isinstance(m, torch.nn.Linear) and not isinstance(m, (bnb.nn.Linear8bitLt, bnb.nn.Linear4bit))
                   for m in layer.modules())
    float_bytes = sum(p.numel() * 4 for n, p in reference.model.layers[0].named_parameters() if "norm" not in n)
    assert quantized_weight_bytes(layer) < float_bytes / (3 if quant_type == "int8" else 5)
    # memory planning counts what stays float (the norms and the router) at the dtype, the rest quantized
    _, other = block_parameter_counts(span.config)
    assert sum(p.numel() for p in layer.parameters() if p.is_floating_point()) == other
    torch.manual_seed(3)
    ids = torch.randint(3, VOCAB, (2, 12))
    with torch.no_grad():
        expected = reference(ids).logits
        embeds = reference.model.embed_tokens(ids)
    hidden = span.forward(embeds, 0, span.new_session_kv(2, 32, 0, 4))
    got = _logits(reference, hidden)
    assert torch.nn.functional.cosine_similarity(got.flatten(), expected.flatten(), dim=0).item() > min_cosine
    assert torch.allclose(span.forward(embeds, 0, None), hidden, atol=1e-5, rtol=1e-5)
    kvs = [span.new_session_kv(1, 32, 0, 4) for _ in range(2)]
    for row, kv in enumerate(kvs):
        span.forward(embeds[row:row + 1, :5 + row], 0, kv)
    x = torch.randn(2, 1, span.hidden_size)
    together = span.forward_batch([(x[row:row + 1], 5 + row, kv) for row, kv in enumerate(kvs)], 0, 4)
    for row, kv in enumerate(kvs):
        kv.begin_step(5 + row)
        alone = span.forward_batch([(x[row:row + 1], 5 + row, kv)], 0, 4)[0]
        assert torch.allclose(alone, together[row], atol=1e-5, rtol=1e-5)


def test_server_memory_counts_every_expert(mixtral):
    """`server.placement.memory` sizes a block from the layer module: every expert's weights (as linear weights, which
    quantization shrinks; not the router, which it keeps float) and the norms, as many parameters as transformers' block
    has."""
    from server.placement.memory import block_parameter_counts

    _, path, reference, _ = mixtral
    linear, other = block_parameter_counts(Checkpoint(str(path)).load_config())
    assert linear + other == sum(p.numel() for p in reference.model.layers[0].parameters())
    config = reference.config  # the two norms and the router (int8 / nf4 keep it float)
    assert other == 2 * config.hidden_size + config.num_local_experts * config.hidden_size
