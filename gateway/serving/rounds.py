"""The engine round (issue 46): one thread that steps every active generation together, as continuous batching.

A generation (`gateway.serving.runs.GenerationRun`) sends its prompt on its own worker thread (the session pool's
fallbacks stay there), then `EngineRounds.run(member)` hands its decode steps to the round thread and waits for its
end; a member joins with its prompt's step landed (its last states), so its first pick is made in the round too.
Generations join and leave between rounds. Each round:
1. every member's policy says whether it goes on (`DecodeLoop.ended`; `before_step`: a cancelled or late generation
   leaves with its error), and its next input is embedded (`swarm.client.api.round_inputs`: the decode steps'
   tokens of every member in one lookup; `RoundSession.round_input` for a session of another kind);
2. `send_round`: every member's step is sent on the client's loop, the steps that share a server in one message
   to it (`swarm.client.api.astep_sessions`, over `swarm.client.transport.rounds`);
   the round waits for its steps but not for stragglers (`EngineRounds._wait`): a step still in flight (a failover
   replaying history onto a new server) lands in a later round, so it never stalls the others longer than their
   own steps; a member whose step raised (failover exhausted, a server error) leaves with its error alone, a
   retraction (`OutputsRetracted`) cuts its ids back and it goes on next round;
3. ONE LM-head matmul over the last states of every row of every member (per client head: one model, one head);
4. ONE pick over all those rows (`swarm.client.decoding.round_pick.pick_round`: one argmax over greedy rows, one
   softmax over sampled ones with each row's own generator, grammar-masked rows row by row in the same round);
5. each member's picks taken by its policy (`DecodeLoop.take`: text, stop strings, events), the events of all
   members handed to their event loops together (`gateway.serving.events.batched_events`).
A member's own failure anywhere (its processors, its text, its events) ends that member only.

What does not run in the round keeps the per-thread `DecodeLoop` (`GenerationRun.run` decides): speculative decoding
(drafts and rewinds per session), spot-check verification (text held back, retractions resumed after `settle`),
sessions that cannot step in a round (`swarm.client.api.round_capable`).
"""
from __future__ import annotations

import asyncio
import functools
import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Sequence, Set, Tuple, cast

import torch

from gateway.serving.events import ShuttingDown, batched_events
from swarm.client.api import (
    DecodeLoop,
    OutputsRetracted,
    RoundSession,
    Sampler,
    TokenChoice,
    astep_sessions,
    pick_round,
    round_inputs,
)
from swarm.runtime import aio
from swarm.runtime.taskpool import PRIORITY_DECODE, client_pool
from swarm.runtime.threads import serial_torch_here

logger = logging.getLogger("swarmgate.gateway")

STRAGGLER_MIN_S = 0.05  # the least a round waits for its last steps once half of them landed (`EngineRounds._wait`)


@dataclass(eq=False)
class Member:
    """One generation in the rounds: its policy (`GenerationRun`), lease, loop and ids [n, seq] so far."""

    run: Any  # gateway.serving.runs.GenerationRun (its samplers, its DecodePolicy side)
    lease: Any  # gateway.serving.sessions.Lease: `.session` is a RoundSession
    loop: DecodeLoop
    ids: torch.Tensor
    done: threading.Event = field(default_factory=threading.Event)
    error: Optional[BaseException] = None
    remaining: List[Optional[int]] = field(default_factory=list)
    hidden: Optional[torch.Tensor] = None  # this round's input [n, new, hidden]
    step: Optional["Step"] = None  # its step in flight (it may land in a later round)


class Step:
    """One member's step in flight: its outcome (last states [n, hidden], or its error) once `landed`. Set on the
    client's loop, read on the round thread after `Landing.wait` (no per-step lock nor condition: one per round)."""

    __slots__ = ("landed", "outcome")

    def __init__(self, outcome: Any = None, landed: bool = False) -> None:
        """`Step(states, True)`: a step already landed (a prompt's, stepped on the generation's worker thread:
        its first pick is made in the next round with the others', `EngineRounds.run`)."""
        self.landed = landed
        self.outcome: Any = outcome

    def result(self) -> torch.Tensor:
        if isinstance(self.outcome, BaseException):
            raise self.outcome
        return self.outcome


