"""CUDA graphs for single-token decode steps of one session (Llama-style spans on a CUDA device).

On a GPU a decode step of a small batch is bound by kernel launches, not by the GPU: the lean path
(`server.decode`) still issues about 15 kernels per block from Python. A `GraphedStep` captures the whole span's
step for one session once and replays it with a single launch afterwards.

A graph replays fixed addresses and fixed shapes. The block math is the family's (`BlockLayer.step`, as in
`decode_step`); only the attention it is given (`static_attention`) differs, in two ways:
- the position is a device tensor: the new key/value rows are written with `index_copy_` at that position;
- attention reads the session's whole preallocated cache `[batch, kv_heads, max_length, head_dim]` with a mask
  that allows keys at positions <= the step's position; the queries of the heads that share a key/value head
  are the "sequence" of one SDPA call, so grouped-query attention needs no copies of keys or values.
`static_decode_step` is that computation as plain code: it runs eagerly on any device (the CPU tests compare it
with `decode_step`) and is what the graph captures. Graphs live on the session's `SessionKV` (they hold its
buffers' addresses) and die with it; all graphs of a span share one memory pool, as replays never overlap (the
server runs tensor work on one thread) and each replay's output is copied out at once.
"""
from __future__ import annotations

from typing import Any, Callable, Dict, Optional, Sequence, Tuple

import torch
import torch.nn.functional as F

from server.cache import SessionKV, ring_window_mask
from swarm.modeling.families import BlockLayer

MAX_SESSIONS = 8  # up to this many sessions in one server batch replay their graphs one after another
WARMUP_REPLAYS = 2  # eager runs on a side stream before capture (lets cuBLAS/SDPA pick and cache their kernels)


