"""Llama-style model pieces in plain torch: RMSNorm, rotary embeddings, attention, gated MLP, decoder layer.

They compute what transformers' llama, mistral and qwen2 modeling code computes with SDPA attention, op for op,
under the same module and parameter names: checkpoints load into them as they are, `server.decode` fuses their
weights the same way, and `FamilySpec` names them per family (`LlamaDecoderLayer`, `Qwen2RMSNorm`, ...). Why not
transformers' classes: in transformers 5 importing a model module imports torch._dynamo, torch.distributed,
sympy and scipy, about 140 MB of resident memory in every block server and client. RoPE variants come from
`transformers.modeling_rope_utils`, which imports none of that.

The families differ only in which projections carry biases: llama per `attention_bias` / `mlp_bias`, mistral
none, qwen2 on q, k and v. Sliding windows (mistral, qwen2) are the caller's attention mask, as with
transformers' SDPA path.
"""
from __future__ import annotations

from typing import Optional, Tuple

import torch
import torch.nn.functional as F
from torch import nn
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS, dynamic_rope_update


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float = 1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.variance_epsilon = eps

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        input_dtype = hidden_states.dtype
        hidden_states = hidden_states.to(torch.float32)
        variance = hidden_states.pow(2).mean(-1, keepdim=True)
        hidden_states = hidden_states * torch.rsqrt(variance + self.variance_epsilon)
        return self.weight * hidden_states.to(input_dtype)


def default_rope_parameters(config, device=None, **kwargs) -> Tuple[torch.Tensor, float]:
    """Inverse frequencies of the original RoPE (and the attention scaling 1.0)."""
    base = config.rope_parameters["rope_theta"]
    dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    return 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float) / dim)), 1.0


class RotaryEmbedding(nn.Module):
    """cos/sin `[batch, seq, head_dim]` for position ids `[batch, seq]` (any RoPE type transformers knows)."""

    def __init__(self, config):
        super().__init__()
        self.max_seq_len_cached = config.max_position_embeddings
        self.original_max_seq_len = config.max_position_embeddings
        self.config = config
        self.rope_type = config.rope_parameters["rope_type"]
        if self.rope_type == "default":
            self.rope_init_fn = default_rope_parameters
        else:
            self.rope_init_fn = ROPE_INIT_FUNCTIONS[self.rope_type]
        inv_freq, self.attention_scaling = self.rope_init_fn(config)
        self.register_buffer("inv_freq", inv_freq, persistent=False)
        self.register_buffer("original_inv_freq", inv_freq.clone(), persistent=False)

    @torch.no_grad()
    @dynamic_rope_update  # the RoPE types that grow with the sequence (dynamic, longrope)
    def forward(self, x: torch.Tensor, position_ids: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
        freqs = position_ids[..., None].float() * self.inv_freq.to(device=x.device, dtype=torch.float)
        emb = torch.cat((freqs, freqs), dim=-1)
        cos = emb.cos() * self.attention_scaling
        sin = emb.sin() * self.attention_scaling
        return cos.to(dtype=x.dtype), sin.to(dtype=x.dtype)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1 = x[..., : x.shape[-1] // 2]
    x2 = x[..., x.shape[-1] // 2:]
    return torch.cat((-x2, x1), dim=-1)


def apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim: int = 1):
    cos = cos.unsqueeze(unsqueeze_dim)
    sin = sin.unsqueeze(unsqueeze_dim)
    return (q * cos) + (rotate_half(q) * sin), (k * cos) + (rotate_half(k) * sin)


def repeat_kv(hidden_states: torch.Tensor, n_rep: int) -> torch.Tensor:
    """[batch, kv_heads, seq, dim] -> [batch, kv_heads * n_rep, seq, dim]."""
    batch, kv_heads, length, dim = hidden_states.shape
    if n_rep == 1:
        return hidden_states
    hidden_states = hidden_states[:, :, None, :, :].expand(batch, kv_heads, n_rep, length, dim)
    return hidden_states.reshape(batch, kv_heads * n_rep, length, dim)


def sdpa_attention(query, key, value, attention_mask: Optional[torch.Tensor], scaling: float, groups: int
                   ) -> torch.Tensor:
    """transformers' `sdpa_attention_forward` (CPU and CUDA): [batch, heads, q, dim] -> [batch, q, heads, dim]."""
    kwargs = {}
    q_length = query.shape[2]
    if groups > 1:
        if attention_mask is None and key.shape[-1] == value.shape[-1] <= 256:
            kwargs["enable_gqa"] = True
        elif q_length == 1:  # one query token: attention on the kv heads, the query heads grouped per kv head
            query = query.reshape(query.shape[0], query.shape[1] // groups, groups, query.shape[-1])
            if attention_mask is not None and attention_mask.shape[1] != 1:
                attention_mask = attention_mask.reshape(attention_mask.shape[0], attention_mask.shape[1] // groups,
                                                        groups, attention_mask.shape[-1])
        else:
            key, value = repeat_kv(key, groups), repeat_kv(value, groups)
    is_causal = q_length > 1 and attention_mask is None
    if is_causal and key.shape[2] > q_length:  # an empty cache's prefill: the square causal part only
        key, value = key[:, :, :q_length], value[:, :, :q_length]
    out = F.scaled_dot_product_attention(query, key, value, attn_mask=attention_mask, dropout_p=0.0, scale=scaling,
                                         is_causal=is_causal, **kwargs)
    out = out.reshape(out.shape[0], -1, q_length, value.shape[-1])
    return out.transpose(1, 2).contiguous()


class Attention(nn.Module):
    def __init__(self, config, layer_idx: int, qkv_bias: bool, o_bias: bool):
        super().__init__()
        self.config, self.layer_idx = config, layer_idx
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        self.num_key_value_groups = config.num_attention_heads // config.num_key_value_heads
        self.scaling = self.head_dim ** -0.5
        self.is_causal = True
        heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
        self.q_proj = nn.Linear(config.hidden_size, heads * self.head_dim, bias=qkv_bias)
        self.k_proj = nn.Linear(config.hidden_size, kv_heads * self.head_dim, bias=qkv_bias)
        self.v_proj = nn.Linear(config.hidden_size, kv_heads * self.head_dim, bias=qkv_bias)
        self.o_proj = nn.Linear(heads * self.head_dim, config.hidden_size, bias=o_bias)

    def forward(self, hidden_states: torch.Tensor, position_embeddings: Tuple[torch.Tensor, torch.Tensor],
                attention_mask: Optional[torch.Tensor] = None, past_key_values=None, **kwargs):
        input_shape = hidden_states.shape[:-1]
        hidden_shape = (*input_shape, -1, self.head_dim)
        query = self.q_proj(hidden_states).view(hidden_shape).transpose(1, 2)
        key = self.k_proj(hidden_states).view(hidden_shape).transpose(1, 2)
        value = self.v_proj(hidden_states).view(hidden_shape).transpose(1, 2)
        cos, sin = position_embeddings
        query, key = apply_rotary_pos_emb(query, key, cos, sin)
        if past_key_values is not None:  # a cache with transformers' `update` (server.cache.SessionKV)
            key, value = past_key_values.update(key, value, self.layer_idx)
        out = sdpa_attention(query, key, value, attention_mask, self.scaling, self.num_key_value_groups)
        return self.o_proj(out.reshape(*input_shape, -1).contiguous()), None


class MLP(nn.Module):
    def __init__(self, config, bias: bool):
        super().__init__()
        self.gate_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=bias)
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=bias)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=bias)
        self.act_fn = activation(config.hidden_act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))


