"""The Falcon family's decoder block, in its layouts: parallel attention, multi-query / grouped KV, rotary or ALiBi.

`FalconDecoderLayer` holds transformers' module and parameter names (`self_attention.query_key_value`,
`self_attention.dense`, `mlp.dense_h_to_4h`, `mlp.dense_4h_to_h`, and `ln_attn` + `ln_mlp`, or
`input_layernorm` (+ `post_attention_layernorm` when `parallel_attn` is false)), so a checkpoint's
`transformer.h.{i}.` tensors load as they are, and computes what transformers' `FalconDecoderLayer` computes with
SDPA (tests/swarm/modeling/test_family_bloom_falcon.py compares). The fused q/k/v output is laid out per layout:
- `new_decoder_architecture` (Falcon-40B/180B): per key/value head, its `heads / num_kv_heads` queries, then one
  key, then one value: [kv_heads, groups + 2, head_dim]; query head j uses key/value head j // groups, as
  grouped-query attention does, so the cache holds `num_kv_heads` heads (transformers' holds them repeated);
- old layout with `multi_query` (Falcon-7B): all queries, then one key, one value: [heads + 2, head_dim];
- old layout without it: per head (q, k, v): [heads, 3, head_dim].
Then rotary on q and k (or, with `alibi`, no rotary and Falcon's ALiBi bias: the slopes in bfloat16 times the key
position, in bfloat16, then the model's dtype, divided by sqrt(head_dim): `key_bias`), attention, `dense`.
Parallel attention (new layout, or `parallel_attn`): out = x + (mlp(norm'(x)) + attention); sequential:
h = x + attention, out = h + mlp(post_attention_layernorm(h)). Projections are `FalconLinear` (`x @ W.T + b`, two
ops, as transformers keeps them).

The layer is its own `BlockLayer` (`fuse_layer` returns it), like `swarm.modeling.families.bloom`'s; nothing here
imports transformers' modeling code.
"""
from __future__ import annotations

import math
from typing import Callable, Optional, Tuple

import torch
from torch import nn

from swarm.modeling.layers import (
    DenseProjectionLayer,
    activation,
    alibi_slopes,
    apply_rotary,
    step_forward,
)


class FalconLinear(nn.Linear):
    """transformers' FalconLinear: the matmul, then the bias (not fused, as the model was trained)."""

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        hidden_states = input @ self.weight.T
        return hidden_states if self.bias is None else hidden_states + self.bias


class FalconAttention(nn.Module):
    def __init__(self, config, layer_idx: int, qkv_out: int):
        super().__init__()
        self.layer_idx = layer_idx  # index into the cache (`BlockSpan.load` sets the span-relative one)
        self.query_key_value = FalconLinear(config.hidden_size, qkv_out, bias=config.bias)
        self.dense = FalconLinear(config.hidden_size, config.hidden_size, bias=config.bias)


