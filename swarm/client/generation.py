"""Choosing next tokens from logits: the one token-selection path of `generate` and of the gateway.

`SamplingParams` holds a request's sampling fields (OpenAI / vLLM style; `from_generation_config` maps a Hugging Face
`GenerationConfig` onto them). `build_processors(params, prompt_len)` turns them into a Hugging Face
`LogitsProcessorList`: min-new-tokens, logit bias, repetition / presence / frequency penalties, then the temperature,
top-k, top-p and min-p warpers. transformers' own processors are used wherever it has one (logit bias is its
`SequenceBiasLogitsProcessor` over one-token sequences); the only custom ones are
OpenAI's presence / frequency penalty (none in transformers) and a faster min-new-tokens (`MinNewTokensProcessor`).
`pick_tokens(scores, greedy, generators)` picks one token per row from processed scores: argmax when greedy, else a
draw from the softmax, with the global RNG (`generate`: `torch.manual_seed` reproduces it, as with transformers) or
with one `torch.Generator` per row (the gateway's seeded choices).

`Sampler` is one gateway choice's state: its processors, its own generator (seed + choice index; a random seed when
none is given), an optional token constraint (`TokenConstraint`, e.g. the gateway's JSON mode: rejection sampling
from the constrained distribution, forced closing tokens near the end of the budget) and logprobs taken from the
model's unprocessed distribution. `RowSamplers` holds a batch's samplers and makes the `pick` that
`ModelSession.feed_and_pick` runs in the batched head task.
"""
from __future__ import annotations

import functools
import math
import secrets
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional, Protocol, Sequence, Tuple, Union, cast

import torch
from transformers.generation.logits_process import (
    LogitsProcessor,
    LogitsProcessorList,
    MinNewTokensLengthLogitsProcessor,
    MinPLogitsWarper,
    RepetitionPenaltyLogitsProcessor,
    SequenceBiasLogitsProcessor,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)


@dataclass
class SamplingParams:
    max_tokens: int
    temperature: float = 1.0  # 0: greedy
    top_p: float = 1.0
    top_k: int = 0  # 0: off
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: Dict[int, float] = field(default_factory=dict)
    seed: Optional[int] = None
    stop: List[str] = field(default_factory=list)
    stop_token_ids: List[int] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: bool = False
    top_logprobs: int = 0
    json_mode: bool = False
    min_new_tokens: int = 0  # end-of-sequence tokens (`eos_token_id`) are masked until this many are out
    eos_token_id: Union[int, List[int], torch.Tensor, None] = None  # any integer dtype (for min_new_tokens)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @classmethod
    def from_generation_config(cls, config, max_new_tokens: int) -> "SamplingParams":
        """The sampling of a Hugging Face `GenerationConfig` (what `transformers`' generate would apply)."""
        sample = bool(config.do_sample)
        temperature = 1.0 if config.temperature is None else float(config.temperature)
        if sample and temperature <= 0:
            raise ValueError(f"`temperature` (={temperature}) has to be a strictly positive float when sampling")
        return cls(
            max_tokens=max_new_tokens,
            temperature=temperature if sample else 0.0,
            top_k=(config.top_k or 0) if sample else 0,
            top_p=(1.0 if config.top_p is None else config.top_p) if sample else 1.0,
            min_p=(getattr(config, "min_p", None) or 0.0) if sample else 0.0,
            repetition_penalty=1.0 if config.repetition_penalty is None else config.repetition_penalty,
            min_new_tokens=config.min_new_tokens or 0,
            eos_token_id=config.eos_token_id,
        )


@dataclass
class TokenChoice:
    token_id: int
    logprob: Optional[float] = None
    top: List[Tuple[int, float]] = field(default_factory=list)  # (token id, logprob), best first
    forced: bool = False  # written to close a constrained document before max_tokens ran out


class TokenConstraint(Protocol):
    """What `Sampler` needs from a constraint on the output (the gateway's `JsonConstraint`)."""

    @property
    def complete(self) -> bool: ...

    def candidates(self) -> torch.Tensor: ...  # [vocab] bool, a superset of the tokens that may follow

    def allows(self, token_id: int, budget: Optional[int] = None) -> bool: ...

    def advance(self, token_id: int) -> None: ...

    def closing_tokens(self) -> List[int]: ...


