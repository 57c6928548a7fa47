"""Deferring imports that a dependency makes eagerly but our processes never use.

`import hivemind` imports all of hivemind, and `hivemind.averaging.load_balancing` runs `import scipy.optimize` at
import time for one function of decentralized averaging (training), which swarmgate never runs. scipy.optimize
brings scipy.sparse, scipy.linalg, scipy.special and more: about 320 modules and 35 MB of resident memory in
every server, client and gateway process.

transformers does the same: `transformers.modeling_utils` (every model class, so the client model and the gateway)
imports its object-detection losses, which run `from scipy.optimize import linear_sum_assignment` when scipy is
installed: 37 MB more in the gateway, for a loss we never compute.

`defer_unused_imports()` (called from `swarm/__init__.py`, so before hivemind loads in our processes) installs an
import hook for the names in `DEFERRED`: importing one of them binds a placeholder module, and the first use of
any attribute of it (or of one of its submodules) imports the real module, which then replaces the placeholder in
`sys.modules` and on its parent package. Code that uses the module sees no difference but the delay. Functions
that other modules take by name at import (`from module import function`) are listed with the module: the
placeholder holds a stand-in for each that imports the real module when it is called, and calls the real function.
"""
from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import sys
import threading
import types

# module -> the functions imported from it by name at import time (stand-ins until the first call)
DEFERRED = {"scipy.optimize": ("linear_sum_assignment",)}
_lock = threading.RLock()


class _Placeholder(types.ModuleType):
    """Stands for a deferred module until one of its attributes is used."""

    def __getattr__(self, attr: str):  # only called for attributes the placeholder lacks, i.e. the module's own
        # not while the import system sets the placeholder up, nor for its bookkeeping (__file__, __loader__, ...)
        if not self.__dict__.get("_deferred_ready") or (
                attr.startswith("__") and attr.endswith("__") and attr != "__all__"):
            raise AttributeError(attr)
        return getattr(_load(self.__name__), attr)


class _Finder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def __init__(self, names):
        self.names = set(names)
        self.loading: set = set()

    def find_spec(self, name, path=None, target=None):
        if name not in self.names or name in self.loading:
            return None
        real = importlib.machinery.PathFinder.find_spec(name, path)
        if real is None:
            return None  # not installed: the usual ImportError, now
        spec = importlib.machinery.ModuleSpec(name, self, is_package=real.submodule_search_locations is not None)
        # the package's own `__path__` at once: `from package import name` asks for it, which must not load it
        spec.submodule_search_locations = real.submodule_search_locations
        return spec

    def create_module(self, spec):
        return _Placeholder(spec.name)

    def exec_module(self, module) -> None:
        for function in DEFERRED.get(module.__name__, ()):
            module.__dict__[function] = _stand_in(module.__name__, function)
        module.__dict__["_deferred_ready"] = True


def _stand_in(module: str, function: str):
    """A function that imports `module` on its first call and calls its `function`."""

    def call(*args, **kwargs):
        return getattr(_load(module), function)(*args, **kwargs)

    call.__name__ = call.__qualname__ = function
    call.__module__ = module
    return call


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
            real = importlib.import_module(name)  # also sets it on the parent package
            for child, module in list(sys.modules.items()):  # submodules imported under the placeholder
                attr = child[len(name) + 1:]
                if child.startswith(name + ".") and "." not in attr and not hasattr(real, attr):
                    setattr(real, attr, module)
            return real
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
