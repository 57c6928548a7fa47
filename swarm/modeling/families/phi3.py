"""The Phi-3 family's decoder block: Llama's block, with q/k/v and gate/up fused in the checkpoint.

Phi-3 (`model_type` "phi3": Phi-3 mini/small/medium, Phi-3.5-mini) computes what `llama.block_step` computes: its
attention's `self_attn.qkv_proj` [(heads + 2 * kv_heads) * head_dim, hidden] is q, k and v stacked by rows, and
its MLP's `mlp.gate_up_proj` [2 * intermediate, hidden] gate then up (`up * act(gate)`); no biases. So
`Phi3DecoderLayer` is `llama.DecoderLayer` whose `load_state_dict` splits those two tensors into the separate
projections' names (views); `fuse_layer` (`llama.fuse_layer`) concatenates them again for the server's steps, and
everything Llama's blocks have (batched decode, chunked prefill, CUDA graphs, int8/nf4, sliding windows on every
layer when the config names one) applies unchanged. LongRoPE ("longrope", the legacy "su"/"yarn" names of
Phi-3's configs) comes from transformers' RoPE functions in `layers.RotaryEmbedding`: the short factors up to
`original_max_position_embeddings`, the long ones past it, chosen per step from its largest position as
transformers' `Phi3RotaryEmbedding` does. A step computed in parts (the client's messages under a server's
`--max_step_tokens` or its `max_chunk_bytes`, a server's prefill chunks, a batch of several sessions' rows) picks
them for every part by the whole step's end: the client names it in each message (`Step.rope_length`, where it is
past the message's end; also on pushes, failover replays and spot-checks' `ForwardRequest`), the server keeps it on
the session (`SessionKV.rope_length`) and passes each row's to the rotary (`layers.rope_lengths`), so a prompt past
the boundary has the long factors in its first parts too, as transformers' one call over it.
A session that crosses that boundary: transformers' Phi-3 `generate` drops its cache at the first step whose
sequence reaches past `original_max_position_embeddings` (while the cache holds no more than that) and computes
the whole sequence again, so every position then has the long factors (`Phi3ForCausalLM.prepare_inputs_for_
generation`); before it, every step's factors are the short ones. A client does the same (`recomputes_cache`,
`FamilySpec.recompute_cache`: `swarm.client.model.model_session` sends the whole sequence again from position 0), so
its tokens and logits equal transformers' throughout.
Partial rotary (`partial_rotary_factor` < 1, Phi-4-mini) is refused with a clear error: `llama.block_step` rotates
whole heads.
"""
from __future__ import annotations

from typing import Dict

import torch

from swarm.modeling.families.llama import DecoderLayer
from swarm.modeling.layers import picks_by_length
from swarm.modeling.shape import ModelShape


def recomputes_cache(config, held: int, total: int) -> bool:
    """Whether a step that extends a sequence whose first `held` positions are cached to `total` positions must
    compute all of them again (see the module docstring): LongRoPE's factors switch from short to long at it,
    `0 < held <= original_max_position_embeddings < total`. (transformers drops its cache so whatever Phi-3's RoPE
    type; only LongRoPE's values change by it, so other types keep their cache here.)"""
    if not picks_by_length(config):
        return False
    return 0 < held <= int(config.rope_parameters["original_max_position_embeddings"]) < total


def split_fused(state: Dict[str, torch.Tensor], shape: ModelShape) -> Dict[str, torch.Tensor]:
    """A block's state dict with `self_attn.qkv_proj` and `mlp.gate_up_proj` as the separate projections (views)."""
    state = dict(state)
    q_size, kv_size = shape.num_heads * shape.head_dim, shape.num_kv_heads * shape.head_dim
    for suffix in ("weight", "bias"):
        qkv = state.pop(f"self_attn.qkv_proj.{suffix}", None)
        if qkv is not None:
            if qkv.shape[0] != q_size + 2 * kv_size:
                raise ValueError(f"self_attn.qkv_proj.{suffix} has {qkv.shape[0]} rows; {q_size} query + 2 * "
                                 f"{kv_size} key/value rows expected")
            state[f"self_attn.q_proj.{suffix}"] = qkv[:q_size]
            state[f"self_attn.k_proj.{suffix}"] = qkv[q_size:q_size + kv_size]
            state[f"self_attn.v_proj.{suffix}"] = qkv[q_size + kv_size:]
        gate_up = state.pop(f"mlp.gate_up_proj.{suffix}", None)
        if gate_up is not None:
            if gate_up.shape[0] != 2 * shape.intermediate_size:
                raise ValueError(f"mlp.gate_up_proj.{suffix} has {gate_up.shape[0]} rows; 2 * "
                                 f"{shape.intermediate_size} expected")
            state[f"mlp.gate_proj.{suffix}"] = gate_up[:shape.intermediate_size]
            state[f"mlp.up_proj.{suffix}"] = gate_up[shape.intermediate_size:]
    return state


class Phi3DecoderLayer(DecoderLayer):
    """`llama.DecoderLayer` loading Phi-3's fused `qkv_proj` and `gate_up_proj` tensors."""

    def __init__(self, config, layer_idx: int):
        rope = getattr(config, "rope_parameters", None) or {}
        if float(rope.get("partial_rotary_factor", 1.0)) != 1.0:
            raise ValueError(f"Phi-3 blocks with partial_rotary_factor {rope['partial_rotary_factor']} (rotary on part "
                             f"of each head) are not supported")
        super().__init__(config, layer_idx)
        self.shape = ModelShape.from_config(config)

    def load_state_dict(self, state_dict, strict: bool = True, assign: bool = False):
        return super().load_state_dict(split_fused(dict(state_dict), self.shape), strict=strict, assign=assign)

