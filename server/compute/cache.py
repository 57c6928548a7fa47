"""The server's KV memory: one token budget per server, one preallocated cache per inference session.
On the CPU, one-row sessions' buffers are views of slots in shared tensors (`server.compute.kv_arena`), so that decode
batches attend together; nothing here depends on where the buffers live.

A session reserves `batch_size * max_length` cache tokens when it opens (waiting up to a time-out when the
budget is full, else `OutOfCacheError`) and releases them when it closes. Its `SessionKV` holds, per block,
key/value buffers `[batch, kv_heads, max_length, head_dim]` allocated once: a step writes its new positions in
place and attention reads a view of the filled prefix, so no step reallocates. Rewinding (a client resending
from an earlier position) only moves the fill mark.

What a block caches per token is the span's `CacheLayout` (`swarm.modeling.shape`): kv_heads keys and values of
head_dim, or for DeepSeek-V3's latent attention one key "head" of [latent, rotary key] whose first channels are the
values (`values_in_keys`: the value buffers are views of the key buffers, nothing is stored twice).

Blocks with a sliding window W (Mistral, Mixtral, Qwen2's windowed layers) keep at most `ring_capacity(W)` =
2 W positions (when that is less than max_length): a ring buffer, position p in slot p % capacity, so a session
longer than that holds what its window still needs plus one window of slack for rewinds, and reserves that much
(`cache_tokens`). A multi-token step gets its keys in position order (`update`: the cached part gathered, the new
keys appended); a single-token step may attend over the ring as it lies with a mask of the slots in its window
(`decode_update`). A rewind farther back than the ring still holds is refused (`can_start_at`).

Beam search reorders the rows of the filled prefix in place
(`reorder`, by the beams' parent ids). A left-padded batch keeps each row's count of leading padding positions
(`padding`): those keys are never attended (`key_mask`), and each row's positions count from its first real
token (`position_ids`), as transformers computes `position_ids` from an attention mask.
"""
from __future__ import annotations

import asyncio
import itertools
import math
from typing import TYPE_CHECKING, Callable, Dict, List, Optional, Sequence, Tuple

import torch

if TYPE_CHECKING:
    from server.compute.kv_arena import ArenaSlot, KVArena


def ring_capacity(window: Optional[int], max_length: int) -> int:
    """Positions a block with sliding window `window` keeps for a session of `max_length` (all of them without)."""
    return max_length if window is None else min(max_length, 2 * window)


def cache_tokens(windows: Sequence[Optional[int]], max_length: int) -> int:
    """Cache tokens (each a position in every block of the span) a session of `max_length` reserves per row."""
    if not windows:
        return max_length
    return math.ceil(sum(ring_capacity(w, max_length) for w in windows) / len(windows))


class OutOfCacheError(RuntimeError):
    pass


_SERIALS = itertools.count()


