"""Tests of `swarm.wire`: compression, reachability messages."""
