"""Where swarmgate keeps its files on disk: one cache root, and the directories under it.

The root is `SWARMGATE_CACHE` if set, else `~/.cache/swarmgate`. Under it: `models/<name>` (bundled models
converted by `swarm.modeling.prepare`) and the files of other owners (e.g. the throughput cache of
`server.placement.throughput`). Hub downloads go to the Hugging Face cache or a given `cache_dir` instead
(`swarm.modeling.disk_cache`). The owners' small JSON files are read and written through `read_json` and
`write_json` (a missing or damaged file reads as empty; a write replaces the file atomically).
"""
from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Dict


def cache_root() -> Path:
    """swarmgate's cache directory (not created here)."""
    root = os.environ.get("SWARMGATE_CACHE")
    return Path(root) if root else Path.home() / ".cache" / "swarmgate"


def models_root() -> Path:
    """Where prepared (converted) models live, one directory per model name."""
    return cache_root() / "models"


def read_json(path: Path) -> Dict[str, Any]:
    """A JSON object file's contents; {} where it is missing, unreadable or not an object."""
    try:
        data = json.loads(path.read_text())
        return data if isinstance(data, dict) else {}
    except (OSError, ValueError):
        return {}


def write_json(path: Path, data: Dict[str, Any]) -> None:
    """Write `data` to `path` atomically (readers see the old or the new file, never half of one); creates the
    directory. Raises OSError (a read-only cache: the caller decides)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(data, indent=1, sort_keys=True))
    os.replace(tmp, path)
