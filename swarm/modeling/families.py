"""Model families: where each family keeps its blocks and its client-side parts.

Client and server must agree on how a checkpoint is cut: which tensors belong to block i (the server loads
those), and which are the embeddings, final norm and LM head (the client loads those). One `FamilySpec` per
supported `config.model_type` names the family's modeling module and the classes in it. A new family is one
module plus its tests; `swarm.modeling.llama` serves llama, mistral and qwen2, `swarm.modeling.mixtral` mixtral.
A family module provides
- its decoder layer class (nn.Modules under transformers' parameter names) with transformers' calling convention
  `layer(hidden, attention_mask, position_ids, past_key_values, position_embeddings=(cos, sin))`, and its rotary
  embedding and RMSNorm classes (the RMSNorm is also the client's final norm);
- optionally a function (`FamilySpec.fuse`) that turns a loaded layer into a `BlockLayer`, which the server's
  batched decode, prefill and CUDA-graph steps run; without it the server runs the layer modules.
"""
from __future__ import annotations

import importlib
from dataclasses import dataclass, replace
from typing import Callable, Optional, Protocol

import torch


class UnsupportedModelError(ValueError):
    pass


class BlockLayer(Protocol):
    """What the server's steps (`server.decode`, `server.graphs`) use of a layer: its attention's sizes and one
    block step. x: [..., hidden] (tokens on the leading dims), cos and sin: [..., head_dim];
    `attend(layer, q [..., heads, head_dim], k [..., kv_heads, head_dim], v) -> [..., heads * head_dim]` is the
    step's attention, given q and k with rotary applied."""
    heads: int
    kv_heads: int
    head_dim: int
    scaling: float
    layer_idx: int  # where the layer's keys/values are in the span's cache

    def step(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, attend: Callable) -> torch.Tensor: ...


@dataclass(frozen=True)
class FamilySpec:
    model_type: str
    block_prefix: str  # format with the block index: the prefix of that block's tensor names
    embed_key: str
    norm_key: str  # prefix of the final norm's tensors
    head_key: str  # LM head weight (may be absent when tied to the embeddings)
    layer_class: str
    rotary_class: Optional[str]
    norm_class: str
    module: str  # the family's modeling module, where the classes above are
    fuse: Optional[str] = None  # the module's function that makes a loaded layer a `BlockLayer`

    def block_tensor_prefix(self, index: int) -> str:
        return self.block_prefix.format(index)

    def import_class(self, name: str):
        return getattr(importlib.import_module(self.module), name)


def _llama_like(model_type: str, camel: str) -> FamilySpec:
    return FamilySpec(
        model_type=model_type,
        block_prefix="model.layers.{}.",
        embed_key="model.embed_tokens.weight",
        norm_key="model.norm.",
        head_key="lm_head.weight",
        layer_class=f"{camel}DecoderLayer",
        rotary_class=f"{camel}RotaryEmbedding",
        norm_class=f"{camel}RMSNorm",
        module="swarm.modeling.llama",
        fuse="fuse_layer",
    )


FAMILIES = {
    spec.model_type: spec
    for spec in (
        _llama_like("llama", "Llama"),
        _llama_like("mistral", "Mistral"),
        _llama_like("qwen2", "Qwen2"),
        # Llama's attention with a mixture of experts; both layouts of the experts' tensors load
        replace(_llama_like("mixtral", "Mixtral"), module="swarm.modeling.mixtral"),
    )
}


def family_for(config) -> FamilySpec:
    spec = FAMILIES.get(str(getattr(config, "model_type", "")))
    if spec is None:
        raise UnsupportedModelError(
            f"model type {getattr(config, 'model_type', None)!r} is not supported; supported: {sorted(FAMILIES)}"
        )
    return spec
