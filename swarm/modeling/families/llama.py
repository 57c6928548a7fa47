"""The Llama family's decoder block (llama, mistral, qwen2): its parameters and its math, written once.

`block_step` is the block: input RMSNorm -> q/k/v projections -> rotary on q and k -> attention (the caller's
`attend`) -> output projection + residual -> post-attention RMSNorm -> gated MLP + residual. It reaches the
weights only through the layer object it is given, of one of two kinds:
- `DecoderLayer` (`LlamaDecoderLayer`, ...): nn.Modules under transformers' module and parameter names, so
  checkpoints load into them as they are; separate projections and the unfused RMSNorm, the ops of transformers'
  modeling code (tests/swarm/modeling/test_layers.py compares the outputs for equality). `forward` takes transformers'
  call: `layer(hidden, attention_mask, position_ids, past_key_values, position_embeddings=(cos, sin))`.
- `FusedLayer` (`fuse_layer`): the same weights concatenated once at load (q/k/v in one matrix, gate/up in one),
  torch's fused RMSNorm, and the output and down projections added to the residual in one `addmm` each. The
  module's parameters become views into the fused tensors, so nothing is duplicated. The server's prefill,
  batched decode and CUDA-graph steps (`server.compute.decode`, `server.compute.graphs`) run these: fewer, larger
  kernels.
The callers differ only in the attention they pass: through a cache (`layers.cache_attention`), per session of a
batch, or over a whole preallocated cache for CUDA graphs. Both kinds have `step(x, cos, sin, attend)`.

The families differ only in which projections carry biases: llama per `attention_bias` / `mlp_bias`, mistral
none, qwen2 on q, k and v. A layer's `sliding_window` (mistral, qwen2's windowed layers: `layers.sliding_window_of`)
is what the caller's attention applies: a mask (`layers.causal_mask`) or the last window's keys in a decode step.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Dict, Optional, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from swarm.modeling.layers import (
    AttentionIndexedLayer,
    RMSNorm,
    activation,
    apply_rotary,
    sliding_window_of,
    step_forward,
)
from swarm.modeling.shape import ModelShape
from swarm.modeling.smallgemm import GemmGroup, SmallGemm

# attend(layer, q [..., heads, head_dim], k [..., kv_heads, head_dim], v [..., kv_heads, head_dim])
#   -> [..., heads * head_dim]; rotary is applied to q and k, "..." are the tokens' leading dims of x
Attend = Callable[..., torch.Tensor]


def attention_output(layer, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, attend: Attend) -> torch.Tensor:
    """The attention's output before its output projection: x [..., hidden] -> [..., heads * head_dim] (also a
    tensor-parallel shard's, `swarm.modeling.tensor_parallel`). cos, sin: [..., head_dim], each token's rotary angles.
    """
    heads, kv_heads = layer.heads, layer.kv_heads
    qkv = layer.qkv(layer.input_norm(x))  # [..., heads + 2 * kv_heads, head_dim]
    # rotary on q and k together: [..., heads + kv_heads, head_dim]
    qk = apply_rotary(qkv[..., :heads + kv_heads, :], cos.unsqueeze(-2), sin.unsqueeze(-2))
    return attend(layer, qk[..., :heads, :], qk[..., heads:, :], qkv[..., heads + kv_heads:, :])  # [..., heads * dim]


def attention_residual(layer, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, attend: Attend) -> torch.Tensor:
    """The block's first half, x + attention: [..., hidden] -> [..., hidden] (also Mixtral's,
    `swarm.modeling.families.mixtral`).

    cos, sin: [..., head_dim], the rotary angles of each token's position.
    """
    return layer.add_o_proj(x, attention_output(layer, x, cos, sin, attend))  # x + o_proj(o): [..., hidden]


def block_step(layer, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, attend: Attend) -> torch.Tensor:
    """One decoder block on x: [..., hidden], tokens on the leading dims ([batch, seq] or [rows]).

    cos, sin: [..., head_dim], the rotary angles of each token's position. Returns [..., hidden].
    """
    x = attention_residual(layer, x, cos, sin, attend)
    gate, up = layer.gate_up(layer.post_norm(x))  # [..., intermediate] each
    # in place: a 1024-token prefill chunk would otherwise hold a third [rows, intermediate] buffer
    return layer.add_down(x, layer.act(gate).mul_(up))  # x + down_proj(act(gate) * up): [..., hidden]


class Attention(nn.Module):
    """The attention's projections (`self_attn.q_proj`, ...), as transformers names them; `block_step` uses them."""

    def __init__(self, shape: ModelShape, layer_idx: int, qkv_bias: bool, o_bias: bool):
        super().__init__()
        self.layer_idx = layer_idx  # index into the cache (`BlockSpan.load` sets the span-relative one)
        self.head_dim, self.scaling = shape.head_dim, shape.scaling
        q_size, kv_size = shape.num_heads * shape.head_dim, shape.num_kv_heads * shape.head_dim
        self.q_proj = nn.Linear(shape.hidden_size, q_size, bias=qkv_bias)
        self.k_proj = nn.Linear(shape.hidden_size, kv_size, bias=qkv_bias)
        self.v_proj = nn.Linear(shape.hidden_size, kv_size, bias=qkv_bias)
        self.o_proj = nn.Linear(q_size, shape.hidden_size, bias=o_bias)


