"""`generate` as Hugging Face defines it, over the one decode loop (`swarm.client.decoding.loop`).

`generate(model, input_ids, ...)` is `DistributedModelForCausalLM.generate`: it resolves the call's
`GenerationConfig` (`swarm.client.decoding.genconfig`: every setting applied or an error naming it), builds the logits
processors (`swarm.client.decoding.sampling.build_processors`, a user's `logits_processor` merged) and stopping
criteria, opens a session when none is given, and runs `DecodeLoop` with `TransformersPolicy`: the rows' tokens picked
in the batched LM-head task (transformers' processors over the batch, the global RNG as transformers draws), processed
scores and raw logits kept for `return_dict_in_generate`, the streamer fed, rows finished by their end-of-sequence
ids and the stopping criteria. Speculative decoding (`speculative=`, `num_draft_tokens=`, or transformers'
`prompt_lookup_num_tokens`) runs in the same loop for one unpadded row; `num_beams > 1` is transformers' beam search
with the servers' caches reordered in place (`swarm.client.decoding.beam`, its own loop: the beam scorer decides the
rows).
"""
from __future__ import annotations

import functools
from typing import TYPE_CHECKING, Any, Callable, List, Optional, Tuple, Union, cast

import torch
from transformers import GenerationConfig
from transformers.generation.logits_process import LogitsProcessorList
from transformers.generation.stopping_criteria import StoppingCriteriaList

from swarm.client.decoding.drafting import MAX_DRAFT_TOKENS, SpeculativeConfig
from swarm.client.decoding.genconfig import resolve_generation_config, stopping_criteria_for
from swarm.client.decoding.loop import DecodeLoop
from swarm.client.decoding.rows import left_padding
from swarm.client.decoding.sampling import SamplingParams, build_processors, process_and_pick_scores
from swarm.client.decoding.speculative import Speculator, accept_drafts
from swarm.client.transport.session import SessionError
from swarm.client.transport.verify import OutputsRetracted

if TYPE_CHECKING:  # transformers.generation.utils pulls in torch.distributed, dynamo and sympy: about 80 MB of
    # resident memory that a gateway or a client that never asks for a dict or beams should not carry
    from transformers.generation.utils import GenerateBeamDecoderOnlyOutput, GenerateDecoderOnlyOutput

# a step's picks for the batch: the next tokens [rows] and their processed scores [rows, vocab]
Picks = Tuple[torch.Tensor, torch.Tensor]


class _DraftSampling:
    def __init__(self, processors: LogitsProcessorList):
        self.processors, self.generator = processors, None  # drafts drawn with the global RNG, as the picks


class TransformersPolicy:
    """`generate`'s side of the decode loop (module docstring)."""

    pick_in_head = True

    def __init__(self, processors: LogitsProcessorList, draft_processors: LogitsProcessorList, greedy: bool,
                 rows: int, prompt_len: int, eos_ids: torch.Tensor, criteria: StoppingCriteriaList, streamer: Any,
                 scores: Optional[List[torch.Tensor]], raw_logits: Optional[List[torch.Tensor]]):
        self.processors, self.greedy, self.prompt_len = processors, greedy, prompt_len
        self.eos_ids, self.criteria, self.streamer = eos_ids, criteria, streamer
        self.scores, self.raw_logits = scores, raw_logits  # lists to append each step's [rows, vocab] to (or None)
        self.draft_sampling = None if greedy else _DraftSampling(draft_processors)
        self.done = torch.zeros(rows, dtype=torch.bool)
        self.finished: List[bool] = [False] * rows
        self.unsettled = False

    def picker(self, ids: torch.Tensor, remaining: List[Optional[int]]) -> Callable[[torch.Tensor], Picks]:
        return functools.partial(process_and_pick_scores, self.processors, ids, greedy=self.greedy)

    def verifier(self, ids: torch.Tensor, drafts: List[int], probs: Optional[torch.Tensor]
                 ) -> Callable[[torch.Tensor], List[Picks]]:
        fed = torch.cat([ids, torch.tensor([drafts], dtype=torch.long)], dim=1)  # [1, seq + k]
        seq = ids.shape[1]

        def score(j: int, logits_j: torch.Tensor) -> torch.Tensor:  # the scores plain decoding would see there
            return self.processors(cast(torch.LongTensor, fed[:, :seq + j]), logits_j[None].float())[0]

        def pick(logits: torch.Tensor) -> List[Picks]:  # logits [1, k + 1, vocab]
            accepted = accept_drafts(drafts, logits[0], score, self.greedy, None, probs)
            return [(torch.tensor([token]), step_scores[None]) for token, step_scores in accepted]

        return pick

    def tokens(self, picks: Picks) -> List[int]:
        return picks[0].tolist()

    def take(self, ids: torch.Tensor, picks: Picks, logits: torch.Tensor) -> None:
        step_scores = picks[1]
        if self.scores is not None:
            self.scores.append(step_scores)
        if self.raw_logits is not None:
            self.raw_logits.append(logits.float())
        last = ids[:, -1]  # [rows] (finished rows: padding)
        if self.streamer is not None:
            self.streamer.put(last.clone())
        if len(self.eos_ids):
            self.done |= torch.isin(last, self.eos_ids)
        if len(self.criteria):
            self.done |= self.criteria(cast(torch.LongTensor, ids), step_scores).to(self.done.device)
        self.finished = self.done.tolist()

    def retract(self, retracted: OutputsRetracted, ids: torch.Tensor) -> torch.Tensor:
        per_token = [values for values in (self.scores, self.raw_logits) if values is not None]
        ids, self.done = retracted.retract(ids, self.prompt_len, self.eos_ids, *per_token)
        self.finished = self.done.tolist()
        return ids

    def before_step(self) -> None:
        pass

    def after_step(self, ids: torch.Tensor, positions: int) -> None:
        pass


