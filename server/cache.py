"""The server's KV memory: one token budget per server, one preallocated cache per inference session.

A session reserves `batch_size * max_length` cache tokens when it opens (waiting up to a time-out when the
budget is full, else `OutOfCacheError`) and releases them when it closes. Its `SessionKV` holds, per block,
key/value buffers `[batch, kv_heads, max_length, head_dim]` allocated once: a step writes its new positions in
place and attention reads a view of the filled prefix, so no step reallocates. Rewinding (a client resending
from an earlier position) only moves the fill mark. Beam search reorders the rows of the filled prefix in place
(`reorder`, by the beams' parent ids). A left-padded batch keeps each row's count of leading padding positions
(`padding`): those keys are never attended (`key_mask`), and each row's positions count from its first real
token (`position_ids`), as transformers computes `position_ids` from an attention mask.
"""
from __future__ import annotations

import asyncio
from typing import Dict, List, Optional, Tuple

import torch


class OutOfCacheError(RuntimeError):
    pass


class SessionKV:
    """Per-session KV buffers for the blocks of a span; duck-types the `Cache.update` that HF attention calls."""

    def __init__(self, num_layers: int, batch_size: int, kv_heads: int, head_dim: int, max_length: int,
                 dtype: torch.dtype, device: torch.device, layer_offset: int = 0):
        shape = (batch_size, kv_heads, max_length, head_dim)
        self.keys: List[torch.Tensor] = [torch.empty(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.values: List[torch.Tensor] = [torch.empty(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.batch_size, self.max_length = batch_size, max_length
        self.layer_offset = layer_offset  # layer_idx of the first block this session uses
        self.length = 0  # positions filled (valid for all layers after a complete step)
        self._step_start = 0
        self.padding: Optional[torch.Tensor] = None  # [batch] long: leading padding positions per row, or none

    # ---- rows: padding and beam reordering ------------------------------------------------------------------
    def set_padding(self, padding: Optional[List[int]]) -> None:
        """Each row's leading padding positions (set by a step at position 0); None or all zeros: no padding."""
        if padding is None or not any(padding):
            self.padding = None
        else:
            self.padding = torch.tensor(padding, dtype=torch.long, device=self.keys[0].device)

    @torch.inference_mode()
    def reorder(self, hypo_ids: torch.Tensor, length: int) -> None:
        """Row i of positions [0, length) becomes what row hypo_ids[i] held, in every layer (beam search)."""
        hypo_ids = hypo_ids.to(self.keys[0].device)
        for buf in self.keys + self.values:
            buf[:, :, :length].copy_(buf[:, :, :length].index_select(0, hypo_ids))
        if self.padding is not None:
            self.padding = self.padding.index_select(0, hypo_ids)

    def position_ids(self, start: int, seq: int) -> torch.Tensor:
        """[batch, seq] rotary positions of the absolute positions start..start+seq (`padded_positions`)."""
        return padded_positions(self.padding, start, seq, self.batch_size, self.keys[0].device)

    def key_mask(self, start: int, seq: int, dtype: torch.dtype) -> torch.Tensor:
        """[batch, 1, seq, start + seq] additive mask of this step's queries (`padded_key_mask`)."""
        return padded_key_mask(self.padding, start, seq, dtype, self.keys[0].device)

    # ---- steps ----------------------------------------------------------------------------------------------
    def begin_step(self, start_position: int) -> None:
        """Start writing at `start_position` (<= length); positions after it are discarded."""
        assert 0 <= start_position <= self.length
        self.length = start_position
        self._step_start = start_position

    def end_step(self, num_new: int) -> None:
        self.length = self._step_start + num_new

    def abort_step(self) -> None:
        self.length = self._step_start

    # the interface HF attention layers use: returns all keys/values up to the new tokens
    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args, **kwargs
               ) -> Tuple[torch.Tensor, torch.Tensor]:
        start = self._step_start
        end = start + key_states.shape[-2]
        k_buf, v_buf = self.keys[layer_idx - self.layer_offset], self.values[layer_idx - self.layer_offset]
        k_buf[:, :, start:end].copy_(key_states)
        v_buf[:, :, start:end].copy_(value_states)
        return k_buf[:, :, :end], v_buf[:, :, :end]

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.length


class CacheBudget:
    """Counts reserved cache tokens against a fixed budget; reservations wait for room up to a time-out."""

    def __init__(self, max_tokens: int):
        self.max_tokens = max_tokens
        self.used_tokens = 0
        self._sessions: Dict[str, int] = {}
        self._changed: Optional[asyncio.Condition] = None

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
            try:
                await asyncio.wait_for(cond.wait_for(lambda: self.free_tokens >= tokens), timeout=timeout)
            except asyncio.TimeoutError:
                raise OutOfCacheError(
                    f"out of cache: session needs {tokens} tokens, {self.free_tokens} of {self.max_tokens} free "
                    f"after waiting {timeout:.1f}s"
                ) from None
            self.used_tokens += tokens
            self._sessions[handle] = tokens

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
