"""The decode loop, written once: every generation through the swarm (`generate`, speculative decoding, the
gateway's runs) steps here.

`DecodeLoop(feed, policy, prompt_len, max_new, pad).run(ids)` owns the cycle around one session: a step through the
swarm (`feed`: the first step sends the prompt, less what the servers hold; then the last token), the pick
(`DecodePolicy.picker`, run in the client's batched LM-head task when `policy.pick_in_head`, else after the step on
this thread: a grammar's matcher stays with its request), appending each row's token (finished rows get `pad`),
the lengths (no row goes past `max_new` new tokens), stopping (the policy says which rows finished), speculative
decoding (with a `Speculator`: one row, [last token + drafts] sent as one step, the accepted tokens taken one by one
as plain steps' would be, the session rewound past the rejected drafts), and spot-checks
(`swarm.client.transport.verify`): a step that raises `OutputsRetracted` is picked again from the retracted position
(`DecodePolicy.retract`), and the loop ends only after `settle` found every check in flight passed (a retraction there
also resumes the loop).

The policy is the front end's side: how tokens are picked (`swarm.client.decoding.sampling`: Hugging Face logits
processors over the batch, or one `Sampler` per choice) and what taking them means (scores, streamers and stopping
criteria for
`generate`, in `swarm.client.decoding.hf_decoding`; text, events and held-back text for the gateway, in
`gateway.serving.runs`). A policy's pick type `P` is its own: the loop only asks `tokens(picks)` for each row's token
id.
"""
from __future__ import annotations

from typing import Callable, Generic, List, Optional, Protocol, Sequence, Tuple, TypeVar

import torch

from swarm.client.decoding.drafting import DraftSampling
from swarm.client.decoding.speculative import Speculator
from swarm.client.transport.verify import OutputsRetracted

P = TypeVar("P")
T = TypeVar("T")

# feed(ids [rows, seq], pick or None, num_logits, first) -> (logits [rows, vocab] or [rows, n, vocab], what pick
# returned or None): the servers hold `ids` afterwards (`swarm.client.model.model_session.ModelSession.feed_and_pick`,
# the gateway's `SessionProvider.prefill` / `step`)
Feed = Callable[[torch.Tensor, Optional[Callable[[torch.Tensor], T]], int, bool], Tuple[torch.Tensor, T]]


class DecodeSession(Protocol):
    """What the loop needs of the session itself, beyond `feed`: its length, the rewind of rejected drafts, and the
    settling of spot-checks in flight."""

    @property
    def max_length(self) -> int: ...

    def rewind(self, length: int) -> None: ...

    def settle(self) -> None: ...


class DecodePolicy(Protocol[P]):
    """A front end's side of the loop (module docstring)."""

    @property
    def finished(self) -> List[bool]:
        """Per row: no more tokens (the loop pads it)."""
        ...

    @property
    def pick_in_head(self) -> bool:
        """Whether picks run in the batched LM-head task (else on the loop's thread after the step)."""
        ...

    @property
    def draft_sampling(self) -> Optional[DraftSampling]:
        """A sampled request's drafting (None: greedy drafts)."""
        ...

    def picker(self, ids: torch.Tensor, remaining: List[Optional[int]]) -> Callable[[torch.Tensor], P]:
        """pick(logits [rows, vocab]) -> the rows' picks; ids [rows, seq]; `remaining` tokens each row may still
        generate, this one included (None: the row finished)."""
        ...

    def verifier(self, ids: torch.Tensor, drafts: List[int], probs: Optional[torch.Tensor]
                 ) -> Callable[[torch.Tensor], List[P]]:
        """For a speculative step of one row: logits [1, k + 1, vocab] -> the picks of each position it yields (the
        accepted drafts and one more; `swarm.client.decoding.speculative.accept_drafts`)."""
        ...

    def tokens(self, picks: P) -> Sequence[Optional[int]]:
        """Each row's picked token id (None: nothing picked for it)."""
        ...

    def take(self, ids: torch.Tensor, picks: P, logits: torch.Tensor) -> None:
        """The rows' tokens were appended: ids [rows, seq]; logits [rows, vocab] those they were picked from.
        Updates `finished`."""
        ...

    def retract(self, retracted: OutputsRetracted, ids: torch.Tensor) -> torch.Tensor:
        """Picks made from retracted outputs are undone: the policy's state as it was then; returns ids cut."""
        ...

    def before_step(self) -> None:
        """Before each step (a cancelled or late generation raises here)."""
        ...

    def after_step(self, ids: torch.Tensor, positions: int) -> None:
        """After each step and its `positions` tokens were taken; ids [rows, seq]."""
        ...

    @property
    def unsettled(self) -> bool:
        """One more step is needed although every row finished (it checks held-back outputs)."""
        ...


