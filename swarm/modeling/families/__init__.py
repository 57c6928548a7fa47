"""Model families: where each family keeps its blocks and its client-side parts.

Client and server must agree on how a checkpoint is cut: which tensors belong to block i (the server loads
those), and which are the embeddings, final norm and LM head (the client loads those). One `FamilySpec` per
supported `config.model_type` holds the family's classes and functions themselves (`FAMILIES`, built here by
reference: no class is looked up by name). A new family is one module plus its tests and its line here;
`swarm.modeling.families.llama` serves llama, mistral and qwen2, `swarm.modeling.families.mixtral` mixtral,
`swarm.modeling.families.bloom` BLOOM, `swarm.modeling.families.falcon` Falcon, `swarm.modeling.families.qwen3` Qwen3,
`swarm.modeling.families.qwen3_moe` Qwen3-MoE,
`swarm.modeling.families.phi3` Phi-3, `swarm.modeling.families.gemma` Gemma 2 and 3 (text),
`swarm.modeling.families.gpt_oss` GPT-OSS and
`swarm.modeling.families.deepseek_v3` DeepSeek-V3. A family provides
- its decoder layer class (nn.Modules under transformers' parameter names) with transformers' calling convention
  `layer(hidden, attention_mask, position_ids, past_key_values, position_embeddings=(cos, sin))` (None without
  rotary), a settable `layer_idx`, its rotary embedding class (none for ALiBi-only families) and its norm class
  (also the client's final norm, and its embedding norm where the family has one: BLOOM);
- optionally a function (`FamilySpec.fuse`) that turns a loaded layer into a `BlockLayer`, which the server's
  batched decode, prefill and CUDA-graph steps run; without it the server runs the layer modules.
The spec is also the one place for what code elsewhere must know of a family (no `model_type` is compared outside
this package; tests/test_family_facts.py checks it):
- `quant` (`Quantization`): what int8 / nf4 quantize of its layers and what stays float (`Quantization.split`,
  which the server's memory planning counts and loading checks its quantized layers against) and how
  (`Quantization.build`);
- `lora` (`LoraLayout`): the projections a LoRA adapter may target, its routed experts per block, per-block target
  shapes where its blocks differ (DeepSeek-V3);
- its capabilities: `tensor_parallel`, `serves_adapters`, `graph_refusal`, `packed_gemms`.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Dict, List, Mapping, Optional, Protocol, Tuple

import torch
from torch import nn

from swarm.modeling.families import bloom, deepseek_v3, falcon, gemma, gpt_oss, llama, mixtral, phi3, qwen3, qwen3_moe
from swarm.modeling.layers import RMSNorm, RotaryEmbedding
from swarm.modeling.lora_targets import (
    ATTENTION_MODULES,
    DEEPSEEK_MODULES,
    LAYER_NORM_MODULES,
    MODULES,
    PHI3_MODULES,
)


class UnsupportedModelError(ValueError):
    pass


class BlockLayer(Protocol):
    """What the server's steps (`server.compute.decode`, `server.compute.graphs`) use of a layer: its attention's sizes
    and one block step. x: [..., hidden] (tokens on the leading dims), cos and sin: [..., head_dim] (None for a span
    without rotary); `attend(layer, q [..., heads, head_dim], k [..., kv_heads, head_dim], v) -> [..., heads *
    head_dim]` is the step's attention, given q and k with rotary applied. An ALiBi layer also has
    `key_bias(key_length, dtype, device) -> [heads, key_length]`, the bias its attention adds
    (`swarm.modeling.layers.key_bias`)."""
    heads: int
    kv_heads: int
    head_dim: int
    scaling: float
    layer_idx: int  # where the layer's keys/values are in the span's cache

    def step(self, x: torch.Tensor, cos: Optional[torch.Tensor], sin: Optional[torch.Tensor],
             attend: Callable) -> torch.Tensor: ...


@dataclass(frozen=True)
class QuantSplit:
    """What int8 / nf4 make of one block (`Quantization.split`): each quantized module's weight shape [out, in]
    (rows concatenated where the served layer fuses them: q;k;v, gate;up), the parameters those hold, and the
    parameters and float buffer values that stay at the serving dtype (norms, routers, biases, kept linears)."""
    modules: Tuple[Tuple[int, int], ...]
    quantized: int
    other: int


def _quantize_linears(quant: "Quantization", layer: nn.Module, quant_type: str, dtype: torch.dtype,
                      device: torch.device) -> nn.Module:
    """The layer (its own `BlockLayer`: BLOOM, Falcon, Gemma, DeepSeek-V3) with its linear modules but `quant.keep`
    swapped for bitsandbytes modules (`swarm.modeling.quantize.quantize_linears`)."""
    from swarm.modeling.quantize import quantize_linears  # (imports the family modules: not at this package's import)

    return quantize_linears(layer, quant_type, dtype, device, keep=quant.keep)


@dataclass(frozen=True)
class Quantization:
    """A family's int8 / nf4 (`--quant_type`): `split` says what they quantize of a layer (the family's layer, real
    or on the meta device) and what stays float; `build` makes the quantized layer from the fused float one. The
    server's memory planning counts `split` (`server.placement.memory`); loading (`server.compute.loading`) builds
    each block with `quantize` and checks its bitsandbytes modules against `split`, so the two cannot drift."""
    # (quant, fused layer, quant_type, dtype, device) -> the quantized layer that serves every path
    build: Callable = _quantize_linears
    keep: Tuple[str, ...] = ()  # linear modules left at the serving dtype (routers, DeepSeek-V3's kv_b_proj)
    joins: Tuple[Tuple[str, ...], ...] = ()  # sibling linear modules quantized as one (rows concatenated: q;k;v)
    # stacked [experts, in, out] parameters quantized as one module an expert, of its transposed [out, in] (GPT-OSS)
    stacked: Tuple[str, ...] = ()

    def quantize(self, fused, quant_type: str, dtype: torch.dtype, device: torch.device) -> nn.Module:
        return self.build(self, fused, quant_type, dtype, device)

    def split(self, layer: nn.Module) -> QuantSplit:
        """What `quantize` makes of `layer` (its parameter names as the family's layer has them)."""
        modules: List[Tuple[int, int]] = []
        joined: Dict[Tuple[str, int], List[Tuple[int, int]]] = {}
        quantized = other = 0
        for module_name, module in layer.named_modules():
            for name, param in module.named_parameters(recurse=False):
                full = f"{module_name}.{name}" if module_name else name
                if full in self.stacked:
                    experts, in_features, out_features = param.shape
                    modules += [(out_features, in_features)] * experts
                    quantized += param.numel()
                elif isinstance(module, nn.Linear) and name == "weight" and module_name not in self.keep:
                    quantized += param.numel()
                    parent, _, leaf = module_name.rpartition(".")
                    group = next((i for i, join in enumerate(self.joins) if leaf in join), None)
                    if group is None:
                        modules.append((param.shape[0], param.shape[1]))
                    else:
                        joined.setdefault((parent, group), []).append((param.shape[0], param.shape[1]))
                else:
                    other += param.numel()
            other += sum(b.numel() for b in module.buffers(recurse=False) if b.is_floating_point())
        for shapes in joined.values():
            modules.append((sum(out for out, _ in shapes), shapes[0][1]))
        return QuantSplit(tuple(modules), quantized, other)


@dataclass(frozen=True)
class LoraLayout:
    """Where a LoRA adapter may apply on a family's blocks (`swarm.modeling.lora_files` checks adapters by it)."""
    modules: Mapping[str, str] = field(default_factory=lambda: MODULES)  # target projection -> its parent module
    # (config, block) -> (experts, one expert's intermediate size) of the block's routed experts, None where it has
    # none (a dense block); None: a family without experts. Their stacked parameters take `target_parameters`
    # adapters (`swarm.modeling.lora_experts`)
    experts: Optional[Callable] = None
    # (config, block) -> target -> (out, in) where a family's blocks differ (DeepSeek-V3: q_proj or q_a/q_b, a dense
    # MLP or shared experts), each target then a group of its own; None: `lora_targets.target_shapes` of the model's
    # shape, the projections grouped by input (`lora_targets.PROJECTIONS`)
    shapes: Optional[Callable] = None


@dataclass(frozen=True)
class FamilySpec:
    model_type: str
    block_prefix: str  # format with the block index: the prefix of that block's tensor names
    embed_key: str
    norm_key: str  # prefix of the final norm's tensors
    head_key: str  # LM head weight (may be absent when tied to the embeddings)
    layer: type  # the decoder layer class: layer(config, layer_idx)
    rotary: Optional[type]  # rotary(config=config), None for ALiBi-only families
    norm: type  # norm(hidden_size, eps=...)
    fuse: Optional[Callable] = None  # a loaded layer -> its `BlockLayer`
    norm_eps: str = "rms_norm_eps"  # the config attribute of the norms' epsilon
    embed_norm_key: Optional[str] = None  # prefix of a norm the client applies to the embeddings (BLOOM)
    base_prefix: str = ""  # the base model's prefix, which checkpoints saved from the base model lack (BLOOM's)
    # its blocks split across devices (`swarm.modeling.tensor_parallel`: llama's and Mixtral's fused layers); a new
    # family: no
    tensor_parallel: bool = False
    # (config, embed, lm_head) -> (embed, lm_head): changes the client's parts (Gemma's embedding scale and final
    # soft-cap)
    client_parts: Optional[Callable] = None
    # LoRA adapters (`swarm.modeling.lora`) apply to its blocks (the mixtures of experts: their attention, and their
    # experts' stacked parameters through `target_parameters`, `swarm.modeling.lora_experts`)
    serves_adapters: bool = False
    # (config, held, total) -> whether extending a cached sequence of `held` positions to `total` computes all of it
    # again, as transformers' generate does (Phi-3's LongRoPE switching to its long factors: `phi3.recomputes_cache`)
    recompute_cache: Optional[Callable] = None
    quant: Quantization = Quantization()  # int8 / nf4: what is quantized and what stays float, and how
    lora: LoraLayout = LoraLayout()  # what LoRA adapters target (with `serves_adapters`)
    # why CUDA graphs (`server.compute.graphs`) cannot capture its decode steps (None: they can): layers that route
    # tokens to experts (data-dependent shapes, a host sync), or attention the captured SDPA is not (Gemma 2's
    # soft-caps, Gemma 3's 2 * head_dim wide cos/sin, GPT-OSS's sinks)
    graph_refusal: Optional[str] = None
    # its fused layers (`llama.FusedLayer`) take small-batch products packed for decode batch sizes
    # (`swarm.modeling.smallgemm`, `server.compute.loading.packed_rows_for`)
    packed_gemms: bool = False

    @property
    def blocks_prefix(self) -> str:
        """How the model's modules name its blocks (what an adapter config's target patterns match)."""
        return self.block_prefix.split("{}")[0]

    def block_tensor_prefix(self, index: int) -> str:
        return self.block_prefix.format(index)

    def load_norm(self, config, prefix: str, tensors: Dict[str, torch.Tensor]) -> torch.nn.Module:
        """The family's norm (its epsilon from the config) holding the `prefix` tensors of `tensors`."""
        norm = self.norm(config.hidden_size, eps=getattr(config, self.norm_eps, 1e-6))
        state = {k[len(prefix):]: v for k, v in tensors.items() if k.startswith(prefix)}
        if not state:
            raise ValueError(f"no {prefix}* tensors in the checkpoint")
        norm.load_state_dict(state)
        return norm


def _fused_build(pick: Callable) -> Callable:
    """A `Quantization.build` that makes a fused layer into `pick(swarm.modeling.quantize, fused)`, one of the
    quantized classes there (imported when a block is quantized: that module imports the family modules)."""
    def build(quant: Quantization, fused, quant_type: str, dtype: torch.dtype, device: torch.device) -> nn.Module:
        from swarm.modeling import quantize

        return pick(quantize, fused)(fused, quant_type, dtype, device)

    return build


# int8 / nf4 of the Llama family's fused layers (`llama.FusedLayer` -> `quantize.QuantizedLayer`: q;k;v, o, gate;up
# and down one bitsandbytes module each)
LLAMA_JOINS = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))
LLAMA_QUANT = Quantization(build=_fused_build(lambda q, fused: q.QuantizedLayer), joins=LLAMA_JOINS)
ROUTES = "the layers route tokens by their values (a host sync per block)"


def _llama_like(model_type: str, layer: type, fuse: Callable = llama.fuse_layer, norm: type = RMSNorm,
                rotary: type = RotaryEmbedding, **fields) -> FamilySpec:
    """`model.layers.{i}.` blocks, `model.embed_tokens`, `model.norm`, `lm_head`."""
    return FamilySpec(model_type=model_type, block_prefix="model.layers.{}.", embed_key="model.embed_tokens.weight",
                      norm_key="model.norm.", head_key="lm_head.weight", layer=layer, rotary=rotary, norm=norm,
                      fuse=fuse, **fields)


def _layer_norm_family(model_type: str, layer: type, fuse: Callable, rotary: Optional[type], embed_norm: bool
                       ) -> FamilySpec:
    """BLOOM and Falcon: `transformer.` names, LayerNorms, the layers their own `BlockLayer`s (their linear modules
    quantized as they are: q/k/v fused in the checkpoint)."""
    return FamilySpec(
        model_type=model_type,
        block_prefix="transformer.h.{}.",
        embed_key="transformer.word_embeddings.weight",
        norm_key="transformer.ln_f.",
        head_key="lm_head.weight",
        layer=layer,
        rotary=rotary,
        norm=nn.LayerNorm,
        fuse=fuse,
        norm_eps="layer_norm_epsilon",
        embed_norm_key="transformer.word_embeddings_layernorm." if embed_norm else None,
        base_prefix="transformer.",
        serves_adapters=True,
        lora=LoraLayout(modules=LAYER_NORM_MODULES),
    )


