"""Launchers: the `swarmgate` command, the bootstrap peer, and the local topology (`swarmgate up`, test fixtures,
benchmarks)."""