class DecodeLoop(Generic[P]):
    """One generation's loop over `session` (module docstring). `speculator`: speculative decoding (one row)."""

    def __init__(self, session: DecodeSession, feed: Feed, policy: DecodePolicy[P], prompt_len: int, max_new: int,
                 pad: int, speculator: Optional[Speculator] = None):
        self.session, self.feed, self.policy = session, feed, policy
        self.prompt_len, self.max_new, self.pad, self.speculator = prompt_len, max_new, pad, speculator
        self.steps = 0

    def run(self, ids: torch.Tensor) -> torch.Tensor:
        """ids [rows, prompt] -> [rows, prompt + new]: every row's tokens (finished rows padded to the longest)."""
        policy, session = self.policy, self.session
        while True:
            if self.ended(ids):
                try:  # every spot-check in flight settled before the output is final
                    session.settle()
                    return ids
                except OutputsRetracted as retracted:
                    ids = policy.retract(retracted, ids)
                    continue
            ids = self.step(ids)

    def step(self, ids: torch.Tensor) -> torch.Tensor:
        """One turn of the loop once `ended` said a step is left: ids [rows, seq] -> [rows, seq + 1 or more] (or
        cut back, after a retraction)."""
        self.policy.before_step()
        remaining = self.remaining(ids)
        try:
            # (the step's logits live in `_step` only: a view of the head batch's whole logits, held into the
            # next step, would keep that round's batch alive: 6 MB at 32 streams)
            return self._step(ids, remaining)
        except OutputsRetracted as retracted:  # a lying server was caught: pick from its position again
            return self.policy.retract(retracted, ids)

    # ---- the pieces an engine round (`gateway.serving.rounds`) drives one step of this loop with
    def ended(self, ids: torch.Tensor) -> bool:
        """Whether no step is left: every row finished or at `max_new`, and nothing held back waits for a check."""
        generated = ids.shape[1] - self.prompt_len
        return (all(self.policy.finished) or generated >= self.max_new) and not self.policy.unsettled

    def remaining(self, ids: torch.Tensor) -> List[Optional[int]]:
        """The tokens each row may still generate, this step's included (None: the row finished)."""
        generated = ids.shape[1] - self.prompt_len
        return [None if done else self.max_new - generated for done in self.policy.finished]

    def take(self, ids: torch.Tensor, blocks: List[Tuple[P, torch.Tensor]]) -> torch.Tensor:
        """A step's picks taken (each block: the picks of one position, its logits [rows, vocab]): ids [rows, seq]
        -> [rows, seq + len(blocks)] at most (a speculative step's tokens one by one, as plain steps would)."""
        policy = self.policy
        self.steps += 1
        for picks, logits in blocks:  # a speculative step's tokens one by one, as plain steps would take them
            column = [self.pad if token is None or done else token
                      for token, done in zip(policy.tokens(picks), policy.finished)]
            ids = torch.cat([ids, torch.tensor(column, dtype=torch.long)[:, None]], dim=1)
            policy.take(ids, picks, logits)
            if all(policy.finished):
                break
        policy.after_step(ids, len(blocks))
        return ids

    def _step(self, ids: torch.Tensor, remaining: List[Optional[int]]) -> torch.Tensor:
        """One step through the swarm and its tokens taken: ids [rows, seq] -> [rows, seq + 1 or more]."""
        blocks = self._speculative_step(ids, remaining[0]) if self.speculator is not None else None
        if blocks is None:
            blocks = [self._plain_step(ids, remaining)]
        return self.take(ids, blocks)

    def _plain_step(self, ids: torch.Tensor, remaining: List[Optional[int]]) -> Tuple[P, torch.Tensor]:
        """One token per row: (the picks, logits [rows, vocab])."""
        policy = self.policy
        pick = policy.picker(ids, remaining)
        logits, picks = self.feed(ids, pick if policy.pick_in_head else None, 1, self.steps == 0)
        return (picks if policy.pick_in_head else pick(logits)), logits

    def _speculative_step(self, ids: torch.Tensor, remaining: Optional[int]) -> Optional[List[Tuple[P, torch.Tensor]]]:
        """[last token + drafts] for the one row: each position's (picks, logits [1, vocab]); None when there is
        nothing to draft (a plain step follows)."""
        assert self.speculator is not None and remaining is not None
        policy = self.policy
        drafts, probs = self.speculator.drafts(ids[0], remaining, self.session.max_length - ids.shape[1],
                                               policy.draft_sampling)
        if not drafts:
            return None
        fed = torch.cat([ids, torch.tensor([drafts], dtype=torch.long)], dim=1)  # [1, seq + k]
        logits, accepted = self.feed(fed, policy.verifier(ids, drafts, probs), len(drafts) + 1, self.steps == 0)
        self.speculator.record(len(drafts), len(accepted) - 1)
        self.session.rewind(ids.shape[1] + len(accepted) - 1)  # every server drops the rejected drafts
        return [(picks, logits[0, j][None]) for j, picks in enumerate(accepted)]  # logits [1, k + 1, vocab]
