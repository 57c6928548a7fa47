"""Beam search through an inference session: transformers' own beam scorer, the swarm's cache reordered in place.

`beam_search` is transformers 5's `GenerationMixin._beam_search` loop with its own helpers
(`_get_top_k_continuations`, `_get_running_beams_for_next_iteration`, `_update_finished_beams`,
`_check_early_stop_heuristic`, `_beam_search_has_unfinished_sequences`, called on a bare `GenerationMixin`), so
`num_beams`, `num_return_sequences`, `length_penalty`, `early_stopping` and beam sampling (`do_sample=True`: the
global RNG, as transformers) give transformers' choices. Where transformers calls `cache.reorder_cache(beam_idx)`
the next step instead carries `beam_idx` as the step's `hypo_ids`: every server reorders the session's cache rows
before running it (`server.compute.cache.SessionKV.reorder`), and the client reorders its failover history the same way.
The logits processors are those of `swarm.client.decoding.sampling.build_processors`, applied as transformers does in
beam search (to the log-softmax of the logits). transformers 5 moved diverse (group) and constrained beam search out
of the library (to Hub `custom_generate` repositories), so they are rejected here (`UNSUPPORTED_GENERATION_SETTINGS`).
"""
from __future__ import annotations

from typing import Any, List, Optional, Protocol, Tuple, Union, cast

import torch
from torch import nn
from transformers.generation.logits_process import LogitsProcessorList
from transformers.generation.stopping_criteria import StoppingCriteriaList
from transformers.generation.utils import GenerateBeamDecoderOnlyOutput, GenerationMixin


class BeamSession(Protocol):
    """What beam search needs of a session (`swarm.client.model.causal_lm.ModelSession`)."""

    def feed(self, input_ids: torch.Tensor, hypo_ids: Optional[List[int]] = None,
             left_padding: Optional[List[int]] = None) -> torch.Tensor: ...  # [rows, seq] -> logits [rows, vocab]


class _BeamOps(GenerationMixin):
    """transformers' beam helpers need only the class's static methods: a bare instance to call them on."""


_OPS = _BeamOps()


