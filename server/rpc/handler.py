"""The RPC handlers of a block server: `BlockHandler`, its request checks, the push stream, forward passes and the
info calls (the inference stream is `server.rpc.inference.InferenceHandler`'s, the round stream that steps many of its
sessions in one message `server.rpc.rounds.RoundHandler`'s, the channel that carries many sessions' streams in one
`server.rpc.channel.ChannelHandler`'s, the training passes `server.rpc.training.TrainingHandler`'s:
this class extends them).

Every request is validated before any tensor work (message schema and version, block range, tensor dtype and
shape, positions against the session's cache and `max_length`, finite values, beam parent ids and padding against
the session's rows) and against the resource limits of `server/rpc/limits.py` (message size, tokens per step, streams,
sessions per peer, queued steps). A bad step gets an
`ErrorReply` on its own stream and leaves the session as it was; other sessions and the server go on. A
session's cache is reserved when its stream opens and released when the stream ends for any reason. In a
private swarm (`swarm_key`), every RPC is refused (`forbidden`) unless its first request proves the caller's
membership for the connection's peer id (`swarm.runtime.swarm_key`).
"""
from __future__ import annotations

import logging
from functools import partial
from typing import AsyncIterator, Optional

import torch
from hivemind.p2p import P2PContext
from hivemind.proto import runtime_pb2

from server.compute.blocks import BlockSpan
from server.compute.cache import CacheBudget
from server.compute.decode import host_outputs
from server.rpc.channel import ChannelHandler
from server.rpc.inference import Counters
from server.rpc.limits import LimitError, RpcLimits, StreamLimiter
from server.rpc.push import PushRefused, PushRouter, PushSender, proven_pushes
from server.rpc.rounds import RoundHandler
from server.rpc.training import TrainingHandler
from swarm.runtime.dht_traffic import DHTTraffic
from swarm.runtime.swarm_key import NOT_A_MEMBER, SwarmKey, proof_for
from swarm.runtime.taskpool import PRIORITY_FORWARD, TaskPool
from swarm.wire import protocol as P

logger = logging.getLogger(__name__)


