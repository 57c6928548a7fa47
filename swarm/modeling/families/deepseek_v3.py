"""The DeepSeek-V3 family's decoder block: multi-head latent attention (MLA) over a compressed cache, then a dense MLP
(the first `first_k_dense_replace` blocks) or routed experts with shared experts and grouped top-k routing.

Attention (`mla_attention`), as transformers' `DeepseekV3Attention` computes it:
- queries: `q_proj` (`q_lora_rank` None), or `q_b_proj(RMSNorm(q_a_proj(h)))`: [..., heads, nope + rope];
- keys/values: `kv_a_proj_with_mqa(h)` = [latent (kv_lora_rank), k_rot (qk_rope_head_dim)]; the latent through
  `kv_a_layernorm`; `kv_b_proj` [heads * (nope + v_head_dim), kv_lora_rank] expands it to each head's key part
  without rotary (W_uk) and its value (W_uv); the rotary key is one head shared by all;
- rotary on the rope parts of q and k (interleaved pairs with `rope_interleave`, DeepSeek's layout), logits scaled by
  qk_head_dim ** -0.5 (times YaRN's mscale_all_dim factor squared).
The server caches per token and block only [latent, k_rot] (kv_lora_rank + qk_rope_head_dim channels, one "head")
instead of every head's keys and values: W_uk is absorbed into the query (q_nope @ W_uk gives a query against the
latent, so q . k = [q_nope W_uk, q_rot] . [latent, k_rot]) and W_uv applied after the attention (the attention's
output over the latent, then per head @ W_uv^T). The attention is then multi-query attention with one key head of
kv_lora_rank + rope channels whose value is the key's first kv_lora_rank channels: the layer's `attend` call is the
server's usual one (`kv_heads` 1, `head_dim` kv_lora_rank + rope, values of kv_lora_rank), and its cache stores the
values as views of the keys (`swarm.modeling.shape.CacheLayout`'s values_in_keys; `server.compute.cache.SessionKV`,
`server.compute.kv_arena`). DeepSeek-V3's real sizes: (512 + 64) channels per token and block, 1152 bytes in bfloat16,
against 128 heads * (192 + 128) = 40960 channels (81920 bytes) of full keys and values: 71x less.
Mathematically this is transformers' attention; in float32 the outputs differ by rounding only (the tests compare
logits within 1e-4).

Experts (`DeepseekV3MoE`): the router (`mlp.gate.weight` [experts, hidden], in float32) scores each token with a
sigmoid; `e_score_correction_bias` is added for the choice only; the experts are split into `n_group` groups, each
group scored by its top two, the `topk_group` best groups kept, and the top `num_experts_per_tok` experts of those
chosen; their (uncorrected) scores renormalized with `norm_topk_prob` and times `routed_scaling_factor` weight the
experts' outputs (`mixtral.sparse_moe`, this layer's `route`); `shared_experts` (an MLP of moe_intermediate_size *
n_shared_experts) run on every token and add.
Checkpoints load in the hub's per-expert names (`mlp.experts.{e}.gate_proj`, ...) and in transformers 5's fused
layout (`mlp.experts.gate_up_proj` [experts, 2 * moe_intermediate, hidden]: `qwen3_moe.from_fused_layout`).

The layer is its own `BlockLayer` (`fuse_layer`). int8 / nf4 (`FamilySpec.quant`) swap every projection for a
bitsandbytes module but `kv_b_proj` (the absorbed attention reads its weight as a matrix: `QUANT_KEEP`) and the
router, which stay in the serving dtype. Not captured in CUDA graphs (`FamilySpec.graph_refusal`: data-dependent
routing; the graphs' static attention reads keys and values of one size), no tensor parallelism. The router weight
is cast to the serving dtype like every weight (transformers keeps it in float32; the routing itself runs in
float32). The hub's checkpoints are block-scaled FP8 (every
projection float8_e4m3fn with a `weight_scale_inv` per 128 x 128 block), dequantized as they are read
(`swarm.modeling.checkpoint_quant`). Their multi-token-prediction layer (block `num_hidden_layers`) is not served: a
server logs one line and never reads it (`server.compute.blocks`). Written here rather than imported from
transformers' modeling_deepseek_v3 (about 135 MB of resident imports per process, `swarm.modeling.layers`).

LoRA adapters (`swarm.modeling.lora`): every projection goes through the layer's `project` (q_proj / q_a_proj /
q_b_proj, kv_a_proj_with_mqa, o_proj, the dense MLP's and the shared experts' gate/up/down), where an adapter's rows
add their deltas. kv_b_proj's delta s * B @ A is absorbed like its weight (`absorbed`: per head, the query's q_nope
@ (s B_uk) @ A and the output's (o @ A^T) @ (s B_uv)^T on that adapter's rows; exact, and the cached latent is not
touched by it). The routed experts' stacked parameters through peft's `target_parameters`
(`swarm.modeling.lora_experts`; `expert_gate_up`, `expert_act`, `expert_down`). On int8 / nf4 blocks the same: the
adapter's deltas add to the bitsandbytes modules' outputs, and kv_b_proj stays float.
"""
from __future__ import annotations