def activation(name: str) -> nn.Module:
    """transformers' activation `name` (common ones without importing transformers.activations)."""
    if name in ("silu", "swish"):
        return nn.SiLU()
    if name == "relu":
        return nn.ReLU()
    from transformers.activations import ACT2FN  # the rare others, exactly as transformers has them

    return ACT2FN[name]


class DecoderLayer(nn.Module):
    """`layer(hidden, attention_mask, position_ids, past_key_values, use_cache, position_embeddings)` -> hidden."""

    def __init__(self, config, layer_idx: int, qkv_bias: bool = False, o_bias: bool = False, mlp_bias: bool = False):
        super().__init__()
        self.hidden_size = config.hidden_size
        self.self_attn = Attention(config, layer_idx, qkv_bias, o_bias)
        self.mlp = MLP(config, mlp_bias)
        self.input_layernorm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)

    def forward(self, hidden_states: torch.Tensor, attention_mask: Optional[torch.Tensor] = None,
                position_ids: Optional[torch.Tensor] = None, past_key_values=None, use_cache: bool = False,
                position_embeddings: Optional[Tuple[torch.Tensor, torch.Tensor]] = None, **kwargs) -> torch.Tensor:
        residual = hidden_states
        hidden_states, _ = self.self_attn(self.input_layernorm(hidden_states), position_embeddings,
                                          attention_mask=attention_mask, past_key_values=past_key_values)
        hidden_states = residual + hidden_states
        residual = hidden_states
        return residual + self.mlp(self.post_attention_layernorm(hidden_states))


class LlamaDecoderLayer(DecoderLayer):
    def __init__(self, config, layer_idx: int):
        bias, mlp_bias = bool(getattr(config, "attention_bias", False)), bool(getattr(config, "mlp_bias", False))
        super().__init__(config, layer_idx, qkv_bias=bias, o_bias=bias, mlp_bias=mlp_bias)


class MistralDecoderLayer(DecoderLayer):
    def __init__(self, config, layer_idx: int):
        super().__init__(config, layer_idx)


class Qwen2DecoderLayer(DecoderLayer):
    def __init__(self, config, layer_idx: int):
        super().__init__(config, layer_idx, qkv_bias=True)


# the same computations under each family's names (`swarm.modeling.families`)
LlamaRMSNorm = MistralRMSNorm = Qwen2RMSNorm = RMSNorm
LlamaRotaryEmbedding = MistralRotaryEmbedding = Qwen2RotaryEmbedding = RotaryEmbedding
