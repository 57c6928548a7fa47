"""A checkpoint's `config.json` as a config object, without transformers' model-specific config classes.

In transformers 5, importing `LlamaConfig` (what `AutoConfig` does for a llama checkpoint) imports the model
package and its type validators, and with them torch._dynamo, torch.distributed and sympy: about 100 MB of
resident memory in every process that merely reads a config (servers, clients, the gateway). `model_config`
builds transformers' base `PreTrainedConfig` from the file instead, with what the family's config class would
add: its defaults for absent keys (`FAMILY_DEFAULTS`, copied from the transformers classes; a test compares
them), `head_dim` and `num_key_value_heads` derived as those classes do, and the RoPE parameters standardized
by transformers' own `standardize_rope_params` (legacy `rope_theta` / `rope_scaling` keys included).

BLOOM and Falcon name their sizes differently; their configs get the llama names too, so that `ModelShape` and
the rest read one vocabulary: `num_hidden_layers` / `num_attention_heads` / `hidden_size` (from `n_layer` /
`n_head` / `n_embed` where a file uses those), `intermediate_size` (BLOOM: 4 * hidden; Falcon:
`ffn_hidden_size`) and `num_key_value_heads`, the key/value heads the cache holds (BLOOM: all heads; Falcon:
`num_kv_heads` with `new_decoder_architecture`, else 1 with `multi_query`, else all heads).
"""
from __future__ import annotations

from typing import Any, Dict

from swarm.modeling.shape import head_dim_of

# defaults of transformers' LlamaConfig, MistralConfig, Qwen2Config and MixtralConfig for the keys a checkpoint
# may leave out
_COMMON: Dict[str, Any] = dict(vocab_size=32000, hidden_size=4096, num_hidden_layers=32, num_attention_heads=32,
                               hidden_act="silu", rms_norm_eps=1e-6, tie_word_embeddings=False, use_cache=True,
                               attention_dropout=0.0, initializer_range=0.02, pad_token_id=None, head_dim=None)
FAMILY_DEFAULTS: Dict[str, Dict[str, Any]] = {
    "llama": {**_COMMON, "intermediate_size": 11008, "num_key_value_heads": None, "max_position_embeddings": 2048,
              "bos_token_id": 1, "eos_token_id": 2, "pretraining_tp": 1, "attention_bias": False, "mlp_bias": False},
    "mistral": {**_COMMON, "intermediate_size": 14336, "num_key_value_heads": 8, "max_position_embeddings": 4096 * 32,
                "bos_token_id": 1, "eos_token_id": 2, "sliding_window": 4096},
    "qwen2": {**_COMMON, "vocab_size": 151936, "intermediate_size": 22016, "num_key_value_heads": 32,
              "max_position_embeddings": 32768, "bos_token_id": None, "eos_token_id": None,
              "use_sliding_window": False, "sliding_window": 4096, "max_window_layers": 28},
    "mixtral": {**_COMMON, "intermediate_size": 14336, "num_key_value_heads": 8, "max_position_embeddings": 4096 * 32,
                "rms_norm_eps": 1e-5, "bos_token_id": 1, "eos_token_id": 2, "sliding_window": None,
                "num_experts_per_tok": 2, "num_local_experts": 8, "router_jitter_noise": 0.0,
                "output_router_logits": False, "router_aux_loss_coef": 0.001},
}
# Qwen3Config, Qwen3MoeConfig and Phi3Config's
_QWEN3: Dict[str, Any] = {**_COMMON, "vocab_size": 151936, "max_position_embeddings": 32768, "bos_token_id": None,
                          "eos_token_id": None, "attention_bias": False, "use_sliding_window": False,
                          "sliding_window": 4096, "max_window_layers": 28}
FAMILY_DEFAULTS.update({
    "qwen3": {**_QWEN3, "intermediate_size": 22016, "num_key_value_heads": 32, "head_dim": 128},
    "qwen3_moe": {**{k: v for k, v in _QWEN3.items() if k != "max_window_layers"}, "hidden_size": 2048,
                  "intermediate_size": 6144, "num_hidden_layers": 24,
                  "num_key_value_heads": 4, "decoder_sparse_step": 1, "moe_intermediate_size": 768,
                  "num_experts_per_tok": 8, "num_local_experts": 128, "norm_topk_prob": False, "mlp_only_layers": [],
                  "output_router_logits": False, "router_aux_loss_coef": 0.001},
    "phi3": {**_COMMON, "vocab_size": 32064, "hidden_size": 3072, "intermediate_size": 8192,
             "num_key_value_heads": None, "resid_pdrop": 0.0, "embd_pdrop": 0.0, "max_position_embeddings": 4096,
             "original_max_position_embeddings": 4096, "rms_norm_eps": 1e-5, "bos_token_id": 1, "eos_token_id": 32000,
             "pad_token_id": 32000, "sliding_window": None},
})
# Gemma2Config's and Gemma3TextConfig's
_GEMMA: Dict[str, Any] = {**_COMMON, "hidden_size": 2304, "intermediate_size": 9216, "num_hidden_layers": 26,
                          "num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 256,
                          "hidden_activation": "gelu_pytorch_tanh", "pad_token_id": 0, "eos_token_id": 1,
                          "bos_token_id": 2, "tie_word_embeddings": True, "attention_bias": False,
                          "query_pre_attn_scalar": 256, "sliding_window": 4096, "layer_types": None}