import math
from dataclasses import replace
from typing import Dict, Optional, Tuple, cast

import torch
import torch.nn.functional as F
from torch import nn

from swarm.modeling.families.llama import MLP, Attend
from swarm.modeling.families.qwen3_moe import from_fused_layout
from swarm.modeling.layers import AttentionIndexedLayer, RMSNorm, step_forward
from swarm.modeling.shape import ModelShape


def yarn_mscale(scale: float, mscale: float) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def attention_scaling(config) -> float:
    """qk_head_dim ** -0.5, times YaRN's mscale(factor, mscale_all_dim) squared where the RoPE type scales."""
    scaling = float(config.qk_nope_head_dim + config.qk_rope_head_dim) ** -0.5
    rope = getattr(config, "rope_parameters", None) or {}
    if rope.get("rope_type", "default") != "default" and rope.get("mscale_all_dim", 0):
        factor = yarn_mscale(float(rope["factor"]), float(rope["mscale_all_dim"]))
        scaling = scaling * factor * factor
    return scaling


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleaved: bool) -> torch.Tensor:
    """x [..., n, rope] rotated by cos/sin [..., 1, rope] (cat(freqs, freqs)): DeepSeek's interleaved pairs
    (x0, x1), (x2, x3), ... (the result de-interleaved, as transformers' `apply_rotary_pos_emb_interleave`), else
    rotate_half's halves."""
    half = x.shape[-1] // 2
    if interleaved:
        c, s = cos[..., :half], sin[..., :half]
        x1, x2 = x[..., 0::2], x[..., 1::2]
        return torch.cat([x1 * c - x2 * s, x2 * c + x1 * s], dim=-1)
    return x * cos + torch.cat((-x[..., half:], x[..., :half]), dim=-1) * sin


