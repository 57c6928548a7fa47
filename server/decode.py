"""The server's steps through a span's fused layers: batched single-token decode and one session's prefill.

The block math is the family's (`BlockLayer.step`, e.g. `swarm.modeling.llama.block_step` on its fused weights:
torch's fused RMSNorm, one projection for q/k/v together, rotary on q and k in one go, the output and down
projections added to the residual in one `addmm` each, one projection for gate/up together). This module owns
what surrounds it: which rows go through together, and the attention each step passes in.

A decode step is bound by memory bandwidth: every weight is read once per step whatever the number of rows, so
concurrent sessions' steps share one pass. `decode_step`'s attention writes each session's new keys/values into
its preallocated cache and attends per session over the filled prefix.

`prefill_step` runs one session's multi-token step (a prompt, or a new turn after earlier ones) through the same
fused layers, with the layer modules' attention through the cache (`swarm.modeling.layers.cache_attention`). It
is compute-bound, and the fused kernels save what the layer modules spend in their unfused RMSNorm (five
elementwise passes over [seq, hidden]) and separate projections.
"""
from __future__ import annotations

import contextlib
from typing import Callable, List, Optional, Sequence, Tuple

import torch
import torch.nn.functional as F

from server.cache import SessionKV
from swarm.modeling.families import BlockLayer
from swarm.modeling.layers import cache_attention


def attention_backends(device: torch.device):
    """The SDPA kernels for steps whose key length changes every call: on CUDA all but cuDNN's, which builds an
    execution plan for each new shape (about 3 ms per block per new length on an H100), else no restriction."""
    if device.type != "cuda":
        return contextlib.nullcontext()
    from torch.nn.attention import SDPBackend, sdpa_kernel

    return sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH])


def sessions_attention(sessions: Sequence[Tuple[int, SessionKV]]) -> Callable:
    """Attention for single-token steps of several sessions whose rows lie one after another: each session's new
    keys/values go into its cache, its queries attend over its filled prefix.
    (layer, q [rows, heads, dim], k, v [rows, kv_heads, dim]) -> [rows, heads * dim]"""
    def attend(layer: BlockLayer, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        outs: List[torch.Tensor] = []
        row = 0
        for size, kv in sessions:
            # [size, kv_heads, 1, dim] into the cache; attention over the filled prefix
            keys, values = kv.update(k[row:row + size].unsqueeze(2), v[row:row + size].unsqueeze(2), layer.layer_idx)
            if kv.padding is not None:  # a left-padded session: its padding keys hidden
                outs.append(_padded_attention(layer, q[row:row + size], keys, values, kv))
            else:
                outs.append(F.scaled_dot_product_attention(q[row:row + size].unsqueeze(2), keys, values,
                                                           scale=layer.scaling,
                                                           enable_gqa=layer.heads != layer.kv_heads))
            row += size
        o = outs[0] if len(outs) == 1 else torch.cat(outs, dim=0)  # [rows, heads, 1, dim]
        return o.reshape(q.shape[0], -1)

    return attend


def _padded_attention(layer: BlockLayer, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, kv: SessionKV
                      ) -> torch.Tensor:
    """One query per row over a left-padded session's cache: q [size, heads, dim], keys/values [size, kv_heads,
    length, dim] -> [size, heads, 1, dim]. The query heads are grouped per key/value head (no mask with GQA in
    CUDA's kernels); the mask [size, 1, 1, length] hides each row's padding."""
    size, length = q.shape[0], keys.shape[2]
    mask = kv.key_mask(length - 1, 1, q.dtype)  # [size, 1, 1, length]
    grouped = q.reshape(size, layer.kv_heads, layer.heads // layer.kv_heads, q.shape[-1])
    out = F.scaled_dot_product_attention(grouped, keys, values, attn_mask=mask, scale=layer.scaling)
    return out.reshape(size, layer.heads, 1, q.shape[-1])


@torch.inference_mode()
def decode_step(layers: Sequence[BlockLayer], x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                sessions: Sequence[Tuple[int, SessionKV]]) -> torch.Tensor:
    """Run single-token steps of several sessions through `layers`.

    x: [rows, hidden], the sessions' rows one after another; cos, sin: [rows, head_dim] for each row's position;
    sessions: (rows, kv) per session, whose `begin_step` was called. Returns [rows, hidden].
    """
    attend = sessions_attention(sessions)
    with attention_backends(x.device):
        for layer in layers:
            x = layer.step(x, cos, sin, attend)
    return x


@torch.inference_mode()
def prefill_step(layers: Sequence[BlockLayer], x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, kv: SessionKV,
                 mask: Optional[torch.Tensor]) -> torch.Tensor:
    """Run one session's step of `seq` tokens through `layers`, its `begin_step` called.

    x: [batch, seq, hidden]; cos, sin: [batch, seq, head_dim]; mask: the additive causal mask [1, 1, seq,
    prefix + seq], or None when the cache held nothing before this step (SDPA's square causal mask) or the step is
    one token (it sees every key). Returns [batch, seq, hidden].
    """
    # the layer modules' attention (transformers' SDPA path): with a mask it expands the key/value heads rather
    # than asking SDPA for GQA, which CUDA's kernels do not combine with a mask
    attend = cache_attention(kv, mask)
    with attention_backends(x.device):
        for layer in layers:
            x = layer.step(x, cos, sin, attend)
    return x
