"""The server's KV memory: one token budget per server, one preallocated cache per inference session.

A session reserves `batch_size * max_length` cache tokens when it opens (waiting up to a time-out when the
budget is full, else `OutOfCacheError`) and releases them when it closes. Its `SessionKV` holds, per block,
key/value buffers `[batch, kv_heads, max_length, head_dim]` allocated once: a step writes its new positions in
place and attention reads a view of the filled prefix, so no step reallocates. Rewinding (a client resending
from an earlier position) only moves the fill mark.
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
        self.adapter: Optional[str] = None  # the session's LoRA adapter (`BlockSpan.adapters`), None: the base
        self._step_start = 0

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
