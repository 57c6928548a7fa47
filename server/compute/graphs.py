"""CUDA graphs for the single-token decode steps of a set of sessions (spans of fused layers on a CUDA device).

On a GPU a decode step of a small batch is bound by kernel launches, not by the GPU: the lean path
(`server.compute.decode`) still issues about 15 kernels per block from Python (more for nf4 weights, adapters and
ALiBi). A `GraphedStep` captures the whole span's step for an ordered set of sessions once and replays it with a single
launch afterwards: their rows go through the projections together (one read of the weights, quantized or not),
and each session attends over its own cache inside the graph.

A graph replays fixed addresses and fixed shapes. The block math is the family's (`BlockLayer.step`, as in
`decode_step`); only the attention it is given (`static_attention`) differs:
- each session's position is an element of a device tensor: its new key/value rows are written with `index_copy_`
  at that position (modulo the ring's capacity for a sliding-window block);
- attention reads the session's whole preallocated cache `[batch, kv_heads, max_length, head_dim]` with a mask
  that allows the keys at positions <= the step's position, and for a left-padded session only those at or past
  each row's padding (`SessionKV.padding`, a graph input kept at one address); the queries of the heads that share
  a key/value head are the "sequence" of one SDPA call, so grouped-query attention needs no copies;
- an ALiBi layer's bias (`key_bias`) is added over the whole cache's key positions.
`static_decode_step` is that computation as plain code: it runs eagerly on any device (the CPU tests compare it
with `decode_step`) and is what the graph captures.

Which sets get a graph (`SpanGraphs.run`): a set of sessions (in the batch's canonical order, `SessionKV.serial`),
with their padding versions and block range, is captured the second time it comes (a lone session at once), and
at most one such set every `CAPTURE_SPACING` steps: decode batches whose membership shifts from step to step
(sessions joining, finishing, drifting into another pass) run the eager lean path instead of paying a capture
(about three eager steps) each. At most `MAX_GRAPHS` graphs live per span (least recently
used go first); a graph is dropped as soon as one of its sessions is collected (a finalizer queues it, the next
step drops it: never inside a capture). All graphs of a span share one memory pool, as replays never overlap (the
server runs tensor work on one thread) and each replay's output is copied out at once.

What is not captured: Mixtral's routed experts (`FamilySpec.graph_refusal`: a host sync per block to count each expert's
tokens), int8 weights (LLM.int8() picks its outlier columns from each input: a host sync and data-dependent
shapes, which capture refuses: `BlockSpan.enable_cuda_graphs`).
"""
from __future__ import annotations

import logging
import weakref
from collections import OrderedDict
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch
import torch.nn.functional as F

from server.compute.cache import SessionKV, ring_held
from swarm.modeling.families import BlockLayer
from swarm.modeling.layers import key_bias

MAX_SESSIONS = 16  # decode batches of up to this many sessions replay a graph; larger ones run the eager path
MAX_GRAPHS = 32  # graphs kept per span (each holds its set's inputs and output, and its share of the pool)
CAPTURE_AFTER = 2  # a set of several sessions is captured the second time it comes as one batch
CAPTURE_SPACING = 16  # steps between two captures of sets of several sessions (a capture costs ~3 eager steps)
WARMUP_REPLAYS = 2  # eager runs on a side stream before capture (lets cuBLAS/SDPA pick and cache their kernels)
logger = logging.getLogger(__name__)

Sessions = Sequence[Tuple[int, SessionKV]]  # (rows, cache) per session, in the batch's row order


def session_masks(sessions: Sessions, positions: torch.Tensor, key_positions: torch.Tensor) -> List[torch.Tensor]:
    """Per session, the bool mask of the cache positions its step's queries may see (full attention):
    [1, 1, 1, max_length], or [rows, 1, 1, max_length] for a left-padded session (its padding keys hidden).
    positions: long [sessions]; key_positions: long [>= every max_length] = arange."""
    masks = []
    for i, (_, kv) in enumerate(sessions):
        keys = key_positions[:kv.max_length]
        allowed = (keys <= positions[i:i + 1]).view(1, 1, 1, -1)
        if kv.padding is not None:
            allowed = allowed & (keys[None, :] >= kv.padding[:, None]).view(kv.batch_size, 1, 1, -1)
        masks.append(allowed)
    return masks


