"""The wire protocol between clients and block servers: RPC names, typed versioned messages, tensors.

The protocol's one name for its users (`from swarm.wire import protocol as P`): the RPC surface (`BlockRPC`,
`ProvedStub`) and the request/reply helpers live here; the machinery (`Message`, versions, `encode` / `decode`,
tensors) in `swarm.wire.codec`, the session streams' messages in `swarm.wire.inference_messages`, the one-shot
calls' messages in `swarm.wire.call_messages`, all re-exported here.

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
- `rpc_round`: a long-lived stream per (client, server) carrying `RoundStep`s: the steps of many sessions opened on
  `rpc_inference` streams, one message per round, each row tagged with its session part (`swarm.wire.rounds`);
  `rpc_round_stats`: `RoundStats`, the server's round counters.
- `rpc_round_push`: a long-lived stream from one server to the next carrying `RoundPush`es: the outputs of a
  round's rows whose next hop is that server (each row with its part's push token), in one message; the receiver
  steps them on the client's round stream and answers the client there (`RoundResult.pushed`). Like `rpc_push`,
  its only replies are refusals.
- `rpc_sessions`: a long-lived stream per (client, server) carrying many sessions' `rpc_inference` streams as
  virtual streams, each message behind a frame header naming its part (`swarm.wire.channel`).
- `rpc_info`: `ServerStats`.
- `rpc_dht_traffic`: `DHTTrafficReport`, the server's DHT peer's traffic counters (`swarm.runtime.dht_traffic`).
- `rpc_prefix_cache`: `PrefixCacheReport`, the server's prefix cache counters (`server.compute.prefix_cache`).
- `rpc_prefix_outputs`: `PrefixOutputsRequest` -> `StepResult` and a tensor: the outputs at the prefix positions an
  open session part adopted without receiving them (`OpenSession.prefix_outputs` False).

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

from typing import AsyncIterator, List, Optional, Sequence, Tuple, Type, Union

import torch
from hivemind.p2p import P2PContext, ServicerBase
from hivemind.proto import runtime_pb2

from swarm.runtime.dht_traffic import DHTTraffic
from swarm.wire.call_messages import (
    DHTTrafficReport,
    ForwardRequest,
    ForwardResult,
    PrefixCacheReport,
    PrefixOutputsRequest,
    ServerStats,
    TrainBackward,
    TrainForward,
    TrainResult,
)
from swarm.wire.codec import (
    MAX_BATCH,
    MAX_SESSION_ID_LEN,
    MAX_TOKEN_LEN,
    ErrorReply,
    M,
    Message,
    ProtocolError,
    RemoteError,
    _parse,
    _validate,
    check_capabilities,
    decode,
    decode_parsed,
    deserialize_tensor,
    encode,
    request_version,
    serialize_tensor,
)
from swarm.wire.duplex import call_stream
from swarm.wire.inference_messages import (
    MAX_PREFIX_TOKENS,
    OpenSession,
    PrefixDecl,
    PushStep,
    PushTarget,
    RowEdits,
    RowIndex,
    Step,
    StepResult,
    check_row_edits,
    stream_key,
)

__all__ = [
    "MAX_BATCH", "MAX_SESSION_ID_LEN", "MAX_TOKEN_LEN", "ErrorReply", "M", "Message", "ProtocolError",
    "RemoteError", "check_capabilities", "decode", "decode_parsed", "deserialize_tensor", "encode", "request_version",
    "serialize_tensor", "OpenSession", "PushStep", "PushTarget", "RowEdits", "RowIndex", "Step", "StepResult",
    "check_row_edits", "stream_key", "MAX_PREFIX_TOKENS", "PrefixDecl", "PrefixCacheReport", "PrefixOutputsRequest",
    "DHTTrafficReport", "ForwardRequest", "ForwardResult", "ServerStats",
    "TrainBackward", "TrainForward", "TrainResult", "HANDLER_VERSION", "REQUEST_TYPES", "ReplyMessage",
    "decode_reply", "make_request", "make_response", "error_response", "unpack_reply", "BlockRPC", "ProvedStub",
    "parse_stats", "parse_dht_traffic",
]

# the RPC handlers' names keep "v1" for good (`swarmgate.v1.rpc_inference`): a later protocol version travels in the
# messages' `v`, never in the names, or a newer peer's handlers would vanish for an older one
HANDLER_VERSION = 1

REQUEST_TYPES: Tuple[Type["Message"], ...] = (OpenSession, Step, PushStep, ForwardRequest, TrainForward, TrainBackward,
                                              PrefixOutputsRequest)

ReplyMessage = Union[StepResult, ErrorReply]


def decode_reply(data: bytes, forward: bool = False) -> Union[StepResult, ForwardResult, ErrorReply]:
    """A server's reply to a step (`forward`: to a forward pass): its result or an error reply."""
    raw = _parse(data)
    kind: Type[Message] = ErrorReply if raw.get("type") == "error" else ForwardResult if forward else StepResult
    try:
        return _validate(raw, kind)  # type: ignore[return-value]
    except ProtocolError as e:
        raise ProtocolError(f"invalid reply from server: {e}") from None


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

    async def rpc_round(
        self, requests: AsyncIterator[runtime_pb2.ExpertRequest], context: P2PContext
    ) -> AsyncIterator[runtime_pb2.ExpertResponse]:
        raise NotImplementedError
        yield  # pragma: no cover

    async def rpc_round_stats(self, request: runtime_pb2.ExpertUID, context: P2PContext) -> runtime_pb2.ExpertInfo:
        raise NotImplementedError

    async def rpc_round_push(
        self, requests: AsyncIterator[runtime_pb2.ExpertRequest], context: P2PContext
    ) -> AsyncIterator[runtime_pb2.ExpertResponse]:
        raise NotImplementedError
        yield  # pragma: no cover

    async def rpc_sessions(
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

    async def rpc_prefix_outputs(self, request: runtime_pb2.ExpertRequest, context: P2PContext
                                 ) -> runtime_pb2.ExpertResponse:
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

    async def rpc_prefix_outputs(self, request: runtime_pb2.ExpertRequest, **kwargs):
        return await self._stub.rpc_prefix_outputs(self._proved(request), **kwargs)

    async def rpc_inference(self, requests: AsyncIterator[runtime_pb2.ExpertRequest]):
        return await self._long_lived("rpc_inference", requests)

    async def rpc_push(self, requests: AsyncIterator[runtime_pb2.ExpertRequest]):
        return await self._long_lived("rpc_push", requests)

    async def rpc_round(self, requests: AsyncIterator[runtime_pb2.ExpertRequest]):
        return await self._long_lived("rpc_round", requests)

    async def rpc_sessions(self, requests: AsyncIterator[runtime_pb2.ExpertRequest]):
        return await self._long_lived("rpc_sessions", requests)

    async def rpc_round_push(self, requests: AsyncIterator[runtime_pb2.ExpertRequest]):
        return await self._long_lived("rpc_round_push", requests)

    async def _long_lived(self, method: str, requests: AsyncIterator[runtime_pb2.ExpertRequest]):
        """A session's, push or round stream: its replies end as soon as the server's side closes
        (`swarm.wire.duplex`), not when this side's requests end too."""
        stub = self._stub
        return await call_stream(stub._p2p, stub._peer, BlockRPC._get_handle_name(stub._namespace, method),
                                 self._first_proved(requests), runtime_pb2.ExpertResponse)

    async def rpc_round_stats(self, request: runtime_pb2.ExpertUID, **kwargs):
        return await self._stub.rpc_round_stats(self._proved(request), **kwargs)

    async def rpc_train_forward(self, requests: AsyncIterator[runtime_pb2.ExpertRequest], **kwargs):
        return await self._stub.rpc_train_forward(self._first_proved(requests), **kwargs)

    async def rpc_train_backward(self, requests: AsyncIterator[runtime_pb2.ExpertRequest], **kwargs):
        return await self._stub.rpc_train_backward(self._first_proved(requests), **kwargs)


def parse_stats(info: runtime_pb2.ExpertInfo) -> ServerStats:
    return decode(info.serialized_info, ServerStats)


def parse_dht_traffic(info: runtime_pb2.ExpertInfo) -> Optional[DHTTraffic]:
    return decode(info.serialized_info, DHTTrafficReport).traffic