FAMILY_DEFAULTS.update({
    "gemma2": {**_GEMMA, "vocab_size": 256000, "max_position_embeddings": 8192, "final_logit_softcapping": 30.0,
               "attn_logit_softcapping": 50.0},
    "gemma3_text": {**_GEMMA, "vocab_size": 262208, "max_position_embeddings": 131072,
                    "final_logit_softcapping": None, "attn_logit_softcapping": None,
                    "use_bidirectional_attention": False},
})
# GptOssConfig's
_GPT_OSS_ROPE = {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
                 "original_max_position_embeddings": 4096}
FAMILY_DEFAULTS["gpt_oss"] = {
    **_COMMON, "num_hidden_layers": 36, "num_local_experts": 128, "vocab_size": 201088, "hidden_size": 2880,
    "intermediate_size": 2880, "head_dim": 64, "num_attention_heads": 64, "num_key_value_heads": 8,
    "sliding_window": 128, "max_position_embeddings": 131072, "rms_norm_eps": 1e-5, "num_experts_per_tok": 4,
    "swiglu_alpha": 1.702, "swiglu_limit": 7.0, "router_aux_loss_coef": 0.001, "output_router_logits": False,
    "attention_bias": True, "layer_types": None, "bos_token_id": None, "eos_token_id": None}
# DeepseekV3Config's (head_dim: the rotary part's size, as the class derives it)
FAMILY_DEFAULTS["deepseek_v3"] = {
    **_COMMON, "vocab_size": 129280, "hidden_size": 7168, "intermediate_size": 18432, "moe_intermediate_size": 2048,
    "num_hidden_layers": 61, "num_attention_heads": 128, "num_key_value_heads": None, "n_shared_experts": 1,
    "n_routed_experts": 256, "routed_scaling_factor": 2.5, "kv_lora_rank": 512, "q_lora_rank": 1536,
    "qk_rope_head_dim": 64, "v_head_dim": 128, "qk_nope_head_dim": 128, "n_group": 8, "topk_group": 4,
    "num_experts_per_tok": 8, "first_k_dense_replace": 3, "norm_topk_prob": True, "max_position_embeddings": 4096,
    "bos_token_id": 0, "eos_token_id": 1, "rope_interleave": True, "attention_bias": False,
    "output_router_logits": False}
_LAYER_NORM: Dict[str, Any] = dict(vocab_size=32000, hidden_size=64, num_hidden_layers=2, num_attention_heads=8,
                                   layer_norm_epsilon=1e-5, initializer_range=0.02, use_cache=True, pad_token_id=None,
                                   hidden_dropout=0.0, attention_dropout=0.0, tie_word_embeddings=True)
FAMILY_DEFAULTS.update({
    "bloom": {**_LAYER_NORM, "vocab_size": 250880, "bos_token_id": 1, "eos_token_id": 2,
              "apply_residual_connection_post_layernorm": False, "pretraining_tp": 1, "slow_but_exact": False},
    "falcon": {**_LAYER_NORM, "vocab_size": 65024, "hidden_size": 4544, "num_hidden_layers": 32,
               "num_attention_heads": 71, "num_ln_in_parallel_attn": None, "num_kv_heads": None, "alibi": False,
               "new_decoder_architecture": False, "multi_query": True, "parallel_attn": True, "bias": False,
               "max_position_embeddings": 2048, "bos_token_id": 11, "eos_token_id": 11, "ffn_hidden_size": None,
               "activation": "gelu"},
})
_ALIASES = (("n_embed", "hidden_size"), ("n_layer", "num_hidden_layers"), ("n_head", "num_attention_heads"),
            ("num_experts", "num_local_experts"))  # (the last: Qwen3-MoE hub files)
# the family classes' `default_theta` where it is not the base class's 10000
_DEFAULT_THETA = {"mixtral": 1e6, "gpt_oss": 150000.0}
_ROPE_KEYS = ("rope_parameters", "rope_scaling", "rope_theta")


