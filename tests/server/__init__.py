"""Tests of a block server's parts (`server/`)."""
