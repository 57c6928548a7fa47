"""Loading a span of transformer blocks: `load_blocks` reads only the tensors of blocks [start, end) from the
checkpoint (the other blocks are never materialized) into the family's decoder layers, built on the meta device and
filled in place, one block at a time, and returns them as `LoadedBlocks` for `server.compute.blocks.BlockSpan` to run.

With `quant_type` int8 / nf4 each block is quantized before the next is read (`swarm.modeling.quantize`). A
checkpoint published quantized (MXFP4, block-scaled FP8) has the span's stored tensors checked from their headers
first, then each block dequantized into the serving dtype as it is read (`swarm.modeling.checkpoint_quant`). With
`tensor_parallel` devices each block is split across them (`swarm.modeling.tensor_parallel`). LoRA adapters'
tensors of the span's blocks are read too (`swarm.modeling.lora.SpanAdapter`). Also the serving dtype
(`resolve_dtype`) and the decode batch sizes a span packs its weights for (`packed_rows_for`), which the server's
memory planning reads before any block is loaded.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional, Sequence

import torch
from torch import nn

from swarm.modeling.checkpoint import Checkpoint
from swarm.modeling.families import FAMILIES, FamilySpec, QuantSplit, family_for
from swarm.modeling.families.llama import FusedLayer, attach_small_gemms
from swarm.modeling.lora import SpanAdapter, check_layers
from swarm.modeling.lora_files import AdapterError, AdapterFiles
from swarm.modeling.shape import ModelShape, config_dtype
from swarm.modeling.smallgemm import GemmGroup, packing_available
from swarm.modeling.tensor_parallel import check_splittable, parse_devices, split_layer
from swarm.runtime import malloc
from swarm.wire.dtypes import DTYPES

logger = logging.getLogger(__name__)


@dataclass
class LoadedBlocks:
    """A span's blocks as loaded, what `BlockSpan` is made of."""
    config: object
    family: FamilySpec
    layers: nn.ModuleList  # the family's layer modules (or the quantized / split layers that serve every path)
    fused: list  # the layers as `BlockLayer`s (`FamilySpec.fuse`), for server.compute.decode / graphs
    rotary: Optional[nn.Module]
    dtype: torch.dtype
    device: torch.device  # the span's inputs and outputs (with tensor parallelism: the first shard's)
    tp_devices: List[torch.device]  # each block's shards' devices; empty without tensor parallelism
    quant_type: str  # none / int8 / nf4
    gemms: Optional[GemmGroup] = None  # the fused layers' small-batch products (`packed_rows`)
    adapters: Dict[str, SpanAdapter] = field(default_factory=dict)  # LoRA adapters on these blocks, by name


def resolve_dtype(name: str, config, device: torch.device) -> torch.dtype:
    """The serving dtype: `name` (one of `swarm.wire.dtypes.DTYPES`), or for "auto" the checkpoint's own."""
    if name == "auto":
        configured = config_dtype(config)
        if configured in (torch.float16, torch.bfloat16) and device.type == "cpu":
            return torch.float32  # half-precision matmuls are slow on most CPUs
        return configured if configured is not None and configured in DTYPES.values() else torch.float32
    if name not in DTYPES:
        raise ValueError(f"unknown torch_dtype {name!r}; choose one of auto, {', '.join(DTYPES)}")
    return DTYPES[name]


def packed_rows_for(packed_rows: Sequence[int], device: str, dtype: torch.dtype, quant_type: str,
                    family: FamilySpec) -> tuple:
    """The decode batch sizes a span packs its weights for (`swarm.modeling.smallgemm`): float32 blocks of a family
    with `packed_gemms` (Llama's `FusedLayer`s) on the CPU of a torch with MKL's packed GEMM, not quantized; else
    none."""
    if torch.device(device).type != "cpu" or dtype != torch.float32 or quant_type not in (None, "none") or \
            not family.packed_gemms or not packing_available():
        return ()
    return tuple(packed_rows)


def _starts_with(prefix: str) -> Callable[[str], bool]:
    return lambda name: name.startswith(prefix)


