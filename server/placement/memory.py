"""How much a server can hold: free device memory, bytes per block and per cached token, the default budget.

`plan_capacity` turns what the device has free into (number of blocks, KV cache budget in tokens) using the
pure `server.placement.policy.num_blocks_that_fit`. A block's size is counted from its parameters (built on the meta
device, nothing allocated) at the serving dtype; for `--quant_type` int8 / nf4 by the family's own account of what
they make of its layer (`FamilySpec.quant.split`, which loading checks each quantized block against): each quantized
module at the bytes bitsandbytes holds for it (`swarm.wire.quant.QuantFormat.module_bytes`), what the family keeps
in float (norms, routers, DeepSeek-V3's kv_b_proj) at the dtype. A cached token costs keys and values of every kv
head at the dtype, per block. Of a model whose blocks differ (DeepSeek-V3's dense first blocks), the larger of its
first and last block.
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

# (After its first call on a CPU with bitsandbytes' packed kernels an nf4 module's absmax shrinks to bfloat16: what
# is held then is less than planned, never more.)
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


def block_split(model_config, index: int):
    """The family's `Quantization.split` (`swarm.modeling.families`) of block `index`, its layer built on the meta
    device (nothing allocated)."""
    from swarm.modeling.families import family_for

    family = family_for(model_config)
    with torch.device("meta"):
        layer = family.layer(model_config, index)
    return family.quant.split(layer)


def block_splits(model_config) -> list:
    """`block_split` of the first and the last block: the kinds of block a model mixes (DeepSeek-V3's dense first
    blocks, then experts)."""
    last = int(model_config.num_hidden_layers) - 1
    return [block_split(model_config, index) for index in sorted({0, max(last, 0)})]


def block_parameter_counts(model_config) -> tuple[int, int]:
    """(parameters in the linear weights int8 / nf4 quantize, other parameters and float buffer values: norms,
    routers, biases and the linear weights the family keeps in float, `Quantization.keep`) of the larger of the first
    and the last block, by parameters."""
    split = max(block_splits(model_config), key=lambda split: split.quantized + split.other)
    return split.quantized, split.other


def bytes_per_block(model_config, dtype: torch.dtype, quant_type: str = "none", packed_copies: int = 0) -> int:
    """Bytes one block's weights take on the device at `dtype` (linear weights at the quantized size, each quantized
    module's as bitsandbytes holds it, but those the family keeps in float; with `packed_copies` more copies of the
    float linear weights: `swarm.modeling.smallgemm`'s packs): the larger of the first and the last block."""
    itemsize = torch.empty((), dtype=dtype).element_size()
    if quant_type is None or not quant_format(quant_type).quantized:
        return max((split.quantized * (1 + packed_copies) + split.other) * itemsize
                   for split in block_splits(model_config))
    return max(quantized_bytes(split.modules, quant_type) + split.other * itemsize
               for split in block_splits(model_config))


def quantized_bytes(modules, quant_type: str) -> int:
    """Bytes of the quantized modules of weights [out, in] `modules` as `quant_type`, with their statistics and tables:
    what `swarm.modeling.quantize.quantized_weight_bytes` measures of them once loaded."""
    quant = quant_format(quant_type)
    if not quant.quantized:
        raise ValueError("quantized_bytes of quant_type none: the weights count at the serving dtype")
    return sum(quant.module_bytes(out_features, in_features) for out_features, in_features in modules)


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
