"""The messages of the one-shot calls (see `swarm.wire.protocol`): a forward pass through a block range
(`rpc_forward`), the training passes (`rpc_train_forward` / `rpc_train_backward`), and the server's reports
(`rpc_info`'s `ServerStats`, `rpc_dht_traffic`'s `DHTTrafficReport`), and `rpc_prefix_outputs`' `PrefixOutputsRequest`.
"""
from __future__ import annotations

from typing import Annotated, List, Literal, Optional

from pydantic import Field

from swarm.runtime.dht_traffic import DHTTraffic
from swarm.wire.codec import MAX_BATCH, MAX_SESSION_ID_LEN, Message
from swarm.wire.records import ServerLimits


class ForwardRequest(Message):
    type: Literal["forward"] = "forward"
    start: int = Field(ge=0)
    end: int = Field(gt=0)
    adapter: Optional[str] = Field(default=None, min_length=1, max_length=128, description="as in OpenSession")
    left_padding: Optional[List[Annotated[int, Field(ge=0)]]] = Field(
        default=None, max_length=MAX_BATCH,
        description="each row's count of leading padding positions, never attended (length = batch, each below "
                    "the sequence length); positions are not shifted, as transformers' forward without position ids")
    rope_length: Optional[int] = Field(
        default=None, gt=0, exclude_if=lambda value: value is None,
        description="as `Step.rope_length` (>= the sequence length; left out when None): a spot-check replays a "
                    "session's positions with the factors its step picked")


class ForwardResult(Message):
    type: Literal["forward_result"] = "forward_result"


class TrainForward(Message):
    """tensors: hidden [batch, seq, hidden], then deep prompts [end - start, batch | 1, pre_seq_len, hidden] if
    `prompts`."""

    type: Literal["train_forward"] = "train_forward"
    start: int = Field(ge=0)
    end: int = Field(gt=0)
    prompts: bool = False
    # left out of the message when None (a field added later: see `swarm.wire.protocol`'s Versions), so servers
    # from before still take every training call on the base model
    adapter: Optional[str] = Field(default=None, min_length=1, max_length=128, exclude_if=lambda value: value is None,
                                   description="the LoRA adapter the blocks run with (None: the base model)")


class TrainBackward(Message):
    """tensors: hidden (the span's input) and grad_output, both [batch, seq, hidden], then the prompts if
    `prompts`."""

    type: Literal["train_backward"] = "train_backward"
    start: int = Field(ge=0)
    end: int = Field(gt=0)
    prompts: bool = False
    # left out of the message when None (a field added later: see `swarm.wire.protocol`'s Versions), so servers
    # from before still take every training call on the base model
    adapter: Optional[str] = Field(default=None, min_length=1, max_length=128, exclude_if=lambda value: value is None,
                                   description="the LoRA adapter the blocks run with (None: the base model)")


class TrainResult(Message):
    """tensors: the output (forward) or grad_input, then grad_prompts (backward with prompts)."""

    type: Literal["train_result"] = "train_result"


class ServerStats(Message):
    type: Literal["info"] = "info"
    version: str
    model: str
    start: int
    end: int
    num_blocks_total: int
    dtype: str
    hidden_size: int
    cache_tokens_total: int
    cache_tokens_used: int
    sessions_open: int
    streams_open: int = Field(default=0, description="inference streams and training calls open now")
    inference_tokens_processed: int = Field(description="tokens received by inference steps since start")
    inference_steps: int
    forward_tokens_processed: int
    steps_from_push: int = 0
    pushes_sent: int = 0
    pushes_refused: int = Field(default=0, description="pushes refused for a wrong push token (hijack attempts)")
    decode_batches: int = 0
    largest_batch: int = 0
    decode_compute_seconds: float = 0.0
    training_tokens_processed: int = Field(default=0, description="tokens of training forward/backward passes")
    limits: Optional[ServerLimits] = Field(default=None, description="the resource limits the server enforces")
    # no field may be added here: clients parse exactly these (see `swarm.wire.protocol`'s Versions); a new report
    # gets its own RPC, as `DHTTrafficReport` did


class DHTTrafficReport(Message):
    """`rpc_dht_traffic`'s reply: the server's DHT peer's traffic since it started, as of its last announcement."""

    type: Literal["dht_traffic"] = "dht_traffic"
    traffic: Optional[DHTTraffic] = Field(default=None, description="None: not read yet (before the first "
                                                                    "announcement with blocks loaded)")


class PrefixCacheReport(Message):
    """`rpc_prefix_cache`'s reply: the server's prefix cache (`server.compute.prefix_cache`) since it started."""

    type: Literal["prefix_cache"] = "prefix_cache"
    enabled: bool
    page_tokens: int = 0
    pages_held: int = 0
    pages_hit: int = Field(default=0, description="pages adopted by new sessions")
    pages_computed: int = Field(default=0, description="pages of declared prompts that sessions computed (stored "
                                                       "or not: a page two sessions computed counts twice)")
    pages_evicted: int = Field(default=0, description="pages dropped for room")
    sessions_declined: int = Field(default=0, description="sessions that declared a prefix the cache declines")


class PrefixOutputsRequest(Message):
    """`rpc_prefix_outputs`' request: the span's outputs at the prefix positions that an open session part adopted
    when it opened with `OpenSession.prefix_outputs` False (the server kept them instead of sending them). The reply
    is a `StepResult` (`position`: the positions sent) with those outputs [batch, positions, hidden] as its tensor;
    only the peer that opened the session part may ask."""

    type: Literal["prefix_outputs"] = "prefix_outputs"
    stream_key: str = Field(min_length=1, max_length=MAX_SESSION_ID_LEN + 16, description="the session part's "
                                                                                          "`stream_key`")
    positions: int = Field(gt=0, description="positions [0, positions): at most those the session part adopted")
