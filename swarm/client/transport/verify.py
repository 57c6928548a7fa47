"""Spot-checks of untrusted servers' outputs: a span's recorded inputs re-run on an independent server.

With `ClientConfig.verify`, at each step `Verifier.plan` picks the spans of the chain to check: always a server
not checked yet, else each span with probability `verify_probability`. The step itself is not slowed: it keeps
push (every server also returns its span's output to the client, which records it as the next boundary's history,
`BoundaryHistory`), and once it is done the session starts the checks in the background on the client's loop
(`BackgroundChecks`, one per session) with copies of each checked span's whole input history `[batch, n, hidden]`
and of its recorded outputs for the same positions. A referee re-runs those inputs as one forward pass
(`rpc_forward`, no cache) through other servers covering the same blocks with the same dtype and weight format
(from their DHT records). The comparison (`divergence`) is per position, relative to each row's typical
magnitude, within a tolerance per dtype and quantization (`tolerance`). A session has at most
`MAX_PENDING_CHECKS` random checks in flight; one planned beyond that is skipped (`VerifyStats.skipped_busy`; a
server never checked is planned again at the next step).

Majority: a first referee that agrees clears the server. If it disagrees, a second referee decides: the side
with two of three opinions wins; the minority server (or referee chain) is distrusted for the life of the
client (`SwarmManager.distrusted`: routing never uses it again), logged and counted. A check that finds a server
wrong raises `ServerMismatch` with the first wrong position in its task; the session's next step (or settle
point) collects it (`BackgroundChecks.failed`): the session rewinds to that position (or lower, if it went back
since the check began: positions after that may have gone through the server again), re-routes and replays the
liar's spans as failover does, and raises `OutputsRetracted(position)`; the caller picks the tokens from there
again (`generate`, the gateway's `GenerationRun`; tokens a streamer already received cannot be taken back).
Settle points wait for every check in flight first: the end of `generate` (`ModelSession.settle`), and a step
asked to check every span (`ModelSession.check_next_step`, what a front end that holds text back until it is
checked uses): that step starts a check of every span and returns only once all the session's checks are done,
so its output and everything before it is checked. A span no other server covers cannot be checked
(`unverifiable`); a tie (one referee, or three different answers) is `unresolved` and bans nobody. A session whose
chain holds a server distrusted since (by another session of the client) checks that span during its next step
(waiting for it, the rare case), retracting what was wrong, and leaves the server. Beam search steps (rows
reordered every step) and deep prompts are not checked. The referee returns whole hidden states anyway
(`rpc_forward`), so they are compared directly rather than through TOPLOC-style commitments.
"""
from __future__ import annotations

import asyncio
import logging
import random
import weakref
from dataclasses import dataclass, field
from typing import FrozenSet, List, Optional, Sequence, Set

import torch

from swarm.client.transport.manager import SwarmManager, needs_for
from swarm.client.transport.routing import RouteHop, RoutingError, choose_forward_chain
from swarm.wire.quant import QUANT_FORMATS, UNKNOWN_TOLERANCE

logger = logging.getLogger(__name__)

# largest honest divergence (see `divergence`) by serving dtype; a quantized weight format adds its own margin
# (`QuantFormat.verify_tolerance`)
DTYPE_TOLERANCE = {"float32": 0.02, "float16": 0.1, "bfloat16": 0.15}
MAX_PENDING_CHECKS = 2  # random checks a session may have in flight; more are skipped (`VerifyStats.skipped_busy`)


class ServerMismatch(RuntimeError):
    """A server's output disagreed with the majority of independent servers over the same blocks, first at
    `position`."""

    def __init__(self, message: str, position: int):
        super().__init__(message)
        self.position = position


class OutputsRetracted(RuntimeError):
    """Outputs the session returned for positions `position`.. came from a server found wrong since: the session
    now holds only positions [0, position); the caller feeds the tokens after them again (`generate` does)."""

    def __init__(self, position: int):
        super().__init__(f"outputs from position {position} on were wrong and are retracted")
        self.position = position

    def retract(self, ids: torch.Tensor, prompt_len: int, eos_ids: torch.Tensor, *per_token: list) -> tuple:
        """For a generation loop: ids [batch, n] cut to the tokens picked from outputs before `position` (and the
        per-token lists, such as scores, cut alike); returns (ids, finished [batch])."""
        keep = max(self.position + 1, prompt_len)
        for values in per_token:
            del values[keep - prompt_len:]
        ids = ids[:, :keep]
        return ids, torch.isin(ids[:, prompt_len:], eos_ids).any(dim=1)


@dataclass
class VerifyStats:
    """Counters for a client's checks (the gateway can expose them as metrics)."""

    checks: int = 0  # spans checked against at least one referee
    passed: int = 0
    mismatches: int = 0  # servers found wrong by a majority (distrusted)
    unverifiable: int = 0  # checks skipped: no other server covers the span with the same dtype and weights
    unresolved: int = 0  # disagreements without a majority (no ban)
    referee_failures: int = 0  # referee calls that failed (the referee is not an opinion)
    skipped_busy: int = 0  # planned random checks skipped: the session had `MAX_PENDING_CHECKS` in flight
    largest_passed: float = 0.0  # the largest divergence of a check that passed (how close honest servers are)
    distrusted: List[str] = field(default_factory=list)

    def as_dict(self) -> dict:
        return dict(self.__dict__, distrusted=list(self.distrusted))


def tolerance(dtype: str, quant_type: str) -> float:
    quant = QUANT_FORMATS.get(quant_type)
    return DTYPE_TOLERANCE.get(dtype, 0.15) + (quant.verify_tolerance if quant else UNKNOWN_TOLERANCE)


def position_divergence(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """How far two outputs [batch, seq, hidden] differ at each position [seq]: the mean of
    |a - b| / (|b| + median |b|) over hidden, the largest over the batch (a few massive activations cannot hide a
    change of the others)."""
    a, b = a.float(), b.float()
    scale = b.abs().median(dim=-1, keepdim=True).values + 1e-6  # [batch, seq, 1]
    return ((a - b).abs() / (b.abs() + scale)).mean(dim=-1).amax(dim=0)  # [seq]


def divergence(a: torch.Tensor, b: torch.Tensor) -> float:
    """The largest `position_divergence` of two outputs [batch, seq, hidden]."""
    per_position = position_divergence(a, b)
    return float(per_position.max()) if per_position.numel() else 0.0


class Verifier:
    """One client's checks: which servers were checked, counters, and the distrusted servers (on the manager)."""

    def __init__(self, manager: SwarmManager, rng: Optional[random.Random] = None):
        self.manager, self.config = manager, manager.config
        self.checked: Set[str] = set()
        self.stats = VerifyStats()
        self.rng = rng or random.Random()

    def plan(self, hops: Sequence[RouteHop]) -> Set[int]:
        """The indexes of the hops to check at this step."""
        return {i for i, hop in enumerate(hops)
                if hop.peer_id not in self.checked or self.rng.random() < self.config.verify_probability}

    def _referee_chain(self, hop: RouteHop, exclude: Set[str], adapter: Optional[str],
                       needs: FrozenSet[str] = frozenset()) -> List[RouteHop]:
        spans = self.manager.allowed_spans()
        audited = next((s for s in spans if s.peer_id == hop.peer_id), None)
        dtype = audited.info.dtype if audited else None
        quant = audited.info.quant_type if audited else None
        same = [s for s in spans if s.peer_id not in exclude and (audited is None or (
            s.info.dtype == dtype and s.info.quant_type == quant))]
        return choose_forward_chain(same, hop.start, hop.end, banned=self.manager.banned(), rng=self.rng,
                                    adapter=adapter, needs=needs_for(adapter=adapter) | needs)

    async def _referee(self, hop: RouteHop, inputs: torch.Tensor, seq: int, exclude: Set[str],
                       adapter: Optional[str], left_padding: Optional[List[int]] = None,
                       rope_length: Optional[int] = None) -> Optional[tuple]:
        """(peers, output [batch, seq, hidden]) of an independent chain over hop's blocks (its last seq positions),
        or None if none is left."""
        loop = asyncio.get_running_loop()
        needs = needs_for(left_padding=left_padding is not None, rope_length=rope_length is not None)
        while True:
            try:
                chain = await loop.run_in_executor(None, self._referee_chain, hop, exclude, adapter, needs)
            except RoutingError:
                return None
            peers = [h.peer_id for h in chain]
            exclude.update(peers)
            try:
                x = inputs
                for referee in chain:
                    x = await self.manager.forward(referee, x, adapter, left_padding, rope_length)
                return peers, x[:, -seq:]
            except Exception as e:  # a referee that fails gives no opinion; try another
                self.stats.referee_failures += 1
                logger.info(f"referee {peers} failed: {e}")

    async def check(self, hop: RouteHop, inputs: torch.Tensor, output: torch.Tensor,
                    adapter: Optional[str] = None, left_padding: Optional[List[int]] = None,
                    rope_length: Optional[int] = None) -> None:
        """`left_padding`: the rows' leading padding (a left-padded batch), hidden from the referee too;
        `rope_length`: where the session's step ended, past the inputs (`ForwardRequest.rope_length`: the referee
        picks LongRoPE's factors as that step did), None: at the inputs' end. inputs: the
        span's whole input history [batch, n, hidden]; output: what it returned for the last seq
        positions [batch, seq, hidden] (seq <= n: the session passes every output it recorded). Raises
        ServerMismatch, with the first wrong position, if a majority of independent servers disagrees with it."""
        spans = {s.peer_id: s for s in self.manager.spans}
        record = spans.get(hop.peer_id)
        tol = tolerance(record.info.dtype, record.info.quant_type) if record else tolerance("bfloat16", "nf4")
        seq = output.shape[1]
        exclude = {hop.peer_id} | self.manager.distrusted
        self.checked.add(hop.peer_id)  # at once: a check in flight is not planned again as a first check
        first = await self._referee(hop, inputs, seq, exclude, adapter, left_padding, rope_length)
        if first is None:
            self.stats.unverifiable += 1
            return
        self.stats.checks += 1
        first_divergence = divergence(output, first[1])
        if first_divergence <= tol:
            self.stats.passed += 1
            self.stats.largest_passed = max(self.stats.largest_passed, first_divergence)
            return
        second = await self._referee(hop, inputs, seq, exclude, adapter, left_padding, rope_length)
        if second is None:
            self.stats.unresolved += 1
            logger.warning(f"server {hop.peer_id} and referee {first[0]} disagree on blocks {hop.start}:{hop.end} "
                           f"(divergence {divergence(output, first[1]):.3g} > {tol}); no third server to decide")
            return
        with_audited = divergence(output, second[1]) <= tol
        with_first = divergence(first[1], second[1]) <= tol
        if with_audited and not with_first:
            self.stats.passed += 1
            self._distrust(first[0], hop)
        elif with_first and not with_audited:
            self._distrust([hop.peer_id], hop)
            wrong = (position_divergence(output, first[1]) > tol).nonzero()
            position = inputs.shape[1] - seq + (int(wrong[0]) if len(wrong) else 0)
            raise ServerMismatch(f"server {hop.peer_id} returned wrong outputs for blocks {hop.start}:{hop.end} from "
                                 f"position {position} (divergence {first_divergence:.3g} > {tol} from two other "
                                 f"servers)", position)
        else:
            self.stats.unresolved += 1

    def _distrust(self, peers: Sequence[str], hop: RouteHop) -> None:
        """Distrust `peers`; one already distrusted (caught again by another session still on it) counts once."""
        for peer in peers:
            if peer in self.manager.distrusted:
                continue
            logger.warning(f"server {peer} disagrees with the majority on blocks {hop.start}:{hop.end}: distrusted "
                           f"for the life of this client")
            self.manager.distrusted.add(peer)
            self.stats.distrusted.append(peer)
            self.stats.mismatches += 1


@dataclass
class _Pending:
    task: "asyncio.Future[None]"
    low: int  # the fewest positions the session held since the check's snapshot (a retraction goes back there)
    explicit: bool  # asked for (`check_next_step`), not a random spot-check: not bounded


class BackgroundChecks:
    """One session's checks in flight on the client's loop: started after a step (`start`, the step does not wait),
    their failures collected by the session's next step or settle point (`failed`, `settle`)."""

    def __init__(self, verifier: Verifier, limit: int = MAX_PENDING_CHECKS):
        self.verifier, self.limit = verifier, limit
        self.pending: List[_Pending] = []

    def start(self, hop: RouteHop, inputs: torch.Tensor, outputs: torch.Tensor, adapter: Optional[str],
              left_padding: Optional[List[int]], explicit: bool = False, rope_length: Optional[int] = None) -> bool:
        """Check hop's outputs [batch, n, hidden] for its inputs [batch, n, hidden] (copies: the session goes on) in
        the background; a random check (not `explicit`) is skipped, and counted, while `limit` are in flight."""
        if not explicit and sum(not p.task.done() and not p.explicit for p in self.pending) >= self.limit:
            self.verifier.stats.skipped_busy += 1
            return False
        task = asyncio.ensure_future(self.verifier.check(hop, inputs, outputs, adapter, left_padding, rope_length))
        self.pending.append(_Pending(task, inputs.shape[1], explicit))
        return True

    def rewound(self, position: int) -> None:
        """The session went back to `position`: what checks in flight find wrong is retracted from there at least
        (positions after it may have gone through the same server again)."""
        for pending in self.pending:
            pending.low = min(pending.low, position)

    def failed(self) -> Optional[ServerMismatch]:
        """Forget the finished checks; the mismatch among them with the earliest position to retract, if any."""
        worst: Optional[ServerMismatch] = None
        still: List[_Pending] = []
        for pending in self.pending:
            if not pending.task.done():
                still.append(pending)
                continue
            error = None if pending.task.cancelled() else pending.task.exception()
            if isinstance(error, ServerMismatch):
                position = min(error.position, pending.low)
                if worst is None or position < worst.position:
                    worst = ServerMismatch(str(error), position)
            elif error is not None:  # the check itself failed (no verdict): logged, the session goes on
                logger.warning(f"a spot-check failed: {type(error).__name__}: {error}")
        self.pending = still
        return worst

    async def settle(self) -> None:
        """Wait for every check in flight (their verdicts: `failed`)."""
        await asyncio.gather(*(p.task for p in self.pending), return_exceptions=True)

    def cancel(self) -> None:
        for pending in self.pending:
            if pending.task.done() and not pending.task.cancelled():
                pending.task.exception()  # retrieved: the session is closing, its verdict no longer matters
            pending.task.cancel()
        self.pending = []


_verifiers: "weakref.WeakKeyDictionary[SwarmManager, Verifier]" = weakref.WeakKeyDictionary()


def verifier_for(manager: SwarmManager) -> Optional[Verifier]:
    """The manager's verifier (shared by its sessions), or None when `ClientConfig.verify` is off."""
    if not manager.config.verify:
        return None
    if manager not in _verifiers:
        _verifiers[manager] = Verifier(manager)
    return _verifiers[manager]
