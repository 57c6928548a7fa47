"""Reading LoRA adapters in peft's format, and checking each against the base model at server start.

An adapter is a directory (or hub repo) as `peft` saves it: `adapter_config.json` (parsed by `peft.LoraConfig`)
and `adapter_model.safetensors`, whose tensors are named `base_model.model.model.layers.{i}.self_attn.q_proj.
lora_A.weight` ([r, in]) and `...lora_B.weight` ([out, r]). `open_adapter` reads the config and the safetensors
header (names and shapes, no tensor data) and checks the whole adapter against the base model: every tensor must be
a LoRA A/B pair of a Llama projection (q/k/v/o, gate/up/down; Phi-3's fused qkv_proj and gate_up_proj instead of its
parts; BLOOM's and Falcon's query_key_value, dense, dense_h_to_4h, dense_4h_to_h; q/k/v/o on Mixtral, Qwen3-MoE and
GPT-OSS; DeepSeek-V3's latent attention's projections, its dense MLP's and shared experts') that the config targets,
with the configured rank and the base model's shapes, for a block the model has, or of an experts' stacked
parameter that the config's `target_parameters` name (`swarm.modeling.lora_experts`). Features not implemented
(DoRA, LoRA biases, trained base biases, `modules_to_save`, ...) are rejected with an error naming them. The result,
`AdapterFiles`, names every (block, target) the adapter adapts; `swarm.modeling.lora.SpanAdapter.load` then reads
only the tensors of one span's blocks. Also the adapter names (`--adapters` entries, `check_adapter_name`) as they
travel in records, messages and model ids.
"""
from __future__ import annotations

import json
import logging
import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, List, Optional, Tuple

from swarm.modeling.families import family_for
from swarm.modeling.lora_experts import EXPERT_KEY, ExpertTarget, expert_targets, unsupported_parameters
from swarm.modeling.lora_targets import target_shapes
from swarm.modeling.shape import ModelShape

logger = logging.getLogger(__name__)

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
_KEY = re.compile(r"^(?:base_model\.model\.)?(?:model\.|transformer\.)?(?:layers|h)\.(\d+)\."
                  r"(self_attn|self_attention|mlp)\.((?:shared_experts\.)?[a-z_0-9]+)"
                  r"\.lora_([AB])\.weight$")
ADAPTERS_HELP = ("LoRA adapters to serve on the blocks (users choose one per request): each a local directory or a "
                 "hub repo id in peft's format (adapter_config.json + adapter_model.safetensors), optionally "
                 "NAME=PATH_OR_REPO; named by the repo id or the directory's name otherwise")
MAX_NAME_LEN = 128
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._/-]*$")


class AdapterError(ValueError):
    """An adapter that cannot be served on this model (missing, malformed, for another model, unsupported)."""


@dataclass(frozen=True)
class AdapterSource:
    """`--adapters` entry: `NAME=PATH_OR_REPO`, or a path (named by its directory) or a hub repo id (named by it)."""

    name: str
    location: str

    @classmethod
    def parse(cls, text: str) -> "AdapterSource":
        text = text.strip()
        name, sep, location = text.partition("=")
        if not sep:
            location = text
            local = Path(text).exists() or text.startswith((".", "/", "~"))
            name = Path(text).expanduser().resolve().name if local else text.rstrip("/")
        if not location:
            raise AdapterError(f"adapter {text!r}: empty path")
        check_adapter_name(name)
        return cls(name, location)


def check_adapter_name(name: str) -> str:
    """An adapter name as it travels in records, messages and model ids; AdapterError otherwise."""
    if not (0 < len(name) <= MAX_NAME_LEN) or not _NAME.match(name):
        raise AdapterError(f"adapter name {name!r} must be 1-{MAX_NAME_LEN} characters of letters, digits and ._/- "
                           f"(give one with NAME=PATH)")
    return name


