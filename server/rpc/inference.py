"""Inference streams on a block server: `InferenceHandler.rpc_inference`, one session's stream from its opening to
its teardown, and the scheduling of its steps on the compute thread (`server.rpc.handler.BlockHandler` extends it).

A stream's phases: `_open_stream` (admission, the `OpenSession` request checked, the session counted against its
peer's limit, its cache reserved and made, its push key registered), `_step` (one step from the client or pushed by
the previous server: checked against the session, computed, pushed on; its reply), and `_close_stream`, which gives
back whatever the opening took, however the stream ended. A refused opening gets one `ErrorReply` and its pending
requests drained (`server.rpc.refusal`); a bad step gets an `ErrorReply` and leaves the session as it was.

Scheduling (`_compute`): decode steps are batched with other sessions' at `PRIORITY_DECODE`; a long prefill runs in
chunks of `prefill_chunk` tokens at `PRIORITY_PREFILL`, chunks of several sessions sharing a pass where they can, a
pass taking the queued chunks in arrival order up to `prefill_batch_tokens` (`--prefill_batch_tokens`): each pass's
sessions get their outputs (and go on to the next server) when that pass ends, not when every queued chunk is done,
and decode steps of running sessions go between passes.
"""
from __future__ import annotations

import asyncio
import logging
import time
import uuid
from dataclasses import dataclass
from functools import partial
from typing import Any, AsyncGenerator, AsyncIterator, Dict, Optional, Tuple

import torch
from hivemind.p2p import P2PContext
from hivemind.proto import runtime_pb2

from server.compute.blocks import BlockSpan
from server.compute.cache import CacheBudget, OutOfCacheError
from server.compute.decode import host_outputs
from server.rpc.limits import LimitError, RpcLimits, StreamLimiter
from server.rpc.prefix import PrefixHandler
from server.rpc.push import PushRouter, PushSender
from server.rpc.refusal import Refused, admitted, refuse
from swarm.runtime import malloc
from swarm.runtime.swarm_key import NOT_A_MEMBER
from swarm.runtime.taskpool import PRIORITY_DECODE, PRIORITY_PREFILL, TaskPool
from swarm.wire import protocol as P

logger = logging.getLogger(__name__)


@dataclass
class Counters:
    """What a block server has done (its `ServerStats`)."""
    inference_tokens: int = 0
    inference_steps: int = 0
    forward_tokens: int = 0
    compute_seconds: float = 0.0  # time spent in inference forward passes
    steps_from_push: int = 0  # inference steps whose input came from the previous server
    pushes_sent: int = 0
    pushes_refused: int = 0  # pushes without the session part's push token
    session_steps: int = 0  # steps that came on sessions' own streams (from the client or pushed)
    round_messages: int = 0  # round messages (`server.rpc.rounds`)
    round_rows: int = 0  # session steps in them
    round_row_errors: int = 0
    round_streams: int = 0  # open now


@dataclass
class _Stream:
    """What one inference stream holds, from its opening (`InferenceHandler._open_stream`) to its teardown
    (`InferenceHandler._close_stream`, which gives back whatever of it was taken)."""
    peer: Optional[str] = None  # the caller, once the session counts against its per-peer limit
    handle: Optional[str] = None  # the session's cache reservation (`CacheBudget`)
    opened: Optional[P.OpenSession] = None
    prompts: Optional[torch.Tensor] = None  # deep prompts [blocks, batch | 1, pre_seq_len, hidden]
    kv: Any = None  # the session's cache (`SessionKV`)
    key: Optional[str] = None  # the session part's registered push key
    inputs: Optional[asyncio.Queue] = None  # ("client" | "push", request), None when the client left
    pump: Optional[asyncio.Future] = None  # moves the client's requests into `inputs`
    compression: str = "none"  # of this session's replies and pushes
    last_step_id: int = -1
    last_reorder_id: int = 0  # the last `Step.reorder_id` applied to this session's cache rows
    # every reply of the stream is in the protocol version of its first request (the client's OpenSession)
    version: Optional[int] = None
    busy: bool = False  # a step of this session is being computed (from its stream or a round)
    last_active: float = 0.0  # monotonic time of its last step from a round (`server.rpc.rounds`)
    # its last step computed from a round push: (step id, its output [batch, 1, hidden]), the answer to the client's
    # late copy of that step (`server.rpc.rounds`)
    pushed_step: Optional[Tuple[int, torch.Tensor]] = None
    prefix: Any = None  # its use of the prefix cache (`server.rpc.prefix.PrefixState`), None: none
    adopted: Optional[torch.Tensor] = None  # the outputs at the prefix positions adopted at the opening


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


