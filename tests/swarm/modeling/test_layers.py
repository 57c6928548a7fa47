"""`swarm.modeling.families.llama` (the Llama family's layers) and `swarm.modeling.model_config` against the
transformers classes they stand in for, per family.

The layers must compute exactly what transformers' modeling code computes (same ops, so equal outputs: prefill,
a step after a cache with and without a mask, single-token decode, float32 and bfloat16, biases, RoPE scaling
types), and the config must carry the same values, defaults of absent keys and RoPE standardization included.
"""
from __future__ import annotations

import importlib
import json

import pytest
import torch

import swarm.modeling.families.llama as llama
from swarm.modeling.families import family_for
from swarm.modeling.model_config import model_config
from tests.fixtures.family_configs import LLAMA_TINY, llama_like_configs

CAMEL = {"llama": "Llama", "mistral": "Mistral", "qwen2": "Qwen2"}


def _cases():
    from transformers import LlamaConfig

    cases = dict(llama_like_configs())
    cases["llama-biases-llama3"] = LlamaConfig(
        **{**LLAMA_TINY, "num_key_value_heads": 4}, attention_bias=True, mlp_bias=True,
        rope_parameters={"rope_type": "llama3", "rope_theta": 5e5, "factor": 8.0, "low_freq_factor": 1.0,
                         "high_freq_factor": 4.0, "original_max_position_embeddings": 64})
    cases["llama-dynamic"] = LlamaConfig(**LLAMA_TINY, rope_parameters={"rope_type": "dynamic", "rope_theta": 1e4,
                                                                   "factor": 2.0})
    return cases


class _PastKV:
    """What the layers' attention sees of a cache: earlier keys/values, then the new ones appended."""

    def __init__(self, keys, values):
        self.keys, self.values = keys, values

    def update(self, k, v, layer_idx, *args, **kwargs):  # as `transformers.Cache.update` (5.24 passes kwargs=)
        return torch.cat([self.keys, k], dim=2), torch.cat([self.values, v], dim=2)


@pytest.mark.parametrize("name", list(_cases()))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_layers_compute_what_transformers_computes(name, dtype):
    hf_config = _cases()[name]
    hf_config._attn_implementation = "sdpa"
    family = hf_config.model_type
    hf = importlib.import_module(f"transformers.models.{family}.modeling_{family}")
    ours_config = model_config(hf_config.to_dict())
    torch.manual_seed(0)
    reference = getattr(hf, f"{CAMEL[family]}DecoderLayer")(hf_config, 1).to(dtype).eval()
    spec = family_for(ours_config)  # the family's classes, registered by reference (Llama's for all three)
    assert spec.layer.__module__ == llama.__name__
    ours = spec.layer(ours_config, 1).to(dtype).eval()
    ours.load_state_dict(reference.state_dict(), strict=True)
    rotary_ref = getattr(hf, f"{CAMEL[family]}RotaryEmbedding")(config=hf_config)
    assert spec.rotary is not None
    rotary = spec.rotary(ours_config)
    norm_ref = getattr(hf, f"{CAMEL[family]}RMSNorm")(LLAMA_TINY["hidden_size"], eps=1e-5).to(dtype)
    norm = spec.norm(LLAMA_TINY["hidden_size"], eps=1e-5).to(dtype)
    norm.load_state_dict(norm_ref.state_dict())
    kv_heads, head_dim = hf_config.num_key_value_heads, ours.self_attn.head_dim
    # (batch, positions before, new positions, with an explicit mask); position 200 > the llama3 original length
    for batch, start, seq, masked in [(2, 0, 7, False), (1, 0, 1, False), (2, 5, 3, True), (3, 8, 1, False),
                                      (2, 200, 40, True)]:
        x = torch.randn(batch, seq, LLAMA_TINY["hidden_size"], dtype=dtype)
        positions = torch.arange(start, start + seq)[None].expand(batch, -1)
        cos, sin = rotary(x, positions)
        cos_ref, sin_ref = rotary_ref(x, positions)
        assert torch.equal(cos, cos_ref) and torch.equal(sin, sin_ref)
        past = (torch.randn(batch, kv_heads, start, head_dim, dtype=dtype),
                torch.randn(batch, kv_heads, start, head_dim, dtype=dtype))
        mask = None
        if masked:
            allowed = torch.arange(start + seq)[None] <= positions[0][:, None]
            mask = torch.zeros(allowed.shape, dtype=dtype).masked_fill_(~allowed, torch.finfo(dtype).min)[None, None]
        with torch.no_grad():
            expected = reference(x, attention_mask=mask, position_ids=positions,
                                 past_key_values=_PastKV(*past) if start else None, use_cache=bool(start),
                                 position_embeddings=(cos_ref, sin_ref))
            got = ours(x, attention_mask=mask, position_ids=positions,
                       past_key_values=_PastKV(*past) if start else None, use_cache=bool(start),
                       position_embeddings=(cos, sin))
        expected = expected[0] if isinstance(expected, tuple) else expected
        assert torch.equal(got, expected), (batch, start, seq, masked, (got - expected).abs().max())
        assert torch.equal(norm(x), norm_ref(x))


