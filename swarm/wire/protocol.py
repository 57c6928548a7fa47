"""The wire protocol between clients and block servers: RPC names, typed versioned messages, tensors.

Transport: hivemind P2P protobuf handlers. Each request/response is a `runtime_pb2.ExpertRequest` /
`ExpertResponse` whose `metadata` holds one JSON-encoded pydantic message (with a protocol version `v` and a
`type` tag) and whose `tensors` carry raw tensors in their own dtype. Every message rejects unknown fields and
wrong versions, and tensors are checked (dtype, byte size, element count) before they are materialized.

RPCs (see `BlockRPC`):
- `rpc_inference`: a bidirectional stream per session. The first request is `OpenSession` (with deep prompts
  as its tensor if `prompts`); then each
  `Step` carries hidden states `[batch, seq, hidden]` starting at `start_position`; each gets a `StepResult`
  (the output hidden states) or an `ErrorReply`. Closing the stream frees the session's KV cache. A step may
  reorder the cache's rows first (`hypo_ids`: beam search's parent beams) and a step at position 0 may set the
  rows' left padding (`left_padding`: those keys are never attended, each row's positions start at its first
  real token, as transformers computes `position_ids` from an attention mask).
- `rpc_push`: a long-lived stream from one server to the next carrying `PushStep`s: in a decode step each
  server hands its output straight to the next server of the chain (named by the client in `Step.push_chain`).
  A push is bound to its session: it must carry the `push_token` the client gave that session part when it
  opened (a secret the client passes only down the chain); a wrong or missing token is refused with an
  `ErrorReply` (`forbidden`) on the push stream, the only reply a push stream ever gets.
- `rpc_forward`: one pass of hidden states through a block range, no cache.
- `rpc_train_forward` / `rpc_train_backward`: streamed (`swarm.wire.streaming`, chunks under the message limit)
  passes for training. `TrainForward` + hidden `[batch, seq, hidden]` (+ deep prompts `[blocks, batch | 1,
  pre_seq_len, hidden]`, added to the first pre_seq_len positions of each block's input) -> `TrainResult` + the
  output; `TrainBackward` + hidden, grad_output (+ prompts) -> `TrainResult` + grad_input (+ grad_prompts). The
  server keeps nothing between the two calls: backward recomputes the span's forward from the inputs it is sent.
- `rpc_info`: `ServerStats`.
- `rpc_dht_traffic`: `DHTTrafficReport`, the server's DHT peer's traffic counters (`swarm.runtime.dht_traffic`).
- `rpc_prefix_cache`: `PrefixCacheReport`, the server's prefix cache counters (`server.compute.prefix_cache`).

Versions. Every message rejects unknown fields, so a reader parses exactly the fields of its own version. A field
added to a message later is optional and never reaches a reader from before it: in a request it is left out
while unset (`OpenSession.compression`: a server from before takes every session that does not ask for
compression), and a client sets it only for a server whose record announces the capability that names it
(`swarm.wire.capabilities.FIELD_CAPABILITIES`, checked before each request goes: `check_capabilities`; routing
avoids servers without what a session needs); a reply (`ServerStats`) keeps
the fields it had, and what a server reports later gets an RPC of its own (`rpc_dht_traffic`), which a server from
before answers with the transport's "no such handler" error. A peer accepts messages of the protocol versions
`MIN_PROTOCOL_VERSION..PROTOCOL_VERSION` (so far only 1) and a server answers in the version it was sent. The rule
for adding a field is in `docs/compatibility.md`.

In a private swarm the `uid` of a stream's first request (of every `rpc_forward` request, of `rpc_info`'s
`ExpertUID`) carries the caller's membership proof (`swarm.runtime.swarm_key`; `ProvedStub` stamps it);
otherwise it is empty.
"""
from __future__ import annotations

import json
import math
from typing import (
    Annotated,
    AsyncIterator,
    Collection,
    List,
    Literal,
    Optional,
    Sequence,
    Tuple,
    Type,
    TypeVar,
    Union,
)

