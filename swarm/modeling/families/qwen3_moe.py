"""The Qwen3-MoE family's decoder block: Qwen3's attention (q/k norms per head), then routed experts.

A sparse layer is `mixtral.moe_block_step` on Qwen3's attention (`swarm.modeling.families.qwen3`): input RMSNorm, q/k/v,
the query and key heads' RMSNorm, rotary, attention, output projection + residual, post-attention RMSNorm, and
`mixtral.sparse_moe` + residual: the router's softmax in float32, the top `num_experts_per_tok` of
`num_experts` (config.json's name; `num_local_experts` in transformers' config object), their probabilities
renormalized only with `norm_topk_prob`, no shared expert. Layers in `mlp_only_layers`, or off the
`decoder_sparse_step` grid, have a dense MLP instead: those are exactly Qwen3 layers (`qwen3.block_step`).
This is transformers' `Qwen3MoeDecoderLayer` with its eager experts, op for op (tests/test_family_qwen3.py).

- `Qwen3MoeDecoderLayer`: modules under the hub checkpoints' names (`mlp.gate`, `mlp.experts.{e}.gate_proj /
  up_proj / down_proj`); `load_state_dict` also takes transformers 5's fused layout (`mlp.experts.gate_up_proj`
  [experts, 2 * moe_intermediate, hidden], `mlp.experts.down_proj` [experts, hidden, moe_intermediate]).
- `FusedQkNormMoeLayer` (`fuse_layer`, sparse layers): `mixtral.FusedMoeLayer` with the q/k norms; dense layers
  fuse to `qwen3.FusedQkNormLayer`. Routing is data-dependent: no CUDA graphs (as Mixtral).
- `--quant_type int8 / nf4`: `swarm.modeling.quantize.QuantizedQkNormMoeLayer`, the quantized Mixtral block with the
  q/k norms in float.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Dict, Optional, Tuple, cast

import torch
import torch.nn.functional as F
from torch import nn

from swarm.modeling.families.llama import MLP, Attend, _share, block_step
from swarm.modeling.families.mixtral import FusedMoeLayer, _stack_experts, moe_block_step
from swarm.modeling.families.qwen3 import Qwen3DecoderLayer, fused_qk_norm
from swarm.modeling.families.qwen3 import fuse_layer as fuse_qwen3_layer
from swarm.modeling.shape import ModelShape


def is_sparse(config, layer_idx: int) -> bool:
    """Whether block `layer_idx` routes to experts (transformers' Qwen3MoeDecoderLayer's rule), else a dense MLP."""
    experts = int(getattr(config, "num_local_experts", 0) or 0)
    step = int(getattr(config, "decoder_sparse_step", 1) or 1)
    return layer_idx not in (getattr(config, "mlp_only_layers", None) or []) and experts > 0 \
        and (layer_idx + 1) % step == 0


class SparseMoe(nn.Module):
    """The router (`gate`, [experts, hidden]) and the experts, each a gated MLP of `moe_intermediate_size`."""

    def __init__(self, config, shape: ModelShape):
        super().__init__()
        self.num_experts, self.top_k = int(config.num_local_experts), int(config.num_experts_per_tok)
        self.norm_topk_prob = bool(getattr(config, "norm_topk_prob", False))
        self.gate = nn.Linear(shape.hidden_size, self.num_experts, bias=False)
        expert_shape = replace(shape, intermediate_size=int(config.moe_intermediate_size))
        self.experts = nn.ModuleList(MLP(expert_shape, bias=False) for _ in range(self.num_experts))
        self.act_fn = cast(MLP, self.experts[0]).act_fn


def from_fused_layout(state: Dict[str, torch.Tensor], num_experts: int) -> Dict[str, torch.Tensor]:
    """A block's state dict with transformers 5's fused expert tensors as the hub's per-expert names (views)."""
    if "mlp.experts.gate_up_proj" not in state:
        return state
    state = dict(state)
    gate_up, down = state.pop("mlp.experts.gate_up_proj"), state.pop("mlp.experts.down_proj", None)
    if down is None or gate_up.dim() != 3 or down.dim() != 3 or len(gate_up) != num_experts \
            or len(down) != num_experts or gate_up.shape[1] != 2 * down.shape[2]:
        raise ValueError(f"fused Qwen3-MoE experts need mlp.experts.gate_up_proj [{num_experts}, 2 * intermediate, "
                         f"hidden] and mlp.experts.down_proj [{num_experts}, hidden, intermediate]; got "
                         f"{list(gate_up.shape)} and {None if down is None else list(down.shape)}")
    intermediate = down.shape[2]
    for e in range(num_experts):
        state[f"mlp.experts.{e}.gate_proj.weight"] = gate_up[e, :intermediate]
        state[f"mlp.experts.{e}.up_proj.weight"] = gate_up[e, intermediate:]
        state[f"mlp.experts.{e}.down_proj.weight"] = down[e]
    return state


