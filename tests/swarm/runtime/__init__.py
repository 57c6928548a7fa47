"""Tests of `swarm.runtime`: the compute thread, swarm keys, DHT traffic."""
