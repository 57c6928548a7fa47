"""The quantized formats checkpoints are published in, dequantized block by block as `checkpoint.Checkpoint` reads them.

A checkpoint's `config.json` names its format in `quantization_config.quant_method` (`quant_format`); the reader then
selects tensors by their logical names (`logical_name`: what the model's modules are called), reads the stored
tensors, checks them (`check_tensors`: before any data is read, from the safetensors headers too) and turns each
quantized pair into one tensor of the serving dtype (`dequantize`) as soon as both halves are read (`group`): a
block's load holds its dequantized tensors and one pair's stored bytes. What is held after loading is then exactly what
an unquantized checkpoint of the serving dtype gives (`server.placement.memory` plans by it), and `--quant_type`
int8 / nf4 quantizes the dequantized block as usual.

- MXFP4 (`mxfp4`; GPT-OSS's experts): `X_blocks` uint8 [..., rows, cols / 32, 16] holds two e2m1 values a byte (the
  low nibble first; `FP4_VALUES`), `X_scales` uint8 [..., rows, cols / 32] one e8m0 exponent per 32 values (the scale
  is 2 ** (byte - 127)). `X` = values * scales as [..., rows, cols], transposed to [..., cols, rows]: GPT-OSS's
  `mlp.experts.gate_up_proj_blocks` [experts, 2 * inter, hidden / 32, 16] gives `mlp.experts.gate_up_proj`
  [experts, hidden, 2 * inter], `down_proj_blocks` [experts, hidden, inter / 32, 16] gives `down_proj` [experts,
  inter, hidden] (transformers' `integrations.mxfp4.convert_moe_packed_tensors`, op for op).
- block-scaled FP8 (`fp8`, `weight_block_size` [bm, bn]; DeepSeek-V3 / R1, Qwen3's FP8 releases): `W.weight`
  float8_e4m3fn [rows, cols] with `W.weight_scale_inv` float32 [ceil(rows / bm), ceil(cols / bn)]; each weight's
  block (i, j) times scale_inv[i, j], in float32, then cast (transformers' `Fp8Dequantize`; the last blocks of a
  size the block does not divide are partial, as DeepSeek's own `weight_dequant`: its kv_a_proj_with_mqa has 576
  rows, 4.5 blocks). Without `weight_block_size`, one scale per tensor. Activation scales (`input_scale`) are
  dropped: the blocks compute in float.

A checkpoint that does not hold what its config says (a scale missing, of the wrong shape or dtype, a block size
that does not divide as the config says, an unknown quant_method) is a `QuantizationError` naming the tensor.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Dict, FrozenSet, Iterable, List, Optional, Sequence, Set, Tuple

import torch

FP4_VALUES = (+0.0, +0.5, +1.0, +1.5, +2.0, +3.0, +4.0, +6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
MXFP4_GROUP = 32  # values per e8m0 scale (16 bytes of blocks)
E8M0_BIAS = 127
FP8_WEIGHTS = (torch.float8_e4m3fn, torch.float8_e5m2)
METHODS = ("mxfp4", "fp8")
ACTIVATION_SCALES = (".input_scale", ".activation_scale")


class QuantizationError(ValueError):
    """The checkpoint's quantized tensors are not what its quantization config says."""


# (dtype, shape) of a stored tensor, from a safetensors header or the tensor itself
TensorInfo = Tuple[torch.dtype, Tuple[int, ...]]


