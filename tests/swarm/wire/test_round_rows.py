"""A round message's rows in one tensor (`swarm.wire.rounds.join_rows` / `split_rows`): each row comes back as it went,
in order, whether every row has the same shape (a round of decode steps: one cat, one view) or not (a prefill or a
speculative step beside them: row by row), and sizes that do not add up are refused."""
from __future__ import annotations

import pytest
import torch

from swarm.wire import rounds as R
from swarm.wire.protocol import ProtocolError


@pytest.mark.parametrize("shapes", [[(1, 1)] * 5, [(2, 3)] * 4, [(1, 1), (1, 4), (2, 1), (3, 2)], [(1, 2)]])
def test_rows_join_and_split_back_in_order(shapes):
    torch.manual_seed(0)
    rows = [torch.randn(batch, seq, 8) for batch, seq in shapes]
    rows[0] = rows[0].transpose(0, 1).contiguous().transpose(0, 1)  # a non-contiguous row joins the same
    flat = R.join_rows(rows)  # [sum(batch_i * seq_i), hidden]
    assert torch.equal(flat, torch.cat([r.reshape(-1, 8) for r in rows]))
    back = R.split_rows(flat, shapes)
    assert [tuple(b.shape) for b in back] == [(batch, seq, 8) for batch, seq in shapes]
    assert all(torch.equal(b, r) for b, r in zip(back, rows))
    with pytest.raises(ProtocolError):
        R.split_rows(flat[1:], shapes)
