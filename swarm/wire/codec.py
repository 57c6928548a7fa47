"""The message machinery of the wire: the `Message` base, protocol versions, errors, tensors as bytes.

A message is one JSON-encoded pydantic model (with a protocol version `v` and a `type` tag) that rejects unknown
fields and versions this peer does not speak (`SPOKEN`); `encode` writes it in a given version (older ones through
the message's `downgrade`), `decode` reads it (older ones through its `upgrade`), each raising `ProtocolError` with a
readable reason. Tensors travel as raw bytes in their own dtype (or compressed, `swarm.wire.compression`) and are
checked (dtype, byte size, element count) before they are materialized. The messages themselves are in
`swarm.wire.inference_messages` and `swarm.wire.call_messages`; the RPCs and the rules for versions in
`swarm.wire.protocol`.
"""
from __future__ import annotations

import json
import math
from typing import Collection, Literal, Optional, Tuple, Type, TypeVar

import torch
from hivemind.proto import runtime_pb2
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from swarm.wire import compression as wire_compression
from swarm.wire.capabilities import MIN_PROTOCOL_VERSION, PROTOCOL_VERSION, needed_capabilities
from swarm.wire.dtypes import DTYPES, WIRE_DTYPES, dtype_name

MAX_SESSION_ID_LEN = 128
MAX_TOKEN_LEN = 64  # push tokens (`OpenSession.push_token`)
MAX_BATCH = 1024

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


class ErrorReply(Message):
    type: Literal["error"] = "error"
    code: str
    message: str


def check_capabilities(message: "Message", capabilities: Collection[str], peer_id: Optional[str] = None) -> None:
    """ProtocolError unless a server announcing `capabilities` takes `message` (a client never sends it then:
    routing keeps to servers with what a request needs, so this only fires on a bug)."""
    lacking = needed_capabilities(message) - set(capabilities)
    if lacking:
        raise ProtocolError(f"not sent: {type(message).__name__} needs {', '.join(sorted(lacking))}, which server "
                            f"{peer_id or '?'} does not announce")

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


def decode_parsed(raw: dict, message_type: Type[M]) -> M:
    """`decode` of metadata already parsed from JSON (a reader that looked at its `type` first parses it once)."""
    return _validate(raw, message_type)


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