def _note_extra_layers(checkpoint: Checkpoint, family: FamilySpec, num_layers: int) -> None:
    """One log line (per `Checkpoint`: a server's whole life) for a checkpoint's blocks past `num_hidden_layers`
    (DeepSeek-V3's multi-token-prediction layer, block 61 of the hub checkpoint), which are never read nor served."""
    extra = family.block_tensor_prefix(num_layers)
    if checkpoint.extra_layers_noted or \
            not any(name.startswith(extra) for name in checkpoint.weight_map()):
        return
    checkpoint.extra_layers_noted = True
    logger.info(f"{checkpoint.name}: skipping the tensors of block {num_layers} and beyond (past num_hidden_layers "
                f"{num_layers}: a multi-token-prediction layer), not served")


def check_split(quantized: nn.Module, split: QuantSplit, family: FamilySpec, index: int) -> None:
    """RuntimeError unless the quantized block holds bitsandbytes modules of exactly the weight shapes its family's
    `Quantization.split` names and as many float values as it keeps (what memory planning counts)."""
    import bitsandbytes as bnb

    held = sorted((m.out_features, m.in_features) for m in quantized.modules()
                  if isinstance(m, (bnb.nn.Linear8bitLt, bnb.nn.Linear4bit)))
    if held != sorted(split.modules):
        raise RuntimeError(f"block {index}: the {family.model_type} family's quantization split names modules "
                           f"{sorted(split.modules)}, its build made {held}")
    floats = sum(t.numel() for t in list(quantized.parameters()) + list(quantized.buffers()) if t.is_floating_point())
    if floats != split.other:
        raise RuntimeError(f"block {index}: the {family.model_type} family's quantization split keeps {split.other} "
                           f"values in float, its quantized block holds {floats}")


