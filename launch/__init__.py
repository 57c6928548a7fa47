"""Launchers: the `swarmgate` command, the bootstrap peer, and the local topology (`swarmgate up`, test fixtures,
benchmarks)."""

# swarm's package init first, before torch and hivemind load (what it sets up: swarm/__init__.py), also for code that
# imports an entry module directly rather than through `launch.cli.main`
import swarm  # noqa: E402,F401