class SessionKV:
    """Per-session KV buffers for the blocks of a span; duck-types the `Cache.update` that HF attention calls."""

    def __init__(self, num_layers: int, batch_size: int, kv_heads: int, head_dim: int, max_length: int,
                 dtype: torch.dtype, device: torch.device, layer_offset: int = 0,
                 windows: Optional[Sequence[Optional[int]]] = None, arena: Optional["KVArena"] = None,
                 devices: Optional[Sequence[torch.device]] = None, values_in_keys: Optional[int] = None):
        """windows: each block's sliding window (None: full attention); those blocks keep a ring buffer.
        values_in_keys: the values are the keys' first `values_in_keys` channels, views of the key buffers
        (`swarm.modeling.shape.CacheLayout`: DeepSeek's latent attention caches its latent and rotary key as one
        key head of `head_dim` channels and attends with the latent as the value), else buffers of their own.
        arena: shared storage (`server.compute.kv_arena`) this session's buffers come from if it fits there (one row, no
        sliding window, on the arena's device); `slot` says where, None otherwise. devices: each layer's device
        (a tensor-parallel span's shards: `swarm.modeling.tensor_parallel.cache_layout`), else all on `device`."""
        self.windows: List[Optional[int]] = list(windows) if windows is not None else [None] * num_layers
        assert len(self.windows) == num_layers
        self.keys: List[torch.Tensor] = []
        self.values: List[torch.Tensor] = []
        self.slot: Optional["ArenaSlot"] = None
        self.values_in_keys = values_in_keys
        if arena is not None and arena.fits(batch_size, max_length) and device.type == "cpu" and \
                all(window is None for window in self.windows) and arena.values_in_keys == values_in_keys:
            assigned = arena.assign(self, layer_offset, layer_offset + num_layers, max_length)
            if assigned is not None:
                self.slot, self.keys, self.values = assigned
        for index, window in enumerate(self.windows if self.slot is None else ()):
            shape = (batch_size, kv_heads, ring_capacity(window, max_length), head_dim)
            layer_device = device if devices is None else devices[index]
            self.keys.append(torch.empty(shape, dtype=dtype, device=layer_device))
            if values_in_keys is not None:
                self.values.append(self.keys[-1][..., :values_in_keys])
            else:
                self.values.append(torch.empty(shape, dtype=dtype, device=layer_device))
        self.batch_size, self.max_length = batch_size, max_length
        self.layer_offset = layer_offset  # layer_idx of the first block this session uses
        self.length = 0  # positions filled (valid for all layers after a complete step)
        self.adapter: Optional[str] = None  # the session's LoRA adapter (`BlockSpan.adapters`), None: the base
        self._step_start = 0
        self._lost = 0  # positions before this are overwritten in some ring buffer
        self.padding: Optional[torch.Tensor] = None  # [batch] long: leading padding positions per row, or none
        self.padding_version = 0  # counts changes of `padding` (a CUDA graph reads the tensor it was captured with)
        # where the client's step that the next calls are parts of ends (`Step.rope_length`): LongRoPE picks its
        # factors by it (`BlockSpan.rope_lengths`); None: each call by its own end
        self.rope_length: Optional[int] = None
        self.serial = next(_SERIALS)  # unique for the process's life (unlike id()): orders batches, keys graphs
        # a fill of positions this session already holds, still to be written into its buffers (a prefix adoption's
        # copy: `server.compute.prefix_cache.PrefixCache.adopt_later`), called with this cache by `ready`, which
        # every step (`begin_step`) and reorder does first, on the compute thread
        self.pending: Optional[Callable[["SessionKV"], None]] = None

    def ready(self) -> None:
        """Do the pending fill of the buffers, once (nothing if there is none). If it fails, the session holds nothing
        (length 0: its client's next step is refused as past what it holds, and goes elsewhere)."""
        fill, self.pending = self.pending, None
        if fill is not None:
            try:
                fill(self)
            except BaseException:
                self.length = self._step_start = 0
                raise

    def can_start_at(self, start_position: int) -> bool:
        """Whether a step may start at `start_position` (<= length): every ring still holds the positions its
        window needs before it (a step at position 0 needs none)."""
        return start_position == 0 or all(window is None or max(0, start_position - window + 1) >= self._lost
                                          for window in self.windows)

    @property
    def step_start(self) -> int:
        """The position of the running step's first token (`begin_step`)."""
        return self._step_start

    # ---- rows: padding and beam reordering ------------------------------------------------------------------
    def set_padding(self, padding: Optional[List[int]]) -> None:
        """Each row's leading padding positions (set by a step at position 0); None or all zeros: no padding."""
        if padding is None or not any(padding):
            self.padding = None
        else:
            self.padding = torch.tensor(padding, dtype=torch.long, device=self.keys[0].device)
        self.padding_version += 1

    @torch.inference_mode()
    def reorder(self, hypo_ids: torch.Tensor, length: int) -> None:
        """Row i of positions [0, length) becomes what row hypo_ids[i] held, in every layer (beam search)."""
        if self.pending is not None:  # (a deferred adoption: `ready`)
            self.ready()
        hypo_ids = hypo_ids.to(self.keys[0].device)
        # (a tensor-parallel span's buffers may lie on several devices; values inside the keys move with them)
        for buf in self.keys + ([] if self.values_in_keys is not None else self.values):
            buf[:, :, :length].copy_(buf[:, :, :length].index_select(0, hypo_ids.to(buf.device)))
        if self.padding is not None:
            self.padding = self.padding.index_select(0, hypo_ids)
            self.padding_version += 1

    def position_ids(self, start: int, seq: int) -> torch.Tensor:
        """[batch, seq] rotary positions of the absolute positions start..start+seq (`padded_positions`)."""
        return padded_positions(self.padding, start, seq, self.batch_size, self.keys[0].device)

    def key_mask(self, start: int, seq: int, dtype: torch.dtype) -> torch.Tensor:
        """[batch, 1, seq, start + seq] additive mask of this step's queries (`padded_key_mask`)."""
        return padded_key_mask(self.padding, start, seq, dtype, self.keys[0].device)

    # ---- steps ----------------------------------------------------------------------------------------------
    def begin_step(self, start_position: int) -> None:
        """Start writing at `start_position` (<= length); positions after it are discarded."""
        if self.pending is not None:  # (a deferred adoption: `ready`)
            self.ready()
        assert 0 <= start_position <= self.length
        if not self.can_start_at(start_position):
            raise ValueError(f"cannot go back to position {start_position}: the sliding-window cache keeps only "
                             f"positions from {self._lost} on")
        self.length = start_position
        self._step_start = start_position
        if start_position == 0:
            self._lost = 0  # everything is written again

    def end_step(self, num_new: int) -> None:
        self.length = self._step_start + num_new
        self._overwritten(self.length)

    def abort_step(self) -> None:
        self._overwritten(self._step_start + 1)  # a failed single-token step may have written its position
        self.length = self._step_start

    def _overwritten(self, end: int) -> None:
        """Positions up to `end` were written: the rings have dropped those a capacity before."""
        for k_buf, window in zip(self.keys, self.windows):
            if window is not None:
                self._lost = max(self._lost, end - k_buf.shape[2])

    # the interface HF attention layers use: returns all keys/values up to the new tokens
    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args, **kwargs
               ) -> Tuple[torch.Tensor, torch.Tensor]:
        """key_states, value_states: [batch, kv_heads, new, head_dim] at the step's positions. Returns the keys
        and values of positions [0, end) in order, or for a ring buffer that has wrapped those of
        [start - window + 1, end): the last columns of the step's mask (`swarm.modeling.layers.causal_mask`)."""
        start = self._step_start
        end = start + key_states.shape[-2]
        index = layer_idx - self.layer_offset
        k_buf, v_buf = self.keys[index], self.values[index]
        capacity = k_buf.shape[2]
        if end <= capacity:
            k_buf[:, :, start:end].copy_(key_states)
            v_buf[:, :, start:end].copy_(value_states)
            return k_buf[:, :, :end], v_buf[:, :, :end]
        window = self.windows[index]
        assert window is not None  # full-attention buffers hold max_length positions
        self._overwritten(end)
        # the cached positions the first new query sees, gathered before the new keys may overwrite their slots
        old = torch.arange(max(0, start - window + 1), start, device=k_buf.device) % capacity
        keys = torch.cat([k_buf.index_select(2, old), key_states], dim=2)
        values = torch.cat([v_buf.index_select(2, old), value_states], dim=2)
        kept = min(end - start, capacity)  # the new positions the ring keeps: the last `capacity`
        slots = torch.arange(end - kept, end, device=k_buf.device) % capacity
        k_buf.index_copy_(2, slots, key_states[:, :, -kept:])
        v_buf.index_copy_(2, slots, value_states[:, :, -kept:])
        return keys, values

    def decode_update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int
                      ) -> Tuple[torch.Tensor, torch.Tensor, Optional[torch.Tensor]]:
        """A single-token step's update without reordering: key_states, value_states [batch, kv_heads, 1,
        head_dim]. Returns the keys and values the query attends over and a bool mask [capacity] of the slots it
        sees, or None when it sees all returned keys (the filled prefix, or its window's end of it)."""
        index = layer_idx - self.layer_offset
        k_buf, window, end = self.keys[index], self.windows[index], self._step_start + 1
        if end <= k_buf.shape[2]:
            keys, values = self.update(key_states, value_states, layer_idx)
            if window is not None and end > window:
                keys, values = keys[:, :, -window:], values[:, :, -window:]
            return keys, values, None
        assert window is not None
        position, capacity = end - 1, k_buf.shape[2]
        self.keys[index][:, :, position % capacity].copy_(key_states[:, :, 0])
        self.values[index][:, :, position % capacity].copy_(value_states[:, :, 0])
        self._overwritten(end)
        return self.keys[index], self.values[index], ring_window_mask(position, window, capacity, k_buf.device)

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.length


