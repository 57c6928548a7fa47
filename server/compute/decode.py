"""The server's steps through a span's fused layers: batched single-token decode and one session's prefill.

The block math is the family's (`BlockLayer.step`, e.g. `swarm.modeling.families.llama.block_step` on its fused weights:
torch's fused RMSNorm, one projection for q/k/v together, rotary on q and k in one go, the output and down
projections added to the residual in one `addmm` each, one projection for gate/up together). This module owns
what surrounds it: which rows go through together, and the attention each step passes in.

A decode step is bound by memory bandwidth: every weight is read once per step whatever the number of rows, so
concurrent sessions' steps share one pass. `decode_step`'s attention writes each session's new keys/values into
its preallocated cache and attends per session over the filled prefix; sessions on the shared KV arena
(`server.compute.kv_arena`) attend with one SDPA call per chunk instead (`arena_groups`, `ChunkPlan`): measured on the
2-core machine, real SmolLM2 blocks 0:15 with 8 sessions of 150-200 tokens, 18.0 ms a pass instead of 20.1 (16
sessions: 30.9 instead of 33.6).

`prefill_step` runs one session's multi-token step (a prompt, or a new turn after earlier ones) through the same
fused layers, with the layer modules' attention through the cache (`swarm.modeling.layers.cache_attention`). It
is compute-bound, and the fused kernels save what the layer modules spend in their unfused RMSNorm (five
elementwise passes over [seq, hidden]) and separate projections.

`ragged_prefill_step` runs several sessions' multi-token steps in one pass, their tokens' rows one after another
(the projections and MLP on all rows at once, each session's attention through its own cache): concurrent
requests' prompts, which arrive together, then cost one read of the weights instead of one each.

`host_outputs` brings a pass's outputs to the host on the compute thread that ran it (one copy for a batch), so
that the RPC handlers' event loop, which serializes them, never waits there for a GPU (measured on an H200, 16
sessions through the gateway: 37% of the server's samples were its event loop inside `serialize_tensor`'s `.cpu()`).
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Callable, List, Optional, Sequence, Tuple

import torch

from server.compute.cache import SessionKV
from server.compute.kv_arena import Chunk
from swarm.modeling.families import BlockLayer
from swarm.modeling.layers import biased_mask, cache_attention, causal_mask, key_bias, layer_sdpa, sdpa_attention


def attention_backends(device: torch.device):
    """The SDPA kernels for steps whose key length changes every call: on CUDA all but cuDNN's, which builds an
    execution plan for each new shape (about 3 ms per block per new length on an H100), else no restriction."""
    if device.type != "cuda":
        return contextlib.nullcontext()
    from torch.nn.attention import SDPBackend, sdpa_kernel

    return sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH])


def sessions_attention(sessions: Sequence[Tuple[int, SessionKV]]) -> Callable:
    """Attention for single-token steps of several sessions whose rows lie one after another: each session's new
    keys/values go into its cache, its queries attend over its filled prefix (for a layer with a sliding window,
    its last `window` positions: `SessionKV.decode_update`).
    (layer, q [rows, heads, dim], k, v [rows, kv_heads, dim]) -> [rows, heads * dim]"""
    biases: dict = {}  # key length -> an ALiBi layer's bias [1, heads, 1, keys], once for all layers of a step
    groups = arena_groups(sessions)  # sessions on shared storage attend together (`server.compute.kv_arena`)
    if groups is not None:
        return _grouped_attention(groups)

    def attend(layer: BlockLayer, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        outs: List[torch.Tensor] = []
        row = 0
        for size, kv in sessions:
            # [size, kv_heads, 1, dim] into the cache; attention over the filled prefix (or its window)
            keys, values, mask = kv.decode_update(k[row:row + size].unsqueeze(2), v[row:row + size].unsqueeze(2),
                                                  layer.layer_idx)
            length = keys.shape[2]
            if kv.padding is not None:  # a left-padded session: its padding keys hidden
                outs.append(_padded_attention(layer, q[row:row + size], keys, values, kv, mask))
                row += size
                continue
            if mask is not None:  # a wrapped ring buffer: its slots in the window; a kv head's query heads as "seq"
                grouped = q[row:row + size].reshape(size, layer.kv_heads, layer.heads // layer.kv_heads, -1)
                o = layer_sdpa(layer, grouped, keys, values, attn_mask=mask.view(1, 1, 1, -1), scale=layer.scaling)
                outs.append(o.reshape(size, -1))
                row += size
                continue
            if length not in biases:
                bias = key_bias(layer, length, q.dtype, q.device)
                biases[length] = None if bias is None else biased_mask(bias, None, 1)
            if biases[length] is None:
                o = layer_sdpa(layer, q[row:row + size].unsqueeze(2), keys, values, scale=layer.scaling,
                               enable_gqa=layer.heads != layer.kv_heads)  # [size, heads, 1, dim]
            else:  # SDPA with a per-head mask, the query heads grouped per key/value head: [size, 1, heads, dim]
                o = sdpa_attention(q[row:row + size].unsqueeze(2), keys, values, biases[length], layer.scaling,
                                   layer.heads // layer.kv_heads)
            outs.append(o.reshape(size, -1))
            row += size
        return outs[0] if len(outs) == 1 else torch.cat(outs, dim=0)  # [rows, heads * dim]

    return attend


@dataclass
class ChunkPlan:
    """One step's members of one arena chunk, rows `row`..`row + len(slots)` of the batch in slot order: their slots
    [m], the positions they write [m], the slot range [lo, hi) and key length they attend over, and the additive mask
    [hi - lo, 1, 1, length] of each range row's own keys (None: every row sees them all)."""

    chunk: Chunk
    layer_offset: int
    row: int
    slots: torch.Tensor
    positions: torch.Tensor
    lo: int
    hi: int
    length: int
    mask: Optional[torch.Tensor]
    local: Optional[torch.Tensor]  # slots - lo where the range has slots of non-members (their queries are zeros)


