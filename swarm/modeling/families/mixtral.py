"""The Mixtral family's decoder block: Llama's attention, then a sparse mixture of experts in place of the MLP.

The block is `moe_block_step`: `llama.attention_residual` (input RMSNorm, q/k/v, rotary, the caller's attention,
output projection + residual; grouped-query attention and the config's sliding window as for Mistral), then the
post-attention RMSNorm and `sparse_moe` + residual. `sparse_moe` routes each token on its own (the router's
softmax in float32, the top `num_experts_per_tok` of `num_local_experts`, their weights renormalized to sum to
1) and runs every expert once on the tokens routed to it: `w2(act(w1(h)) * w3(h))` scaled by the token's weight
and added at its row. Rows of a batched decode step (different sessions) thus each get their own experts. This is
transformers' `MixtralSparseMoeBlock` with its eager experts, op for op (tests/swarm/modeling/test_family_mixtral.py
compares).

Two kinds of layer object, as in `swarm.modeling.families.llama`:
- `MixtralDecoderLayer`: nn.Modules under the hub checkpoints' names (`block_sparse_moe.gate`,
  `block_sparse_moe.experts.{e}.w1/w2/w3`), so `server.placement.memory` counts each expert's linear weights. Its
  `load_state_dict` also takes the fused layout of transformers 5's modules (`mlp.gate.weight`,
  `mlp.experts.gate_up_proj` [experts, 2 * intermediate, hidden], `mlp.experts.down_proj` [experts, hidden,
  intermediate]), as a state dict of `MixtralForCausalLM` has it (transformers 5.23's `save_pretrained` writes the
  hub names back); each expert's weights become views of those tensors.
- `FusedMoeLayer` (`fuse_layer`): q/k/v in one matrix (`llama.FusedLayer`'s attention methods), the experts'
  gate/up stacked in one [experts, 2 * intermediate, hidden] tensor and down in one [experts, hidden,
  intermediate]; the module's parameters become views into them. The server's prefill and batched decode
  (`server.compute.decode`) run it. Routing is data-dependent (a host sync per block to count each expert's tokens), so
  it is not captured in a CUDA graph (`FamilySpec.graph_refusal`, which
  `server.compute.blocks.BlockSpan.enable_cuda_graphs` reads).
- `--quant_type int8 / nf4`: `swarm.modeling.quantize.QuantizedMoeLayer`, the fused layer's projections as
  bitsandbytes modules, one per expert for gate/up and one for down; router and norms in float.
Written here in plain torch rather than imported from transformers' modeling_mixtral, which would cost every
server and client about 135 MB of resident imports (measured: importing it after torch and the config
module), while this module adds none measurable (`swarm.modeling.layers`).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, Optional, Tuple, cast

import torch
import torch.nn.functional as F
from torch import nn

from swarm.modeling.families.llama import Attend, Attention, DecoderLayer, FusedLayer, _share, attention_residual
from swarm.modeling.layers import (
    AttentionIndexedLayer,
    RMSNorm,
    activation,
    sliding_window_of,
    step_forward,
)
from swarm.modeling.shape import ModelShape


def sparse_moe(layer, h: torch.Tensor) -> torch.Tensor:
    """The experts' output for h: [..., hidden] (tokens on the leading dims), each token through its top-k experts.

    `layer` provides `router(h [tokens, hidden]) -> [tokens, experts]` (or its own `route(h) -> (weights, experts)
    [tokens, top_k] each`), `expert(e, h [n, hidden]) -> [n, hidden]`, `num_experts` and `top_k`. Returns
    [..., hidden]. A layer with LoRA deltas on its experts (`lora.AdaptedLayer`) takes `expert_rows(e, h, tokens)`
    instead, tokens [n] the rows of h's tokens (ascending) among the flattened leading dims.
    """
    flat = h.reshape(-1, h.shape[-1])  # [tokens, hidden]
    route = getattr(layer, "route", None)  # a family's own routing (GPT-OSS: the softmax of the top-k logits)
    if route is not None:
        weights, chosen = route(flat)  # [tokens, top_k] each
    else:
        probs = F.softmax(layer.router(flat).float(), dim=-1)  # [tokens, experts], float32 as transformers
        weights, chosen = torch.topk(probs, layer.top_k, dim=-1)  # [tokens, top_k]
        if getattr(layer, "norm_topk_prob", True):  # (Qwen3-MoE's config may keep the top-k probabilities)
            weights /= weights.sum(dim=-1, keepdim=True)
    out = torch.zeros_like(flat)
    # the (token, slot) assignments grouped by expert: one host sync for the counts
    flat_chosen = chosen.reshape(-1)  # [tokens * top_k]
    order = torch.argsort(flat_chosen, stable=True)
    counts = torch.bincount(flat_chosen, minlength=layer.num_experts).tolist()
    flat_weights = weights.reshape(-1)
    expert_rows = getattr(type(layer), "expert_rows", None)  # (a class attribute: not the wrapped layer's lookup)
    begin = 0
    for expert, count in enumerate(counts):
        if count == 0:
            continue
        assignments = order[begin:begin + count]
        begin += count
        tokens = assignments // layer.top_k  # [count]
        h_e = flat[tokens]  # [count, hidden]
        y = layer.expert(expert, h_e) if expert_rows is None else expert_rows(layer, expert, h_e, tokens)
        y = y * flat_weights[assignments, None]  # [count, hidden]
        out.index_add_(0, tokens, y.to(out.dtype))
    return out.view(h.shape)


# the router, which int8 / nf4 keep float (`FamilySpec.quant`: its top-k choice is what quantization noise should not
# flip)
QUANT_KEEP = ("block_sparse_moe.gate",)


def moe_block_step(layer, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, attend: Attend) -> torch.Tensor:
    """One Mixtral block on x: [..., hidden] (cos, sin: [..., head_dim]), as `llama.block_step`. -> [..., hidden]"""
    x = attention_residual(layer, x, cos, sin, attend)
    return x + sparse_moe(layer, layer.post_norm(x))


class Expert(nn.Module):
    """One expert's gated MLP under the hub names: w1 (gate), w3 (up), w2 (down)."""

    def __init__(self, hidden: int, intermediate: int):
        super().__init__()
        self.w1 = nn.Linear(hidden, intermediate, bias=False)
        self.w2 = nn.Linear(intermediate, hidden, bias=False)
        self.w3 = nn.Linear(hidden, intermediate, bias=False)