def _parse_config(path: Path, where: str):
    """`peft.LoraConfig` of `adapter_config.json` at `path` (peft's own parsing and defaults)."""
    from peft import LoraConfig, PeftType

    try:
        raw = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise AdapterError(f"{where}: cannot read {CONFIG_FILE}: {e}") from None
    if not isinstance(raw, dict):
        raise AdapterError(f"{where}: {CONFIG_FILE} is not a JSON object")
    if raw.get("peft_type", "LORA") != PeftType.LORA.value:
        raise AdapterError(f"{where}: peft_type {raw.get('peft_type')!r} is not LORA (only LoRA adapters are served)")
    try:
        config = LoraConfig.from_pretrained(str(path.parent))
    except Exception as e:  # peft raises TypeError / ValueError for unknown or inconsistent fields
        raise AdapterError(f"{where}: {CONFIG_FILE} is not a valid LoraConfig: {type(e).__name__}: {e}") from None
    unsupported = []
    if getattr(config, "use_dora", False):
        unsupported.append("use_dora (DoRA)")
    if getattr(config, "lora_bias", False):
        unsupported.append("lora_bias")
    if config.bias != "none":
        unsupported.append(f"bias={config.bias!r} (trained base biases)")
    if config.modules_to_save:
        unsupported.append(f"modules_to_save {list(config.modules_to_save)}")
    odd = unsupported_parameters(getattr(config, "target_parameters", None) or [])
    if odd:
        unsupported.append(f"target_parameters {odd} (LoRA on parameters other than the experts' stacked "
                           f"gate_up_proj and down_proj)")
    for name in ("layer_replication", "trainable_token_indices", "alora_invocation_tokens",
                 "use_bdlora", "arrow_config", "kasa_config", "monteclora_config", "velora_config"):
        if getattr(config, name, None):
            unsupported.append(name)
    if getattr(config, "use_qalora", False):
        unsupported.append("use_qalora")
    if unsupported:
        raise AdapterError(f"{where}: this server does not implement {', '.join(unsupported)}")
    if config.fan_in_fan_out:
        # as peft does for nn.Linear targets: the flag only concerns Conv1D base weights; lora_A/B are unaffected
        logger.warning(f"{where}: fan_in_fan_out=True is ignored for Linear projections (as peft does)")
    return config


def _pattern_value(patterns: Dict[str, int | float], key: str, default):
    """peft's rank_pattern / alpha_pattern lookup for module `key` (peft's own matcher)."""
    if not patterns:
        return default
    from peft.utils.other import get_pattern_key

    return patterns.get(get_pattern_key(list(patterns.keys()), key), default)


@dataclass(frozen=True)
class TargetSpec:
    """One adapted projection of one block: its tensors' names, rank and scaling."""

    block: int
    target: str
    a_key: str
    b_key: str
    rank: int
    scaling: float
    module: str = ""  # its parent module ("self_attn", "mlp")


@dataclass
class AdapterFiles:
    """An adapter checked against a base model: its config, weights file and every (block, target) it adapts."""

    name: str
    config: object  # peft.LoraConfig
    weights: Path
    targets: Dict[Tuple[int, str], TargetSpec] = field(default_factory=dict)
    # (block, "gate_up_proj" / "down_proj") -> the experts' stacked parameter it adapts (`target_parameters`)
    experts: Dict[Tuple[int, str], ExpertTarget] = field(default_factory=dict)
    model_config: object = None
    grouped: bool = True  # targets grouped by their input (`PROJECTIONS`); False: each its own (DeepSeek-V3)

    def blocks(self) -> List[int]:
        return sorted({block for block, _ in self.targets} | {block for block, _ in self.experts})


def _safetensors_header(path: Path, where: str) -> Dict[str, dict]:
    try:
        with open(path, "rb") as f:
            length = int.from_bytes(f.read(8), "little")
            if not 0 < length < 1 << 28:
                raise ValueError("bad header length")
            header = json.loads(f.read(length))
    except (OSError, ValueError) as e:
        raise AdapterError(f"{where}: {path.name} is not a safetensors file: {e}") from None
    header.pop("__metadata__", None)
    return header


