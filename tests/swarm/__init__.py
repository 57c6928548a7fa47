"""Tests of the swarm library (`swarm/`), one folder per package."""