def model_config(data: Dict[str, Any]):
    """The config of a `config.json` dict (a `transformers.PreTrainedConfig`; attributes as the family's class)."""
    from transformers.configuration_utils import PreTrainedConfig

    values = dict(data)
    family = values.get("model_type")
    defaults = FAMILY_DEFAULTS.get(family) if isinstance(family, str) else None
    if defaults is None:  # not a family we serve: its keys as they are (`family_for` rejects it with a clear error)
        return PreTrainedConfig(**values)
    for alias, name in _ALIASES:  # BLOOM's (and old Falcon files') names for the sizes
        if alias in values:
            aliased = values.pop(alias)
            values.setdefault(name, aliased)
    values = {**defaults, **values}
    rope = {key: values.pop(key, None) for key in _ROPE_KEYS}
    config = PreTrainedConfig(**values)
    if family == "deepseek_v3":
        config.head_dim = config.qk_rope_head_dim  # (rotary runs on that part of each head)
        config.qk_head_dim = config.qk_nope_head_dim + config.qk_rope_head_dim
    config.head_dim = head_dim_of(config)
    if getattr(config, "num_key_value_heads", None) is None:
        config.num_key_value_heads = config.num_attention_heads
    if family in ("qwen2", "qwen3", "qwen3_moe") and not config.use_sliding_window:
        config.sliding_window = None
    if family == "bloom":  # ALiBi, no RoPE; a 4 * hidden MLP
        config.intermediate_size = 4 * config.hidden_size
        config.num_key_value_heads = config.num_attention_heads
        return config
    if family == "falcon":
        _falcon_sizes(config)
    if family in ("gemma2", "gemma3_text", "gpt_oss"):
        pattern = int(values.get("sliding_window_pattern", 6 if family == "gemma3_text" else 2))
        if not config.layer_types:  # as the config classes: `pattern - 1` sliding layers, then a full one
            config.layer_types = ["sliding_attention" if (i + 1) % pattern else "full_attention"
                                  for i in range(config.num_hidden_layers)]
    if family == "gemma3_text":
        _gemma3_rope(config, rope, values)
        return config
    # as the family classes do: rope_scaling (legacy) or rope_parameters, with rope_theta (default 10000) inside
    parameters = dict(rope["rope_scaling"] or rope["rope_parameters"]
                      or (_GPT_OSS_ROPE if family == "gpt_oss" else {}))
    default_theta = _DEFAULT_THETA.get(str(family), config.default_theta)
    parameters.setdefault("rope_theta", rope["rope_theta"] if rope["rope_theta"] is not None else default_theta)
    if family == "phi3":  # as Phi3Config: rotary on whole heads unless named, and the legacy names of LongRoPE
        parameters.setdefault("partial_rotary_factor", 1.0)
    config.rope_parameters = parameters
    config.standardize_rope_params()
    if family == "phi3" and config.rope_parameters.get("rope_type") in ("su", "yarn"):
        config.rope_parameters["rope_type"] = "longrope"
    if family == "phi3" and config.rope_parameters.get("rope_type") == "longrope":
        config.rope_parameters.setdefault("original_max_position_embeddings", config.original_max_position_embeddings)
    return config


def _gemma3_rope(config, rope: Dict[str, Any], values: Dict[str, Any]) -> None:
    """Gemma3TextConfig's RoPE parameters per layer type: `rope_parameters` {"sliding_attention": ...,
    "full_attention": ...}, or from the legacy keys (`rope_theta` for the full layers with `rope_scaling`,
    `rope_local_base_freq` for the sliding ones)."""
    parameters = {k: dict(v) for k, v in (rope["rope_parameters"] or {}).items()} or {
        "sliding_attention": {"rope_type": "default"}, "full_attention": {"rope_type": "default"}}
    if rope["rope_scaling"]:
        parameters.setdefault("full_attention", {"rope_type": "default"}).update(rope["rope_scaling"])
    full = parameters.setdefault("full_attention", {"rope_type": "default"})
    full.setdefault("rope_theta", rope["rope_theta"] if rope["rope_theta"] is not None else 1_000_000.0)
    sliding = parameters.setdefault("sliding_attention", {"rope_type": "default"})
    sliding.setdefault("rope_theta", values.get("rope_local_base_freq", 10_000.0))
    config.rope_parameters = parameters
    config.standardize_rope_params()


def _falcon_sizes(config) -> None:
    """FalconConfig's derived sizes, and the key/value heads of each layout under the llama name."""
    if config.num_kv_heads is None:
        config.num_kv_heads = config.num_attention_heads
    if config.ffn_hidden_size is None:
        config.ffn_hidden_size = 4 * config.hidden_size
    config.intermediate_size = config.ffn_hidden_size
    if config.new_decoder_architecture:
        config.num_key_value_heads = config.num_kv_heads
    else:
        config.num_key_value_heads = 1 if config.multi_query else config.num_attention_heads
