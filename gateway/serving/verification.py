"""Spot-checks in the gateway's decode loop: text is sent only once checked, and picks a liar caused are redone.

With `--verify_rate` the client checks servers' outputs (`swarm.client.transport.verify`). A check may find that a
server lied from an earlier position on: the session then raises `OutputsRetracted(position)`, and every token picked
from the outputs at that position or later is wrong. Text already sent to an HTTP client cannot be unsent, so
`RunVerification` (one per `gateway.serving.runs.GenerationRun`) holds a run's text events back until every output they
came from was checked:

- Before each step it snapshots the run's per-choice state (text streams, pending choices, token counts, finished
  flags, the samplers' random state and grammar position), keyed by the number of tokens picked so far.
- A step that checks every span of the chain (`GenerationSession.check_next_step`) is asked for when a stream has
  run `holdback` tokens ahead of its last full check, or when every choice has finished (non-streamed responses:
  only then). That step waits for every check of the session (random ones otherwise run in the background, their
  failures surfacing at a later step), so once it returns, every output the session holds was checked (or could
  not be: a span that one server alone covers is counted `unverifiable`), and the held events go out. A step that
  every choice's `max_tokens` makes the last is checked so; when choices end otherwise (end of sequence, stop
  string), one more step feeds the last picked tokens only to check them.
- On `OutputsRetracted` the run goes back to the snapshot at the retracted position, the events held since are
  dropped, and the loop picks again from there: the response is what honest servers give.

A retraction cannot reach text already sent (it was checked on every span, and later checks of those servers cover
the same positions); if it ever did, the request fails with a 502 rather than send text that contradicts itself.
The cost is a bounded delay of streamed text (`holdback` tokens plus one step) and one full check per `holdback`
tokens and per response, on top of the random checks of `verify_rate`.

`distrusted_in(model, session)`: whether a (pooled) session's chain includes a server the checks distrusted.
"""
from __future__ import annotations

import copy
import logging
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional

import torch

from gateway.errors import APIError
from gateway.serving.events import ChoiceDelta
from swarm.client.api import ClientModel, GenerationSession, OutputsRetracted

logger = logging.getLogger("swarmgate.gateway")


def verification_on(model: ClientModel) -> bool:
    """Whether the client model spot-checks servers."""
    return model.verify_stats() is not None


def distrusted_in(model: ClientModel, session: GenerationSession) -> bool:
    """Whether `session`'s servers include one that spot-checks outvoted (its states may be wrong)."""
    stats = model.verify_stats()
    if stats is None or not stats.distrusted:
        return False
    return bool(set(session.servers()) & set(stats.distrusted))


@dataclass
class _Snapshot:
    held: int  # events held when it was taken
    texts: List[Any]  # gateway.serving.textstream.TextStream copies
    pending: List[list]
    finished: List[bool]
    generated: List[int]
    rng: List[torch.Tensor]  # each sampler's generator state


