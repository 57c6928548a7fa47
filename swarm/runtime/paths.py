"""Where swarmgate keeps its files on disk: one cache root, and the directories under it.

The root is `SWARMGATE_CACHE` if set, else `~/.cache/swarmgate`. Under it: `models/<name>` (bundled models
converted by `swarm.modeling.prepare`) and the files of other owners (e.g. the throughput cache of
`server.placement.throughput`). Hub downloads go to the Hugging Face cache or a given `cache_dir` instead
(`swarm.modeling.disk_cache`). The owners' small JSON files are read and written through `read_json` and
`write_json` (a missing or damaged file reads as empty, a damaged one with a warning; a write replaces the file
atomically, so that processes writing one file at once leave one of their files whole, never a mix).
"""
from __future__ import annotations

import json
import logging
import os
import uuid
from pathlib import Path
from typing import Any, Dict, Set

logger = logging.getLogger(__name__)
_WARNED: Set[str] = set()  # damaged files already warned of in this process


def cache_root() -> Path:
    """swarmgate's cache directory (not created here)."""
    root = os.environ.get("SWARMGATE_CACHE")
    return Path(root) if root else Path.home() / ".cache" / "swarmgate"


def models_root() -> Path:
    """Where prepared (converted) models live, one directory per model name."""
    return cache_root() / "models"


def read_json(path: Path) -> Dict[str, Any]:
    """A JSON object file's contents; {} where it is missing, unreadable or not an object (a damaged file: its owner
    starts afresh, and the next `write_json` replaces it), with one warning per file and process for a file that is
    there but damaged."""
    try:
        text = path.read_text()
    except FileNotFoundError:
        return {}
    except (OSError, ValueError) as e:  # (ValueError: not UTF-8)
        return _damaged(path, e)
    try:
        data = json.loads(text)
    except ValueError as e:
        return _damaged(path, e)
    return data if isinstance(data, dict) else _damaged(path, f"a JSON {type(data).__name__}, not an object")


def _damaged(path: Path, why: object) -> Dict[str, Any]:
    warn_damaged(path, f"is unreadable ({why}): treated as absent (it is replaced at the next write)")
    return {}


def warn_damaged(path: Path, what: str) -> None:
    """One warning per file and process that `path` (a cache file) is damaged: `what` says how and what is done."""
    if str(path) not in _WARNED:
        _WARNED.add(str(path))
        logger.warning(f"{path} {what}")


def write_json(path: Path, data: Dict[str, Any]) -> None:
    """Write `data` to `path` atomically: into a temporary file of its own (unique to this call, so that threads and
    processes writing at once never share one) in the same directory, then renamed over `path`, so readers see the
    old or the new file, never half of one; the temporary file is removed if anything fails. Creates the directory.
    Raises OSError (a read-only cache: the caller decides)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{uuid.uuid4().hex}.tmp")
    try:
        with open(tmp, "x") as f:  # ("x": never another writer's file)
            json.dump(data, f, indent=1, sort_keys=True)
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise
