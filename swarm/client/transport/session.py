"""Client inference sessions: one long-lived stream per server of the chain, positions tracked end to end.

`InferenceSession.step(hidden [batch, seq, hidden]) -> [batch, seq, hidden]` sends the new positions through
every server of the chain; each server keeps the session's KV cache, so only new tokens travel. Long inputs
are cut into chunks that fit one message. `rewind(position)` makes the next step overwrite from an earlier
position (the servers drop the rest of their cache). The inputs sent to each span are kept so that a failed
span can be rebuilt on a replacement server by replaying them. A session with a LoRA `adapter` is routed only
through servers that hold it (failover too), and names it when it opens each server's part.

Beam search: `step(hidden, hypo_ids=...)` makes every server reorder the session's cache rows by the beams'
parent ids before the step (no re-prefill); the kept inputs are reordered the same way once a span has done it,
so a replay rebuilds the reordered cache. A left-padded batch: `step(hidden, left_padding=...)` at position 0
tells the servers each row's leading padding (never attended; positions count from the first real token).
"""
from __future__ import annotations

import asyncio
import logging
import uuid
from typing import Collection, FrozenSet, List, Optional, Sequence

import torch

from swarm.client.transport import prefix as prefix_cache
from swarm.client.transport.manager import SwarmManager, needs_for
from swarm.client.transport.routing import RouteHop
from swarm.client.transport.session_chain import BoundaryHistory, SessionChain
from swarm.client.transport.span_stream import SessionError
from swarm.client.transport.verify import BackgroundChecks, OutputsRetracted, ServerMismatch, verifier_for
from swarm.runtime import aio
from swarm.wire import protocol as P

logger = logging.getLogger(__name__)

# the longest step pushed server to server: decode steps, and speculative steps (a token plus its drafts, verified
# in one pass); longer steps (prefill) go through the client, whose copy of each span's output is the history
PUSH_MAX_TOKENS = 16