GEMMA_GRAPHS = ("Gemma 2's soft-capped attention and Gemma 3's 2 * head_dim wide cos/sin are not the captured "
                "attention")
MIXTURES = LoraLayout(modules=ATTENTION_MODULES, experts=mixtral.expert_sizes)  # attention modules, stacked experts

FAMILIES = {
    spec.model_type: spec
    for spec in (
        _llama_like("llama", llama.LlamaDecoderLayer, tensor_parallel=True, serves_adapters=True, quant=LLAMA_QUANT,
                    packed_gemms=True),
        _llama_like("mistral", llama.MistralDecoderLayer, tensor_parallel=True, serves_adapters=True,
                    quant=LLAMA_QUANT, packed_gemms=True),
        _llama_like("qwen2", llama.Qwen2DecoderLayer, tensor_parallel=True, serves_adapters=True, quant=LLAMA_QUANT,
                    packed_gemms=True),
        _layer_norm_family("bloom", bloom.BloomDecoderLayer, bloom.fuse_layer, rotary=None, embed_norm=True),  # ALiBi
        # rotary, or ALiBi with `alibi`
        _layer_norm_family("falcon", falcon.FalconDecoderLayer, falcon.fuse_layer, rotary=RotaryEmbedding,
                           embed_norm=False),
        # Llama's attention with a mixture of experts; both layouts of the experts' tensors load
        _llama_like("mixtral", mixtral.MixtralDecoderLayer, mixtral.fuse_layer, tensor_parallel=True,
                    serves_adapters=True, lora=MIXTURES, graph_refusal=ROUTES,
                    quant=Quantization(build=_fused_build(lambda q, fused: q.QuantizedMoeLayer),
                                       keep=mixtral.QUANT_KEEP, joins=LLAMA_JOINS + (("w1", "w3"),))),
        # Llama's block with q/k norms per head (and Qwen3-MoE's experts)
        _llama_like("qwen3", qwen3.Qwen3DecoderLayer, qwen3.fuse_layer, serves_adapters=True,
                    quant=Quantization(build=_fused_build(lambda q, fused: q.QuantizedQkNormLayer), joins=LLAMA_JOINS)),
        _llama_like("qwen3_moe", qwen3_moe.Qwen3MoeDecoderLayer, qwen3_moe.fuse_layer, serves_adapters=True,
                    lora=LoraLayout(modules=ATTENTION_MODULES, experts=qwen3_moe.expert_sizes), graph_refusal=ROUTES,
                    quant=Quantization(build=_fused_build(
                        lambda q, fused: q.QuantizedQkNormMoeLayer if isinstance(fused, qwen3_moe.FusedQkNormMoeLayer)
                        else q.QuantizedQkNormLayer), keep=qwen3_moe.QUANT_KEEP, joins=LLAMA_JOINS)),
        # Llama's block with q/k/v and gate/up fused in the checkpoint
        _llama_like("phi3", phi3.Phi3DecoderLayer, serves_adapters=True, recompute_cache=phi3.recomputes_cache,
                    quant=LLAMA_QUANT, lora=LoraLayout(modules=PHI3_MODULES)),
        # pre- and post-norms, scaled embeddings; Gemma 2 soft-caps (eager attention: `layers.layer_sdpa`),
        # Gemma 3 has q/k norms and two rotary bases
        _llama_like("gemma2", gemma.Gemma2DecoderLayer, gemma.fuse_layer, norm=gemma.GemmaRMSNorm,
                    client_parts=gemma.client_parts, serves_adapters=True, graph_refusal=GEMMA_GRAPHS),
        _llama_like("gemma3_text", gemma.Gemma3DecoderLayer, gemma.fuse_layer, norm=gemma.GemmaRMSNorm,
                    rotary=gemma.Gemma3RotaryEmbedding, client_parts=gemma.client_parts, serves_adapters=True,
                    graph_refusal=GEMMA_GRAPHS),
        # attention sinks (eager attention: `layers.layer_sdpa`) and its own experts
        _llama_like("gpt_oss", gpt_oss.GptOssDecoderLayer, gpt_oss.fuse_layer, serves_adapters=True, lora=MIXTURES,
                    graph_refusal=ROUTES + "; its attention has sinks, which the captured attention has not",
                    quant=Quantization(build=gpt_oss.quantize_layer, keep=gpt_oss.QUANT_KEEP,
                                       stacked=gpt_oss.QUANT_STACKED)),
        # multi-head latent attention (a latent cache: `shape.CacheLayout`), shared experts and grouped routing
        _llama_like("deepseek_v3", deepseek_v3.DeepseekV3DecoderLayer, deepseek_v3.fuse_layer,
                    serves_adapters=True, graph_refusal=ROUTES, quant=Quantization(keep=deepseek_v3.QUANT_KEEP),
                    lora=LoraLayout(modules=DEEPSEEK_MODULES, experts=deepseek_v3.expert_sizes,
                                    shapes=deepseek_v3.lora_shapes)),
    )
}


def family_for(config) -> FamilySpec:
    spec = FAMILIES.get(str(getattr(config, "model_type", "")))
    if spec is None:
        raise UnsupportedModelError(
            f"model type {getattr(config, 'model_type', None)!r} is not supported; supported: {sorted(FAMILIES)}"
        )
    return spec
