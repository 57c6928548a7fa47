"""Tests of `swarm.launch`: the topology launcher and the latency lab."""
