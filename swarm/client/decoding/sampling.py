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
none is given), an optional token constraint (`TokenConstraint`: `swarm.client.decoding.grammar.GrammarConstraint` for
structured output, whose mask sets the scores of the tokens that may not follow to -inf before the processors) and
logprobs taken from the model's unprocessed distribution; `Sampler.verify` picks a choice's tokens from a speculative
step's drafts. `RowSamplers` holds a batch's samplers and makes the `pick`
that `ModelSession.feed_and_pick` runs in the batched head task.
"""
from __future__ import annotations

import functools
import math
import secrets
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Protocol, Sequence, Tuple, Union, cast

import torch
from transformers.generation.logits_process import (
    EpsilonLogitsWarper,
    EtaLogitsWarper,
    ExponentialDecayLengthPenalty,
    ForcedBOSTokenLogitsProcessor,
    ForcedEOSTokenLogitsProcessor,
    InfNanRemoveLogitsProcessor,
    LogitNormalization,
    LogitsProcessor,
    LogitsProcessorList,
    MinLengthLogitsProcessor,
    MinNewTokensLengthLogitsProcessor,
    MinPLogitsWarper,
    NoBadWordsLogitsProcessor,
    NoRepeatNGramLogitsProcessor,
    RepetitionPenaltyLogitsProcessor,
    SequenceBiasLogitsProcessor,
    SuppressTokensAtBeginLogitsProcessor,
    SuppressTokensLogitsProcessor,
    TemperatureLogitsWarper,
    TopHLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
    TypicalLogitsWarper,
)

from swarm.client.decoding.speculative import accept_drafts

# `GenerationConfig` fields that `generate` cannot honour: set to anything but the value given here, they are an error
# (never silently ignored). Each maps to the reason given in the error.
UNSUPPORTED_GENERATION_SETTINGS: Dict[str, Tuple[Any, str]] = {
    "output_attentions": (False, "the servers do not return attention weights"),
    "output_hidden_states": (False, "the servers do not return the hidden states of every layer"),
    "encoder_repetition_penalty": (1.0, "not supported by the swarm client"),
    "encoder_no_repeat_ngram_size": (0, "not supported by the swarm client"),
    "guidance_scale": (1.0, "classifier-free guidance (a second, unconditional forward pass) is not supported"),
    "watermarking_config": (None, "watermarking is not supported"),
    "token_healing": (False, "token healing is not supported"),
    "penalty_alpha": (None, "contrastive search is not supported"),
    "dola_layers": (None, "DoLa decoding is not supported"),
    "num_beam_groups": (1, "diverse beam search is not supported"),
    "constraints": (None, "constrained beam search is not supported"),
    "force_words_ids": (None, "constrained beam search is not supported"),
    "use_mtp": (False, "multi-token prediction is not supported"),
}


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
    grammar: Optional[str] = None  # llguidance grammar the output must follow (`swarm.client.decoding.grammar`)
    min_new_tokens: int = 0  # end-of-sequence tokens (`eos_token_id`) are masked until this many are out
    eos_token_id: Union[int, List[int], torch.Tensor, None] = None  # any integer dtype (for min_new_tokens)
    # Hugging Face `generate`'s other processors (set by `from_generation_config`; the defaults apply nothing)
    min_length: int = 0  # prompt + generated tokens below which end-of-sequence tokens are masked
    sequence_bias: Any = None  # transformers' `sequence_bias` (token-id sequences -> bias)
    no_repeat_ngram_size: int = 0
    bad_words_ids: Optional[List[List[int]]] = None
    forced_bos_token_id: Optional[int] = None
    forced_eos_token_id: Union[int, List[int], None] = None  # forced at the last position (prompt + max_tokens)
    remove_invalid_values: bool = False
    exponential_decay_length_penalty: Optional[Tuple[int, float]] = None
    suppress_tokens: Optional[List[int]] = None
    begin_suppress_tokens: Optional[List[int]] = None
    top_h: Optional[float] = None
    typical_p: float = 1.0
    epsilon_cutoff: float = 0.0
    eta_cutoff: float = 0.0
    renormalize_logits: bool = False

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    def end_token_ids(self, eos_token_ids: Sequence[int]) -> List[int]:
        """The ids that end a choice (sorted): `stop_token_ids`, and the model's end-of-sequence ids unless
        `ignore_eos`. The gateway's one rule for them: what `min_tokens` masks and what finishes a choice."""
        return sorted(set(self.stop_token_ids) | (set() if self.ignore_eos else set(eos_token_ids)))

    @classmethod
    def from_generation_config(cls, config, max_new_tokens: int) -> "SamplingParams":
        """The sampling of a Hugging Face `GenerationConfig` (what `transformers`' generate would apply). A setting
        that cannot be applied is an error naming it (`UNSUPPORTED_GENERATION_SETTINGS`), never ignored."""
        for name, (default, why) in UNSUPPORTED_GENERATION_SETTINGS.items():
            value = getattr(config, name, default)
            if value is not None and value != default:
                raise NotImplementedError(f"generate(): `{name}={value!r}` is not supported: {why}")
        sample = bool(config.do_sample)
        temperature = 1.0 if config.temperature is None else float(config.temperature)
        if sample and temperature <= 0:
            raise ValueError(f"`temperature` (={temperature}) has to be a strictly positive float when sampling")
        get = functools.partial(getattr, config)
        return cls(
            max_tokens=max_new_tokens,
            temperature=temperature if sample else 0.0,
            top_k=(config.top_k or 0) if sample else 0,
            top_p=(1.0 if config.top_p is None else config.top_p) if sample else 1.0,
            min_p=(getattr(config, "min_p", None) or 0.0) if sample else 0.0,
            repetition_penalty=1.0 if config.repetition_penalty is None else config.repetition_penalty,
            min_new_tokens=config.min_new_tokens or 0,
            eos_token_id=config.eos_token_id,
            min_length=get("min_length", 0) or 0,
            sequence_bias=get("sequence_bias", None),
            no_repeat_ngram_size=get("no_repeat_ngram_size", 0) or 0,
            bad_words_ids=get("bad_words_ids", None),
            forced_bos_token_id=get("forced_bos_token_id", None),
            forced_eos_token_id=get("forced_eos_token_id", None),
            remove_invalid_values=bool(get("remove_invalid_values", False)),
            exponential_decay_length_penalty=get("exponential_decay_length_penalty", None),
            suppress_tokens=get("suppress_tokens", None),
            begin_suppress_tokens=get("begin_suppress_tokens", None),
            top_h=get("top_h", None) if sample else None,
            typical_p=(1.0 if get("typical_p", None) is None else get("typical_p", None)) if sample else 1.0,
            epsilon_cutoff=(get("epsilon_cutoff", None) or 0.0) if sample else 0.0,
            eta_cutoff=(get("eta_cutoff", None) or 0.0) if sample else 0.0,
            renormalize_logits=bool(get("renormalize_logits", False)),
        )


