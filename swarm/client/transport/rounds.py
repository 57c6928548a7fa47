"""Stepping many inference sessions in one round: `step_round` / `astep_round`, one message per server per round.

Each `InferenceSession` steps on its own streams (`session.py`); a client that steps many sessions together (the
gateway's engine, one round for every generation) calls `step_round(items)` instead: the sessions whose current hop
is the same server travel in ONE `swarm.wire.rounds.RoundStep` on ONE round stream per (client, server) pair
(`RoundStream`, opened on first use and kept), each row tagged with its session part; the server runs the rows
through its batched step and answers once. Hop by hop the round's items advance through their chains, and the
items whose next hop is the same server are grouped again. The session parts stay the sessions' own (their own
caches, limits and failures on the servers): a round stream is attached to a part with the part's secret.

Correctness first: an item steps on its session's own streams (`InferenceSession.astep`) where the round cannot
carry it (`round_ready`): a session not open yet (its first step opens it), closed, with spot-check verification,
with row edits (beam parents, left padding) or a step longer than one message, with compressed hidden states, or
whose chain has no server with the `rounds` capability. In a chain that mixes releases (a rolling upgrade), the hops
on servers without `rounds` (or without `push`: a round stream attaches to a part with its push token) take the
item's step on the session's own stream to that server, in the same wave as the others' round messages. An item
whose row fails (an error reply for that row, a broken round stream, a failed step on an older server) is stepped
again whole through `astep`, with the session's failover: the servers that already took the step overwrite the
same positions. Rewinds need nothing special: a row starts at the session's position, whatever it is.
"""
from __future__ import annotations

import asyncio
import json
import logging
from collections import defaultdict
from dataclasses import dataclass
from typing import Any, Awaitable, Callable, Dict, List, Mapping, Optional, Sequence, Tuple, Union

import torch
from hivemind.proto import runtime_pb2

from swarm.client.transport.liveness import wait_while_alive
from swarm.client.transport.manager import SwarmManager, unreachable
from swarm.client.transport.per_peer import PerPeer
from swarm.client.transport.session import InferenceSession
from swarm.client.transport.session_chain import METADATA_ROOM, BoundaryHistory
from swarm.client.transport.span_stream import SpanStream
from swarm.runtime import aio
from swarm.wire import protocol as P
from swarm.wire import rounds as R

logger = logging.getLogger(__name__)

# (session, inputs [batch, seq, hidden], options: `InferenceSession.astep`'s keyword arguments, or None)
RoundItem = Tuple[InferenceSession, torch.Tensor, Optional[Mapping[str, Any]]]
Outcome = Union[torch.Tensor, BaseException]
# a row of one server's round: (session part, hidden [batch, seq, hidden], start position, step id)
Row = Tuple[SpanStream, torch.Tensor, int, int]