def ring_held(position, capacity: int, device: torch.device) -> torch.Tensor:
    """Long [capacity]: the position each slot of a ring holds when a query at `position` (an int, or a long tensor
    [1]) writes: the latest position <= `position` that is the slot modulo capacity (negative: never written yet)."""
    slots = torch.arange(capacity, device=device)
    return position - (position - slots) % capacity


def ring_window_mask(position, window: int, capacity: int, device: torch.device) -> torch.Tensor:
    """Bool [capacity]: the ring's slots whose positions a query at `position` (an int, or a long tensor [1]) sees."""
    held = ring_held(position, capacity, device)
    return (held > position - window) & (held >= 0)


class CacheBudget:
    """Counts reserved cache tokens against a fixed budget; reservations wait for room up to a time-out."""

    def __init__(self, max_tokens: int):
        self.max_tokens = max_tokens
        self.used_tokens = 0
        self._sessions: Dict[str, int] = {}
        self._changed: Optional[asyncio.Condition] = None
        # tokens held outside sessions (`take`/`give`: the prefix cache's pages, `server.compute.prefix_cache`),
        # and how to free some of them (returns the tokens freed) before a session waits or is refused
        self.reclaim: Optional[Callable[[int], int]] = None
        self.waiting = 0  # reservations waiting for room now

    @property
    def free_tokens(self) -> int:
        return self.max_tokens - self.used_tokens

    @property
    def num_sessions(self) -> int:
        return len(self._sessions)

    def _condition(self) -> asyncio.Condition:
        if self._changed is None:
            self._changed = asyncio.Condition()
        return self._changed

    async def reserve(self, handle: str, tokens: int, timeout: float) -> None:
        if tokens > self.max_tokens:
            raise OutOfCacheError(
                f"session needs {tokens} cache tokens but this server's whole budget is {self.max_tokens}"
            )
        if handle in self._sessions:
            raise ValueError(f"session {handle!r} is already open on this server")
        cond = self._condition()
        async with cond:
            if self.free_tokens < tokens and self.reclaim is not None:
                self.reclaim(tokens - self.free_tokens)  # kept prefix pages go before a session waits
            if self.free_tokens < tokens:  # (asyncio.wait_for with a time-out of 0 fails even what is ready)
                self.waiting += 1
                try:
                    await asyncio.wait_for(cond.wait_for(lambda: self.free_tokens >= tokens), timeout=timeout)
                except asyncio.TimeoutError:
                    raise OutOfCacheError(
                        f"out of cache: session needs {tokens} tokens, {self.free_tokens} of {self.max_tokens} free "
                        f"after waiting {timeout:.1f}s"
                    ) from None
                finally:
                    self.waiting -= 1
            self.used_tokens += tokens
            self._sessions[handle] = tokens

    def take(self, tokens: int) -> bool:
        """Hold `tokens` outside any session if they are free now (never waits); False otherwise."""
        if tokens > self.free_tokens:
            return False
        self.used_tokens += tokens
        return True

    def give(self, tokens: int) -> None:
        """Give back tokens held with `take` (a session waiting for room is woken by the next `release` or
        `reserve`; `reclaim` runs where it waits)."""
        self.used_tokens -= tokens

    async def release(self, handle: str) -> None:
        cond = self._condition()
        async with cond:
            self.used_tokens -= self._sessions.pop(handle, 0)
            cond.notify_all()