def static_attention(kv: SessionKV, position: torch.Tensor, key_positions: torch.Tensor) -> Callable:
    """Attention for one session's single-token step over its whole preallocated cache: the new keys/values are
    written at `position`, and a mask allows the keys at positions <= `position`.
    (layer, q [batch, heads, dim], k, v [batch, kv_heads, dim]) -> [batch, heads * dim]"""
    allowed = (key_positions <= position).view(1, 1, 1, -1)  # [1, 1, 1, max_length]

    def attend(layer: BlockLayer, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        rows, heads, dim = q.shape
        index = layer.layer_idx - kv.layer_offset
        k_buf, v_buf = kv.keys[index], kv.values[index]  # [batch, kv_heads, max_length (or a ring's), dim]
        capacity, window = k_buf.shape[2], getattr(layer, "sliding_window", None)
        slot = position if capacity == kv.max_length else position % capacity
        k_buf.index_copy_(2, slot, k.unsqueeze(2))
        v_buf.index_copy_(2, slot, v.unsqueeze(2))
        # query heads j*group .. (j+1)*group-1 share key/value head j (as transformers' repeat_kv):
        # [batch, kv_heads, group, dim] against [batch, kv_heads, max_length, dim]
        q = q.reshape(rows, layer.kv_heads, heads // layer.kv_heads, dim)
        if window is None:
            mask = allowed
        elif capacity == kv.max_length:
            mask = allowed & (key_positions > position - window).view(1, 1, 1, -1)
        else:  # a ring buffer (`server.cache`): the slots whose positions are in the window
            mask = ring_window_mask(position, window, capacity, position.device).view(1, 1, 1, -1)
        o = F.scaled_dot_product_attention(q, k_buf, v_buf, attn_mask=mask, scale=layer.scaling)
        return o.reshape(rows, heads * dim)

    return attend


@torch.inference_mode()
def static_decode_step(layers: Sequence[BlockLayer], x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                       kv: SessionKV, position: torch.Tensor, key_positions: torch.Tensor) -> torch.Tensor:
    """One session's single-token step with shapes and addresses that do not depend on the position.

    x: [batch, hidden]; cos, sin: [batch, head_dim]; position: long [1] (the step's position);
    key_positions: long [max_length] = arange(max_length). Writes the new keys/values at `position` of `kv`'s
    buffers. Returns [batch, hidden].
    """
    attend = static_attention(kv, position, key_positions)
    for layer in layers:
        x = layer.step(x, cos, sin, attend)
    return x


def clear_unfilled(kv: SessionKV) -> None:
    """Zero the cache positions no step has written yet: the buffers start uninitialized, and masked-out NaNs
    would still poison attention (0 * NaN). Later steps only ever write finite states."""
    for k, v in zip(kv.keys, kv.values):  # a ring buffer filled once over has no unwritten slot left
        k[:, :, kv.length:].zero_()
        v[:, :, kv.length:].zero_()


class GraphedStep:
    """A captured `static_decode_step` over fixed layers for one session's `SessionKV`."""

    def __init__(self, layers: Sequence[BlockLayer], kv: SessionKV, hidden_size: int, head_dim: int,
                 pool: Optional[Any] = None):
        device, dtype = kv.keys[0].device, kv.keys[0].dtype
        batch = kv.batch_size
        self.x = torch.zeros(batch, hidden_size, dtype=dtype, device=device)
        self.cos = torch.zeros(batch, head_dim, dtype=dtype, device=device)
        self.sin = torch.zeros(batch, head_dim, dtype=dtype, device=device)
        self.position = torch.zeros(1, dtype=torch.long, device=device)
        self.key_positions = torch.arange(kv.max_length, device=device)
        args = (layers, self.x, self.cos, self.sin, kv, self.position, self.key_positions)
        # warm-up on a side stream writes position 0 of the cache, which holds no valid state before any step
        # has filled it; a graph is only captured once a prefill has, so save and restore that row
        clear_unfilled(kv)
        saved = [(k[:, :, :1].clone(), v[:, :, :1].clone()) for k, v in zip(kv.keys, kv.values)]
        stream = torch.cuda.Stream(device)
        stream.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(stream):
            for _ in range(WARMUP_REPLAYS):
                static_decode_step(*args)
        torch.cuda.current_stream(device).wait_stream(stream)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph, pool=pool):
            self.out = static_decode_step(*args)  # [batch, hidden]
        for (k, v), (k0, v0) in zip(zip(kv.keys, kv.values), saved):
            k[:, :, :1].copy_(k0)
            v[:, :, :1].copy_(v0)

    def __call__(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, position: int) -> torch.Tensor:
        """x: [batch, hidden]; cos, sin: [batch, head_dim]. Returns a fresh [batch, hidden] tensor."""
        self.x.copy_(x)
        self.cos.copy_(cos)
        self.sin.copy_(sin)
        self.position.fill_(position)
        self.graph.replay()
        return self.out.clone()


class SpanGraphs:
    """The graphs of one span: created per (session, first, last) at its first single-token step."""

    def __init__(self, device: torch.device, hidden_size: int, head_dim: int, max_sessions: int = MAX_SESSIONS):
        self.hidden_size, self.head_dim = hidden_size, head_dim
        self.max_sessions = max_sessions  # batches of more sessions run the eager lean path
        self.pool = torch.cuda.graph_pool_handle()
        # a pool whose graphs were all freed (every session closed) cannot take new captures: a trivial graph
        # that lives as long as the span keeps it in use
        self._anchor_in = torch.zeros(1, device=device)
        self._anchor = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self._anchor, pool=self.pool):
            self._anchor_out = self._anchor_in + 1
        self.captures = 0

    def step(self, layers: Sequence[BlockLayer], key: Tuple[int, int], kv: SessionKV, x: torch.Tensor,
             cos: torch.Tensor, sin: torch.Tensor, position: int) -> torch.Tensor:
        graphs: Dict[Tuple[int, int], GraphedStep] = kv.__dict__.setdefault("graphs", {})
        graphed = graphs.get(key)
        if graphed is None:
            graphed = graphs[key] = GraphedStep(layers, kv, self.hidden_size, self.head_dim, self.pool)
            self.captures += 1
        return graphed(x, cos, sin, position)