def _config_cases():
    legacy_llama3 = {"rope_theta": 500000.0, "rope_scaling": {
        "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192}}
    return [
        ("llama", {}),
        ("llama", {"max_position_embeddings": 16384, **legacy_llama3}),
        ("llama", {"rope_scaling": {"type": "linear", "factor": 2.0}, "attention_bias": True}),
        ("mistral", {}),
        ("mistral", {"rope_theta": 1e6, "head_dim": 32, "sliding_window": None}),
        ("qwen2", {}),
        ("qwen2", {"num_key_value_heads": 2, "use_sliding_window": True, "rope_theta": 1e6,
                   "tie_word_embeddings": True, "torch_dtype": "bfloat16"}),
    ]


@pytest.mark.parametrize("family, values", _config_cases())
def test_model_config_matches_the_family_config_class(family, values, tmp_path):
    from transformers import AutoConfig

    values = {"hidden_size": 64, "num_attention_heads": 4, **values}
    reference = AutoConfig.for_model(family, **json.loads(json.dumps(values)))
    reference.save_pretrained(tmp_path)
    saved = json.loads((tmp_path / "config.json").read_text())
    keys = ["model_type", "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
            "num_attention_heads", "num_key_value_heads", "hidden_act", "max_position_embeddings", "rms_norm_eps",
            "tie_word_embeddings", "bos_token_id", "eos_token_id", "pad_token_id", "rope_parameters", "dtype",
            "sliding_window", "attention_bias", "mlp_bias"]
    for source in ({"model_type": family, **values}, saved):  # as written by hand, and as transformers saves it
        ours = model_config(json.loads(json.dumps(source)))
        for key in keys:
            if hasattr(reference, key):
                assert getattr(ours, key) == getattr(reference, key), key
        # the head size the attention layers use (qwen2's class has no head_dim field and derives it the same way)
        assert ours.head_dim == (getattr(reference, "head_dim", None) or 64 // 4)


@pytest.mark.parametrize("queries,keys,mask_kind", [(22, 1046, "additive"), (256, 512, "additive"), (7, 300, "bool"),
                                                    (5, 40, "per_head")])
def test_grouped_query_attention_with_a_mask_equals_the_heads_expanded(queries, keys, mask_kind):
    """A multi-token step over a cache (a mask, query heads sharing key/value heads): on the CPU SDPA's own
    grouped-query attention, bit for bit what transformers computes with the key/value heads expanded
    (`repeat_kv`), which it no longer copies."""
    from swarm.modeling.layers import repeat_kv, sdpa_attention

    generator = torch.Generator().manual_seed(queries)
    kv_heads, groups, dim = 3, 3, 64
    q = torch.randn(2, kv_heads * groups, queries, dim, generator=generator)
    k, v = (torch.randn(2, kv_heads, keys, dim, generator=generator) for _ in range(2))
    start = keys - queries
    allowed = torch.arange(keys)[None, :] <= (start + torch.arange(queries))[:, None]  # [queries, keys]
    if mask_kind == "bool":
        mask = allowed[None, None]
    else:
        mask = torch.zeros(queries, keys).masked_fill(~allowed, torch.finfo(torch.float32).min)[None, None]
        if mask_kind == "per_head":  # an ALiBi-like bias per query head
            mask = mask + torch.randn(1, kv_heads * groups, 1, keys, generator=generator)
    expected = torch.nn.functional.scaled_dot_product_attention(
        q, repeat_kv(k, groups), repeat_kv(v, groups), attn_mask=mask, scale=0.125).transpose(1, 2)
    assert torch.equal(sdpa_attention(q, k, v, mask, 0.125, groups), expected)
