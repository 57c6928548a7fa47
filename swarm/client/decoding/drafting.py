"""Drafts for speculative decoding: cheap guesses of the next tokens, made on the client.

`SpeculativeConfig` says which drafter a generation uses and how many tokens it drafts at most. Drafters:
- `NgramDrafter` (`method="ngram"`): prompt lookup. The last few tokens are looked up earlier in the sequence
  (prompt and output) and what followed them there is the draft: transformers' `PromptLookupCandidateGenerator`.
  Free to make; helps where the output repeats its input (code edits, quotes, repetitive text). Deterministic: its
  draft distribution is one-hot.
- `DraftModelDrafter` (`method="draft_model"`): a small local causal LM of the same tokenizer (`draft_model=` a
  local checkpoint directory, loaded once per process by `load_draft_model`), run by the client with its own KV
  cache, cropped to what still matches the sequence at each call. Greedy requests draft its argmax; sampled ones
  draw from its distribution under the request's processors and return it (`q`) for the acceptance rule.
`DraftLength` adapts the number of drafted tokens to the measured acceptance (transformers' "heuristic" schedule:
+2 after a step whose drafts were all accepted, -1 otherwise, within [1, max]); after steps in a row whose drafts
were all rejected it pauses drafting for 1, 2, 4 ... 16 steps, so that text where drafts do not help costs almost
nothing more than plain decoding.
"""
from __future__ import annotations

import functools
import threading
from dataclasses import dataclass
from typing import Any, List, Optional, Protocol, Tuple, cast

import torch
from transformers.generation.candidate_generator import PromptLookupCandidateGenerator
from transformers.generation.logits_process import LogitsProcessorList

METHODS = ("off", "ngram", "draft_model")
MAX_DRAFT_TOKENS = 16  # a sliding-window cache keeps a window of slack for rewinds; drafts stay far below it


@dataclass
class SpeculativeConfig:
    """How a generation drafts: `method` "ngram" | "draft_model" | "off" (None: off); `num_draft_tokens`: the most
    tokens drafted per step (adapted below it with `adaptive`); `draft_model`: a local checkpoint directory;
    `ngram_size`: the longest n-gram looked up."""

    method: Optional[str] = "ngram"
    num_draft_tokens: int = 4
    draft_model: Optional[str] = None
    adaptive: bool = True
    ngram_size: int = 3

    def __post_init__(self) -> None:
        if self.method is None:
            self.method = "off"
        if self.method not in METHODS:
            raise ValueError(f"speculative must be one of {', '.join(METHODS)}, got {self.method!r}")
        if not 1 <= self.num_draft_tokens <= MAX_DRAFT_TOKENS:
            raise ValueError(f"num_draft_tokens must be in [1, {MAX_DRAFT_TOKENS}], got {self.num_draft_tokens}")
        if self.ngram_size < 1:
            raise ValueError(f"ngram_size must be at least 1, got {self.ngram_size}")
        if self.method == "draft_model" and not self.draft_model:
            raise ValueError("speculative='draft_model' needs draft_model= (a local checkpoint directory)")

    @property
    def enabled(self) -> bool:
        return self.method != "off"

    @classmethod
    def of(cls, speculative, num_draft_tokens: Optional[int] = None, draft_model: Optional[str] = None
           ) -> Optional["SpeculativeConfig"]:
        """`generate`'s arguments as a config: a `SpeculativeConfig` as it is, a method name, or None / "off"."""
        if isinstance(speculative, SpeculativeConfig):
            config = speculative
        elif speculative is None or speculative == "off":
            return None
        else:
            config = cls(method=str(speculative), draft_model=draft_model,
                         num_draft_tokens=cls.num_draft_tokens if num_draft_tokens is None else int(num_draft_tokens))
        return config if config.enabled else None


class DraftSampling(Protocol):
    """What a drafter needs to draft for a sampled request (None: greedy, argmax drafts)."""

    @property
    def processors(self) -> LogitsProcessorList: ...

    @property
    def generator(self) -> Optional[torch.Generator]: ...


class Drafter(Protocol):
    def draft(self, ids: torch.Tensor, k: int, sampling: Optional[DraftSampling] = None
              ) -> Tuple[List[int], Optional[torch.Tensor]]:
        """Up to `k` tokens likely to follow ids [seq]; and their draft distributions [len, vocab] (None: the
        drafts are deterministic, a one-hot distribution)."""
        ...


class NgramDrafter:
    """Prompt-lookup drafts (transformers' `PromptLookupCandidateGenerator`, which stops a draft at an end of
    sequence token)."""

    def __init__(self, ngram_size: int = 3, eos_token_ids: Optional[List[int]] = None):
        eos = torch.tensor(eos_token_ids, dtype=torch.long) if eos_token_ids else None
        self.lookup = PromptLookupCandidateGenerator(eos, num_output_tokens=1, max_matching_ngram_size=ngram_size,
                                                     max_length=1 << 62)

    def draft(self, ids: torch.Tensor, k: int, sampling: Optional[DraftSampling] = None
              ) -> Tuple[List[int], Optional[torch.Tensor]]:
        if k <= 0 or ids.shape[0] < 2:
            return [], None
        self.lookup.num_output_tokens = k
        candidates, _ = self.lookup.get_candidates(cast(torch.LongTensor, ids[None]))  # [1, seq + drafts]
        return candidates[0, ids.shape[0]:ids.shape[0] + k].tolist(), None