import torch
from hivemind.p2p import P2PContext, ServicerBase
from hivemind.proto import runtime_pb2
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from swarm.runtime.dht_traffic import DHTTraffic
from swarm.wire import compression as wire_compression
from swarm.wire.capabilities import MIN_PROTOCOL_VERSION, PROTOCOL_VERSION, needed_capabilities
from swarm.wire.dtypes import DTYPES, WIRE_DTYPES, dtype_name
from swarm.wire.records import ServerLimits

# the RPC handlers' names keep "v1" for good (`swarmgate.v1.rpc_inference`): a later protocol version travels in the
# messages' `v`, never in the names, or a newer peer's handlers would vanish for an older one
HANDLER_VERSION = 1
MAX_SESSION_ID_LEN = 128
MAX_TOKEN_LEN = 64  # push tokens (`OpenSession.push_token`)
MAX_BATCH = 1024
MAX_PREFIX_TOKENS = 1 << 17  # `PrefixDecl.tokens`

M = TypeVar("M", bound="Message")


class ProtocolError(ValueError):
    """A message that does not follow the protocol; the text is safe to send back to the peer."""


class RemoteError(RuntimeError):
    """An error reply from a server (carries the server's error code)."""

    def __init__(self, code: str, message: str, peer_id: Optional[str] = None):
        super().__init__(f"[{code}] {message}" + (f" (server {peer_id})" if peer_id else ""))
        self.code, self.message, self.peer_id = code, message, peer_id


# the message versions this peer reads and writes (`decode`, `encode`): a module value so that tests can run the
# mechanism over a range of versions with test-only message types, while the wire speaks only version 1
SPOKEN: Tuple[int, int] = (MIN_PROTOCOL_VERSION, PROTOCOL_VERSION)


class Message(BaseModel):
    """One message. Its fields are always this release's; `v` is the protocol version it is written in: a decoded
    request keeps the version it came in, and a reply built with that `v` (or encoded with `version=`) goes out in
    it (`encode` writes older versions through `downgrade`; `decode` reads them through `upgrade`)."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    v: int = Field(default=PROTOCOL_VERSION, ge=1)

    @classmethod
    def upgrade(cls, raw: dict, version: int) -> dict:
        """A message of this type as written in an older spoken `version`, rewritten in this release's fields (a
        message that changed in a later version overrides this; none has yet)."""
        return raw

    def downgrade(self, data: dict, version: int) -> dict:
        """This message's fields (`data`, JSON) rewritten for an older spoken `version`: the inverse of `upgrade`."""
        return data


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
    # left out of the message when None (a field added later: see Versions), so servers from before still take
    # every step that does not need it
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


class ErrorReply(Message):
    type: Literal["error"] = "error"
    code: str
    message: str


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
    # left out of the message when None (a field added later: see Versions), so servers from before still take
    # every training call on the base model
    adapter: Optional[str] = Field(default=None, min_length=1, max_length=128, exclude_if=lambda value: value is None,
                                   description="the LoRA adapter the blocks run with (None: the base model)")


class TrainBackward(Message):
    """tensors: hidden (the span's input) and grad_output, both [batch, seq, hidden], then the prompts if
    `prompts`."""

    type: Literal["train_backward"] = "train_backward"
    start: int = Field(ge=0)
    end: int = Field(gt=0)
    prompts: bool = False
    # left out of the message when None (a field added later: see Versions), so servers from before still take
    # every training call on the base model
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
    # no field may be added here: clients parse exactly these (see the module's Versions); a new report gets its
    # own RPC, as `DHTTrafficReport` did


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
    pages_computed: int = Field(default=0, description="pages stored after a session computed them")
    pages_evicted: int = Field(default=0, description="pages dropped for room")
    sessions_declined: int = Field(default=0, description="sessions that declared a prefix the cache declines")


REQUEST_TYPES: Tuple[Type["Message"], ...] = (OpenSession, Step, PushStep, ForwardRequest, TrainForward, TrainBackward)


