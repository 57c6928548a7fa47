"""The lean inference path of Llama-style blocks (llama, mistral, qwen2): decode steps, and multi-token steps.

A decode step is bound by memory bandwidth: every weight is read once per step whatever the number of rows, so
concurrent sessions' steps share one pass, and the pass is made of as few kernel calls as possible. Per block:
torch's fused RMSNorm, one projection for q/k/v together, rotary embeddings applied to q and k in one go, the new
keys/values written into each session's preallocated cache, attention per session, the output projection added
to the residual in one `addmm`, one projection for gate/up together, and the down projection added the same way.

`prefill_step` runs one session's multi-token step (a prompt, or a new turn after earlier ones) the same way. It
is compute-bound, and the fused kernels save what the layer modules spend in their unfused RMSNorm (five
elementwise passes over [seq, hidden]) and separate projections: a 96-token prefill of 15 SmolLM2 blocks takes
55 ms instead of 58 on this project's 2-core machine.

`fuse_layer` builds the fused weights once at load and makes the layer modules' parameters (`swarm.modeling.layers`, the
same computations as transformers' modeling code) views into them, so nothing is duplicated and the module path
(forward passes without a cache, `rpc_forward`) reads the same memory.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import List, Optional, Sequence, Tuple

import torch
import torch.nn.functional as F
from torch import nn

from server.cache import SessionKV
from swarm.modeling.layers import sdpa_attention


@dataclass
class FusedLayer:
    """One block's weights for the decode path (views shared with the layer module)."""
    input_norm: torch.Tensor  # [hidden]
    post_norm: torch.Tensor  # [hidden]
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


def fuse_layer(layer: nn.Module) -> FusedLayer:
    attn, mlp = layer.self_attn, layer.mlp
    qkv = (attn.q_proj, attn.k_proj, attn.v_proj)
    head_dim = attn.head_dim
    return FusedLayer(
        input_norm=layer.input_layernorm.weight, post_norm=layer.post_attention_layernorm.weight,
        eps=layer.input_layernorm.variance_epsilon,
        qkv_weight=_share(qkv, "weight"), qkv_bias=_share(qkv, "bias"),
        o_weight_t=attn.o_proj.weight.t(), o_bias=attn.o_proj.bias,
        gate_up_weight=_share((mlp.gate_proj, mlp.up_proj), "weight"),
        gate_up_bias=_share((mlp.gate_proj, mlp.up_proj), "bias"),
        down_weight_t=mlp.down_proj.weight.t(), down_bias=mlp.down_proj.bias, act=mlp.act_fn,
        heads=attn.q_proj.weight.shape[0] // head_dim, kv_heads=attn.k_proj.weight.shape[0] // head_dim,
        head_dim=head_dim, scaling=attn.scaling, layer_idx=attn.layer_idx,
    )


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def _project_residual(x: torch.Tensor, h: torch.Tensor, weight_t: torch.Tensor, bias: Optional[torch.Tensor]
                      ) -> torch.Tensor:
    """x + h @ weight_t (+ bias), for x, h: [rows, features]."""
    out = torch.addmm(x, h, weight_t)
    return out if bias is None else out.add_(bias)


def attention_backends(device: torch.device):
    """The SDPA kernels for steps whose key length changes every call: on CUDA all but cuDNN's, which builds an
    execution plan for each new shape (about 3 ms per block per new length on an H100), else no restriction."""
    if device.type != "cuda":
        return contextlib.nullcontext()
    from torch.nn.attention import SDPBackend, sdpa_kernel

    return sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH])


@torch.inference_mode()
def decode_step(layers: Sequence[FusedLayer], x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                sessions: Sequence[Tuple[int, SessionKV]]) -> torch.Tensor:
    """Run single-token steps of several sessions through `layers`.

    x: [rows, hidden], the sessions' rows one after another; cos, sin: [rows, head_dim] for each row's position;
    sessions: (rows, kv) per session, whose `begin_step` was called. Returns [rows, hidden].
    """
    with attention_backends(x.device):
        return _decode_layers(layers, x, cos, sin, sessions)


