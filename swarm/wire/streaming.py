"""Streamed messages: one typed message plus tensors larger than a P2P message, split into chunks and rebuilt.

The training RPCs (`rpc_train_forward`, `rpc_train_backward`) carry activations, gradients and deep prompts that
can exceed hivemind's message limit (4 MiB). `pack` serializes the tensors, splits each buffer into parts of at
most `chunk_bytes` (hivemind's `split_for_streaming`: the first part names the shape, dtype and part count) and
groups the parts into messages of about `chunk_bytes`; the first message also carries the metadata (one
`swarm.wire.protocol` message). `collect` reads such a stream back, refusing it (`ProtocolError`) as soon as its
bytes or parts pass the receiver's limits, and `unpack` rebuilds the tensors through
`protocol.deserialize_tensor` (dtype, shape and byte size checked).
"""
from __future__ import annotations

from typing import AsyncIterator, List, Optional, Sequence, Tuple, Type, TypeVar, Union

import torch
from hivemind.proto import runtime_pb2
from hivemind.utils.streaming import combine_from_streaming, split_for_streaming

from swarm.wire import protocol as P

DEFAULT_CHUNK_BYTES = 1 << 20  # well under hivemind's 4 MiB message limit
MAX_PARTS = 1 << 16
EMPTY_STREAM = "empty stream"  # what `collect` raises when the stream ended before any message: no reply at all

Envelope = Union[runtime_pb2.ExpertRequest, runtime_pb2.ExpertResponse]
E = TypeVar("E", runtime_pb2.ExpertRequest, runtime_pb2.ExpertResponse)


def pack(envelope: Type[E], message: P.Message, tensors: Sequence[torch.Tensor],
         chunk_bytes: int = DEFAULT_CHUNK_BYTES) -> List[E]:
    """`message` and `tensors` as a list of envelopes (requests or responses), each under about `chunk_bytes`."""
    parts: List[runtime_pb2.Tensor] = []
    for tensor in tensors:
        parts.extend(split_for_streaming(P.serialize_tensor(tensor), chunk_bytes))
    out: List[E] = [envelope(metadata=P.encode(message))]
    size = 0
    for part in parts:
        if size and size + len(part.buffer) > chunk_bytes:
            out.append(envelope())
            size = 0
        out[-1].tensors.append(part)
        size += len(part.buffer)
    return out


async def collect(stream: AsyncIterator[Envelope], max_bytes: int) -> Tuple[bytes, List[runtime_pb2.Tensor]]:
    """Read a whole stream: (the first envelope's metadata, the tensor parts in order). ProtocolError if it is
    empty, carries metadata past its first envelope, or exceeds `max_bytes` / `MAX_PARTS`."""
    metadata: Optional[bytes] = None
    parts: List[runtime_pb2.Tensor] = []
    total = 0
    async for envelope in stream:
        if metadata is None:
            metadata = envelope.metadata
        elif envelope.metadata:
            raise P.ProtocolError("metadata is allowed in the first message of a stream only")
        for part in envelope.tensors:
            total += len(part.buffer)
            if total > max_bytes:
                raise P.ProtocolError(f"payload exceeds this server's limit of {max_bytes} bytes")
            parts.append(part)
        if len(parts) > MAX_PARTS:
            raise P.ProtocolError(f"payload has more than {MAX_PARTS} tensor parts")
    if metadata is None:
        raise P.ProtocolError(EMPTY_STREAM)
    return metadata, parts


def unpack(parts: Sequence[runtime_pb2.Tensor], max_elements: int = 1 << 28) -> List[torch.Tensor]:
    """The tensors split by `pack`, validated (`protocol.deserialize_tensor`)."""
    tensors: List[torch.Tensor] = []
    index = 0
    while index < len(parts):
        if not parts[index].dtype:
            raise P.ProtocolError("a tensor part without a header (dtype, shape) where a tensor should begin")
        count = max(int(parts[index].chunks), 1)  # an empty tensor is announced as 0 parts
        group = parts[index:index + count]
        if len(group) < count:
            raise P.ProtocolError(f"a tensor announced {count} parts but the stream ended after {len(group)}")
        tensors.append(P.deserialize_tensor(combine_from_streaming(group), max_elements=max_elements))
        index += count
    return tensors


async def read_reply(stream: AsyncIterator[runtime_pb2.ExpertResponse], message_type: Type[P.M], max_bytes: int,
                     peer_id: Optional[str] = None) -> Tuple[P.M, List[torch.Tensor]]:
    """A server's streamed reply: its message and tensors; RemoteError for an `ErrorReply`."""
    metadata, parts = await collect(stream, max_bytes)
    try:
        error = P.decode(metadata, P.ErrorReply)
    except P.ProtocolError:
        error = None
    if error is not None:
        raise P.RemoteError(error.code, error.message, peer_id)
    return P.decode(metadata, message_type), unpack(parts, max_elements=1 << 31)
