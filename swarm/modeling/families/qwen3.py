"""The Qwen3 family's decoder block: Llama's block with an RMSNorm on each query and key head before rotary.

Qwen3 (`model_type` "qwen3") is `swarm.modeling.families.llama`'s `block_step` with one difference: after the q/k/v
projections, every query head and every key head ([..., head_dim]) goes through its own RMSNorm
(`self_attn.q_norm`, `self_attn.k_norm`, one weight [head_dim] shared by all heads), then rotary. The layers here
override `qkv` to do that, so every caller of `block_step` (prefill, batched decode, CUDA graphs, passes without
a cache) gets it:
- `Qwen3DecoderLayer`: `llama.DecoderLayer` with the norms under transformers' names;
- `FusedQkNormLayer` (`fuse_layer`): `llama.FusedLayer` plus the two norm weights (torch's fused RMSNorm);
- `--quant_type int8 / nf4`: `swarm.modeling.quantize.QuantizedQkNormLayer`, `quantize.QuantizedLayer` plus the
  norms in float.
An adapter's q/k/v delta belongs before the norms: `qkv_projection` is the projection alone and `qk_norm` the
norms, which `swarm.modeling.lora.AdaptedLayer` calls around its delta.
Sliding windows as Qwen2 (`layers.sliding_window_of`: the layers `layer_types` names "sliding_attention").
Written here rather than imported from transformers' modeling_qwen3 (about 135 MB of resident imports per process,
`swarm.modeling.layers`).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, cast

import torch
import torch.nn.functional as F

from swarm.modeling.families.llama import Attention, DecoderLayer, FusedLayer
from swarm.modeling.families.llama import fuse_layer as fuse_llama_layer
from swarm.modeling.layers import RMSNorm
from swarm.modeling.shape import ModelShape


def normed_qk(qkv: torch.Tensor, heads: int, kv_heads: int, q_norm, k_norm) -> torch.Tensor:
    """qkv: [..., heads + 2 * kv_heads, head_dim] with the query heads through `q_norm` and the key heads through
    `k_norm` (callables on [..., n, head_dim]); the value heads as they are. Returns the same shape."""
    q, k, v = qkv[..., :heads, :], qkv[..., heads:heads + kv_heads, :], qkv[..., heads + kv_heads:, :]
    return torch.cat([q_norm(q), k_norm(k), v], dim=-2)


def fused_qk_norm(layer, qkv: torch.Tensor) -> torch.Tensor:
    """`normed_qk` with torch's fused RMSNorm of `layer.q_norm_weight` / `layer.k_norm_weight` [head_dim]."""
    dim = qkv.shape[-1:]
    return normed_qk(qkv, layer.heads, layer.kv_heads, lambda q: F.rms_norm(q, dim, layer.q_norm_weight, layer.eps),
                     lambda k: F.rms_norm(k, dim, layer.k_norm_weight, layer.eps))





class QkNormAttention(Attention):
    """`llama.Attention`'s projections and the query and key heads' norms (`q_norm`, `k_norm`: [head_dim])."""

    def __init__(self, shape: ModelShape, layer_idx: int, bias: bool):
        super().__init__(shape, layer_idx, qkv_bias=bias, o_bias=bias)
        self.q_norm = RMSNorm(shape.head_dim, eps=shape.rms_norm_eps)
        self.k_norm = RMSNorm(shape.head_dim, eps=shape.rms_norm_eps)


class Qwen3DecoderLayer(DecoderLayer):
    """`llama.DecoderLayer` with `self_attn.q_norm` and `self_attn.k_norm` (RMSNorm over head_dim)."""

    window_layers = True  # (as Qwen2's)

    def __init__(self, config, layer_idx: int):
        super().__init__(config, layer_idx)
        self.self_attn = QkNormAttention(ModelShape.from_config(config), layer_idx,
                                         bool(getattr(config, "attention_bias", False)))

    @property
    def attention(self) -> QkNormAttention:
        return cast(QkNormAttention, self.self_attn)

    def qkv_projection(self, h: torch.Tensor) -> torch.Tensor:
        """[..., hidden] -> [..., heads + 2 * kv_heads, head_dim], before the norms."""
        return DecoderLayer.qkv(self, h)

    def qk_norm(self, qkv: torch.Tensor) -> torch.Tensor:
        return normed_qk(qkv, self.heads, self.kv_heads, self.attention.q_norm, self.attention.k_norm)

    def qkv(self, h: torch.Tensor) -> torch.Tensor:
        return self.qk_norm(self.qkv_projection(h))


@dataclass(eq=False)
class FusedQkNormLayer(FusedLayer):
    """`llama.FusedLayer` with the query and key heads' RMSNorm weights [head_dim] (views of the layer module's)."""
    q_norm_weight: Optional[torch.Tensor] = None
    k_norm_weight: Optional[torch.Tensor] = None

    def qkv_projection(self, h: torch.Tensor) -> torch.Tensor:
        return FusedLayer.qkv(self, h)

    def qk_norm(self, qkv: torch.Tensor) -> torch.Tensor:
        return fused_qk_norm(self, qkv)

    def qkv(self, h: torch.Tensor) -> torch.Tensor:
        return self.qk_norm(self.qkv_projection(h))


def fuse_layer(layer: Qwen3DecoderLayer) -> FusedQkNormLayer:
    """`llama.fuse_layer` plus the query/key norms."""
    fused = fuse_llama_layer(layer)
    values = {name: getattr(fused, name) for name in fused.__dataclass_fields__}
    return FusedQkNormLayer(**values, q_norm_weight=layer.attention.q_norm.weight,
                            k_norm_weight=layer.attention.k_norm.weight)