def static_attention(sessions: Sessions, positions: torch.Tensor, key_positions: torch.Tensor) -> Callable:
    """Attention for single-token steps of `sessions` (their rows one after another) over their whole preallocated
    caches: each session's new keys/values are written at its position, and a mask allows what its queries see.
    (layer, q [rows, heads, dim], k, v [rows, kv_heads, dim]) -> [rows, heads * dim]"""
    masks = session_masks(sessions, positions, key_positions)
    biases: Dict[int, Optional[torch.Tensor]] = {}  # key length -> an ALiBi layer's bias [1, kv_heads, group, keys]

    def attend(layer: BlockLayer, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        _, heads, dim = q.shape
        group = heads // layer.kv_heads
        outs, row = [], 0
        for i, (size, kv) in enumerate(sessions):
            index = layer.layer_idx - kv.layer_offset
            k_buf, v_buf = kv.keys[index], kv.values[index]  # [size, kv_heads, max_length (or a ring's), dim]
            capacity, window = k_buf.shape[2], getattr(layer, "sliding_window", None)
            position = positions[i:i + 1]
            slot = position if capacity == kv.max_length else position % capacity
            k_buf.index_copy_(2, slot, k[row:row + size].unsqueeze(2))
            v_buf.index_copy_(2, slot, v[row:row + size].unsqueeze(2))
            mask = masks[i]
            if window is not None:
                if capacity == kv.max_length:
                    mask = mask & (key_positions[:capacity] > position - window).view(1, 1, 1, -1)
                else:  # a ring buffer (`server.compute.cache`): the slots whose positions are in the window
                    held = ring_held(position, capacity, position.device)  # [capacity]
                    mask = ((held > position - window) & (held >= 0)).view(1, 1, 1, -1)
                    if kv.padding is not None:  # and a left-padded row's positions at or past its padding
                        mask = mask & (held[None, :] >= kv.padding[:, None]).view(size, 1, 1, -1)
            if capacity not in biases:
                bias = key_bias(layer, capacity, q.dtype, q.device)  # [heads, keys]
                biases[capacity] = None if bias is None else bias.view(1, layer.kv_heads, group, capacity)
            bias = biases[capacity]
            if bias is not None:  # additive: the bias where a key is seen, the dtype's minimum where not
                mask = torch.where(mask, bias, torch.finfo(q.dtype).min)
            # query heads j*group .. (j+1)*group-1 share key/value head j (as transformers' repeat_kv):
            # [size, kv_heads, group, dim] against [size, kv_heads, capacity, dim]
            grouped = q[row:row + size].reshape(size, layer.kv_heads, group, dim)
            o = F.scaled_dot_product_attention(grouped, k_buf, v_buf, attn_mask=mask, scale=layer.scaling)
            outs.append(o.reshape(size, heads * dim))
            row += size
        return outs[0] if len(outs) == 1 else torch.cat(outs)

    return attend


@torch.inference_mode()
def static_decode_step(layers: Sequence[BlockLayer], x: torch.Tensor, cos: Optional[torch.Tensor],
                       sin: Optional[torch.Tensor], sessions: Sessions, positions: torch.Tensor,
                       key_positions: torch.Tensor) -> torch.Tensor:
    """The single-token step of `sessions` with shapes and addresses that do not depend on their positions.

    x: [rows, hidden] (the sessions' rows one after another); cos, sin: [rows, head_dim] (None without rotary);
    positions: long [sessions] (each step's position); key_positions: long [>= every max_length] = arange. Writes
    the new keys/values at the positions of each session's buffers. Returns [rows, hidden].
    """
    attend = static_attention(sessions, positions, key_positions)
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
    """A captured `static_decode_step` over fixed layers for an ordered set of sessions."""

    def __init__(self, layers: Sequence[BlockLayer], sessions: Sessions, positions: Sequence[int], hidden_size: int,
                 head_dim: int, rotary: bool, pool: Optional[Any] = None):
        kv0 = sessions[0][1]
        device, dtype = kv0.keys[0].device, kv0.keys[0].dtype
        rows = sum(size for size, _ in sessions)
        self.x = torch.zeros(rows, hidden_size, dtype=dtype, device=device)
        self.cos = torch.zeros(rows, head_dim, dtype=dtype, device=device) if rotary else None
        self.sin = torch.zeros(rows, head_dim, dtype=dtype, device=device) if rotary else None
        # the positions of the step being captured: warm-up writes (zero) keys there, which the replay overwrites
        self.positions = torch.tensor(list(positions), dtype=torch.long, device=device)
        self.key_positions = torch.arange(max(kv.max_length for _, kv in sessions), device=device)
        args = (layers, self.x, self.cos, self.sin, sessions, self.positions, self.key_positions)
        for _, kv in sessions:
            clear_unfilled(kv)
        stream = torch.cuda.Stream(device)
        stream.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(stream):
            for _ in range(WARMUP_REPLAYS):
                static_decode_step(*args)
        torch.cuda.current_stream(device).wait_stream(stream)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph, pool=pool):
            self.out = static_decode_step(*args)  # [rows, hidden]

    def __call__(self, x: torch.Tensor, cos: Optional[torch.Tensor], sin: Optional[torch.Tensor],
                 positions: torch.Tensor) -> torch.Tensor:
        """x: [rows, hidden]; cos, sin: [rows, head_dim] or None; positions: long [sessions] (on the host).
        Returns a fresh [rows, hidden] tensor."""
        self.x.copy_(x)
        if self.cos is not None and self.sin is not None and cos is not None and sin is not None:
            self.cos.copy_(cos)
            self.sin.copy_(sin)
        self.positions.copy_(positions, non_blocking=True)
        self.graph.replay()
        return self.out.clone()


