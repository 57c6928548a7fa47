"""Caching transformers' lazy import structure on disk, so that `import transformers` does not read every model file.

`import transformers` (any `transformers.*` import runs the package's `__init__` first) builds the table of what
each of its ~1,700 model modules exports by opening and scanning every one of them
(`transformers.utils.import_utils.create_import_structure_from_path`): 0.25-0.45 s of CPU in every process that
imports transformers (each server, gateway and client; ~300 process starts in a run of the test suite), for a
table that only changes when transformers does.

`cache_import_structure()` (called from `swarm/__init__.py`, so before transformers loads in our processes) installs
an import hook for `transformers.utils.import_utils` that wraps that function once the module has run: the result
for a directory is kept in one pickle file per transformers version under the cache root
(`swarm.runtime.paths.cache_root()/import-structure/`), keyed by the directory's path, modification time and entry
count, and read back by later processes. Anything unexpected (another transformers whose module lacks the function,
an unreadable or stale file, a failed write) falls back to transformers' own scan; `SWARMGATE_IMPORT_CACHE=0`
turns the hook off (for a transformers checkout being edited in place: a module's exports changed without a
file added or removed and without a new version would not be seen). Files are replaced atomically, so concurrent
processes never read half a file.
"""
from __future__ import annotations

import importlib.abc
import importlib.machinery
import logging
import os
import pickle
import sys
import tempfile
from pathlib import Path
from typing import Any, Callable, Dict, Optional, Tuple

MODULE = "transformers.utils.import_utils"
FUNCTION = "create_import_structure_from_path"
FORMAT = 1  # of the pickled table; another value is a different file

logger = logging.getLogger(__name__)


def _cache_file() -> Optional[Path]:
    """One file per transformers version (read from its installed metadata: nothing of it imported)."""
    try:
        from importlib.metadata import version

        from swarm.runtime.paths import cache_root

        return cache_root() / "import-structure" / f"transformers-{version('transformers')}-{FORMAT}.pickle"
    except Exception:  # noqa: BLE001 - no metadata: no cache
        return None


def _key(module_path: Any) -> Tuple[str, int, int]:
    """The directory's path, modification time and entry count: a file added or removed changes them."""
    path = os.path.abspath(str(module_path))
    return path, os.stat(path).st_mtime_ns, len(os.listdir(path))


def _read(file: Path) -> Dict[tuple, bytes]:
    try:
        with open(file, "rb") as f:
            table = pickle.load(f)
        return table if isinstance(table, dict) else {}
    except Exception:  # noqa: BLE001 - missing, partial or foreign: start again
        return {}


def _write(file: Path, table: Dict[tuple, bytes]) -> None:
    try:
        file.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=file.parent, prefix=file.name, suffix=".tmp")
        with os.fdopen(fd, "wb") as f:
            pickle.dump(table, f, protocol=pickle.HIGHEST_PROTOCOL)
        os.replace(tmp, file)
    except Exception as e:  # noqa: BLE001 - read-only home, full disk: the scan stays uncached
        logger.debug("import structure cache not written: %s", e)


def cached(scan: Callable[[Any], Any], file: Path) -> Callable[[Any], Any]:
    """`scan` (a directory's import structure) answered from `file` where it holds the directory's current key.
    Only the outermost call is looked up and kept (`scan` recurses into the subdirectories through this wrapper:
    those calls go straight to it), as pickled bytes: every answer is a fresh copy, whatever its caller does with
    it."""
    table: Optional[Dict[tuple, bytes]] = None
    scanning = False

    def structure(module_path):
        nonlocal table, scanning
        if scanning:
            return scan(module_path)
        try:
            key = _key(module_path)
        except OSError:
            return scan(module_path)
        if table is None:
            table = _read(file)
        hit = table.get(key)
        if hit is not None:
            try:
                return pickle.loads(hit)
            except Exception:  # noqa: BLE001 - a damaged entry: scanned again below
                pass
        scanning = True
        try:
            result = scan(module_path)
        finally:
            scanning = False
        table[key] = pickle.dumps(result, protocol=pickle.HIGHEST_PROTOCOL)
        _write(file, table)
        return result

    return structure


class _Finder(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name != MODULE:
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        file = _cache_file()
        if spec is None or spec.loader is None or file is None or not hasattr(spec.loader, "exec_module"):
            return spec
        run = spec.loader.exec_module

        def exec_module(module) -> None:
            run(module)
            scan = getattr(module, FUNCTION, None)
            if callable(scan):
                setattr(module, FUNCTION, cached(scan, file))

        spec.loader.exec_module = exec_module
        return spec


_finder = _Finder()


def cache_import_structure() -> bool:
    """Install the hook (once); False if turned off or transformers is already imported."""
    if os.environ.get("SWARMGATE_IMPORT_CACHE", "1") == "0" or MODULE in sys.modules:
        return False
    if _finder not in sys.meta_path:
        sys.meta_path.insert(0, _finder)
    return True
