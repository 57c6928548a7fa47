"""Sequence classification on top of the swarm: a trainable head on the last position's final-norm state.

`AutoDistributedModelForSequenceClassification.from_pretrained(name_or_path, num_labels=N, **kwargs)` wraps the
causal client model (`swarm.client.model.causal_lm`; the same keyword arguments, `tuning_mode` / `pre_seq_len` included)
with `score`, a linear layer [hidden -> num_labels] that lives and trains on the client, like transformers'
`LlamaForSequenceClassification`. Sequences are not padded (the client sends equal lengths), so the last position
is each row's last token. The hidden states come from `swarm.client.model.ptune.trainable_hidden`: with prompts, the
gradients of the loss reach them through the swarm as well.
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import nn
from transformers.modeling_outputs import SequenceClassifierOutputWithPast

from swarm.client.model.causal_lm import DistributedModelForCausalLM
from swarm.client.model.ptune import trainable_hidden


class DistributedModelForSequenceClassification(nn.Module):
    def __init__(self, base: DistributedModelForCausalLM, num_labels: int):
        super().__init__()
        if num_labels < 1:
            raise ValueError(f"num_labels must be at least 1, got {num_labels}")
        self.base, self.num_labels = base, num_labels
        self.score = nn.Linear(base.config.hidden_size, num_labels, bias=False, dtype=base.dtype, device=base.device)
        nn.init.normal_(self.score.weight, std=0.02)

    @classmethod
    def from_pretrained(cls, name_or_path: str, *, num_labels: int = 2,
                        **kwargs) -> "DistributedModelForSequenceClassification":
        return cls(DistributedModelForCausalLM.from_pretrained(name_or_path, **kwargs), num_labels)

    def forward(self, input_ids: Optional[torch.Tensor] = None, inputs_embeds: Optional[torch.Tensor] = None,
                labels: Optional[torch.Tensor] = None) -> SequenceClassifierOutputWithPast:
        """logits [batch, num_labels] (and the cross-entropy `loss` when `labels` [batch] are given)."""
        hidden = trainable_hidden(self.base, input_ids, inputs_embeds)  # [batch, seq, hidden]
        logits = self.score(hidden[:, -1]).float()  # [batch, num_labels]
        loss = None
        if labels is not None:
            loss = nn.functional.cross_entropy(logits, labels.to(logits.device))
        return SequenceClassifierOutputWithPast(loss=loss, logits=logits)

    def close(self) -> None:
        """Stop the base model's DHT process and p2pd (`DistributedModelForCausalLM.close`)."""
        self.base.close()

    shutdown = close

    def __enter__(self) -> "DistributedModelForSequenceClassification":
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()


class AutoDistributedModelForSequenceClassification:
    """Picks the classification model for a checkpoint's family (all supported families share one class)."""

    @staticmethod
    def from_pretrained(name_or_path: str, **kwargs) -> DistributedModelForSequenceClassification:
        return DistributedModelForSequenceClassification.from_pretrained(name_or_path, **kwargs)
