"""A block server: loading, execution, KV cache, scheduling, block placement, RPC handlers and its CLI."""

# swarm's package init first, before torch and hivemind load (what it sets up: swarm/__init__.py), also for code that
# imports an entry module directly rather than through `launch.cli.main`
import swarm  # noqa: E402,F401