class InferenceHandler(PrefixHandler, P.BlockRPC):
    """The inference RPC of `server.rpc.handler.BlockHandler` (which sets the attributes below and defines the
    checks it shares with the other RPCs)."""

    span: BlockSpan
    budget: CacheBudget
    pool: TaskPool
    limits: RpcLimits
    streams: StreamLimiter
    counters: Counters
    push_router: PushRouter
    pusher: Optional[PushSender]
    max_length: int
    max_batch_tokens: int
    alloc_timeout: float
    step_timeout: float
    prefill_chunk: int
    prefill_batch_tokens: int  # most tokens of prefill chunks in one pass (the first chunk always goes)
    accepting: bool
    compression: str
    open_parts: Dict[str, _Stream]  # stream key -> the open session part (rounds attach to it by key)
    round_routes: Dict[str, Any]  # stream key -> the round stream its pushes go to (`server.rpc.rounds`)

    def _admits(self, context: P2PContext, proof: str) -> bool:
        raise NotImplementedError

    def _check_range(self, start: int, end: int) -> None:
        raise NotImplementedError

    def _check_adapter(self, adapter: Optional[str]) -> None:
        raise NotImplementedError

    def _hidden_from(self, request: runtime_pb2.ExpertRequest) -> torch.Tensor:
        raise NotImplementedError

    def _session_prompts(self, request: runtime_pb2.ExpertRequest, opened: P.OpenSession) -> Optional[torch.Tensor]:
        """An inference session's deep prompts (the OpenSession request's tensor when `prompts`), validated:
        [end - start, batch_size | 1, pre_seq_len, hidden] in the span's dtype."""
        count = 1 if opened.prompts else 0
        if len(request.tensors) != count:
            raise P.ProtocolError(f"OpenSession with prompts={opened.prompts} carries {count} tensor(s), "
                                  f"got {len(request.tensors)}")
        if not opened.prompts:
            return None
        blocks = opened.end - opened.start
        prompts = P.deserialize_tensor(request.tensors[0], max_elements=blocks * self.max_batch_tokens *
                                       self.span.hidden_size)
        if (prompts.ndim != 4 or prompts.shape[0] != blocks or prompts.shape[1] not in (1, opened.batch_size)
                or not 0 < prompts.shape[2] <= opened.max_length or prompts.shape[3] != self.span.hidden_size):
            raise P.ProtocolError(
                f"prompts must have shape [{blocks}, {opened.batch_size} or 1, 0 < pre_seq_len <= max_length, "
                f"{self.span.hidden_size}], got {list(prompts.shape)}")
        if not torch.isfinite(prompts).all():
            raise P.ProtocolError("prompts contain NaN or infinite values")
        return prompts.to(self.span.device, self.span.dtype)

    # ---- the stream --------------------------------------------------------------------------------------
    async def rpc_inference(
        self, requests: AsyncIterator[runtime_pb2.ExpertRequest], context: P2PContext
    ) -> AsyncIterator[runtime_pb2.ExpertResponse]:
        """One inference session's stream: its opening (`_open_stream`), its steps (`_step`, one reply each) until
        the client leaves or goes quiet for `step_timeout`, and its teardown (`_close_stream`), whatever ends it;
        counted under `--max_streams` (`refusal.admitted`)."""
        async for reply in admitted(self.streams, requests, lambda: self._session_stream(requests, context)):
            yield reply

    async def _session_stream(self, requests: AsyncIterator[runtime_pb2.ExpertRequest], context: P2PContext
                              ) -> AsyncGenerator[runtime_pb2.ExpertResponse, None]:
        stream = _Stream()
        try:
            try:
                first = await asyncio.wait_for(requests.__anext__(), timeout=self.step_timeout)
            except StopAsyncIteration:
                return
            except asyncio.TimeoutError:
                yield P.error_response("timeout", f"no request within {self.step_timeout:g}s of opening the stream "
                                                  f"(the server's --step_timeout); stream closed")
                return
            stream.version = P.request_version(first.metadata)
            try:
                await self._open_stream(stream, first, requests, context)
            except Refused as e:
                async for reply in refuse(requests, e.code, str(e), stream.version):
                    yield reply
                return
            # the session is open (holding the prefix positions it adopted, with their outputs)
            yield P.make_response(P.StepResult(position=stream.kv.length),
                                  [] if stream.adopted is None else [stream.adopted],
                                  compression=stream.compression, version=stream.version)
            stream.adopted = None
            assert stream.inputs is not None
            while True:
                try:
                    item = await asyncio.wait_for(stream.inputs.get(), timeout=self.step_timeout)
                except asyncio.TimeoutError:
                    if time.monotonic() - stream.last_active < self.step_timeout:
                        continue  # the session steps in rounds (`server.rpc.rounds`): it is not idle
                    yield P.error_response("timeout", f"no step for {self.step_timeout:.0f}s; session closed",
                                           stream.version)
                    return
                if item is None:
                    return
                reply = await self._step(stream, *item)
                if reply is not None:
                    yield reply
        finally:
            await self._close_stream(stream)

    async def _open_stream(self, stream: _Stream, first: runtime_pb2.ExpertRequest,
                           requests: AsyncIterator[runtime_pb2.ExpertRequest], context: P2PContext) -> None:
        """Admission and opening: the caller's membership, the `OpenSession` request checked, the session counted
        against its peer's limit, its cache reserved and made, its push key registered and the client's requests
        pumped into its input queue. `Refused` when any of it is refused; `stream` holds what was taken so far."""
        if not self._admits(context, first.uid):
            raise Refused("forbidden", NOT_A_MEMBER)
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
            stream.peer = str(context.remote_id)
            stream.handle = f"{context.remote_id}/{opened.session_id}/{uuid.uuid4().hex[:8]}"
            await self.budget.reserve(stream.handle, opened.batch_size * self.span.cache_tokens(
                opened.max_length, opened.start, opened.end), self.alloc_timeout)
        except LimitError as e:
            stream.handle = None
            raise Refused("over_limit", str(e)) from e
        except OutOfCacheError as e:
            stream.handle = None
            raise Refused("out_of_cache", str(e)) from e
        except (P.ProtocolError, ValueError) as e:
            stream.handle = None
            raise Refused("bad_request", str(e)) from e
        stream.opened, stream.prompts = opened, prompts
        stream.kv = self.span.new_session_kv(opened.batch_size, opened.max_length, opened.start, opened.end,
                                             adapter=opened.adapter)
        key = P.stream_key(opened.session_id, opened.start)
        # ("client" | "push", request), or None when the client left; bounded: a flood waits (client) or is
        # dropped (push) instead of growing memory
        stream.inputs = asyncio.Queue(maxsize=self.limits.max_queued_steps)
        if not self.push_router.register(key, stream.inputs, opened.push_token, owner=stream.peer):
            raise Refused("bad_request", f"session part {key} is already open here")
        stream.key = key
        self.open_parts[key] = stream
        stream.pump = asyncio.ensure_future(_pump(requests, stream.inputs))
        stream.compression = opened.compression or self.compression
        try:
            stream.prefix, stream.adopted = await self._prefix_open(stream.kv, opened)
        except Exception:  # noqa: BLE001 - the session goes on without the prefix cache
            logger.exception("prefix cache lookup failed")

    async def _step(self, stream: _Stream, source: str, request: runtime_pb2.ExpertRequest
                    ) -> Optional[runtime_pb2.ExpertResponse]:
        """One step of an open session, from the client or pushed by the previous server: checked against the
        session, computed, pushed on along its chain; the reply to the client (its output, or an error that leaves
        the session as it was), or None for a step that gets none (a copy already processed, a malformed push)."""
        opened, kv, key = stream.opened, stream.kv, stream.key
        assert opened is not None and kv is not None
        try:
            if source == "push":
                pushed = P.decode(request.metadata, P.PushStep)
                step = P.Step(start_position=pushed.start_position, step_id=pushed.step_id,
                              push_chain=pushed.push_chain, **pushed.row_edits())
            else:
                step = P.decode(request.metadata, P.Step)
            self.limits.check_message(request)
            if step.step_id and step.step_id <= stream.last_step_id:
                return None  # the other copy of a step already processed (push and client fallback)
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
                return None
            return P.error_response("over_limit" if isinstance(e, LimitError) else "bad_request", str(e),
                                    stream.version)
        if stream.busy:  # a round is computing a step of this session (a client that mixes the two at once)
            return P.error_response("bad_request", "this session is in the middle of another step", stream.version)
        stream.busy = True
        try:
            if step.hypo_ids is not None and (step.reorder_id == 0 or step.reorder_id != stream.last_reorder_id):
                # beam search: the kept positions' rows follow their beams (once per reorder id: a step
                # retried after a failover may reach a server that already applied it)
                await self.pool.submit(PRIORITY_DECODE, kv.reorder, torch.tensor(step.hypo_ids),
                                       step.start_position)
                stream.last_reorder_id = step.reorder_id
            if step.start_position == 0:  # the rows start afresh: their padding is this step's
                kv.set_padding(step.left_padding)
            # the client's step this message is part of ends here (LongRoPE picks its factors by it)
            kv.rope_length = step.rope_length if step.rope_length is not None else step.start_position + seq
            held_before = kv.length
            output = await self._compute(hidden, step.start_position, kv, opened.start, opened.end,
                                         stream.prompts)
            if stream.prefix is not None:  # the pages this step completed (`server.rpc.prefix`)
                await self._prefix_after_step(kv, stream.prefix, step.start_position, held_before, output)
        except Exception as e:
            logger.exception("inference step failed")
            self._prefix_close(stream.prefix)  # its claimed pages: waiters compute them rather than wait for a retry
            return P.error_response("internal", f"step failed: {type(e).__name__}: {e}", stream.version)
        finally:
            stream.busy = False
        stream.last_step_id = max(stream.last_step_id, step.step_id)
        self.counters.inference_tokens += batch * seq
        self.counters.inference_steps += 1
        self.counters.session_steps += 1
        self.counters.steps_from_push += source == "push"
        # push first (the next server starts at once), then the copy the client keeps for failover
        was_pushed = bool(step.push_chain) and self.pusher is not None and self.pusher.push(
            step.push_chain, step.start_position, step.step_id, output, step.row_edits(),
            compression=stream.compression)
        self.counters.pushes_sent += was_pushed
        if was_pushed:
            # let the other sessions of this batch (resumed in the same loop turn) push theirs before any
            # client copy goes out: the next server waits for the whole batch
            await asyncio.sleep(0)
        return P.make_response(P.StepResult(position=kv.length, step_id=step.step_id, pushed=was_pushed),
                               [output], compression=stream.compression, version=stream.version)

    async def _close_stream(self, stream: _Stream) -> None:
        """Teardown, however the stream ended: what `_open_stream` took is given back (the session count, the cache
        and its reservation, the push key, the pump), the caches' memory returned to the OS after the last session
        (the stream count drops after it, `refusal.admitted`)."""
        self._prefix_close(stream.prefix)
        if stream.peer is not None:
            self.streams.close_session(stream.peer)
        if stream.kv is not None:
            self.pool.gatherer.forget(id(stream.kv))  # batches stop waiting for this session's steps
        stream.kv = None  # the session's cache buffers are freed here (an arena slot: cleared below)
        if stream.key is not None:
            self.push_router.unregister(stream.key, stream.inputs)
            if self.open_parts.get(stream.key) is stream:
                del self.open_parts[stream.key]
                self.round_routes.pop(stream.key, None)  # its pushes have nowhere to go (`server.rpc.rounds`)
        if stream.pump is not None:
            stream.pump.cancel()
        if stream.handle is not None:
            await self.budget.release(stream.handle)
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
        chunks of several sessions queued together share a pass of up to `prefill_batch_tokens` tokens
        (`_prefill_batch`; concurrent requests' prompts), taken in arrival order."""
        seq = hidden.shape[1]
        if seq == 1 and self.span.can_batch and (prompts is None or start_position >= prompts.shape[2]):
            return await self.pool.submit_batchable(
                PRIORITY_DECODE, (id(self), first, last), partial(self._decode_batch, first=first, last=last),
                (hidden, start_position, kv), source=id(kv))
        outputs = []
        batchable = prompts is None and self.span.can_batch_prefill(kv)
        for offset in range(0, seq, self.prefill_chunk):
            chunk = hidden[:, offset:offset + self.prefill_chunk]
            if batchable:  # no source: a pass takes the chunks queued with it, up to its budget, and waits for none
                out = await self.pool.submit_batchable(
                    PRIORITY_PREFILL, ("prefill", id(self), first, last),
                    partial(self._prefill_batch, first=first, last=last), (chunk, start_position + offset, kv),
                    cost=chunk.shape[1], budget=self.prefill_batch_tokens)
                if isinstance(out, BaseException):  # this session's own failure (`_prefill_batch`)
                    raise out
            else:
                out = await self.pool.submit(PRIORITY_PREFILL, self._forward_to_host, chunk, start_position + offset,
                                             kv, first, last, prompts)
            outputs.append(out)
        return torch.cat(outputs, dim=1) if len(outputs) > 1 else outputs[0]

    def _forward_to_host(self, hidden: torch.Tensor, start: int, kv, first: int, last: int,
                         prompts: Optional[torch.Tensor]) -> torch.Tensor:
        """On the compute thread: one session's step alone (`BlockSpan.forward`), its output on the host."""
        return host_outputs([self.span.forward(hidden, start, kv, first, last, prompts=prompts)])[0]

    def _prefill_batch(self, items: list, first: int, last: int) -> list:
        """Prefill chunks of several sessions (items [(hidden [1, seq_i, hidden], start_i, kv_i)], what the task
        pool took within `prefill_batch_tokens`), in passes of at most that many tokens together; a pass that fails
        runs its chunks one by one, so that each session gets its own outcome (an output or its error)."""
        results: list = []
        group: list = []
        tokens = 0  # in `group`
        for item in items + [None]:
            if group and (item is None or tokens + item[0].shape[1] > self.prefill_batch_tokens):
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
        return host_outputs(results)

    def _decode_batch(self, items: list, first: int, last: int) -> list:
        began = time.perf_counter()
        try:
            return host_outputs(self.span.forward_batch(items, first, last))
        finally:
            self.counters.compute_seconds += time.perf_counter() - began