def check_capabilities(message: "Message", capabilities: Collection[str], peer_id: Optional[str] = None) -> None:
    """ProtocolError unless a server announcing `capabilities` takes `message` (a client never sends it then:
    routing keeps to servers with what a request needs, so this only fires on a bug)."""
    lacking = needed_capabilities(message) - set(capabilities)
    if lacking:
        raise ProtocolError(f"not sent: {type(message).__name__} needs {', '.join(sorted(lacking))}, which server "
                            f"{peer_id or '?'} does not announce")


ReplyMessage = Union[StepResult, ErrorReply]


def _check_version(version: object) -> int:
    low, high = SPOKEN
    if isinstance(version, bool) or not isinstance(version, int) or not low <= version <= high:
        raise ProtocolError(f"unsupported protocol version {version!r}; this peer speaks {low}..{high}")
    return version


def encode(message: Message, version: Optional[int] = None) -> bytes:
    """`message` as JSON in protocol `version` (None: the message's own `v`): a server answers each request in the
    version it came in. Versions older than this release's newest go through the message's `downgrade`."""
    version = _check_version(message.v if version is None else version)
    if version == message.v == SPOKEN[1]:  # this release's own form: the hot path
        return message.model_dump_json().encode()
    data = json.loads(message.model_dump_json())
    data["v"] = version
    if version < SPOKEN[1]:
        data = message.downgrade(data, version)
    return json.dumps(data, separators=(",", ":")).encode()


def request_version(data: bytes) -> int:
    """The protocol version a request is written in, for its reply: its `v` if this peer speaks it, else this
    peer's newest (the error that follows names the versions it speaks)."""
    try:
        return _check_version(json.loads(data).get("v"))
    except (ValueError, UnicodeDecodeError, AttributeError, ProtocolError):
        return SPOKEN[1]


def _parse(data: bytes) -> dict:
    try:
        raw = json.loads(data)
    except (ValueError, UnicodeDecodeError):
        raise ProtocolError("metadata is not valid JSON") from None
    if not isinstance(raw, dict):
        raise ProtocolError("metadata must be a JSON object")
    return raw


def _validate(raw: dict, message_type: Type[M]) -> M:
    version = _check_version(raw.get("v"))
    if version < SPOKEN[1]:
        raw = message_type.upgrade(dict(raw), version)
    try:
        return message_type.model_validate(raw)
    except ValidationError as e:
        reasons = "; ".join(f"{'.'.join(map(str, err['loc']))}: {err['msg']}" for err in e.errors())
        raise ProtocolError(f"invalid {message_type.__name__}: {reasons}") from None


def decode(data: bytes, message_type: Type[M]) -> M:
    """Parse bytes into `message_type` (of a spoken version, read through its `upgrade`; the message keeps its `v`),
    raising ProtocolError with a readable reason otherwise."""
    return _validate(_parse(data), message_type)


def decode_reply(data: bytes, forward: bool = False) -> Union[StepResult, ForwardResult, ErrorReply]:
    """A server's reply to a step (`forward`: to a forward pass): its result or an error reply."""
    raw = _parse(data)
    kind: Type[Message] = ErrorReply if raw.get("type") == "error" else ForwardResult if forward else StepResult
    try:
        return _validate(raw, kind)  # type: ignore[return-value]
    except ProtocolError as e:
        raise ProtocolError(f"invalid reply from server: {e}") from None


def serialize_tensor(tensor: torch.Tensor, compression: str = "none") -> runtime_pb2.Tensor:
    """Raw bytes in the tensor's own dtype (no casts); bfloat16 travels as its 2-byte pattern. With a
    `compression` (`swarm.wire.compression`) that applies to the tensor, its compressed form instead."""
    if compression != "none" and wire_compression.applies(tensor, compression):
        return wire_compression.compress(tensor, compression)
    tensor = tensor.detach()
    if tensor.device.type != "cpu":
        tensor = tensor.cpu()
    tensor = tensor.contiguous()
    name = dtype_name(tensor.dtype)
    if name not in WIRE_DTYPES:
        raise ProtocolError(f"dtype {name} cannot be sent")
    raw = tensor.view(torch.int16) if tensor.dtype == torch.bfloat16 else tensor
    return runtime_pb2.Tensor(buffer=raw.numpy().tobytes(), size=list(tensor.shape), dtype=name)


