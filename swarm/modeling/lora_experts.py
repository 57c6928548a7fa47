"""LoRA on a mixture of experts' stacked expert weights: peft's `target_parameters` adapters, served per row.

transformers 5 keeps a MoE layer's experts as stacked 3-d parameters (`mlp.experts.gate_up_proj`, `mlp.experts.
down_proj`), which peft adapts through `LoraConfig(target_parameters=[...])` (its `lora.ParamWrapper`). Its math, for
a parameter [experts, d1, d2] (`ParamWrapper.get_delta_weight`): `lora_A` is [rank * experts, in] and `lora_B`
[out, rank * experts], where (in, out) is (d2, d1) for Mixtral's, Qwen3-MoE's and DeepSeek-V3's [experts, out, in]
and (d1, d2) for GPT-OSS's transposed [experts, in, out]; expert e's delta is `scaling * B_e @ A_e` with
`A_e = A.reshape(experts, rank, in)[e]` (rows e * rank ..) and `B_e = B.reshape(out, rank, experts)[:, :, e]`
(B's columns e, e + experts, ..: interleaved), scaling `lora_alpha / rank` (`/ sqrt(rank)` with rslora). The
delta is added to the weight, so a token routed to expert e gets `(h @ A_e^T) @ B_e^T * scaling` added to that
projection's output (gate_up: before the activation, in the parameter's own column order: Mixtral's gate rows then
up rows, GPT-OSS's interleaved columns; down: on the activated intermediate).

peft nests one wrapper per targeted parameter of a module, so the file names the tensors by nesting depth, not by
parameter (`mlp.experts.base_layer.lora_A.weight` is the inner wrapper's, `mlp.experts.lora_A.weight` the outer's);
`expert_targets` tells gate_up from down by their shapes ([rank * experts, hidden] / [2 * intermediate, ...]
against [rank * experts, intermediate] / [hidden, ...], which differ for any sizes).

At a step (`lora.AdaptedLayer.expert_rows`, which `mixtral.sparse_moe` calls with the flattened row of each token
routed to the expert), each row group's delta is added to its own tokens only (a 0/1 row mask on the rank-sized
product: no host sync), so sessions of different adapters and of the base share one batched decode step. The layer
provides the expert in parts: `expert_gate_up(e, h)` [n, 2 * intermediate], `expert_act(gate_up)` [n, intermediate]
and `expert_down(e, a)` [n, hidden] (Mixtral's and Qwen3-MoE's fused layers, GPT-OSS's and DeepSeek-V3's layers).
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence, Tuple

import torch

from swarm.modeling.families import family_for

EXPERT_PARAMETERS = ("gate_up_proj", "down_proj")
EXPERT_KEY = re.compile(r"^(?:base_model\.model\.)?model\.layers\.(\d+)\.mlp\.experts\.((?:base_layer\.)*)"
                        r"lora_([AB])\.weight$")


def unsupported_parameters(target_parameters: Sequence[str]) -> List[str]:
    """The entries of a config's `target_parameters` that are not an experts' stacked gate_up / down weight."""
    # (peft matches a parameter's key by suffix: "mlp.experts.down_proj", "experts.down_proj" or "down_proj"; peft
    # itself writes the bare names where it turns target_modules' gate_proj / up_proj / down_proj into them)
    return [name for name in target_parameters
            if name.split(".")[-1] not in EXPERT_PARAMETERS or name.split(".")[-2:-1] not in ([], ["experts"])]


def expert_sizes(model_config, block: int) -> Optional[Tuple[int, int]]:
    """(experts, intermediate size of one expert) of block `block`, or None where the block has no routed experts
    (a dense layer, or a family without experts): the family's `LoraLayout.experts`."""
    sizes = family_for(model_config).lora.experts
    return None if sizes is None else sizes(model_config, block)


@dataclass(frozen=True)
class ExpertTarget:
    """One adapted stacked parameter of one block: its tensors' names, per-expert rank and scaling."""

    block: int
    parameter: str  # "gate_up_proj" or "down_proj"
    a_key: str
    b_key: str
    rank: int
    scaling: float