class RunVerification:
    """One generation's hold-back of unchecked text and its recovery from retracted outputs (module docstring).

    `run`: the `GenerationRun` whose state it snapshots (`texts`, `pending`, `finished`, `generated`, `samplers`);
    `holdback`: tokens a choice may run ahead of the last full check (None: until every choice finished);
    `on_retract(tokens)`: told how many picked tokens (per row) a retraction dropped."""

    def __init__(self, run: Any, emit: Callable[[Any], None], enabled: bool, holdback: Optional[int],
                 prompt_len: int, on_retract: Callable[[int], None] = lambda tokens: None):
        self.run, self._emit, self.enabled = run, emit, enabled
        self.holdback, self.prompt_len, self.on_retract = holdback, prompt_len, on_retract
        self.started = False  # events are held only once the first step began
        self.held: List[Any] = []
        self.snapshots: Dict[int, _Snapshot] = {}  # tokens picked -> the run's state then
        self.released = 0  # tokens picked whose text went out (checked)
        self.picked = 0  # tokens picked so far (per row; finished rows are padded)
        self.full_check = False  # the coming step checks every span

    def emit(self, event: Any) -> None:
        if self.enabled and self.started and isinstance(event, ChoiceDelta):
            self.held.append(event)
        else:
            self._emit(event)

    @property
    def unsettled(self) -> bool:
        """Tokens were picked that no full check covers yet: the loop must step once more (to check them)."""
        return self.enabled and self.picked > self.released

    def before_step(self, session: Any, all_finished: bool) -> None:
        """Snapshot the run, and ask this step to check every span when the held text has to go out."""
        self.started = True
        if not self.enabled:
            return
        if self.picked not in self.snapshots:
            self.snapshots[self.picked] = self._snapshot()
        ahead = self.picked - self.released
        run = self.run  # its last step (every choice reaches max_tokens with it) is checked: no step after it
        last = all(done or run.left(i) <= 1 for i, done in enumerate(run.finished))
        due = all_finished or last or (self.holdback is not None and ahead >= self.holdback)
        if (ahead > 0 or last) and due and not self.full_check:
            if session.check_next_step():
                self.full_check = True
            else:  # this session cannot be checked (no verifier, deep prompts): nothing to wait for
                logger.info("a session without spot-checks: its text is sent unchecked")
                self.enabled = False
                self._release()

    def after_step(self, ids: torch.Tensor) -> None:
        """The step returned and its picks were taken; ids [n, prompt + picked]. After a full check, release."""
        self.picked = ids.shape[1] - self.prompt_len
        if self.enabled and self.full_check:
            self.full_check = False
            self.released = self.picked
            self.snapshots = {}
            self._release()

    def retract(self, retracted: OutputsRetracted, ids: torch.Tensor) -> torch.Tensor:
        """Undo the picks made from retracted outputs: the run's state as it was then; returns ids [n, kept]."""
        keep = max(retracted.position + 1, self.prompt_len)
        tokens = keep - self.prompt_len
        snapshot = self.snapshots.get(tokens)
        if not self.enabled or tokens < self.released or snapshot is None:
            raise APIError(502, "A server of the swarm was found returning wrong outputs for text already sent; "
                                "please retry the request.", "server_error", code="outputs_retracted")
        logger.warning(f"outputs from position {retracted.position} on were wrong (a server outvoted by "
                       f"spot-checks): {self.picked - tokens} picked token(s) dropped and picked again")
        self.on_retract(self.picked - tokens)
        self._restore(snapshot)
        self.held = self.held[:snapshot.held]
        self.snapshots = {k: v for k, v in self.snapshots.items() if k <= tokens}
        self.picked = tokens  # a full check asked for stays asked: the session keeps the request after a failed step
        return ids[:, :keep]

    # ---- helpers --------------------------------------------------------------------------------------------------
    def _release(self) -> None:
        held, self.held = self.held, []
        for event in held:
            self._emit(event)

    def _snapshot(self) -> _Snapshot:
        run = self.run
        return _Snapshot(len(self.held), _copy_texts(run.texts), [list(p) for p in run.pending], list(run.finished),
                         list(run.generated), [s.generator.get_state() for s in run.samplers.samplers])

    def _restore(self, snapshot: _Snapshot) -> None:
        """The run's state as `snapshot` holds it (copies: the snapshot stays for a later retraction)."""
        run = self.run
        for i, sampler in enumerate(run.samplers.samplers):
            sampler.generator.set_state(snapshot.rng[i])
            consumed = run.generated[i] - snapshot.generated[i]
            if sampler.constraint is not None and consumed > 0:
                sampler.constraint.rollback(consumed)  # the grammar's position then
        run.texts = _copy_texts(snapshot.texts)
        run.pending = [list(p) for p in snapshot.pending]
        run.finished = list(snapshot.finished)
        run.generated = list(snapshot.generated)


def _copy_texts(texts: List[Any]) -> List[Any]:
    """Independent copies of `gateway.serving.textstream.TextStream`s (own ids, own incremental decoder)."""
    return [copy.copy(text) for text in texts]
