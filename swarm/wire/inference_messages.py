"""The messages of a session's streams (`rpc_inference`, `rpc_push`; see `swarm.wire.protocol`): opening a session
part, its steps (with the row edits a step may make to the cache first), the pushes between servers, and results.
"""
from __future__ import annotations

from typing import Annotated, List, Literal, Optional

from pydantic import Field, model_validator

from swarm.wire import compression as wire_compression
from swarm.wire.codec import MAX_BATCH, MAX_SESSION_ID_LEN, MAX_TOKEN_LEN, Message, ProtocolError

MAX_PREFIX_TOKENS = 1 << 17  # `PrefixDecl.tokens`


class PrefixDecl(Message):
    """The prompt a session starts with, so that servers key its prefix pages (`server.compute.prefix_cache`)."""

    salt: str = Field(max_length=128, description="pages of different salts are never shared (the gateway's: a "
                                                  "hash of the API key)")
    tokens: List[Annotated[int, Field(ge=0, lt=1 << 31)]] = Field(max_length=MAX_PREFIX_TOKENS,
                                                                  description="the prompt's leading token ids")


class OpenSession(Message):
    type: Literal["open"] = "open"
    session_id: str = Field(min_length=1, max_length=MAX_SESSION_ID_LEN)
    start: int = Field(ge=0, description="first block of this server's part of the chain")
    end: int = Field(gt=0, description="one past the last block")
    max_length: int = Field(gt=0, description="most tokens (positions) this session will hold")
    batch_size: int = Field(default=1, gt=0, le=MAX_BATCH)
    adapter: Optional[str] = Field(default=None, min_length=1, max_length=128,
                                   description="the LoRA adapter this session runs with (None: the base model)")
    prompts: bool = Field(default=False, description="the request carries deep prompts [end - start, batch | 1, "
                                                     "pre_seq_len, hidden], added to each block's first positions")
    push_token: Optional[str] = Field(default=None, min_length=16, max_length=MAX_TOKEN_LEN,
                                      description="the secret a push into this session part must carry (the client "
                                                  "hands it to the previous server only); None: no push accepted")
    # left out of the message when None, so that servers from before the field (which reject unknown fields)
    # still take sessions that do not ask for compression
    compression: Optional[wire_compression.Compression] = Field(
        default=None, exclude_if=lambda value: value is None,
        description="how this session's hidden states travel (steps, replies, pushes; swarm.wire.compression); "
                    "None: the server's --compression")
    # (left out when None, as compression) the prompt whose prefix pages the server may hold: the reply to this
    # OpenSession then says in `position` how many leading tokens the session holds already, with the span's
    # outputs at them [batch, position, hidden] as its tensor; the client's first step starts at most there
    prefix: Optional[PrefixDecl] = Field(default=None, exclude_if=lambda value: value is None,
                                         description="the session's prompt for the server's prefix cache")
    # (left out when True, the default) False: the reply to this OpenSession carries no outputs for the positions
    # the session holds; the server keeps them for the session, and `rpc_prefix_outputs` sends them when the client
    # needs them (a failover replay of the next span, a caller that asks for every position's output)
    prefix_outputs: bool = Field(default=True, exclude_if=lambda value: value is True,
                                 description="whether the opening's reply carries the adopted positions' outputs")


class PushTarget(Message):
    peer_id: str = Field(min_length=1, max_length=128)
    stream_key: str = Field(min_length=1, max_length=MAX_SESSION_ID_LEN + 16)
    push_token: str = Field(default="", max_length=MAX_TOKEN_LEN, description="the target's OpenSession.push_token")


RowIndex = Annotated[int, Field(ge=0, lt=MAX_BATCH)]


