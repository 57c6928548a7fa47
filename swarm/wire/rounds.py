"""The round messages: the steps of many inference sessions in ONE message per (client, server) pair and round.

A client that steps many sessions together (`swarm.client.transport.rounds.step_round`) keeps one long-lived
`rpc_round` stream per server (capability `rounds`). Sessions are opened as always, each on its own
`rpc_inference` stream (which holds the session's KV cache on the server and frees it when it closes); a round
message then names several of them, each row tagged with its session part (`stream_key`), and the server runs all
rows through its batched step and answers once, each row's outcome tagged the same way.

- `RoundStep` (client -> server): `attach` binds session parts to this round stream, each with the part's secret
  (`OpenSession.push_token`: the client gave it only to this server and the previous one of its chain, and the
  server also checks that the round stream's peer opened that part), so nobody steps another client's session;
  a part stays attached for the stream's life (a re-opened part is attached again, with its new token). `rows`:
  one step per session part: hidden states `[batch, seq, hidden]` for positions `start_position..`. The message's
  one tensor holds every row's hidden states in row order, flattened: `[sum(batch_i * seq_i), hidden]`.
- `RoundResult` (server -> client): per row, in the request's order, its `stream_key` and step id, and either the
  position its session holds after the step or an error (`code`, `message`) that concerns that row only (an
  unknown or unattached part, a wrong position, over a limit, a failed computation); its one tensor holds the
  outputs of the rows that succeeded, in row order, flattened like the request's.
- `RoundStats`: `rpc_round_stats`'s reply, the server's round counters (messages, rows, row errors) and its
  per-session steps, so that a test or an operator sees how many messages a round cost.

Typed and versioned like every message (`swarm.wire.protocol.Message`: unknown fields are refused); an older
server has no `rpc_round` handler and does not announce `rounds`, so a client steps its sessions one by one there.
"""
from __future__ import annotations

from typing import List, Literal, Optional, Sequence, Tuple

import torch
from pydantic import Field, model_validator

from swarm.wire.protocol import MAX_BATCH, MAX_SESSION_ID_LEN, MAX_TOKEN_LEN, Message, ProtocolError, PushTarget

MAX_ROUND_ROWS = 4096  # session parts in one round message
STREAM_KEY_LEN = MAX_SESSION_ID_LEN + 16  # `protocol.stream_key`


class RoundAttach(Message):
    """Bind a session part to this round stream."""

    type: Literal["attach"] = "attach"
    stream_key: str = Field(min_length=1, max_length=STREAM_KEY_LEN)
    token: str = Field(min_length=16, max_length=MAX_TOKEN_LEN, description="the part's OpenSession.push_token")


class RoundRow(Message):
    """One session part's step in a round: hidden [batch, seq, hidden] for positions start_position.."""

    type: Literal["row"] = "row"
    stream_key: str = Field(min_length=1, max_length=STREAM_KEY_LEN)
    start_position: int = Field(ge=0)
    step_id: int = Field(default=0, ge=0)
    batch: int = Field(gt=0, le=MAX_BATCH)
    seq: int = Field(gt=0)
    # capability `round_push`: after the step, push the output to push_chain[0] (the session's part on the next
    # server), which pushes on along the rest (left out of the JSON while empty: an older server never sees it)
    push_chain: List[PushTarget] = Field(default_factory=list, max_length=256, exclude_if=lambda value: not value)


class RoundStep(Message):
    """tensors: hidden [sum(batch_i * seq_i), hidden], the rows' hidden states in row order."""

    type: Literal["round"] = "round"
    round_id: int = Field(default=0, ge=0)
    attach: List[RoundAttach] = Field(default_factory=list, max_length=MAX_ROUND_ROWS)
    rows: List[RoundRow] = Field(min_length=1, max_length=MAX_ROUND_ROWS)

    @model_validator(mode="after")
    def _distinct_rows(self):
        if len({row.stream_key for row in self.rows}) != len(self.rows):
            raise ValueError("a session part appears twice in one round")
        return self

    @property
    def tokens(self) -> int:
        return sum(row.batch * row.seq for row in self.rows)


