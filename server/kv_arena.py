"""Shared KV storage on the CPU: one-row sessions' caches as slots of a few large tensors, so that a decode batch
attends with one SDPA call per layer instead of one per session (`server.decode.sessions_attention`).

A decode step's attention per session is tiny (one query over a few hundred keys) and costs mostly the dispatch
of its dozen small ops: about 50 us a session and block on two cores, a third of a SmolLM2 span's batch-8 pass.
Sessions whose caches lie in one tensor `[slots, kv_heads, capacity, head_dim]` attend together: their new
keys/values are written with one indexed copy, and one SDPA call runs over the slot range `[lo, hi)` and the
longest member's length, with a mask for each row's own length (`ChunkPlan`).

`KVArena` hands out slots of `Chunk`s (`SLOTS` each, one chunk layout per layer range [first, last) of the span),
of `capacity` positions each (the server's `--max_length`). A `SessionKV` on a slot (`ArenaSlot`) gets views of
its slot as its buffers, narrowed to its own max_length, so every other path (prefill, rewinds) is unchanged.

Memory: a chunk is an anonymous mapping (zero-filled; untouched pages are not resident, and it asks for no huge
pages): a slot costs only the positions its sessions wrote, as separate buffers did. The batched attention reads
every member's slot up to the longest member's length, past a shorter member's own positions (masked out, but
multiplied by zero weights): those must hold finite numbers, so a slot is zeroed over its session's max_length
when the session's `SessionKV` is collected (a `weakref.finalize`: no slot is reused while any step still holds
the old one), and a chunk is freed when its last slot is released.
"""
from __future__ import annotations

import math
import mmap
import threading
import weakref
from dataclasses import dataclass
from typing import Dict, List, Optional, Tuple

import torch

SLOTS = 16  # sessions per chunk: one SDPA call per chunk and layer


class Chunk:
    """Per layer of one layer range, keys and values `[SLOTS, kv_heads, capacity, head_dim]` (zero-filled)."""

    def __init__(self, num_layers: int, kv_heads: int, capacity: int, head_dim: int, dtype: torch.dtype):
        shape = (SLOTS, kv_heads, capacity, head_dim)
        self.keys = [_zeros(shape, dtype) for _ in range(num_layers)]
        self.values = [_zeros(shape, dtype) for _ in range(num_layers)]
        self.free = list(range(SLOTS - 1, -1, -1))  # pop() takes the lowest: members stay near the range's start

    @property
    def empty(self) -> bool:
        return len(self.free) == SLOTS


def _zeros(shape: Tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A zero tensor whose pages stay unallocated until written (an anonymous mapping), unlike `torch.zeros`, which
    fills it. Without huge pages: a slot's key head spans `capacity * head_dim` elements (2 MiB for 8192 positions of
    64 float32), so a huge page would make a session's first key hold that much at once, and the kernel would zero
    (and maybe compact memory for) 2 MiB at each first write."""
    itemsize = torch.empty((), dtype=dtype).element_size()
    raw = mmap.mmap(-1, max(math.prod(shape) * itemsize, 1))
    if hasattr(mmap, "MADV_NOHUGEPAGE"):
        raw.madvise(mmap.MADV_NOHUGEPAGE)
    return torch.frombuffer(raw, dtype=torch.uint8).view(dtype).view(shape)  # the tensor keeps the mapping alive


@dataclass(frozen=True)
class ArenaSlot:
    """A session's place in a chunk: `index` in `chunk`, whose layer `i` holds the session's block first + i."""

    chunk: Chunk
    index: int


class KVArena:
    """Slots for one-row sessions of up to `capacity` positions over a span's blocks (`BlockSpan.enable_kv_arena`)."""

    def __init__(self, kv_heads: int, head_dim: int, capacity: int, dtype: torch.dtype):
        self.kv_heads, self.head_dim, self.capacity, self.dtype = kv_heads, head_dim, capacity, dtype
        self._chunks: Dict[Tuple[int, int], List[Chunk]] = {}  # (first, last) -> chunks with these layers
        self._lock = threading.Lock()  # releases come from whichever thread drops a session's last reference

    def fits(self, batch_size: int, max_length: int) -> bool:
        return batch_size == 1 and max_length <= self.capacity

    def assign(self, owner: object, first: int, last: int, max_length: int) -> Optional[Tuple[ArenaSlot, list, list]]:
        """A free slot for `owner` (a `SessionKV`) over blocks [first, last) and its per-layer buffers [1, kv_heads,
        max_length, head_dim] (keys, values); None if no chunk can be allocated (the caller then allocates its own).
        The slot is released when `owner` is collected."""
        with self._lock:
            chunks = self._chunks.setdefault((first, last), [])
            chunk = next((c for c in chunks if c.free), None)
            if chunk is None:
                try:
                    chunk = Chunk(last - first, self.kv_heads, self.capacity, self.head_dim, self.dtype)
                except (MemoryError, RuntimeError, OSError):  # (mmap: ENOMEM under strict overcommit)
                    return None
                chunks.append(chunk)
            slot = ArenaSlot(chunk, chunk.free.pop())
        weakref.finalize(owner, self._release, (first, last), slot, max_length)
        keys = [k[slot.index:slot.index + 1, :, :max_length] for k in slot.chunk.keys]
        values = [v[slot.index:slot.index + 1, :, :max_length] for v in slot.chunk.values]
        return slot, keys, values

    def _release(self, layers: Tuple[int, int], slot: ArenaSlot, max_length: int) -> None:
        with torch.inference_mode():
            for buf in slot.chunk.keys + slot.chunk.values:  # every position the session may have written
                buf[slot.index, :, :max_length].zero_()
        with self._lock:
            slot.chunk.free.append(slot.index)
            slot.chunk.free.sort(reverse=True)
            chunks = self._chunks.get(layers, [])
            if slot.chunk.empty and slot.chunk in chunks:
                chunks.remove(slot.chunk)  # its memory goes back once no view of it is left

    def chunks(self) -> int:
        """Chunks allocated now."""
        with self._lock:
            return sum(len(c) for c in self._chunks.values())