class MlaAttention(nn.Module):
    """The attention's projections under transformers' names."""

    def __init__(self, config, layer_idx: int):
        super().__init__()
        self.layer_idx = layer_idx
        hidden, heads = int(config.hidden_size), int(config.num_attention_heads)
        self.q_lora_rank: Optional[int] = config.q_lora_rank
        qk_head_dim = int(config.qk_nope_head_dim) + int(config.qk_rope_head_dim)
        bias = bool(getattr(config, "attention_bias", False))
        if self.q_lora_rank is None:
            self.q_proj = nn.Linear(hidden, heads * qk_head_dim, bias=False)
        else:
            self.q_a_proj = nn.Linear(hidden, self.q_lora_rank, bias=bias)
            self.q_a_layernorm = RMSNorm(self.q_lora_rank)
            self.q_b_proj = nn.Linear(self.q_lora_rank, heads * qk_head_dim, bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(hidden, int(config.kv_lora_rank) + int(config.qk_rope_head_dim), bias=bias)
        self.kv_a_layernorm = RMSNorm(int(config.kv_lora_rank))
        self.kv_b_proj = nn.Linear(int(config.kv_lora_rank),
                                   heads * (int(config.qk_nope_head_dim) + int(config.v_head_dim)), bias=False)
        self.o_proj = nn.Linear(heads * int(config.v_head_dim), hidden, bias=bias)


def mla_attention(layer, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, attend: Attend) -> torch.Tensor:
    """The latent attention's output projection of h: [..., hidden] (normed) -> [..., hidden]; cos, sin: [...,
    rope], the rotary angles of each token's position (see the module docstring for the absorbed form)."""
    attn = cast(MlaAttention, layer.self_attn)
    heads, nope, rope, rank, v_dim = layer.heads, layer.nope_dim, layer.rope_dim, layer.rank, layer.v_dim
    project = layer.project  # (a LoRA adapter's `lora.AdaptedLayer.project` adds its deltas)
    if attn.q_lora_rank is None:
        q = project("self_attn.q_proj", h)
    else:
        q = project("self_attn.q_b_proj", attn.q_a_layernorm(project("self_attn.q_a_proj", h)))
    q_nope, q_rot = q.unflatten(-1, (heads, nope + rope)).split([nope, rope], dim=-1)  # [..., heads, nope / rope]
    latent, k_rot = project("self_attn.kv_a_proj_with_mqa", h).split([rank, rope], dim=-1)  # [..., rank], [..., rope]
    latent = attn.kv_a_layernorm(latent)
    cos, sin = cos.unsqueeze(-2), sin.unsqueeze(-2)  # [..., 1, rope]
    q_rot = rotate(q_rot, cos, sin, layer.rope_interleave)
    k_rot = rotate(k_rot.unsqueeze(-2), cos, sin, layer.rope_interleave)  # [..., 1, rope]
    w = attn.kv_b_proj.weight.view(heads, nope + v_dim, rank)  # per head: W_uk rows, then W_uv rows
    q_latent = torch.einsum("...hn,hnr->...hr", q_nope, w[:, :nope])  # [..., heads, rank]
    deltas = layer.absorbed("self_attn.kv_b_proj") if hasattr(layer, "absorbed") else []
    if deltas:
        q_latent = q_latent.contiguous()  # (the deltas go into its rows' memory)
    for r0, r1, lora in deltas:  # kv_b_proj's LoRA delta s * B @ A on its rows: q_nope @ (s B_uk) @ A
        b_t = lora.b_t.view(-1, heads, nope + v_dim)  # [r, heads, nope + v_dim]: s * B^T per head
        low = torch.einsum("thn,jhn->thj", q_nope.reshape(-1, heads, nope)[r0:r1], b_t[:, :, :nope])
        q_latent.view(-1, heads, rank)[r0:r1] += low @ lora.a_t.t()  # [rows, heads, r] @ [r, rank]
    query = torch.cat([q_latent, q_rot], dim=-1)  # [..., heads, rank + rope]
    key = torch.cat([latent.unsqueeze(-2), k_rot], dim=-1)  # [..., 1, rank + rope]: what the cache holds
    o = attend(layer, query, key, key[..., :rank]).unflatten(-1, (heads, rank))  # [..., heads, rank] over the latent
    o_v = torch.einsum("...hr,hvr->...hv", o, w[:, nope:])  # [..., heads, v_dim]
    if deltas:
        o_v = o_v.contiguous()
    for r0, r1, lora in deltas:  # and (o @ A^T) @ (s B_uv)^T per head
        b_t = lora.b_t.view(-1, heads, nope + v_dim)
        low = o.reshape(-1, heads, rank)[r0:r1] @ lora.a_t  # [rows, heads, r]
        o_v.view(-1, heads, v_dim)[r0:r1] += torch.einsum("thj,jhv->thv", low, b_t[:, :, nope:])
    return project("self_attn.o_proj", o_v.flatten(-2))


def deepseek_block_step(layer, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, attend: Attend
                        ) -> torch.Tensor:
    """One block on x: [..., hidden] (tokens on the leading dims); cos, sin: [..., rope]. Returns [..., hidden]."""
    x = x + mla_attention(layer, layer.input_layernorm(x), cos, sin, attend)
    h = layer.post_attention_layernorm(x)
    project = layer.project
    if not layer.sparse:
        act = cast(MLP, layer.mlp).act_fn
        return x + project("mlp.down_proj", act(project("mlp.gate_proj", h)) * project("mlp.up_proj", h))
    from swarm.modeling.families.mixtral import sparse_moe  # (mixtral imports quantize: bitsandbytes only when it runs)

    act = cast(DeepseekV3MoE, layer.mlp).shared_experts.act_fn
    return x + (sparse_moe(layer, h) + project("mlp.shared_experts.down_proj", act(
        project("mlp.shared_experts.gate_proj", h)) * project("mlp.shared_experts.up_proj", h)))


class TopkRouter(nn.Module):
    e_score_correction_bias: torch.Tensor  # [experts], a buffer

    def __init__(self, config):
        super().__init__()
        experts = int(config.n_routed_experts)
        self.weight = nn.Parameter(torch.empty(experts, int(config.hidden_size)))
        self.register_buffer("e_score_correction_bias", torch.zeros(experts))


class DeepseekV3MoE(nn.Module):
    def __init__(self, config, shape: ModelShape):
        super().__init__()
        experts, inter = int(config.n_routed_experts), int(config.moe_intermediate_size)
        self.gate = TopkRouter(config)
        self.experts = nn.ModuleList(MLP(_sized(shape, inter), bias=False) for _ in range(experts))
        self.shared_experts = MLP(_sized(shape, inter * int(config.n_shared_experts)), bias=False)


def _sized(shape: ModelShape, intermediate: int) -> ModelShape:
    return replace(shape, intermediate_size=intermediate)


class DeepseekV3DecoderLayer(AttentionIndexedLayer):
    """`layer(hidden, attention_mask, position_ids, past_key_values, use_cache, position_embeddings)` -> hidden;
    also its own `BlockLayer`: `heads`, `kv_heads` (1), `head_dim` (kv_lora_rank + qk_rope_head_dim: the cached
    latent key), `scaling`, `step`."""

    step = deepseek_block_step
    sliding_window = None

    def __init__(self, config, layer_idx: int):
        super().__init__()
        shape = ModelShape.from_config(config)
        self.heads, self.kv_heads = int(config.num_attention_heads), 1
        self.rank, self.rope_dim = int(config.kv_lora_rank), int(config.qk_rope_head_dim)
        self.nope_dim, self.v_dim = int(config.qk_nope_head_dim), int(config.v_head_dim)
        self.head_dim = self.rank + self.rope_dim
        self.scaling = attention_scaling(config)
        self.rope_interleave = bool(getattr(config, "rope_interleave", True))
        self.self_attn = MlaAttention(config, layer_idx)
        self.sparse = layer_idx >= int(config.first_k_dense_replace or 0) and int(config.n_routed_experts or 0) > 0
        if self.sparse:
            experts, groups = int(config.n_routed_experts), int(config.n_group or 1)
            if experts % groups or experts // groups < 2:
                raise ValueError(f"DeepSeek-V3 routing needs n_routed_experts ({experts}) split into n_group "
                                 f"({groups}) groups of at least 2")
            self.num_experts, self.top_k, self.groups = experts, int(config.num_experts_per_tok), groups
            self.topk_group = int(config.topk_group or groups)
            self.norm_topk_prob = bool(config.norm_topk_prob)
            self.routed_scaling_factor = float(config.routed_scaling_factor)
            self.mlp: nn.Module = DeepseekV3MoE(config, shape)
        else:
            self.mlp = MLP(shape, bias=False)
        self.input_layernorm = RMSNorm(shape.hidden_size, eps=shape.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(shape.hidden_size, eps=shape.rms_norm_eps)

    forward = step_forward  # transformers' layer call, through `step` (`layers.step_forward`)

    def load_state_dict(self, state_dict, strict: bool = True, assign: bool = False):
        """Either layout of the experts' tensors (`qwen3_moe.from_fused_layout`)."""
        if self.sparse:
            state_dict = from_fused_layout(dict(state_dict), self.num_experts)
        return super().load_state_dict(state_dict, strict=strict, assign=assign)

    # what `mixtral.sparse_moe` reads

    def route(self, h: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
        """h: [tokens, hidden] -> (weights float32 [tokens, top_k], experts [tokens, top_k]): grouped top-k routing,
        as transformers' `DeepseekV3TopkRouter`."""
        router = cast(DeepseekV3MoE, self.mlp).gate
        scores = F.linear(h.float(), router.weight.float()).sigmoid()  # [tokens, experts]
        for_choice = scores + router.e_score_correction_bias.float()
        group_scores = for_choice.view(-1, self.groups, self.num_experts // self.groups).topk(2, dim=-1)[0].sum(-1)
        kept = torch.topk(group_scores, k=self.topk_group, dim=-1, sorted=False)[1]  # [tokens, topk_group]
        group_mask = torch.zeros_like(group_scores).scatter_(1, kept, 1)  # [tokens, groups]
        expert_mask = group_mask.unsqueeze(-1).expand(-1, self.groups, self.num_experts // self.groups)
        for_choice = for_choice.masked_fill(~expert_mask.reshape(-1, self.num_experts).bool(), float("-inf"))
        chosen = torch.topk(for_choice, k=self.top_k, dim=-1, sorted=False)[1]
        weights = scores.gather(1, chosen)
        if self.norm_topk_prob:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        return weights * self.routed_scaling_factor, chosen

    def expert(self, e: int, h: torch.Tensor) -> torch.Tensor:
        expert = cast(MLP, cast(DeepseekV3MoE, self.mlp).experts[e])
        return expert.down_proj(expert.act_fn(expert.gate_proj(h)) * expert.up_proj(h))

    # the expert in parts, where a LoRA adapter adds its deltas (`swarm.modeling.lora_experts`)
    def expert_gate_up(self, e: int, h: torch.Tensor) -> torch.Tensor:
        expert = cast(MLP, cast(DeepseekV3MoE, self.mlp).experts[e])
        return torch.cat([expert.gate_proj(h), expert.up_proj(h)], dim=-1)  # [n, 2 * intermediate]: gate, up

    def expert_act(self, gate_up: torch.Tensor) -> torch.Tensor:
        gate, up = gate_up.chunk(2, dim=-1)
        return cast(MLP, cast(DeepseekV3MoE, self.mlp).experts[0]).act_fn(gate) * up  # [n, intermediate]

    def expert_down(self, e: int, a: torch.Tensor) -> torch.Tensor:
        return cast(MLP, cast(DeepseekV3MoE, self.mlp).experts[e]).down_proj(a)  # [n, hidden]

    def project(self, name: str, h: torch.Tensor) -> torch.Tensor:
        """The projection `name` ("self_attn.q_a_proj", "mlp.shared_experts.up_proj", ...) of h [..., in] ->
        [..., out] (what a LoRA adapter's `lora.AdaptedLayer.project` adds its deltas to)."""
        return self.get_submodule(name)(h)


# int8 / nf4 (`FamilySpec.quant`, `swarm.modeling.quantize.quantize_linears`):
# q_proj (or q_a_proj and q_b_proj), kv_a_proj_with_mqa, o_proj, the dense MLP or every routed expert's and
# the shared experts' gate/up/down become bitsandbytes modules, called as modules by the same step.
#
# Kept in the serving dtype: the norms, the router (`mlp.gate`, a tiny [experts, hidden] matrix whose top-k
# choice quantization noise should not flip, as Mixtral's and Qwen3-MoE's quantized blocks keep theirs), and
# `kv_b_proj` (`QUANT_KEEP`). The absorbed attention never calls kv_b_proj on an input: it reads its weight
# as per-head matrices, W_uk multiplied into the query and W_uv applied to the attention's output over the
# latent (`mla_attention`). bitsandbytes' packed int8 / nf4 weight is only usable inside its own matmul, so a
# quantized kv_b_proj would be dequantized into a float temporary every step (the same numbers as keeping
# the dequantized matrix), or the cached latent expanded back through it into every head's keys and values
# every step (what the latent cache exists to avoid). At DeepSeek-V3's sizes kv_b_proj is [128 * (128 +
# 128), 512] = 16.8M parameters, 32 MiB in bfloat16: 0.15% of an expert block's 11.5G parameters (0.52% of
# its 6199 MiB in nf4, 0.27% of 11677 MiB in int8), 2.9% of a dense first block's 584M (9.5% of its 336 MiB
# in nf4); quantized to nf4 it would take 9 MiB, 23 MiB less per block.
QUANT_KEEP = ("self_attn.kv_b_proj",)


def expert_sizes(config, block: int) -> Optional[Tuple[int, int]]:
    """(routed experts, one expert's intermediate size) of a block, None for a dense one (`FamilySpec.lora`)."""
    if block < int(config.first_k_dense_replace or 0) or not int(config.n_routed_experts or 0):
        return None
    return int(config.n_routed_experts), int(config.moe_intermediate_size)


def lora_shapes(config, block: int) -> Dict[str, Tuple[int, int]]:
    """The LoRA targets of block `block` -> (out_features, in_features) of their projections (`FamilySpec.lora`):
    q_proj or q_a_proj / q_b_proj, the latent attention's, a dense MLP or the shared experts."""
    hidden, heads = int(config.hidden_size), int(config.num_attention_heads)
    rope, nope, v_dim = int(config.qk_rope_head_dim), int(config.qk_nope_head_dim), int(config.v_head_dim)
    rank = int(config.kv_lora_rank)
    shapes = {"kv_a_proj_with_mqa": (rank + rope, hidden), "kv_b_proj": (heads * (nope + v_dim), rank),
              "o_proj": (hidden, heads * v_dim)}
    if config.q_lora_rank is None:
        shapes["q_proj"] = (heads * (nope + rope), hidden)
    else:
        shapes.update(q_a_proj=(int(config.q_lora_rank), hidden), q_b_proj=(heads * (nope + rope),
                                                                             int(config.q_lora_rank)))
    if expert_sizes(config, block) is None:
        prefix, inter = "", int(config.intermediate_size)
    else:
        prefix, inter = "shared_experts.", int(config.moe_intermediate_size) * int(config.n_shared_experts)
    shapes.update({f"{prefix}gate_proj": (inter, hidden), f"{prefix}up_proj": (inter, hidden),
                   f"{prefix}down_proj": (hidden, inter)})
    return shapes


def fuse_layer(layer: DeepseekV3DecoderLayer) -> DeepseekV3DecoderLayer:
    """The layer is its own `BlockLayer` (see the module docstring)."""
    return layer

