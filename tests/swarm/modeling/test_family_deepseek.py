"""DeepSeek-V3 (`swarm.modeling.families.deepseek_v3`) beyond the in-process comparisons it shares with the other open
models (tests/swarm/modeling/test_family_open_models.py: logits, chunked prefill, greedy decoding, batched rows, a
left-padded batch and training gradients against transformers, with and without q_lora_rank, YaRN and both rotary
layouts): its latent cache (bytes per token, values as views of the keys, the shared CPU arena's sessions equal to their
own buffers'), its config against transformers' `DeepseekV3Config`, what it refuses with a clear error (adapters, CUDA
graphs, nf4 on widths it cannot quantize; its int8 / nf4 blocks: test_deepseek_quant.py), and two servers split
mid-model against transformers (`check_split_swarm`; a session failing over in the extended tier).
"""
from __future__ import annotations

import json

import pytest
import torch

from server.compute.blocks import BlockSpan
from swarm.modeling.checkpoint import Checkpoint
from swarm.modeling.model_config import model_config
from swarm.modeling.shape import ModelShape
from tests.fixtures.family_configs import DEEPSEEK, DEEPSEEK_YARN, VOCAB
from tests.fixtures.span_checks import check_batched_rows
from tests.fixtures.swarm_checks import check_failover, check_split_swarm
from tests.fixtures.tiny_checkpoints import save_tiny


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = tmp_path_factory.mktemp("deepseek")
    reference = save_tiny("deepseek_v3", path, None, vocab_size=VOCAB, **DEEPSEEK)
    return path, reference


def test_the_cache_holds_the_latent(tiny):
    """Per token and block the cache holds the latent and the rotary key (32 + 8 channels), the values being views
    of the keys' first 32: 4 x fewer bytes than full keys and values of 4 heads (24 + 16 channels each) here, 71 x
    fewer for DeepSeek-V3's own sizes (1152 bytes per token and block in bfloat16 against 81920)."""
    path, _ = tiny
    span = BlockSpan.load(Checkpoint(str(path)), 0, 4, "float32")
    kv = span.new_session_kv(2, 16, 0, 4)
    assert [list(k.shape) for k in kv.keys] == [[2, 1, 16, 40]] * 4
    assert [list(v.shape) for v in kv.values] == [[2, 1, 16, 32]] * 4
    assert all(v.data_ptr() == k.data_ptr() for k, v in zip(kv.keys, kv.values))
    full = 4 * (24 + 16) * 4  # heads * (qk_head_dim + v_head_dim) * float32 bytes, per block
    assert span.cache_bytes_per_token() == 4 * 40 * 4 == 4 * full // 4
    real = ModelShape.from_config(model_config({"model_type": "deepseek_v3"}))
    assert real.cache_bytes_per_token(torch.bfloat16) == (512 + 64) * 2 == 1152
    assert 128 * (192 + 128) * 2 // 1152 == 71
    # beam search reorders the rows once (the values are the same memory)
    span.forward(torch.randn(2, 5, span.hidden_size), 0, kv)
    before = kv.keys[0][:, :, :5].clone()
    kv.reorder(torch.tensor([1, 0]), 5)
    assert torch.equal(kv.keys[0][:, :, :5], before.flip(0))


def test_memory_planning_counts_an_expert_block(tiny):
    """A server plans its blocks by the larger of the first (dense) and last (experts) blocks' parameters."""
    from server.placement.memory import block_parameter_counts

    path, reference = tiny
    linear, other = block_parameter_counts(Checkpoint(str(path)).load_config())
    layer = reference.model.layers[3]
    assert linear + other == sum(t.numel() for t in list(layer.parameters()) + list(layer.buffers()))
    assert linear + other > sum(p.numel() for p in reference.model.layers[0].parameters())


