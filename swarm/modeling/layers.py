"""Pieces that model families share, in plain torch: RMSNorm, rotary embeddings, ALiBi, SDPA attention with
causal and sliding-window masks, activations, a layer's cache index (`AttentionIndexedLayer`), the
projections of BLOOM's and Falcon's layers (`DenseProjectionLayer`), and every family's layer `forward`
(`step_forward`: transformers' layer call run as the layer's own `step`).

They compute what transformers' modeling code computes with SDPA attention, op for op, so a family module built
from them (`swarm.modeling.families.llama`) gives equal outputs. Why not transformers' classes: in transformers 5
importing a model module imports torch._dynamo, torch.distributed, sympy and scipy, about 140 MB of resident
memory in every block server and client. RoPE variants come from `transformers.modeling_rope_utils`, which
imports none of that.

ALiBi (BLOOM, Falcon with `alibi`): a layer whose `key_bias(key_length, dtype, device)` gives a bias
[heads, key_length] (slope * key position, each family's dtype handling) gets it added to its attention logits by
every attention callback (`cache_attention` here, `server.compute.decode.sessions_attention`); softmax is
shift-invariant per query, so a bias on the key position alone is the relative one. `biased_mask` merges it with the
causal mask.

Attention SDPA cannot compute (Gemma 2's logit soft-cap, GPT-OSS's sinks): a layer with `logit_softcap` or
`attention_sinks` gets transformers' eager attention from `cache_attention` and from `layer_sdpa`, which the
server's decode paths call where they would call SDPA.
"""
from __future__ import annotations

import math
from typing import Any, Callable, Optional, Tuple

import torch
import torch.nn.functional as F
from torch import nn
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS, dynamic_rope_update

from swarm.modeling.shape import head_dim_of


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
    dim = head_dim_of(config)
    return 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float) / dim)), 1.0


