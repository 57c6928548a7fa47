"""A disk cache for downloaded checkpoint files with least-recently-used eviction under a size limit.

Several servers on one machine may share one cache directory (the Hugging Face hub cache, or `--cache_dir`).
Every fetch takes an exclusive file lock on `<root>/.swarmgate-disk-cache.lock` for the whole check, eviction
and download, so that two servers never download the same file twice, never evict a file the other is
writing, and never together exceed the limit. Use is recorded in each file's access time (set explicitly,
so `noatime` mounts work too); eviction deletes the least recently used complete files (never the lock, nor
unfinished `*.incomplete` downloads) and then the symlinks left dangling (the hub cache's `snapshots/`).

`hub_download` routes `huggingface_hub.hf_hub_download` through the cache: if the file is not cached yet (and a
limit is set), it asks the hub for its size first and makes room for it; the download itself keeps the hub
client's usual behaviour (an up-to-date check, the cached file when offline).
"""
from __future__ import annotations

import logging
import os
import re
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator, List, Optional, Union

from filelock import FileLock

logger = logging.getLogger(__name__)

LOCK_NAME = ".swarmgate-disk-cache.lock"
_UNITS = {"": 1, "b": 1, "k": 10**3, "kb": 10**3, "m": 10**6, "mb": 10**6, "g": 10**9, "gb": 10**9,
          "t": 10**12, "tb": 10**12, "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


class DiskCacheError(OSError):
    """The cache cannot make room for a file (it is larger than the limit, or the rest cannot be evicted)."""


def parse_size(value: Union[str, int, float, None]) -> Optional[int]:
    """'20GB', '512MiB', '1.5g', 1000 -> bytes (None stays None); ValueError on anything else."""
    if value is None:
        return None
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        number, unit = float(value), ""
    else:
        match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", str(value))
        if not match or match.group(2).lower() not in _UNITS:
            raise ValueError(f"size must look like 500MB, 20GiB or a number of bytes, got {value!r}")
        number, unit = float(match.group(1)), match.group(2).lower()
    if number < 0:
        raise ValueError(f"size must be non-negative, got {value!r}")
    return int(number * _UNITS[unit])


@dataclass(frozen=True)
class Entry:
    path: Path
    size: int
    last_used: float


class DiskCache:
    def __init__(self, root: Union[str, Path], max_bytes: Optional[int] = None):
        self.root = Path(root)
        self.max_bytes = max_bytes

    # ---- locking ------------------------------------------------------------------------------------------
    @contextmanager
    def locked(self) -> Iterator[None]:
        """Exclusive across processes (and across threads: each call opens its own file description)."""
        self.root.mkdir(parents=True, exist_ok=True)
        with FileLock(str(self.root / LOCK_NAME)):
            yield

    # ---- bookkeeping --------------------------------------------------------------------------------------
    def entries(self) -> List[Entry]:
        """Every regular file under the root (symlinks are not counted twice), least recently used first."""
        found = []
        for dirpath, dirnames, filenames in os.walk(self.root):
            for name in filenames:
                path = Path(dirpath) / name
                if path.parent == self.root and name == LOCK_NAME:
                    continue
                try:
                    st = os.lstat(path)
                except FileNotFoundError:
                    continue
                if not os.path.islink(path):
                    found.append(Entry(path, st.st_size, st.st_atime))
        return sorted(found, key=lambda e: (e.last_used, str(e.path)))

    def usage(self) -> int:
        return sum(e.size for e in self.entries())

    @staticmethod
    def touch(path: Union[str, Path]) -> None:
        """Mark a file as just used (its access time; the modification time is kept)."""
        real = os.path.realpath(path)
        try:
            st = os.stat(real)
            os.utime(real, (time.time(), st.st_mtime))
        except FileNotFoundError:
            pass

    def _evictable(self, entry: Entry) -> bool:
        return not entry.path.name.endswith(".incomplete") and ".locks" not in entry.path.relative_to(self.root).parts

    def make_room(self, needed: int) -> List[Path]:
        """Evict least recently used files until `needed` more bytes fit under the limit; call with the lock held.
        Returns the evicted paths."""
        if self.max_bytes is None:
            return []
        if needed > self.max_bytes:
            raise DiskCacheError(f"a file of {needed} bytes does not fit in a cache limited to {self.max_bytes} bytes")
        entries = self.entries()
        used = sum(e.size for e in entries)
        evicted = []
        for entry in entries:
            if used + needed <= self.max_bytes:
                break
            if not self._evictable(entry):
                continue
            try:
                entry.path.unlink()
            except FileNotFoundError:
                pass
            used -= entry.size
            evicted.append(entry.path)
            logger.info(f"disk cache: evicted {entry.path} ({entry.size / 2**20:.1f} MiB, least recently used)")
        if used + needed > self.max_bytes:
            raise DiskCacheError(
                f"cannot free room for {needed} bytes in {self.root}: {used} of {self.max_bytes} bytes are in use "
                f"by files that cannot be evicted"
            )
        if evicted:
            self._remove_dangling_links()
        return evicted

    def _remove_dangling_links(self) -> None:
        for dirpath, dirnames, filenames in os.walk(self.root):
            for name in filenames + dirnames:
                path = os.path.join(dirpath, name)
                if os.path.islink(path) and not os.path.exists(path):
                    try:
                        os.unlink(path)
                    except FileNotFoundError:
                        pass

    # ---- fetching -----------------------------------------------------------------------------------------
    def fetch(self, download: Callable[[], Union[str, Path]], size: Union[int, Callable[[], int]],
              cached: Optional[Callable[[], Optional[Union[str, Path]]]] = None) -> Path:
        """Return `cached()` if it gives an existing file; else make room for `size` bytes and `download()`.
        All of it under the lock; the result is marked as just used."""
        with self.locked():
            if cached is not None:
                hit = cached()
                if hit is not None and os.path.isfile(hit):
                    self.touch(hit)
                    return Path(hit)
            needed = size() if callable(size) else size
            self.make_room(int(needed or 0))
            path = Path(download())
            self.touch(path)
            if self.max_bytes is not None and self.usage() > self.max_bytes:
                logger.warning(f"disk cache {self.root} holds {self.usage()} bytes, over its {self.max_bytes} limit")
            return path


def hub_download(repo_id: str, filename: str, *, cache_dir: Optional[str] = None, revision: Optional[str] = None,
                 max_disk_space: Optional[int] = None, token: Optional[str] = None) -> Path:
    """`hf_hub_download` through a `DiskCache` on the hub cache directory (one download per file per machine);
    `token`: None for huggingface_hub's own (HF_TOKEN, or the stored login)."""
    from huggingface_hub import constants, get_hf_file_metadata, hf_hub_download, hf_hub_url, try_to_load_from_cache

    root = Path(cache_dir) if cache_dir else Path(constants.HF_HUB_CACHE)
    cache = DiskCache(root, max_disk_space)

    def cached():
        hit = try_to_load_from_cache(repo_id, filename, cache_dir=cache_dir, revision=revision)
        return hit if isinstance(hit, str) else None

    def size() -> int:
        if max_disk_space is None or cached() is not None:
            return 0  # nothing to make room for (an up-to-date check may still replace the file in place)
        return get_hf_file_metadata(hf_hub_url(repo_id, filename, revision=revision), token=token).size or 0

    def download() -> str:
        return hf_hub_download(repo_id, filename, cache_dir=cache_dir, revision=revision, token=token)

    return cache.fetch(download, size)
