"""The Gemma 2 and Gemma 3 (text) families' decoder blocks, and the client parts they change.

A Gemma block (`gemma_block_step`): input norm -> q/k/v -> (Gemma 3: an RMSNorm on each query and key head) ->
rotary -> attention scaled by `query_pre_attn_scalar ** -0.5` -> output projection -> post-attention norm ->
+ residual -> pre-feedforward norm -> gated MLP (`gelu_pytorch_tanh`) -> post-feedforward norm -> + residual.
Gemma's RMSNorm (`GemmaRMSNorm`) scales by (1 + weight), in float32. Layers alternate between a sliding window
and full attention as the config's `layer_types` say (Gemma 2: every other layer; Gemma 3: five sliding layers,
then a full one, `sliding_window_pattern`).
- Gemma 2's attention soft-caps its logits (`attn_logit_softcapping`: tanh(logits / cap) * cap before the
  softmax), which SDPA cannot do: its layers carry `logit_softcap`, for which `layers.cache_attention` (prefill,
  passes without a cache) and `layers.layer_sdpa` (the server's batched decode and arena attention) compute the
  attention eagerly. Not captured in CUDA graphs (`FamilySpec.graph_refusal`: the captured attention is SDPA).
- Gemma 3's sliding and full layers rotate with different bases (`rope_parameters["sliding_attention"]`, 10000;
  `["full_attention"]`, 1e6, possibly with linear scaling): `Gemma3RotaryEmbedding` returns both angle sets
  side by side, cos/sin [..., 2 * head_dim] (full, then sliding), and each layer takes its half (`rope_part`).
  The server passes cos/sin through by rows only, so every path (batched decode, prefill, chunked prefill) works;
  not captured in CUDA graphs (the graphs' static cos buffers are head_dim wide).
Both layers are their own `BlockLayer` (as BLOOM's, `fuse_layer`), quantized by swapping their linear modules
(`quantize.quantize_linears`).
The client (`client_parts`): embeddings scaled by sqrt(hidden) in their dtype (`ScaledEmbedding`), and Gemma 2's
final logits soft-capped (`final_logit_softcapping`, `SoftcappedHead`). Written here rather than imported from
transformers' modeling_gemma2/3 (about 135 MB of resident imports per process, `swarm.modeling.layers`).
"""
from __future__ import annotations

import copy
from typing import Optional, Tuple, cast

import torch
import torch.nn.functional as F
from torch import nn

from swarm.modeling.layers import AttentionIndexedLayer, RotaryEmbedding, activation, apply_rotary, step_forward
from swarm.modeling.shape import ModelShape


def gemma_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """transformers' Gemma RMSNorm: x / rms(x) * (1 + weight), in float32, back to x's dtype."""
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return (h * (1.0 + weight.float())).type_as(x)


class GemmaRMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float = 1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(hidden_size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return gemma_rms_norm(x, self.weight, self.eps)


def gemma_activation(config) -> nn.Module:
    name = getattr(config, "hidden_activation", None) or getattr(config, "hidden_act", None) or "gelu_pytorch_tanh"
    if name == "gelu_pytorch_tanh":  # transformers' GELUTanh: torch's tanh approximation
        return nn.GELU(approximate="tanh")
    return activation(name)


def gemma_block_step(layer, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, attend) -> torch.Tensor:
    """One Gemma block on x: [..., hidden] (tokens on the leading dims); cos, sin: [..., head_dim], or
    [..., 2 * head_dim] with Gemma 3's two rotary bases (the layer's `rope_part` picks). Returns [..., hidden]."""
    heads, kv_heads, dim = layer.heads, layer.kv_heads, layer.head_dim
    if layer.rope_part is not None:
        cos = cos[..., layer.rope_part * dim:(layer.rope_part + 1) * dim]
        sin = sin[..., layer.rope_part * dim:(layer.rope_part + 1) * dim]
    attn = layer.self_attn
    h = layer.input_layernorm(x)
    # [..., heads + 2 * kv_heads, head_dim]: q, k, v (a LoRA adapter's `AdaptedLayer.project` adds its deltas here)
    qkv = layer.project("qkv", h).unflatten(-1, (heads + 2 * kv_heads, dim))
    q, k, v = qkv[..., :heads, :], qkv[..., heads:heads + kv_heads, :], qkv[..., heads + kv_heads:, :]
    if layer.qk_norm:
        q, k = attn.q_norm(q), attn.k_norm(k)
    q, k = apply_rotary(q, cos.unsqueeze(-2), sin.unsqueeze(-2)), apply_rotary(k, cos.unsqueeze(-2), sin.unsqueeze(-2))
    o = layer.project("o", attend(layer, q, k, v))  # [..., hidden]
    x = x + layer.post_attention_layernorm(o)
    h = layer.pre_feedforward_layernorm(x)
    gate, up = layer.project("gate_up", h).chunk(2, dim=-1)  # [..., intermediate] each
    return x + layer.post_feedforward_layernorm(layer.project("down", layer.mlp.act_fn(gate) * up))


class GemmaAttention(nn.Module):
    def __init__(self, shape: ModelShape, layer_idx: int, bias: bool, qk_norm: bool):
        super().__init__()
        self.layer_idx = layer_idx
        q_size, kv_size = shape.num_heads * shape.head_dim, shape.num_kv_heads * shape.head_dim
        self.q_proj = nn.Linear(shape.hidden_size, q_size, bias=bias)
        self.k_proj = nn.Linear(shape.hidden_size, kv_size, bias=bias)
        self.v_proj = nn.Linear(shape.hidden_size, kv_size, bias=bias)
        self.o_proj = nn.Linear(q_size, shape.hidden_size, bias=bias)
        if qk_norm:
            self.q_norm = GemmaRMSNorm(shape.head_dim, eps=shape.rms_norm_eps)
            self.k_norm = GemmaRMSNorm(shape.head_dim, eps=shape.rms_norm_eps)


class GemmaMLP(nn.Module):
    def __init__(self, config, shape: ModelShape):
        super().__init__()
        self.gate_proj = nn.Linear(shape.hidden_size, shape.intermediate_size, bias=False)
        self.up_proj = nn.Linear(shape.hidden_size, shape.intermediate_size, bias=False)
        self.down_proj = nn.Linear(shape.intermediate_size, shape.hidden_size, bias=False)
        self.act_fn = gemma_activation(config)


def layer_type_of(config, layer_idx: int) -> str:
    layer_types = getattr(config, "layer_types", None)
    if not layer_types:
        raise ValueError(f"a {config.model_type} config needs layer_types")
    return str(layer_types[layer_idx])


class GemmaDecoderLayer(AttentionIndexedLayer):
    """`layer(hidden, attention_mask, position_ids, past_key_values, use_cache, position_embeddings)` -> hidden;
    also its own `BlockLayer` (`step`)."""

    step = gemma_block_step
    qk_norm = False
    dual_rope = False  # Gemma 3: cos/sin of both rotary bases side by side

    def __init__(self, config, layer_idx: int):
        super().__init__()
        if getattr(config, "use_bidirectional_attention", False):
            raise ValueError("Gemma blocks with use_bidirectional_attention (embedding models) are not supported: "
                             "the swarm's blocks are causal")
        shape = ModelShape.from_config(config)
        self.heads, self.kv_heads, self.head_dim = shape.num_heads, shape.num_kv_heads, shape.head_dim
        self.scaling = float(getattr(config, "query_pre_attn_scalar", shape.head_dim)) ** -0.5
        self.self_attn = GemmaAttention(shape, layer_idx, bool(getattr(config, "attention_bias", False)), self.qk_norm)
        self.mlp = GemmaMLP(config, shape)
        for name in ("input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm",
                     "post_feedforward_layernorm"):
            setattr(self, name, GemmaRMSNorm(shape.hidden_size, eps=shape.rms_norm_eps))
        sliding = layer_type_of(config, layer_idx) == "sliding_attention"
        self.sliding_window: Optional[int] = int(config.sliding_window) if sliding and config.sliding_window else None
        self.rope_part: Optional[int] = (1 if sliding else 0) if self.dual_rope else None
        self.logit_softcap: Optional[float] = getattr(config, "attn_logit_softcapping", None)

    def project(self, group: str, h: torch.Tensor) -> torch.Tensor:
        """Projection `group` of h [..., in] in h's dtype: "qkv" (q;k;v outputs side by side), "o", "gate_up"
        (gate;up) or "down" (the groups a LoRA adapter's `AdaptedLayer` adds its deltas to; a quantized module
        may answer in its compute dtype)."""
        attn, mlp = self.self_attn, self.mlp
        if group == "qkv":
            return torch.cat([attn.q_proj(h), attn.k_proj(h), attn.v_proj(h)], dim=-1).to(h.dtype)
        if group == "gate_up":
            return torch.cat([mlp.gate_proj(h), mlp.up_proj(h)], dim=-1).to(h.dtype)
        return (attn.o_proj if group == "o" else mlp.down_proj)(h).to(h.dtype)

    forward = step_forward  # transformers' layer call, through `step` (`layers.step_forward`)


class Gemma2DecoderLayer(GemmaDecoderLayer):
    pass


class Gemma3DecoderLayer(GemmaDecoderLayer):
    qk_norm = True
    dual_rope = True


def fuse_layer(layer: GemmaDecoderLayer) -> GemmaDecoderLayer:
    """The layer is its own `BlockLayer` (see the module docstring)."""
    return layer


class Gemma3RotaryEmbedding(nn.Module):
    """cos/sin [batch, seq, 2 * head_dim] for position ids [batch, seq]: the full layers' angles, then the sliding
    layers' (each with its `rope_parameters[layer_type]`, any RoPE type transformers knows)."""

    def __init__(self, config):
        super().__init__()
        self.full = RotaryEmbedding(_rope_config(config, "full_attention"))
        self.sliding = RotaryEmbedding(_rope_config(config, "sliding_attention"))
        self.by_length = self.full.by_length or self.sliding.by_length

    def forward(self, x: torch.Tensor, position_ids: torch.Tensor, lengths: Optional[torch.Tensor] = None
                ) -> Tuple[torch.Tensor, torch.Tensor]:
        """`lengths`: as `RotaryEmbedding`'s (which each angle set's RoPE type uses or ignores)."""
        cos_full, sin_full = self.full(x, position_ids, lengths)
        cos_sliding, sin_sliding = self.sliding(x, position_ids, lengths)
        return torch.cat([cos_full, cos_sliding], dim=-1), torch.cat([sin_full, sin_sliding], dim=-1)


def _rope_config(config, layer_type: str):
    """A copy of `config` whose `rope_parameters` are the `layer_type` layers' own (a flat dict)."""
    sub = copy.copy(config)
    sub.rope_parameters = dict(config.rope_parameters[layer_type])
    return sub


class ScaledEmbedding(nn.Embedding):
    """Gemma's embeddings: the looked-up rows times sqrt(hidden), the factor in the embeddings' dtype."""
    scale: float = 1.0

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return super().forward(input_ids) * torch.tensor(self.scale, dtype=self.weight.dtype)


class SoftcappedHead(nn.Linear):
    """The LM head with Gemma 2's final soft-cap: tanh(logits / cap) * cap."""
    cap: float = 0.0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        logits = F.linear(x, self.weight, self.bias)
        return torch.tanh(logits / self.cap) * self.cap


def client_parts(config, embed: nn.Embedding, lm_head: nn.Linear) -> Tuple[nn.Embedding, nn.Linear]:
    """The client's embeddings scaled (`ScaledEmbedding`), and its head soft-capped where the config says
    (`final_logit_softcapping`): the same modules, their classes changed (no tensor is copied)."""
    embed.__class__ = ScaledEmbedding
    cast(ScaledEmbedding, embed).scale = float(config.hidden_size) ** 0.5
    cap = getattr(config, "final_logit_softcapping", None)
    if cap:
        lm_head.__class__ = SoftcappedHead
        cast(SoftcappedHead, lm_head).cap = float(cap)
    return embed, lm_head
