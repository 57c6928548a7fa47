"""swarmgate's HTTP face: an OpenAI-compatible API (chat and text completions, SSE streaming) over the swarm.

Start it with `swarmgate gateway MODEL --initial_peers ...` (`gateway.app.main`), or build the app in-process
with `gateway.app.create_app(config, model=None, tokenizer=None)`.
"""

# first, before anything imports torch or hivemind: swarm's package init sets GOMP_SPINCOUNT (swarm.runtime.threads)
# and defers scipy.optimize (swarm.runtime.deferred_imports), which only work before those load (`swarmgate`'s
# processes get it from launch.cli.main; this covers code that imports an entry module directly)
import swarm  # noqa: E402,F401
