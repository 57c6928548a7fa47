"""Tiny random checkpoints per family, built and saved by the tests: a few blocks, a small hidden size, and a real
tokenizer (the bundled SmolLM2's files, with its chat template; the vocabulary sized to match it).

`save_tiny` writes the checkpoint as transformers' `save_pretrained` does (for Mixtral: the hub's per-expert
tensor names), optionally sharded with `model.safetensors.index.json`, or with Mixtral's experts in the fused
layout of transformers 5's modules (`layout="fused"`: the model's own state dict). It returns the transformers
model, the local reference.
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Optional

import torch

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")
VOCAB = 49152  # the bundled tokenizer's
TINY = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=256, bos_token_id=1, eos_token_id=2, pad_token_id=2)
EXPERTS = ("mixtral", "qwen3_moe", "gpt_oss", "deepseek_v3")  # transformers' eager experts: the op order we follow


def tiny_config(family: str, **overrides):
    from transformers import AutoConfig

    values = dict(TINY)
    if family == "mixtral":
        values.update(num_local_experts=4, num_experts_per_tok=2)
    if family == "mistral":
        values.update(sliding_window=None)
    values.update(overrides)
    config = AutoConfig.for_model(family, **values)
    # Gemma 2's soft-capped and GPT-OSS's sinks attention are transformers' eager one
    config._attn_implementation = "eager" if family in ("gemma2", "gpt_oss") else "sdpa"
    if family in EXPERTS:
        config._experts_implementation = "eager"
    return config


def save_tiny(family: str, path: Path, tokenizer_dir: Optional[str], layout: str = "hub",
              max_shard_size: Optional[str] = None, seed: int = 0, chat_template: bool = True, **overrides):
    """Build a random `family` model, save it (and the tokenizer from `tokenizer_dir`, if given) to `path`; return
    it (eval mode, float32). `overrides`: config values (e.g. `sliding_window=8`, a smaller `vocab_size`)."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    reference = AutoModelForCausalLM.from_config(tiny_config(family, **overrides)).eval()
    if family in EXPERTS:
        reference.set_experts_implementation("eager")  # transformers' per-expert loop: the op order we follow
    path = Path(path)
    if max_shard_size is not None:
        reference.save_pretrained(path, max_shard_size=max_shard_size)
    else:
        reference.save_pretrained(path)
    if layout == "fused":
        save_fused(reference, path)
    elif layout != "hub":
        raise ValueError(f"unknown layout {layout!r}")
    for name in TOKENIZER_FILES if tokenizer_dir is not None else ():
        if name == "chat_template.jinja" and not chat_template:
            continue  # a tokenizer without a chat template (the bundled one keeps it in this file only)
        source = Path(tokenizer_dir) / name
        if source.is_file():
            shutil.copy(source, path / name)
    return reference


def save_fused(reference, path: Path) -> None:
    """`reference`'s tensors under the modules' own names (fused experts) at `path`, one file, no index."""
    from safetensors.torch import save_file

    for stale in list(Path(path).glob("model*.safetensors*")):
        stale.unlink()
    state = {k: v.contiguous() for k, v in reference.state_dict().items()}
    if reference.config.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    save_file(state, str(Path(path) / "model.safetensors"), metadata={"format": "pt"})


def tensor_names(path: Path) -> list:
    """The tensor names a saved checkpoint holds (all its safetensors files)."""
    from safetensors import safe_open

    names = []
    for file in sorted(Path(path).glob("*.safetensors")):
        with safe_open(str(file), framework="pt") as f:
            names.extend(f.keys())
    return names


def shard_files(path: Path) -> list:
    """The shard file names of a sharded checkpoint, from its index."""
    index = json.loads((Path(path) / "model.safetensors.index.json").read_text())
    return sorted(set(index["weight_map"].values()))