def padded_positions(padding: Optional[torch.Tensor], start: int, seq: int, batch: int, device: torch.device
                     ) -> torch.Tensor:
    """[batch, seq] rotary positions of the absolute positions start..start+seq, shifted by each row's padding
    [batch] (padding positions get 0, as transformers' `cumsum(mask) - 1` masked with 0)."""
    positions = torch.arange(start, start + seq, device=device)
    if padding is None:
        return positions.unsqueeze(0).expand(batch, -1)
    return (positions.unsqueeze(0) - padding.unsqueeze(1)).clamp_(min=0)


def padded_key_mask(padding: Optional[torch.Tensor], start: int, seq: int, dtype: torch.dtype,
                    device: torch.device) -> torch.Tensor:
    """The additive mask [batch or 1, 1, seq, start + seq] of queries start.. over keys 0..: causal, each row's
    leading `padding` keys hidden (a padding position sees itself only, so that no row of the softmax is empty)."""
    queries = torch.arange(start, start + seq, device=device)
    keys = torch.arange(start + seq, device=device)
    allowed = (keys.unsqueeze(0) <= queries.unsqueeze(1)).unsqueeze(0)  # [1, seq, keys]
    if padding is not None:
        real = keys.unsqueeze(0) >= padding.unsqueeze(1)  # [batch, keys]
        allowed = allowed & (real.unsqueeze(1) | (keys.unsqueeze(0) == queries.unsqueeze(1)).unsqueeze(0))
    mask = torch.zeros(allowed.shape, dtype=dtype, device=device)
    return mask.masked_fill_(~allowed, torch.finfo(dtype).min).unsqueeze(1)
