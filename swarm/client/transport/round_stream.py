"""A client's round stream to one server (`RoundStream`): the transport of `rounds.step_round`.

One long-lived `rpc_round` stream per (client, server) pair (`ROUND_STREAMS`, made on first use, made again once
closed). Rounds on it go one at a time (a lock), each `RoundStep` answered in order by one `RoundResult` (or an
`ErrorReply`). Its session parts are attached with their push tokens (`RoundAttach`) the first time they ride it.
With `round_push`, a row names the rest of its chain (`RoundRow.push_chain`) and the server also sends results of
rows the previous server pushed to it (`RoundResult.pushed`), which the stream's reader keeps by (session part,
step id) for `wait_pushed`; a copy of a pushed step that the client sent anyway is answered with the output the
server kept from the push. The reader takes replies only to messages sent (a server that sends more is cut off) and
keeps at most `MAX_PUSHED_KEPT` pushed results nobody waits for yet. A late reply is waited for while the server
answers liveness pings (`liveness.py`).
"""
from __future__ import annotations

import asyncio
import json
import logging
from typing import Any, Dict, List, Optional, Sequence, Tuple, Union

import torch
from hivemind.proto import runtime_pb2

from swarm.client.transport.liveness import wait_while_alive
from swarm.client.transport.manager import SwarmManager
from swarm.client.transport.per_peer import PerPeer
from swarm.client.transport.span_stream import SpanStream
from swarm.runtime import aio
from swarm.wire import protocol as P
from swarm.wire import rounds as R

logger = logging.getLogger(__name__)

Outcome = Union[torch.Tensor, BaseException]
# a row of one server's round: (session part, hidden [batch, seq, hidden], start position, step id)
Row = Tuple[SpanStream, torch.Tensor, int, int]

MAX_PUSHED_KEPT = 1024  # pushed results kept for rows not waited for yet (one token each); the oldest go first
_END = object()  # the end of a round stream's replies