MAX_PUSHED_KEPT = 4096  # pushed results kept for rows not waited for yet; the oldest go first
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
        self._lock = asyncio.Lock()
        self._attached: Dict[str, str] = {}  # stream key -> the token it was attached with
        self._round_id = 0
        self.closed = False
        self.pushed_rows = 0  # results of rows that came pushed (the client did not send them here)
        self._loop: Optional[asyncio.AbstractEventLoop] = None  # the client loop, once the stream opens there

    def attached(self, stream: SpanStream) -> bool:
        """Whether the session part is attached to this stream with its current token (pushes for it land here)."""
        return not self.closed and self._reader is not None and self._attached.get(stream.key) == stream.push_token

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
            error = P.decode(response.metadata, P.ErrorReply)
            raise P.RemoteError(error.code, error.message, self.peer_id)
        result = P.decode(response.metadata, R.RoundResult)
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
            if row.code == "duplicate":  # taken from the previous server's push, answered before this reply
                outcome, pushed_on = self._duplicate(stream, x, start, step_id)
                outcomes.append(outcome)
                if pushed_on:
                    pushed.add(n)
            elif row.code is not None:
                self._attached.pop(stream.key, None)  # attached again next time (a closed part, a new token)
                outcomes.append(P.RemoteError(row.code, row.message or "", self.peer_id))
            elif row.position != start + x.shape[1]:
                outcomes.append(P.RemoteError("bad_reply", f"server reported position {row.position}", self.peer_id))
            else:
                stream.position = row.position
                outcomes.append(next(outputs))
                if row.pushed and chains[n]:
                    pushed.add(n)
        return outcomes, pushed

    def _duplicate(self, stream: SpanStream, x: torch.Tensor, start: int, step_id: int) -> Tuple[Outcome, bool]:
        kept = self._pushed.pop((stream.key, step_id), None)
        if kept is None:
            return P.RemoteError("bad_reply", "a step answered as pushed came with no pushed result",
                                 self.peer_id), False
        return self._pushed_outcome(stream, x.shape[1], start, *kept)

    def _pushed_outcome(self, stream: SpanStream, seq: int, start: int, row: R.RoundRowResult,
                        output: Optional[torch.Tensor]) -> Tuple[Outcome, bool]:
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
        return self._pushed_outcome(stream, seq, start, *kept)

    async def _read(self, responses: Any) -> None:
        """Every reply of the stream: those to this client's messages in order into `_replies`, the results of
        pushed rows to their waiters (or kept for them)."""
        try:
            async for response in responses:
                raw = json.loads(response.metadata) if response.metadata else {}
                if isinstance(raw, dict) and raw.get("pushed") is True and raw.get("type") == "round_result":
                    self._take_pushed(response)
                else:
                    self._replies.put_nowait((response, raw if isinstance(raw, dict) else {}))
        except Exception as e:  # noqa: BLE001 - a broken stream reads as an ended one
            logger.debug(f"round stream to {self.peer_id} ended: {type(e).__name__}: {e}")
        finally:
            self._replies.put_nowait(_END)
            for waiter in self._waiters.values():
                if not waiter.done():
                    waiter.set_result(None)

    def _take_pushed(self, response: Any) -> None:
        try:
            result = P.decode(response.metadata, R.RoundResult)
            done = [row for row in result.rows if row.code is None]
            outputs: List[Optional[torch.Tensor]] = [None] * len(result.rows)
            if done:
                if len(response.tensors) != 1:
                    raise P.ProtocolError("a pushed result carries no outputs")
                flat = P.deserialize_tensor(response.tensors[0], max_elements=1 << 31)
                if flat.ndim != 2 or flat.shape[0] != len(done):  # pushed rows are single tokens (`pushable`)
                    raise P.ProtocolError(f"pushed outputs of shape {list(flat.shape)} for {len(done)} rows")
                parts = iter(flat.view(len(done), 1, 1, flat.shape[1]).unbind(0))  # [1, 1, hidden] each
                outputs = [next(parts) if row.code is None else None for row in result.rows]
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


def round_ready(session: InferenceSession, hidden: torch.Tensor, options: Optional[Mapping[str, Any]]) -> bool:
    """Whether `step_round` can carry this step in round messages (else it goes through `astep`)."""
    if session._closed or session.batch_size is None or session._verifier is not None or session.check_all_next:
        return False
    if any(value is not None for value in (options or {}).values()):
        return False  # beam parents, left padding: on the session's own streams
    if hidden.ndim != 3 or hidden.shape[0] != session.batch_size or not session._streams:
        return False
    sent = session._history.get(session._streams[0].hop.start)
    if sent is not None and sent.buffer.shape[-1] != hidden.shape[-1]:
        return False  # not this model's hidden size: astep says so
    if session.position + hidden.shape[1] > session.max_length or \
            (hidden.shape[1] > 1 and hidden.shape[1] > session._chunk_len(hidden)):  # (one position always fits)
        return False
    return (all(s.compression is None and not s.open_pending for s in session._streams)
            and any(in_rounds(s) for s in session._streams))


