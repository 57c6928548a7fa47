"""The RPC handlers of a block server: inference streams, forward passes and the info call (the training passes
are `server.rpc.training.TrainingHandler`'s, which this class extends).

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

import asyncio
import logging
import time
import uuid
from dataclasses import dataclass
from functools import partial
from typing import AsyncIterator, Optional

import torch
from hivemind.p2p import P2PContext
from hivemind.proto import runtime_pb2

from server.compute.blocks import BlockSpan
from server.compute.cache import CacheBudget, OutOfCacheError
from server.rpc.limits import LimitError, RpcLimits, StreamLimiter
from server.rpc.push import PushRefused, PushRouter, PushSender
from server.rpc.training import TrainingHandler, drain_refused
from swarm.runtime import malloc
from swarm.runtime.dht_traffic import DHTTraffic
from swarm.runtime.swarm_key import NOT_A_MEMBER, SwarmKey, proof_for
from swarm.runtime.taskpool import PRIORITY_DECODE, PRIORITY_FORWARD, PRIORITY_PREFILL, TaskPool
from swarm.wire import protocol as P

logger = logging.getLogger(__name__)



@dataclass
class Counters:
    inference_tokens: int = 0
    inference_steps: int = 0
    forward_tokens: int = 0
    compute_seconds: float = 0.0  # time spent in inference forward passes
    steps_from_push: int = 0  # inference steps whose input came from the previous server
    pushes_sent: int = 0
    pushes_refused: int = 0  # pushes without the session part's push token


async def _pump(requests: AsyncIterator, inputs: asyncio.Queue) -> None:
    """Move the client's requests into the session's (bounded) input queue; None marks the client's end. A full
    queue stops reading the stream (back-pressure on the client) instead of holding its messages in memory."""
    try:
        async for request in requests:
            await inputs.put(("client", request))
    except asyncio.CancelledError:
        raise
    except Exception as e:
        logger.debug(f"client stream ended: {e}")
    await inputs.put(None)


class BlockHandler(TrainingHandler):
    compression = "none"  # hidden states of sessions that do not ask (`--compression`, swarm.wire.compression)

    def __init__(self, span: BlockSpan, model_name: str, version: str, budget: CacheBudget, pool: TaskPool,
                 max_length: int, alloc_timeout: float, step_timeout: float, max_batch_tokens: int = 1 << 16,
                 prefill_chunk: int = 256, swarm_key: Optional[SwarmKey] = None, limits: RpcLimits = RpcLimits()):
        self.span, self.model_name, self.version = span, model_name, version
        self.swarm_key = swarm_key
        self.budget, self.pool = budget, pool
        self.max_length, self.alloc_timeout, self.step_timeout = max_length, alloc_timeout, step_timeout
        self.limits, self.streams = limits, StreamLimiter(limits)
        # tokens per training call (`server.rpc.training`), under the inference steps' cap too
        self.max_batch_tokens = min(max_batch_tokens, limits.max_step_tokens)
        self.prefill_chunk = prefill_chunk
        self.counters = Counters()
        self.dht_traffic: Optional[DHTTraffic] = None  # the server's DHT traffic at its last announcement
        self.accepting = True
        self.push_router = PushRouter()
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

    # ---- inference --------------------------------------------------------------------------------------
    async def rpc_inference(
        self, requests: AsyncIterator[runtime_pb2.ExpertRequest], context: P2PContext
    ) -> AsyncIterator[runtime_pb2.ExpertResponse]:
        handle = registered = pump = kv = peer = None
        try:
            self.streams.enter_stream()
        except LimitError as e:
            yield P.error_response("over_limit", str(e))
            await drain_refused(requests)  # closing at once may reset the stream before the caller reads the reply
            return
        try:
            try:
                first = await asyncio.wait_for(requests.__anext__(), timeout=self.step_timeout)
            except StopAsyncIteration:
                return
            except asyncio.TimeoutError:
                yield P.error_response("timeout", f"no request within {self.step_timeout:g}s of opening the stream "
                                                  f"(the server's --step_timeout); stream closed")
                return
            # every reply of this stream is in the version of its first request (the client's OpenSession)
            version = P.request_version(first.metadata)
            error = partial(P.error_response, version=version)
            if not self._admits(context, first.uid):
                yield error("forbidden", NOT_A_MEMBER)
                await drain_refused(requests)
                return
            try:
                self.limits.check_message(first)
                opened = P.decode(first.metadata, P.OpenSession)
                self._check_range(opened.start, opened.end)
                prompts = self._session_prompts(first, opened)  # deep prompts [blocks, batch | 1, pre, hidden]
                if not self.accepting:
                    raise OutOfCacheError("this server is shutting down and takes no new sessions")
                if opened.max_length > self.max_length:
                    raise P.ProtocolError(
                        f"max_length {opened.max_length} exceeds this server's limit {self.max_length}")
                self._check_adapter(opened.adapter)
                self.streams.open_session(str(context.remote_id))
                peer = str(context.remote_id)
                handle = f"{context.remote_id}/{opened.session_id}/{uuid.uuid4().hex[:8]}"
                await self.budget.reserve(handle, opened.batch_size * self.span.cache_tokens(
                    opened.max_length, opened.start, opened.end), self.alloc_timeout)
            except LimitError as e:
                handle = None
                yield error("over_limit", str(e))
                await drain_refused(requests)
                return
            except OutOfCacheError as e:
                handle = None
                yield error("out_of_cache", str(e))
                await drain_refused(requests)
                return
            except (P.ProtocolError, ValueError) as e:
                handle = None
                yield error("bad_request", str(e))
                await drain_refused(requests)
                return
            kv = self.span.new_session_kv(opened.batch_size, opened.max_length, opened.start, opened.end,
                                          adapter=opened.adapter)
            key = P.stream_key(opened.session_id, opened.start)
            # ("client" | "push", request), or None when the client left; bounded: a flood waits (client) or is
            # dropped (push) instead of growing memory
            inputs: asyncio.Queue = asyncio.Queue(maxsize=self.limits.max_queued_steps)
            if not self.push_router.register(key, inputs, opened.push_token, owner=peer):
                yield error("bad_request", f"session part {key} is already open here")
                await drain_refused(requests)
                return
            registered = key
            pump = asyncio.ensure_future(_pump(requests, inputs))
            compression = opened.compression or self.compression  # of this session's replies and pushes
            yield P.make_response(P.StepResult(position=0), version=version)  # the session is open
            last_step_id = -1
            last_reorder_id = 0  # the last `Step.reorder_id` applied to this session's cache rows
            while True:
                try:
                    item = await asyncio.wait_for(inputs.get(), timeout=self.step_timeout)
                except asyncio.TimeoutError:
                    yield error("timeout", f"no step for {self.step_timeout:.0f}s; session closed")
                    return
                if item is None:
                    return
                source, request = item
                try:
                    if source == "push":
                        pushed = P.decode(request.metadata, P.PushStep)
                        step = P.Step(start_position=pushed.start_position, step_id=pushed.step_id,
                                      push_chain=pushed.push_chain, **pushed.row_edits())
                    else:
                        step = P.decode(request.metadata, P.Step)
                    self.limits.check_message(request)
                    if step.step_id and step.step_id <= last_step_id:
                        continue  # the other copy of a step already processed (push and client fallback)
                    hidden = self._hidden_from(request)
                    batch, seq = hidden.shape[:2]
                    if batch != opened.batch_size:
                        raise P.ProtocolError(f"batch size {batch} differs from the session's {opened.batch_size}")
                    if step.start_position > kv.length:
                        raise P.ProtocolError(
                            f"start_position {step.start_position} is past the {kv.length} tokens this session holds"
                        )
                    if not kv.can_start_at(step.start_position):
                        raise P.ProtocolError(f"start_position {step.start_position} is farther back than this "
                                              f"session's sliding-window cache holds")
                    if step.start_position + seq > opened.max_length:
                        raise P.ProtocolError(
                            f"positions up to {step.start_position + seq} exceed the session's max_length "
                            f"{opened.max_length}"
                        )
                    P.check_row_edits(step, batch, opened.max_length, step.start_position + seq)
                except (P.ProtocolError, LimitError) as e:
                    if source == "push":
                        logger.warning(f"dropping a malformed push for {key}: {e}")
                        continue
                    yield error("over_limit" if isinstance(e, LimitError) else "bad_request", str(e))
                    continue
                try:
                    if step.hypo_ids is not None and (step.reorder_id == 0 or step.reorder_id != last_reorder_id):
                        # beam search: the kept positions' rows follow their beams (once per reorder id: a step
                        # retried after a failover may reach a server that already applied it)
                        await self.pool.submit(PRIORITY_DECODE, kv.reorder, torch.tensor(step.hypo_ids),
                                               step.start_position)
                        last_reorder_id = step.reorder_id
                    if step.start_position == 0:  # the rows start afresh: their padding is this step's
                        kv.set_padding(step.left_padding)
                    # the client's step this message is part of ends here (LongRoPE picks its factors by it)
                    kv.rope_length = step.rope_length if step.rope_length is not None else step.start_position + seq
                    output = await self._compute(hidden, step.start_position, kv, opened.start, opened.end,
                                                  prompts)
                except Exception as e:
                    logger.exception("inference step failed")
                    yield error("internal", f"step failed: {type(e).__name__}: {e}")
                    continue
                last_step_id = max(last_step_id, step.step_id)
                self.counters.inference_tokens += batch * seq
                self.counters.inference_steps += 1
                self.counters.steps_from_push += source == "push"
                # push first (the next server starts at once), then the copy the client keeps for failover
                was_pushed = bool(step.push_chain) and self.pusher is not None and self.pusher.push(
                    step.push_chain, step.start_position, step.step_id, output, step.row_edits(),
                    compression=compression)
                self.counters.pushes_sent += was_pushed
                if was_pushed:
                    # let the other sessions of this batch (resumed in the same loop turn) push theirs before any
                    # client copy goes out: the next server waits for the whole batch
                    await asyncio.sleep(0)
                yield P.make_response(P.StepResult(position=kv.length, step_id=step.step_id, pushed=was_pushed),
                                      [output], compression=compression, version=version)
        finally:
            self.streams.exit_stream()
            if peer is not None:
                self.streams.close_session(peer)
            if kv is not None:
                self.pool.gatherer.forget(id(kv))  # batches stop waiting for this session's steps
            kv = None  # the session's cache buffers are freed here (an arena slot: cleared below)
            if registered is not None:
                self.push_router.unregister(registered, inputs)
            if pump is not None:
                pump.cancel()
            if handle is not None:
                await self.budget.release(handle)
                if self.budget.num_sessions == 0:
                    # the last open session closed: the caches' memory back to the OS (swarm.runtime.malloc)
                    malloc.trim()
            if self.span.kv_arena is not None:
                try:
                    self.span.kv_arena.collect()  # the slots of collected sessions, cleared for the next ones
                except Exception:  # noqa: BLE001 - the next open collects again
                    logger.exception("clearing KV arena slots failed")

    async def _compute(self, hidden: torch.Tensor, start_position: int, kv, first: int, last: int,
                       prompts: Optional[torch.Tensor] = None) -> torch.Tensor:
        """One step of a session: decode steps are batched with other sessions'; a long prefill runs in chunks
        of `prefill_chunk` tokens at a lower priority, so that other sessions' decode steps go in between, and
        chunks of several sessions queued together share a pass (`_prefill_batch`; concurrent requests' prompts)."""
        seq = hidden.shape[1]
        if seq == 1 and self.span.can_batch and (prompts is None or start_position >= prompts.shape[2]):
            return await self.pool.submit_batchable(
                PRIORITY_DECODE, (id(self), first, last), partial(self._decode_batch, first=first, last=last),
                (hidden, start_position, kv), source=id(kv))
        outputs = []
        batchable = prompts is None and self.span.can_batch_prefill(kv)
        for offset in range(0, seq, self.prefill_chunk):
            chunk = hidden[:, offset:offset + self.prefill_chunk]
            if batchable:  # no source: a batch takes the chunks queued with it and waits for none
                out = await self.pool.submit_batchable(
                    PRIORITY_PREFILL, ("prefill", id(self), first, last),
                    partial(self._prefill_batch, first=first, last=last), (chunk, start_position + offset, kv))
                if isinstance(out, BaseException):  # this session's own failure (`_prefill_batch`)
                    raise out
            else:
                out = await self.pool.submit(PRIORITY_PREFILL, partial(self.span.forward, prompts=prompts), chunk,
                                             start_position + offset, kv, first, last)
            outputs.append(out)
        return torch.cat(outputs, dim=1) if len(outputs) > 1 else outputs[0]

    def _prefill_batch(self, items: list, first: int, last: int) -> list:
        """Prefill chunks of several sessions, in passes of at most `prefill_chunk` tokens together; a pass that
        fails runs its chunks one by one, so that each session gets its own outcome (an output or its error)."""
        results: list = []
        group: list = []
        tokens = 0  # in `group`
        for item in items + [None]:
            if group and (item is None or tokens + item[0].shape[1] > self.prefill_chunk):
                try:
                    results += self.span.forward_prefill_batch(group, first, last)
                except Exception:  # noqa: BLE001 - each chunk again alone: its own output or error
                    for hidden, start, kv in group:
                        try:
                            results.append(self.span.forward(hidden, start, kv, first, last))
                        except Exception as e:  # noqa: BLE001 - delivered to that session's step
                            results.append(e)
                group, tokens = [], 0
            if item is not None:
                group.append(item)
                tokens += item[0].shape[1]
        return results

    def _decode_batch(self, items: list, first: int, last: int) -> list:
        began = time.perf_counter()
        try:
            return self.span.forward_batch(items, first, last)
        finally:
            self.counters.compute_seconds += time.perf_counter() - began

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
        admitted = False
        async for request in requests:
            if not admitted:  # the first push of a stream proves membership for the whole stream
                if not self._admits(context, request.uid):
                    return
                admitted = True
            try:
                self.limits.check_message(request)
                pushed = P.decode(request.metadata, P.PushStep)
            except (P.ProtocolError, LimitError) as e:
                logger.warning(f"malformed push from {context.remote_id}: {e}")
                continue
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
        try:
            output = await self.pool.submit(
                PRIORITY_FORWARD, partial(self.span.forward, rope_length=message.rope_length), hidden, 0, None,
                message.start, message.end, message.adapter, None if padding is None else torch.tensor(padding)
            )
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
            cache_tokens_used=self.budget.used_tokens, sessions_open=self.budget.num_sessions,
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
