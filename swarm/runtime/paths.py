"""Where swarmgate keeps its files on disk: one cache root, and the directories under it.

The root is `SWARMGATE_CACHE` if set, else `~/.cache/swarmgate`. Under it: `models/<name>` (bundled models
converted by `swarm.modeling.prepare`) and the files of other owners (e.g. the throughput cache of
`server.placement.throughput`). Hub downloads go to the Hugging Face cache or a given `cache_dir` instead
(`swarm.modeling.disk_cache`).
"""
from __future__ import annotations

import os
from pathlib import Path


def cache_root() -> Path:
    """swarmgate's cache directory (not created here)."""
    root = os.environ.get("SWARMGATE_CACHE")
    return Path(root) if root else Path.home() / ".cache" / "swarmgate"


def models_root() -> Path:
    """Where prepared (converted) models live, one directory per model name."""
    return cache_root() / "models"