PER_SESSION_KEYS = 512  # a session's own attention call costs about what reading this many more keys costs


def arena_groups(sessions: Sequence[Tuple[int, SessionKV]]) -> Optional[List[ChunkPlan]]:
    """The step's sessions as `ChunkPlan`s in row order: a chunk's members together, or each alone where one long
    session among short ones would make the others read as many keys; None unless every session is a one-row arena
    session without padding. A chunk's members attend together if their rows come in slot order
    (`BlockSpan.forward_batch` orders them so). Chunks share a layer range, so its members share `layer_offset`."""
    if not sessions or any(size != 1 or kv.slot is None or kv.padding is not None for size, kv in sessions):
        return None
    groups: List[ChunkPlan] = []
    start = 0
    while start < len(sessions):
        chunk = sessions[start][1].slot.chunk  # type: ignore[union-attr]
        end = start
        while end < len(sessions) and sessions[end][1].slot.chunk is chunk:  # type: ignore[union-attr]
            end += 1
        members = [kv for _, kv in sessions[start:end]]
        slots = [kv.slot.index for kv in members]  # type: ignore[union-attr]
        lengths = [kv.step_start + 1 for kv in members]
        if any(n > kv.max_length for n, kv in zip(lengths, members)):  # (the handler refuses such steps first)
            raise ValueError("a decode step past its session's max_length")
        lo, hi, length = slots[0], slots[-1] + 1, max(lengths)
        # each alone: slots out of order, or a long session among short ones (the others would read its length)
        if slots != sorted(set(slots)) or (hi - lo) * length > sum(lengths) + PER_SESSION_KEYS * len(members):
            groups.extend(_chunk_plan(chunk, members[0].layer_offset, start + i, [slot], [n], slot, slot + 1, n)
                          for i, (slot, n) in enumerate(zip(slots, lengths)))
        else:
            groups.append(_chunk_plan(chunk, members[0].layer_offset, start, slots, lengths, lo, hi, length))
        start = end
    return groups


def _chunk_plan(chunk: Chunk, layer_offset: int, row: int, slots: List[int], lengths: List[int], lo: int, hi: int,
                length: int) -> ChunkPlan:
    dtype = chunk.keys[0].dtype
    local = torch.tensor([s - lo for s in slots])
    dense = len(slots) == hi - lo
    mask = None
    if not dense or min(lengths) < length:
        seen = torch.ones(hi - lo, dtype=torch.long)  # a non-member's zero query sees key 0 only (no empty softmax)
        seen[local] = torch.tensor(lengths)
        hidden = torch.arange(length).unsqueeze(0) >= seen.unsqueeze(1)  # [hi - lo, length]
        mask = torch.zeros(hidden.shape, dtype=dtype).masked_fill_(hidden, torch.finfo(dtype).min)[:, None, None]
    return ChunkPlan(chunk, layer_offset, row, torch.tensor(slots), torch.tensor(lengths) - 1, lo, hi, length, mask,
                     None if dense else local)


