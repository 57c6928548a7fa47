"""Tests of the gateway (`gateway/`): in process and over real swarms."""
