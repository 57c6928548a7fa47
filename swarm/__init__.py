"""swarmgate's swarm library: protocol, DHT records, routing, client sessions and the client model.

`from swarm import AutoDistributedModelForCausalLM` gives the Hugging Face-style client model
(`AutoDistributedModelForSequenceClassification`: a trainable classification head on top); the heavy
imports happen on first use so that servers and tools importing `swarm.*` modules stay light.
"""
from swarm.wire.capabilities import release as _release  # noqa: E402

__version__ = _release()  # pyproject.toml's version (swarm.wire.capabilities.release)

from swarm.runtime.deferred_imports import defer_unused_imports as _defer_unused_imports  # noqa: E402
from swarm.runtime.import_structure_cache import cache_import_structure as _cache_import_structure  # noqa: E402
from swarm.runtime.threads import tune_openmp_env as _tune_openmp_env  # noqa: E402

_tune_openmp_env()  # before torch loads, if it has not yet (swarm.runtime.threads)
# before hivemind loads: it imports scipy.optimize, which we never use (swarm.runtime.deferred_imports)
_defer_unused_imports()
# before transformers loads: what its model modules export, read from disk (swarm.runtime.import_structure_cache)
_cache_import_structure()

__all__ = ["AutoDistributedModelForCausalLM", "DistributedModelForCausalLM",
           "AutoDistributedModelForSequenceClassification", "__version__"]


def __getattr__(name):
    if name in ("AutoDistributedModelForCausalLM", "DistributedModelForCausalLM"):
        from swarm.client.model import causal_lm as model

        return getattr(model, name)
    if name == "AutoDistributedModelForSequenceClassification":
        from swarm.client.model import classification

        return classification.AutoDistributedModelForSequenceClassification
    raise AttributeError(name)