def open_adapter(source: AdapterSource, model_config, cache_dir: Optional[str] = None,
                 max_disk_space: Optional[int] = None) -> AdapterFiles:
    """Find (a local directory, or a hub repo through the disk cache) and check an adapter against the base model
    whose config is `model_config`. Reads the config and the weights' header only. AdapterError on any problem."""
    from swarm.modeling.checkpoint import Checkpoint, CheckpointError

    where = f"adapter {source.name!r} ({source.location})"
    location = Path(source.location)
    if location.exists() and not location.is_dir():
        raise AdapterError(f"{where}: not a directory")
    if not location.exists() and (source.location.startswith((".", "/", "~")) or source.location.count("/") != 1):
        raise AdapterError(f"{where}: no such directory (nor a hub repo id of the form owner/name)")
    try:
        files = Checkpoint(source.location, cache_dir=cache_dir, max_disk_space=max_disk_space)
        config_path, weights_path = files.file(CONFIG_FILE), files.file(WEIGHTS_FILE)
    except CheckpointError as e:
        raise AdapterError(f"{where}: {e}") from None
    assert config_path is not None and weights_path is not None  # required files raise instead
    config = _parse_config(config_path, where)
    shape = ModelShape.from_config(model_config)
    shapes = target_shapes(shape)
    header = _safetensors_header(weights_path, where)
    from peft.tuners.tuners_utils import check_target_module_exists

    family = family_for(model_config)
    modules, per_block = family.lora.modules, family.lora.shapes  # (per_block: DeepSeek-V3's blocks differ)
    pairs: Dict[Tuple[int, str], Dict[str, Tuple[str, List[int]]]] = {}
    expert_pairs: Dict[Tuple[int, str], Dict[str, Tuple[str, List[int]]]] = {}
    for key, info in header.items():
        match = _KEY.match(key)
        expert = EXPERT_KEY.match(key)
        if expert is not None:  # an experts' stacked parameter (`target_parameters`), by its wrapper's nesting
            expert_pairs.setdefault((int(expert.group(1)), expert.group(2)), {})[expert.group(3)] = \
                (key, list(info.get("shape", [])))
            continue
        if match is None and ".experts." in key:
            raise AdapterError(f"{where}: tensor {key} adapts one expert's own module: only the experts' stacked "
                               f"parameters (target_parameters) and {', '.join(modules)} are served on "
                               f"{model_config.model_type}")
        if match is None or match.group(3) not in modules or modules[match.group(3)] != match.group(2):
            raise AdapterError(f"{where}: tensor {key} is not a LoRA A/B weight of a projection of a decoder block "
                               f"({', '.join(modules)})")
        block, target, which = int(match.group(1)), match.group(3), match.group(4)
        if block >= model_config.num_hidden_layers:
            raise AdapterError(f"{where}: tensor {key} is for block {block}, but the model has "
                               f"{model_config.num_hidden_layers} blocks (an adapter for another model?)")
        pairs.setdefault((block, target), {})[which] = (key, list(info.get("shape", [])))
    if not pairs and not expert_pairs:
        raise AdapterError(f"{where}: {WEIGHTS_FILE} holds no LoRA weights")
    result = AdapterFiles(source.name, config, weights_path, model_config=model_config, grouped=per_block is None)
    if expert_pairs or config.target_parameters:
        try:
            result.experts = expert_targets(model_config, config, expert_pairs, lambda key: (
                int(_pattern_value(config.rank_pattern, key, config.r)),
                float(_pattern_value(config.alpha_pattern, key, config.lora_alpha))))
        except ValueError as e:
            raise AdapterError(f"{where}: {e}") from None
    for (block, target), found in sorted(pairs.items()):
        if set(found) != {"A", "B"}:
            raise AdapterError(f"{where}: block {block} {target} has lora_{''.join(found)} without its pair")
        module_key = f"{family.blocks_prefix}{block}.{modules[target]}.{target}"
        if not check_target_module_exists(config, module_key):
            raise AdapterError(f"{where}: weights for {module_key}, which the config's target_modules "
                               f"{sorted(config.target_modules or [])} do not target")
        rank = int(_pattern_value(config.rank_pattern, module_key, config.r))
        alpha = float(_pattern_value(config.alpha_pattern, module_key, config.lora_alpha))
        block_shapes = shapes if per_block is None else per_block(model_config, block)
        if target not in block_shapes:
            raise AdapterError(f"{where}: weights for {module_key}, which block {block} does not have")
        out_features, in_features = block_shapes[target]
        (a_key, a_shape), (b_key, b_shape) = found["A"], found["B"]
        if a_shape != [rank, in_features] or b_shape != [out_features, rank]:
            raise AdapterError(
                f"{where}: {module_key} has lora_A {a_shape} and lora_B {b_shape}; rank {rank} on this model needs "
                f"[{rank}, {in_features}] and [{out_features}, {rank}] (an adapter for another model, or a rank "
                f"that disagrees with its config?)")
        scaling = alpha / math.sqrt(rank) if config.use_rslora else alpha / rank
        result.targets[(block, target)] = TargetSpec(block, target, a_key, b_key, rank, scaling, modules[target])
    wanted = {t for t in modules
              if check_target_module_exists(config, f"{family.blocks_prefix}0.{modules[t]}.{t}")}
    present = {t for _, target in result.targets for t in (target, target.rpartition(".")[2])}
    if isinstance(config.target_modules, (set, list, tuple)):
        named = set(config.target_modules) & set(modules)
        if per_block is not None:  # (only the projections its blocks have: q_proj or q_a_proj / q_b_proj, ...)
            named &= {t for block in range(model_config.num_hidden_layers) for t in per_block(model_config, block)}
        if named - present:
            raise AdapterError(f"{where}: the config targets {sorted(named - present)} but the weights hold none")
    elif wanted and not present:
        raise AdapterError(f"{where}: the config targets {sorted(wanted)} but the weights hold none")
    return result
