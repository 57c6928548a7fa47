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

Round pushes (capability `round_push`): a row may name its session's parts on the next servers
(`RoundRow.push_chain`). After the round, the rows' outputs go on in ONE `RoundPush` per next server
(`rpc_round_push`, `PushSender`), each row with the rest of its chain, and the row's result says so (`pushed`). The
next server checks each pushed row's push token, hands the rows to the round stream their parts are attached to
(`round_routes`), runs them there as one batch like a client's message, answers the client on that stream
(`RoundResult.pushed`) and pushes them on likewise: a decode step crosses a chain of k servers in k + 1 network
hops instead of 2k. The client keeps the previous server's output (its history for failover) and sends the
row itself only when the pushed result is late (`push_timeout`); a copy already computed from the push is answered
with the output kept from it (`_Stream.pushed_step`, not computed again), and a push that comes after the client's
copy is dropped (by step id). A round stream takes at most `MAX_PUSHES_WAITING` pushed batches ahead of its own
messages; more are dropped (the client's copy will do).

Round steps carry no row edits (beam parents, padding, rope lengths): a client sends those steps on the session's
own stream, as before. `rpc_round_stats` reports the round counters (`RoundStats`).
"""
from __future__ import annotations

import asyncio
import logging
import time
from collections import defaultdict
from typing import AsyncGenerator, AsyncIterator, Collection, Dict, List, Optional, Tuple

import torch
from hivemind.p2p import P2PContext
from hivemind.proto import runtime_pb2

from server.compute.decode import host_outputs
from server.rpc.inference import InferenceHandler, _Stream
from server.rpc.limits import LimitError
from server.rpc.push import proven_pushes, token_matches
from server.rpc.refusal import admitted
from swarm.runtime.swarm_key import NOT_A_MEMBER
from swarm.runtime.taskpool import PRIORITY_DECODE
from swarm.wire import protocol as P
from swarm.wire import rounds as R
from swarm.wire.capabilities import PROTOCOL_VERSION

logger = logging.getLogger(__name__)

RowError = Tuple[str, str]  # (code, message)
MAX_PUSHES_WAITING = 8  # pushed batches a round stream holds ahead of its processing; more are dropped
MAX_CLIENT_WAITING = 4  # a client's messages read ahead of their processing; then the stream is not read


def _reply(result: R.RoundResult, outputs: List[Optional[torch.Tensor]], version: int) -> runtime_pb2.ExpertResponse:
    """A round's (or a pushed round's) reply: its result and the outputs of the rows that have one, in row order."""
    tensors = [output for output in outputs if output is not None]
    return P.make_response(result, [R.join_rows(tensors)] if tensors else [], version=version)


class _Inbox:
    """A round stream's input in arrival order: ("client", request), ("push", rows, parts), or None at its end."""

    def __init__(self) -> None:
        self.queue: "asyncio.Queue[Optional[tuple]]" = asyncio.Queue()
        self.pushes = 0  # pushed batches waiting
        self.client = 0  # client messages waiting
        self.room = asyncio.Event()  # set while the client may send more
        self.room.set()
        self.failure: Optional[BaseException] = None  # how the client's requests ended, if they broke

    async def pump(self, requests: AsyncIterator[runtime_pb2.ExpertRequest]) -> None:
        """The client's messages into the queue, at most `MAX_CLIENT_WAITING` ahead (a flood is not read)."""
        try:
            async for request in requests:
                self.client += 1
                self.queue.put_nowait(("client", request))
                if self.client >= MAX_CLIENT_WAITING:
                    self.room.clear()
                    await self.room.wait()
        except Exception as e:  # noqa: BLE001 - the stream broke: raised where the replies are made
            self.failure = e
        finally:
            self.queue.put_nowait(None)