class SpanGraphs:
    """The graphs of one span, by (block range, sessions in row order with their rows and padding versions)."""

    def __init__(self, device: torch.device, hidden_size: int, head_dim: int, rotary: bool = True,
                 max_sessions: int = MAX_SESSIONS, max_graphs: int = MAX_GRAPHS):
        self.hidden_size, self.head_dim, self.rotary = hidden_size, head_dim, rotary
        self.max_sessions = max_sessions  # batches of more sessions run the eager lean path
        self.max_graphs = max_graphs
        self.pool = torch.cuda.graph_pool_handle()
        # a pool whose graphs were all freed (every session closed) cannot take new captures: a trivial graph
        # that lives as long as the span keeps it in use
        self._anchor_in = torch.zeros(1, device=device)
        self._anchor = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self._anchor, pool=self.pool):
            self._anchor_out = self._anchor_in + 1
        self._graphs: "OrderedDict[tuple, GraphedStep]" = OrderedDict()
        self._seen: "OrderedDict[tuple, int]" = OrderedDict()  # sets not captured yet -> times they came
        self._dead: List[int] = []  # serials of collected sessions (queued by their finalizers)
        self._watched: set = set()
        self.captures = 0
        self.replays = 0
        self.refused: Optional[str] = None  # why a capture failed (then no more are tried)
        self.steps = 0
        self._last_capture = -CAPTURE_SPACING  # the step of the last capture of a set of several sessions

    def run(self, layers: Sequence[BlockLayer], first: int, last: int, sessions: Sessions, x: torch.Tensor,
            cos: Optional[torch.Tensor], sin: Optional[torch.Tensor], positions: Sequence[int]
            ) -> Optional[torch.Tensor]:
        """The step of `sessions` (x: [rows, hidden], their rows one after another) through blocks [first, last) by
        a graph, captured now if this set has come before (a lone session: at once); None if it is not (yet) to be
        captured: the caller runs the eager path."""
        self._drop_dead()
        self.steps += 1
        key = (first, last, tuple((kv.serial, kv.padding_version, size) for size, kv in sessions))
        graphed = self._graphs.get(key)
        if graphed is None:
            seen = self._seen.pop(key, 0) + 1
            if len(sessions) > 1 and (seen < CAPTURE_AFTER or self.steps - self._last_capture < CAPTURE_SPACING):
                self._seen[key] = seen
                while len(self._seen) > 4 * self.max_graphs:
                    self._seen.popitem(last=False)
                return None
            if self.refused is not None:
                return None
            for _, kv in sessions:
                self._watch(kv)
            try:
                graphed = GraphedStep(layers, sessions, positions, self.hidden_size, self.head_dim, self.rotary,
                                      self.pool)
            except Exception as e:  # a kernel that capture refuses: this span's steps run eagerly from now on
                self.refused = f"{type(e).__name__}: {e}".splitlines()[0]
                logger.warning(f"CUDA graph capture failed, decode steps run eagerly: {self.refused}")
                torch.cuda.synchronize()
                return None
            self.captures += 1
            logger.info(f"captured a CUDA graph of {len(sessions)} session(s), blocks {first}:{last} ({self.captures} "
                        f"captures, {self.replays} replays, {len(self._graphs) + 1} held)")
            if len(sessions) > 1:
                self._last_capture = self.steps
            self._graphs[key] = graphed
            while len(self._graphs) > self.max_graphs:
                self._graphs.popitem(last=False)
        else:
            self._graphs.move_to_end(key)
        self.replays += 1
        return graphed(x, cos, sin, torch.tensor(list(positions), dtype=torch.long))

    def __len__(self) -> int:
        return len(self._graphs)

    def _watch(self, kv: SessionKV) -> None:
        if kv.serial not in self._watched:
            self._watched.add(kv.serial)
            weakref.finalize(kv, self._dead.append, kv.serial)  # only queues: graphs are freed by the next step

    def _drop_dead(self) -> None:
        if not self._dead:
            return
        dead = set()
        while self._dead:  # (a finalizer may append meanwhile, from any thread)
            dead.add(self._dead.pop())
        self._watched -= dead
        for key in [key for key in self._graphs if any(serial in dead for serial, _, _ in key[2])]:
            del self._graphs[key]


class StaticSteps:
    """`SpanGraphs.run`'s computation without capture, on any device: every step of up to `max_sessions` sessions
    runs `static_decode_step` eagerly. What the CPU tests compare with the lean path (`BlockSpan.graphs` set to
    one), and a way to tell a graph's math from its capture when debugging on a GPU."""

    def __init__(self, max_sessions: int = MAX_SESSIONS):
        self.max_sessions = max_sessions
        self.replays = 0

    def run(self, layers: Sequence[BlockLayer], first: int, last: int, sessions: Sessions, x: torch.Tensor,
            cos: Optional[torch.Tensor], sin: Optional[torch.Tensor], positions: Sequence[int]) -> torch.Tensor:
        for _, kv in sessions:
            clear_unfilled(kv)
        self.replays += 1
        device = x.device
        return static_decode_step(layers, x, cos, sin, sessions, torch.tensor(list(positions), device=device),
                                  torch.arange(max(kv.max_length for _, kv in sessions), device=device))
