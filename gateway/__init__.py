"""swarmgate's HTTP face: an OpenAI-compatible API (chat and text completions, SSE streaming) over the swarm.

Start it with `swarmgate gateway MODEL --initial_peers ...` (`gateway.app.main`), or build the app in-process
with `gateway.app.create_app(config, model=None, tokenizer=None)`.
"""