def in_rounds(stream: SpanStream) -> bool:
    """Whether this session part's server takes its steps in round messages (else on the part's own stream)."""
    return "rounds" in stream.hop.capabilities and stream.pushes


@dataclass
class _Flight:
    """One item on its way through its chain in the round."""
    index: int  # in the round's items
    session: InferenceSession
    inputs: torch.Tensor  # [batch, seq, hidden], as given (what a fallback sends again)
    x: torch.Tensor  # the current hop's input
    step_id: int
    hop: int = 0
    pushed: bool = False  # the previous server pushed x to the current hop's server (its result comes there)


def step_round(items: Sequence[RoundItem]) -> List[Outcome]:
    """`astep_round` from plain code (the engine's thread)."""
    return aio.run(astep_round(items))


OnOutcome = Callable[[int, Outcome], None]


async def astep_round(items: Sequence[RoundItem], on_outcome: Optional[OnOutcome] = None) -> List[Outcome]:
    """Step every item's session once: items are (session, inputs [batch, seq, hidden] for positions
    session.position.., options: `astep`'s keyword arguments or None). Returns, per item in order, what
    `session.astep(inputs, **options)` would: the last block's output [batch, seq, hidden], or the exception that
    item raised (its session's `SessionError`, a `ValueError` for bad inputs, ...); an exception in one item never
    fails the others. Each session's position advances as with `astep`. A session appears at most once per round
    (a second appearance gets a ValueError). Items that share a server at a hop travel in one message to it (see
    the module's docstring for those that go through `astep` instead).

    Contract for callers (the gateway's engine): await it on the client loop (`swarm.runtime.aio`; `step_round`
    from any other thread); a session must not be stepped elsewhere (its own `astep`, a rewind) while a round that
    holds it runs; inputs are what `astep` takes (embeddings, or the previous stage's hidden states), outputs are
    the last block's hidden states, before the final norm and LM head (the caller's). Rounds from several callers
    may run at once: they take turns per server. Items of different models (managers) may share a round.

    `on_outcome(index, outcome)`, if given, is called on the loop as soon as each item's outcome is known (the
    items that rode round messages when their last hop answered; a fallback or a retried item when its own `astep`
    ends), so that a caller need not wait for the slowest item (a failover replay) to use the others'."""
    outcomes: List[Optional[Outcome]] = [None] * len(items)

    def settle(index: int, outcome: Outcome) -> None:
        outcomes[index] = outcome
        if on_outcome is not None:
            try:
                on_outcome(index, outcome)
            except Exception:  # noqa: BLE001 - the caller's callback must not break the round
                logger.exception("a round's outcome callback failed")

    async def alone_step(index: int, step: Awaitable[torch.Tensor]) -> None:
        try:
            outcome: Outcome = await step
        except BaseException as e:  # noqa: BLE001 - the item's own error (CancelledError included), as gather's
            outcome = e
        settle(index, outcome)

    seen: set = set()
    flights: List[_Flight] = []
    alone: List[Any] = []  # the astep coroutines of items that go on their sessions' own streams
    for index, (session, hidden, options) in enumerate(items):
        if id(session) in seen:
            settle(index, ValueError("a session appears twice in one round"))
            continue
        seen.add(id(session))
        if round_ready(session, hidden, options):
            flights.append(_Flight(index, session, hidden, hidden, session._next_step_id()))
        else:
            alone.append(alone_step(index, session.astep(hidden, **dict(options or {}))))
    alone_task = asyncio.gather(*alone)
    retried: List["asyncio.Future[None]"] = []  # failed rows stepped again whole, with failover, at once
    try:
        while flights:
            # (manager, server, whether the part takes round messages) -> the flights whose current hop is there
            groups: Dict[Tuple[SwarmManager, str, bool], List[_Flight]] = defaultdict(list)
            for flight in flights:
                stream = flight.session._streams[flight.hop]
                groups[(flight.session.manager, stream.hop.peer_id, in_rounds(stream))].append(flight)
            results = await asyncio.gather(*(_send_group(manager, peer, group)
                                             for (manager, peer, _), group in groups.items()))
            flights = []
            for group, (outputs, pushed) in zip(groups.values(), results):
                for n, (flight, output) in enumerate(zip(group, outputs)):
                    flight.pushed = n in pushed
                    if isinstance(output, BaseException):
                        logger.debug(f"round step of session {flight.session.session_id} failed ({output}); "
                                     f"stepping it on its own streams")
                        # servers that took the step overwrite the same positions
                        retried.append(asyncio.ensure_future(
                            alone_step(flight.index, flight.session.astep(flight.inputs))))
                        continue
                    flight.x, flight.hop = output, flight.hop + 1
                    if flight.hop < len(flight.session._streams):
                        flights.append(flight)
                    else:
                        flight.session.position += flight.inputs.shape[1]
                        settle(flight.index, output)
    finally:
        await asyncio.gather(alone_task, *retried)
    return [outcome if outcome is not None else RuntimeError("no outcome") for outcome in outcomes]