# ---- processors that transformers lacks ------------------------------------------------------------------------
class PresenceFrequencyPenalty(LogitsProcessor):
    """OpenAI's penalties over the tokens generated so far (not the prompt)."""

    def __init__(self, presence: float, frequency: float, prompt_len: int):
        self.presence, self.frequency, self.prompt_len = presence, frequency, prompt_len

    def __call__(self, input_ids: torch.LongTensor, scores: torch.Tensor) -> torch.Tensor:
        generated = input_ids[:, self.prompt_len:]
        if generated.shape[1] == 0:
            return scores
        counts = torch.zeros_like(scores)
        counts.scatter_add_(1, generated, torch.ones_like(generated, dtype=scores.dtype))
        return scores - self.frequency * counts - self.presence * (counts > 0).to(scores.dtype)


class MinNewTokensProcessor(MinNewTokensLengthLogitsProcessor):
    """transformers' processor (end-of-sequence tokens get -inf until `min_new_tokens` are out) without its
    per-call `isin` over the whole vocabulary, 0.3 ms a step on the CPU: with 8 concurrent sessions that was a
    third of their token choices. The same scores, set by index; once the minimum is reached the scores pass through
    as they are (transformers returns a copy; none of the processors here changes its input in place). The eos ids
    may be of any integer dtype."""

    def __call__(self, input_ids: torch.LongTensor, scores: torch.Tensor) -> torch.Tensor:
        if input_ids.shape[-1] - self.prompt_length_to_skip >= self.min_new_tokens:
            return scores
        eos = self.eos_token_id.to(scores.device, torch.long).reshape(-1)
        eos = eos[(eos >= 0) & (eos < scores.shape[-1])]  # ids outside the vocabulary match nothing, as in isin
        return scores.index_fill(-1, eos, -math.inf)


def build_processors(params: SamplingParams, prompt_len: int = 0) -> LogitsProcessorList:
    """The processors for `params`, in the order they apply; `prompt_len`: where the generated tokens start."""
    processors = LogitsProcessorList()
    if params.min_new_tokens and params.eos_token_id is not None:
        processors.append(MinNewTokensProcessor(prompt_len, params.min_new_tokens, params.eos_token_id))
    if params.logit_bias:
        # OpenAI's logit_bias: transformers' sequence bias with one-token sequences (a constant added to their logits)
        processors.append(SequenceBiasLogitsProcessor([[[int(t)], float(b)] for t, b in params.logit_bias.items()]))
    if params.repetition_penalty != 1.0:
        processors.append(RepetitionPenaltyLogitsProcessor(penalty=params.repetition_penalty))
    if params.presence_penalty or params.frequency_penalty:
        processors.append(PresenceFrequencyPenalty(params.presence_penalty, params.frequency_penalty, prompt_len))
    if not params.greedy:
        if params.temperature != 1.0:
            processors.append(TemperatureLogitsWarper(params.temperature))
        if params.top_k:
            processors.append(TopKLogitsWarper(top_k=params.top_k, min_tokens_to_keep=1))
        if params.top_p < 1.0:
            processors.append(TopPLogitsWarper(top_p=params.top_p, min_tokens_to_keep=1))
        if params.min_p > 0:
            processors.append(MinPLogitsWarper(min_p=params.min_p, min_tokens_to_keep=1))
    return processors


# ---- picking ---------------------------------------------------------------------------------------------------
@torch.no_grad()
def pick_tokens(scores: torch.Tensor, greedy: bool,
                generators: Optional[Sequence[torch.Generator]] = None) -> torch.Tensor:
    """The next token of each row [batch] from processed scores [batch, vocab]: the argmax when `greedy`, else a
    draw from the softmax, with the global RNG or, given `generators`, row i's own `generators[i]`."""
    if greedy:
        return scores.argmax(dim=-1)
    probs = torch.softmax(scores, dim=-1)
    if generators is None:
        return torch.multinomial(probs, num_samples=1).squeeze(1)
    return torch.cat([torch.multinomial(row, 1, generator=g) for row, g in zip(probs, generators)])


@torch.no_grad()
def process_and_pick(processors: LogitsProcessorList, input_ids: torch.Tensor, logits: torch.Tensor,
                     greedy: bool, generators: Optional[Sequence[torch.Generator]] = None) -> torch.Tensor:
    """`pick_tokens` after the processors: input_ids [batch, seq], logits [batch, vocab] -> next tokens [batch]."""
    return pick_tokens(processors(cast(torch.LongTensor, input_ids), logits), greedy, generators)