class Landing:
    """Where the steps of the rounds land: the loop marks each step landed (`land`), the round thread waits until a
    number of its steps have (`wait`). One condition for all steps, notified only when the waiter's count is
    reached: a round of many rows costs one wake-up, not a lock, a condition and a notify per row (issue 46)."""

    def __init__(self) -> None:
        self._cond = threading.Condition(threading.Lock())
        self._watched: Set[int] = set()  # ids of the steps the round thread waits on (not landed yet), while it waits
        self._missing = 0  # how many of them must still land to wake it

    def land(self, step: Step, outcome: Any) -> None:
        """From the client's loop: `step` ends with `outcome`."""
        with self._cond:
            step.outcome, step.landed = outcome, True
            if id(step) in self._watched:
                self._watched.discard(id(step))
                self._missing -= 1
                if self._missing <= 0:
                    self._watched = set()
                    self._cond.notify()

    def wait(self, steps: Sequence[Step], need: int, timeout: Optional[float] = None) -> int:
        """Until at least `need` of `steps` landed (or `timeout` seconds passed): how many have."""
        with self._cond:
            landed = sum(s.landed for s in steps)
            if landed < need:
                self._watched, self._missing = {id(s) for s in steps if not s.landed}, need - landed
                self._cond.wait(timeout)
                self._watched, self._missing = set(), 0
                landed = sum(s.landed for s in steps)
            return landed


def send_round(steps: Sequence[Tuple[RoundSession, torch.Tensor, torch.Tensor]], landing: Landing) -> List[Step]:
    """Send every (session, ids [n, seq], hidden [n, new, hidden]) step of a round on the client's loop (one
    hand-over for the round); each `Step` lands (`landing`) with its last states [n, hidden] or its error, as soon
    as that step ends. The client's sessions go together (`swarm.client.api.astep_sessions`: the steps that share a
    server travel in one message to it, issue 46's one message per server per round); a session of another kind
    (`round_step` only) steps on its own. The one place a round's steps are sent."""
    sent = [Step() for _ in steps]
    together = [n for n, (session, _, _) in enumerate(steps) if callable(getattr(session, "round_finish", None))]
    alone = sorted(set(range(len(steps))) - set(together)) if len(together) < len(steps) else []
    riding = [sent[n] for n in together]

    def done(index: int, outcome: Any) -> None:
        landing.land(riding[index], outcome)

    def start() -> None:
        if together:
            round_task = asyncio.ensure_future(astep_sessions([cast(Any, steps[n]) for n in together], done))
            _running.add(round_task)  # (the loop holds tasks weakly: one nobody holds may vanish mid-step)
            round_task.add_done_callback(functools.partial(_round_ended, landing, riding))
        for n in alone:
            session, ids, hidden = steps[n]
            task = asyncio.ensure_future(session.round_step(ids, hidden))
            _running.add(task)
            task.add_done_callback(functools.partial(_settle, landing, sent[n]))

    if steps:
        aio.get_loop().call_soon_threadsafe(start)
    return sent


def _round_ended(landing: Landing, steps: List[Step], task: "asyncio.Future[Any]") -> None:
    """A round of the client's sessions ended: every step has its outcome (`done`), unless the round itself broke."""
    _running.discard(task)
    broken = (asyncio.CancelledError("the round was cancelled") if task.cancelled() else task.exception())
    for step in steps:
        if not step.landed:
            landing.land(step, broken or RuntimeError("the round ended without this step's outcome"))


_running: Set["asyncio.Future[Any]"] = set()  # the steps in flight (touched on the client's loop only)


