"""The GPT-OSS family's decoder block: Llama's attention with biases and attention sinks, then its mixture of experts.

A block (`mixtral.moe_block_step`): input RMSNorm, q/k/v (with biases), rotary (YaRN by default), attention in
which each head's softmax also counts a learned sink logit (`self_attn.sinks` [heads]: probability mass that goes
nowhere), output projection + residual; post-attention RMSNorm, then the experts: the router (`mlp.router`, a
linear layer with a bias) picks each token's top `num_experts_per_tok` logits and softmaxes those, and each chosen
expert computes `gate_up = h @ gate_up_proj[e] + bias` with gate and up interleaved (even and odd columns), gate
clamped above at `swiglu_limit`, up clamped to +-limit, `(up + 1) * gate * sigmoid(alpha * gate)`, then
`@ down_proj[e] + bias`. Layers alternate between a sliding window and full attention (`layer_types`).
This is transformers' `GptOssDecoderLayer` with eager attention and eager experts, op for op
(tests/swarm/modeling/test_family_open_models.py compares).

The sinks make the attention something SDPA cannot compute: the layer's `attention_sinks` are read by
`layers.cache_attention` (prefill, passes without a cache) and `layers.layer_sdpa` (the server's batched decode and
arena attention), which compute it eagerly; the layer is its own `BlockLayer` (`fuse_layer`), not CUDA-graph
captured (`FamilySpec.graph_refusal`: the captured attention is SDPA). int8 / nf4 (`quantize_layer`): the attention's
projections through `quantize.quantize_linears`, each expert's gate_up and down as bitsandbytes modules of their own
(weights transposed to [out, in], biases kept); router, sinks and norms in float (equal to transformers' model
quantized locally: tests/swarm/modeling/test_gpt_oss_quant.py). Checkpoints in transformers'
names (`mlp.experts.gate_up_proj` [experts, hidden, 2 * intermediate], ...) load, and the hub's as published, with
MXFP4 experts (`*_blocks`, `*_scales`; `quantization_config.quant_method` mxfp4): the checkpoint reader dequantizes
them into these names (`swarm.modeling.checkpoint_quant`); MXFP4 tensors without that config are refused.
Written here rather than imported from transformers' modeling_gpt_oss (about 135 MB of resident imports per
process, `swarm.modeling.layers`).
"""
from __future__ import annotations

from typing import Tuple, cast

import torch
import torch.nn.functional as F
from torch import nn

from swarm.modeling.families.llama import DecoderLayer
from swarm.modeling.families.mixtral import moe_block_step


class GptOssExperts(nn.Module):
    """Every expert's weights, stacked as transformers 5 keeps them (x @ weight, not linear layers)."""

    def __init__(self, config):
        super().__init__()
        experts, hidden, inter = int(config.num_local_experts), int(config.hidden_size), int(config.intermediate_size)
        self.gate_up_proj = nn.Parameter(torch.empty(experts, hidden, 2 * inter))  # gate, up interleaved columns
        self.gate_up_proj_bias = nn.Parameter(torch.empty(experts, 2 * inter))
        self.down_proj = nn.Parameter(torch.empty(experts, inter, hidden))
        self.down_proj_bias = nn.Parameter(torch.empty(experts, hidden))
        self.alpha, self.limit = float(config.swiglu_alpha), float(config.swiglu_limit)


