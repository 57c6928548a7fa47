"""The client's local layers, as an inference session uses them: the embeddings (and their norm, where the family
norms them: BLOOM), the final norm and the LM head.

`ClientHead` holds the client model's own modules (no copies: `DistributedModelForCausalLM` owns them as its
`nn.Module` children and moves them with `.to()`), so that a session (`swarm.client.model.model_session.ModelSession`)
needs only these and the swarm manager, never the whole model. `head_rows` is the batched LM head: the last states
of concurrent sessions' steps in one pass on the client's compute thread, each with its own pick.
"""
from __future__ import annotations

from typing import Any, Callable, List, Optional, Tuple

import torch
from torch import nn

from swarm.modeling.smallgemm import SmallGemm


class ClientHead:
    def __init__(self, embed_tokens: nn.Embedding, norm: nn.Module, lm_head: nn.Linear, hidden_size: int,
                 embed_norm: Optional[nn.Module] = None):
        self.embed_tokens, self.norm, self.lm_head, self.embed_norm = embed_tokens, norm, lm_head, embed_norm
        self.hidden_size = hidden_size
        self.gemm: Optional[SmallGemm] = None  # concurrent sessions' head rows (`from_pretrained`)

    @property
    def dtype(self) -> torch.dtype:
        return self.embed_tokens.weight.dtype

    @property
    def device(self) -> torch.device:
        return self.embed_tokens.weight.device

    @torch.no_grad()
    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """[batch, seq] -> [batch, seq, hidden]: what the first block takes (the embeddings, normed where the
        family norms them)."""
        hidden = self.embed_tokens(input_ids.to(self.device))
        return hidden if self.embed_norm is None else self.embed_norm(hidden)

    @torch.no_grad()
    def head(self, hidden: torch.Tensor) -> torch.Tensor:
        """[batch, seq, hidden] (or [rows, hidden]) from the last block -> logits [batch, seq, vocab] (or [rows,
        vocab]), float32, on the CPU. Rows of concurrent sessions may be padded to the count the BLAS runs
        fastest, or run on the head's weight packed for them (`swarm.modeling.smallgemm`)."""
        normed = self.norm(hidden.to(self.device, self.dtype))
        gemm = self.gemm
        if gemm is not None and normed.ndim == 2 and normed.device.type == "cpu" and \
                normed.dtype == torch.float32 and self.lm_head.weight.data_ptr() == gemm.weight.data_ptr():
            return gemm(normed).float().cpu()
        return self.lm_head(normed).float().cpu()

    def head_rows(self, items: List[Tuple[torch.Tensor, Optional[Callable[[torch.Tensor], Any]]]]) -> list:
        """LM head for several sessions' last states in one pass, then each session's token choice.

        items: (last states [b_i, hidden], pick or None) each; returns (logits [b_i, vocab], pick(logits) or
        None) each."""
        rows = [x for x, _ in items]
        logits = self.head(torch.cat(rows) if len(rows) > 1 else rows[0])  # [sum b_i, vocab]
        parts = torch.split(logits, [x.shape[0] for x in rows])
        return [(part, _try(pick, part)) for part, (_, pick) in zip(parts, items)]


def _try(pick, logits: torch.Tensor):
    """pick(logits), its error as the result (one session's failure must not fail the batch), or None."""
    if pick is None:
        return None
    try:
        return pick(logits)
    except Exception as e:
        return e