@torch.inference_mode()
def generate(model: Any, input_ids: torch.Tensor, *, session: Any = None,
             attention_mask: Optional[torch.Tensor] = None, generation_config: Optional[GenerationConfig] = None,
             logits_processor: Optional[LogitsProcessorList] = None,
             stopping_criteria: Optional[StoppingCriteriaList] = None, streamer=None, tokenizer=None,
             **kwargs) -> Union[torch.Tensor, "GenerateDecoderOnlyOutput", "GenerateBeamDecoderOnlyOutput"]:
    """`DistributedModelForCausalLM.generate` (its docstring) for `model`."""
    spec = SpeculativeConfig.of(kwargs.pop("speculative", None), kwargs.pop("num_draft_tokens", None),
                                kwargs.pop("draft_model", None))
    if input_ids is None or input_ids.ndim != 2 or input_ids.shape[1] == 0:
        raise ValueError("input_ids must be a non-empty [batch, seq] tensor")
    padding = left_padding(attention_mask, input_ids)
    config = resolve_generation_config(model.generation_config, generation_config, kwargs)
    if getattr(config, "prompt_lookup_num_tokens", None):  # transformers' prompt lookup: n-gram drafts here
        spec = spec or SpeculativeConfig("ngram", min(int(config.prompt_lookup_num_tokens), MAX_DRAFT_TOKENS))
    beams = int(config.num_beams or 1)
    if beams > 1 and streamer is not None:
        raise ValueError("`streamer` cannot be used with beam search (as in transformers); use num_beams=1")
    if config.num_return_sequences not in (None, 1) and beams == 1:  # validate() rejected it without sampling
        input_ids = input_ids.repeat_interleave(int(config.num_return_sequences), dim=0)
        padding = None if padding is None else [p for p in padding for _ in range(config.num_return_sequences)]
    prompt_len = input_ids.shape[1]
    max_new = config.max_new_tokens if config.max_new_tokens is not None else config.max_length - prompt_len
    params = SamplingParams.from_generation_config(config, max(max_new, 0))
    # beam sampling keeps one token more than there are end-of-sequence ids, as transformers
    eos_list = [] if config.eos_token_id is None else torch.tensor(config.eos_token_id).reshape(-1).tolist()
    processors = build_processors(params, prompt_len, custom=logits_processor,
                                  min_tokens_to_keep=len(eos_list) + 1 if beams > 1 else 1)
    criteria = stopping_criteria_for(config, stopping_criteria, tokenizer, prompt_len + max_new if beams > 1 else None)
    want_scores, want_logits = bool(config.output_scores), bool(config.output_logits)
    scores: List[torch.Tensor] = []
    raw_logits: List[torch.Tensor] = []

    def result(ids: torch.Tensor) -> Union[torch.Tensor, "GenerateDecoderOnlyOutput"]:
        if not config.return_dict_in_generate:
            return ids
        from transformers.generation.utils import GenerateDecoderOnlyOutput
        return GenerateDecoderOnlyOutput(sequences=cast(torch.LongTensor, ids),
                                         scores=cast(Any, tuple(scores)) if want_scores else None,
                                         logits=cast(Any, tuple(raw_logits)) if want_logits else None)

    if max_new <= 0:
        return result(input_ids)
    eos_ids = torch.tensor(eos_list, dtype=torch.long)
    pad = config.pad_token_id if config.pad_token_id is not None else (eos_list[0] if eos_list else 0)

    own_session = session is None
    if session is None:
        session = model.inference_session(max_length=prompt_len + max_new)
    elif prompt_len + max_new - 1 > session.max_length:
        raise SessionError(f"prompt ({prompt_len}) + max_new_tokens ({max_new}) exceeds the session's max_length "
                           f"{session.max_length}")
    try:
        if beams > 1:
            config.max_length = prompt_len + max_new
            from swarm.client.decoding.beam import beam_search  # (transformers' generation utils: imported on use)
            with session.unverified():  # no spot-checks while beams reorder the rows every step
                return beam_search(session, input_ids, padding, config, processors, criteria,
                                   torch.tensor(eos_list) if eos_list else None, config.pad_token_id)
        speculator = None
        if spec is not None and input_ids.shape[0] == 1 and padding is None:
            speculator = Speculator(spec, int(model.config.vocab_size), eos_list,
                                    getattr(model.config, "sliding_window", None))
            model.last_speculation = speculator.length  # its acceptance counts (benchmarks read them)
        if streamer is not None:
            streamer.put(input_ids.cpu())
        policy = TransformersPolicy(processors, build_processors(params, prompt_len), params.greedy,
                                    input_ids.shape[0], prompt_len, eos_ids, criteria, streamer,
                                    scores if want_scores else None, raw_logits if want_logits else None)
        extra = {} if padding is None else {"left_padding": padding}

        def feed(ids: torch.Tensor, pick: Any, num_logits: int, first: bool) -> Tuple[torch.Tensor, Any]:
            return session.feed_and_pick(ids, pick, **(dict(extra, num_logits=num_logits) if num_logits > 1
                                                       else extra))

        try:
            return result(DecodeLoop(session, feed, policy, prompt_len, max_new, pad, speculator).run(input_ids))
        finally:
            if streamer is not None:
                streamer.end()
    finally:
        if own_session:
            session.close()