def test_arena_sessions_equal_their_own_buffers(tiny):
    """One-row sessions on the shared CPU arena (`server.compute.kv_arena`, the latent layout: values inside the keys)
    attend together in a decode batch and give what sessions with buffers of their own give."""
    path, _ = tiny
    span = BlockSpan.load(Checkpoint(str(path)), 0, 4, "float32")
    torch.manual_seed(3)
    prompts = [torch.randn(1, n, span.hidden_size) for n in (3, 6, 4)]
    steps = [torch.randn(1, 1, span.hidden_size) for _ in prompts]

    def decode_batch() -> list:
        kvs = [span.new_session_kv(1, 16, 0, 4) for _ in prompts]
        for prompt, kv in zip(prompts, kvs):
            span.forward(prompt, 0, kv)
        assert all((kv.slot is not None) == (span.kv_arena is not None) for kv in kvs)
        return span.forward_batch([(x, p.shape[1], kv) for x, p, kv in zip(steps, prompts, kvs)], 0, 4)

    own = decode_batch()
    assert span.enable_kv_arena(64)
    for a, b in zip(own, decode_batch()):
        assert torch.allclose(a, b, atol=1e-5, rtol=1e-5)
    check_batched_rows(span)  # (arena sessions batched equal each alone)


def test_model_config_matches_transformers_config(tmp_path):
    from transformers import AutoConfig

    keys = ("head_dim", "num_key_value_heads", "intermediate_size", "rms_norm_eps", "rope_parameters", "kv_lora_rank",
            "q_lora_rank", "qk_rope_head_dim", "qk_nope_head_dim", "v_head_dim", "qk_head_dim", "n_routed_experts",
            "n_group", "topk_group", "num_experts_per_tok", "first_k_dense_replace", "norm_topk_prob",
            "routed_scaling_factor", "n_shared_experts", "moe_intermediate_size", "rope_interleave", "attention_bias",
            "max_position_embeddings", "bos_token_id", "eos_token_id", "tie_word_embeddings", "vocab_size")
    for values in ({}, DEEPSEEK, DEEPSEEK_YARN):
        reference = AutoConfig.for_model("deepseek_v3", **values)
        reference.save_pretrained(tmp_path)
        saved = json.loads((tmp_path / "config.json").read_text())
        for source in ({"model_type": "deepseek_v3", **values}, saved):
            ours = model_config(source)
            for key in keys:
                assert getattr(ours, key) == getattr(reference, key), (values, key)
    # the hub's file: legacy rope_scaling (YaRN with DeepSeek's mscale keys)
    legacy = {"rope_theta": 10000, "rope_scaling": {"type": "yarn", "factor": 40, "mscale": 1.0, "mscale_all_dim": 1.0,
                                                    "original_max_position_embeddings": 4096, "beta_fast": 32,
                                                    "beta_slow": 1}}
    assert model_config({"model_type": "deepseek_v3", **legacy}).rope_parameters == \
        AutoConfig.for_model("deepseek_v3", **legacy).rope_parameters


def test_what_deepseek_blocks_refuse(tiny, tmp_path):
    """CUDA graphs (the latent cache) and nf4 on widths bitsandbytes' 64-value blocks do not divide are refused with
    one line each (int8 / nf4 blocks: tests/swarm/modeling/test_deepseek_quant.py; LoRA adapters are served:
    test_family_open_models.py)."""
    path, _ = tiny
    with pytest.raises(ValueError, match="nf4 needs input sizes divisible by 64: self_attn.q_b_proj has 24"):
        BlockSpan.load(Checkpoint(str(path)), 0, 2, "float32", quant_type="nf4")
    span = BlockSpan.load(Checkpoint(str(path)), 0, 2, "float32")
    span.device = torch.device("cuda")  # (the refusal's reason only: nothing runs)
    assert "latent" in (span.cuda_graphs_refusal() or "")
    save_tiny("deepseek_v3", tmp_path, None, vocab_size=VOCAB, **dict(DEEPSEEK, n_group=8))  # groups of one expert
    with pytest.raises(ValueError, match="n_group"):
        BlockSpan.load(Checkpoint(str(tmp_path)), 0, 2, "float32")


def test_deepseek_through_a_split_swarm(tmp_path, bootstrap, model_path, tokenizer, monkeypatch):
    path = tmp_path / "tiny-deepseek"
    reference = save_tiny("deepseek_v3", path, model_path, max_shard_size="150KB", **DEEPSEEK)
    check_split_swarm(path, reference, "tds", bootstrap, tokenizer, monkeypatch)


@pytest.mark.extended
def test_deepseek_session_fails_over(tmp_path, bootstrap, model_path, tokenizer):
    path = tmp_path / "tiny-deepseek"
    reference = save_tiny("deepseek_v3", path, model_path, **DEEPSEEK_YARN)
    check_failover(path, reference, "tdsfo", bootstrap, tokenizer)
