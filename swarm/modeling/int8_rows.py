"""LLM.int8() over row groups: several sessions' rows through one bitsandbytes `Linear8bitLt` call, each session's
rows quantized as bitsandbytes quantizes them when they are a call of their own, so that a merged decode batch gives
every session, bit for bit, what its steps alone give (issue 50).

bitsandbytes 0.50's forward of an eval-mode `Linear8bitLt` (`MatMul8bitLt.forward`, threshold 6.0) on x [rows, in]:
1. `int8_vectorwise_quant(x.half(), threshold)`: the entries with |x| >= threshold are the outliers; a column with an
   outlier in ANY row of the call is an outlier column; each row's scale is the absmax of its entries with the
   outliers zeroed (so a row's scale is its own), its int8 values round(x * 127 / scale), and the outlier columns
   zeroed in every row of the call;
2. `int8_scaled_mm`: one int8 matmul with the int8 weight (`torch._int_mm` on AVX-512 CPUs, exact integers; else a
   float32 matmul of integers) and `int8_mm_dequant` (elementwise: int32 * (row scale * weight row scale) / 127^2,
   plus the bias);
3. `int8_mixed_scaled_mm`: out.addmm(x[:, outlier columns], dequantized weight columns^T), the outlier columns'
   float products added.
Only the outlier column set mixes rows: one session's outlier columns zero the other sessions' int8 values there
and move those products into the float part. `grouped_linear` therefore computes step 1 per row (as it is), zeroes
each row's own group's outlier columns (one masked fill), runs step 2 once for all rows, and step 3 per group that has
outlier columns, with bitsandbytes' own ops on the same operands.

Why step 3 is not one batched op: MKL's sgemm sums an output's K products in an order that depends on the call's
shape. Measured here (torch 2.13 / MKL 2024.2, AVX-512): the same row's `addmm` over the same K columns gives other
last bits when it is one of 16 rows than alone (K >= 2), and padding K with zero columns (a masked matmul over the
union of the groups' columns, rows zeroed outside their own) changes the bits from K >= 7 (about 1 in 2 outputs of
a 960-wide projection, by 1-2 ulp). Each group's own `addmm` (its rows, its columns, as bitsandbytes calls it) is
exact; it reads only the outlier columns of the weight, a few of its hundreds, so the weight is still read once.

Step 2 is exact whatever the rows around: `torch._int_mm` sums integers; bitsandbytes' fallback on CPUs without
AVX-512, a float32 matmul of the int8 values, is exact while every partial sum stays within 2^24 (always for
in_features <= 1040, as 127 * 127 * 1040 < 2^24; beyond, only rows of nearly all +-127 values of one sign could
round).

Step 1 reproduces bitsandbytes' CPU quantization (its default `int8_vectorwise_quant`, torch ops) op for op, so the
server groups rows on CPU spans only (`server.compute.blocks.BlockSpan.groups_int8_rows`). On CUDA bitsandbytes
quantizes rows in a kernel of its own (`cint8_vector_quant`, then the outlier columns zeroed in Python); the exact
route there would be that op per group (its rows alone), then steps 2 and 3 as here: left to a GPU check.

The groups are set by the caller around a step (`row_groups`, a context variable: the server's batched decode and
merged prefill, `server.compute.blocks.BlockSpan`); `QuantizedLayer`'s projections call `linear` (`grouped_linear`
where groups are set, else the module as it is). Shapes: x [..., in] with rows = prod(leading dims), groups' sizes
summing to rows, in row order.
"""
from __future__ import annotations

import contextlib
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import Any, Iterator, List, Optional, Sequence

import torch
from torch import nn


@dataclass
class RowGroups:
    """Consecutive row groups of one step's calls: `sizes` [groups], rows r0..r1 each (`bounds`); `ids` [rows]: each
    row's group (built once, for every call of the step)."""

    sizes: List[int]
    bounds: List[tuple] = field(init=False)
    ids: Optional[torch.Tensor] = field(init=False, default=None)

    def __post_init__(self) -> None:
        if not self.sizes or any(size < 1 for size in self.sizes):
            raise ValueError(f"row groups need sizes of at least 1 row: {self.sizes}")
        self.bounds, row = [], 0
        for size in self.sizes:
            self.bounds.append((row, row + size))
            row += size
        self.rows = row
        self.single_rows = all(size == 1 for size in self.sizes)

    def group_ids(self, device: torch.device) -> torch.Tensor:
        if self.ids is None or self.ids.device != device:
            self.ids = torch.repeat_interleave(torch.arange(len(self.sizes), device=device),
                                               torch.tensor(self.sizes, device=device))
        return self.ids


