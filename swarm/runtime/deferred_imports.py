"""Deferring imports that a dependency makes eagerly but our processes never use.

`import hivemind` imports all of hivemind, and `hivemind.averaging.load_balancing` runs `import scipy.optimize` at
import time for one function of decentralized averaging (training), which swarmgate never runs. scipy.optimize
brings scipy.sparse, scipy.linalg, scipy.special and more: about 320 modules and 35 MB of resident memory in
every server, client and gateway process.

`defer_unused_imports()` (called from `swarm/__init__.py`, so before hivemind loads in our processes) installs an
import hook for the names in `DEFERRED`: importing one of them binds a placeholder module, and the first use of
any attribute of it (or of one of its submodules) imports the real module, which then replaces the placeholder in
`sys.modules` and on its parent package. Code that uses the module sees no difference but the delay.
"""
from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import sys
import threading
import types

DEFERRED = ("scipy.optimize",)
_lock = threading.RLock()


class _Placeholder(types.ModuleType):
    """Stands for a deferred module until one of its attributes is used."""

    def __getattr__(self, attr: str):  # only called for attributes the placeholder lacks, i.e. the module's own
        # not while the import system sets the placeholder up, nor for its bookkeeping (__file__, __loader__, ...)
        if not self.__dict__.get("_deferred_ready") or (
                attr.startswith("__") and attr.endswith("__") and attr not in ("__path__", "__all__")):
            raise AttributeError(attr)
        return getattr(_load(self.__name__), attr)


class _Finder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def __init__(self, names):
        self.names = set(names)
        self.loading: set = set()

    def find_spec(self, name, path=None, target=None):
        if name not in self.names or name in self.loading:
            return None
        if importlib.machinery.PathFinder.find_spec(name, path) is None:
            return None  # not installed: the usual ImportError, now
        return importlib.machinery.ModuleSpec(name, self)

    def create_module(self, spec):
        return _Placeholder(spec.name)

    def exec_module(self, module) -> None:
        module.__dict__["_deferred_ready"] = True


_finder = _Finder(DEFERRED)


def _load(name: str) -> types.ModuleType:
    """The real module `name` (imported now if only its placeholder is there)."""
    with _lock:
        placeholder = sys.modules.get(name)
        if not isinstance(placeholder, _Placeholder):
            return placeholder if placeholder is not None else importlib.import_module(name)
        del sys.modules[name]
        _finder.loading.add(name)
        try:
            return importlib.import_module(name)  # also sets it on the parent package
        except BaseException:
            sys.modules[name] = placeholder
            raise
        finally:
            _finder.loading.discard(name)


def defer_unused_imports() -> bool:
    """Install the hook (once); False if a deferred module is already imported (nothing to gain then)."""
    with _lock:
        if _finder in sys.meta_path:
            return True
        if any(name in sys.modules for name in DEFERRED):
            return False
        sys.meta_path.insert(0, _finder)
        return True