async def _send_group(manager: SwarmManager, peer_id: str, group: List[_Flight]) -> Tuple[List[Outcome], set]:
    """The rows of `group` (their current hops are all on `peer_id`, all in rounds or none) in as few messages as
    the server's limits allow (one, unless the round is larger than a message), or each on its part's own stream;
    each boundary's history records the inputs, as `InferenceSession._step_chunk` does. Rows that the previous
    server pushed here are not sent: their results are waited for on the round stream (`push_timeout`), and only
    those that do not come are sent. Per row its outcome, and the indexes of the rows pushed on to their next hop."""
    sent: List[int] = []  # index in group of each row sent now
    awaited: List[int] = []  # rows pushed here by the previous server
    failed: Dict[int, BaseException] = {}  # index in group -> what went wrong before anything was sent
    for n, flight in enumerate(group):
        session, stream = flight.session, flight.session._streams[flight.hop]
        try:
            assert session.batch_size is not None
            history = session._history.get(stream.hop.start)
            if history is None:
                history = session._history[stream.hop.start] = BoundaryHistory(
                    session.batch_size, session.max_length, flight.x.shape[-1], flight.x.dtype)
            if session.position == 0:
                history.padding = None
            history.write(session.position, flight.x)
        except Exception as e:  # noqa: BLE001 - this item's own error (astep gives it again, or its own)
            failed[n] = e
            continue
        (awaited if flight.pushed else sent).append(n)
    outcomes: Dict[int, Outcome] = dict(failed)
    pushed: set = set()

    def row(n: int) -> Row:
        flight = group[n]
        return flight.session._streams[flight.hop], flight.x, flight.session.position, flight.step_id

    async def send(indexes: List[int]) -> None:
        if not indexes:
            return
        chains = [_push_chain(group[n]) for n in indexes]
        got, on = await _send_rows(manager, peer_id, [row(n) for n in indexes], chains)
        outcomes.update(zip(indexes, got))
        pushed.update(indexes[i] for i in on)

    async def collect(indexes: List[int]) -> None:
        if not indexes:
            return
        stream = round_stream(manager, peer_id)
        timeout = manager.config.push_timeout
        got = await asyncio.gather(*(stream.wait_pushed(*_wait_args(group[n]), timeout) for n in indexes))
        late = [n for n, kept in zip(indexes, got) if kept is None]
        for n, kept in zip(indexes, got):
            if kept is not None:
                outcomes[n] = kept[0]
                if kept[1]:
                    pushed.add(n)
        if late:  # the push got lost (or is that late): deliver those steps ourselves
            logger.debug(f"{len(late)} pushed step(s) did not come back from {peer_id}; sending them")
            for n in late:
                group[n].pushed = False
            await send(late)

    await asyncio.gather(send(sent), collect(awaited))
    return [outcomes[n] for n in range(len(group))], pushed


