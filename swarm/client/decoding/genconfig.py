"""A `generate` call's settings: its `GenerationConfig` resolved as transformers resolves it, and its stopping
criteria.

`resolve_generation_config` deep-copies the given config (or the model's), fills unset fields from the model's
generation config and transformers' global defaults, applies the call's keyword arguments (an unknown one is a
`TypeError`) and runs transformers' own `validate()`. `stopping_criteria_for` builds transformers' criteria for
`max_time` and `stop_strings` (and, for beam search, max length and end-of-sequence ids, which greedy and sampling
check in their own loop), merged with a user's `stopping_criteria` as transformers merges them.
"""
from __future__ import annotations

import copy
from typing import Optional

import torch
from transformers import GenerationConfig
from transformers.generation.stopping_criteria import (
    EosTokenCriteria,
    MaxLengthCriteria,
    MaxTimeCriteria,
    StoppingCriteriaList,
    StopStringCriteria,
)


def resolve_generation_config(model_config: GenerationConfig, generation_config: Optional[GenerationConfig],
                              kwargs: dict) -> GenerationConfig:
    """The config a `generate(generation_config=..., **kwargs)` call runs with (`model_config`: the model's)."""
    config = copy.deepcopy(generation_config or model_config)
    # as transformers: unset fields come from the model's config, then from transformers' global defaults (say,
    # top_k=50 when sampling)
    config.update(**model_config.to_dict(), defaults_only=True, allow_custom_entries=True)
    defaults = getattr(GenerationConfig, "_get_default_generation_params", None)
    if defaults is not None:
        config.update(**defaults(), defaults_only=True)
    unused = config.update(**kwargs)
    if unused:
        raise TypeError(f"generate() got unexpected arguments: {sorted(unused)}")
    config.validate()  # transformers' own checks (say, greedy with num_return_sequences > 1)
    return config


def stopping_criteria_for(config: GenerationConfig, custom: Optional[StoppingCriteriaList], tokenizer,
                          max_length: Optional[int] = None) -> StoppingCriteriaList:
    """transformers' stopping criteria for `max_time` and `stop_strings`; with `max_length` (beam search) also its
    max-length and end-of-sequence criteria, in transformers' order; then a user's `stopping_criteria` merged: one
    replaces the criterion of its type, the others follow."""
    criteria = StoppingCriteriaList()
    if max_length is not None:
        criteria.append(MaxLengthCriteria(max_length=max_length))
    if config.max_time is not None:
        criteria.append(MaxTimeCriteria(max_time=config.max_time))
    if config.stop_strings is not None:
        if tokenizer is None:
            raise ValueError("generate(): `stop_strings` needs the model's tokenizer: pass `tokenizer=` to generate")
        criteria.append(StopStringCriteria(stop_strings=config.stop_strings, tokenizer=tokenizer))
    if max_length is not None and config.eos_token_id is not None:
        criteria.append(EosTokenCriteria(eos_token_id=torch.tensor(config.eos_token_id).reshape(-1)))
    for extra in custom or []:
        same = [i for i, c in enumerate(criteria) if type(c) is type(extra)]
        if same:
            criteria[same[0]] = extra
        else:
            criteria.append(extra)
    return criteria
