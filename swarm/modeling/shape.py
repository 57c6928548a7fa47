"""The shape of a model's blocks (`ModelShape`), read once from its Hugging Face config.

Every size the code needs of a block comes from here: the hidden size, query and key/value heads, `head_dim`,
the MLP width, the norm's epsilon, the RoPE type and the checkpoint's own dtype. `head_dim_of` is the one place
that derives `head_dim` as the transformers config classes do (`hidden_size // num_attention_heads` unless the
config names one). `CacheLayout` is what one block caches per token: key and value heads (Llama-like attention), or
DeepSeek's multi-head latent attention's compressed latent and shared rotary key
(`swarm.modeling.families.deepseek_v3`).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch


def head_dim_of(config) -> int:
    """The attention head size of `config`: its `head_dim`, else `hidden_size // num_attention_heads`."""
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


def config_dtype(config) -> Optional[torch.dtype]:
    """The dtype the checkpoint was saved in (`dtype`, or the older `torch_dtype`), None if the config names none."""
    configured = getattr(config, "dtype", None) or getattr(config, "torch_dtype", None)
    if isinstance(configured, str):
        configured = getattr(torch, configured, None)
    return configured if isinstance(configured, torch.dtype) else None


@dataclass(frozen=True)
class CacheLayout:
    """One block's cache per token: keys [kv_heads, key_dim] and values [kv_heads, value_dim]. With
    `values_in_keys` the values are no tensor of their own but the keys' first `value_dim` channels (a view):
    DeepSeek's latent attention caches [latent (kv_lora_rank), rotary key (qk_rope_head_dim)] as one key head,
    and attends with the latent as the value (`server.compute.cache.SessionKV`, `server.compute.kv_arena`)."""
    kv_heads: int
    key_dim: int
    value_dim: int
    values_in_keys: bool = False

    def bytes_per_token(self, dtype: torch.dtype) -> int:
        """Bytes one cached token takes in one block at `dtype`."""
        channels = self.key_dim + (0 if self.values_in_keys else self.value_dim)
        return self.kv_heads * channels * torch.empty((), dtype=dtype).element_size()


@dataclass(frozen=True)
class ModelShape:
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    num_layers: int
    intermediate_size: int
    rms_norm_eps: float
    hidden_act: str
    rope_type: str  # "default", "llama3", "dynamic", ... (transformers' ROPE_INIT_FUNCTIONS)
    dtype: Optional[torch.dtype]  # the checkpoint's dtype per its config, None when it names none
    kv_lora_rank: Optional[int] = None  # DeepSeek's latent attention: the compressed key/value latent's size

    @classmethod
    def from_config(cls, config) -> "ModelShape":
        rope = getattr(config, "rope_parameters", None) or {}
        return cls(
            hidden_size=config.hidden_size,
            num_heads=config.num_attention_heads,
            num_kv_heads=getattr(config, "num_key_value_heads", None) or config.num_attention_heads,
            head_dim=head_dim_of(config),
            num_layers=config.num_hidden_layers,
            intermediate_size=config.intermediate_size,
            rms_norm_eps=getattr(config, "rms_norm_eps", 1e-6),
            hidden_act=getattr(config, "hidden_act", "silu"),
            rope_type=rope.get("rope_type", "default"),
            dtype=config_dtype(config),
            kv_lora_rank=getattr(config, "kv_lora_rank", None),
        )

    @property
    def groups(self) -> int:
        """Query heads per key/value head (grouped-query attention; 1 for plain multi-head attention)."""
        return self.num_heads // self.num_kv_heads

    @property
    def scaling(self) -> float:
        """The attention logits' scale, 1 / sqrt(head_dim)."""
        return self.head_dim ** -0.5

    @property
    def cache_layout(self) -> CacheLayout:
        """What a block caches per token: `num_kv_heads` keys and values of `head_dim`, or with a latent attention
        (`kv_lora_rank`) one head of the latent and the rotary key (`head_dim` is then the rotary part's size),
        whose first kv_lora_rank channels are the values."""
        if self.kv_lora_rank:
            return CacheLayout(1, self.kv_lora_rank + self.head_dim, self.kv_lora_rank, values_in_keys=True)
        return CacheLayout(self.num_kv_heads, self.head_dim, self.head_dim)

    def cache_bytes_per_token(self, dtype: torch.dtype) -> int:
        """Bytes of keys and values one cached token takes in one block at `dtype`."""
        return self.cache_layout.bytes_per_token(dtype)
