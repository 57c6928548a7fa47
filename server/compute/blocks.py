"""Running hidden states through a span of transformer blocks: `BlockSpan`, its capabilities (batching, CUDA graphs,
the KV arena, int8's sessions) and its passes.

`BlockSpan.load` makes one from the blocks `server.compute.loading.load_blocks` reads (only blocks [start, end),
quantized or split across devices as asked). `forward` runs `[batch, seq, hidden]` states through some or all of the
span with explicit positions, either with a session's `SessionKV` (inference) or without a cache (a plain forward
pass), optionally adding a session's deep prompts to each block's input at positions below pre_seq_len
(`add_prompt`).

LoRA adapters (`--adapters`, `swarm.modeling.lora`): `load` also reads the span's tensors of each adapter into
`adapters` (name -> `SpanAdapter`). A session's adapter is its `SessionKV.adapter`; a step runs the fused layers
wrapped by `lora.adapt_layers`, so a decode batch mixes sessions of any adapters (and none): the base projections
run once on all rows, each adapter's rows add their low-rank deltas (sessions are ordered by adapter so that each
adapter's rows are one contiguous group).
"""
from __future__ import annotations

import contextlib
import itertools
import logging
from typing import TYPE_CHECKING, Dict, Optional, Sequence, Union

import torch
from torch import nn

from server.compute.cache import SessionKV, cache_tokens, padded_key_mask
from server.compute.decode import attention_backends, decode_step, prefill_step, ragged_prefill_step
from server.compute.kv_arena import KVArena
from server.compute.loading import load_blocks
from swarm.modeling.checkpoint import Checkpoint
from swarm.modeling.families import FamilySpec
from swarm.modeling.int8_rows import row_groups
from swarm.modeling.layers import cache_attention, causal_mask, key_bias, rope_lengths
from swarm.modeling.lora import SpanAdapter, adapt_layers
from swarm.modeling.lora_files import AdapterError, AdapterFiles
from swarm.modeling.shape import ModelShape
from swarm.modeling.smallgemm import GemmGroup
from swarm.modeling.tensor_parallel import cache_layout
from swarm.wire.quant import QuantFormat, quant_format

if TYPE_CHECKING:
    from server.compute.graphs import SpanGraphs, StaticSteps

PACK_BUDGET = 0.02  # seconds a decode batch of several rows spends packing weights until all are
logger = logging.getLogger(__name__)


def add_prompt(hidden: torch.Tensor, prompt: torch.Tensor, start_position: int) -> torch.Tensor:
    """A block's input with its deep prompt added (Petals' convention): hidden [batch, seq, hidden] holds positions
    start_position.., prompt [batch | 1, pre_seq_len, hidden] positions 0..pre_seq_len; they add where they
    overlap."""
    k = min(prompt.shape[1], start_position + hidden.shape[1]) - start_position
    if k <= 0:
        return hidden
    return torch.cat([hidden[:, :k] + prompt[:, start_position:start_position + k], hidden[:, k:]], dim=1)