class RotaryEmbedding(nn.Module):
    """cos/sin `[batch, seq, head_dim]` for position ids `[batch, seq]` (any RoPE type transformers knows).

    LongRoPE picks its short or long factors by a sequence length: transformers' `dynamic_rope_update` by the call's
    (its largest position + 1), for every row. A server's call may be one chunk of a longer step, or rows of several
    sessions' steps, so `lengths` [batch, 1] (each row's, broadcast over its positions) picks them per row: the
    long factors where the row's length is past `original_max_position_embeddings` (`rope_lengths`). Other RoPE
    types ignore `lengths`."""

    inv_freq: torch.Tensor  # [head_dim / 2], a buffer
    original_inv_freq: torch.Tensor  # [head_dim / 2]: the short factors' (LongRoPE), a buffer
    long_inv_freq: torch.Tensor  # [head_dim / 2]: LongRoPE's long factors', a buffer (`by_length` only)

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
        self.by_length = picks_by_length(config)
        if self.by_length:  # the long factors' inverse frequencies (the short ones are `original_inv_freq`)
            boundary = int(config.rope_parameters["original_max_position_embeddings"])
            self.register_buffer("long_inv_freq", self.rope_init_fn(config, seq_len=boundary + 1)[0],
                                 persistent=False)
            self.boundary = boundary

    @torch.no_grad()
    def forward(self, x: torch.Tensor, position_ids: torch.Tensor, lengths: Optional[torch.Tensor] = None
                ) -> Tuple[torch.Tensor, torch.Tensor]:
        if lengths is None or not self.by_length:
            return self._forward(x, position_ids)
        inv_freq = torch.where(lengths.to(position_ids.device)[..., None] > self.boundary,  # [batch, 1, head_dim / 2]
                               self.long_inv_freq.to(x.device), self.original_inv_freq.to(x.device))
        freqs = position_ids[..., None].float() * inv_freq
        return self._angles(freqs, x.dtype)

    @torch.no_grad()
    @dynamic_rope_update  # the RoPE types that grow with the sequence (dynamic, longrope)
    def _forward(self, x: torch.Tensor, position_ids: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
        freqs = position_ids[..., None].float() * self.inv_freq.to(device=x.device, dtype=torch.float)
        return self._angles(freqs, x.dtype)

    def _angles(self, freqs: torch.Tensor, dtype: torch.dtype) -> Tuple[torch.Tensor, torch.Tensor]:
        emb = torch.cat((freqs, freqs), dim=-1)
        cos = emb.cos() * self.attention_scaling
        sin = emb.sin() * self.attention_scaling
        return cos.to(dtype=dtype), sin.to(dtype=dtype)


def picks_by_length(config) -> bool:
    """Whether the config's rotary picks its factors by the sequence's length (LongRoPE: `RotaryEmbedding`), so that
    a step computed in parts must name the whole step's length (`rope_length`) for each part."""
    rope = getattr(config, "rope_parameters", None) or {}
    return rope.get("rope_type") == "longrope" and rope.get("original_max_position_embeddings") is not None


def rope_lengths(position_ids: torch.Tensor, beyond: int = 0) -> torch.Tensor:
    """[batch, 1]: the sequence length by which a call over rotary positions `position_ids` [batch, seq] picks its
    factors (`RotaryEmbedding`) when its step runs `beyond` positions past the call's last one: as transformers picks
    them for the whole step at once, its largest position + 1 over the rows (rows of one step share the pick)."""
    return (position_ids[:, -1:].max() + 1 + beyond).expand(position_ids.shape[0], 1)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1 = x[..., : x.shape[-1] // 2]
    x2 = x[..., x.shape[-1] // 2:]
    return torch.cat((-x2, x1), dim=-1)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x rotated by its positions' angles, as transformers' `apply_rotary_pos_emb` does to q and to k (cos, sin
    broadcast against x: [..., heads, head_dim] with [..., 1, head_dim])."""
    return (x * cos) + (rotate_half(x) * sin)


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
        # SDPA's own grouped-query attention: every kernel without a mask; with one, the CPU's (the same numbers as
        # the heads expanded, without their copy: 3.4x faster for 22 queries over 1,046 keys), not CUDA's
        if key.shape[-1] == value.shape[-1] <= 256 and (attention_mask is None
                                                        or (q_length > 1 and query.device.type == "cpu")):
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


def _eager(layer, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: Optional[torch.Tensor]) -> torch.Tensor:
    """`layer_sdpa`'s eager attention for `cache_attention`: q [batch, heads, seq, dim], k, v [batch, kv_heads,
    keys, dim] -> [batch, seq, heads, dim]. A None mask is `sdpa_attention`'s: causal over the last q keys of a
    square, or one query seeing every key."""
    q_length = q.shape[2]
    if mask is None and q_length > 1:
        k, v = k[:, :, :q_length], v[:, :, :q_length]
        mask = torch.triu(torch.full((q_length, q_length), torch.finfo(q.dtype).min, dtype=q.dtype, device=q.device),
                          diagonal=1)
    return layer_sdpa(layer, q, k, v, mask, layer.scaling).transpose(1, 2).contiguous()


def layer_sdpa(layer, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
               attn_mask: Optional[torch.Tensor] = None, scale: Optional[float] = None, enable_gqa: bool = False
               ) -> torch.Tensor:
    """`F.scaled_dot_product_attention` as the server's decode paths call it, or for a layer with Gemma 2's
    `logit_softcap` or GPT-OSS's `attention_sinks` the same attention computed eagerly, as transformers' eager
    attention (the soft-cap before the mask and a float32 softmax; the sinks as one more logit per head in the
    logits' dtype, whose probability is dropped).
    Layouts: query [b, heads, q, dim] with key/value [b, kv_heads, keys, dim], or a kv head's query heads grouped as
    its "sequence", query [b, kv_heads, heads / kv_heads, dim] (one query token each); attn_mask additive or
    boolean (True: attend), broadcast to the logits [b, query dim 1, query dim 2, keys]."""
    cap, sinks = getattr(layer, "logit_softcap", None), getattr(layer, "attention_sinks", None)
    if not cap and sinks is None:
        return F.scaled_dot_product_attention(query, key, value, attn_mask=attn_mask, scale=scale,
                                              enable_gqa=enable_gqa)
    per_head = query.shape[1] == layer.heads  # else grouped per kv head
    if per_head and key.shape[1] != query.shape[1]:
        key, value = repeat_kv(key, query.shape[1] // key.shape[1]), repeat_kv(value, query.shape[1] // key.shape[1])
    weights = torch.matmul(query, key.transpose(-1, -2)) * (scale if scale is not None else query.shape[-1] ** -0.5)
    if cap:
        weights = torch.tanh(weights / cap) * cap
    if attn_mask is not None and attn_mask.dtype == torch.bool:  # (SDPA's boolean masks: True where allowed)
        weights = weights.masked_fill(~attn_mask, torch.finfo(weights.dtype).min)
    elif attn_mask is not None:
        weights = weights + attn_mask
    if sinks is None:
        weights = F.softmax(weights, dim=-1, dtype=torch.float32).to(query.dtype)
    else:
        sink = sinks.view(1, -1, 1, 1) if per_head else sinks.view(1, layer.kv_heads, -1, 1)
        combined = torch.cat([weights, sink.to(weights.dtype).expand(*weights.shape[:-1], 1)], dim=-1)
        combined = combined - combined.max(dim=-1, keepdim=True).values
        weights = F.softmax(combined, dim=-1, dtype=combined.dtype)[..., :-1].to(value.dtype)
    return torch.matmul(weights, value)


def alibi_slopes(num_heads: int) -> torch.Tensor:
    """transformers' ALiBi slopes (BLOOM's `_get_alibi_slopes`, Falcon's `build_alibi_tensor`): [heads] float32, CPU."""
    closest_power_of_2 = 2 ** math.floor(math.log2(num_heads))
    base = torch.full((), 2 ** (-(2 ** -(math.log2(closest_power_of_2) - 3))), dtype=torch.float32, device="cpu")
    slopes = torch.pow(base, torch.arange(1, 1 + closest_power_of_2, dtype=torch.int32, device="cpu"))
    if closest_power_of_2 != num_heads:
        extra_base = torch.full((), 2 ** (-(2 ** -(math.log2(2 * closest_power_of_2) - 3))), dtype=torch.float32,
                                device="cpu")
        remaining = min(closest_power_of_2, num_heads - closest_power_of_2)
        extra_powers = torch.arange(1, 1 + 2 * remaining, 2, dtype=torch.int32, device="cpu")
        slopes = torch.cat([slopes, torch.pow(extra_base, extra_powers)], dim=0)
    return slopes


class AttentionIndexedLayer(nn.Module):
    """A decoder layer whose `layer_idx` (its index into the cache, which `BlockSpan.load` sets span-relative) is
    its attention module's: `self_attn` (Llama-like layers, Gemma's, Mixtral's), or `attention_module`."""

    attention_module = "self_attn"

    @property
    def layer_idx(self) -> int:
        return getattr(self, self.attention_module).layer_idx

    @layer_idx.setter
    def layer_idx(self, value: int) -> None:
        getattr(self, self.attention_module).layer_idx = value


class DenseProjectionLayer(AttentionIndexedLayer):
    """The module layout BLOOM's and Falcon's layers share (transformers' names): `self_attention` with
    `query_key_value`, `dense` and the cache's `layer_idx`, and `mlp` with `dense_h_to_4h` and `dense_4h_to_h`;
    their steps run every projection through `project` (which a LoRA adapter's `AdaptedLayer` wraps)."""

    attention_module = "self_attention"
    self_attention: Any  # set by the family's __init__
    mlp: Any

    def project(self, group: str, h: torch.Tensor) -> torch.Tensor:
        """Projection `group` ("qkv": query_key_value, "o": dense, "up": dense_h_to_4h, "down": dense_4h_to_h) of h
        [..., in], in h's dtype (a quantized module may answer in its compute dtype; a LoRA adapter's
        `AdaptedLayer` adds its deltas to these outputs)."""
        attention, mlp = self.self_attention, self.mlp
        module = {"qkv": attention.query_key_value, "o": attention.dense, "up": mlp.dense_h_to_4h,
                  "down": mlp.dense_4h_to_h}[group]
        return module(h).to(h.dtype)


def key_bias(layer, key_length: int, dtype: torch.dtype, device: torch.device) -> Optional[torch.Tensor]:
    """The layer's additive attention bias over key positions 0..key_length-1, [heads, key_length]; None for a
    layer without one (RoPE layers, whose `key_bias` is absent or returns None)."""
    bias = getattr(layer, "key_bias", None)
    return None if bias is None else bias(key_length, dtype, device)


def biased_mask(bias: torch.Tensor, mask: Optional[torch.Tensor], q_length: int) -> torch.Tensor:
    """The attention mask [1, heads, q_length, keys] of a layer with bias [heads, keys]: the bias where a query
    may see a key, the dtype's minimum where not. mask: the additive causal mask [1, 1, q_length, keys] (0 or the
    minimum), or None (causal over the last q_length keys; a single query sees every key)."""
    out = bias[None, :, None, :]  # [1, heads, 1, keys]
    keys = bias.shape[-1]
    if mask is not None:
        return torch.where(mask == 0, out, torch.finfo(bias.dtype).min)
    if q_length == 1:
        return out
    key_positions = torch.arange(keys, device=bias.device)
    query_positions = torch.arange(keys - q_length, keys, device=bias.device)
    allowed = key_positions[None, :] <= query_positions[:, None]  # [q_length, keys]
    return out.masked_fill(~allowed, torch.finfo(bias.dtype).min)


def sliding_window_of(config, layer_idx: int, window_layers: bool = False) -> Optional[int]:
    """The sliding window of block `layer_idx` as transformers applies it: a query at position p sees the keys at
    positions p - window + 1 .. p. Mistral, Mixtral, Qwen3-MoE: `sliding_window` on every layer; Qwen2, Qwen3
    (`window_layers`, their layers' class attribute): on the layers their `layer_types` name "sliding_attention" (by
    default those from `max_window_layers` on, when `use_sliding_window`). None: full causal attention."""
    window = getattr(config, "sliding_window", None)
    if not window:
        return None
    if window_layers:  # windows on some layers (the layer class says: Qwen2's, Qwen3's): `layer_types`, else
        # `max_window_layers`
        layer_types = getattr(config, "layer_types", None)
        if layer_types:
            return window if layer_types[layer_idx] == "sliding_attention" else None
        return window if layer_idx >= getattr(config, "max_window_layers", 0) else None
    return int(window)


def causal_mask(start: int, seq: int, window: Optional[int], dtype: torch.dtype, device: torch.device
                ) -> Optional[torch.Tensor]:
    """The additive mask [1, 1, seq, start + seq] of queries at positions start.. over keys 0..start + seq - 1:
    key <= query, and with a `window` key > query - window. None where SDPA without a mask computes the same: a
    first step that the window does not cut (SDPA's square causal mask), one query seeing every key."""
    cut = window is not None and start + seq > window
    if not cut and (start == 0 or seq == 1):
        return None
    queries = torch.arange(start, start + seq, device=device).unsqueeze(1)  # [seq, 1]
    keys = torch.arange(start + seq, device=device).unsqueeze(0)  # [1, start + seq]
    allowed = keys <= queries
    if window is not None:
        allowed &= keys > queries - window
    mask = torch.zeros(allowed.shape, dtype=dtype, device=device)
    mask.masked_fill_(~allowed, torch.finfo(dtype).min)
    return mask[None, None]


def cache_attention(cache, mask: Optional[torch.Tensor], window_mask: Optional[torch.Tensor] = None) -> Callable:
    """The attention of a block step through a cache with transformers' `update(k, v, layer_idx)` (or none): the
    new keys/values join the cache's, then SDPA with `mask` (None: causal over a square, or one query seeing every
    key; with an ALiBi layer's bias, `biased_mask`), or for layers with a `sliding_window` the step's `causal_mask`
    with the window when one is given (a caller that passes each layer its own mask, as transformers'
    `attention_mask`, leaves `window_mask` None). The `attend` callback of a family's `block_step`:
    (layer, q [batch, seq, heads, head_dim], k, v [batch, seq, kv_heads, head_dim]) -> [batch, seq, heads * head_dim].
    """
    masks: dict = {}  # key length -> the biased mask, computed once for all layers of a step

    def attend(layer, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)  # [batch, heads, seq, head_dim]
        if cache is not None:
            k, v = cache.update(k, v, layer.layer_idx)  # [batch, kv_heads, cached + seq, head_dim]
        layer_mask = window_mask if window_mask is not None and getattr(layer, "sliding_window", None) else mask
        if layer_mask is not None and layer_mask.shape[-1] > k.shape[2]:
            layer_mask = layer_mask[..., -k.shape[2]:]  # a sliding-window cache returned only the window's keys
        step_key = (k.shape[2], layer_mask is window_mask)
        if step_key not in masks:
            bias = key_bias(layer, k.shape[2], q.dtype, q.device)
            masks[step_key] = layer_mask if bias is None else biased_mask(bias, layer_mask, q.shape[2])
        step_mask = masks[step_key]
        if step_mask is not None and step_mask.device != q.device:  # a tensor-parallel shard on another device
            step_mask = step_mask.to(q.device)
        # [batch, seq, heads, dim]
        if getattr(layer, "logit_softcap", None) or getattr(layer, "attention_sinks", None) is not None:
            out = _eager(layer, q, k, v, step_mask)  # (Gemma 2's soft-cap, GPT-OSS's sinks: not SDPA's)
        else:
            out = sdpa_attention(q, k, v, step_mask, layer.scaling, layer.heads // layer.kv_heads)
        return out.flatten(-2)

    return attend


def step_forward(layer, hidden_states: torch.Tensor, attention_mask: Optional[torch.Tensor] = None,
                 position_ids: Optional[torch.Tensor] = None, past_key_values=None, use_cache: bool = False,
                 position_embeddings=None, **kwargs) -> torch.Tensor:
    """Every family's layer module's `forward` (`forward = step_forward`): transformers' decoder-layer call run as the
    layer's own `step(x, cos, sin, attend)` through `cache_attention`. hidden_states: [batch, seq, hidden];
    attention_mask: the additive causal mask or None; position_embeddings: (cos, sin) [batch, seq, head_dim] (None
    without rotary embeddings: ALiBi); a cache with transformers' `update` (`server.compute.cache.SessionKV`) or
    None. Returns [batch, seq, hidden]."""
    cos, sin = position_embeddings if position_embeddings is not None else (None, None)
    return layer.step(hidden_states, cos, sin, cache_attention(past_key_values, attention_mask))


def activation(name: str) -> nn.Module:
    """transformers' activation `name` (common ones without importing transformers.activations)."""
    if name in ("silu", "swish"):
        return nn.SiLU()
    if name == "relu":
        return nn.ReLU()
    if name == "gelu":  # transformers' GELUActivation: torch's exact (erf) GELU
        return nn.GELU()
    from transformers.activations import ACT2FN  # the rare others, exactly as transformers has them

    return ACT2FN[name]