class SparseMoe(nn.Module):
    def __init__(self, config, shape: ModelShape):
        super().__init__()
        self.num_experts, self.top_k = int(config.num_local_experts), int(config.num_experts_per_tok)
        self.gate = nn.Linear(shape.hidden_size, self.num_experts, bias=False)  # the router
        self.experts = nn.ModuleList(Expert(shape.hidden_size, shape.intermediate_size)
                                     for _ in range(self.num_experts))
        self.act_fn = activation(shape.hidden_act)


def from_fused_layout(state: Dict[str, torch.Tensor], num_experts: int) -> Dict[str, torch.Tensor]:
    """A block's state dict with transformers 5's fused expert tensors renamed to the hub's per-expert names (as
    views); a state dict in the hub layout is returned as it is."""
    if "mlp.experts.gate_up_proj" not in state and "mlp.gate.weight" not in state:
        return state
    state = dict(state)
    gate_up, down = state.pop("mlp.experts.gate_up_proj", None), state.pop("mlp.experts.down_proj", None)
    if gate_up is None or down is None or gate_up.dim() != 3 or down.dim() != 3 or len(gate_up) != num_experts \
            or len(down) != num_experts or gate_up.shape[1] % 2 or gate_up.shape[1] // 2 != down.shape[2]:
        raise ValueError(f"fused Mixtral experts need mlp.experts.gate_up_proj [{num_experts}, 2 * intermediate, "
                         f"hidden] and mlp.experts.down_proj [{num_experts}, hidden, intermediate]; got "
                         f"{None if gate_up is None else list(gate_up.shape)} and "
                         f"{None if down is None else list(down.shape)}")
    intermediate = down.shape[2]
    if "mlp.gate.weight" in state:
        state["block_sparse_moe.gate.weight"] = state.pop("mlp.gate.weight")
    for e in range(num_experts):
        state[f"block_sparse_moe.experts.{e}.w1.weight"] = gate_up[e, :intermediate]
        state[f"block_sparse_moe.experts.{e}.w3.weight"] = gate_up[e, intermediate:]
        state[f"block_sparse_moe.experts.{e}.w2.weight"] = down[e]
    return state