class BlockSpan(nn.Module):
    def __init__(self, config, family: FamilySpec, start: int, end: int, layers: nn.ModuleList,
                 rotary: Optional[nn.Module], dtype: torch.dtype, device: torch.device):
        super().__init__()
        self.config, self.family = config, family
        self.start, self.end = start, end
        self.layers, self.rotary = layers, rotary
        self.dtype, self.device = dtype, device
        self.shape = ModelShape.from_config(config)
        self.hidden_size, self.head_dim = self.shape.hidden_size, self.shape.head_dim
        self.kv_heads = self.shape.num_kv_heads
        # what each block caches per token (DeepSeek's latent attention: one head of latent + rotary key)
        self.cache_layout = self.shape.cache_layout
        self.fused: list = []  # the layers as `BlockLayer`s for server.compute.decode / server.compute.graphs
        # (`FamilySpec.fuse`)
        self.graphs: Optional[Union["SpanGraphs", "StaticSteps"]] = None  # set by `enable_cuda_graphs`
        self.kv_arena: Optional[KVArena] = None  # set by `enable_kv_arena`
        self.gemms: Optional[GemmGroup] = None  # the fused layers' small-batch products (`load`'s packed_rows)
        self.quant_type = "none"  # or int8 / nf4: the layers are `swarm.modeling.quantize.QuantizedLayer`s
        self.adapters: Dict[str, SpanAdapter] = {}  # LoRA adapters on this span's blocks, by name
        # with tensor parallelism, each block's shards' devices (`swarm.modeling.tensor_parallel`); else empty
        self.tp_devices: list = []
        # the layers' sliding window (all that have one share the config's), None if none has one
        self.sliding_window = next((w for w in (getattr(layer, "sliding_window", None) for layer in layers) if w),
                                   None)

    def enable_cuda_graphs(self) -> bool:
        """Replay decode steps of up to 16 sessions as CUDA graphs (`server.compute.graphs`: CUDA devices, families with
        fused layers; float or nf4 weights, adapters, left-padded rows, ALiBi and sliding windows); True if on.

        Not for families whose layers cannot be captured (`FamilySpec.graph_refusal`: Mixtral's routed experts, a
        host sync per block), nor for int8 spans: bitsandbytes' LLM.int8() picks outlier columns from each input (a
        host sync and data-dependent shapes), which capture refuses (docs/benchmarks-gpu.md has the error).
        """
        reason = self.cuda_graphs_refusal()
        if reason is not None:
            logger.info(f"no CUDA graphs: {reason}")
            return False
        from server.compute.graphs import SpanGraphs

        self.graphs = SpanGraphs(self.device, self.hidden_size, self.head_dim, rotary=self.rotary is not None)
        return True

    def cuda_graphs_refusal(self) -> Optional[str]:
        """Why this span's decode steps cannot replay CUDA graphs, or None if they can."""
        if self.device.type != "cuda":
            return f"the span is on {self.device.type}, not a CUDA device"
        if not self.can_batch:
            return f"the {self.family.model_type} family has no fused layers"
        if self.quant.graph_refusal:
            return self.quant.graph_refusal
        if self.cache_layout.values_in_keys:
            return ("the blocks cache a latent (multi-head latent attention): the graphs' static attention reads "
                    "keys and values of one head size")
        if self.family.graph_refusal:  # e.g. Mixtral's routing
            return self.family.graph_refusal
        if self.tp_devices:
            return "the blocks are split across devices (--tensor_parallel_devices): their steps run eagerly"
        return None

    def enable_kv_arena(self, capacity: int) -> bool:
        """Give one-row sessions of up to `capacity` positions slots of shared CPU storage (`server.compute.kv_arena`),
        whose decode batches attend with one call per layer; True if on. CPU spans of fused rotary layers only (ALiBi
        layers and sliding windows attend per session; CUDA has its graphs), and not int8 spans: the arena's
        grouped attention sums in another order than a session's own call, and LLM.int8() quantizes the next
        projection's input per row, so a last-bit difference there can move an activation a whole int8 step
        (measured: a 9-token prompt's greedy text left transformers' int8 model's at its 14th token)."""
        if self.device.type != "cpu" or not self.can_batch or self.rotary is None or self.alibi or \
                self.tp_devices or self.quant_type == "int8":
            return False
        layout = self.cache_layout
        self.kv_arena = KVArena(layout.kv_heads, layout.key_dim, capacity, self.dtype,
                                layout.value_dim if layout.values_in_keys else None)
        return True

    @classmethod
    def load(cls, checkpoint: Checkpoint, start: int, end: int, dtype_name: str = "auto",
             device: str = "cpu", quant_type: str = "none", adapters: Sequence[AdapterFiles] = (),
             packed_rows: Sequence[int] = (), tensor_parallel: Sequence[str] = ()) -> "BlockSpan":
        """Blocks [start, end) of `checkpoint`, read by `server.compute.loading.load_blocks` (quantized, split across
        `tensor_parallel` devices, with `adapters`' tensors and weights packed for `packed_rows`: its doc says how)."""
        loaded = load_blocks(checkpoint, start, end, dtype_name, device, quant_type, adapters, packed_rows,
                             tensor_parallel)
        span = cls(loaded.config, loaded.family, start, end, loaded.layers, loaded.rotary, loaded.dtype,
                   loaded.device)
        span.fused, span.tp_devices, span.gemms = loaded.fused, loaded.tp_devices, loaded.gemms
        span.quant_type = loaded.quant_type
        span.adapters.update(loaded.adapters)
        return span

    def span_layers(self, first: int, last: int):
        """The layers of blocks [first, last), in order (an iterator: a slice of the `ModuleList` would build a new
        module, ~30 us, at every session's opening and every single-session pass)."""
        return itertools.islice(self.layers, first - self.start, last - self.start)

    def windows(self, first: int, last: int) -> list:
        """The sliding window of each block in [first, last) (None: full attention)."""
        return [getattr(layer, "sliding_window", None) for layer in self.span_layers(first, last)]

    def new_session_kv(self, batch_size: int, max_length: int, first: int, last: int,
                       adapter: Optional[str] = None) -> SessionKV:
        """KV buffers for a session that runs blocks [first, last) of this span (ring buffers for windowed ones),
        with LoRA `adapter`."""
        if adapter is not None and adapter not in self.adapters:
            raise AdapterError(f"adapter {adapter!r} is not served here (this server has: "
                               f"{', '.join(sorted(self.adapters)) or 'none'})")
        if self.tp_devices:  # each block's shards' parts of the cache, on their devices
            n = len(self.tp_devices)
            devices, windows = cache_layout(self.tp_devices, self.windows(first, last))
            kv = SessionKV(len(windows), batch_size, self.kv_heads // n, self.head_dim, max_length, self.dtype,
                           self.device, layer_offset=(first - self.start) * n, windows=windows, devices=devices)
        else:
            layout = self.cache_layout
            kv = SessionKV(last - first, batch_size, layout.kv_heads, layout.key_dim, max_length, self.dtype,
                           self.device, layer_offset=first - self.start, windows=self.windows(first, last),
                           arena=self.kv_arena, values_in_keys=layout.value_dim if layout.values_in_keys else None)
        kv.adapter = adapter
        return kv

    def cache_tokens(self, max_length: int, first: int, last: int) -> int:
        """Cache tokens per row a session of `max_length` over blocks [first, last) reserves
        (`server.compute.cache`)."""
        return cache_tokens(self.windows(first, last), max_length)

    def cache_bytes_per_token(self) -> int:
        return len(self.layers) * self.shape.cache_bytes_per_token(self.dtype)

    @property
    def alibi(self) -> bool:
        """The layers' attention adds a position bias (`swarm.modeling.layers.key_bias`)."""
        return bool(self.fused) and key_bias(self.fused[0], 1, self.dtype, self.device) is not None

    @property
    def quant(self) -> QuantFormat:
        """The span's weight format, with its facts (`swarm.wire.quant`)."""
        return quant_format(self.quant_type)

    @property
    def groups_int8_rows(self) -> bool:
        """Whether this int8 span's steps quantize each session's rows as a call of their own inside a merged batch
        (`swarm.modeling.int8_rows`): every block a `QuantizedLayer` (each projection sees all rows of the step; a
        mixture of experts' expert sees routed subsets), not split across devices, on the CPU: bit-exactness was
        shown for bitsandbytes' CPU kernels, whose quantization `int8_rows` reproduces op for op; CUDA quantizes rows
        in a kernel of its own (`int8_vectorwise_quant`), unverified here, so a CUDA int8 span runs sessions alone."""
        from swarm.modeling.quantize import QuantizedLayer

        return self.quant_type == "int8" and self.device.type == "cpu" and bool(self.fused) and \
            not self.tp_devices and all(isinstance(layer, QuantizedLayer) for layer in self.fused)

    @property
    def sessions_alone(self) -> bool:
        """Whether each session's rows must go through the layers in calls of their own: int8 spans that cannot
        group rows per session (`groups_int8_rows`: MoE, BLOOM / Falcon / Gemma / DeepSeek-V3 / GPT-OSS layers,
        tensor parallelism, CUDA). LLM.int8() picks its outlier columns (kept in float; the rest quantized per row over
        the others) from all rows of a call, so rows of other sessions in the same projection change a session's
        numbers, and which sessions meet in a batch depends on timing. A session's decode step and prefill chunk
        then see exactly the rows that a local int8 model's call for that session sees (`forward_batch`,
        `can_batch_prefill`). The other int8 spans merge sessions with each session's rows quantized on their own:
        the same numbers, bit for bit."""
        return self.quant.sessions_alone is not None and not self.groups_int8_rows

    @property
    def can_batch(self) -> bool:
        """Decode steps run on the batched path of `server.compute.decode` (the family fuses its layers)."""
        return self.family.fuse is not None

    def can_batch_prefill(self, kv: SessionKV) -> bool:
        """Whether this session's multi-token steps may share a pass with other sessions' (`forward_prefill_batch`):
        fused rotary blocks (no ALiBi), one row, no padding, no adapter, not int8 (`sessions_alone`)."""
        return bool(self.fused) and self.rotary is not None and kv.batch_size == 1 and kv.padding is None \
            and kv.adapter is None and not self.alibi and not self.sessions_alone

    @torch.inference_mode()
    def forward_prefill_batch(self, items: list, first: int, last: int) -> list:
        """Several sessions' multi-token steps in one pass (`server.compute.decode.ragged_prefill_step`).

        items: [(hidden [1, seq_i, hidden], start_position_i, kv_i)] (`can_batch_prefill`), over blocks [first, last).
        Returns [1, seq_i, hidden] each, in order."""
        if len(items) == 1:
            hidden, start, kv = items[0]
            return [self.forward(hidden, start, kv, first, last)]
        assert self.rotary is not None, "can_batch_prefill: rotary blocks only"
        x = torch.cat([h.to(self.device, self.dtype).reshape(-1, self.hidden_size) for h, _, _ in items])
        sizes = [h.shape[1] for h, _, _ in items]
        position_ids = torch.cat([torch.arange(start, start + h.shape[1], device=self.device)
                                  for h, start, _ in items])[:, None]  # [rows, 1]
        lengths = torch.cat([self.rope_lengths(start, h.shape[1], kv, h.shape[1]) for h, start, kv in items]) \
            if self.by_length else None  # [rows, 1]: each session's step's
        cos, sin = (t[:, 0] for t in self.rotary(x, position_ids, lengths))  # [rows, head_dim]
        begun: list = []  # only these are taken back on a failure (the others' fill marks stay as they are)
        try:
            for _, start, kv in items:
                kv.begin_step(start)
                begun.append(kv)
            with row_groups(sizes) if self.quant_type == "int8" else contextlib.nullcontext():
                x = ragged_prefill_step(self.fused[first - self.start:last - self.start], x, cos, sin,
                                        [(start, seq, kv) for seq, (_, start, kv) in zip(sizes, items)],
                                        self.sliding_window)
        except BaseException:
            for kv in begun:
                kv.abort_step()
            raise
        for seq, (_, _, kv) in zip(sizes, items):
            kv.end_step(seq)
        return [part[None] for part in torch.split(x, sizes)]

    @torch.inference_mode()
    def forward_batch(self, items: list, first: int, last: int) -> list:
        """One lean pass (`server.compute.decode`) for the single-token decode steps of one or more sessions.

        items: [(hidden [b_i, 1, hidden], start_position_i, kv_i)], all over blocks [first, last). The norms,
        projections and MLP run once on all rows `[sum b_i, hidden]`; attention runs per session against its own
        cache. Returns the outputs `[b_i, 1, hidden]` in the same order. On an int8 span each session's rows are
        quantized on their own (`swarm.modeling.int8_rows`), or where the layers cannot (`sessions_alone`) each
        session's step runs alone: the same numbers whichever sessions' steps came together.
        """
        if self.sessions_alone and len(items) > 1:
            return [self._forward_batch([item], first, last)[0] for item in items]
        # each adapter's sessions next to each other (the base's first): one row group per adapter; within one, the
        # sessions of each arena chunk in slot order (they attend together: `server.compute.decode.arena_groups`)
        order = sorted(range(len(items)), key=lambda i: _batch_order(items[i][2]))
        if order != list(range(len(items))):
            outputs = self._forward_batch([items[i] for i in order], first, last)
            result = [outputs[0]] * len(items)
            for position, i in enumerate(order):
                result[i] = outputs[position]
            return result
        return self._forward_batch(items, first, last)

    def _forward_batch(self, items: list, first: int, last: int) -> list:
        x = torch.cat([h.to(self.device, self.dtype).reshape(-1, self.hidden_size) for h, _, _ in items])
        sizes = [h.shape[0] for h, _, _ in items]
        position_ids = torch.cat([kv.position_ids(pos, 1) for _, pos, kv in items])  # [rows, 1]
        cos = sin = None  # without rotary (ALiBi: the attention's bias carries the positions)
        if self.rotary is not None:
            lengths = torch.cat([self.rope_lengths(pos, 1, kv, h.shape[0]) for h, pos, kv in items]) \
                if self.by_length else None  # [rows, 1]: each session's step's
            cos, sin = (t[:, 0] for t in self.rotary(x, position_ids, lengths))  # [rows, head_dim]
        for _, pos, kv in items:
            kv.begin_step(pos)
        layers = self.fused[first - self.start:last - self.start]
        groups, row = [], 0
        for size, (_, _, kv) in zip(sizes, items):
            if kv.adapter is not None:
                groups.append((row, row + size, self.adapters[kv.adapter]))
            row += size
        if groups:
            layers = adapt_layers(layers, _merge_groups(groups), first)
        if self.gemms is not None and self.gemms.pending and x.shape[0] >= self.gemms.min_packed:
            self.gemms.pack_pending(PACK_BUDGET)  # a batch that packs would serve: pack a few more weights
        try:
            sessions = [(size, kv) for size, (_, _, kv) in zip(sizes, items)]
            graphed = None
            if self.graphs is not None and len(items) <= self.graphs.max_sessions:
                # one launch for the whole step instead of the eager path's hundreds of kernel launches
                graphed = self.graphs.run(layers, first, last, sessions, x, cos, sin, [pos for _, pos, _ in items])
            if graphed is not None:
                x = graphed
            else:
                with row_groups(sizes) if self.quant_type == "int8" else contextlib.nullcontext():
                    x = decode_step(layers, x, cos, sin, sessions)
        except BaseException:
            for _, _, kv in items:
                kv.abort_step()
            raise
        for _, _, kv in items:
            kv.end_step(1)
        return [part.unsqueeze(1) for part in torch.split(x, sizes, dim=0)]

    @torch.inference_mode()
    def forward(self, hidden: torch.Tensor, start_position: int = 0, kv: Optional[SessionKV] = None,
                first: Optional[int] = None, last: Optional[int] = None, adapter: Optional[str] = None,
                padding: Optional[torch.Tensor] = None, prompts: Optional[torch.Tensor] = None,
                rope_length: Optional[int] = None) -> torch.Tensor:
        """hidden: [batch, seq, hidden] for positions start_position.. ; runs blocks [first, last) of the model.
        With a LoRA adapter: `kv.adapter`, or `adapter` for a pass without a cache. `padding` [batch] (a pass
        without a cache): each row's leading padding keys are hidden, the positions left as they are
        (transformers' forward with an attention mask and no position ids). prompts: deep prompts
        [last - first, batch | 1, pre_seq_len, hidden] (`add_prompt`), or None. `rope_length`: where the step this
        pass is part of ends (`rope_lengths`; default: `kv.rope_length`, else this pass's end)."""
        if prompts is not None and start_position >= prompts.shape[2]:
            prompts = None  # past the prompts' positions
        first = self.start if first is None else first
        last = self.end if last is None else last
        adapter = kv.adapter if kv is not None else adapter
        if adapter is not None and adapter not in self.adapters:
            raise AdapterError(f"adapter {adapter!r} is not served here")
        hidden = hidden.to(self.device, self.dtype)
        batch, seq, _ = hidden.shape
        positions = torch.arange(start_position, start_position + seq, device=self.device)
        position_ids = positions.unsqueeze(0).expand(batch, -1)
        # queries at positions p..p+seq attend to keys 0..p+seq with key <= query (and within a sliding window):
        # [1, 1, seq, p+seq], or None where SDPA's own causal mask (or none, for one query) gives the same
        mask = causal_mask(start_position, seq, None, self.dtype, self.device)
        window_mask = causal_mask(start_position, seq, self.sliding_window, self.dtype, self.device)
        row_padding = kv.padding if kv is not None else padding
        if row_padding is not None:  # a left-padded batch: each row's padding keys hidden (ALiBi: its bias is
            # shift-invariant per query, so keys counted from 0 give what each row's own positions give)
            if kv is not None:
                position_ids = kv.position_ids(start_position, seq)  # positions count from each row's first token
            mask = padded_key_mask(row_padding.to(self.device), start_position, seq, self.dtype, self.device)
            # [batch, 1, seq, p+seq]; the window's cut too where one applies
            window_mask = mask if window_mask is None else torch.minimum(mask, window_mask)
        position_embeddings = None
        if self.rotary is not None:
            lengths = rope_lengths(position_ids, self._beyond(start_position, seq, kv, rope_length)) \
                if self.by_length else None  # [batch, 1]
            position_embeddings = self.rotary(hidden, position_ids, lengths)
        if kv is not None:
            kv.begin_step(start_position)
        try:
            if kv is not None and self.fused:
                # an inference step: the fused layers (the layer modules serve passes without a cache)
                cos, sin = position_embeddings if position_embeddings is not None else (None, None)  # [batch, seq, dim]
                layers = self.fused[first - self.start:last - self.start]
                if adapter is not None:  # one group: all rows [batch * seq] use the session's adapter
                    layers = adapt_layers(layers, [(0, batch * seq, self.adapters[adapter])], first)
                if prompts is None:
                    hidden = prefill_step(layers, hidden, cos, sin, kv, mask, window_mask)
                else:  # one block at a time, each input with its prompt
                    for layer, prompt in zip(layers, prompts):
                        hidden = prefill_step([layer], add_prompt(hidden, prompt, start_position), cos, sin, kv, mask,
                                              window_mask)
            elif adapter is not None:
                # a pass without a cache on the fused layers, which the adapter wraps
                cos, sin = position_embeddings if position_embeddings is not None else (None, None)  # (ALiBi)
                layers = adapt_layers(self.fused[first - self.start:last - self.start],
                                      [(0, batch * seq, self.adapters[adapter])], first)
                attend = cache_attention(None, mask, window_mask)
                with attention_backends(self.device):
                    for layer in layers:
                        hidden = layer.step(hidden, cos, sin, attend)
            else:
                with attention_backends(self.device):
                    hidden = self._layers(hidden, (mask, window_mask), position_ids, position_embeddings, kv, first,
                                          last, prompts, start_position)
        except BaseException:
            if kv is not None:
                kv.abort_step()
            raise
        if kv is not None:
            kv.end_step(seq)
        return hidden

    def rope_lengths(self, start: int, seq: int, kv: SessionKV, rows: int = 1) -> torch.Tensor:
        """[rows, 1]: the length by which a session's pass over positions start..start+seq picks its rotary factors
        (`swarm.modeling.layers.rope_lengths`; LongRoPE's): that of the step it is part of, which ends at
        `kv.rope_length` (the handler sets it per step: `Step.rope_length`), or at this pass's end."""
        position_ids = kv.position_ids(start, seq)  # [batch, seq]
        return rope_lengths(position_ids, self._beyond(start, seq, kv))[:1].expand(rows, 1)

    @property
    def by_length(self) -> bool:
        """Whether the rotary picks its factors by the sequence's length (`swarm.modeling.layers.picks_by_length`)."""
        return bool(getattr(self.rotary, "by_length", False))

    @staticmethod
    def _beyond(start: int, seq: int, kv: Optional[SessionKV], rope_length: Optional[int] = None) -> int:
        """How many positions the step runs past a pass over start..start+seq (`rope_length`, else the session's)."""
        end = rope_length if rope_length is not None else kv.rope_length if kv is not None else None
        return 0 if end is None else max(0, end - start - seq)

    def _layers(self, hidden, masks, position_ids, position_embeddings, kv, first: int, last: int,
                prompts: Optional[torch.Tensor] = None, start_position: int = 0) -> torch.Tensor:
        mask, window_mask = masks  # full causal, and with the sliding window (for the layers that have one)
        for i, layer in enumerate(self.span_layers(first, last)):
            if prompts is not None:
                hidden = add_prompt(hidden, prompts[i], start_position)
            layer_mask = window_mask if getattr(layer, "sliding_window", None) else mask
            out = layer(hidden, attention_mask=layer_mask, position_ids=position_ids, past_key_values=kv,
                        use_cache=kv is not None, position_embeddings=position_embeddings)
            hidden = out[0] if isinstance(out, tuple) else out
        return hidden


def _batch_order(kv: SessionKV) -> tuple:
    """Each adapter's sessions together; arena sessions by chunk and slot, others by age (one order for one set of
    sessions, whatever order their steps came in: a CUDA graph is captured per ordered set)."""
    return (kv.adapter or "", 0, kv.serial) if kv.slot is None else (kv.adapter or "", id(kv.slot.chunk), kv.slot.index)


def _merge_groups(groups: list) -> list:
    """[(r0, r1, adapter)] in row order -> the same with neighbours of one adapter merged into one group."""
    merged = [groups[0]]
    for r0, r1, adapter in groups[1:]:
        p0, p1, previous = merged[-1]
        if previous is adapter and p1 == r0:
            merged[-1] = (p0, r1, adapter)
        else:
            merged.append((r0, r1, adapter))
    return merged
