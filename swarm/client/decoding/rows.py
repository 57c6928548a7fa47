"""What a session's rows hold: left padding from an attention mask, and the prefix of new input the servers keep.

`left_padding(attention_mask)` turns a Hugging Face attention mask `[batch, seq]` of 0/1 into each row's count of
leading padding positions (the servers hide those keys and count the row's positions from its first real token,
as transformers computes `position_ids = cumsum(mask) - 1`); only left padding is accepted (a 0 after a 1 is an
error naming the row), as in transformers' batched generation of decoder-only models.

`held_prefix(held, new)` says how many leading positions of the new input `[batch, n]` the servers already hold
for a session holding `held` `[batch, m]`, and, when another order of the held rows keeps more (the beams of a
beam search left in the session by an earlier `generate`, now continued from its best sequence), the parent row of
each new row (`hypo_ids`: the servers reorder their caches rather than recompute).
"""
from __future__ import annotations

from typing import List, Optional, Tuple

import torch


def left_padding(attention_mask: Optional[torch.Tensor], input_ids: torch.Tensor) -> Optional[List[int]]:
    """Each row's leading padding count from `attention_mask` [batch, seq] (None: no mask or no padding)."""
    if attention_mask is None:
        return None
    if attention_mask.shape != input_ids.shape:
        raise ValueError(f"attention_mask has shape {list(attention_mask.shape)}; input_ids has "
                         f"{list(input_ids.shape)}")
    mask = attention_mask.to(torch.long).cpu()
    if bool(((mask != 0) & (mask != 1)).any()):
        raise ValueError("attention_mask must hold only 0 (padding) and 1 (a real token)")
    pads = (mask.cumsum(dim=1) == 0).sum(dim=1)  # [batch] leading zeros
    for row, pad in enumerate(pads.tolist()):
        if not bool(mask[row, pad:].all()):
            raise ValueError(f"attention_mask row {row} has padding after a real token: only left padding is "
                             "supported (set the tokenizer's padding_side='left')")
        if pad == mask.shape[1]:
            raise ValueError(f"attention_mask row {row} has no real token")
    return pads.tolist() if bool(pads.any()) else None


def held_prefix(held: Optional[torch.Tensor], new: torch.Tensor) -> Tuple[int, Optional[List[int]]]:
    """(positions of `new` [batch, n] the servers can keep, parent row of each new row or None for the same rows).

    At most n - 1 positions are kept: the last token is always sent again, as its logits are needed. The rows are
    matched again only when the same rows keep fewer positions than the best parent of each."""
    if held is None or held.shape[0] != new.shape[0]:
        return 0, None
    n = min(held.shape[1], new.shape[1] - 1)
    if n <= 0:
        return 0, None
    if bool((new[:, :n] == held[:, :n]).all()):  # a decode step: the same rows hold everything
        return n, None
    # common[i, j]: leading positions where new row i equals held row j  [batch, batch]
    equal = new[:, None, :n] == held[None, :, :n]  # [batch, batch, n]
    common = torch.where(equal.all(dim=2), n, (~equal).to(torch.int8).argmax(dim=2))
    same = int(common.diagonal().min())
    if same == n:
        return n, None
    best, parents = common.max(dim=1)  # [batch] each new row's longest match and its held row
    if int(best.min()) <= same:
        return same, None
    return int(best.min()), parents.tolist()