class RoundRowResult(Message):
    """One row's outcome: `position` (tokens its session holds now) or an error (`code`, `message`)."""

    type: Literal["row_result"] = "row_result"
    stream_key: str = Field(min_length=1, max_length=STREAM_KEY_LEN)
    step_id: int = Field(default=0, ge=0)
    position: Optional[int] = Field(default=None, ge=0)
    code: Optional[str] = Field(default=None, max_length=64)
    message: Optional[str] = Field(default=None, max_length=4096)
    # `round_push`: the output also went on to the row's next server (only for a row with a push chain)
    pushed: bool = Field(default=False, exclude_if=lambda value: not value)

    @model_validator(mode="after")
    def _one_outcome(self):
        if (self.position is None) == (self.code is None):
            raise ValueError("a row result has either a position or an error code")
        return self


class RoundResult(Message):
    """tensors: the outputs of the rows that succeeded, [sum over them of batch_i * seq_i, hidden], in row order."""

    type: Literal["round_result"] = "round_result"
    round_id: int = Field(default=0, ge=0)
    rows: List[RoundRowResult] = Field(max_length=MAX_ROUND_ROWS)
    # `round_push`: this result answers rows that the previous server pushed here (round_id 0), not a message of
    # the client's (only a client whose rows asked for pushes gets one)
    pushed: bool = Field(default=False, exclude_if=lambda value: not value)


class RoundPushRow(Message):
    """One pushed row: the output of the previous server for this server's session part `stream_key`."""

    type: Literal["push_row"] = "push_row"
    stream_key: str = Field(min_length=1, max_length=STREAM_KEY_LEN)
    token: str = Field(min_length=16, max_length=MAX_TOKEN_LEN, description="the part's OpenSession.push_token")
    start_position: int = Field(ge=0)
    step_id: int = Field(ge=0)
    batch: int = Field(gt=0, le=MAX_BATCH)
    seq: int = Field(gt=0)
    push_chain: List[PushTarget] = Field(default_factory=list, max_length=256, description="where its output goes on")


class RoundPush(Message):
    """Server -> next server (`rpc_round_push`): a round's rows whose next hop is that server, in one message.
    tensors: their hidden states [sum(batch_i * seq_i), hidden], in row order."""

    type: Literal["round_push"] = "round_push"
    rows: List[RoundPushRow] = Field(min_length=1, max_length=MAX_ROUND_ROWS)

    @model_validator(mode="after")
    def _distinct_rows(self):
        if len({row.stream_key for row in self.rows}) != len(self.rows):
            raise ValueError("a session part appears twice in one push")
        return self

    @property
    def tokens(self) -> int:
        return sum(row.batch * row.seq for row in self.rows)


class RoundStats(Message):
    """`rpc_round_stats`'s reply."""

    type: Literal["round_stats"] = "round_stats"
    messages: int = Field(default=0, ge=0, description="round messages received")
    rows: int = Field(default=0, ge=0, description="session steps received in round messages")
    row_errors: int = Field(default=0, ge=0, description="rows answered with an error")
    session_steps: int = Field(default=0, ge=0, description="steps received on sessions' own inference streams")
    round_streams: int = Field(default=0, ge=0, description="round streams open now")


ROUND_REQUEST_TYPES = (RoundStep, RoundPush)


def split_rows(flat: torch.Tensor, shapes: Sequence[Tuple[int, int]]) -> List[torch.Tensor]:
    """[sum(batch_i * seq_i), hidden] -> one [batch_i, seq_i, hidden] view per (batch_i, seq_i); ProtocolError if
    the sizes do not add up."""
    sizes = [batch * seq for batch, seq in shapes]
    if flat.ndim != 2 or flat.shape[0] != sum(sizes):
        raise ProtocolError(f"round hidden states must be [{sum(sizes)}, hidden] (the rows' batch * seq), got "
                            f"{list(flat.shape)}")
    if shapes and all(shape == shapes[0] for shape in shapes):  # a round of decode steps: one view, one unbind
        return list(flat.view(len(shapes), shapes[0][0], shapes[0][1], flat.shape[1]).unbind(0))
    return [part.view(batch, seq, flat.shape[1])
            for part, (batch, seq) in zip(torch.split(flat, sizes), shapes)]


def join_rows(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """[batch_i, seq_i, hidden] each -> [sum(batch_i * seq_i), hidden] (the inverse of `split_rows`)."""
    if tensors and all(t.ndim == 3 and t.shape[1] == tensors[0].shape[1] for t in tensors):  # one seq length: one cat
        return torch.cat(list(tensors)).reshape(-1, tensors[0].shape[-1])
    return torch.cat([t.reshape(-1, t.shape[-1]) for t in tensors])