@dataclass
class TokenChoice:
    token_id: int
    logprob: Optional[float] = None
    top: List[Tuple[int, float]] = field(default_factory=list)  # (token id, logprob), best first


class TokenConstraint(Protocol):
    """What `Sampler` needs from a constraint on the output (`swarm.client.decoding.grammar.GrammarConstraint`)."""

    @property
    def complete(self) -> bool: ...

    def mask(self) -> torch.Tensor: ...  # [vocab] bool, exactly the tokens that may follow

    def advance(self, token_id: int) -> None: ...

    def rollback(self, tokens: int) -> None: ...  # undo the last `tokens` advances


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


def build_processors(params: SamplingParams, prompt_len: int = 0, custom: Optional[Sequence[LogitsProcessor]] = None,
                     min_tokens_to_keep: int = 1) -> LogitsProcessorList:
    """The processors for `params`, in the order they apply (transformers' order in `generate`, the OpenAI
    penalties after its repetition penalty); `prompt_len`: where the generated tokens start. `custom`: a user's
    `logits_processor` list, merged as transformers does: one replaces the processor of its type built here, the
    others follow the processors and precede the sampling warpers. `min_tokens_to_keep`: the warpers' (beam
    sampling keeps one more than there are end-of-sequence ids, as transformers)."""
    keep = min_tokens_to_keep
    eos = params.eos_token_id
    processors = LogitsProcessorList()
    if params.min_new_tokens and eos is not None:
        processors.append(MinNewTokensProcessor(prompt_len, params.min_new_tokens, eos))
    if params.sequence_bias is not None:
        processors.append(SequenceBiasLogitsProcessor(sequence_bias=params.sequence_bias))
    if params.logit_bias:
        # OpenAI's logit_bias: transformers' sequence bias with one-token sequences (a constant added to their logits)
        processors.append(SequenceBiasLogitsProcessor([[[int(t)], float(b)] for t, b in params.logit_bias.items()]))
    if params.repetition_penalty != 1.0:
        processors.append(RepetitionPenaltyLogitsProcessor(penalty=params.repetition_penalty))
    if params.presence_penalty or params.frequency_penalty:
        processors.append(PresenceFrequencyPenalty(params.presence_penalty, params.frequency_penalty, prompt_len))
    if params.no_repeat_ngram_size > 0:
        processors.append(NoRepeatNGramLogitsProcessor(params.no_repeat_ngram_size))
    if params.bad_words_ids is not None:
        processors.append(NoBadWordsLogitsProcessor(params.bad_words_ids, eos))
    if params.min_length > 0 and eos is not None:
        processors.append(MinLengthLogitsProcessor(params.min_length, eos))
    if params.forced_bos_token_id is not None:
        processors.append(ForcedBOSTokenLogitsProcessor(params.forced_bos_token_id))
    if params.forced_eos_token_id is not None:
        processors.append(ForcedEOSTokenLogitsProcessor(prompt_len + params.max_tokens, params.forced_eos_token_id))
    if params.remove_invalid_values:
        processors.append(InfNanRemoveLogitsProcessor())
    if params.exponential_decay_length_penalty is not None:
        if eos is None:
            raise ValueError("`exponential_decay_length_penalty` needs an `eos_token_id`")
        start, factor = params.exponential_decay_length_penalty
        processors.append(ExponentialDecayLengthPenalty((int(start), float(factor)), eos, prompt_len))
    if params.suppress_tokens is not None:
        processors.append(SuppressTokensLogitsProcessor(params.suppress_tokens))
    if params.begin_suppress_tokens is not None:
        begin = prompt_len if prompt_len > 1 or params.forced_bos_token_id is None else prompt_len + 1
        processors.append(SuppressTokensAtBeginLogitsProcessor(params.begin_suppress_tokens, begin))
    if custom:
        processors = _merge_custom(processors, custom)
    if not params.greedy:
        if params.temperature != 1.0:
            processors.append(TemperatureLogitsWarper(params.temperature))
        if params.top_h is not None:
            processors.append(TopHLogitsWarper(top_h=params.top_h))
        if params.top_k:
            processors.append(TopKLogitsWarper(top_k=params.top_k, min_tokens_to_keep=keep))
        if params.top_p < 1.0:
            processors.append(TopPLogitsWarper(top_p=params.top_p, min_tokens_to_keep=keep))
        if params.min_p > 0:
            processors.append(MinPLogitsWarper(min_p=params.min_p, min_tokens_to_keep=keep))
        if params.typical_p < 1.0:
            processors.append(TypicalLogitsWarper(mass=params.typical_p, min_tokens_to_keep=keep))
        if 0.0 < params.epsilon_cutoff < 1.0:
            processors.append(EpsilonLogitsWarper(epsilon=params.epsilon_cutoff, min_tokens_to_keep=keep))
        if 0.0 < params.eta_cutoff < 1.0:
            processors.append(EtaLogitsWarper(epsilon=params.eta_cutoff, min_tokens_to_keep=keep))
    if params.renormalize_logits:
        processors.append(LogitNormalization())  # always the last, as in transformers
    return processors