def _settle(landing: Landing, step: Step, task: "asyncio.Future[torch.Tensor]") -> None:
    _running.discard(task)
    if task.cancelled():
        landing.land(step, asyncio.CancelledError("the step was cancelled"))
    elif task.exception() is not None:
        landing.land(step, cast(BaseException, task.exception()))
    else:
        landing.land(step, task.result())


class EngineRounds:
    """The round thread (module docstring). `rounds`: rounds run so far; `largest`: the most rows one round had."""

    def __init__(self, vocab_size: int, on_rows: Optional[Callable[[int], None]] = None):
        """`on_rows(rows)`: told how many rows each LM head of a round picked (the gateway's `round_rows`)."""
        self.vocab_size, self.on_rows = vocab_size, on_rows
        self._joining: List[Member] = []
        self._wake = threading.Condition()
        self._thread: Optional[threading.Thread] = None
        self._stopped = False
        self._landing = Landing()
        self.rounds = 0
        self.largest = 0

    def run(self, member: Member) -> torch.Tensor:
        """Step `member` in the rounds until it ends (called on its worker thread, which waits): its final ids
        [n, seq]; raises its own error (cancelled, timed out, a failed step). A member may join with its prompt's
        step landed (`member.step`: its last states [n, hidden], `member.remaining` set): the next round's LM head
        and pick take its first tokens with every other row (no head of its own on the compute thread)."""
        with self._wake:
            if self._stopped:
                raise ShuttingDown("the engine is shutting down")
            self._joining.append(member)
            if self._thread is None:
                self._thread = threading.Thread(target=self._serve, name="engine-round", daemon=True)
                self._thread.start()
            self._wake.notify()
        member.done.wait()
        if member.error is not None:
            raise member.error
        return member.ids

    def shutdown(self) -> None:
        """Stop after the round in flight; members still waiting end with an error (their sessions are closed by
        their runs)."""
        with self._wake:
            self._stopped = True
            self._wake.notify()

    # ---- the round thread ---------------------------------------------------------------------------------------
    def _serve(self) -> None:
        serial_torch_here()
        active: List[Member] = []
        while True:
            with self._wake:
                while not self._joining and not active and not self._stopped:
                    self._wake.wait()
                if self._stopped:
                    for m in active + self._joining:
                        self._leave(m, ShuttingDown("the engine is shutting down"))
                    self._joining.clear()
                    return
                active += self._joining
                self._joining.clear()
            try:
                with batched_events():
                    active = self._round(active)
            except BaseException as e:  # noqa: BLE001 - a bug in the round itself: fail its members, keep serving
                logger.exception("an engine round failed")
                for m in active:
                    self._leave(m, e)
                active = []

    def _round(self, active: List[Member]) -> List[Member]:
        """One round over `active`; returns the members that go on."""
        stepping: List[Member] = []
        for m in active:
            if m.step is not None:
                continue  # its step from an earlier round is still in flight
            try:
                if m.loop.ended(m.ids):
                    self._leave(m)
                    continue
                m.run.before_step()
                m.remaining = m.loop.remaining(m.ids)
                stepping.append(m)
            except BaseException as e:  # noqa: BLE001 - this member's own end (cancelled, deadline, ...)
                self._leave(m, e)
        # every member's next input, the decode steps' tokens in one embedding lookup (`round_inputs`)
        inputs = round_inputs([(m.lease.session, m.ids) for m in stepping])
        for m, hidden in zip(stepping, inputs):
            if isinstance(hidden, BaseException):
                self._leave(m, hidden)  # its own error (a failed rewind, ...)
            else:
                m.hidden = hidden
        stepping = [m for m in stepping if m.hidden is not None]
        earlier = [m.step for m in active if m.step is not None]  # (before this round's are set)
        sent = send_round([(m.lease.session, m.ids, cast(torch.Tensor, m.hidden)) for m in stepping], self._landing)
        for m, step in zip(stepping, sent):
            m.hidden, m.step = None, step
        self._wait(sent, earlier)
        stepped: List[Tuple[Member, torch.Tensor]] = []
        for m in active:
            if m.step is None or not m.step.landed:
                continue
            step, m.step = m.step, None
            try:
                stepped.append((m, step.result()))
            except OutputsRetracted as retracted:  # a lying server caught: pick again from its position next round
                m.ids = m.run.retract(retracted, m.ids)
            except BaseException as e:  # noqa: BLE001 - this member's step failed (failover exhausted, ...)
                self._leave(m, e)
        if stepped:
            self._pick_and_take(stepped)
        self.rounds += 1
        return [m for m in active if not m.done.is_set()]

    def _wait(self, sent: List[Step], earlier: List[Step]) -> None:
        """Wait for this round's steps, but not for stragglers: once half of them landed, the rest get twice the
        time that took (at least `STRAGGLER_MIN_S`); a step still in flight then (a failover replaying a server's
        history, a slow server) lands in a later round, and never holds up the others' round longer than their
        own steps. With nothing sent this round, wait for any earlier step to land (or a new member)."""
        if not sent:
            if earlier:
                self._landing.wait(earlier, 1, timeout=STRAGGLER_MIN_S)
            return
        start, half = time.monotonic(), len(sent) - len(sent) // 2
        while self._landing.wait(sent, half, timeout=1.0) < half:
            pass
        if half < len(sent):
            self._landing.wait(sent, len(sent), timeout=max(STRAGGLER_MIN_S, 2 * (time.monotonic() - start)))

    def _pick_and_take(self, stepped: List[Tuple[Member, torch.Tensor]]) -> None:
        """One LM head per client head over every row, one pick over the rows still generating, then each member's
        policy takes its rows' tokens."""
        by_head: Dict[int, List[Tuple[Member, torch.Tensor]]] = {}
        for m, out in stepped:
            by_head.setdefault(id(m.lease.session.head), []).append((m, out))
        for group in by_head.values():
            head = group[0][0].lease.session.head
            states = torch.cat([out for _, out in group]) if len(group) > 1 else group[0][1]  # [rows, hidden]
            # the client's compute thread, as every LM head of the process [rows, vocab] float32
            logits = client_pool().call(PRIORITY_DECODE, head.head, states)[:, :self.vocab_size]
            self.largest = max(self.largest, logits.shape[0])
            if self.on_rows is not None:
                self.on_rows(logits.shape[0])
            rows: List[Tuple[Sampler, torch.Tensor]] = []
            where: List[Tuple[int, int, int]] = []  # (member in group, row in member, row in logits)
            start = 0
            for k, (m, out) in enumerate(group):
                samplers = m.run.samplers.samplers
                for i, left in enumerate(m.remaining):
                    if left is not None:
                        rows.append((samplers[i], m.ids[i]))
                        where.append((k, i, start + i))
                start += out.shape[0]
            # every row still generating (the usual round): the logits as they are, no gathered copy
            chosen = logits if len(where) == logits.shape[0] else logits[[r for _, _, r in where]]
            picked = pick_round(rows, chosen) if rows else []
            picks: List[List[Optional[TokenChoice]]] = [[None] * out.shape[0] for _, out in group]
            failed: Dict[int, BaseException] = {}
            for (k, i, _), choice in zip(where, picked):
                if isinstance(choice, BaseException):
                    failed.setdefault(k, choice)
                else:
                    picks[k][i] = choice
            parts = torch.split(logits, [out.shape[0] for _, out in group])  # each member's rows, views at once
            for k, ((m, _), part) in enumerate(zip(group, parts)):
                if k in failed:
                    self._leave(m, failed[k])
                    continue
                try:
                    m.ids = m.loop.take(m.ids, [(picks[k], part)])
                except BaseException as e:  # noqa: BLE001 - this member's own failure (its text, its events)
                    self._leave(m, e)

    @staticmethod
    def _leave(m: Member, error: Optional[BaseException] = None) -> None:
        m.error = error
        m.done.set()