def load_blocks(checkpoint: Checkpoint, start: int, end: int, dtype_name: str = "auto", device: str = "cpu",
                quant_type: str = "none", adapters: Sequence[AdapterFiles] = (), packed_rows: Sequence[int] = (),
                tensor_parallel: Sequence[str] = ()) -> LoadedBlocks:
    """Blocks [start, end) of `checkpoint`, read, (quantized) and moved to `device` one block at a time; with
    `adapters` (checked by `swarm.modeling.lora_files.open_adapter`), their tensors of these blocks too.

    quant_type "int8" / "nf4" (`swarm.modeling.quantize`): each block is fused and quantized before the next is
    read, and its float tensors are dropped, so the process never holds the span in full precision.
    `packed_rows` (`packed_rows_for`): float32 CPU blocks' projections get small-batch products packed for these
    decode batch sizes (`swarm.modeling.smallgemm`; one more copy of the weights each).
    `tensor_parallel`: devices to split each block across (`swarm.modeling.tensor_parallel`; the span's inputs
    and outputs on the first; `device` is then unused).
    """
    config = checkpoint.load_config()
    family = family_for(config)
    checkpoint.expect_prefix(family.base_prefix)
    if not 0 <= start < end <= config.num_hidden_layers:
        raise ValueError(f"blocks {start}:{end} are outside the model's 0:{config.num_hidden_layers}")
    if adapters and not family.serves_adapters:
        served = sorted(name for name, spec in FAMILIES.items() if spec.serves_adapters)
        raise AdapterError(f"LoRA adapters are not served on {family.model_type} blocks (served on "
                           f"{', '.join(served)})")
    # (a GPU may repeat here, for tests and the benchmark; the server's config refuses that)
    tp_devices = parse_devices(tensor_parallel, allow_repeat=True) if tensor_parallel else []
    torch_device = tp_devices[0] if tp_devices else torch.device(device)
    dtype = resolve_dtype(dtype_name, config, torch_device)
    quant_type = quant_type or "none"
    if tp_devices:
        check_splittable(family, ModelShape.from_config(config), len(tp_devices), quant_type)
        packed_rows = ()
    if quant_type != "none" and family.fuse is None:
        raise ValueError(f"quant_type {quant_type} needs a family with fused layers ({family.model_type})")

    # a checkpoint published quantized (MXFP4 / FP8): the span's stored tensors checked from their headers before
    # any is read (a bad one: one error naming it); each block is then dequantized as it is read
    prefixes = tuple(family.block_tensor_prefix(index) for index in range(start, end))
    checkpoint.check_quantized(lambda name: name.startswith(prefixes))
    _note_extra_layers(checkpoint, family, config.num_hidden_layers)
    config._attn_implementation = "sdpa"
    layer_cls, fuse = family.layer, family.fuse
    layers = nn.ModuleList()
    fused = []
    for index in range(start, end):
        with torch.device("meta"):
            layer = layer_cls(config, index)
        prefix = family.block_tensor_prefix(index)
        # only this block's tensors are read: its float copies are gone before the next block's are read
        state = {k[len(prefix):]: v for k, v in checkpoint.load_tensors(_starts_with(prefix), dtype).items()}
        missing, unexpected = layer.load_state_dict(state, strict=False, assign=True)
        if missing or unexpected:
            raise ValueError(f"block {index}: missing tensors {missing}, unexpected {unexpected}")
        for name, tensor in list(layer.named_parameters()) + list(layer.named_buffers()):
            if tensor.is_meta:
                raise ValueError(f"block {index}: {name} was not loaded from the checkpoint")
        layer.layer_idx = index - start  # index into this span's SessionKV
        del state
        if tp_devices and fuse is not None:  # fused on the CPU, each shard copied (and quantized) to its device
            layers.append(split_layer(fuse(layer.to(dtype).eval().requires_grad_(False)), tp_devices,
                                      ModelShape.from_config(config), quant_type, dtype, family.quant))
            fused.append(layers[-1])
            del layer
            malloc.trim()
            continue
        if quant_type != "none" and fuse is not None:
            # fused on the CPU, then each fused weight quantized as it moves to the device; the float layer
            # (and its fused tensors) is dropped here, the quantized layer serves every path
            split = family.quant.split(layer)  # what memory planning counted of this block
            quantized = family.quant.quantize(fuse(layer.to(dtype).eval().requires_grad_(False)), quant_type, dtype,
                                              torch_device)
            check_split(quantized, split, family, index)
            del layer
            malloc.trim()  # the float block's pages go back now, not reused piecemeal (the peak stays ~1 block)
            layers.append(quantized)
            fused.append(quantized)
            continue
        layers.append(layer.to(torch_device, dtype).eval().requires_grad_(False))
        if fuse is not None:
            fused.append(fuse(layers[-1]))
    rotary = None
    if family.rotary is not None:
        rotary = family.rotary(config=config).to(torch_device)
    logger.info(f"loaded blocks {start}:{end} of {checkpoint.name} ({dtype}, {device}, quant_type {quant_type})")
    loaded = LoadedBlocks(config, family, layers, fused, rotary, dtype, torch_device, tp_devices, quant_type)
    packed_rows = packed_rows_for(packed_rows, device, dtype, quant_type, family)
    if packed_rows and any(isinstance(layer, FusedLayer) for layer in fused):
        # the span's products run on the server's one compute thread; packed as decode batches come (`_pack_some`)
        loaded.gemms = GemmGroup(packed_rows, lazy=True)
        for layer in fused:
            if isinstance(layer, FusedLayer):
                attach_small_gemms(layer, loaded.gemms)
        planned = sum(g.weight.numel() * g.weight.element_size() for g in loaded.gemms.members) * len(packed_rows)
        logger.info(f"decode batches of {loaded.gemms.min_packed} to {max(packed_rows)} rows will use weights "
                    f"packed for {', '.join(map(str, packed_rows))} rows ({planned / 2**20:.0f} MiB, packed during "
                    f"the first such batches)")
    shape = ModelShape.from_config(config)
    for files in adapters:
        loaded.adapters[files.name] = SpanAdapter.load(files, start, end, dtype, torch_device, shape)
        check_layers(loaded.adapters[files.name], fused)
        logger.info(f"loaded adapter {files.name} for blocks {start}:{end} "
                    f"({loaded.adapters[files.name].nbytes() / 2**20:.1f} MiB)")
    return loaded