@functools.lru_cache(maxsize=4)
def load_draft_model(path: str) -> torch.nn.Module:
    """A local causal LM for drafting, loaded once per process (float32, CPU, eval)."""
    from transformers.models.auto import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    model.eval().requires_grad_(False)
    return model


class DraftModelDrafter:
    """Drafts from a small local model of the same tokenizer, its KV cache kept between calls and cropped to the
    longest prefix that still matches (the target's accepted tokens)."""

    def __init__(self, path: str, vocab_size: int):
        self.model = load_draft_model(path)
        self.vocab_size = vocab_size  # the target's: draft distributions are cut or padded to it
        self.cache: Any = None  # transformers DynamicCache of `held` tokens
        self.held: List[int] = []
        self._lock = threading.Lock()

    @torch.no_grad()
    def draft(self, ids: torch.Tensor, k: int, sampling: Optional[DraftSampling] = None
              ) -> Tuple[List[int], Optional[torch.Tensor]]:
        if k <= 0:
            return [], None
        with self._lock:
            return self._draft(ids.tolist(), k, sampling)

    def _draft(self, sequence: List[int], k: int, sampling: Optional[DraftSampling]
               ) -> Tuple[List[int], Optional[torch.Tensor]]:
        from transformers import DynamicCache

        common = 0
        limit = min(len(self.held), len(sequence) - 1)  # the last token is always fed again: its logits are needed
        while common < limit and self.held[common] == sequence[common]:
            common += 1
        if self.cache is None or common == 0:
            self.cache, common = DynamicCache(), 0
        else:
            self.cache.crop(common - len(self.held))  # transformers 5: minus the tokens to remove
        self.held = sequence[:common]
        new = torch.tensor([sequence[common:]], dtype=torch.long)  # [1, n]
        drafts: List[int] = []
        dists: List[torch.Tensor] = []
        running = torch.tensor([sequence], dtype=torch.long)  # [1, seq + drafts] for the processors
        for _ in range(k):
            out = self.model(input_ids=new, past_key_values=self.cache, use_cache=True)
            self.held.extend(new[0].tolist())
            logits = self._fit(out.logits[0, -1].float())  # [vocab]
            if sampling is None:
                token = int(logits.argmax())
            else:
                scores = sampling.processors(cast(torch.LongTensor, running), logits[None])[0]
                probs = torch.softmax(scores, dim=-1)
                token = int(torch.multinomial(probs, 1, generator=sampling.generator))
                dists.append(probs)
            drafts.append(token)
            running = torch.cat([running, torch.tensor([[token]])], dim=1)
            new = torch.tensor([[token]], dtype=torch.long)
        return drafts, (torch.stack(dists) if dists else None)

    def _fit(self, logits: torch.Tensor) -> torch.Tensor:
        """Draft logits [draft vocab] -> [target vocab] (padded entries can never be drafted)."""
        if logits.shape[0] >= self.vocab_size:
            return logits[: self.vocab_size]
        return torch.cat([logits, logits.new_full((self.vocab_size - logits.shape[0],), float("-inf"))])


def make_drafter(config: SpeculativeConfig, vocab_size: int, eos_token_ids: Optional[List[int]] = None) -> Drafter:
    if config.method == "draft_model":
        assert config.draft_model is not None
        return DraftModelDrafter(config.draft_model, vocab_size)
    return NgramDrafter(config.ngram_size, eos_token_ids)


class DraftLength:
    """The number of tokens to draft next, adapted to acceptance; and the counts behind the acceptance rate."""

    MAX_IDLE = 16  # the longest pause in drafting after a run of steps whose drafts were all rejected

    def __init__(self, maximum: int, adaptive: bool = True):
        self.maximum, self.adaptive = maximum, adaptive
        self.k = maximum if not adaptive else min(maximum, 4)
        self.proposed = self.accepted = self.steps = 0
        self.misses = 0  # steps in a row whose drafts were all rejected
        self.idle = 0  # steps left to take plainly (no drafting) before trying again

    def update(self, proposed: int, accepted: int) -> None:
        self.proposed += proposed
        self.accepted += accepted
        self.steps += 1
        if self.adaptive and proposed:
            self.k = min(self.maximum, self.k + 2) if accepted == proposed else max(1, self.k - 1)
            self.misses = self.misses + 1 if accepted == 0 else 0
            if self.misses >= 2:  # drafts keep failing: pause drafting for 1, 2, 4 ... steps (plain steps cost less)
                self.idle = min(self.MAX_IDLE, 1 << (self.misses - 2))

    def take_turn(self) -> bool:
        """Whether this step drafts (False while paused after failed drafts)."""
        if self.idle:
            self.idle -= 1
            return False
        return True

    @property
    def acceptance(self) -> float:
        return self.accepted / self.proposed if self.proposed else 0.0