def _merge_custom(processors: LogitsProcessorList, custom: Sequence[LogitsProcessor]) -> LogitsProcessorList:
    """transformers' `_merge_criteria_processor_list`: a custom processor takes the place of the one of its type."""
    merged = LogitsProcessorList()
    for default in processors:
        kind = MinNewTokensLengthLogitsProcessor if isinstance(default, MinNewTokensProcessor) else type(default)
        merged.append(next((c for c in custom if type(c) is type(default) or type(c) is kind), default))
    merged.extend(c for c in custom if c not in merged)
    return merged


# ---- picking ---------------------------------------------------------------------------------------------------
@torch.no_grad()
def pick_tokens(scores: torch.Tensor, greedy: bool,
                generators: Optional[Sequence[torch.Generator]] = None) -> torch.Tensor:
    """The next token of each row [batch] from processed scores [batch, vocab]: the argmax when `greedy`, else a
    draw from the softmax, with the global RNG (`torch.multinomial`, as transformers draws: the same seed gives the
    same tokens) or, given `generators`, row i's own `generators[i]` (`draw`)."""
    if greedy:
        return scores.argmax(dim=-1)
    probs = torch.softmax(scores, dim=-1)
    if generators is None:
        return torch.multinomial(probs, num_samples=1).squeeze(1)
    return torch.tensor([draw(row, g) for row, g in zip(probs, generators)], dtype=torch.long)


