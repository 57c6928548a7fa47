"""Stepping many inference sessions in one round: `step_round` / `astep_round`, one message per server per round.

Each `InferenceSession` steps on its own streams (`session.py`); a client that steps many sessions together (the
gateway's engine, one round for every generation) calls `step_round(items)` instead: the sessions whose current hop
is the same server travel in ONE `swarm.wire.rounds.RoundStep` on ONE round stream per (client, server) pair
(`round_stream.RoundStream`, opened on first use and kept), each row tagged with its session part; the server runs
the rows through its batched step and answers once. Hop by hop the round's items advance through their chains, and
the items whose next hop is the same server are grouped again. With `round_push` the servers hand the rows on
themselves (`_push_chain`): the client sends a round to its first servers only, and waits for the others' results
on their round streams, sending a row itself only when its pushed result is late (`push_timeout`). The session
parts stay the sessions' own (their own caches, limits and failures on the servers): a round stream is attached to
a part with the part's secret.

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
import logging
from collections import defaultdict
from dataclasses import dataclass
from typing import Any, Awaitable, Callable, Dict, List, Mapping, Optional, Sequence, Tuple

import torch

from swarm.client.transport.manager import SwarmManager, unreachable
from swarm.client.transport.round_stream import (  # noqa: F401  (re-exported: the round API in one place)
    ROUND_STREAMS,
    Outcome,
    RoundStream,
    Row,
    close_round_streams,
    round_stats,
    round_stream,
)
from swarm.client.transport.session import InferenceSession
from swarm.client.transport.session_chain import METADATA_ROOM, BoundaryHistory
from swarm.client.transport.span_stream import SpanStream
from swarm.runtime import aio
from swarm.wire import protocol as P

logger = logging.getLogger(__name__)

# (session, inputs [batch, seq, hidden], options: `InferenceSession.astep`'s keyword arguments, or None)
RoundItem = Tuple[InferenceSession, torch.Tensor, Optional[Mapping[str, Any]]]


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

    async def send(indexes: List[int]) -> None:
        if not indexes:
            return
        chains = [_push_chain(group[n]) for n in indexes]
        got, on = await _send_rows(manager, peer_id, [_row(group[n]) for n in indexes], chains)
        outcomes.update(zip(indexes, got))
        pushed.update(indexes[i] for i in on)

    async def collect(indexes: List[int]) -> None:
        if not indexes:
            return
        stream = round_stream(manager, peer_id)
        timeout = manager.config.push_timeout
        rows = [_row(group[n]) for n in indexes]
        got = await asyncio.gather(*(stream.wait_pushed(part, x.shape[1], start, step_id, timeout)
                                     for part, x, start, step_id in rows))
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


def _row(flight: _Flight) -> Row:
    """The flight's row at its current hop: (session part, x [batch, seq, hidden], start position, step id)."""
    return flight.session._streams[flight.hop], flight.x, flight.session.position, flight.step_id


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
        chain.append(after.push_target)
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