class Sampler:
    """Picks the tokens of one choice of a request."""

    MAX_REJECTIONS = 64
    CLOSING_LOOKAHEAD = 24  # check that the document can still be closed when this few tokens are left
    SCAN_WITH_BUDGET = 2048  # most likely tokens checked against that budget before closing outright

    def __init__(self, params: SamplingParams, prompt_len: int, vocab_size: int, index: int = 0,
                 constraint: Optional[TokenConstraint] = None):
        self.params, self.prompt_len, self.vocab_size = params, prompt_len, vocab_size
        self.processors = build_processors(params, prompt_len)
        seed = params.seed + index if params.seed is not None else secrets.randbits(62)
        self.generator = torch.Generator().manual_seed(seed % (1 << 63))
        self.constraint = constraint
        self._forcing: List[int] = []

    @torch.no_grad()
    def choose(self, input_ids: torch.Tensor, logits: torch.Tensor, remaining: int) -> TokenChoice:
        """input_ids: [seq] this choice's ids so far; logits: [vocab] for the next position; `remaining`: tokens
        this choice may still generate, including this one."""
        logits = logits[: self.vocab_size].float()
        token, forced = self._pick(input_ids, logits, remaining)
        choice = TokenChoice(token, forced=forced)
        if self.params.logprobs:
            logprobs = torch.log_softmax(logits, dim=-1)
            choice.logprob = float(logprobs[token])
            if self.params.top_logprobs:
                values, ids = torch.topk(logprobs, self.params.top_logprobs)
                choice.top = [(int(i), float(v)) for i, v in zip(ids, values)]
        if self.constraint is not None:
            self.constraint.advance(token)
        return choice

    def _pick(self, input_ids: torch.Tensor, logits: torch.Tensor, remaining: int) -> Tuple[int, bool]:
        c = self.constraint
        if c is not None:
            if not self._forcing:
                closing = c.closing_tokens()
                if closing and len(closing) >= remaining:
                    self._forcing = closing
            if self._forcing:
                return self._forcing.pop(0), True
        scores = self.processors(cast(torch.LongTensor, input_ids[None]), logits[None])  # [1, vocab]
        if c is None:
            return int(pick_tokens(scores, self.params.greedy, [self.generator])[0]), False
        # near the end of the budget, a token must also leave room to close the document
        budget = remaining - 1 if remaining <= self.CLOSING_LOOKAHEAD else None
        return self._constrained(c, scores[0], budget)

    def _constrained(self, c: TokenConstraint, scores: torch.Tensor, budget: Optional[int]) -> Tuple[int, bool]:
        scores = scores.masked_fill(~c.candidates(), float("-inf"))  # exact: those tokens cannot follow
        if self.params.greedy:
            best = int(torch.argmax(scores))
            if c.allows(best, budget):
                return best, False
        else:
            probs = torch.softmax(scores, dim=-1)
            for _ in range(self.MAX_REJECTIONS):
                if not bool(torch.isfinite(probs).all()) or float(probs.sum()) <= 0:
                    break
                token = int(torch.multinomial(probs, 1, generator=self.generator))
                if c.allows(token, budget):
                    return token, False
                probs[token] = 0
        order = torch.argsort(scores, descending=True).tolist()
        for token in order[:self.SCAN_WITH_BUDGET] if budget is not None else order:
            if c.allows(token, budget):
                return token, False
        closing = c.closing_tokens()
        if closing:  # the likely tokens cannot close in time: start writing the shortest closing text
            self._forcing = closing[1:]
            return closing[0], True
        raise RuntimeError("no token continues the constrained text")  # unreachable for a tokenizer with ASCII tokens


class RowSamplers:
    """The samplers of a batch's rows (the n choices of a request, as one batched session)."""

    def __init__(self, samplers: Sequence[Sampler]):
        self.samplers = list(samplers)

    def picker(self, input_ids: torch.Tensor, remaining: Sequence[Optional[int]]
               ) -> Callable[[torch.Tensor], List[Optional[TokenChoice]]]:
        """The `pick` for `ModelSession.feed_and_pick`: logits [batch, vocab] -> each row's `TokenChoice`, None for
        the rows whose `remaining` is None (finished). input_ids: [batch, seq] the rows' ids so far."""
        return functools.partial(self.choose, input_ids, list(remaining))

    def choose(self, input_ids: torch.Tensor, remaining: Sequence[Optional[int]], logits: torch.Tensor
               ) -> List[Optional[TokenChoice]]:
        return [None if left is None else sampler.choose(input_ids[i], logits[i], left)
                for i, (sampler, left) in enumerate(zip(self.samplers, remaining))]
