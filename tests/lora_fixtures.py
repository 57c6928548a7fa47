"""LoRA adapters for the tests: built with `peft` for the bundled model, and their local references.

`make_adapter` wraps a fresh copy of the model with `peft.get_peft_model`, fills the LoRA A/B matrices with
seeded random non-zero values (so the adapter changes the model's output) and saves it in peft's format.
`peft_reference` loads saved adapters onto one local transformers model (`PeftModel.from_pretrained`,
`load_adapter`), which the tests generate with per adapter, and with the adapters disabled for the base.
"""
from __future__ import annotations

from pathlib import Path
from typing import Dict, Sequence

import torch

TARGETS = ("q_proj", "v_proj", "gate_proj", "up_proj", "down_proj")


def make_adapter(model_path: str, out_dir: Path, seed: int, targets: Sequence[str] = TARGETS, r: int = 8,
                 alpha: float = 16, std: float = 0.05, **config) -> Path:
    """Save a peft LoRA adapter for the model at `model_path` into `out_dir`; returns `out_dir`."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
    lora = LoraConfig(r=r, lora_alpha=alpha, target_modules=list(targets), lora_dropout=0.0, task_type="CAUSAL_LM",
                      **config)
    model = get_peft_model(base, lora)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_" in name:
                param.copy_(torch.randn(param.shape, generator=generator) * std)
    model.save_pretrained(str(out_dir))
    return out_dir


def peft_reference(model_path: str, adapters: Dict[str, Path]):
    """A local transformers model with every adapter of `adapters` (name -> directory) loaded through peft."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).eval()
    names = list(adapters)
    model = PeftModel.from_pretrained(base, str(adapters[names[0]]), adapter_name=names[0])
    for name in names[1:]:
        model.load_adapter(str(adapters[name]), adapter_name=name)
    return model.eval()


@torch.no_grad()
def reference_generate(model, input_ids: torch.Tensor, max_new_tokens: int, adapter=None) -> torch.Tensor:
    """Greedy ids [batch, prompt + new] from the peft model with `adapter` active (None: adapters disabled)."""
    kwargs = dict(max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=0)
    if adapter is None:
        with model.disable_adapter():
            return model.generate(input_ids=input_ids, **kwargs)
    model.set_adapter(adapter)
    return model.generate(input_ids=input_ids, **kwargs)
