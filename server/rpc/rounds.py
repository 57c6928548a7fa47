"""Round streams on a block server: `RoundHandler.rpc_round`, many sessions' steps in one message per round.

Sessions open as always, each on its own `rpc_inference` stream (`server.rpc.inference`), which holds its cache,
counts it against its peer's limits and frees it when it ends. A client that steps many sessions together keeps one
`rpc_round` stream to this server and sends one `swarm.wire.rounds.RoundStep` per round: its `attach` entries bind
session parts to the round stream (the part must have been opened by the same peer and the entry must carry the
part's secret, `OpenSession.push_token`), its rows name attached parts, each with its hidden states. The server
checks each row against its session as a step on the session's own stream would be (batch size, position against
the cache and `max_length`, the sliding window, step ids, finite values), then hands every single-token row of the
round to the compute thread as ONE task per block range (`BlockSpan.forward_batch`: one pass over all rows, each
session attending to its own cache), and runs longer rows (a prefill, a speculative step) through the session's
usual scheduling (`InferenceHandler._compute`). One `RoundResult` answers the message: per row its position, or an
error that concerns that row alone (a bad row, or a pass that failed for that session: a failed batched pass is run
again session by session, so that each row gets its own outcome). A malformed message as a whole (not JSON, over
the message limit, a tensor of the wrong size) gets one `ErrorReply` and the stream goes on.

Round steps carry no push chain and no row edits (beam parents, padding, rope lengths): a client sends those steps
on the session's own stream, as before. `rpc_round_stats` reports the round counters (`RoundStats`).
"""
from __future__ import annotations

import asyncio
import hmac
import logging
import time
from collections import defaultdict
from typing import AsyncGenerator, AsyncIterator, Dict, List, Optional, Tuple

import torch
from hivemind.p2p import P2PContext
from hivemind.proto import runtime_pb2

from server.compute.decode import host_outputs
from server.rpc.inference import InferenceHandler, _Stream
from server.rpc.limits import LimitError
from server.rpc.refusal import admitted
from swarm.runtime.swarm_key import NOT_A_MEMBER
from swarm.runtime.taskpool import PRIORITY_DECODE
from swarm.wire import protocol as P
from swarm.wire import rounds as R

logger = logging.getLogger(__name__)

RowError = Tuple[str, str]  # (code, message)