def expert_targets(model_config, config, header_pairs: Dict[Tuple[int, str], Dict[str, Tuple[str, List[int]]]],
                   rank_alpha) -> Dict[Tuple[int, str], ExpertTarget]:
    """The adapted experts of an adapter: `header_pairs` maps (block, nesting) to {"A": (key, shape), "B": ...};
    `rank_alpha(module_key)` gives peft's (rank, alpha) for a parameter's key. ValueError says what is wrong."""
    if family_for(model_config).lora.experts is None:
        raise ValueError(f"tensors on experts, but {model_config.model_type} has no routed experts")
    hidden = int(model_config.hidden_size)
    targets: Dict[Tuple[int, str], ExpertTarget] = {}
    for (block, nesting), found in sorted(header_pairs.items()):
        if set(found) != {"A", "B"}:
            raise ValueError(f"block {block} experts ({nesting or 'outer'}) have lora_{''.join(found)} without "
                             f"its pair")
        sizes = expert_sizes(model_config, block)
        if sizes is None:
            raise ValueError(f"tensors for the experts of block {block}, which has none (a dense layer)")
        experts, inter = sizes
        (a_key, a_shape), (b_key, b_shape) = found["A"], found["B"]
        parameter = None
        for name, (in_features, out_features) in (("gate_up_proj", (hidden, 2 * inter)),
                                                  ("down_proj", (inter, hidden))):
            if len(a_shape) == 2 and a_shape[1] == in_features and b_shape[:1] == [out_features]:
                parameter = name
        if parameter is None:
            raise ValueError(f"{a_key} {a_shape} and {b_key} {b_shape} fit neither experts.gate_up_proj (in {hidden}, "
                             f"out {2 * inter}) nor experts.down_proj (in {inter}, out {hidden}) of block {block}")
        key = f"model.layers.{block}.mlp.experts.{parameter}"
        if not any(key == t or key.endswith(f".{t}") for t in config.target_parameters or ()):
            raise ValueError(f"weights for {key}, which the config's target_parameters "
                             f"{list(config.target_parameters or [])} do not target")
        if (block, parameter) in targets:
            raise ValueError(f"two pairs of tensors for {key}")
        rank, alpha = rank_alpha(key)
        if a_shape != [rank * experts, a_shape[1]] or b_shape != [b_shape[0], rank * experts]:
            raise ValueError(f"{key} has lora_A {a_shape} and lora_B {b_shape}; rank {rank} over {experts} experts "
                             f"needs {rank * experts} rows of A and columns of B")
        scaling = alpha / rank ** 0.5 if config.use_rslora else alpha / rank
        targets[(block, parameter)] = ExpertTarget(block, parameter, a_key, b_key, rank, scaling)
    named = {p for t in config.target_parameters or () for p in EXPERT_PARAMETERS if t.endswith(p)}
    missing = named - {parameter for _, parameter in targets}
    if missing:
        raise ValueError(f"the config targets experts.{sorted(missing)} but the weights hold none")
    return targets


@dataclass
class ExpertLora:
    """An adapter's low-rank factors for one stacked parameter of one block, per expert."""

    a_t: torch.Tensor  # [experts, in, rank]: A_e^T
    b_t: torch.Tensor  # [experts, rank, out]: B_e^T * scaling

    @classmethod
    def from_peft(cls, a: torch.Tensor, b: torch.Tensor, experts: int, scaling: float) -> "ExpertLora":
        """From peft's lora_A [rank * experts, in] and lora_B [out, rank * experts]."""
        rank = a.shape[0] // experts
        a_t = a.reshape(experts, rank, a.shape[1]).transpose(1, 2)  # [experts, in, rank]
        b_t = b.reshape(b.shape[0], rank, experts).permute(2, 1, 0) * scaling  # [experts, rank, out]
        return cls(a_t.contiguous(), b_t.contiguous())

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.a_t, self.b_t))


def load_expert_loras(f, targets: Sequence[ExpertTarget], model_config, dtype: torch.dtype,
                      device: torch.device) -> Dict[str, ExpertLora]:
    """One block's adapted parameters ("gate_up_proj" / "down_proj" -> ExpertLora), read from the open
    safetensors file `f`."""
    loras = {}
    for target in targets:
        sizes = expert_sizes(model_config, target.block)
        assert sizes is not None  # (checked by `expert_targets`)
        lora = ExpertLora.from_peft(f.get_tensor(target.a_key).float(), f.get_tensor(target.b_key).float(), sizes[0],
                                    target.scaling)
        loras[target.parameter] = ExpertLora(lora.a_t.to(device, dtype), lora.b_t.to(device, dtype))
    return loras


# the row groups of a step that carry experts' deltas: rows [r0, r1) of the flattened leading dims use `loras`
ExpertGroup = Tuple[int, int, Dict[str, ExpertLora]]


def add_expert_deltas(groups: Sequence[ExpertGroup], parameter: str, e: int, x: torch.Tensor, tokens: torch.Tensor,
                      out: torch.Tensor) -> None:
    """Into out [n, width] (expert e's `parameter` output for its n tokens, in place) add each group's delta on its
    own tokens: x [n, in] its input, tokens [n] their rows (`mixtral.sparse_moe`)."""
    for r0, r1, loras in groups:
        lora = loras.get(parameter)
        if lora is None:
            continue
        mask = ((tokens >= r0) & (tokens < r1)).to(x.dtype).unsqueeze(-1)  # [n, 1]: this group's tokens
        out.addmm_((x @ lora.a_t[e]) * mask, lora.b_t[e])  # [n, rank] @ [rank, width]


def adapted_expert(layer, groups: Sequence[ExpertGroup], e: int, h: torch.Tensor, tokens: torch.Tensor
                   ) -> torch.Tensor:
    """Expert e of `layer` on h [n, hidden] (tokens [n]: their rows) with each group's deltas -> [n, hidden]."""
    gate_up = layer.expert_gate_up(e, h)  # [n, 2 * intermediate], a new tensor
    add_expert_deltas(groups, "gate_up_proj", e, h, tokens, gate_up)
    a = layer.expert_act(gate_up)  # [n, intermediate]
    out = layer.expert_down(e, a)  # [n, hidden], a new tensor
    add_expert_deltas(groups, "down_proj", e, a, tokens, out)
    return out