def draw(probs: torch.Tensor, generator: torch.Generator) -> int:
    """One token from `probs` [vocab] (non-negative, not necessarily normalized), exactly by its distribution: the
    inverse of the cumulative distribution (float64) at one uniform number. A thirtieth of `torch.multinomial`'s
    time over a 49k vocabulary (0.03 vs 0.9 ms), which the gateway pays per row and token."""
    cdf = probs.double().cumsum(0)  # [vocab]
    u = torch.rand((), generator=generator, dtype=torch.float64) * cdf[-1]
    index = int(torch.searchsorted(cdf, u, right=True))  # the first token whose cdf passes u: never a zero one
    if index >= cdf.shape[0]:  # u rounded up to the total: the last token of nonzero probability
        index = int(torch.nonzero(probs > 0)[-1])
    return index


@torch.no_grad()
def process_and_pick(processors: LogitsProcessorList, input_ids: torch.Tensor, logits: torch.Tensor,
                     greedy: bool, generators: Optional[Sequence[torch.Generator]] = None) -> torch.Tensor:
    """`pick_tokens` after the processors: input_ids [batch, seq], logits [batch, vocab] -> next tokens [batch]."""
    return process_and_pick_scores(processors, input_ids, logits, greedy, generators)[0]


@torch.no_grad()
def process_and_pick_scores(processors: LogitsProcessorList, input_ids: torch.Tensor, logits: torch.Tensor,
                            greedy: bool, generators: Optional[Sequence[torch.Generator]] = None
                            ) -> Tuple[torch.Tensor, torch.Tensor]:
    """`process_and_pick`, also returning the processed scores [batch, vocab] (`generate`'s `output_scores` and
    stopping criteria)."""
    scores = processors(cast(torch.LongTensor, input_ids), logits)
    return pick_tokens(scores, greedy, generators), scores