class RoundHandler(InferenceHandler):
    """The round RPCs of `server.rpc.handler.BlockHandler`."""

    async def rpc_round(
        self, requests: AsyncIterator[runtime_pb2.ExpertRequest], context: P2PContext
    ) -> AsyncIterator[runtime_pb2.ExpertResponse]:
        """One client's round stream: each `RoundStep` gets one `RoundResult` (or an `ErrorReply` for a malformed
        message), in order, until the client closes it; counted under `--max_streams` (`refusal.admitted`)."""
        async for reply in admitted(self.streams, requests, lambda: self._round_stream(requests, context)):
            yield reply

    async def _round_stream(self, requests: AsyncIterator[runtime_pb2.ExpertRequest], context: P2PContext
                            ) -> AsyncGenerator[runtime_pb2.ExpertResponse, None]:
        self.counters.round_streams += 1
        peer = str(context.remote_id)
        attached: Dict[str, _Stream] = {}  # stream key -> the session part this stream may step
        admitted = False
        try:
            async for request in requests:
                version = P.request_version(request.metadata)
                if not admitted:  # the first message proves membership for the whole stream
                    if not self._admits(context, request.uid):
                        yield P.error_response("forbidden", NOT_A_MEMBER, version)
                        return
                    admitted = True
                yield await self._round(request, attached, peer, version)
        finally:
            self.counters.round_streams -= 1

    async def rpc_round_stats(self, request: runtime_pb2.ExpertUID, context: P2PContext) -> runtime_pb2.ExpertInfo:
        if not self._admits(context, request.uid):
            raise PermissionError(NOT_A_MEMBER)
        c = self.counters
        stats = R.RoundStats(messages=c.round_messages, rows=c.round_rows, row_errors=c.round_row_errors,
                             session_steps=c.session_steps, round_streams=c.round_streams)
        return runtime_pb2.ExpertInfo(serialized_info=P.encode(stats))

    # ---- one round ------------------------------------------------------------------------------------------
    async def _round(self, request: runtime_pb2.ExpertRequest, attached: Dict[str, _Stream], peer: str,
                     version: int) -> runtime_pb2.ExpertResponse:
        try:
            self.limits.check_message(request)
            message = P.decode(request.metadata, R.RoundStep)
            if len(request.tensors) != 1:
                raise P.ProtocolError(f"a round carries exactly 1 tensor (the rows' hidden states), got "
                                      f"{len(request.tensors)}")
            tokens = message.tokens
            self.limits.check_step_tokens(tokens)
            flat = P.deserialize_tensor(request.tensors[0], max_elements=tokens * self.span.hidden_size)
            if flat.ndim != 2 or flat.shape[1] != self.span.hidden_size:
                raise P.ProtocolError(f"round hidden states must be [tokens, {self.span.hidden_size}], got "
                                      f"{list(flat.shape)}")
            parts = R.split_rows(flat, [(row.batch, row.seq) for row in message.rows])  # [batch_i, seq_i, hidden]
        except LimitError as e:
            return P.error_response("over_limit", str(e), version)
        except P.ProtocolError as e:
            return P.error_response("bad_request", str(e), version)
        rows = message.rows
        self.counters.round_messages += 1
        self.counters.round_rows += len(rows)
        errors: Dict[int, RowError] = {}
        refused = {a.stream_key: problem for a in message.attach
                   if (problem := self._attach(a, attached, peer)) is not None}
        finite = torch.isfinite(flat).all(dim=1)  # [tokens]
        if not bool(finite.all()):
            for i, ok in enumerate(torch.split(finite, [row.batch * row.seq for row in rows])):
                if not bool(ok.all()):
                    errors[i] = ("bad_request", "hidden states contain NaN or infinite values")
        started: List[int] = []  # rows whose sessions are marked busy
        held_before: Dict[int, int] = {}  # row -> its session's length before the step (the prefix pages' notes)
        try:
            for i, row in enumerate(rows):
                if i in errors:
                    continue
                problem = refused.get(row.stream_key) or self._row_problem(row, attached.get(row.stream_key))
                if problem is not None:
                    errors[i] = problem
                    continue
                stream = attached[row.stream_key]
                stream.busy = True
                started.append(i)
                kv = stream.kv
                if row.start_position == 0:  # the rows start afresh, without padding (a padded step goes alone)
                    kv.set_padding(None)
                kv.rope_length = row.start_position + row.seq
                held_before[i] = kv.length
            outputs = await self._round_compute([(i, rows[i], parts[i], attached[rows[i].stream_key])
                                                 for i in started])
        finally:
            for i in started:
                attached[rows[i].stream_key].busy = False
        now = time.monotonic()
        results, tensors = [], []
        for i, row in enumerate(rows):
            output = outputs.get(i)
            if isinstance(output, BaseException):
                logger.error(f"round step of {row.stream_key} failed: {type(output).__name__}: {output}")
                self._prefix_close(attached[row.stream_key].prefix)  # its claimed pages: waiters compute them
                errors[i] = ("internal", f"step failed: {type(output).__name__}: {output}")
            elif i not in errors and attached[row.stream_key].kv is None:  # its stream ended during the step
                errors[i] = ("closed", f"session part {row.stream_key} closed during the step")
            if i in errors:
                code, text = errors[i]
                results.append(R.RoundRowResult(stream_key=row.stream_key, step_id=row.step_id, code=code,
                                                message=text[:4096]))
                continue
            assert isinstance(output, torch.Tensor)
            stream = attached[row.stream_key]
            if stream.prefix is not None:  # as on its own stream: pages it completed, a rewind ends its prompt
                await self._prefix_after_step(stream.kv, stream.prefix, row.start_position, held_before[i], output)
            stream.last_step_id = max(stream.last_step_id, row.step_id)
            stream.last_active = now
            results.append(R.RoundRowResult(stream_key=row.stream_key, step_id=row.step_id,
                                            position=stream.kv.length))
            tensors.append(output)
        self.counters.round_row_errors += len(errors)
        if len(attached) > 2 * len(self.open_parts) + 64:  # parts closed since they were attached: let them go
            for key in [key for key, stream in attached.items() if stream.kv is None]:
                del attached[key]
        self.counters.inference_steps += len(tensors)
        self.counters.inference_tokens += sum(t.shape[0] * t.shape[1] for t in tensors)
        reply = R.RoundResult(round_id=message.round_id, rows=results)
        return P.make_response(reply, [R.join_rows(tensors)] if tensors else [], version=version)

    def _attach(self, entry: R.RoundAttach, attached: Dict[str, _Stream], peer: str) -> Optional[RowError]:
        """Bind a session part to the round stream: it must be open here, opened by this stream's peer, and the
        entry must carry its push token. The problem otherwise (the same words for a part that does not exist and
        another client's: no probing)."""
        stream = self.open_parts.get(entry.stream_key)
        if stream is None or stream.peer != peer or stream.opened is None:
            return "bad_request", f"no session part {entry.stream_key} of yours is open here"
        expected = stream.opened.push_token
        if expected is None or not hmac.compare_digest(expected.encode(), entry.token.encode()):
            return "forbidden", f"session part {entry.stream_key}: the token does not match the one it was opened with"
        attached[entry.stream_key] = stream
        return None

    def _row_problem(self, row: R.RoundRow, stream: Optional[_Stream]) -> Optional[RowError]:
        """Why a row cannot run (the checks of a step on the session's own stream), or None."""
        if stream is None:
            return "bad_request", f"session part {row.stream_key} is not attached to this round stream"
        opened, kv = stream.opened, stream.kv
        if kv is None or opened is None or self.open_parts.get(row.stream_key) is not stream:
            return "closed", f"session part {row.stream_key} is closed"
        if stream.busy:
            return "bad_request", f"session part {row.stream_key} is in the middle of another step"
        if row.step_id and row.step_id <= stream.last_step_id:
            return "bad_request", f"step id {row.step_id} is not past the session's last ({stream.last_step_id})"
        if row.batch != opened.batch_size:
            return "bad_request", f"batch size {row.batch} differs from the session's {opened.batch_size}"
        if row.start_position > kv.length:
            return "bad_request", (f"start_position {row.start_position} is past the {kv.length} tokens this "
                                   f"session holds")
        if not kv.can_start_at(row.start_position):
            return "bad_request", (f"start_position {row.start_position} is farther back than this session's "
                                   f"sliding-window cache holds")
        if row.start_position + row.seq > opened.max_length:
            return "bad_request", (f"positions up to {row.start_position + row.seq} exceed the session's max_length "
                                   f"{opened.max_length}")
        return None

    async def _round_compute(self, work: list) -> Dict[int, object]:
        """Outputs [batch, seq, hidden] (or each row's exception) by row index. `work`: [(index, row, hidden,
        stream)]. Single-token rows of one block range: one compute task per `max_batch` rows; others: each
        through the session's usual scheduling."""
        decode: Dict[Tuple[int, int], list] = defaultdict(list)
        alone = []
        for index, row, hidden, stream in work:
            opened, prompts = stream.opened, stream.prompts
            if row.seq == 1 and self.span.can_batch and (prompts is None or row.start_position >= prompts.shape[2]):
                decode[(opened.start, opened.end)].append((index, (hidden, row.start_position, stream.kv)))
            else:
                alone.append((index, self._compute(hidden, row.start_position, stream.kv, opened.start, opened.end,
                                                   prompts)))
        futures, order = [], []
        size = max(1, self.pool.max_batch)
        for (first, last), items in decode.items():
            for offset in range(0, len(items), size):
                chunk = items[offset:offset + size]
                futures.append(self.pool.submit(PRIORITY_DECODE, self._round_decode, [item for _, item in chunk],
                                                first, last))
                order.append([index for index, _ in chunk])
        results = await asyncio.gather(*futures, *(coroutine for _, coroutine in alone), return_exceptions=True)
        outputs: Dict[int, object] = {}
        for indexes, result in zip(order, results[:len(futures)]):
            for n, index in enumerate(indexes):
                outputs[index] = result if isinstance(result, BaseException) else result[n]
        for (index, _), result in zip(alone, results[len(futures):]):
            outputs[index] = result
        return outputs

    def _round_decode(self, items: list, first: int, last: int) -> list:
        """On the compute thread: one pass over the single-token rows of a round (`BlockSpan.forward_batch`); if it
        fails, each session's step alone, so that each row gets its own output or error."""
        began = time.perf_counter()
        try:
            try:
                return host_outputs(self.span.forward_batch(items, first, last))
            except Exception:  # noqa: BLE001 - each session alone: its own output or error
                outputs: list = []
                for item in items:
                    try:
                        outputs.append(self.span.forward_batch([item], first, last)[0])
                    except Exception as e:  # noqa: BLE001 - delivered to that row
                        outputs.append(e)
                return host_outputs(outputs)
        finally:
            self.counters.compute_seconds += time.perf_counter() - began
            self.pool.batches_done += 1
            self.pool.largest_batch = max(self.pool.largest_batch, len(items))
