"""Tests of `launch`: the topology launcher and the latency lab."""
