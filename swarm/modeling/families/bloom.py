"""The BLOOM family's decoder block: ALiBi attention, one fused query_key_value projection, LayerNorms, tanh GELU.

`BloomDecoderLayer` holds transformers' module and parameter names (`input_layernorm`,
`self_attention.query_key_value`, `self_attention.dense`, `post_attention_layernorm`, `mlp.dense_h_to_4h`,
`mlp.dense_4h_to_h`), so a checkpoint's `transformer.h.{i}.` tensors load into it as they are, and computes what
transformers' `BloomBlock` computes (op for op where the order matters; tests/swarm/modeling/test_family_bloom_falcon.py
compares):
- input LayerNorm; q/k/v from one projection whose output is laid out per head as (q, k, v): [heads, 3, head_dim];
- attention with ALiBi and no rotary: transformers adds `slope_h * key_position` (float32, cast to the model's
  dtype) to `q.k / sqrt(head_dim)` (`baddbmm`); here that bias is the attention mask's (`key_bias`, merged with
  the causal mask by the caller's attention, `swarm.modeling.layers`), which SDPA adds to the same scaled scores;
- dense + residual, post-attention LayerNorm, the MLP with BLOOM's tanh GELU (its own constants), + residual; with
  `apply_residual_connection_post_layernorm` the residuals are the LayerNorms' outputs.

The layer is its own `BlockLayer` (`fuse_layer` returns it): the checkpoint already fuses q/k/v, and LayerNorm is
one torch kernel, so there is nothing to concatenate. The server's batched decode, chunked prefill and the layer's
`forward` run the same `step`; quantization swaps its `nn.Linear`s for bitsandbytes modules
(`swarm.modeling.quantize.quantize_linears`). Nothing here imports transformers' modeling code.
"""
from __future__ import annotations

import math
from typing import Callable, Optional

import torch
from torch import nn

from swarm.modeling.layers import DenseProjectionLayer, alibi_slopes, step_forward


class BloomGelu(nn.Module):
    """transformers' `bloom_gelu_forward` (its constants, not torch's tanh GELU's)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * 0.5 * (1.0 + torch.tanh(0.79788456 * x * (1 + 0.044715 * x * x)))


class BloomAttention(nn.Module):
    def __init__(self, hidden_size: int, layer_idx: int):
        super().__init__()
        self.layer_idx = layer_idx  # index into the cache (`BlockSpan.load` sets the span-relative one)
        self.query_key_value = nn.Linear(hidden_size, 3 * hidden_size, bias=True)
        self.dense = nn.Linear(hidden_size, hidden_size)


class BloomMLP(nn.Module):
    def __init__(self, hidden_size: int):
        super().__init__()
        self.dense_h_to_4h = nn.Linear(hidden_size, 4 * hidden_size)
        self.gelu_impl = BloomGelu()
        self.dense_4h_to_h = nn.Linear(4 * hidden_size, hidden_size)


class BloomDecoderLayer(DenseProjectionLayer):
    """`layer(hidden, attention_mask, position_ids, past_key_values, use_cache, position_embeddings)` -> hidden,
    and `step(x, cos, sin, attend)` (cos/sin unused: ALiBi) for the server's steps."""

    def __init__(self, config, layer_idx: int):
        super().__init__()
        hidden = config.hidden_size
        self.heads = self.kv_heads = config.num_attention_heads
        self.head_dim = hidden // self.heads
        self.scaling = 1.0 / math.sqrt(self.head_dim)  # transformers' inv_norm_factor
        self.residual_post_norm = bool(config.apply_residual_connection_post_layernorm)
        self.input_layernorm = nn.LayerNorm(hidden, eps=config.layer_norm_epsilon)
        self.self_attention = BloomAttention(hidden, layer_idx)
        self.post_attention_layernorm = nn.LayerNorm(hidden, eps=config.layer_norm_epsilon)
        self.mlp = BloomMLP(hidden)
        self.slopes = alibi_slopes(self.heads)  # [heads] float32 on the CPU (not a buffer: never in a checkpoint)

    def key_bias(self, key_length: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """ALiBi as BLOOM builds it: slope_h * key position in float32, then the model's dtype: [heads, keys]."""
        positions = torch.arange(key_length, device=device)
        if self.slopes.device != positions.device:  # moved once, so a CUDA graph's capture copies nothing
            self.slopes = self.slopes.to(device)
        return (self.slopes[:, None] * positions).to(dtype)

    def step(self, x: torch.Tensor, cos: Optional[torch.Tensor], sin: Optional[torch.Tensor],
             attend: Callable) -> torch.Tensor:
        """One block on x: [..., hidden] (tokens on the leading dims). Returns [..., hidden]."""
        mlp = self.mlp
        normed = self.input_layernorm(x)
        residual = normed if self.residual_post_norm else x
        qkv = self.project("qkv", normed).unflatten(-1, (self.heads, 3, self.head_dim))
        o = attend(self, qkv[..., 0, :], qkv[..., 1, :], qkv[..., 2, :])  # [..., heads * head_dim]
        x = residual + self.project("o", o)
        normed = self.post_attention_layernorm(x)
        residual = normed if self.residual_post_norm else x
        return residual + self.project("down", mlp.gelu_impl(self.project("up", normed)))

    forward = step_forward  # transformers' layer call, through `step` (`layers.step_forward`)


def fuse_layer(layer: BloomDecoderLayer) -> BloomDecoderLayer:
    """The layer is its own `BlockLayer` (see the module docstring)."""
    return layer
