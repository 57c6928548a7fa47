"""Tests of `swarm.client`: routing, generation, speculation, liveness."""