class GptOssMoe(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.router = nn.Linear(config.hidden_size, int(config.num_local_experts), bias=True)
        self.experts = GptOssExperts(config)


class GptOssDecoderLayer(DecoderLayer):
    """`layer(hidden, attention_mask, position_ids, past_key_values, use_cache, position_embeddings)` -> hidden."""

    step = moe_block_step  # layer.step(x, cos, sin, attend)

    def __init__(self, config, layer_idx: int):
        bias = bool(getattr(config, "attention_bias", True))
        super().__init__(config, layer_idx, qkv_bias=bias, o_bias=bias)
        self.self_attn.sinks = nn.Parameter(torch.empty(self.heads))
        self.mlp = GptOssMoe(config)  # type: ignore[assignment]
        self.num_experts, self.top_k = int(config.num_local_experts), int(config.num_experts_per_tok)
        layer_types = getattr(config, "layer_types", None) or []
        sliding = layer_idx < len(layer_types) and layer_types[layer_idx] == "sliding_attention"
        self.sliding_window = int(config.sliding_window) if sliding and config.sliding_window else None

    @property
    def moe(self) -> GptOssMoe:
        return cast(GptOssMoe, self.mlp)

    @property
    def attention_sinks(self) -> torch.Tensor:
        """[heads]: each head's sink logit (`layers.cache_attention` adds it to the softmax)."""
        return cast(torch.Tensor, self.self_attn.sinks)

    def load_state_dict(self, state_dict, strict: bool = True, assign: bool = False):
        mxfp4 = sorted(k for k in state_dict if k.endswith(("_blocks", "_scales")))
        if mxfp4:
            raise ValueError(f"GPT-OSS experts in MXFP4 ({', '.join(mxfp4[:2])}, ...) but config.json has no "
                             f"quantization_config with quant_method mxfp4")
        return super().load_state_dict(state_dict, strict=strict, assign=assign)

    # what `mixtral.sparse_moe` reads

    def route(self, h: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
        """h: [tokens, hidden] -> (weights [tokens, top_k], experts [tokens, top_k]): the softmax of the top logits."""
        logits = self.moe.router(h)  # [tokens, experts]
        top, chosen = torch.topk(logits, self.top_k, dim=-1)
        return F.softmax(top, dim=1, dtype=top.dtype), chosen

    def expert(self, e: int, h: torch.Tensor) -> torch.Tensor:
        """h: [n, hidden] -> [n, hidden]: expert e's clamped SwiGLU with biases."""
        return self.expert_down(e, self.expert_act(self.expert_gate_up(e, h)))

    # the expert in parts, where a LoRA adapter adds its deltas (`swarm.modeling.lora_experts`)
    def expert_gate_up(self, e: int, h: torch.Tensor) -> torch.Tensor:
        experts = self.moe.experts
        if hasattr(experts, "gate_up_q"):  # quantized (`quantize_layer`)
            return experts.gate_up_q[e](h).to(h.dtype)
        return h @ experts.gate_up_proj[e] + experts.gate_up_proj_bias[e]  # [n, 2 * intermediate], interleaved

    def expert_act(self, gate_up: torch.Tensor) -> torch.Tensor:
        experts = self.moe.experts
        gate, up = gate_up[..., ::2], gate_up[..., 1::2]
        gate = gate.clamp(min=None, max=experts.limit)
        up = up.clamp(min=-experts.limit, max=experts.limit)
        return (up + 1) * (gate * torch.sigmoid(gate * experts.alpha))  # [n, intermediate]

    def expert_down(self, e: int, a: torch.Tensor) -> torch.Tensor:
        experts = self.moe.experts
        if hasattr(experts, "down_q"):  # quantized (`quantize_layer`)
            return experts.down_q[e](a).to(a.dtype)
        return a @ experts.down_proj[e] + experts.down_proj_bias[e]  # [n, hidden]


# what int8 / nf4 keep in float and what they quantize beyond the linear modules (`FamilySpec.quant`)
QUANT_KEEP = ("mlp.router",)
QUANT_STACKED = ("mlp.experts.gate_up_proj", "mlp.experts.down_proj")


def quantize_layer(quant, layer: GptOssDecoderLayer, quant_type: str, dtype: torch.dtype, device: torch.device
                   ) -> nn.Module:
    """The layer with int8 / nf4 projections (`FamilySpec.quant`): q/k/v/o through `quantize.quantize_linears`, and
    each expert's gate_up ([hidden, 2 * inter] stored, [2 * inter, hidden] quantized, its gate/up columns still
    interleaved) and down as bitsandbytes modules of their own, with their biases. Kept in the serving dtype: the
    norms, the sinks and the router (`QUANT_KEEP`, whose top-k choice quantization noise should not flip, as
    Mixtral's and Qwen3-MoE's quantized blocks keep theirs)."""
    from swarm.modeling.quantize import quantize_linears, quantized_linear

    experts = layer.moe.experts
    stacked = {k: experts._parameters.pop(k) for k in ("gate_up_proj", "gate_up_proj_bias", "down_proj",
                                                      "down_proj_bias")}
    quantize_linears(layer, quant_type, dtype, device, keep=quant.keep)
    gate_up, gate_up_bias = cast(torch.Tensor, stacked["gate_up_proj"]), stacked["gate_up_proj_bias"]
    down, down_bias = cast(torch.Tensor, stacked["down_proj"]), stacked["down_proj_bias"]
    experts.gate_up_q = nn.ModuleList(quantized_linear(gate_up[e].t(), gate_up_bias[e], quant_type, dtype, device)
                                      for e in range(layer.num_experts))
    experts.down_q = nn.ModuleList(quantized_linear(down[e].t(), down_bias[e], quant_type, dtype, device)
                                   for e in range(layer.num_experts))
    return layer.eval().requires_grad_(False)


def fuse_layer(layer: GptOssDecoderLayer) -> GptOssDecoderLayer:
    """The layer is its own `BlockLayer`: the server's batched steps run its `step` (eager attention with sinks,
    `layers.layer_sdpa`)."""
    return layer

