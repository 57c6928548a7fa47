"""A block server: loading, execution, KV cache, scheduling, block placement, RPC handlers and its CLI."""

# first, before anything imports torch or hivemind: swarm's package init sets GOMP_SPINCOUNT (swarm.runtime.threads)
# and defers scipy.optimize (swarm.runtime.deferred_imports), which only work before those load (`swarmgate`'s
# processes get it from launch.cli.main; this covers code that imports an entry module directly)
import swarm  # noqa: E402,F401