class RoundStream:
    """One client's round stream to one server: rounds go one at a time (a lock), each answered in order. With
    `round_push`, the server also sends results of rows the previous server pushed to it (`RoundResult.pushed`):
    its reader keeps them by (session part, step id) for `wait_pushed`."""

    def __init__(self, manager: SwarmManager, peer_id: str):
        self.manager, self.peer_id = manager, peer_id
        self._queue: "asyncio.Queue[Optional[object]]" = asyncio.Queue()
        self._responses: Any = None
        self._replies: "asyncio.Queue[Any]" = asyncio.Queue()  # (response, its JSON) answering own messages, or _END
        self._reader: Optional["asyncio.Future[None]"] = None
        self._pushed: Dict[Tuple[str, int], Tuple[R.RoundRowResult, Optional[torch.Tensor]]] = {}
        self._waiters: Dict[Tuple[str, int], "asyncio.Future[Any]"] = {}
        self._unanswered = 0  # messages sent whose replies the reader has not taken yet
        self._lock = asyncio.Lock()
        self._attached: Dict[str, str] = {}  # stream key -> the token it was attached with
        self._round_id = 0
        self.closed = False
        self.pushed_rows = 0  # results of rows that came pushed (the client did not send them here)
        self._loop: Optional[asyncio.AbstractEventLoop] = None  # the client loop, once the stream opens there

    @property
    def usable(self) -> bool:
        """Not closed, and its replies still read (pushed results can still come on it)."""
        return not self.closed and (self._reader is None or not self._reader.done())

    def attached(self, stream: SpanStream) -> bool:
        """Whether the session part is attached to this stream with its current token (pushes for it land here)."""
        return self._reader is not None and self.usable and self._attached.get(stream.key) == stream.push_token

    async def step(self, rows: Sequence[Row], chains: Optional[Sequence[List[P.PushTarget]]] = None
                   ) -> Tuple[List[Outcome], set]:
        """One message with `rows` (all session parts on this server), each pushed on along its push chain in
        `chains` if any: per row its output [batch, seq, hidden] or the `RemoteError` the server answered for that
        row, and the indexes of the rows the server pushed on. A failure of the whole message (the stream ended or
        broke, the server did not answer a liveness ping while the reply was late, no reply within `step_timeout`,
        an error reply) raises, and the stream is closed (the next round reopens it)."""
        async with self._lock:
            try:
                return await self._step(rows, chains)
            except BaseException:
                self.close()
                raise

    async def _step(self, rows: Sequence[Row], chains: Optional[Sequence[List[P.PushTarget]]]
                    ) -> Tuple[List[Outcome], set]:
        if self.closed:
            raise P.RemoteError("closed", "the round stream is closed", self.peer_id)
        if self._responses is None:
            self._loop = asyncio.get_running_loop()
            self._responses = await self.manager.stub(self.peer_id).rpc_round(aio.iterate_queue(self._queue))
            if self.closed:  # closed from another thread while it opened: nothing closed these replies
                await self._responses.aclose()
                raise P.RemoteError("closed", "the round stream is closed", self.peer_id)
        if self._reader is None:
            self._reader = asyncio.ensure_future(self._read(self._responses))
        self._round_id += 1
        attach = [R.RoundAttach(stream_key=s.key, token=s.push_token) for s, _, _, _ in rows
                  if self._attached.get(s.key) != s.push_token]
        chains = chains if chains is not None else [[]] * len(rows)
        message = R.RoundStep(round_id=self._round_id, attach=attach, rows=[
            R.RoundRow(stream_key=s.key, start_position=start, step_id=step_id, batch=x.shape[0], seq=x.shape[1],
                       push_chain=chain)
            for (s, x, start, step_id), chain in zip(rows, chains)])
        wire_dtype = rows[0][0].wire_dtype  # the server's dtype (one server: one dtype)
        flat = R.join_rows([x for _, x, _, _ in rows])  # [sum(batch_i * seq_i), hidden]
        if wire_dtype is not None and flat.is_floating_point():
            flat = flat.to(wire_dtype)  # (one conversion for every row)
        self._unanswered += 1
        self._queue.put_nowait(P.make_request(message, [flat]))
        # the reply, waited for while the server answers liveness pings (a frozen or cut-off server fails in about
        # liveness_interval + liveness_timeout s); a server whose process died ends the stream at once
        pending = asyncio.ensure_future(self._replies.get())
        try:
            reply = await wait_while_alive(self.manager, self.peer_id, pending)
        finally:
            if not pending.done():
                pending.cancel()  # the reply of a failed server is not read (the stream closes)
        if reply is _END:
            self._replies.put_nowait(_END)  # (for any later reader of a stream that ended)
            who = "this client closed the round stream" if self.closed else "the server closed the round stream"
            raise P.RemoteError("closed", who, self.peer_id)
        response, raw = reply
        if raw.get("type") == "error":
            error = P.decode_parsed(raw, P.ErrorReply)
            raise P.RemoteError(error.code, error.message, self.peer_id)
        result = P.decode_parsed(raw, R.RoundResult)
        if result.round_id != message.round_id or [r.stream_key for r in result.rows] != [r.stream_key for r in
                                                                                            message.rows]:
            raise P.RemoteError("bad_reply", "the round's reply does not answer its rows", self.peer_id)
        for entry in attach:
            self._attached[entry.stream_key] = entry.token
        done = [(row, (s, x, start, _)) for row, (s, x, start, _) in zip(result.rows, rows) if row.code is None]
        if done:
            if len(response.tensors) != 1:
                raise P.RemoteError("bad_reply", "the round's reply carries no outputs", self.peer_id)
            flat_out = P.deserialize_tensor(response.tensors[0], max_elements=1 << 31)
            outputs = iter(R.split_rows(flat_out, [(x.shape[0], x.shape[1]) for _, (_, x, _, _) in done]))
        outcomes: List[Outcome] = []
        pushed = set()
        for n, (row, (stream, x, start, step_id)) in enumerate(zip(result.rows, rows)):
            outcome, on = self._outcome(stream, x.shape[1], start, row, next(outputs) if row.code is None else None)
            outcomes.append(outcome)
            if row.code is not None:
                self._attached.pop(stream.key, None)  # attached again next time (a closed part, a new token)
            elif isinstance(outcome, torch.Tensor):
                self._pushed.pop((stream.key, step_id), None)  # a pushed result that came too late for its row
                if on and chains[n]:
                    pushed.add(n)
        return outcomes, pushed

    def _outcome(self, stream: SpanStream, seq: int, start: int, row: R.RoundRowResult,
                 output: Optional[torch.Tensor]) -> Tuple[Outcome, bool]:
        """A row's result: its output [batch, seq, hidden] (the part's position moved on) or its error, and whether
        the server pushed it on."""
        if row.code is not None or output is None:
            return P.RemoteError(row.code or "bad_reply", row.message or "", self.peer_id), False
        if row.position != start + seq or output.shape[1] != seq:
            return P.RemoteError("bad_reply", f"server reported position {row.position}", self.peer_id), False
        stream.position = row.position
        return output, row.pushed

    async def wait_pushed(self, stream: SpanStream, seq: int, start: int, step_id: int, timeout: float
                          ) -> Optional[Tuple[Outcome, bool]]:
        """The result of the step `step_id` of `stream`'s part that the previous server pushed here: its output
        [batch, seq, hidden] or this server's error for it, and whether this server pushed it on; None if none came
        within `timeout` seconds (or the stream ended): the caller sends the step itself."""
        key = (stream.key, step_id)
        kept = self._pushed.pop(key, None)
        if kept is None:
            if self.closed or self._reader is None or self._reader.done():
                return None
            waiter = self._waiters[key] = asyncio.get_running_loop().create_future()
            try:
                kept = await asyncio.wait_for(waiter, timeout)
            except asyncio.TimeoutError:
                return None
            finally:
                if self._waiters.get(key) is waiter:
                    del self._waiters[key]
            if kept is None:
                return None
        return self._outcome(stream, seq, start, *kept)

    async def _read(self, responses: Any) -> None:
        """Every reply of the stream: those to this client's messages in order into `_replies`, the results of
        pushed rows to their waiters (or kept for them)."""
        try:
            async for response in responses:
                raw = json.loads(response.metadata) if response.metadata else {}
                if isinstance(raw, dict) and raw.get("pushed") is True and raw.get("type") == "round_result":
                    self._take_pushed(response, raw)
                    continue
                if self._unanswered <= 0:
                    logger.warning(f"round stream to {self.peer_id}: a reply to no message; the stream is ended")
                    return
                self._unanswered -= 1
                self._replies.put_nowait((response, raw if isinstance(raw, dict) else {}))
        except ValueError as e:
            logger.warning(f"round stream to {self.peer_id}: a reply that is not JSON ({e}); the stream is ended")
        except Exception as e:  # noqa: BLE001 - a broken stream reads as an ended one
            logger.debug(f"round stream to {self.peer_id} ended: {type(e).__name__}: {e}")
        finally:
            self._replies.put_nowait(_END)
            for waiter in self._waiters.values():
                if not waiter.done():
                    waiter.set_result(None)

    def _take_pushed(self, response: Any, raw: dict) -> None:
        try:
            result = P.decode_parsed(raw, R.RoundResult)
            done = [row for row in result.rows if row.code is None]
            outputs: List[Optional[torch.Tensor]] = [None] * len(result.rows)
            if done:
                if len(response.tensors) != 1:
                    raise P.ProtocolError("a pushed result carries no outputs")
                flat = P.deserialize_tensor(response.tensors[0], max_elements=1 << 31)
                # pushed rows are single tokens (`rounds._push_chain`): [1, 1, hidden] each, a copy each (a kept
                # row must not hold the whole message)
                parts = iter(R.split_rows(flat, [(1, 1)] * len(done)))
                outputs = [next(parts).clone() if row.code is None else None for row in result.rows]
        except P.ProtocolError as e:
            logger.warning(f"a malformed pushed result from {self.peer_id}: {e}")
            return
        for row, output in zip(result.rows, outputs):
            key = (row.stream_key, row.step_id)
            waiter = self._waiters.pop(key, None)
            self.pushed_rows += row.code is None
            if waiter is not None and not waiter.done():
                waiter.set_result((row, output))
                continue
            self._pushed[key] = (row, output)
            if len(self._pushed) > MAX_PUSHED_KEPT:  # rows nobody waits for any more (their sessions moved on)
                del self._pushed[next(iter(self._pushed))]

    def close(self) -> None:
        """End the stream (the server lets go of its attachments); from any thread."""
        if self.closed:
            return
        self.closed = True
        if self._loop is None:  # never opened: nobody waits on the queue
            self._queue.put_nowait(None)
            return
        responses = self._responses

        def end() -> None:
            self._queue.put_nowait(None)
            if self._reader is not None:  # it stops reading (its end wakes whoever waits on this stream)
                self._reader.cancel()
            if responses is not None:  # (behind the end mark; `call_stream`'s replies: closing them never fails)
                asyncio.ensure_future(responses.aclose())

        aio.call_on(self._loop, end)


# a stream the server ended is handed out until a round on it fails ("the server closed the round stream": the
# rows fail over at once) and closes it; no push chain goes through it meanwhile (`attached`)
ROUND_STREAMS: PerPeer[RoundStream] = PerPeer(RoundStream, lambda stream: not stream.closed, RoundStream.close)


def round_stream(manager: SwarmManager, peer_id: str) -> RoundStream:
    """The manager's round stream to `peer_id` (a new one if there is none or it was closed)."""
    return ROUND_STREAMS.get(manager, peer_id)


async def round_stats(manager: SwarmManager, peer_id: str) -> R.RoundStats:
    """A server's round counters (`rpc_round_stats`; a server without `rounds` has no such handler)."""
    response = await manager.stub(peer_id).rpc_round_stats(runtime_pb2.ExpertUID(uid=""),
                                                           timeout=manager.config.request_timeout)
    return P.decode(response.serialized_info, R.RoundStats)


def close_round_streams(manager: SwarmManager) -> None:
    """End the manager's round streams (`SwarmManager.shutdown` does); from any thread."""
    ROUND_STREAMS.close_all(manager)
