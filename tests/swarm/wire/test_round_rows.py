"""A round message's rows in one tensor (`swarm.wire.rounds.join_rows` / `split_rows`): each row comes back as it went,
in order, whether every row has the same shape (a round of decode steps: one cat, one view) or not (a prefill or a
speculative step beside them: row by row), and sizes that do not add up are refused."""
from __future__ import annotations

import json

import pytest
import torch

from swarm.wire import protocol as P
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


def test_round_push_fields_stay_out_of_the_json_while_unset():
    """`round_push`'s fields (`RoundRow.push_chain`; `pushed` in the results) are left out while unset, so a server
    or client of an older release, which refuses unknown fields, never sees them unless it asked for pushes."""
    row = R.RoundRow(stream_key="s:0", start_position=3, step_id=4, batch=1, seq=1)
    assert "push_chain" not in row.model_dump_json()
    target = P.PushTarget(peer_id="b", stream_key="s:15", push_token="t" * 24)
    assert "push_chain" in R.RoundRow(stream_key="s:0", start_position=3, batch=1, seq=1,
                                      push_chain=[target]).model_dump_json()
    result = R.RoundResult(rows=[R.RoundRowResult(stream_key="s:0", position=4)])
    assert "pushed" not in P.encode(result).decode()
    pushed = R.RoundResult(rows=[R.RoundRowResult(stream_key="s:0", position=4, pushed=True)], pushed=True)
    assert P.decode(P.encode(pushed), R.RoundResult) == pushed


@pytest.mark.parametrize("rows, reason", [
    ([], "at least 1"),
    ([dict(stream_key="s:0")] * 2, "appears twice"),
    ([dict(stream_key="s:0", token="short")], "at least 16"),
    ([dict(stream_key="s:0", step_id=-1)], "greater than or equal"),
    ([dict(stream_key="s:0", batch=0)], "greater than 0"),
])
def test_a_malformed_round_push_is_refused(rows, reason):
    base = dict(token="t" * 24, start_position=3, step_id=4, batch=1, seq=1)
    raw = {"v": 1, "type": "round_push", "rows": [{"type": "push_row", **base, **row} for row in rows]}
    with pytest.raises(P.ProtocolError, match=reason):
        P.decode(json.dumps(raw).encode(), R.RoundPush)