class RoundHandler(InferenceHandler):
    """The round RPCs of `server.rpc.handler.BlockHandler`."""

    round_routes: Dict[str, _Inbox]  # stream key -> the inbox of the round stream it is attached to (pushes go there)

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
        inbox = _Inbox()
        pump = asyncio.ensure_future(inbox.pump(requests))
        admitted = False
        version = PROTOCOL_VERSION  # of the client's last message (pushed results are answered in it)
        try:
            while (item := await inbox.queue.get()) is not None:
                if item[0] == "push":
                    inbox.pushes -= 1
                    reply = await self._pushed_round(item[1], item[2], attached, version)
                    if reply is not None:
                        yield reply
                    continue
                inbox.client -= 1
                inbox.room.set()
                request = item[1]
                version = P.request_version(request.metadata)
                if not admitted:  # the first message proves membership for the whole stream
                    if not self._admits(context, request.uid):
                        yield P.error_response("forbidden", NOT_A_MEMBER, version)
                        return
                    admitted = True
                yield await self._round(request, attached, peer, version, inbox)
            if inbox.failure is not None:
                raise inbox.failure
        finally:
            pump.cancel()
            for key in attached:
                if self.round_routes.get(key) is inbox:
                    del self.round_routes[key]
            self.counters.round_streams -= 1

    async def rpc_round_push(
        self, requests: AsyncIterator[runtime_pb2.ExpertRequest], context: P2PContext
    ) -> AsyncIterator[runtime_pb2.ExpertResponse]:
        """A previous server's round pushes: each row goes, with the others for the same round stream, to the round
        stream its part is attached to, if it carries that part's push token. A row with a wrong token is refused
        (one `forbidden` reply per message; the stream goes on); a row whose part is gone or not attached to a
        round stream, or whose stream holds too many pushes already, is dropped (the client sends its own copy)."""
        def parse(request: runtime_pb2.ExpertRequest) -> Tuple[R.RoundPush, List[torch.Tensor]]:
            self.limits.check_message(request)
            message = P.decode(request.metadata, R.RoundPush)
            return message, self._round_rows(request, message)[1]

        async for request, (message, parts) in proven_pushes(requests, context.remote_id,
                                                             lambda uid: self._admits(context, uid), parse,
                                                             "round push"):
            groups: Dict[int, Tuple[_Inbox, list, list]] = {}
            refused = []
            for row, part in zip(message.rows, parts):
                stream, inbox = self.open_parts.get(row.stream_key), self.round_routes.get(row.stream_key)
                if stream is None or inbox is None or stream.opened is None:
                    continue  # gone, or not on a round stream: the client's own copy will do
                if not token_matches(stream.opened.push_token, row.token):
                    refused.append(row.stream_key)
                    continue
                group = groups.setdefault(id(inbox), (inbox, [], []))
                group[1].append(row)
                group[2].append(part)
            for inbox, rows, hidden in groups.values():
                if inbox.pushes < MAX_PUSHES_WAITING:
                    inbox.pushes += 1
                    inbox.queue.put_nowait(("push", rows, hidden))
            if refused:
                self.counters.pushes_refused += len(refused)
                logger.warning(f"refused {len(refused)} round push row(s) from {context.remote_id}: wrong push token")
                yield P.error_response("forbidden", f"round push refused for {', '.join(refused[:4])}: the push token "
                                       f"does not match (only the previous server of a session's chain may push to "
                                       f"it)", P.request_version(request.metadata))

    async def rpc_round_stats(self, request: runtime_pb2.ExpertUID, context: P2PContext) -> runtime_pb2.ExpertInfo:
        if not self._admits(context, request.uid):
            raise PermissionError(NOT_A_MEMBER)
        c = self.counters
        stats = R.RoundStats(messages=c.round_messages, rows=c.round_rows, row_errors=c.round_row_errors,
                             session_steps=c.session_steps, round_streams=c.round_streams)
        return runtime_pb2.ExpertInfo(serialized_info=P.encode(stats))

    # ---- one round ------------------------------------------------------------------------------------------
    def _round_rows(self, request: runtime_pb2.ExpertRequest, message) -> Tuple[torch.Tensor, List[torch.Tensor]]:
        """A round's (or a push's) one tensor, checked: [tokens, hidden] flat and one [batch, seq, hidden] view per
        row. ProtocolError / LimitError."""
        if len(request.tensors) != 1:
            raise P.ProtocolError(f"a round carries exactly 1 tensor (the rows' hidden states), got "
                                  f"{len(request.tensors)}")
        tokens = message.tokens
        self.limits.check_step_tokens(tokens)
        flat = P.deserialize_tensor(request.tensors[0], max_elements=tokens * self.span.hidden_size)
        if flat.ndim != 2 or flat.shape[1] != self.span.hidden_size:
            raise P.ProtocolError(f"round hidden states must be [tokens, {self.span.hidden_size}], got "
                                  f"{list(flat.shape)}")
        return flat, R.split_rows(flat, [(row.batch, row.seq) for row in message.rows])  # [batch_i, seq_i, hidden]

    async def _round(self, request: runtime_pb2.ExpertRequest, attached: Dict[str, _Stream], peer: str,
                     version: int, inbox: Optional[_Inbox] = None) -> runtime_pb2.ExpertResponse:
        try:
            self.limits.check_message(request)
            message = P.decode(request.metadata, R.RoundStep)
            flat, parts = self._round_rows(request, message)
        except LimitError as e:
            return P.error_response("over_limit", str(e), version)
        except P.ProtocolError as e:
            return P.error_response("bad_request", str(e), version)
        rows = message.rows
        self.counters.round_messages += 1
        self.counters.round_rows += len(rows)
        refused = {a.stream_key: problem for a in message.attach
                   if (problem := self._attach(a, attached, peer, inbox)) is not None}
        errors: Dict[int, RowError] = {i: refused[row.stream_key] for i, row in enumerate(rows)
                                       if row.stream_key in refused}
        ready: Dict[int, torch.Tensor] = {}  # the client's copies of steps already computed from a push
        for i, row in enumerate(rows):
            stream = attached.get(row.stream_key)
            if i not in errors and stream is not None and row.step_id and stream.pushed_step is not None \
                    and stream.pushed_step[0] == row.step_id and stream.kv is not None \
                    and stream.kv.length == row.start_position + row.seq:
                ready[i] = stream.pushed_step[1]
        results, outputs = await self._run_rows(rows, parts, flat, attached, errors, ready)
        results = self._push_on(rows, results, outputs, ready)
        return _reply(R.RoundResult(round_id=message.round_id, rows=results), outputs, version)

    async def _pushed_round(self, rows: List[R.RoundPushRow], parts: List[torch.Tensor], attached: Dict[str, _Stream],
                            version: int) -> Optional[runtime_pb2.ExpertResponse]:
        """Rows pushed by the previous server, run as one round of this stream; the reply to its client, or None
        when none is left (parts detached, or steps the client's own copies already took)."""
        keep = [i for i, row in enumerate(rows) if (stream := attached.get(row.stream_key)) is not None
                and not (row.step_id <= stream.last_step_id)]
        if not keep:
            return None
        rows, parts = [rows[i] for i in keep], [parts[i] for i in keep]
        self.counters.round_rows += len(rows)
        results, outputs = await self._run_rows(rows, parts, None, attached, {})
        for row, output in zip(rows, outputs):
            if output is not None:
                attached[row.stream_key].pushed_step = (row.step_id, output.clone())  # (not the batch's view)
        self.counters.steps_from_push += sum(output is not None for output in outputs)
        results = self._push_on(rows, results, outputs)
        return _reply(R.RoundResult(rows=results, pushed=True), outputs, version)

    def _push_on(self, rows, results: List[R.RoundRowResult], outputs: List[Optional[torch.Tensor]],
                 ready: Collection[int] = ()) -> List[R.RoundRowResult]:
        """The outputs of rows with a push chain go on, one `RoundPush` per next server (each row with the rest of
        its chain); `results` with those rows marked `pushed`. Not the `ready` rows: a pushed step went on when it
        was computed."""
        targets: Dict[str, List[int]] = defaultdict(list)
        for i, row in enumerate(rows):
            if row.push_chain and outputs[i] is not None and i not in ready:
                targets[row.push_chain[0].peer_id].append(i)
        if not targets or self.pusher is None:
            return results
        pushed: set = set()
        for peer_id, indexes in targets.items():
            try:
                message = R.RoundPush(rows=[
                    R.RoundPushRow(stream_key=rows[i].push_chain[0].stream_key, token=rows[i].push_chain[0].push_token,
                                   start_position=rows[i].start_position, step_id=rows[i].step_id,
                                   batch=rows[i].batch, seq=rows[i].seq, push_chain=rows[i].push_chain[1:])
                    for i in indexes])
            except ValueError as e:  # a target the next server would refuse (a short token, a key twice)
                logger.debug(f"not pushing to {peer_id}: {e}")
                continue
            hidden = R.join_rows([t for i in indexes if (t := outputs[i]) is not None])  # [tokens, hidden]
            if self.pusher.push_round(peer_id, message, hidden):
                pushed.update(indexes)
                self.counters.pushes_sent += len(indexes)
        return [result.model_copy(update={"pushed": True}) if i in pushed else result
                for i, result in enumerate(results)]

    async def _run_rows(self, rows: list, parts: List[torch.Tensor], flat: Optional[torch.Tensor],
                        attached: Dict[str, _Stream], errors: Dict[int, RowError],
                        ready: Optional[Dict[int, torch.Tensor]] = None
                        ) -> Tuple[List[R.RoundRowResult], List[Optional[torch.Tensor]]]:
        """Check, compute and note the rows (`RoundRow`s or `RoundPushRow`s, with their hidden states `parts`); per
        row its result and its output [batch, seq, hidden] (None for a row that failed). `errors`: rows already
        answered (their problem); `ready`: rows whose output is already known (not computed again)."""
        ready = ready or {}
        finite = torch.isfinite(flat).all(dim=1) if flat is not None else None  # [tokens]
        if finite is None:
            for i, part in enumerate(parts):
                if not bool(torch.isfinite(part).all()):
                    errors[i] = ("bad_request", "hidden states contain NaN or infinite values")
        elif not bool(finite.all()):
            for i, ok in enumerate(torch.split(finite, [row.batch * row.seq for row in rows])):
                if not bool(ok.all()):
                    errors[i] = ("bad_request", "hidden states contain NaN or infinite values")
        started: List[int] = []  # rows whose sessions are marked busy
        held_before: Dict[int, int] = {}  # row -> its session's length before the step (the prefix pages' notes)
        try:
            for i, row in enumerate(rows):
                if i in errors or i in ready:
                    continue
                problem = self._row_problem(row, attached.get(row.stream_key))
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
            computed = await self._round_compute([(i, rows[i], parts[i], attached[rows[i].stream_key])
                                                  for i in started])
        finally:
            for i in started:
                attached[rows[i].stream_key].busy = False
        now = time.monotonic()
        results: List[R.RoundRowResult] = []
        outputs: List[Optional[torch.Tensor]] = []
        for i, row in enumerate(rows):
            output = ready[i] if i in ready else computed.get(i)
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
                outputs.append(None)
                continue
            assert isinstance(output, torch.Tensor)
            stream = attached[row.stream_key]
            if stream.prefix is not None and i not in ready:  # as on its own stream: pages it completed, a rewind
                await self._prefix_after_step(stream.kv, stream.prefix, row.start_position, held_before[i], output)
            stream.last_step_id = max(stream.last_step_id, row.step_id)
            stream.last_active = now
            results.append(R.RoundRowResult(stream_key=row.stream_key, step_id=row.step_id,
                                            position=stream.kv.length))
            outputs.append(output)
        self.counters.round_row_errors += len(errors)
        if len(attached) > 2 * len(self.open_parts) + 64:  # parts closed since they were attached: let them go
            for key in [key for key, stream in attached.items() if stream.kv is None]:
                del attached[key]
        done = [output for i, output in enumerate(outputs) if output is not None and i not in ready]
        self.counters.inference_steps += len(done)
        self.counters.inference_tokens += sum(t.shape[0] * t.shape[1] for t in done)
        return results, outputs

    def _attach(self, entry: R.RoundAttach, attached: Dict[str, _Stream], peer: str,
                inbox: Optional[_Inbox] = None) -> Optional[RowError]:
        """Bind a session part to the round stream (and route the pushes for it there): it must be open here,
        opened by this stream's peer, and the entry must carry its push token. The problem otherwise (the same
        words for a part that does not exist and another client's: no probing)."""
        stream = self.open_parts.get(entry.stream_key)
        if stream is None or stream.peer != peer or stream.opened is None:
            return "bad_request", f"no session part {entry.stream_key} of yours is open here"
        if not token_matches(stream.opened.push_token, entry.token):
            return "forbidden", f"session part {entry.stream_key}: the token does not match the one it was opened with"
        attached[entry.stream_key] = stream
        if inbox is not None:
            self.round_routes[entry.stream_key] = inbox
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