def deserialize_tensor(
    proto: runtime_pb2.Tensor, max_elements: int = 1 << 28, allowed: Optional[dict] = None
) -> torch.Tensor:
    """Rebuild a tensor after checking its dtype, shape and byte size; ProtocolError on any mismatch."""
    allowed = DTYPES if allowed is None else allowed
    if proto.compression != runtime_pb2.CompressionType.NONE:  # float16 / blockwise8 (swarm.wire.compression)
        try:
            return wire_compression.decompress(proto, max_elements, allowed)
        except wire_compression.CompressionError as e:
            raise ProtocolError(str(e)) from None
    dtype = allowed.get(proto.dtype)
    if dtype is None:
        raise ProtocolError(f"dtype {proto.dtype!r} is not accepted here (allowed: {sorted(allowed)})")
    shape = tuple(proto.size)
    if any(d < 0 for d in shape):
        raise ProtocolError(f"negative dimension in shape {shape}")
    numel = math.prod(shape)
    if numel > max_elements:
        raise ProtocolError(f"tensor of {numel} elements exceeds the limit of {max_elements}")
    itemsize = torch.empty((), dtype=dtype).element_size()
    if len(proto.buffer) != numel * itemsize:
        raise ProtocolError(f"tensor buffer has {len(proto.buffer)} bytes, shape {shape} needs {numel * itemsize}")
    if numel == 0:
        return torch.empty(shape, dtype=dtype)
    storage_dtype = torch.int16 if dtype == torch.bfloat16 else dtype
    flat = torch.frombuffer(bytearray(proto.buffer), dtype=storage_dtype)
    if dtype == torch.bfloat16:
        flat = flat.view(torch.bfloat16)
    return flat.view(shape)


def make_request(message: Message, tensors: Sequence[torch.Tensor] = (), uid: str = "",
                 compression: str = "none") -> runtime_pb2.ExpertRequest:
    return runtime_pb2.ExpertRequest(uid=uid, metadata=encode(message),
                                     tensors=[serialize_tensor(t, compression) for t in tensors])


def make_response(message: Message, tensors: Sequence[torch.Tensor] = (), compression: str = "none",
                  version: Optional[int] = None) -> runtime_pb2.ExpertResponse:
    """A reply; `version`: the request's (`encode`)."""
    return runtime_pb2.ExpertResponse(metadata=encode(message, version),
                                      tensors=[serialize_tensor(t, compression) for t in tensors])


def error_response(code: str, message: str, version: Optional[int] = None) -> runtime_pb2.ExpertResponse:
    return make_response(ErrorReply(code=code, message=message), version=version)


def unpack_reply(
    response: runtime_pb2.ExpertResponse, peer_id: Optional[str] = None, forward: bool = False
) -> Tuple[Union[StepResult, ForwardResult], List[torch.Tensor]]:
    """Decode a server reply; raises RemoteError for an error reply."""
    reply = decode_reply(response.metadata, forward=forward)
    if isinstance(reply, ErrorReply):
        raise RemoteError(reply.code, reply.message, peer_id)
    tensors = [deserialize_tensor(t, max_elements=1 << 31) for t in response.tensors]
    return reply, tensors


