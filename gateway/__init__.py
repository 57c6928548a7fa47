"""swarmgate's HTTP face: an OpenAI-compatible API (chat and text completions, SSE streaming) over the swarm.

Start it with `swarmgate gateway MODEL --initial_peers ...` (`gateway.app.main`), or build the app in-process
with `gateway.app.create_app(config, model=None, tokenizer=None)`.
"""

# swarm's package init first, before torch and hivemind load (what it sets up: swarm/__init__.py), also for code that
# imports an entry module directly rather than through `launch.cli.main`
import swarm  # noqa: E402,F401
