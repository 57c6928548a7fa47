"""Handing freed heap memory back to the operating system (glibc malloc).

torch allocates CPU tensors with malloc. glibc keeps what is freed in its heaps for reuse rather than returning it
to the OS: blocks larger than the mmap threshold start out as their own mappings (unmapped when freed), but
freeing one raises the threshold to its size, so later tensors of up to a few MB (a block's weights, KV caches,
activations) come from the heaps, and a process's resident memory stays at its high-water mark after the
tensors are gone. Our processes free large amounts at known moments: a block server after loading its blocks
(the unfused checkpoint tensors, a throughput measurement) and when its last open session closes (the KV
caches). `trim()` then returns the free pages of all heaps (`malloc_trim(0)`, a few ms), and the next session
maps fresh pages as it needs them. Elsewhere (other C libraries, or a failed lookup) it does nothing.

Huge pages: a decode pass streams every weight of a span through the cores (hundreds of MB a step), and with 4 KB
pages much of that time goes to TLB misses. torch's CPU allocator can align its large tensors (2 MB and more) to
2 MB and ask for transparent huge pages (`THP_MEM_ALLOC_ENABLE=1`, read when torch loads);
`tune_allocator_env()` sets it for a block server before torch is imported, unless the user set it: a batch of 8
sessions' pass through 15 packed SmolLM2 blocks took 21-22 ms with it and 24-26 ms without (2-core test machine,
transparent huge pages in `madvise` mode, the kernel's default).
"""
from __future__ import annotations

import ctypes
import ctypes.util
import logging
import os
import sys
import threading
from typing import Optional

logger = logging.getLogger(__name__)

_lock = threading.Lock()
_libc: Optional[ctypes.CDLL] = None
_looked_up = False


def _malloc_trim():
    global _libc, _looked_up
    with _lock:
        if not _looked_up:
            _looked_up = True
            try:
                libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
                if hasattr(libc, "malloc_trim"):
                    libc.malloc_trim.argtypes, libc.malloc_trim.restype = [ctypes.c_size_t], ctypes.c_int
                    _libc = libc
            except OSError as e:  # not glibc
                logger.debug(f"malloc_trim unavailable: {e}")
        return _libc.malloc_trim if _libc is not None else None


def trim() -> bool:
    """Return the free memory of all malloc heaps to the OS; False where the C library cannot."""
    malloc_trim = _malloc_trim()
    if malloc_trim is None:
        return False
    malloc_trim(0)
    return True


THP_ENV = "THP_MEM_ALLOC_ENABLE"


def tune_allocator_env() -> bool:
    """Ask torch's allocator for huge pages (`THP_ENV`) while it can take effect: before torch loads. Returns whether
    it was set (not when torch is loaded or the user set the variable)."""
    if "torch" in sys.modules or THP_ENV in os.environ:
        return False
    os.environ[THP_ENV] = "1"
    return True
