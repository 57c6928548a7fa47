"""Model families: where each family keeps its blocks and its client-side parts.

Client and server must agree on how a checkpoint is cut: which tensors belong to block i (the server loads
those), and which are the embeddings, final norm and LM head (the client loads those). One `FamilySpec` per
supported `config.model_type` names the family's modeling module and the classes in it. A new family is one
module plus its tests; `swarm.modeling.llama` serves llama, mistral and qwen2, `swarm.modeling.mixtral`
mixtral, `swarm.modeling.bloom` BLOOM, `swarm.modeling.falcon` Falcon, `swarm.modeling.qwen3` Qwen3,
`swarm.modeling.qwen3_moe` Qwen3-MoE, `swarm.modeling.phi3` Phi-3, `swarm.modeling.gemma` Gemma 2 and 3
(text), `swarm.modeling.gpt_oss` GPT-OSS and `swarm.modeling.deepseek_v3` DeepSeek-V3. A family module provides
- its decoder layer class (nn.Modules under transformers' parameter names) with transformers' calling convention
  `layer(hidden, attention_mask, position_ids, past_key_values, position_embeddings=(cos, sin))` (None without
  rotary), a settable `layer_idx`, its rotary embedding class (none for ALiBi-only families) and its norm class
  (also the client's final norm, and its embedding norm where the family has one: BLOOM);
- optionally a function (`FamilySpec.fuse`) that turns a loaded layer into a `BlockLayer`, which the server's
  batched decode, prefill and CUDA-graph steps run; without it the server runs the layer modules.
"""
from __future__ import annotations

import importlib
from dataclasses import dataclass, replace
from typing import Callable, Dict, Optional, Protocol

import torch


class UnsupportedModelError(ValueError):
    pass


class BlockLayer(Protocol):
    """What the server's steps (`server.decode`, `server.graphs`) use of a layer: its attention's sizes and one
    block step. x: [..., hidden] (tokens on the leading dims), cos and sin: [..., head_dim] (None for a span
    without rotary); `attend(layer, q [..., heads, head_dim], k [..., kv_heads, head_dim], v) -> [..., heads *
    head_dim]` is the step's attention, given q and k with rotary applied. An ALiBi layer also has
    `key_bias(key_length, dtype, device) -> [heads, key_length]`, the bias its attention adds
    (`swarm.modeling.layers.key_bias`)."""
    heads: int
    kv_heads: int
    head_dim: int
    scaling: float
    layer_idx: int  # where the layer's keys/values are in the span's cache

    def step(self, x: torch.Tensor, cos: Optional[torch.Tensor], sin: Optional[torch.Tensor],
             attend: Callable) -> torch.Tensor: ...


@dataclass(frozen=True)
class FamilySpec:
    model_type: str
    block_prefix: str  # format with the block index: the prefix of that block's tensor names
    embed_key: str
    norm_key: str  # prefix of the final norm's tensors
    head_key: str  # LM head weight (may be absent when tied to the embeddings)
    layer_class: str
    rotary_class: Optional[str]
    norm_class: str
    module: str  # the family's modeling module, where the classes above are
    fuse: Optional[str] = None  # the module's function that makes a loaded layer a `BlockLayer`
    norm_eps: str = "rms_norm_eps"  # the config attribute of the norms' epsilon
    embed_norm_key: Optional[str] = None  # prefix of a norm the client applies to the embeddings (BLOOM)
    base_prefix: str = ""  # the base model's prefix, which checkpoints saved from the base model lack (BLOOM's)
    # its blocks split across devices (`swarm.modeling.tensor_parallel`: llama's and Mixtral's fused layers); a new
    # family: no
    tensor_parallel: bool = False
    # the module's function (config, embed, lm_head) -> (embed, lm_head) that changes the client's parts (Gemma's
    # embedding scale and final soft-cap)
    client_parts: Optional[str] = None

    @property
    def serves_adapters(self) -> bool:
        """LoRA adapters (`swarm.modeling.lora`) apply to its blocks: Llama's block step on fused layers."""
        return self.module in LORA_MODULES

    def block_tensor_prefix(self, index: int) -> str:
        return self.block_prefix.format(index)

    def import_class(self, name: str):
        return getattr(importlib.import_module(self.module), name)

    def load_norm(self, config, prefix: str, tensors: Dict[str, torch.Tensor]) -> torch.nn.Module:
        """The family's norm (`norm_class`, its epsilon from the config) holding the `prefix` tensors of `tensors`."""
        norm = self.import_class(self.norm_class)(config.hidden_size, eps=getattr(config, self.norm_eps, 1e-6))
        state = {k[len(prefix):]: v for k, v in tensors.items() if k.startswith(prefix)}
        if not state:
            raise ValueError(f"no {prefix}* tensors in the checkpoint")
        norm.load_state_dict(state)
        return norm