def _wait_args(flight: _Flight) -> Tuple[SpanStream, int, int, int]:
    return flight.session._streams[flight.hop], flight.x.shape[1], flight.session.position, flight.step_id


def _push_chain(flight: _Flight) -> List[P.PushTarget]:
    """Where the current hop's server may push this row's output on (`round_push`): the session's parts of the next
    hops, as far as each server announces `round_push` and each part is attached to the client's round stream to
    its server (its result comes back there), for a row of one token; empty: the client sends it on itself."""
    session = flight.session
    streams = session._streams
    chain: List[P.PushTarget] = []
    if not session.manager.config.use_push or flight.x.shape[:2] != (1, 1) \
            or "round_push" not in streams[flight.hop].hop.capabilities:
        return chain
    for after in streams[flight.hop + 1:]:
        if "round_push" not in after.hop.capabilities or not in_rounds(after):
            break
        stream = ROUND_STREAMS.peek(session.manager, after.hop.peer_id)
        if stream is None or not stream.attached(after):
            break
        chain.append(P.PushTarget(peer_id=after.hop.peer_id, stream_key=after.key, push_token=after.push_token))
    return chain


async def _send_rows(manager: SwarmManager, peer_id: str, rows: List[Row],
                     chains: Sequence[List[P.PushTarget]]) -> Tuple[List[Outcome], set]:
    if not in_rounds(rows[0][0]):  # an older server: each session's step on its own stream, one message each
        alone = await asyncio.gather(*(stream.step(x, start, step_id) for stream, x, start, step_id in rows),
                                     return_exceptions=True)
        if not any(isinstance(outcome, BaseException) for outcome in alone):
            manager.mark_ok(peer_id)
        return list(alone), set()
    limits = rows[0][0].hop.limits
    outcomes: List[Outcome] = []
    pushed: set = set()
    for part in _messages(rows, limits, manager.config.max_chunk_bytes):
        try:
            got, on = await round_stream(manager, peer_id).step([rows[i] for i in part], [chains[i] for i in part])
            pushed.update(part[i] for i in on)
            outcomes += got
        except Exception as e:  # noqa: BLE001 - the whole message failed (the stream closed): each item alone
            logger.warning(f"a round message to {peer_id} failed ({type(e).__name__}: {e}); its {len(part)} "
                           f"row(s) step on their sessions' own streams")
            if unreachable(e):  # the server is gone: those sessions fail it over at once, not after another wait
                for i in part:
                    rows[i][0].failed = e
            outcomes += [e] * len(part)
    if not any(isinstance(outcome, BaseException) for outcome in outcomes):
        manager.mark_ok(peer_id)
    return outcomes, pushed


def _messages(rows: List[Row], limits, max_bytes: int) -> List[List[int]]:
    """The indexes of `rows` cut into messages under the server's announced `max_step_tokens` and
    `max_message_bytes` and the client's `max_chunk_bytes` (a round of decode steps is one message)."""
    max_tokens = limits.max_step_tokens if limits is not None else None
    if limits is not None:
        max_bytes = min(max_bytes, limits.max_message_bytes - METADATA_ROOM)
    parts: List[List[int]] = [[]]
    tokens = size = 0
    for i, row in enumerate(rows):
        x = row[1]
        row_tokens = x.shape[0] * x.shape[1]
        row_bytes = x.numel() * x.element_size()
        over_tokens = max_tokens is not None and tokens + row_tokens > max_tokens
        if parts[-1] and (over_tokens or size + row_bytes > max_bytes):
            parts.append([])
            tokens = size = 0
        parts[-1].append(i)
        tokens += row_tokens
        size += row_bytes
    return parts
