"""Model families: where each family keeps its blocks and its client-side parts.

Client and server must agree on how a checkpoint is cut: which tensors belong to block i (the server loads
those), and which are the embeddings, final norm and LM head (the client loads those). One `FamilySpec` per
supported `config.model_type` holds the family's classes and functions themselves (`FAMILIES`, built here by
reference: no class is looked up by name). A new family is one module plus its tests and its line here;
`swarm.modeling.families.llama` serves llama, mistral and qwen2, `swarm.modeling.families.mixtral` mixtral,
`swarm.modeling.families.bloom` BLOOM, `swarm.modeling.families.falcon` Falcon, `swarm.modeling.families.qwen3` Qwen3,
`swarm.modeling.families.qwen3_moe` Qwen3-MoE,
`swarm.modeling.families.phi3` Phi-3, `swarm.modeling.families.gemma` Gemma 2 and 3 (text),
`swarm.modeling.families.gpt_oss` GPT-OSS and
`swarm.modeling.families.deepseek_v3` DeepSeek-V3. A family provides
- its decoder layer class (nn.Modules under transformers' parameter names) with transformers' calling convention
  `layer(hidden, attention_mask, position_ids, past_key_values, position_embeddings=(cos, sin))` (None without
  rotary), a settable `layer_idx`, its rotary embedding class (none for ALiBi-only families) and its norm class
  (also the client's final norm, and its embedding norm where the family has one: BLOOM);
- optionally a function (`FamilySpec.fuse`) that turns a loaded layer into a `BlockLayer`, which the server's
  batched decode, prefill and CUDA-graph steps run; without it the server runs the layer modules.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Dict, Optional, Protocol

import torch
from torch import nn

from swarm.modeling.families import bloom, deepseek_v3, falcon, gemma, gpt_oss, llama, mixtral, phi3, qwen3, qwen3_moe
from swarm.modeling.layers import RMSNorm, RotaryEmbedding


class UnsupportedModelError(ValueError):
    pass


class BlockLayer(Protocol):
    """What the server's steps (`server.compute.decode`, `server.compute.graphs`) use of a layer: its attention's sizes
    and one block step. x: [..., hidden] (tokens on the leading dims), cos and sin: [..., head_dim] (None for a span
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
    layer: type  # the decoder layer class: layer(config, layer_idx)
    rotary: Optional[type]  # rotary(config=config), None for ALiBi-only families
    norm: type  # norm(hidden_size, eps=...)
    fuse: Optional[Callable] = None  # a loaded layer -> its `BlockLayer`
    norm_eps: str = "rms_norm_eps"  # the config attribute of the norms' epsilon
    embed_norm_key: Optional[str] = None  # prefix of a norm the client applies to the embeddings (BLOOM)
    base_prefix: str = ""  # the base model's prefix, which checkpoints saved from the base model lack (BLOOM's)
    # its blocks split across devices (`swarm.modeling.tensor_parallel`: llama's and Mixtral's fused layers); a new
    # family: no
    tensor_parallel: bool = False
    # (config, embed, lm_head) -> (embed, lm_head): changes the client's parts (Gemma's embedding scale and final
    # soft-cap)
    client_parts: Optional[Callable] = None
    # LoRA adapters (`swarm.modeling.lora`) apply to its blocks (the mixtures of experts: their attention, and their
    # experts' stacked parameters through `target_parameters`, `swarm.modeling.lora_experts`)
    serves_adapters: bool = False
    # (config, held, total) -> whether extending a cached sequence of `held` positions to `total` computes all of it
    # again, as transformers' generate does (Phi-3's LongRoPE switching to its long factors: `phi3.recomputes_cache`)
    recompute_cache: Optional[Callable] = None

    def block_tensor_prefix(self, index: int) -> str:
        return self.block_prefix.format(index)

    def load_norm(self, config, prefix: str, tensors: Dict[str, torch.Tensor]) -> torch.nn.Module:
        """The family's norm (its epsilon from the config) holding the `prefix` tensors of `tensors`."""
        norm = self.norm(config.hidden_size, eps=getattr(config, self.norm_eps, 1e-6))
        state = {k[len(prefix):]: v for k, v in tensors.items() if k.startswith(prefix)}
        if not state:
            raise ValueError(f"no {prefix}* tensors in the checkpoint")
        norm.load_state_dict(state)
        return norm


def _llama_like(model_type: str, layer: type, fuse: Callable = llama.fuse_layer, norm: type = RMSNorm,
                rotary: type = RotaryEmbedding, **fields) -> FamilySpec:
    """`model.layers.{i}.` blocks, `model.embed_tokens`, `model.norm`, `lm_head`."""
    return FamilySpec(model_type=model_type, block_prefix="model.layers.{}.", embed_key="model.embed_tokens.weight",
                      norm_key="model.norm.", head_key="lm_head.weight", layer=layer, rotary=rotary, norm=norm,
                      fuse=fuse, **fields)


def _layer_norm_family(model_type: str, layer: type, fuse: Callable, rotary: Optional[type], embed_norm: bool
                       ) -> FamilySpec:
    """BLOOM and Falcon: `transformer.` names, LayerNorms, the layers their own `BlockLayer`s."""
    return FamilySpec(
        model_type=model_type,
        block_prefix="transformer.h.{}.",
        embed_key="transformer.word_embeddings.weight",
        norm_key="transformer.ln_f.",
        head_key="lm_head.weight",
        layer=layer,
        rotary=rotary,
        norm=nn.LayerNorm,
        fuse=fuse,
        norm_eps="layer_norm_epsilon",
        embed_norm_key="transformer.word_embeddings_layernorm." if embed_norm else None,
        base_prefix="transformer.",
        serves_adapters=True,
    )


FAMILIES = {
    spec.model_type: spec
    for spec in (
        _llama_like("llama", llama.LlamaDecoderLayer, tensor_parallel=True, serves_adapters=True),
        _llama_like("mistral", llama.MistralDecoderLayer, tensor_parallel=True, serves_adapters=True),
        _llama_like("qwen2", llama.Qwen2DecoderLayer, tensor_parallel=True, serves_adapters=True),
        _layer_norm_family("bloom", bloom.BloomDecoderLayer, bloom.fuse_layer, rotary=None, embed_norm=True),  # ALiBi
        # rotary, or ALiBi with `alibi`
        _layer_norm_family("falcon", falcon.FalconDecoderLayer, falcon.fuse_layer, rotary=RotaryEmbedding,
                           embed_norm=False),
        # Llama's attention with a mixture of experts; both layouts of the experts' tensors load
        _llama_like("mixtral", mixtral.MixtralDecoderLayer, mixtral.fuse_layer, tensor_parallel=True,
                    serves_adapters=True),
        # Llama's block with q/k norms per head (and Qwen3-MoE's experts)
        _llama_like("qwen3", qwen3.Qwen3DecoderLayer, qwen3.fuse_layer, serves_adapters=True),
        _llama_like("qwen3_moe", qwen3_moe.Qwen3MoeDecoderLayer, qwen3_moe.fuse_layer, serves_adapters=True),
        # Llama's block with q/k/v and gate/up fused in the checkpoint
        _llama_like("phi3", phi3.Phi3DecoderLayer, serves_adapters=True, recompute_cache=phi3.recomputes_cache),
        # pre- and post-norms, scaled embeddings; Gemma 2 soft-caps (eager attention: `layers.layer_sdpa`),
        # Gemma 3 has q/k norms and two rotary bases
        _llama_like("gemma2", gemma.Gemma2DecoderLayer, gemma.fuse_layer, norm=gemma.GemmaRMSNorm,
                    client_parts=gemma.client_parts, serves_adapters=True),
        _llama_like("gemma3_text", gemma.Gemma3DecoderLayer, gemma.fuse_layer, norm=gemma.GemmaRMSNorm,
                    rotary=gemma.Gemma3RotaryEmbedding, client_parts=gemma.client_parts, serves_adapters=True),
        # attention sinks (eager attention: `layers.layer_sdpa`) and its own experts
        _llama_like("gpt_oss", gpt_oss.GptOssDecoderLayer, gpt_oss.fuse_layer, serves_adapters=True),
        # multi-head latent attention (a latent cache: `shape.CacheLayout`), shared experts and grouped routing
        _llama_like("deepseek_v3", deepseek_v3.DeepseekV3DecoderLayer, deepseek_v3.fuse_layer,
                    serves_adapters=True),
    )
}


def family_for(config) -> FamilySpec:
    spec = FAMILIES.get(str(getattr(config, "model_type", "")))
    if spec is None:
        raise UnsupportedModelError(
            f"model type {getattr(config, 'model_type', None)!r} is not supported; supported: {sorted(FAMILIES)}"
        )
    return spec