class Qwen3MoeDecoderLayer(Qwen3DecoderLayer):
    """`layer(hidden, attention_mask, position_ids, past_key_values, use_cache, position_embeddings)` -> hidden."""

    num_experts = top_k = 0  # (sparse layers': moe_block_step reads them)
    norm_topk_prob = False
    window_layers = False  # the config's window on every layer (transformers' Qwen3-MoE)

    def __init__(self, config, layer_idx: int):
        super().__init__(config, layer_idx)
        self.sparse = is_sparse(config, layer_idx)
        if self.sparse:
            moe = SparseMoe(config, ModelShape.from_config(config))
            self.mlp = moe  # type: ignore[assignment]
            self.num_experts, self.top_k, self.norm_topk_prob = moe.num_experts, moe.top_k, moe.norm_topk_prob

    @property
    def moe(self) -> SparseMoe:
        return cast(SparseMoe, self.mlp)

    def step(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, attend: Attend) -> torch.Tensor:
        return (moe_block_step if self.sparse else block_step)(self, x, cos, sin, attend)

    def load_state_dict(self, state_dict, strict: bool = True, assign: bool = False):
        """Either layout of the experts' tensors (`from_fused_layout`)."""
        if self.sparse:
            state_dict = from_fused_layout(dict(state_dict), self.num_experts)
        return super().load_state_dict(state_dict, strict=strict, assign=assign)

    def router(self, h: torch.Tensor) -> torch.Tensor:
        return self.moe.gate(h)

    def expert(self, e: int, h: torch.Tensor) -> torch.Tensor:
        expert = cast(MLP, self.moe.experts[e])
        return expert.down_proj(expert.act_fn(expert.gate_proj(h)) * expert.up_proj(h))


@dataclass(eq=False)
class FusedQkNormMoeLayer(FusedMoeLayer):
    """`mixtral.FusedMoeLayer` with the query and key heads' norms and `norm_topk_prob`."""
    q_norm_weight: Optional[torch.Tensor] = None  # [head_dim]
    k_norm_weight: Optional[torch.Tensor] = None
    norm_topk_prob: bool = False

    def qkv_projection(self, h: torch.Tensor) -> torch.Tensor:
        return F.linear(h, self.qkv_weight, self.qkv_bias).unflatten(-1, (-1, self.head_dim))  # (FusedLayer.qkv's)

    def qk_norm(self, qkv: torch.Tensor) -> torch.Tensor:
        return fused_qk_norm(self, qkv)

    def qkv(self, h: torch.Tensor) -> torch.Tensor:
        return self.qk_norm(self.qkv_projection(h))



QUANT_KEEP = ("mlp.gate",)  # a sparse layer's router: int8 / nf4 keep it float (`FamilySpec.quant`)


def expert_sizes(config, block: int) -> Optional[Tuple[int, int]]:
    """(experts, one expert's intermediate size) of a sparse block, None for a dense one (`FamilySpec.lora`)."""
    return (int(config.num_local_experts), int(config.moe_intermediate_size)) if is_sparse(config, block) else None


def fuse_layer(layer: Qwen3MoeDecoderLayer):
    """A dense layer as `qwen3.fuse_layer`; a sparse one's attention and experts fused (views of the module's)."""
    if not layer.sparse:
        return fuse_qwen3_layer(layer)
    attn, moe = layer.attention, layer.moe
    qkv_weight = _share((attn.q_proj, attn.k_proj, attn.v_proj), "weight")
    assert qkv_weight is not None
    return FusedQkNormMoeLayer(
        input_norm_weight=layer.input_layernorm.weight, post_norm_weight=layer.post_attention_layernorm.weight,
        eps=layer.input_layernorm.variance_epsilon, qkv_weight=qkv_weight, o_weight_t=attn.o_proj.weight.t(),
        qkv_bias=_share((attn.q_proj, attn.k_proj, attn.v_proj), "bias"), o_bias=attn.o_proj.bias,
        router_weight=moe.gate.weight, gate_up_weight=_stack_experts(moe.experts, ("gate_proj", "up_proj")),
        down_weight=_stack_experts(moe.experts, ("down_proj",)), act=moe.act_fn, num_experts=moe.num_experts,
        top_k=moe.top_k, heads=layer.heads, kv_heads=layer.kv_heads, head_dim=layer.head_dim,
        scaling=layer.scaling, layer_idx=layer.layer_idx, sliding_window=layer.sliding_window,
        q_norm_weight=attn.q_norm.weight, k_norm_weight=attn.k_norm.weight, norm_topk_prob=moe.norm_topk_prob,
    )

