"""How much a server can hold: free device memory, bytes per block and per cached token, the default budget.

`plan_capacity` turns what the device has free into (number of blocks, KV cache budget in tokens) using the
pure `server.placement.policy.num_blocks_that_fit`. A block's size is counted from its parameters (built on the meta
device, nothing allocated) at the serving dtype, its linear weights at their quantized size with their scales for
`--quant_type` int8 / nf4 (`swarm.modeling.quantize`); a cached token costs keys and values of every kv head at the
dtype, per block. A layer's `float_linears` (DeepSeek-V3's kv_b_proj, the MoE routers, which int8 / nf4 leave in float)
count at the dtype; of a model whose blocks differ (DeepSeek-V3's dense first blocks), the larger of its first and last
block.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Optional

import torch

from server.placement.policy import num_blocks_that_fit
from swarm.modeling.shape import ModelShape
from swarm.wire.quant import quant_format

logger = logging.getLogger(__name__)

# A quantized weight's bytes per parameter and per module are its format's (`swarm.wire.quant`). The per-module
# bytes (nf4's code table) are counted per linear weight of the family's layer: the served layer fuses some (q/k/v,
# gate/up), so this is an upper bound by at most 64 bytes a fused weight. (After its first call on a CPU with
# bitsandbytes' packed kernels an nf4 module's absmax shrinks to bfloat16: what is held then is less, never more.)
DEFAULT_CACHE_TOKENS = 16384  # Petals' per-server default: plenty of sessions of a few thousand tokens
MIN_CACHE_TOKENS = 2048
CACHE_MEMORY_FRACTION = 0.25  # at most this share of the free memory goes to the KV cache by default


def free_memory_bytes(device: str) -> int:
    """Memory that new tensors can use now: free GPU memory for CUDA devices, available RAM otherwise."""
    dev = torch.device(device)
    if dev.type == "cuda":
        free, _total = torch.cuda.mem_get_info(dev)
        return int(free)
    import psutil

    return int(psutil.virtual_memory().available)


def block_parameter_counts(model_config) -> tuple[int, int]:
    """(parameters in the linear weights int8 / nf4 quantize, other parameters: norms, routers, biases, float buffers
    and the linear weights a layer keeps in float, its `float_linears`: DeepSeek-V3's kv_b_proj, the routers) of the
    larger of the first and the last block, by parameters (DeepSeek-V3's first blocks are dense MLPs, the later ones
    experts)."""
    linear, other, _modules = max(_block_counts(model_config), key=lambda counts: counts[0] + counts[1])
    return linear, other


def quantized_module_count(model_config) -> int:
    """Quantized modules of the block `block_parameter_counts` describes: one a linear weight, one an expert's
    matrix of a stacked parameter (GPT-OSS's experts, quantized per expert)."""
    return max(_block_counts(model_config), key=lambda counts: counts[0] + counts[1])[2]


def _block_counts(model_config) -> list[tuple[int, int, int]]:
    """`_parameter_counts` of the first and the last block: the kinds of block a model mixes (dense, experts)."""
    last = int(model_config.num_hidden_layers) - 1
    return [_parameter_counts(model_config, index) for index in sorted({0, max(last, 0)})]


def _parameter_counts(model_config, index: int) -> tuple[int, int, int]:
    """(quantizable linear parameters, other parameters, quantized modules) of block `index`."""
    from swarm.modeling.families import family_for

    family = family_for(model_config)
    with torch.device("meta"):
        layer = family.layer(model_config, index)
    kept = set(getattr(layer, "float_linears", ()))
    stacked = set(getattr(layer, "quantized_parameters", ()))  # e.g. GPT-OSS's experts, quantized per expert
    linear = other = modules = 0
    for module_name, module in layer.named_modules():
        for name, param in module.named_parameters(recurse=False):
            if f"{module_name}.{name}" in stacked:
                linear += param.numel()
                modules += param.shape[0]  # [experts, ...]: one quantized module an expert
            elif isinstance(module, torch.nn.Linear) and name == "weight" and module_name not in kept:
                linear += param.numel()
                modules += 1
            else:
                other += param.numel()
        # float buffers are held at the dtype too (DeepSeek-V3's router's e_score_correction_bias)
        other += sum(b.numel() for b in module.buffers(recurse=False) if b.is_floating_point())
    return linear, other, modules


def bytes_per_block(model_config, dtype: torch.dtype, quant_type: str = "none", packed_copies: int = 0) -> int:
    """Bytes one block's weights take on the device at `dtype` (linear weights at the quantized size, but those a
    layer keeps in float; with `packed_copies` more copies of the float linear weights: `swarm.modeling.smallgemm`'s
    packs): the larger of the first and the last block, by these bytes."""
    itemsize = torch.empty((), dtype=dtype).element_size()
    if quant_type is None or not quant_format(quant_type).quantized:
        return max((linear * (1 + packed_copies) + other) * itemsize
                   for linear, other, _modules in _block_counts(model_config))
    return max(quantized_bytes(linear, modules, quant_type) + other * itemsize
               for linear, other, modules in _block_counts(model_config))


def quantized_bytes(linear: int, modules: int, quant_type: str) -> int:
    """Bytes of `linear` parameters quantized as `quant_type` in `modules` modules, with their statistics and tables:
    what `swarm.modeling.quantize.quantized_weight_bytes` measures of them, at most."""
    quant = quant_format(quant_type)
    if not quant.quantized:
        raise ValueError("quantized_bytes of quant_type none: the weights count at the serving dtype")
    return int(linear * quant.bytes_per_param) + modules * quant.bytes_per_module


def cache_bytes_per_token(model_config, dtype: torch.dtype) -> int:
    """Bytes of keys and values one cached token takes in one block."""
    return ModelShape.from_config(model_config).cache_bytes_per_token(dtype)


@dataclass(frozen=True)
class Capacity:
    num_blocks: int
    attn_cache_tokens: int
    free_bytes: int
    block_bytes: int
    token_bytes: int  # per block


def plan_capacity(model_config, dtype: torch.dtype, free_bytes: int, *, num_blocks: Optional[int] = None,
                  attn_cache_tokens: Optional[int] = None, reserve_fraction: float = 0.1,
                  quant_type: str = "none", packed_copies: int = 0) -> Capacity:
    """How many blocks to serve and how many cache tokens to budget, given `free_bytes` of device memory.

    Given values win. Without `attn_cache_tokens` the budget is `DEFAULT_CACHE_TOKENS`, lowered so that the
    cache of the chosen blocks takes at most `CACHE_MEMORY_FRACTION` of the free memory (but not below
    `MIN_CACHE_TOKENS`). Without `num_blocks`, as many blocks as fit with their share of that cache.
    Raises ValueError when not even one block fits.
    """
    total = model_config.num_hidden_layers
    block = bytes_per_block(model_config, dtype, quant_type, packed_copies)
    token = cache_bytes_per_token(model_config, dtype)

    def default_tokens(blocks: int) -> int:
        affordable = int(free_bytes * CACHE_MEMORY_FRACTION) // max(1, token * blocks)
        return max(MIN_CACHE_TOKENS, min(DEFAULT_CACHE_TOKENS, affordable))

    if num_blocks is None:
        tokens = attn_cache_tokens or DEFAULT_CACHE_TOKENS
        blocks = num_blocks_that_fit(free_bytes, block, tokens * token, total, reserve_fraction=reserve_fraction)
        if blocks == 0 and attn_cache_tokens is None:  # a smaller cache may let one block in
            tokens = MIN_CACHE_TOKENS
            blocks = num_blocks_that_fit(free_bytes, block, tokens * token, total, reserve_fraction=reserve_fraction)
        if blocks == 0:
            raise ValueError(
                f"not even one block fits: {free_bytes / 2**20:.0f} MiB free, a block needs "
                f"{block / 2**20:.1f} MiB plus {tokens * token / 2**20:.1f} MiB of KV cache"
            )
    else:
        blocks = min(num_blocks, total)
    tokens = attn_cache_tokens if attn_cache_tokens is not None else default_tokens(blocks)
    return Capacity(blocks, tokens, free_bytes, block, token)