_GROUPS: ContextVar[Optional[RowGroups]] = ContextVar("int8_row_groups", default=None)


@contextlib.contextmanager
def row_groups(sizes: Sequence[int]) -> Iterator[RowGroups]:
    """Inside: int8 projections (`linear`) quantize rows in groups of `sizes` (in row order), each as a call of its
    own would."""
    groups = RowGroups(list(sizes))
    token = _GROUPS.set(groups)
    try:
        yield groups
    finally:
        _GROUPS.reset(token)


def linear(module: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """An int8 module (`Linear8bitLt`) on x [..., in] -> [..., out]: per row group where `row_groups` set more than
    one, else the module's own call."""
    groups = _GROUPS.get()
    if groups is None or len(groups.sizes) == 1:
        return module(x)
    return grouped_linear(module, x, groups)


def _dequantized_columns(cb: torch.Tensor, scb: torch.Tensor, cols: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The weight's columns `cols` in float [len(cols), out], as `int8_mixed_scaled_mm` builds them."""
    return torch.ops.bitsandbytes.int8_vectorwise_dequant.default(cb[:, cols].contiguous(), scb).to(dtype).t()


@torch.inference_mode()
def grouped_linear(module: Any, x: torch.Tensor, groups: RowGroups) -> torch.Tensor:
    """`module` (an eval-mode `bitsandbytes.nn.Linear8bitLt` without float weights) on x [..., in] -> [..., out],
    each group's rows computed as the module computes them in a call of their own (see the module docstring)."""
    if module.training or module.state.has_fp16_weights:
        raise ValueError("row-grouped int8 needs an eval-mode Linear8bitLt with int8 weights")
    if module.weight.CB is not None:  # (as Linear8bitLt.forward: the weight's int8 state moved into module.state)
        module.init_8bit_state()
    bias = module.bias
    if bias is not None and bias.dtype != x.dtype:
        bias.data = bias.data.to(x.dtype)
    state = module.state
    cb, scb = state.CB, state.SCB  # [out, in] int8, [out] float32
    a = x.reshape(-1, x.shape[-1])  # [rows, in]
    if a.shape[0] != groups.rows:
        raise ValueError(f"int8 row groups of {groups.rows} rows, but the call has {a.shape[0]}")
    # 1. per row: outliers zeroed, absmax scale, int8 values (`int8_vectorwise_quant`, op for op)
    half = a.to(torch.float16)
    outliers = half.abs() >= state.threshold if state.threshold > 0.0 else None  # [rows, in]
    if outliers is not None:
        half = half.masked_fill(outliers, 0)
    row_stats = torch.max(half.abs(), dim=1).values.float()  # [rows]
    ca = torch.round(half * (127.0 / row_stats.unsqueeze(-1))).to(torch.int8)  # [rows, in]
    columns = None  # [groups, in]: each group's outlier columns
    if outliers is not None:
        if groups.single_rows:
            columns = outliers  # a one-row call's outlier columns are its outliers (zeroed already)
        else:
            ids = groups.group_ids(a.device)
            columns = torch.zeros(len(groups.sizes), a.shape[1], dtype=torch.int32, device=a.device).index_add_(
                0, ids, outliers.to(torch.int32)) > 0
            ca.masked_fill_(columns.index_select(0, ids), 0)  # each row's own group's outlier columns
    # 2. one int8 matmul for all rows, dequantized with the bias (`int8_scaled_mm`)
    out = torch.ops.bitsandbytes.int8_scaled_mm.default(ca, cb, row_stats, scb, bias=bias, dtype=a.dtype)
    # 3. each group's outlier columns in float, with its own addmm (`int8_mixed_scaled_mm`)
    if columns is not None:
        counts = columns.sum(dim=1).tolist()
        if any(counts):
            listed = columns.nonzero()[:, 1]  # every group's columns, ascending, group after group
            offset = 0
            for (r0, r1), count in zip(groups.bounds, counts):
                if count:
                    cols = listed[offset:offset + count]
                    offset += count
                    out[r0:r1] = out[r0:r1].addmm(a[r0:r1, cols], _dequantized_columns(cb, scb, cols, a.dtype))
    return out.reshape(*x.shape[:-1], cb.shape[0])