@torch.no_grad()
def beam_search(session: BeamSession, input_ids: torch.Tensor, left_padding: Optional[List[int]], config,
                processors: LogitsProcessorList, criteria: StoppingCriteriaList, eos: Optional[torch.Tensor],
                pad_token_id: Optional[int]) -> Union[torch.Tensor, GenerateBeamDecoderOnlyOutput]:
    """Beam search from `input_ids` [batch, prompt] (rows left-padded by `left_padding`) through `session`, which
    holds batch * num_beams rows. `config`: the `GenerationConfig` (its `max_length` = prompt + new tokens);
    `criteria`: transformers' full list (max length and eos included); `eos`: [n] end-of-sequence ids or None.
    Returns [batch * num_return_sequences, prompt + generated] ids, or the `GenerateBeamDecoderOnlyOutput`."""
    do_sample, early_stopping, length_penalty = config.do_sample, config.early_stopping, config.length_penalty
    max_length, num_beams, num_return_sequences = config.max_length, config.num_beams, config.num_return_sequences
    if config.low_memory:
        raise ValueError("`low_memory=True` is not supported by beam search (transformers 5 dropped it too)")
    as_dict = bool(config.return_dict_in_generate)
    want_scores, want_logits = as_dict and bool(config.output_scores), as_dict and bool(config.output_logits)
    batch_size, cur_len = input_ids.shape
    decoder_prompt_len = cur_len
    flat = input_ids.repeat_interleave(num_beams, dim=0)  # [batch * num_beams, prompt], as transformers expands
    padding = None if left_padding is None else [p for p in left_padding for _ in range(num_beams)]

    n_eos = eos.shape[0] if eos is not None else 0
    beams_to_keep = max(2, 1 + n_eos) * num_beams
    top_num_beam_mask = torch.cat((torch.ones(num_beams, dtype=torch.bool),
                                   torch.zeros(beams_to_keep - num_beams, dtype=torch.bool)))
    all_scores: Any = () if want_scores else None
    raw_logits: Any = () if want_logits else None

    fill = pad_token_id or int(eos[0]) if eos is not None else -1  # transformers' own precedence
    running_sequences = torch.full((batch_size, num_beams, max_length), fill_value=fill, dtype=torch.int64)
    running_sequences[:, :, :cur_len] = flat.view(batch_size, num_beams, cur_len)
    sequences = running_sequences.clone()
    running_beam_scores = torch.zeros((batch_size, num_beams), dtype=torch.float)
    running_beam_scores[:, 1:] = -1e9
    beam_scores = torch.full((batch_size, num_beams), fill_value=-1e9, dtype=torch.float)
    is_sent_finished = torch.zeros((batch_size, num_beams), dtype=torch.bool)
    is_early_stop_heuristic_unsatisfied = torch.ones((batch_size, 1), dtype=torch.bool)
    running_beam_indices = torch.full((batch_size, num_beams, max_length - cur_len), fill_value=-1, dtype=torch.int32)
    beam_indices = running_beam_indices.clone()

    hypo_ids: Optional[List[int]] = None
    while True:
        flat_running = running_sequences[:, :, :cur_len].reshape(batch_size * num_beams, cur_len)
        logits = session.feed(flat_running, hypo_ids=hypo_ids, left_padding=padding).float()  # [rows, vocab]
        log_probs = processors(cast(torch.LongTensor, flat_running), nn.functional.log_softmax(logits, dim=-1))
        if want_logits:
            raw_logits += (logits.clone(),)
        if want_scores:
            all_scores += (log_probs.clone(),)
        log_probs = log_probs.view(batch_size, num_beams, -1) + running_beam_scores[:, :, None]
        log_probs = log_probs.reshape(batch_size, -1)  # [batch, num_beams * vocab]

        topk_log_probs, topk_running_sequences, topk_running_beam_indices = _OPS._get_top_k_continuations(
            accumulated_log_probs=log_probs, running_sequences=running_sequences,
            running_beam_indices=running_beam_indices, cur_len=cur_len, decoder_prompt_len=decoder_prompt_len,
            do_sample=do_sample, beams_to_keep=beams_to_keep, num_beams=num_beams, batch_size=batch_size)
        hits = criteria(cast(torch.LongTensor, topk_running_sequences[:, :, :cur_len + 1].reshape(
            batch_size * beams_to_keep, cur_len + 1)), all_scores)
        hits = hits.view(batch_size, beams_to_keep)
        running_sequences, running_beam_scores, running_beam_indices = _OPS._get_running_beams_for_next_iteration(
            topk_log_probs=topk_log_probs, topk_running_sequences=topk_running_sequences,
            topk_running_beam_indices=topk_running_beam_indices, next_token_hits_stopping_criteria=hits,
            num_beams=num_beams)
        sequences, beam_scores, beam_indices, is_sent_finished = _OPS._update_finished_beams(
            sequences=sequences, topk_running_sequences=topk_running_sequences, beam_scores=beam_scores,
            topk_log_probs=topk_log_probs, beam_indices=beam_indices,
            topk_running_beam_indices=topk_running_beam_indices,
            is_early_stop_heuristic_unsatisfied=is_early_stop_heuristic_unsatisfied,
            is_sent_finished=is_sent_finished, next_token_hits_stopping_criteria=hits,
            top_num_beam_mask=top_num_beam_mask, num_beams=num_beams, cur_len=cur_len,
            decoder_prompt_len=decoder_prompt_len, length_penalty=length_penalty, early_stopping=early_stopping)
        # transformers' `cache.reorder_cache(beam_idx)`: the next step's parents, flat over batch * num_beams
        hypo_ids = running_beam_indices[..., cur_len - decoder_prompt_len].reshape(-1).tolist()
        cur_len += 1
        is_early_stop_heuristic_unsatisfied = _OPS._check_early_stop_heuristic(
            is_early_stop_heuristic_unsatisfied=is_early_stop_heuristic_unsatisfied,
            running_beam_scores=running_beam_scores, beam_scores=beam_scores, is_sent_finished=is_sent_finished,
            cur_len=cur_len, max_length=max_length, decoder_prompt_len=decoder_prompt_len,
            early_stopping=early_stopping, length_penalty=length_penalty)
        if not _OPS._beam_search_has_unfinished_sequences(is_early_stop_heuristic_unsatisfied, is_sent_finished, hits,
                                                          early_stopping):
            break

    sequences, beam_scores, beam_indices = _best(sequences, beam_scores, beam_indices, num_return_sequences)
    max_generated = ((beam_indices + 1).bool()).sum(dim=1).max()
    sequences = sequences[:, :decoder_prompt_len + max_generated]
    if not as_dict:
        return sequences
    return GenerateBeamDecoderOnlyOutput(
        sequences=cast(torch.LongTensor, sequences), sequences_scores=beam_scores if config.output_scores else None,
        scores=all_scores, logits=raw_logits, beam_indices=cast(torch.LongTensor, beam_indices[:, :max_generated]))


def _best(sequences: torch.Tensor, scores: torch.Tensor, indices: torch.Tensor, n: int
          ) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The best `n` finished beams of each batch item (sorted best first), flattened to [batch * n, ...]."""
    return (sequences[:, :n].flatten(0, 1), scores[:, :n].flatten(0, 1), indices[:, :n].flatten(0, 1))