# (the mixtures of experts: adapters on their attention)
LORA_MODULES = ("swarm.modeling.llama", "swarm.modeling.qwen3", "swarm.modeling.phi3", "swarm.modeling.mixtral",
                "swarm.modeling.qwen3_moe", "swarm.modeling.bloom", "swarm.modeling.falcon")


def _llama_like(model_type: str, camel: str) -> FamilySpec:
    return FamilySpec(
        model_type=model_type,
        block_prefix="model.layers.{}.",
        embed_key="model.embed_tokens.weight",
        norm_key="model.norm.",
        head_key="lm_head.weight",
        layer_class=f"{camel}DecoderLayer",
        rotary_class=f"{camel}RotaryEmbedding",
        norm_class=f"{camel}RMSNorm",
        module="swarm.modeling.llama",
        fuse="fuse_layer",
        tensor_parallel=True,
    )


def _layer_norm_family(model_type: str, camel: str, rotary: bool, embed_norm: bool) -> FamilySpec:
    """BLOOM and Falcon: `transformer.` names, LayerNorms, the layers their own `BlockLayer`s."""
    return FamilySpec(
        model_type=model_type,
        block_prefix="transformer.h.{}.",
        embed_key="transformer.word_embeddings.weight",
        norm_key="transformer.ln_f.",
        head_key="lm_head.weight",
        layer_class=f"{camel}DecoderLayer",
        rotary_class=f"{camel}RotaryEmbedding" if rotary else None,
        norm_class=f"{camel}LayerNorm",
        module=f"swarm.modeling.{model_type}",
        fuse="fuse_layer",
        norm_eps="layer_norm_epsilon",
        embed_norm_key="transformer.word_embeddings_layernorm." if embed_norm else None,
        base_prefix="transformer.",
    )


FAMILIES = {
    spec.model_type: spec
    for spec in (
        _llama_like("llama", "Llama"),
        _llama_like("mistral", "Mistral"),
        _llama_like("qwen2", "Qwen2"),
        _layer_norm_family("bloom", "Bloom", rotary=False, embed_norm=True),  # ALiBi
        _layer_norm_family("falcon", "Falcon", rotary=True, embed_norm=False),  # rotary, or ALiBi with `alibi`
        # Llama's attention with a mixture of experts; both layouts of the experts' tensors load
        replace(_llama_like("mixtral", "Mixtral"), module="swarm.modeling.mixtral"),
        # Llama's block with q/k norms per head (and Qwen3-MoE's experts)
        replace(_llama_like("qwen3", "Qwen3"), module="swarm.modeling.qwen3", tensor_parallel=False),
        replace(_llama_like("qwen3_moe", "Qwen3Moe"), module="swarm.modeling.qwen3_moe", tensor_parallel=False),
        # Llama's block with q/k/v and gate/up fused in the checkpoint
        replace(_llama_like("phi3", "Phi3"), module="swarm.modeling.phi3", tensor_parallel=False),
        # pre- and post-norms, scaled embeddings; Gemma 2 soft-caps (eager attention: `layers.layer_sdpa`),
        # Gemma 3 has q/k norms and two rotary bases
        replace(_llama_like("gemma2", "Gemma2"), module="swarm.modeling.gemma", client_parts="client_parts",
                tensor_parallel=False),
        replace(_llama_like("gemma3_text", "Gemma3"), module="swarm.modeling.gemma", client_parts="client_parts",
                tensor_parallel=False),
        # attention sinks (eager attention: `layers.layer_sdpa`) and its own experts
        replace(_llama_like("gpt_oss", "GptOss"), module="swarm.modeling.gpt_oss", tensor_parallel=False),
        # multi-head latent attention (a latent cache: `shape.CacheLayout`), shared experts and grouped routing
        replace(_llama_like("deepseek_v3", "DeepseekV3"), module="swarm.modeling.deepseek_v3", tensor_parallel=False),
    )
}


def family_for(config) -> FamilySpec:
    spec = FAMILIES.get(str(getattr(config, "model_type", "")))
    if spec is None:
        raise UnsupportedModelError(
            f"model type {getattr(config, 'model_type', None)!r} is not supported; supported: {sorted(FAMILIES)}"
        )
    return spec