class InferenceSession(SessionChain):
    """A session over the whole block stack (or blocks [start, end)), usable as a context manager.

    Failover: the client keeps, for every block boundary where a span starts, the hidden states it sent there
    (`session_chain.BoundaryHistory`). When a server fails (lost connection, time-out, an error reply), it is
    banned, only its span is re-routed (possibly onto several servers: `SessionChain._replace`), the replacement
    replays that boundary's history from position 0 to rebuild its cache, and the step goes on; other servers see
    only new tokens. A step gives up with `SessionError` after `max_retries` failures, except while blocks whose
    only servers could not be reached wait for them to be tried again (`SwarmManager.sole_retry_wait`), for up to
    `sole_retry_patience` seconds.
    """

    def __init__(self, manager: SwarmManager, max_length: int, start: int = 0, end: Optional[int] = None,
                 adapter: Optional[str] = None, prompts: Optional[torch.Tensor] = None, rope_lengths: bool = False,
                 needs: Collection[str] = ()):
        """`prompts`: deep prompts [num_blocks, 1, pre_seq_len, hidden] (`swarm.client.model.ptune`), sent to each
        server with its blocks' part when its stream opens. `rope_lengths`: the model's rotary picks its factors by the
        sequence's length (LongRoPE: `swarm.modeling.layers.picks_by_length`), so each message of a step cut into
        several (and of a replay, and a spot-check's replay) names where the whole step ends (`Step.rope_length`;
        left out where that is the message's own end, so other models' steps reach servers from before it).
        `needs`: capabilities (`swarm.wire.capabilities`) every server of the chain must announce besides those the
        session's own settings need (`needs_for`); a step that needs more (beam parents, left padding) adds them and
        first moves the spans whose servers lack them (`_require`)."""
        if max_length <= 0:
            raise ValueError("max_length must be positive")
        self.manager, self.max_length = manager, max_length
        self.adapter = adapter  # the LoRA adapter every server of the chain runs this session with (None: base)
        self.start, self.end = start, manager.num_blocks if end is None else end
        self.session_id = uuid.uuid4().hex
        self.prompts = prompts
        self.rope_lengths = rope_lengths
        self.needs = needs_for(adapter=adapter, prompts=prompts is not None, rope_length=rope_lengths) | set(needs)
        self._step_end = None  # where the step in flight ends (`_rope_length`), None between steps
        self.position = 0
        self.batch_size = None
        self._streams = []
        self._history = {}  # block index where a span starts -> inputs sent there
        self._closed = False
        self.failovers = 0
        self.moves = 0  # spans moved off servers without a capability a later step needed (`_require`)
        self._step_id = 0  # one id per chunk step (and per replayed chunk), shared by every server of the chain
        self._verifier = verifier_for(manager)  # spot-checks of servers' outputs (None: off)
        self._checks = BackgroundChecks(self._verifier) if self._verifier else None  # this session's, in flight
        self.verify_steps = True  # False: no spot-checks on this session's steps (beam search turns them off)
        self.check_all_next = False  # True: the next step checks every span (`check_next_step`; then reset)
        # the prompt declared to the servers' prefix caches when the chain opens (set before the first step, batch
        # 1: `swarm.client.transport.prefix`), and the positions adopted from them so far
        self.prefix: Optional[P.PrefixDecl] = None
        self.adopted_tokens = 0
        # servers keep their outputs at adopted prefix positions until asked (none asked for when no spot-check
        # compares them); `adopted_outputs` False: `astep` leaves those positions out of what it returns
        self.prefix_outputs_later = self._verifier is None
        self.adopted_outputs = True

    # ---- public, synchronous ------------------------------------------------------------------------------
    @property
    def verifies(self) -> bool:
        """Whether this session's next step waits for spot-checks (`swarm.client.transport.verify`: a check of every
        span asked for), which makes it slow; random checks run in the background and do not slow a step."""
        return self._verifier is not None and self.verify_steps and self.check_all_next

    def step(self, hidden: torch.Tensor, hypo_ids: Optional[Sequence[int]] = None,
             left_padding: Optional[Sequence[int]] = None) -> torch.Tensor:
        """hidden [batch, seq, hidden] for positions position.. -> the last block's output, same shape (less the
        positions adopted from the servers' prefix caches when `adopted_outputs` is False: those sent only).
        `hypo_ids` [batch]: first, row i of the held positions becomes row hypo_ids[i] (beam search's parents);
        `left_padding` [batch] (only at position 0): each row's leading padding positions."""
        return aio.run(self.astep(hidden, hypo_ids, left_padding))

    def open(self, batch_size: int = 1) -> None:
        """Open the chain now for `batch_size` rows (the first step does it otherwise)."""
        if self.batch_size is None:
            aio.run(self._open(batch_size))
        elif batch_size != self.batch_size:
            raise ValueError(f"the session is already open for batch size {self.batch_size}")

    async def _open(self, batch_size: int, wait: bool = True) -> None:
        self._streams = await self._open_span(self.start, self.end, batch_size, wait)
        self.batch_size = batch_size

    def rewind(self, position: int) -> None:
        """Make the next step start at `position` (<= current position); later positions are forgotten: the next
        step overwrites them on every server, and a failover replays only the history before `position`."""
        if not 0 <= position <= self.position:
            raise ValueError(f"cannot rewind to {position}: the session holds {self.position} tokens")
        self.position = position
        self.prefix = prefix_cache.cut(self.prefix, position)  # later positions may be other tokens
        if self._checks is not None:
            self._checks.rewound(position)

    def settle(self) -> None:
        """Wait for this session's spot-checks in flight; raises `OutputsRetracted` if one found a server wrong."""
        if self._checks is not None:  # (no hand-over to the client's loop when nothing is checked)
            aio.run(self.asettle())

    async def asettle(self) -> None:
        if self._checks is not None and self._checks.pending:
            await self._checks.settle()
            await self._apply_checks()

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            aio.run(self._close_streams(), timeout=30)

    def __enter__(self) -> "InferenceSession":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    @property
    def chain(self) -> List[RouteHop]:
        return [s.hop for s in self._streams]

    # ---- async --------------------------------------------------------------------------------------------
    async def _close_streams(self) -> None:
        if self._checks is not None:
            self._checks.cancel()
        await asyncio.gather(*(s.close() for s in self._streams), return_exceptions=True)
        self._streams = []

    async def astep(self, hidden: torch.Tensor, hypo_ids: Optional[Sequence[int]] = None,
                    left_padding: Optional[Sequence[int]] = None) -> torch.Tensor:
        """hidden: [batch, seq, hidden] for positions position.. ; returns the last block's output (`step`)."""
        if self._closed:
            raise SessionError("this inference session is closed")
        if hidden.ndim != 3:
            raise ValueError(f"hidden states must be [batch, seq, hidden], got shape {list(hidden.shape)}")
        batch, seq, hidden_size = hidden.shape
        if self.position + seq > self.max_length:
            raise SessionError(
                f"this step would hold {self.position + seq} tokens, past the session's max_length {self.max_length}"
            )
        if self.batch_size is not None and batch != self.batch_size:
            raise ValueError(f"batch size {batch} differs from the session's {self.batch_size}")
        hypo = _check_rows("hypo_ids", hypo_ids, batch, batch)
        padding = _check_rows("left_padding", left_padding, batch, self.max_length)
        if padding is not None and self.position != 0:
            raise ValueError("left_padding is only accepted on a step at position 0")
        if hypo is not None and (hypo == list(range(batch)) or self.position == 0):
            hypo = None  # the identity, or nothing held: nothing to reorder
        step_needs = needs_for(left_padding=padding is not None, beam=hypo is not None)
        adopted: Optional[torch.Tensor] = None  # the outputs at positions the servers held already
        if self.batch_size is None:
            # the first step follows the OpenSession messages at once: no round trip before it (a failed open
            # fails that step, which replaces the server like any step failure)
            self.needs |= step_needs
            declared = self.prefix is not None and batch == 1 and hypo is None and padding is None
            if not declared:
                self.prefix = None
            # a declared prompt waits for the servers' replies: what they hold of it is not sent again
            await self._open(batch, wait=declared)
            adopted, hidden = await prefix_cache.adopt(self, hidden)
            seq = hidden.shape[1]
        else:
            await self._require(step_needs)
        await self._apply_checks()  # a check finished since found a server wrong: OutputsRetracted
        outputs = [] if adopted is None else [adopted]
        chunk = self._chunk_len(hidden)
        self._step_end = self.position + seq  # each message's rotary factors are the whole step's (`_rope_length`)
        try:
            for offset in range(0, seq, chunk):
                outputs.append(await self._step_chunk(hidden[:, offset:offset + chunk],
                                                      hypo if offset == 0 else None, padding))
                self.position += outputs[-1].shape[1]
        finally:
            self._step_end = None
        if self.check_all_next and self._checkable(hypo):  # asked for: every span checked before this step returns
            self._start_checks(range(len(self._streams)), explicit=True)
            await self.asettle()
        self.check_all_next = False
        return torch.cat(outputs, dim=1) if len(outputs) > 1 else outputs[0]

    async def _step_chunk(self, x: torch.Tensor, hypo_ids: Optional[List[int]] = None,
                          left_padding: Optional[List[int]] = None) -> torch.Tensor:
        """Send x [batch, seq, hidden] through the chain.

        With push, the client sends the step to the first server only, naming the rest of the chain; each
        server hands its output straight to the next one (k + 1 network hops for k servers) and also returns
        a copy to the client, which records it as the next boundary's input history (what failover replays).
        Only decode steps are pushed: a token, or a token and its speculative drafts (up to `PUSH_MAX_TOKENS`).
        If a pushed step has not come back from the next server within `push_timeout`, the client sends it there
        itself (servers drop the second copy by step id), so a dead next server costs at most that long before
        failover starts. After a failure the rest of the step goes through the client.

        `hypo_ids` reorder the held rows first, named by this step's first id (`reorder_id`): a server applies it
        once, and a replacement, rebuilt from the history still in the old order, applies it like the others. Each
        boundary's history is reordered once its server has answered. `left_padding` goes with a step at 0.
        Each message names where the step that x is part of ends where that is past its own (`_rope_length`).
        """
        config = self.manager.config
        seq = x.shape[1]
        step_id = self._next_step_id()
        edits: dict = {}
        if hypo_ids is not None:
            edits.update(hypo_ids=hypo_ids, reorder_id=step_id)
        if self.position == 0:
            edits.update(left_padding=left_padding)
        rope_length = self._rope_length(self._step_end or 0, self.position + seq)
        if rope_length is not None:
            edits.update(rope_length=rope_length)
        assert self.batch_size is not None, "the session is not open"
        failures, index = 0, 0
        # random spot-checks (swarm.client.transport.verify), started once the step is done, in the background (none
        # when the step checks every span anyway); a span on a server distrusted since it joined this session (by
        # another session's check) is checked now: what it returned before may be wrong, the check finds from where
        checkable = self._checkable(hypo_ids)
        planned = (self._verifier.plan([s.hop for s in self._streams])
                   if self._verifier and checkable and not self.check_all_next else set())
        checks = {i for i, s in enumerate(self._streams) if s.hop.peer_id in self.manager.distrusted} if checkable \
            else set()
        delivered = False  # whether the current stream got this step by push from the previous one
        while index < len(self._streams):
            stream = self._streams[index]
            history = self._history.get(stream.hop.start)
            if history is None:
                history = self._history[stream.hop.start] = BoundaryHistory(self.batch_size, self.max_length,
                                                                            x.shape[-1], x.dtype)
            if self.position == 0:
                history.padding = left_padding
            history.write(self.position, x)
            try:
                if not delivered:
                    rest = self._streams[index + 1:]
                    chain = [s.push_target for s in rest]
                    # push decode steps (prefill goes through the client), once the next servers have opened
                    use_push = (config.use_push and seq <= PUSH_MAX_TOKENS and not checks
                                and not any(s.open_pending for s in rest) and all(s.pushes for s in [stream, *rest]))
                    stream.send(x, self.position, step_id, chain if use_push else (), edits)
                    out, pushed = await stream.receive(self.position, seq)
                else:
                    try:
                        out, pushed = await stream.receive(self.position, seq, timeout=config.push_timeout)
                    except asyncio.TimeoutError:  # the push got lost: deliver it ourselves
                        stream.send(x, self.position, step_id, (), edits)
                        out, pushed = await stream.receive(self.position, seq)
                if index in checks and self._verifier is not None:  # ServerMismatch: a failover
                    await self._verifier.check(stream.hop, history.read(self.position + seq),
                                               self._outputs_of(stream.hop.end, out), self.adapter, history.padding,
                                               rope_length)
                    if stream.hop.peer_id in self.manager.distrusted:  # right here, but outvoted elsewhere: leave it
                        raise ServerMismatch(f"server {stream.hop.peer_id} is distrusted", self.position)
            except Exception as e:  # connection lost, time-out, or an error reply: the server is failed
                failures = await self._replace_retrying(index, e, failures)
                if isinstance(e, ServerMismatch) and e.position < self.position:
                    self.position = e.position  # earlier outputs were wrong too: the caller feeds them again
                    if self._checks is not None:
                        self._checks.rewound(e.position)
                    raise OutputsRetracted(e.position) from e
                delivered = False
                step_id = self._next_step_id()  # the replay used newer ids: servers drop older ones as copies
                continue  # the same boundary, now on the replacement
            self.manager.mark_ok(stream.hop.peer_id)
            if hypo_ids is not None:  # this span reordered its cache: so does the history that rebuilds it
                history.reorder(hypo_ids, self.position)
            delivered = pushed
            x = out
            index += 1
        if self._verifier is not None:  # the last span's outputs, which a check compares too
            self._boundary(self.end, x).write(self.position, x)
            self._start_checks(sorted(planned - checks), end=self.position + seq, rope_length=rope_length)
        return x

    async def _require(self, needs: FrozenSet[str]) -> None:
        """Add `needs` to the capabilities every server of this session must announce; a span on a server without
        them moves first (re-routed, its history replayed; the server is not banned), so that no message carries a
        field its server does not know. Where no server has them: `SessionError` with routing's reason."""
        if needs <= self.needs:
            return
        self.needs |= needs
        while True:
            lacking = [s for s in self._streams if not self.needs <= s.hop.capabilities]
            if not lacking:
                return
            missing = ", ".join(sorted(self.needs - lacking[0].hop.capabilities))
            await self._replace(self._streams.index(lacking[0]), SessionError(f"its server does not announce "
                                                                              f"{missing}"), ban=False)

    def _checkable(self, hypo_ids) -> bool:
        """Whether this step's spans can be checked: not a step that reorders beams (the recorded rows follow only
        once the span has answered), nor with deep prompts (a referee's plain forward pass cannot carry them)."""
        return self._verifier is not None and self.verify_steps and hypo_ids is None and self.prompts is None

    def _start_checks(self, indexes, end: Optional[int] = None, explicit: bool = False,
                      rope_length: Optional[int] = None) -> None:
        """Start background checks of the spans at `indexes` over positions [0, end) (default: all held), with the
        step's `rope_length` where it ends past `end`."""
        end = self.position if end is None else end
        for i in indexes:
            if i >= len(self._streams):  # a failover during the step re-routed the chain: fewer streams
                continue
            hop = self._streams[i].hop
            inputs, outputs = self._history[hop.start], self._history.get(hop.end)
            if self._checks is None or outputs is None or outputs.length < end or end == 0:
                continue
            self._checks.start(hop, inputs.read(end).clone(), outputs.read(end).clone(), self.adapter,
                               inputs.padding, explicit, rope_length)

    async def _apply_checks(self) -> None:
        """If a check found a server wrong: leave it (its spans re-routed and replayed up to where its wrong outputs
        began) and raise `OutputsRetracted` from there (the caller feeds those tokens again)."""
        mismatch = self._checks.failed() if self._checks is not None else None
        if mismatch is None or self._checks is None:
            return
        held, self.position = self.position, min(self.position, mismatch.position)
        self._checks.rewound(self.position)
        failures = 0
        while True:
            liars = [i for i, s in enumerate(self._streams) if s.hop.peer_id in self.manager.distrusted]
            if not liars:
                break
            failures = await self._replace_retrying(liars[0], mismatch, failures)
        if self.position < held:
            raise OutputsRetracted(self.position) from mismatch

    def _boundary(self, block: int, like: torch.Tensor) -> BoundaryHistory:
        if block not in self._history:
            assert self.batch_size is not None
            self._history[block] = BoundaryHistory(self.batch_size, self.max_length, like.shape[-1], like.dtype)
        return self._history[block]

    def _outputs_of(self, end: int, out: torch.Tensor) -> torch.Tensor:
        """What the span ending at block `end` returned: recorded positions [0, position), then `out`."""
        recorded = self._history.get(end)
        if recorded is None or recorded.length < self.position:
            return out
        return torch.cat([recorded.read(self.position), out], dim=1)

def _check_rows(name: str, values: Optional[Sequence[int]], batch: int, bound: int) -> Optional[List[int]]:
    """`values` as a list of one int per row, each in [0, bound); ValueError naming `name` otherwise."""
    if values is None:
        return None
    rows = [int(v) for v in values]
    if len(rows) != batch:
        raise ValueError(f"{name} has {len(rows)} entries; the session has {batch} rows")
    if any(not 0 <= v < bound for v in rows):
        raise ValueError(f"{name} must be in [0, {bound}), got {rows}")
    return rows
