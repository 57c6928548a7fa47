"""In-process part of tests/e2e/test_prefix_cache.py: a boundary history whose adopted positions a server kept
(`BoundaryHistory.hold_remote`, `swarm.client.transport.prefix`) never hands them out before they are filled, and a
rewind before them leaves only what is still the server's."""
from __future__ import annotations

import pytest
import torch

from swarm.client.transport.session_chain import BoundaryHistory

HIDDEN = 8


def _history() -> BoundaryHistory:
    return BoundaryHistory(1, 256, HIDDEN, torch.float32)


def test_held_positions_are_refused_until_filled():
    history, source = _history(), object()
    history.hold_remote(100, source)  # type: ignore[arg-type]  (only compared, never called here)
    assert history.length == 100 and history.remote == 100 and history.remote_source is source
    assert history.read(0).shape == (1, 0, HIDDEN)
    with pytest.raises(RuntimeError, match="held by a server"):
        history.read(1)
    own = torch.randn(1, 5, HIDDEN)
    history.write(100, own)  # the session's own positions after them: still held before
    with pytest.raises(RuntimeError, match="held by a server"):
        history.read(105)
    held = torch.randn(1, 100, HIDDEN)
    history.fill(held)
    assert history.remote == 0 and history.remote_source is None
    assert torch.equal(history.read(105), torch.cat([held, own], dim=1))


def test_a_rewind_before_the_held_positions_keeps_only_those_before_it():
    history, source = _history(), object()
    history.hold_remote(100, source)  # type: ignore[arg-type]
    rewritten = torch.randn(1, 10, HIDDEN)
    history.write(40, rewritten)  # a rewind to 40: the server's outputs from 40 on are stale
    assert history.remote == 40 and history.remote_source is source and history.length == 50
    held = torch.randn(1, 100, HIDDEN)
    history.fill(held)  # (a fetch asks for `remote` positions; more are ignored)
    assert torch.equal(history.read(50), torch.cat([held[:, :40], rewritten], dim=1))
    history.hold_remote(30, source)  # type: ignore[arg-type]
    history.write(0, torch.randn(1, 3, HIDDEN))  # rewound to 0: nothing held any more
    assert history.remote == 0 and history.remote_source is None


def test_fewer_filled_positions_than_held_after_a_rewind():
    history, source = _history(), object()
    history.hold_remote(64, source)  # type: ignore[arg-type]
    history.fill(torch.ones(1, 20, HIDDEN))  # a replay of the 20 positions the session still holds
    assert history.remote == 0 and torch.equal(history.read(20), torch.ones(1, 20, HIDDEN))