class FalconMLP(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.dense_h_to_4h = FalconLinear(config.hidden_size, config.ffn_hidden_size, bias=config.bias)
        self.act = activation(config.activation)
        self.dense_4h_to_h = FalconLinear(config.ffn_hidden_size, config.hidden_size, bias=config.bias)


class FalconDecoderLayer(DenseProjectionLayer):
    """`layer(hidden, attention_mask, position_ids, past_key_values, use_cache, position_embeddings)` -> hidden,
    and `step(x, cos, sin, attend)` for the server's steps."""

    def __init__(self, config, layer_idx: int):
        super().__init__()
        hidden = config.hidden_size
        self.heads = config.num_attention_heads
        self.head_dim = hidden // self.heads
        self.scaling = 1.0 / math.sqrt(self.head_dim)
        self.new_layout = bool(config.new_decoder_architecture)
        self.multi_query = bool(config.multi_query) and not self.new_layout
        self.parallel = bool(config.parallel_attn)
        self.alibi = bool(config.alibi)
        if self.new_layout:
            self.kv_heads = config.num_kv_heads
        else:
            self.kv_heads = 1 if self.multi_query else self.heads
        qkv_out = (self.heads + 2 * self.kv_heads) * self.head_dim
        num_ln = config.num_ln_in_parallel_attn
        self.num_ln = 2 if num_ln is None and self.new_layout else num_ln
        self.self_attention = FalconAttention(config, layer_idx, qkv_out)
        self.mlp = FalconMLP(config)
        eps = config.layer_norm_epsilon
        if not self.parallel:
            self.post_attention_layernorm = nn.LayerNorm(hidden, eps=eps)
            self.input_layernorm = nn.LayerNorm(hidden, eps=eps)
        elif self.num_ln == 2:
            self.ln_attn = nn.LayerNorm(hidden, eps=eps)
            self.ln_mlp = nn.LayerNorm(hidden, eps=eps)
        else:
            self.input_layernorm = nn.LayerNorm(hidden, eps=eps)
        # [heads] float32 on the CPU (not a buffer: never in a checkpoint)
        self.slopes = alibi_slopes(self.heads) if self.alibi else None

    def key_bias(self, key_length: int, dtype: torch.dtype, device: torch.device) -> Optional[torch.Tensor]:
        """Falcon's ALiBi (`build_alibi_tensor`, then `/ sqrt(head_dim)` as its SDPA mask): [heads, keys]; None
        for rotary layers."""
        if self.slopes is None:
            return None
        positions = torch.arange(key_length, device=device)
        if self.slopes.device != positions.device:  # moved once, so a CUDA graph's capture copies nothing
            self.slopes = self.slopes.to(device)
        alibi = (self.slopes[:, None].bfloat16() * positions).to(dtype)
        return alibi / math.sqrt(self.head_dim)

    def split_qkv(self, fused: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """[..., (heads + 2 * kv_heads) * head_dim] -> q [..., heads, head_dim], k, v [..., kv_heads, head_dim]."""
        if self.new_layout:
            groups = self.heads // self.kv_heads
            qkv = fused.unflatten(-1, (self.kv_heads, groups + 2, self.head_dim))
            return qkv[..., :groups, :].flatten(-3, -2), qkv[..., groups, :], qkv[..., groups + 1, :]
        if self.multi_query:
            qkv = fused.unflatten(-1, (self.heads + 2, self.head_dim))
            return qkv[..., :self.heads, :], qkv[..., self.heads:self.heads + 1, :], qkv[..., self.heads + 1:, :]
        qkv = fused.unflatten(-1, (self.heads, 3, self.head_dim))
        return qkv[..., 0, :], qkv[..., 1, :], qkv[..., 2, :]

    def step(self, x: torch.Tensor, cos: Optional[torch.Tensor], sin: Optional[torch.Tensor],
             attend: Callable) -> torch.Tensor:
        """One block on x: [..., hidden] (tokens on the leading dims); cos, sin: [..., head_dim] (unused with
        ALiBi). Returns [..., hidden]."""
        residual = x
        if self.parallel and self.num_ln == 2:
            attn_in, mlp_in = self.ln_attn(x), self.ln_mlp(x)
        else:
            attn_in = mlp_in = self.input_layernorm(x)
        q, k, v = self.split_qkv(self.project("qkv", attn_in))
        if not self.alibi:
            assert cos is not None and sin is not None
            q = apply_rotary(q, cos.unsqueeze(-2), sin.unsqueeze(-2))
            k = apply_rotary(k, cos.unsqueeze(-2), sin.unsqueeze(-2))
        attention = self.project("o", attend(self, q, k, v))  # [..., hidden]
        if not self.parallel:
            residual = residual + attention
            mlp_in = self.post_attention_layernorm(residual)
        mlp = self.mlp
        out = self.project("down", mlp.act(self.project("up", mlp_in)))
        if self.new_layout or self.parallel:
            out = out + attention
        return residual + out

    forward = step_forward  # transformers' layer call, through `step` (`layers.step_forward`)


def fuse_layer(layer: FalconDecoderLayer) -> FalconDecoderLayer:
    """The layer is its own `BlockLayer` (see the module docstring)."""
    return layer