class MLP(nn.Module):
    def __init__(self, shape: ModelShape, bias: bool):
        super().__init__()
        self.gate_proj = nn.Linear(shape.hidden_size, shape.intermediate_size, bias=bias)
        self.up_proj = nn.Linear(shape.hidden_size, shape.intermediate_size, bias=bias)
        self.down_proj = nn.Linear(shape.intermediate_size, shape.hidden_size, bias=bias)
        self.act_fn = activation(shape.hidden_act)


class DecoderLayer(AttentionIndexedLayer):
    """`layer(hidden, attention_mask, position_ids, past_key_values, use_cache, position_embeddings)` -> hidden."""

    step = block_step  # layer.step(x, cos, sin, attend)
    # the config's sliding window on some layers only (`layers.sliding_window_of`: Qwen2's, Qwen3's), else on all
    window_layers = False

    def __init__(self, config, layer_idx: int, qkv_bias: bool = False, o_bias: bool = False, mlp_bias: bool = False):
        super().__init__()
        shape = ModelShape.from_config(config)
        self.hidden_size = shape.hidden_size
        self.heads, self.kv_heads, self.head_dim = shape.num_heads, shape.num_kv_heads, shape.head_dim
        self.scaling = shape.scaling
        self.self_attn = Attention(shape, layer_idx, qkv_bias, o_bias)
        self.mlp = MLP(shape, mlp_bias)
        self.input_layernorm = RMSNorm(shape.hidden_size, eps=shape.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(shape.hidden_size, eps=shape.rms_norm_eps)
        self.sliding_window = sliding_window_of(config, layer_idx, self.window_layers)  # None: full causal attention

    forward = step_forward  # transformers' layer call, through `step` (`layers.step_forward`)

    # what block_step reads: the unfused projections, in transformers' order of operations

    @property
    def act(self) -> nn.Module:
        return self.mlp.act_fn

    def input_norm(self, x: torch.Tensor) -> torch.Tensor:
        return self.input_layernorm(x)

    def post_norm(self, x: torch.Tensor) -> torch.Tensor:
        return self.post_attention_layernorm(x)

    def qkv(self, h: torch.Tensor) -> torch.Tensor:
        """[..., hidden] -> [..., heads + 2 * kv_heads, head_dim]"""
        attn = self.self_attn
        return torch.cat([attn.q_proj(h), attn.k_proj(h), attn.v_proj(h)], dim=-1).unflatten(-1, (-1, self.head_dim))

    def add_o_proj(self, x: torch.Tensor, o: torch.Tensor) -> torch.Tensor:
        return x + self.self_attn.o_proj(o)

    def gate_up(self, h: torch.Tensor):
        return self.mlp.gate_proj(h), self.mlp.up_proj(h)

    def add_down(self, x: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
        return x + self.mlp.down_proj(h)


class LlamaDecoderLayer(DecoderLayer):
    def __init__(self, config, layer_idx: int):
        bias, mlp_bias = bool(getattr(config, "attention_bias", False)), bool(getattr(config, "mlp_bias", False))
        super().__init__(config, layer_idx, qkv_bias=bias, o_bias=bias, mlp_bias=mlp_bias)


class MistralDecoderLayer(DecoderLayer):
    def __init__(self, config, layer_idx: int):
        super().__init__(config, layer_idx)


class Qwen2DecoderLayer(DecoderLayer):
    window_layers = True

    def __init__(self, config, layer_idx: int):
        super().__init__(config, layer_idx, qkv_bias=True)



@dataclass(eq=False)
class FusedLayer:
    """One block's weights for the server's steps (views shared with the layer module); `block_step` reads them."""
    input_norm_weight: torch.Tensor  # [hidden]
    post_norm_weight: torch.Tensor  # [hidden]
    eps: float
    qkv_weight: torch.Tensor  # [(heads + 2 * kv_heads) * head_dim, hidden]
    qkv_bias: Optional[torch.Tensor]
    o_weight_t: torch.Tensor  # [heads * head_dim, hidden] (transposed view, for addmm)
    o_bias: Optional[torch.Tensor]
    gate_up_weight: torch.Tensor  # [2 * intermediate, hidden]
    gate_up_bias: Optional[torch.Tensor]
    down_weight_t: torch.Tensor  # [intermediate, hidden] (transposed view)
    down_bias: Optional[torch.Tensor]
    act: nn.Module
    heads: int
    kv_heads: int
    head_dim: int
    scaling: float
    layer_idx: int
    sliding_window: Optional[int] = None  # keys a query sees (itself included); None: all before it
    # a decode step's few rows on the CPU (`swarm.modeling.smallgemm`, `attach_small_gemms`): "qkv", "o", "gate_up",
    # "down" -> the projection's small-batch product; None: plain products
    gemms: Optional[Dict[str, SmallGemm]] = None

    step = block_step  # layer.step(x, cos, sin, attend)

    def input_norm(self, x: torch.Tensor) -> torch.Tensor:
        return F.rms_norm(x, x.shape[-1:], self.input_norm_weight, self.eps)

    def post_norm(self, x: torch.Tensor) -> torch.Tensor:
        return F.rms_norm(x, x.shape[-1:], self.post_norm_weight, self.eps)

    def qkv(self, h: torch.Tensor) -> torch.Tensor:
        """[..., hidden] -> [..., heads + 2 * kv_heads, head_dim]"""
        if self.gemms is not None:  # (a decode step's rows; other shapes get the plain product there)
            return self.gemms["qkv"](h).unflatten(-1, (-1, self.head_dim))
        return F.linear(h, self.qkv_weight, self.qkv_bias).unflatten(-1, (-1, self.head_dim))

    def add_o_proj(self, x: torch.Tensor, o: torch.Tensor) -> torch.Tensor:
        if self.gemms is not None and o.ndim == 2:
            return self.gemms["o"](o).add_(x)
        return _add_projection(x, o, self.o_weight_t, self.o_bias)

    def gate_up(self, h: torch.Tensor):
        if self.gemms is not None:
            return self.gemms["gate_up"](h).chunk(2, dim=-1)
        return F.linear(h, self.gate_up_weight, self.gate_up_bias).chunk(2, dim=-1)

    def add_down(self, x: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
        if self.gemms is not None and h.ndim == 2:
            return self.gemms["down"](h).add_(x)
        return _add_projection(x, h, self.down_weight_t, self.down_bias)


def _add_projection(x: torch.Tensor, h: torch.Tensor, weight_t: torch.Tensor, bias: Optional[torch.Tensor]
                    ) -> torch.Tensor:
    """x + h @ weight_t (+ bias) in one addmm, for x: [..., out], h: [..., in]."""
    if x.dim() == 2:  # decode's rows: no reshapes (each is a dispatch, and an eager GPU step is launch-bound)
        out = torch.addmm(x, h, weight_t)
    else:
        out = torch.addmm(x.reshape(-1, x.shape[-1]), h.reshape(-1, h.shape[-1]), weight_t).view(x.shape)
    return out if bias is None else out.add_(bias)


def _share(modules: Sequence[nn.Linear], name: str) -> Optional[torch.Tensor]:
    """Concatenate the modules' `name` tensors along dim 0 and make each module's tensor a view of the result."""
    tensors = [getattr(m, name) for m in modules]
    if any(t is None for t in tensors):
        return None
    fused = torch.cat([t.detach() for t in tensors], dim=0)
    row = 0
    for module, tensor in zip(modules, tensors):
        setattr(module, name, nn.Parameter(fused[row:row + tensor.shape[0]], requires_grad=False))
        row += tensor.shape[0]
    return fused


def attach_small_gemms(layer: FusedLayer, group: GemmGroup) -> None:
    """Give a float32 CPU layer's projections small-batch products of `group` (its packed copies of the weights)."""
    layer.gemms = {"qkv": group.gemm(layer.qkv_weight, layer.qkv_bias),
                   "o": group.gemm(layer.o_weight_t.t(), layer.o_bias),
                   "gate_up": group.gemm(layer.gate_up_weight, layer.gate_up_bias),
                   "down": group.gemm(layer.down_weight_t.t(), layer.down_bias)}


def fuse_layer(layer: DecoderLayer) -> FusedLayer:
    """The fused view of a loaded layer; afterwards the layer's q/k/v and gate/up parameters are views into it."""
    attn, mlp = layer.self_attn, layer.mlp
    qkv = (attn.q_proj, attn.k_proj, attn.v_proj)
    qkv_weight, gate_up_weight = _share(qkv, "weight"), _share((mlp.gate_proj, mlp.up_proj), "weight")
    assert qkv_weight is not None and gate_up_weight is not None  # weights, unlike biases, always exist
    return FusedLayer(
        input_norm_weight=layer.input_layernorm.weight, post_norm_weight=layer.post_attention_layernorm.weight,
        eps=layer.input_layernorm.variance_epsilon,
        qkv_weight=qkv_weight, qkv_bias=_share(qkv, "bias"),
        o_weight_t=attn.o_proj.weight.t(), o_bias=attn.o_proj.bias,
        gate_up_weight=gate_up_weight,
        gate_up_bias=_share((mlp.gate_proj, mlp.up_proj), "bias"),
        down_weight_t=mlp.down_proj.weight.t(), down_bias=mlp.down_proj.bias, act=mlp.act_fn,
        heads=layer.heads, kv_heads=layer.kv_heads, head_dim=layer.head_dim, scaling=layer.scaling,
        layer_idx=layer.layer_idx, sliding_window=layer.sliding_window,
    )