class RowEdits(Message):
    """What a step may change in the session's cache rows before it runs (`Step` and `PushStep` carry the same);
    their lengths and ranges against the session's batch are checked by the server (`check_row_edits`)."""

    hypo_ids: Optional[List[RowIndex]] = Field(
        default=None, max_length=MAX_BATCH,
        description="beam search: before this step, row i of the kept positions [0, start_position) becomes what "
                    "row hypo_ids[i] held (length = batch, each in [0, batch))")
    reorder_id: int = Field(default=0, ge=0, description="names the reorder: a server applies one nonzero "
                                                         "reorder_id once (a step retried after a failover carries "
                                                         "it again); 0: always apply")
    left_padding: Optional[List[Annotated[int, Field(ge=0)]]] = Field(
        default=None, max_length=MAX_BATCH,
        description="only at start_position 0: each row's count of leading padding positions (never attended; "
                    "the row's positions count from its first real token); absent at 0: no padding")
    # left out of the message when None (a field added later: see `swarm.wire.protocol`'s Versions), so servers
    # from before still take every step that does not need it
    rope_length: Optional[int] = Field(
        default=None, gt=0, exclude_if=lambda value: value is None,
        description="where the client's step that this message is part of ends (>= this message's end): a rotary "
                    "that picks its factors by the sequence's length (LongRoPE) picks them by this one for every "
                    "part of the step, as one pass over the whole step would; None: this message's own end")

    @model_validator(mode="after")
    def _padding_at_start(self):
        if self.left_padding is not None and getattr(self, "start_position", 0) != 0:
            raise ValueError("left_padding is only accepted on a step at start_position 0")
        return self

    def row_edits(self) -> dict:
        return dict(hypo_ids=self.hypo_ids, reorder_id=self.reorder_id, left_padding=self.left_padding,
                    rope_length=self.rope_length)


def check_row_edits(edits: RowEdits, batch: int, max_length: int, end: Optional[int] = None) -> None:
    """ProtocolError unless `hypo_ids` / `left_padding` fit a session of `batch` rows and `max_length` positions, and
    `rope_length` lies in [end, max_length] (`end`: where the message's positions end)."""
    if edits.hypo_ids is not None:
        if len(edits.hypo_ids) != batch:
            raise ProtocolError(f"hypo_ids has {len(edits.hypo_ids)} entries; the session has {batch} rows")
        bad = [i for i in edits.hypo_ids if i >= batch]
        if bad:
            raise ProtocolError(f"hypo_ids {bad} are out of range for a session of {batch} rows")
    if edits.left_padding is not None:
        if len(edits.left_padding) != batch:
            raise ProtocolError(f"left_padding has {len(edits.left_padding)} entries; the session has {batch} rows")
        if max(edits.left_padding) >= max_length:
            raise ProtocolError(f"left_padding {max(edits.left_padding)} is not below max_length {max_length}")
    if edits.rope_length is not None and not (end or 0) <= edits.rope_length <= max_length:
        raise ProtocolError(f"rope_length {edits.rope_length} is outside [{end or 0}, {max_length}]: the step's end "
                            f"must be at or after this message's and within the session's max_length")


class Step(RowEdits):
    type: Literal["step"] = "step"
    start_position: int = Field(ge=0, description="position of the first token in this step")
    step_id: int = Field(default=0, ge=0)
    push_chain: List[PushTarget] = Field(default_factory=list, max_length=256,
                                         description="the servers after this one: push the output to the first")


class PushStep(RowEdits):
    """A server's output pushed to the next server of a chain (rpc_push stream), with the step's row edits."""

    type: Literal["push"] = "push"
    stream_key: str = Field(min_length=1, max_length=MAX_SESSION_ID_LEN + 16)
    push_token: str = Field(default="", max_length=MAX_TOKEN_LEN, description="must equal the session part's token")
    start_position: int = Field(ge=0)
    step_id: int = Field(ge=0)
    push_chain: List[PushTarget] = Field(default_factory=list, max_length=256)


class StepResult(Message):
    type: Literal["result"] = "result"
    position: int = Field(ge=0, description="tokens held in the session's cache after this step")
    step_id: int = 0
    pushed: bool = Field(default=False, description="the output was handed to the push target")


def stream_key(session_id: str, start: int) -> str:
    """Names one server's part of a session (a server may hold two parts of one session)."""
    return f"{session_id}:{start}"