class MixtralDecoderLayer(AttentionIndexedLayer):
    """`layer(hidden, attention_mask, position_ids, past_key_values, use_cache, position_embeddings)` -> hidden."""

    step = moe_block_step  # layer.step(x, cos, sin, attend)

    def __init__(self, config, layer_idx: int):
        super().__init__()
        shape = ModelShape.from_config(config)
        self.hidden_size = shape.hidden_size
        self.heads, self.kv_heads, self.head_dim = shape.num_heads, shape.num_kv_heads, shape.head_dim
        self.scaling = shape.scaling
        self.self_attn = Attention(shape, layer_idx, qkv_bias=False, o_bias=False)
        self.block_sparse_moe = SparseMoe(config, shape)
        self.num_experts, self.top_k = self.block_sparse_moe.num_experts, self.block_sparse_moe.top_k
        self.input_layernorm = RMSNorm(shape.hidden_size, eps=shape.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(shape.hidden_size, eps=shape.rms_norm_eps)
        self.sliding_window = sliding_window_of(config, layer_idx)  # None: full causal attention

    def load_state_dict(self, state_dict, strict: bool = True, assign: bool = False):
        """Either layout of the experts' tensors (`from_fused_layout`)."""
        return super().load_state_dict(from_fused_layout(dict(state_dict), self.num_experts), strict=strict,
                                       assign=assign)

    forward = step_forward  # transformers' layer call, through `step` (`layers.step_forward`)

    # what the block step reads: the attention as Llama's layer module, the experts one by one
    input_norm = DecoderLayer.input_norm
    post_norm = DecoderLayer.post_norm
    qkv = DecoderLayer.qkv
    add_o_proj = DecoderLayer.add_o_proj

    def router(self, h: torch.Tensor) -> torch.Tensor:
        return self.block_sparse_moe.gate(h)

    def expert(self, e: int, h: torch.Tensor) -> torch.Tensor:
        expert = cast(Expert, self.block_sparse_moe.experts[e])
        return expert.w2(self.block_sparse_moe.act_fn(expert.w1(h)) * expert.w3(h))



@dataclass(eq=False)
class FusedMoeLayer:
    """One Mixtral block's weights for the server's steps (views shared with the layer module)."""
    input_norm_weight: torch.Tensor  # [hidden]
    post_norm_weight: torch.Tensor  # [hidden]
    eps: float
    qkv_weight: torch.Tensor  # [(heads + 2 * kv_heads) * head_dim, hidden]
    o_weight_t: torch.Tensor  # [heads * head_dim, hidden] (transposed view, for addmm)
    router_weight: torch.Tensor  # [experts, hidden]
    gate_up_weight: torch.Tensor  # [experts, 2 * intermediate, hidden]: each expert's w1 rows, then its w3 rows
    down_weight: torch.Tensor  # [experts, hidden, intermediate]
    act: nn.Module
    num_experts: int
    top_k: int
    heads: int
    kv_heads: int
    head_dim: int
    scaling: float
    layer_idx: int
    sliding_window: Optional[int] = None
    qkv_bias: Optional[torch.Tensor] = None  # Mixtral has none (FusedLayer's methods read them)
    o_bias: Optional[torch.Tensor] = None
    gemms: Optional[dict] = None  # (`FusedLayer.qkv` reads it: Mixtral's projections stay plain)

    step = moe_block_step  # layer.step(x, cos, sin, attend)

    input_norm = FusedLayer.input_norm
    post_norm = FusedLayer.post_norm
    qkv = FusedLayer.qkv
    add_o_proj = FusedLayer.add_o_proj

    def router(self, h: torch.Tensor) -> torch.Tensor:
        return F.linear(h, self.router_weight)

    def expert(self, e: int, h: torch.Tensor) -> torch.Tensor:
        """h: [n, hidden] -> [n, hidden], as transformers' fused `MixtralExperts` (gate and up in one matmul)."""
        return self.expert_down(e, self.expert_act(self.expert_gate_up(e, h)))

    # the expert in parts, where a LoRA adapter adds its deltas (`swarm.modeling.lora_experts`)
    def expert_gate_up(self, e: int, h: torch.Tensor) -> torch.Tensor:
        return F.linear(h, self.gate_up_weight[e])  # [n, hidden] -> [n, 2 * intermediate]

    def expert_act(self, gate_up: torch.Tensor) -> torch.Tensor:
        gate, up = gate_up.chunk(2, dim=-1)
        return self.act(gate).mul_(up)  # [n, intermediate]

    def expert_down(self, e: int, a: torch.Tensor) -> torch.Tensor:
        return F.linear(a, self.down_weight[e])  # [n, intermediate] -> [n, hidden]


def _stack_experts(experts: nn.ModuleList, names: tuple) -> torch.Tensor:
    """Stack each expert's `names` weights (concatenated along rows) into [experts, rows, in]; afterwards the
    experts' parameters are views of the result."""
    stacked = torch.stack([torch.cat([getattr(expert, name).weight.detach() for name in names]) for expert in experts])
    for e, expert in enumerate(experts):
        row = 0
        for name in names:
            linear = getattr(expert, name)
            rows = linear.weight.shape[0]
            linear.weight = nn.Parameter(stacked[e, row:row + rows], requires_grad=False)
            row += rows
    return stacked


def expert_sizes(config, block: int) -> Tuple[int, int]:
    """(experts, one expert's intermediate size) of a block (`FamilySpec.lora`): every block routes (and GPT-OSS's)."""
    return int(config.num_local_experts), int(config.intermediate_size)


def fuse_layer(layer: MixtralDecoderLayer) -> FusedMoeLayer:
    """The fused view of a loaded layer; afterwards its q/k/v and experts' parameters are views into it."""
    attn, moe = layer.self_attn, layer.block_sparse_moe
    qkv_weight = _share((attn.q_proj, attn.k_proj, attn.v_proj), "weight")
    assert qkv_weight is not None  # weights, unlike biases, always exist
    return FusedMoeLayer(
        input_norm_weight=layer.input_layernorm.weight, post_norm_weight=layer.post_attention_layernorm.weight,
        eps=layer.input_layernorm.variance_epsilon, qkv_weight=qkv_weight, o_weight_t=attn.o_proj.weight.t(),
        router_weight=moe.gate.weight, gate_up_weight=_stack_experts(moe.experts, ("w1", "w3")),
        down_weight=_stack_experts(moe.experts, ("w2",)), act=moe.act_fn, num_experts=moe.num_experts,
        top_k=moe.top_k, heads=layer.heads, kv_heads=layer.kv_heads, head_dim=layer.head_dim,
        scaling=layer.scaling, layer_idx=layer.layer_idx, sliding_window=layer.sliding_window,
    )
