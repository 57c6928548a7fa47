"""Prompt tuning on the client and the client model's differentiable forward pass.

`from_pretrained(..., tuning_mode="ptune" | "deep_ptune", pre_seq_len=N)` gives the model a `PromptTuning`
module (`model.ptune`), the only trainable parameters unless the user adds modules of their own:
- `ptune`: `prompts` [N, hidden], prepended to the input embeddings of every sequence;
- `deep_ptune`: also `deep_prompts` [num_blocks, N, hidden], sent to the servers with each training pass and
  added there to the first N positions of each block's input (Petals' convention); they start at zero.

`trainable_forward(model, input_ids | inputs_embeds)` is `model(...)` when it must be differentiable (prompts,
a trainable module, or inputs that require grad): embeddings, `swarm.client.transport.remote_autograd.RemoteBlocks`,
final norm and LM head in the caller's thread, under autograd; the prompt positions are dropped from the output.

Trained prompts serve generation too: the input prompts go in front of an inference session's first step
(`ModelSession` shifts its positions by N) and the deep prompts travel once per server, with its `OpenSession`
(the servers add them to the prompt positions of each block's input, as in training). `save` / `load` write and
read the prompts with their mode (safetensors).
"""
from __future__ import annotations

from typing import Any, Optional, Tuple

import torch
from torch import nn

from swarm.client.transport.remote_autograd import RemoteBlocks

# the client model (`swarm.client.model.causal_lm.DistributedModelForCausalLM`, which imports this module)
DistributedModel = Any

TUNING_MODES = ("ptune", "deep_ptune")


class PromptTuning(nn.Module):
    def __init__(self, mode: str, pre_seq_len: int, hidden_size: int, num_blocks: int,
                 init: Optional[torch.Tensor] = None, dtype: torch.dtype = torch.float32):
        super().__init__()
        if mode not in TUNING_MODES:
            raise ValueError(f"tuning_mode {mode!r}: choose one of {', '.join(TUNING_MODES)}")
        if pre_seq_len <= 0:
            raise ValueError(f"tuning_mode {mode} needs pre_seq_len > 0, got {pre_seq_len}")
        self.mode, self.pre_seq_len = mode, pre_seq_len
        start = init if init is not None else torch.randn(pre_seq_len, hidden_size) * 0.02
        self.prompts = nn.Parameter(start.detach().clone().to(dtype))  # [pre_seq_len, hidden]
        self.deep_prompts: Optional[nn.Parameter] = None
        if mode == "deep_ptune":  # [num_blocks, pre_seq_len, hidden]
            self.deep_prompts = nn.Parameter(torch.zeros(num_blocks, pre_seq_len, hidden_size, dtype=dtype))

    def input_prompts(self, batch: int) -> torch.Tensor:
        """[batch, pre_seq_len, hidden]"""
        return self.prompts.unsqueeze(0).expand(batch, -1, -1)

    def block_prompts(self) -> Optional[torch.Tensor]:
        """[num_blocks, 1, pre_seq_len, hidden] (the same for every row), or None for shallow prompts."""
        return None if self.deep_prompts is None else self.deep_prompts.unsqueeze(1)

    def save(self, path: str) -> None:
        from safetensors.torch import save_file

        tensors = {name: t.detach().contiguous().cpu() for name, t in self.state_dict().items()}
        save_file(tensors, path, metadata={"mode": self.mode, "pre_seq_len": str(self.pre_seq_len)})

    def load(self, path: str) -> None:
        """Prompts saved by `save`; ValueError when their mode or shapes differ from this model's."""
        from safetensors import safe_open

        with safe_open(path, framework="pt") as f:
            metadata = f.metadata() or {}
            tensors = {name: f.get_tensor(name) for name in f.keys()}
        if metadata.get("mode") != self.mode or metadata.get("pre_seq_len") != str(self.pre_seq_len):
            raise ValueError(f"{path} holds {metadata.get('mode')} prompts of length {metadata.get('pre_seq_len')}; "
                             f"this model tunes {self.mode} of length {self.pre_seq_len}")
        own = self.state_dict()
        for name, tensor in tensors.items():
            if name not in own or own[name].shape != tensor.shape:
                raise ValueError(f"{path}: {name} {list(tensor.shape)} does not fit this model")
        self.load_state_dict(tensors)


def make_prompt_tuning(model: DistributedModel, mode: str, pre_seq_len: int) -> PromptTuning:
    """Prompts initialised from the embeddings of random vocabulary tokens (a common start for soft prompts)."""
    ids = torch.randint(0, model.embed_tokens.num_embeddings, (pre_seq_len,))
    init = model.embed_tokens.weight.detach()[ids].cpu()
    return PromptTuning(mode, pre_seq_len, model.config.hidden_size, model.config.num_hidden_layers, init,
                        model.dtype).to(model.device)


def needs_autograd(model: DistributedModel, inputs_embeds: Optional[torch.Tensor]) -> bool:
    """Whether `model(...)` takes the differentiable path (`trainable_forward`)."""
    if model.ptune is not None or inputs_embeds is not None:
        return True
    return torch.is_grad_enabled() and any(p.requires_grad for p in model.parameters())


def trainable_hidden(model: DistributedModel, input_ids: Optional[torch.Tensor],
                     inputs_embeds: Optional[torch.Tensor], adapter: Optional[str] = None) -> torch.Tensor:
    """Final-norm states [batch, seq, hidden] of the input positions (the prompts' dropped), differentiable with
    respect to `inputs_embeds`, the prompts and any trainable client module; through the servers' LoRA `adapter`
    (None: the base model)."""
    if inputs_embeds is None:
        if input_ids is None or input_ids.ndim != 2 or input_ids.shape[1] == 0:
            raise ValueError("input_ids must be a non-empty [batch, seq] tensor")
        inputs_embeds = model.embed_tokens(input_ids.to(model.device))  # [batch, seq, hidden]
    elif inputs_embeds.ndim != 3 or inputs_embeds.shape[-1] != model.config.hidden_size:
        raise ValueError(f"inputs_embeds must be [batch, seq, {model.config.hidden_size}], got "
                         f"{list(inputs_embeds.shape)}")
    hidden = inputs_embeds.to(model.device, model.dtype)
    pre, deep = 0, None
    if model.ptune is not None:
        pre = model.ptune.pre_seq_len
        hidden = torch.cat([model.ptune.input_prompts(hidden.shape[0]), hidden], dim=1)
        deep = model.ptune.block_prompts()
    if model.remote_blocks is None:
        model.remote_blocks = RemoteBlocks(model.manager)
    out = model.remote_blocks(hidden.cpu(), None if deep is None else deep.cpu(), adapter)[:, pre:]
    return model.norm(out.to(model.device))


def trainable_forward(model: DistributedModel, input_ids: Optional[torch.Tensor],
                      inputs_embeds: Optional[torch.Tensor], adapter: Optional[str] = None
                      ) -> Tuple[torch.Tensor, torch.Tensor]:
    """(logits [batch, seq, vocab] (float32), final-norm states [batch, seq, hidden]): `trainable_hidden`, then
    the LM head."""
    normed = trainable_hidden(model, input_ids, inputs_embeds, adapter)
    return model.lm_head(normed).float(), normed
