"""The projections a LoRA adapter may target, and their shapes (`swarm.modeling.lora`'s tables).

The tables of adaptable projections (target -> its parent module), which a family's spec names as its own
(`FamilySpec.lora`, `swarm.modeling.families`); how they group by the input they share (`PROJECTIONS`,
`FUSED_PROJECTIONS`: one low-rank product per group at a step), each target's (out, in) shape on the base model
(`target_shapes`; where a family's blocks differ, its own `LoraLayout.shapes`: DeepSeek-V3's) and its columns in its
group's fused output (`columns`). The experts' stacked parameters are `swarm.modeling.lora_experts`'.
"""
from __future__ import annotations

from typing import Dict, Tuple

from swarm.modeling.shape import ModelShape

# the projections of a Llama-family block, grouped by the input they share: (group, targets)
PROJECTIONS: Tuple[Tuple[str, Tuple[str, ...]], ...] = (
    ("qkv", ("q_proj", "k_proj", "v_proj")), ("o", ("o_proj",)), ("gate_up", ("gate_proj", "up_proj")),
    ("down", ("down_proj",)), ("up", ()),
)
MODULES = {target: ("self_attn" if group in ("qkv", "o") else "mlp") for group, targets in PROJECTIONS
           for target in targets}
# Phi-3's checkpoints fuse q/k/v and gate/up into one projection each, which its adapters target as such; BLOOM's
# and Falcon's layers name theirs query_key_value, dense, dense_h_to_4h ("up": no gate) and dense_4h_to_h
FUSED_PROJECTIONS = {"qkv_proj": "qkv", "gate_up_proj": "gate_up", "query_key_value": "qkv", "dense": "o",
                     "dense_h_to_4h": "up", "dense_4h_to_h": "down"}
LAYER_NORM_MODULES = {"query_key_value": "self_attention", "dense": "self_attention", "dense_h_to_4h": "mlp",
                      "dense_4h_to_h": "mlp"}
PHI3_MODULES = {"qkv_proj": "self_attn", "o_proj": "self_attn", "gate_up_proj": "mlp", "down_proj": "mlp"}


# mixtures of experts: the attention's projections as modules; their experts' stacked 3-d parameters
# (`mlp.experts.gate_up_proj` [experts, ...]) through peft's `target_parameters` (`swarm.modeling.lora_experts`)
ATTENTION_MODULES = {target: module for target, module in MODULES.items() if module == "self_attn"}
# DeepSeek-V3: its latent attention's projections, the dense blocks' MLP and the sparse blocks' shared experts, each
# a group of its own (named "module.target", e.g. "self_attn.q_a_proj"; the layer's `project` and `absorbed`)
DEEPSEEK_MODULES = {**{t: "self_attn" for t in ("q_proj", "q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj",
                                               "o_proj")},
                    **{f"{shared}{t}": "mlp" for shared in ("", "shared_experts.")
                       for t in ("gate_proj", "up_proj", "down_proj")}}


def target_shapes(shape: ModelShape) -> Dict[str, Tuple[int, int]]:
    """target -> (out_features, in_features) of the base model's projection."""
    q, kv = shape.num_heads * shape.head_dim, shape.num_kv_heads * shape.head_dim
    hidden, inter = shape.hidden_size, shape.intermediate_size
    return {"q_proj": (q, hidden), "k_proj": (kv, hidden), "v_proj": (kv, hidden), "o_proj": (hidden, q),
            "gate_proj": (inter, hidden), "up_proj": (inter, hidden), "down_proj": (hidden, inter),
            "qkv_proj": (q + 2 * kv, hidden), "gate_up_proj": (2 * inter, hidden),
            "query_key_value": (q + 2 * kv, hidden), "dense": (hidden, q), "dense_h_to_4h": (inter, hidden),
            "dense_4h_to_h": (hidden, inter)}


def columns(shape: ModelShape) -> Dict[str, Tuple[int, int, int]]:
    """target -> (first column, last column + 1, width) in the output of its group's fused projection."""
    q, kv = shape.num_heads * shape.head_dim, shape.num_kv_heads * shape.head_dim
    hidden, inter = shape.hidden_size, shape.intermediate_size
    return {"q_proj": (0, q, q + 2 * kv), "k_proj": (q, q + kv, q + 2 * kv), "v_proj": (q + kv, q + 2 * kv, q + 2 * kv),
            "o_proj": (0, hidden, hidden), "gate_proj": (0, inter, 2 * inter), "up_proj": (inter, 2 * inter, 2 * inter),
            "down_proj": (0, hidden, hidden), "qkv_proj": (0, q + 2 * kv, q + 2 * kv),
            "gate_up_proj": (0, 2 * inter, 2 * inter), "query_key_value": (0, q + 2 * kv, q + 2 * kv),
            "dense": (0, hidden, hidden), "dense_h_to_4h": (0, inter, inter), "dense_4h_to_h": (0, hidden, hidden)}