@dataclass(frozen=True)
class QuantFormat:
    method: str  # "mxfp4" or "fp8"
    block_size: Optional[Tuple[int, int]] = None  # fp8: [rows, cols] per scale; None: one scale per tensor

    # ---- names ------------------------------------------------------------------------------------------
    def logical_name(self, stored: str) -> str:
        """The module tensor a stored tensor belongs to (`X_blocks`/`X_scales` -> `X`; `W.weight_scale_inv` ->
        `W.weight`)."""
        if self.method == "mxfp4":
            for suffix in ("_blocks", "_scales"):
                if stored.endswith(suffix):
                    return stored[:-len(suffix)]
            return stored
        if stored.endswith("_scale_inv"):
            return stored[:-len("_scale_inv")]
        for suffix in ACTIVATION_SCALES:
            if stored.endswith(suffix):
                return stored[:-len(suffix)] + ".weight"
        return stored

    # ---- checks -----------------------------------------------------------------------------------------
    def check_tensors(self, infos: Dict[str, TensorInfo]) -> None:
        """Raise `QuantizationError` naming the first tensor of `infos` (stored name -> (dtype, shape), one or
        more blocks' worth) that does not pair up as this format says."""
        for name in sorted(infos):
            if self.method == "mxfp4":
                self._check_mxfp4(name, infos)
            else:
                self._check_fp8(name, infos)

    def _check_mxfp4(self, name: str, infos: Dict[str, TensorInfo]) -> None:
        if name.endswith("_scales"):
            if self.logical_name(name) + "_blocks" not in infos:
                raise QuantizationError(f"{name}: an MXFP4 scale tensor without its {self.logical_name(name)}_blocks")
            return
        if not name.endswith("_blocks"):
            return
        base = self.logical_name(name)
        (dtype, shape), scales = infos[name], infos.get(base + "_scales")
        if scales is None:
            raise QuantizationError(f"{base}_scales is missing: the MXFP4 tensor {name} needs its scales")
        if dtype != torch.uint8 or scales[0] != torch.uint8:
            raise QuantizationError(f"{name} / {base}_scales: MXFP4 blocks and scales are uint8, got {dtype} and "
                                    f"{scales[0]}")
        if len(shape) < 3 or shape[-1] != MXFP4_GROUP // 2:
            raise QuantizationError(f"{name} has shape {list(shape)}: MXFP4 blocks are [..., rows, groups, "
                                    f"{MXFP4_GROUP // 2}] bytes ({MXFP4_GROUP} values per scale)")
        if tuple(scales[1]) != tuple(shape[:-1]):
            raise QuantizationError(f"{base}_scales has shape {list(scales[1])}, expected {list(shape[:-1])} (one "
                                    f"scale per {MXFP4_GROUP} values of {name} {list(shape)})")

    def _check_fp8(self, name: str, infos: Dict[str, TensorInfo]) -> None:
        if name.endswith("_scale_inv"):
            if self.logical_name(name) not in infos:
                raise QuantizationError(f"{name}: a scale tensor without its weight {self.logical_name(name)}")
            return
        dtype, shape = infos[name]
        scale = infos.get(name + "_scale_inv")
        if dtype not in FP8_WEIGHTS:
            if scale is not None:
                raise QuantizationError(f"{name} is {dtype}, not FP8, yet has a scale {name}_scale_inv")
            return
        if scale is None:
            raise QuantizationError(f"{name}_scale_inv is missing: the FP8 tensor {name} needs its scale")
        if not scale[0].is_floating_point and scale[0] != torch.uint8:
            raise QuantizationError(f"{name}_scale_inv is {scale[0]}, not a float scale")
        if self.block_size is None:
            if math.prod(scale[1]) != 1:
                raise QuantizationError(f"{name}_scale_inv has shape {list(scale[1])}: without weight_block_size "
                                        f"the config says one scale per tensor")
            return
        if len(shape) < 2:
            raise QuantizationError(f"{name} has shape {list(shape)}: block-scaled FP8 weights are matrices")
        expected = tuple(shape[:-2]) + tuple(-(-n // b) for n, b in zip(shape[-2:], self.block_size))
        if tuple(scale[1]) != expected:
            raise QuantizationError(
                f"{name}_scale_inv has shape {list(scale[1])}: weight_block_size {list(self.block_size)} does not "
                f"divide {name} {list(shape)} into that grid (expected {list(expected)})")

    # ---- dequantizing -----------------------------------------------------------------------------------
    def group(self, stored: str, names: Set[str]) -> FrozenSet[str]:
        """The stored tensors among `names` (what one read call reads) that make `stored`'s logical tensor: a
        quantized pair, or the tensor alone."""
        base = self.logical_name(stored)
        if self.method == "mxfp4":
            pair = frozenset((base + "_blocks", base + "_scales"))
            return pair if stored in pair else frozenset((stored,))
        if stored.endswith(ACTIVATION_SCALES):
            return frozenset((stored,))
        pair = frozenset((base, base + "_scale_inv"))
        return pair if base + "_scale_inv" in names or stored != base else frozenset((stored,))

    def dequantize(self, tensors: Dict[str, torch.Tensor], dtype: torch.dtype) -> Dict[str, torch.Tensor]:
        """Stored tensors (one or more blocks' worth, popped from `tensors` as they are done) -> logical names,
        quantized pairs dequantized into `dtype`, other tensors as they are."""
        self.check_tensors({name: (t.dtype, tuple(t.shape)) for name, t in tensors.items()})
        result: Dict[str, torch.Tensor] = {}
        for name in sorted(tensors):
            if name not in tensors:
                continue  # (the other half of a pair already done)
            if self.method == "mxfp4" and name.endswith(("_blocks", "_scales")):
                base = self.logical_name(name)
                result[base] = dequantize_mxfp4(tensors.pop(base + "_blocks"), tensors.pop(base + "_scales"), dtype)
            elif self.method == "fp8" and name.endswith(ACTIVATION_SCALES):
                tensors.pop(name)
            elif self.method == "fp8" and (name + "_scale_inv") in tensors:
                result[name] = dequantize_fp8(tensors.pop(name), tensors.pop(name + "_scale_inv"), self.block_size,
                                              dtype)
            else:
                result[name] = tensors.pop(name)
        return result


def dequantize_mxfp4(blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """blocks uint8 [..., rows, groups, 16], scales uint8 [..., rows, groups] -> [..., groups * 32, rows] `dtype`.

    Each byte's two values from one 256-entry table (low nibble first), times 2 ** (scale - 127) per group
    (`ldexp`): the numbers of transformers' `convert_moe_packed_tensors`, in one gather; one expert (leading index)
    at a time, written transposed into the result, so that the temporaries are one expert's."""
    *prefix, rows, groups, width = blocks.shape
    values = torch.tensor(FP4_VALUES, dtype=dtype)
    pairs = torch.stack([values.repeat(16), values.repeat_interleave(16)], dim=-1)  # [256, 2]: byte -> (lo, hi)
    count = math.prod(prefix)
    result = torch.empty(count, groups * width * 2, rows, dtype=dtype)
    blocks, scales = blocks.reshape(count, rows * groups, width), scales.reshape(count, rows * groups, 1)
    for i in range(count):
        out = pairs[blocks[i].to(torch.int64)].view(rows * groups, width * 2)  # [rows * groups, 32]
        torch.ldexp(out, scales[i].to(torch.int32) - E8M0_BIAS, out=out)  # times 2 ** (scale - 127)
        result[i] = out.view(rows, groups * width * 2).t()
    return result.view(*prefix, groups * width * 2, rows)


def dequantize_fp8(weight: torch.Tensor, scale_inv: torch.Tensor, block_size: Optional[Tuple[int, int]],
                   dtype: torch.dtype) -> torch.Tensor:
    """weight FP8 [..., rows, cols] times its scales (float32, or e8m0 bytes: 2 ** (byte - 127)) per block of
    `block_size` (the last ones partial), computed in float32 -> `dtype`, one band of block rows at a time (the
    float32 temporaries: one band's)."""
    scale = (scale_inv.to(torch.float32) - E8M0_BIAS).exp2() if scale_inv.dtype == torch.uint8 \
        else scale_inv.to(torch.float32)
    if block_size is None:
        return weight.to(torch.float32).mul_(scale.reshape(())).to(dtype)
    rows, cols = weight.shape[-2:]
    bm, bn = block_size
    whole = cols // bn * bn
    result = torch.empty(weight.shape, dtype=dtype)
    for band, r0 in enumerate(range(0, rows, bm)):
        w = weight[..., r0:r0 + bm, :].to(torch.float32)  # [..., <= bm, cols]
        s = scale[..., band, None, :]  # [..., 1, col blocks]
        w[..., :whole].unflatten(-1, (cols // bn, bn)).mul_(s[..., :cols // bn, None])
        if whole < cols:  # the last, partial column block
            w[..., whole:].mul_(s[..., cols // bn:])
        result[..., r0:r0 + bm, :] = w
    return result


def quant_format(config: Optional[dict]) -> Optional[QuantFormat]:
    """The format of a `quantization_config` dict (None: not quantized); a `QuantizationError` for one not read."""
    if not config:
        return None
    method = config.get("quant_method")
    if method not in METHODS:
        raise QuantizationError(f"quantization_config.quant_method {method!r} is not supported (supported: "
                                f"{', '.join(METHODS)}: checkpoints as published, dequantized at load)")
    if method == "mxfp4":
        return QuantFormat("mxfp4")
    if config.get("fmt", "e4m3") not in ("e4m3", "float8_e4m3fn"):
        raise QuantizationError(f"quantization_config.fmt {config.get('fmt')!r}: FP8 checkpoints in e4m3 are read")
    block = config.get("weight_block_size")
    if block is None:
        return QuantFormat("fp8")
    if not isinstance(block, Sequence) or len(block) != 2 or not all(isinstance(b, int) and b > 0 for b in block):
        raise QuantizationError(f"quantization_config.weight_block_size {block!r} is not two positive integers")
    return QuantFormat("fp8", (int(block[0]), int(block[1])))


def stored_names(fmt: Optional[QuantFormat], names: Iterable[str], select) -> List[str]:
    """The stored tensors whose logical names `select` accepts."""
    if fmt is None:
        return [name for name in names if select(name)]
    return [name for name in names if select(fmt.logical_name(name))]