class Sampler:
    """Picks the tokens of one choice of a request."""

    def __init__(self, params: SamplingParams, prompt_len: int, vocab_size: int, index: int = 0,
                 constraint: Optional[TokenConstraint] = None):
        self.params, self.prompt_len, self.vocab_size = params, prompt_len, vocab_size
        self.processors = build_processors(params, prompt_len)
        seed = params.seed + index if params.seed is not None else secrets.randbits(62)
        self.generator = torch.Generator().manual_seed(seed % (1 << 63))
        self.constraint = constraint

    @torch.no_grad()
    def choose(self, input_ids: torch.Tensor, logits: torch.Tensor, remaining: int) -> TokenChoice:
        """input_ids: [seq] this choice's ids so far; logits: [vocab] for the next position; `remaining`: tokens
        this choice may still generate, including this one."""
        logits = logits[: self.vocab_size].float()
        token = self._pick(input_ids, logits)
        if self.constraint is not None:
            self.constraint.advance(token)
        return self._describe(token, logits)

    @torch.no_grad()
    def verify(self, input_ids: torch.Tensor, drafts: List[int], draft_probs: Optional[torch.Tensor],
               logits: torch.Tensor) -> List[TokenChoice]:
        """Speculative decoding (`swarm.client.decoding.speculative`): the tokens that drafts [k] of this choice yield,
        given the logits [k + 1, vocab] of [last token + drafts]: the accepted drafts and one more, picked as `choose`
        would (greedy: the same tokens; sampled: the same distribution, with this choice's generator).
        input_ids: [seq] this choice's ids so far; `draft_probs` [k, vocab]: the drafts' distributions (None:
        deterministic drafts). Not with a constraint (structured output decodes plainly)."""
        assert self.constraint is None, "structured output is not decoded speculatively"
        logits = logits[:, : self.vocab_size].float()
        seq = input_ids.shape[0]
        ids = torch.cat([input_ids, torch.tensor(drafts, dtype=torch.long)])[None]  # [1, seq + k]

        def score(j: int, row: torch.Tensor) -> torch.Tensor:
            return self.processors(cast(torch.LongTensor, ids[:, :seq + j]), row[None])[0]

        accepted = accept_drafts(drafts, logits, score, self.params.greedy, self.generator, draft_probs)
        return [self._describe(token, logits[j]) for j, (token, _) in enumerate(accepted)]

    def _describe(self, token: int, logits: torch.Tensor) -> TokenChoice:
        """The choice of `token`, with the logprobs asked for, from the model's unprocessed logits [vocab]."""
        choice = TokenChoice(token)
        if self.params.logprobs:
            logprobs = torch.log_softmax(logits, dim=-1)
            choice.logprob = float(logprobs[token])
            if self.params.top_logprobs:
                values, ids = torch.topk(logprobs, self.params.top_logprobs)
                choice.top = [(int(i), float(v)) for i, v in zip(ids, values)]
        return choice

    def _pick(self, input_ids: torch.Tensor, logits: torch.Tensor) -> int:
        ids = cast(torch.LongTensor, input_ids[None])
        if self.constraint is None:
            scores = self.processors(ids, logits[None])  # [1, vocab]
            return int(pick_tokens(scores, self.params.greedy, [self.generator])[0])
        allowed = self.constraint.mask()  # [vocab] bool
        if allowed.shape[0] < logits.shape[0]:
            allowed = torch.cat([allowed, allowed.new_zeros(logits.shape[0] - allowed.shape[0])])
        masked = logits.masked_fill(~allowed[: logits.shape[0]], float("-inf"))[None]  # [1, vocab]
        scores = self.processors(ids, masked) if self.processors else masked
        if self.processors and not bool(torch.isfinite(scores).any()):  # the processors masked every allowed
            scores = masked  # token (min_tokens where only the end of sequence may follow): the grammar wins
        if not bool(allowed.any()):
            raise RuntimeError("no token continues the constrained text")
        return int(pick_tokens(scores, self.params.greedy, [self.generator])[0])


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