class BlockHandler(RoundHandler, ChannelHandler, TrainingHandler):
    compression = "none"  # hidden states of sessions that do not ask (`--compression`, swarm.wire.compression)

    def __init__(self, span: BlockSpan, model_name: str, version: str, budget: CacheBudget, pool: TaskPool,
                 max_length: int, alloc_timeout: float, step_timeout: float, max_batch_tokens: int = 1 << 16,
                 prefill_chunk: int = 256, swarm_key: Optional[SwarmKey] = None, limits: RpcLimits = RpcLimits(),
                 prefill_batch_tokens: int = 256):
        self.span, self.model_name, self.version = span, model_name, version
        self.swarm_key = swarm_key
        self.budget, self.pool = budget, pool
        self.max_length, self.alloc_timeout, self.step_timeout = max_length, alloc_timeout, step_timeout
        self.limits, self.streams = limits, StreamLimiter(limits)
        # tokens per training call (`server.rpc.training`), under the inference steps' cap too
        self.max_batch_tokens = min(max_batch_tokens, limits.max_step_tokens)
        self.prefill_chunk = prefill_chunk
        self.prefill_batch_tokens = prefill_batch_tokens  # `--prefill_batch_tokens`: most tokens in one prefill pass
        self.counters = Counters()
        self.dht_traffic: Optional[DHTTraffic] = None  # the server's DHT traffic at its last announcement
        self.accepting = True
        self.push_router = PushRouter()
        self.open_parts = {}  # stream key -> open session part (`server.rpc.rounds` attaches to them)
        self.round_routes = {}  # stream key -> the round stream it is attached to (`server.rpc.rounds`)
        self.pusher: Optional[PushSender] = None

    # ---- validation -------------------------------------------------------------------------------------
    def _admits(self, context: P2PContext, proof: str) -> bool:
        """Whether the caller may use this server: any peer in an open swarm, members in a private one."""
        if self.swarm_key is None or self.swarm_key.is_member(context.remote_id, proof):
            return True
        logger.warning(f"refused an RPC from {context.remote_id}: no valid proof of the swarm key")
        return False

    def _check_range(self, start: int, end: int) -> None:
        if not (self.span.start <= start < end <= self.span.end):
            raise P.ProtocolError(
                f"blocks {start}:{end} are not served here (this server holds {self.span.start}:{self.span.end})"
            )

    def _check_adapter(self, adapter: Optional[str]) -> None:
        if adapter is not None and adapter not in self.span.adapters:
            raise P.ProtocolError(f"adapter {adapter!r} is not served here (this server has: "
                                  f"{', '.join(sorted(self.span.adapters)) or 'none'})")

    def _hidden_from(self, request: runtime_pb2.ExpertRequest) -> torch.Tensor:
        if len(request.tensors) != 1:
            raise P.ProtocolError(f"expected exactly 1 tensor (hidden states), got {len(request.tensors)}")
        shape = list(request.tensors[0].size)
        if len(shape) != 3 or shape[-1] != self.span.hidden_size or shape[1] <= 0 or shape[0] <= 0:
            raise P.ProtocolError(
                f"hidden states must have shape [batch, seq>0, {self.span.hidden_size}], got {shape}"
            )
        self.limits.check_step_tokens(shape[0] * shape[1])
        hidden = P.deserialize_tensor(request.tensors[0],
                                      max_elements=self.limits.max_step_tokens * self.span.hidden_size)
        if not torch.isfinite(hidden).all():
            raise P.ProtocolError("hidden states contain NaN or infinite values")
        return hidden

    # ---- push ---------------------------------------------------------------------------------------------
    async def add_p2p_handlers(self, p2p, *args, **kwargs) -> None:
        self.pusher = PushSender(p2p, proof=proof_for(self.swarm_key, p2p.peer_id))
        await super().add_p2p_handlers(p2p, *args, **kwargs)

    async def remove_p2p_handlers(self, p2p, *args, **kwargs) -> None:
        """Stop serving: the RPC handlers go, and so do the push streams to next servers (they must not outlive
        the span, e.g. across a move to other blocks)."""
        try:
            await super().remove_p2p_handlers(p2p, *args, **kwargs)
        finally:
            if self.pusher is not None:
                self.pusher.close()

    async def rpc_push(
        self, requests: AsyncIterator[runtime_pb2.ExpertRequest], context: P2PContext
    ) -> AsyncIterator[runtime_pb2.ExpertResponse]:
        """Pushes from a previous server: each goes to the input queue of the session part it names if it carries
        that part's push token; a push with a wrong token gets a `forbidden` reply (the stream goes on)."""
        def parse(request: runtime_pb2.ExpertRequest) -> P.PushStep:
            self.limits.check_message(request)
            return P.decode(request.metadata, P.PushStep)

        async for request, pushed in proven_pushes(requests, context.remote_id,
                                                   lambda uid: self._admits(context, uid), parse, "push"):
            try:
                self.push_router.deliver(pushed.stream_key, pushed.push_token, request)  # unknown keys: ended
            except PushRefused as e:
                logger.warning(f"refused a push from {context.remote_id}: {e}")
                self.counters.pushes_refused += 1
                yield P.error_response("forbidden", str(e), P.request_version(request.metadata))

    # ---- forward (no cache) -----------------------------------------------------------------------------
    async def rpc_forward(self, request: runtime_pb2.ExpertRequest, context: P2PContext) -> runtime_pb2.ExpertResponse:
        version = P.request_version(request.metadata)  # the reply's (`swarm.wire.protocol.encode`)
        error = partial(P.error_response, version=version)
        if not self._admits(context, request.uid):
            return error("forbidden", NOT_A_MEMBER)
        try:
            self.limits.check_message(request)
            message = P.decode(request.metadata, P.ForwardRequest)
            self._check_range(message.start, message.end)
            self._check_adapter(message.adapter)
            hidden = self._hidden_from(request)
            if hidden.shape[1] > self.max_length:
                raise P.ProtocolError(f"sequence of {hidden.shape[1]} exceeds this server's limit {self.max_length}")
            padding = message.left_padding
            if padding is not None and (len(padding) != hidden.shape[0] or max(padding) >= hidden.shape[1]):
                raise P.ProtocolError(f"left_padding must have one entry per row ({hidden.shape[0]}), each below "
                                      f"the sequence length {hidden.shape[1]}")
            if message.rope_length is not None and not hidden.shape[1] <= message.rope_length <= self.max_length:
                raise P.ProtocolError(f"rope_length {message.rope_length} is outside [{hidden.shape[1]}, "
                                      f"{self.max_length}]: at least the sequence, at most this server's limit")
        except LimitError as e:
            return error("over_limit", str(e))
        except P.ProtocolError as e:
            return error("bad_request", str(e))
        rows_padding = None if padding is None else torch.tensor(padding)

        def forward() -> torch.Tensor:  # on the compute thread, the output brought to the host there
            return host_outputs([self.span.forward(hidden, 0, None, message.start, message.end, message.adapter,
                                                   rows_padding, rope_length=message.rope_length)])[0]

        try:
            output = await self.pool.submit(PRIORITY_FORWARD, forward)
        except Exception as e:
            logger.exception("forward failed")
            return error("internal", f"forward failed: {type(e).__name__}: {e}")
        self.counters.forward_tokens += hidden.shape[0] * hidden.shape[1]
        return P.make_response(P.ForwardResult(), [output], version=version)

    # ---- info -------------------------------------------------------------------------------------------
    def stats(self) -> P.ServerStats:
        return P.ServerStats(
            version=self.version, model=self.model_name, start=self.span.start, end=self.span.end,
            num_blocks_total=self.span.config.num_hidden_layers, dtype=str(self.span.dtype).replace("torch.", ""),
            hidden_size=self.span.hidden_size, cache_tokens_total=self.budget.max_tokens,
            # (sessions' reservations: kept prefix pages go for them, `rpc_prefix_cache` reports those)
            cache_tokens_used=self.budget.used_tokens - (self.prefix_cache.tokens if self.prefix_cache else 0),
            sessions_open=self.budget.num_sessions,
            streams_open=self.streams.streams,
            inference_tokens_processed=self.counters.inference_tokens, inference_steps=self.counters.inference_steps,
            forward_tokens_processed=self.counters.forward_tokens,
            steps_from_push=self.counters.steps_from_push, pushes_sent=self.counters.pushes_sent,
            pushes_refused=self.counters.pushes_refused,
            decode_batches=self.pool.batches_done, largest_batch=self.pool.largest_batch,
            decode_compute_seconds=round(self.counters.compute_seconds, 6),
            training_tokens_processed=self.training_tokens, limits=self.limits.announced(self.max_length),
        )

    async def rpc_info(self, request: runtime_pb2.ExpertUID, context: P2PContext) -> runtime_pb2.ExpertInfo:
        if not self._admits(context, request.uid):
            raise PermissionError(NOT_A_MEMBER)  # the caller gets an RPC error
        return runtime_pb2.ExpertInfo(serialized_info=P.encode(self.stats()))

    async def rpc_dht_traffic(self, request: runtime_pb2.ExpertUID, context: P2PContext) -> runtime_pb2.ExpertInfo:
        if not self._admits(context, request.uid):
            raise PermissionError(NOT_A_MEMBER)
        return runtime_pb2.ExpertInfo(serialized_info=P.encode(P.DHTTrafficReport(traffic=self.dht_traffic)))
