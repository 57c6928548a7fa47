"""Shared KV storage on the CPU: one-row sessions' caches as slots of a few large tensors, so that a decode batch
attends with one SDPA call per layer instead of one per session (`server.compute.decode.sessions_attention`).

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
multiplied by zero weights): those must hold finite numbers, so a released slot is cleared (`Chunk.clear`: its
pages go back to the kernel and read as zeros) before it is handed out again, and a chunk is unmapped when its
last slot is released. A slot is released only once its session's `SessionKV` is collected (no step can still
hold its views).
"""
from __future__ import annotations

import collections
import math
import mmap
import threading
import weakref
from dataclasses import dataclass
from typing import Deque, Dict, List, Optional, Tuple

import torch

SLOTS = 16  # sessions per chunk: one SDPA call per chunk and layer


class Chunk:
    """Per layer of one layer range, keys and values `[SLOTS, kv_heads, capacity, head_dim]` (zero-filled), each an
    anonymous mapping of its own (`_zeros`)."""

    def __init__(self, num_layers: int, kv_heads: int, capacity: int, head_dim: int, dtype: torch.dtype,
                 values_in_keys: Optional[int] = None):
        shape = (SLOTS, kv_heads, capacity, head_dim)
        self.maps: List[mmap.mmap] = []  # the mappings behind keys, then values (if they have their own)
        self.keys = [self._zeros(shape, dtype) for _ in range(num_layers)]
        if values_in_keys is not None:  # the keys' first channels (`server.compute.cache.SessionKV`'s values_in_keys)
            self.values = [k[..., :values_in_keys] for k in self.keys]
        else:
            self.values = [self._zeros(shape, dtype) for _ in range(num_layers)]
        self.free = list(range(SLOTS - 1, -1, -1))  # pop() takes the lowest: members stay near the range's start

    @property
    def empty(self) -> bool:
        return len(self.free) == SLOTS

    def _zeros(self, shape: Tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """A zero tensor whose pages stay unallocated until written (an anonymous mapping), unlike `torch.zeros`,
        which fills it. Without huge pages: a slot's key head spans `capacity * head_dim` elements (2 MiB for 8192
        positions of 64 float32), so a huge page would make a session's first key hold that much at once, and the
        kernel would zero (and maybe compact memory for) 2 MiB at each first write."""
        raw = _map(math.prod(shape) * torch.empty((), dtype=dtype).element_size())
        self.maps.append(raw)
        return torch.frombuffer(raw, dtype=torch.uint8).view(dtype).view(shape)  # (keeps the mapping alive too)

    def clear(self, index: int) -> None:
        """Slot `index` reads as zeros again and holds no memory: its whole pages go back to the kernel
        (`MADV_DONTNEED`: an anonymous mapping's dropped pages read as zeros), the parts of pages it shares with the
        slots beside it are zeroed in place."""
        with torch.inference_mode():
            for raw, buf in zip(self.maps, self.keys + self.values[:len(self.maps) - len(self.keys)]):
                flat = buf.view(-1)
                per_slot = flat.numel() // SLOTS
                size = buf.element_size()
                start, end = index * per_slot * size, (index + 1) * per_slot * size  # bytes
                lo, hi = -(-start // mmap.PAGESIZE) * mmap.PAGESIZE, end // mmap.PAGESIZE * mmap.PAGESIZE
                if hi > lo and hasattr(mmap, "MADV_DONTNEED"):
                    raw.madvise(mmap.MADV_DONTNEED, lo, hi - lo)
                else:
                    lo = hi = end
                flat[start // size:lo // size].zero_()
                flat[hi // size:end // size].zero_()


def _map(nbytes: int) -> mmap.mmap:
    """Private anonymous memory (a shared mapping would keep pages that `MADV_DONTNEED` drops)."""
    raw = mmap.mmap(-1, max(nbytes, 1), flags=mmap.MAP_PRIVATE)
    if hasattr(mmap, "MADV_NOHUGEPAGE"):
        raw.madvise(mmap.MADV_NOHUGEPAGE)
    return raw


@dataclass(frozen=True)
class ArenaSlot:
    """A session's place in a chunk: `index` in `chunk`, whose layer `i` holds the session's block first + i."""

    chunk: Chunk
    index: int


class KVArena:
    """Slots for one-row sessions of up to `capacity` positions over a span's blocks (`BlockSpan.enable_kv_arena`).

    A slot is released when its session's `SessionKV` is collected: the finalizer only queues it (it may run on any
    thread, inside any allocation, even one made under this arena's lock, by the cycle collector), and `collect`
    (called by `assign`, `chunks` and the handler when a session ends) clears the queued slots and frees the chunks
    left empty."""

    def __init__(self, kv_heads: int, head_dim: int, capacity: int, dtype: torch.dtype,
                 values_in_keys: Optional[int] = None):
        self.kv_heads, self.head_dim, self.capacity, self.dtype = kv_heads, head_dim, capacity, dtype
        self.values_in_keys = values_in_keys  # (`Chunk`: values as the keys' first channels, DeepSeek's latent)
        self._chunks: Dict[Tuple[int, int], List[Chunk]] = {}  # (first, last) -> chunks with these layers
        self._released: Deque[Tuple[Tuple[int, int], ArenaSlot]] = collections.deque()  # appended by finalizers
        self._lock = threading.Lock()

    def fits(self, batch_size: int, max_length: int) -> bool:
        return batch_size == 1 and max_length <= self.capacity

    def assign(self, owner: object, first: int, last: int, max_length: int) -> Optional[Tuple[ArenaSlot, list, list]]:
        """A free slot for `owner` (a `SessionKV`) over blocks [first, last) and its per-layer buffers [1, kv_heads,
        max_length, head_dim] (keys, values); None if no chunk can be allocated (the caller then allocates its own).
        The slot is released when `owner` is collected."""
        with self._lock:
            self._collect()
            chunks = self._chunks.setdefault((first, last), [])
            chunk = next((c for c in chunks if c.free), None)
            if chunk is None:
                try:
                    chunk = Chunk(last - first, self.kv_heads, self.capacity, self.head_dim, self.dtype,
                                  self.values_in_keys)
                except (MemoryError, RuntimeError, OSError):  # (mmap: ENOMEM under strict overcommit)
                    return None
                chunks.append(chunk)
            slot = ArenaSlot(chunk, chunk.free.pop())
        release = weakref.finalize(owner, self._released.append, ((first, last), slot))
        release.atexit = False
        keys = [k[slot.index:slot.index + 1, :, :max_length] for k in slot.chunk.keys]
        values = [v[slot.index:slot.index + 1, :, :max_length] for v in slot.chunk.values]
        return slot, keys, values

    def collect(self) -> None:
        """Clear the slots of the sessions collected since the last call and free the chunks left empty."""
        with self._lock:
            self._collect()

    def _collect(self) -> None:
        while self._released:
            layers, slot = self._released.popleft()
            chunk = slot.chunk
            chunk.free.append(slot.index)
            chunk.free.sort(reverse=True)
            chunks = self._chunks.get(layers, [])
            if chunk.empty:
                if chunk in chunks:
                    chunks.remove(chunk)  # unmapped once no view of it is left: nothing to clear
            else:
                chunk.clear(slot.index)

    def chunks(self) -> int:
        """Chunks allocated now."""
        with self._lock:
            self._collect()
            return sum(len(c) for c in self._chunks.values())