@torch.inference_mode()
def prefill_step(layers: Sequence[FusedLayer], x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, kv: SessionKV,
                 mask: Optional[torch.Tensor]) -> torch.Tensor:
    """Run one session's step of `seq` tokens through `layers`, its `begin_step` called.

    x: [batch, seq, hidden]; cos, sin: [batch, seq, head_dim]; mask: the additive causal mask [1, 1, seq,
    prefix + seq], or None when the cache held nothing before this step (SDPA's square causal mask) or the step is
    one token (it sees every key). Returns [batch, seq, hidden].
    """
    batch, seq, hidden = x.shape
    rows = batch * seq
    x = x.reshape(rows, hidden)
    cos, sin = cos.reshape(rows, 1, -1), sin.reshape(rows, 1, -1)
    with attention_backends(x.device):
        for layer in layers:
            heads, kv_heads, dim = layer.heads, layer.kv_heads, layer.head_dim
            h = F.rms_norm(x, x.shape[-1:], layer.input_norm, layer.eps)
            qkv = F.linear(h, layer.qkv_weight, layer.qkv_bias).view(rows, heads + 2 * kv_heads, dim)
            qk = qkv[:, :heads + kv_heads]
            qk = qk * cos + _rotate_half(qk) * sin  # [rows, heads + kv_heads, dim]
            # [batch, heads, seq, dim] views for attention
            q = qk[:, :heads].view(batch, seq, heads, dim).transpose(1, 2)
            k = qk[:, heads:].view(batch, seq, kv_heads, dim).transpose(1, 2)
            v = qkv[:, heads + kv_heads:].view(batch, seq, kv_heads, dim).transpose(1, 2)
            keys, values = kv.update(k, v, layer.layer_idx)
            # the layer modules' attention call (transformers' SDPA path): with a mask it expands the key/value
            # heads rather than asking SDPA for GQA, which CUDA's kernels do not combine with a mask
            o = sdpa_attention(q, keys, values, mask, layer.scaling, heads // kv_heads)  # [batch, seq, heads, dim]
            x = _project_residual(x, o.reshape(rows, heads * dim), layer.o_weight_t, layer.o_bias)
            x = _mlp_residual(layer, x)
    return x.view(batch, seq, hidden)


def _mlp_residual(layer: FusedLayer, x: torch.Tensor) -> torch.Tensor:
    """x + MLP(post_norm(x)) for x [rows, hidden]."""
    h = F.rms_norm(x, x.shape[-1:], layer.post_norm, layer.eps)
    gate, up = F.linear(h, layer.gate_up_weight, layer.gate_up_bias).chunk(2, dim=-1)
    # in place: a 1024-token prefill chunk would otherwise hold a third [rows, intermediate] buffer (6 MB here)
    return _project_residual(x, layer.act(gate).mul_(up), layer.down_weight_t, layer.down_bias)


def _decode_layers(layers: Sequence[FusedLayer], x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                   sessions: Sequence[Tuple[int, SessionKV]]) -> torch.Tensor:
    rows = x.shape[0]
    for layer in layers:
        heads, kv_heads, dim = layer.heads, layer.kv_heads, layer.head_dim
        h = F.rms_norm(x, x.shape[-1:], layer.input_norm, layer.eps)
        qkv = F.linear(h, layer.qkv_weight, layer.qkv_bias).view(rows, heads + 2 * kv_heads, dim)
        qk = qkv[:, :heads + kv_heads]  # rotary on q and k together: [rows, heads + kv_heads, dim]
        qk = qk * cos.unsqueeze(1) + _rotate_half(qk) * sin.unsqueeze(1)
        q, k = qk[:, :heads], qk[:, heads:]
        v = qkv[:, heads + kv_heads:]
        outs: List[torch.Tensor] = []
        row = 0
        for size, kv in sessions:
            # [size, kv_heads, 1, dim] into the cache; attention over the filled prefix
            keys, values = kv.update(k[row:row + size].unsqueeze(2), v[row:row + size].unsqueeze(2), layer.layer_idx)
            outs.append(F.scaled_dot_product_attention(q[row:row + size].unsqueeze(2), keys, values,
                                                       scale=layer.scaling, enable_gqa=heads != kv_heads))
            row += size
        o = outs[0] if len(outs) == 1 else torch.cat(outs, dim=0)  # [rows, heads, 1, dim]
        x = _project_residual(x, o.reshape(rows, heads * dim), layer.o_weight_t, layer.o_bias)
        x = _mlp_residual(layer, x)
    return x
