"""Choosing each next token from the swarm's logits, per choice of a request.

`SamplingParams` holds the OpenAI/vLLM sampling fields of one request. `Sampler` is one choice's state: its
Hugging Face `LogitsProcessorList` (logit bias, repetition / presence / frequency penalties, then temperature,
top-k, top-p and min-p warpers), its own `torch.Generator` (seeded: the same seed gives the same output; choice
i of a request uses seed + i), the optional JSON constraint (rejection sampling: a drawn token that breaks the
JSON prefix is masked and the draw repeated, which samples exactly from the constrained distribution), and
logprobs taken from the model's unprocessed distribution.
"""
from __future__ import annotations

import secrets
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Tuple

import torch
from transformers.generation.logits_process import (LogitsProcessor, LogitsProcessorList, MinPLogitsWarper,
                                                    RepetitionPenaltyLogitsProcessor, TemperatureLogitsWarper,
                                                    TopKLogitsWarper, TopPLogitsWarper)

from gateway.jsonmode import JsonConstraint


@dataclass
class SamplingParams:
    max_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
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

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


@dataclass
class TokenChoice:
    token_id: int
    logprob: Optional[float] = None
    top: List[Tuple[int, float]] = field(default_factory=list)  # (token id, logprob), best first
    forced: bool = False  # written to close a JSON document before max_tokens ran out


class LogitBiasProcessor(LogitsProcessor):
    def __init__(self, bias: Dict[int, float], vocab_size: int):
        self.ids = torch.tensor(list(bias), dtype=torch.long)
        self.values = torch.tensor(list(bias.values()), dtype=torch.float32)

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        scores = scores.clone()
        scores[:, self.ids] += self.values.to(scores.dtype)
        return scores


class PresenceFrequencyPenalty(LogitsProcessor):
    """OpenAI's penalties over the tokens generated so far (not the prompt)."""

    def __init__(self, presence: float, frequency: float, prompt_len: int):
        self.presence, self.frequency, self.prompt_len = presence, frequency, prompt_len

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        generated = input_ids[:, self.prompt_len:]
        if generated.shape[1] == 0:
            return scores
        counts = torch.zeros_like(scores)
        counts.scatter_add_(1, generated, torch.ones_like(generated, dtype=scores.dtype))
        return scores - self.frequency * counts - self.presence * (counts > 0).to(scores.dtype)


def build_processors(params: SamplingParams, prompt_len: int, vocab_size: int) -> LogitsProcessorList:
    processors = LogitsProcessorList()
    if params.logit_bias:
        processors.append(LogitBiasProcessor(params.logit_bias, vocab_size))
    if params.repetition_penalty != 1.0:
        processors.append(RepetitionPenaltyLogitsProcessor(penalty=params.repetition_penalty))
    if params.presence_penalty or params.frequency_penalty:
        processors.append(PresenceFrequencyPenalty(params.presence_penalty, params.frequency_penalty, prompt_len))
    if not params.greedy:
        if params.temperature != 1.0:
            processors.append(TemperatureLogitsWarper(params.temperature))
        if params.top_k > 0:
            processors.append(TopKLogitsWarper(top_k=params.top_k, min_tokens_to_keep=1))
        if params.top_p < 1.0:
            processors.append(TopPLogitsWarper(top_p=params.top_p, min_tokens_to_keep=1))
        if params.min_p > 0:
            processors.append(MinPLogitsWarper(min_p=params.min_p, min_tokens_to_keep=1))
    return processors


class Sampler:
    """Picks the tokens of one choice."""

    MAX_REJECTIONS = 64
    CLOSING_LOOKAHEAD = 24  # check that the document can still be closed when this few tokens are left
    SCAN_WITH_BUDGET = 2048  # most likely tokens checked against that budget before closing outright

    def __init__(self, params: SamplingParams, prompt_len: int, vocab_size: int, index: int = 0,
                 constraint: Optional[JsonConstraint] = None):
        self.params, self.prompt_len, self.vocab_size = params, prompt_len, vocab_size
        self.processors = build_processors(params, prompt_len, vocab_size)
        seed = params.seed + index if params.seed is not None else secrets.randbits(62)
        self.generator = torch.Generator().manual_seed(seed % (1 << 63))
        self.constraint = constraint
        self._forcing: List[int] = []

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
        scores = self.processors(input_ids[None], logits[None])[0]
        if c is None:
            if self.params.greedy:
                return int(torch.argmax(scores)), False
            probs = torch.softmax(scores, dim=-1)
            return int(torch.multinomial(probs, 1, generator=self.generator)), False
        # near the end of the budget, a token must also leave room to close the document
        budget = remaining - 1 if remaining <= self.CLOSING_LOOKAHEAD else None
        return self._constrained(scores, budget)

    def _constrained(self, scores: torch.Tensor, budget: Optional[int]) -> Tuple[int, bool]:
        c = self.constraint
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
        raise RuntimeError("no token continues the JSON text")  # unreachable for a tokenizer with ASCII tokens