def _grouped_attention(plans: List[ChunkPlan]) -> Callable:
    """Attention for `arena_groups`' plans, one SDPA call each.
    (layer, q [rows, heads, dim], k, v [rows, kv_heads, dim]) -> [rows, heads * dim]"""

    def attend(layer: BlockLayer, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        outs: List[torch.Tensor] = []
        for p in plans:
            m = p.slots.shape[0]
            index = layer.layer_idx - p.layer_offset
            keys, values = p.chunk.keys[index], p.chunk.values[index]  # [slots, kv_heads, capacity, dim]
            keys[p.slots, :, p.positions] = k[p.row:p.row + m]  # the new keys/values of the members [m, kv_heads, dim]
            values[p.slots, :, p.positions] = v[p.row:p.row + m]
            # a kv head's query heads as its "sequence" [m, kv_heads, heads / kv_heads, dim]
            grouped = q[p.row:p.row + m].reshape(m, layer.kv_heads, layer.heads // layer.kv_heads, -1)
            if p.local is not None:  # zero queries in the range's slots of non-members
                grouped = grouped.new_zeros((p.hi - p.lo,) + grouped.shape[1:]).index_copy_(0, p.local, grouped)
            o = layer_sdpa(layer, grouped, keys[p.lo:p.hi, :, :p.length], values[p.lo:p.hi, :, :p.length],
                           attn_mask=p.mask, scale=layer.scaling)
            if p.local is not None:
                o = o.index_select(0, p.local)
            outs.append(o.reshape(m, -1))
        return outs[0] if len(outs) == 1 else torch.cat(outs, dim=0)  # [rows, heads * dim]

    return attend


def _padded_attention(layer: BlockLayer, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, kv: SessionKV,
                      ring: Optional[torch.Tensor]) -> torch.Tensor:
    """One query per row over a left-padded session's cache: q [size, heads, dim], keys/values [size, kv_heads,
    length, dim] as `SessionKV.decode_update` returned them (the prefix's last keys in order, or a wrapped ring
    whose visible slots are `ring` [length]) -> [size, heads * dim]. The query heads are grouped per key/value head
    (no mask with GQA in CUDA's kernels); the mask [size, 1, 1, length] hides each row's padding keys."""
    size, length = q.shape[0], keys.shape[2]
    assert kv.padding is not None
    position = kv.step_start  # this step's query position
    slots = torch.arange(length, device=q.device)
    if ring is None:  # the last `length` positions, in order
        held = slots + (position + 1 - length)
    else:  # slot s holds the latest position <= `position` that is s modulo the ring's capacity
        held = position - (position - slots) % length
    padding = kv.padding.to(q.device)  # (on a tensor-parallel shard's device)
    allowed = (held.unsqueeze(0) >= padding.unsqueeze(1)) | (held == position).unsqueeze(0)  # [size, length]
    if ring is not None:
        allowed &= ring.unsqueeze(0)
    mask = torch.zeros(allowed.shape, dtype=q.dtype, device=q.device).masked_fill_(~allowed, torch.finfo(q.dtype).min)
    grouped = q.reshape(size, layer.kv_heads, layer.heads // layer.kv_heads, q.shape[-1])
    full_mask = mask[:, None, None, :]  # [size, 1, 1, length]
    bias = key_bias(layer, length, q.dtype, q.device) if ring is None else None  # [heads, length] (ALiBi)
    if bias is not None:  # per query head, grouped as the queries: [size, kv_heads, groups, length]
        full_mask = torch.where(full_mask == 0, bias.view(1, layer.kv_heads, -1, length), full_mask)
    out = layer_sdpa(layer, grouped, keys, values, attn_mask=full_mask, scale=layer.scaling)
    return out.reshape(size, -1)


@torch.inference_mode()
def decode_step(layers: Sequence[BlockLayer], x: torch.Tensor, cos: Optional[torch.Tensor],
                sin: Optional[torch.Tensor], sessions: Sequence[Tuple[int, SessionKV]]) -> torch.Tensor:
    """Run single-token steps of several sessions through `layers`.

    x: [rows, hidden], the sessions' rows one after another; cos, sin: [rows, head_dim] for each row's position
    (None without rotary);
    sessions: (rows, kv) per session, whose `begin_step` was called. Returns [rows, hidden].
    """
    attend = sessions_attention(sessions)
    with attention_backends(x.device):
        for layer in layers:
            x = layer.step(x, cos, sin, attend)
    return x


@torch.inference_mode()
def prefill_step(layers: Sequence[BlockLayer], x: torch.Tensor, cos: Optional[torch.Tensor],
                 sin: Optional[torch.Tensor], kv: SessionKV, mask: Optional[torch.Tensor],
                 window_mask: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Run one session's step of `seq` tokens through `layers`, its `begin_step` called.

    x: [batch, seq, hidden]; cos, sin: [batch, seq, head_dim] (None without rotary); mask: the additive causal mask
    [1, 1, seq, prefix + seq], or None when the cache held nothing before this step (SDPA's square causal mask) or
    the step is one token (it sees every key); window_mask: the same with the layers' sliding window
    (`layers.causal_mask`), for the layers that have one. Returns [batch, seq, hidden].
    """
    # the layer modules' attention (transformers' SDPA path): with a mask it expands the key/value heads rather
    # than asking SDPA for GQA, which CUDA's kernels do not combine with a mask
    attend = cache_attention(kv, mask, window_mask)
    with attention_backends(x.device):
        for layer in layers:
            x = layer.step(x, cos, sin, attend)
    return x


@torch.inference_mode()
def ragged_prefill_step(layers: Sequence[BlockLayer], x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                        parts: Sequence[Tuple[int, int, SessionKV]], window: Optional[int] = None) -> torch.Tensor:
    """Run several sessions' multi-token steps (one row each) through `layers` in one pass.

    x: [rows, hidden], each session's `seq` tokens one after another; cos, sin: [rows, head_dim] for each token's
    position; parts: (start position, seq, kv) per session, in row order, whose `begin_step` was called; window:
    the sliding window of the layers that have one. Returns [rows, hidden]."""
    dtype, device = x.dtype, x.device
    attends, rows = [], 0
    for start, seq, kv in parts:  # each session's causal mask over its cache (and its window where layers have one)
        attends.append((rows, seq, cache_attention(kv, causal_mask(start, seq, None, dtype, device),
                                                   causal_mask(start, seq, window, dtype, device))))
        rows += seq

    def attend(layer: BlockLayer, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        # q [rows, heads, dim], k, v [rows, kv_heads, dim] -> [rows, heads * dim]
        outs = [inner(layer, q[row:row + seq][None], k[row:row + seq][None], v[row:row + seq][None])[0]
                for row, seq, inner in attends]
        return outs[0] if len(outs) == 1 else torch.cat(outs, dim=0)

    with attention_backends(device):
        for layer in layers:
            x = layer.step(x, cos, sin, attend)
    return x


def host_outputs(outputs: list) -> list:
    """`outputs` (tensors, or a row's exception from a pass that failed for it) with every tensor on the host: the
    tensors on a device of one dtype and trailing shape in one copy (`torch.cat`, then views of the host copy),
    others one by one; host tensors and exceptions as they are. Called on the compute thread, after the pass."""
    on_device = [i for i, out in enumerate(outputs) if isinstance(out, torch.Tensor) and out.device.type != "cpu"]
    if not on_device:
        return outputs
    result = list(outputs)
    first = outputs[on_device[0]]
    if len(on_device) > 1 and all(outputs[i].dtype == first.dtype and outputs[i].shape[1:] == first.shape[1:]
                                  and outputs[i].device == first.device for i in on_device):
        # [sum b_i, ...] in one copy, then each row's part back
        parts = torch.cat([outputs[i] for i in on_device]).cpu().split([outputs[i].shape[0] for i in on_device])
        for i, part in zip(on_device, parts):
            result[i] = part
    else:
        for i in on_device:
            result[i] = outputs[i].cpu()
    return result