class BlockRPC(ServicerBase):
    """The RPC surface of a block server. Servers subclass it; clients use `BlockRPC.get_stub(p2p, peer)`."""

    @classmethod
    def _get_handle_name(cls, namespace: Optional[str], method_name: str) -> str:
        name = f"swarmgate.v{HANDLER_VERSION}.{method_name}"
        return f"{namespace}::{name}" if namespace is not None else name

    async def rpc_inference(
        self, requests: AsyncIterator[runtime_pb2.ExpertRequest], context: P2PContext
    ) -> AsyncIterator[runtime_pb2.ExpertResponse]:
        raise NotImplementedError
        yield  # pragma: no cover  (makes this an async generator)

    async def rpc_forward(self, request: runtime_pb2.ExpertRequest, context: P2PContext) -> runtime_pb2.ExpertResponse:
        raise NotImplementedError

    async def rpc_train_forward(
        self, requests: AsyncIterator[runtime_pb2.ExpertRequest], context: P2PContext
    ) -> AsyncIterator[runtime_pb2.ExpertResponse]:
        raise NotImplementedError
        yield  # pragma: no cover

    async def rpc_train_backward(
        self, requests: AsyncIterator[runtime_pb2.ExpertRequest], context: P2PContext
    ) -> AsyncIterator[runtime_pb2.ExpertResponse]:
        raise NotImplementedError
        yield  # pragma: no cover

    async def rpc_push(
        self, requests: AsyncIterator[runtime_pb2.ExpertRequest], context: P2PContext
    ) -> AsyncIterator[runtime_pb2.ExpertResponse]:
        raise NotImplementedError
        yield  # pragma: no cover

    async def rpc_info(self, request: runtime_pb2.ExpertUID, context: P2PContext) -> runtime_pb2.ExpertInfo:
        raise NotImplementedError

    async def rpc_dht_traffic(self, request: runtime_pb2.ExpertUID, context: P2PContext) -> runtime_pb2.ExpertInfo:
        raise NotImplementedError

    async def rpc_prefix_cache(self, request: runtime_pb2.ExpertUID, context: P2PContext) -> runtime_pb2.ExpertInfo:
        raise NotImplementedError


class ProvedStub:
    """A `BlockRPC` stub whose calls carry `proof` (a private swarm's membership proof, `swarm.runtime.swarm_key`)
    in the `uid` of their request, or of a stream's first request; with an empty proof requests go as they are."""

    def __init__(self, stub, proof: str):
        self._stub, self._proof = stub, proof

    def _proved(self, request):
        if self._proof:
            request.uid = self._proof
        return request

    async def _first_proved(self, requests: AsyncIterator) -> AsyncIterator:
        first = True
        async for request in requests:
            yield self._proved(request) if first else request
            first = False

    async def rpc_info(self, request: runtime_pb2.ExpertUID, **kwargs):
        return await self._stub.rpc_info(self._proved(request), **kwargs)

    async def rpc_dht_traffic(self, request: runtime_pb2.ExpertUID, **kwargs):
        return await self._stub.rpc_dht_traffic(self._proved(request), **kwargs)

    async def rpc_prefix_cache(self, request: runtime_pb2.ExpertUID, **kwargs):
        return await self._stub.rpc_prefix_cache(self._proved(request), **kwargs)

    async def rpc_forward(self, request: runtime_pb2.ExpertRequest, **kwargs):
        return await self._stub.rpc_forward(self._proved(request), **kwargs)

    async def rpc_inference(self, requests: AsyncIterator[runtime_pb2.ExpertRequest], **kwargs):
        return await self._stub.rpc_inference(self._first_proved(requests), **kwargs)

    async def rpc_push(self, requests: AsyncIterator[runtime_pb2.ExpertRequest], **kwargs):
        return await self._stub.rpc_push(self._first_proved(requests), **kwargs)

    async def rpc_train_forward(self, requests: AsyncIterator[runtime_pb2.ExpertRequest], **kwargs):
        return await self._stub.rpc_train_forward(self._first_proved(requests), **kwargs)

    async def rpc_train_backward(self, requests: AsyncIterator[runtime_pb2.ExpertRequest], **kwargs):
        return await self._stub.rpc_train_backward(self._first_proved(requests), **kwargs)


def parse_stats(info: runtime_pb2.ExpertInfo) -> ServerStats:
    return decode(info.serialized_info, ServerStats)


def parse_dht_traffic(info: runtime_pb2.ExpertInfo) -> Optional[DHTTraffic]:
    return decode(info.serialized_info, DHTTrafficReport).traffic
