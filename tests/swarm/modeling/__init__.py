"""Tests of `swarm.modeling`: families against transformers, checkpoints, layers."""
