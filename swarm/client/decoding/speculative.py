"""Speculative decoding across the swarm: drafted tokens verified by the servers in one multi-token step.

A step sends [last token + k drafts] (`swarm.client.decoding.drafting`) through the chain as one step (pushed server to
server like a decode step) and gets the logits of all k + 1 positions from the client's LM head
(`ModelSession.feed_and_pick(num_logits=k + 1)`). `accept_drafts` then walks the positions in order, each scored by
the request's processors over the ids up to it (so penalties and length-dependent processors see exactly what plain
decoding would; positions after the first rejection are never scored):
- greedy: a draft is accepted while it is the argmax; the first mismatch (or, all accepted, the bonus position)
  gives the argmax token. The output is token for token that of plain greedy decoding.
- sampling: the standard rule (Leviathan et al. 2023; Chen et al. 2023): draft x is accepted with probability
  min(1, p(x) / q(x)) where p is the processed target distribution and q the draft's (one-hot for n-gram drafts:
  accept with probability p(x)); on rejection the token is drawn from normalize(max(0, p - q)); after k accepted
  drafts a bonus token is drawn from p. The output has the distribution of plain sampling.
Afterwards the session is rewound (`ModelSession.rewind`) to the tokens before the first rejected draft: every
server's next step overwrites the rest, and the failover history replays only accepted positions.

`Speculator` holds one generation's drafter and adaptive draft length (`DraftLength`); the one decode loop
(`swarm.client.decoding.loop.DecodeLoop`) runs its steps for `generate` and the gateway alike (one row; beam search and
batches of several rows decode plainly).
"""
from __future__ import annotations

import logging
from typing import Callable, List, Optional, Tuple

import torch

from swarm.client.decoding.drafting import DraftLength, DraftSampling, SpeculativeConfig, make_drafter

logger = logging.getLogger(__name__)

# a position's processed scores [vocab] from its index j (0: the last fed token's) and its raw logits [vocab]
Scorer = Callable[[int, torch.Tensor], torch.Tensor]


@torch.no_grad()
def accept_drafts(drafts: List[int], logits: torch.Tensor, score: Scorer, greedy: bool,
                  generator: Optional[torch.Generator] = None, draft_probs: Optional[torch.Tensor] = None
                  ) -> List[Tuple[int, torch.Tensor]]:
    """The tokens a verification step yields: the accepted drafts and one more (corrected or bonus), each with its
    processed scores [vocab]. logits: [k + 1, vocab] (position j predicts the token after drafts[:j]);
    `draft_probs` [k, vocab]: the drafts' distributions (None: deterministic drafts, one-hot); `generator`: the
    random stream of a sampled request (None: torch's global one)."""
    out: List[Tuple[int, torch.Tensor]] = []
    for j in range(len(drafts) + 1):
        scores = score(j, logits[j])  # [vocab]
        if greedy:
            token = int(scores.argmax())
            out.append((token, scores))
            if j == len(drafts) or token != drafts[j]:
                return out
            continue
        p = torch.softmax(scores.float(), dim=-1)  # [vocab]
        if j == len(drafts):  # every draft accepted: the bonus token
            out.append((int(torch.multinomial(p, 1, generator=generator)), scores))
            return out
        x = drafts[j]
        q_x = 1.0 if draft_probs is None else float(draft_probs[j, x])
        u = float(torch.rand((), generator=generator))
        if u * q_x < float(p[x]):  # u < p(x) / q(x), without dividing by a zero q
            out.append((x, scores))
            continue
        if draft_probs is None:
            residual = p.clone()
            residual[x] = 0.0
        else:
            residual = (p - draft_probs[j].to(p.dtype)).clamp_min(0.0)
        if float(residual.sum()) <= 0.0:  # p == q up to rounding: rejection had probability ~0
            residual = p
        out.append((int(torch.multinomial(residual / residual.sum(), 1, generator=generator)), scores))
        return out
    return out


class Speculator:
    """One generation's drafting: the drafter, the adaptive draft length and the acceptance counts."""

    def __init__(self, config: SpeculativeConfig, vocab_size: int, eos_token_ids: Optional[List[int]] = None,
                 sliding_window: Optional[int] = None):
        """`sliding_window`: the model's (servers keep a ring of 2 windows, so a rewind may go back at most about a
        window: drafts stay below it)."""
        self.config = config
        self.drafter = make_drafter(config, vocab_size, eos_token_ids)
        maximum = config.num_draft_tokens
        if sliding_window:
            maximum = max(1, min(maximum, int(sliding_window) - 1))
        self.length = DraftLength(maximum, config.adaptive)

    def drafts(self, ids: torch.Tensor, remaining: int, room: int, sampling: Optional[DraftSampling] = None
               ) -> Tuple[List[int], Optional[torch.Tensor]]:
        """Drafts to follow ids [seq] when `remaining` tokens may still be generated (this step's included) and the
        session has `room` positions left after ids: at most remaining - 1 (the step adds one token of its own)."""
        k = min(self.length.k, remaining - 1, room - 1)
        if k <= 0 or not self.length.take_turn():
            return [], None
        drafts, probs = self.drafter.draft(ids, k, sampling)
        return drafts[:k], None if probs is None else probs[:k]

    def record(self, proposed: int, accepted: int) -> None:
        self.length.update(proposed, accepted)
