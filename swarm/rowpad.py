"""Padding small-batch matrix products on the CPU to the row count the BLAS runs fastest.

MKL picks its sgemm kernel by the number of rows, and for a wide weight the choice is not monotonic. The client's
LM head ([vocab, hidden] = [49152, 576] for SmolLM2) on this project's 2-core Xeon (float32, 2 threads, weight
not in cache) takes 4.3 ms for 1 row, 8.8 ms for 4, 13.0 ms for 8, 16.6 ms for 12 and 8.4 ms for 16: a batch of
8 sessions' heads runs faster as 16 rows, half of them zeros. Other CPUs and BLAS versions differ, so
`RowPadding` does not assume it: the first time it sees a row count it times the product as it is and padded to
the next multiple, a few times each, and from then on uses whichever was faster for that count.
"""
from __future__ import annotations

import time
from typing import Dict, Optional

import torch
import torch.nn.functional as F


class RowPadding:
    def __init__(self, multiple: int = 16, min_rows: int = 4, trials: int = 3):
        self.multiple, self.min_rows, self.trials = multiple, min_rows, trials
        self.pad: Dict[int, bool] = {}  # row count -> whether padding was faster

    def _padded(self, x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor]) -> torch.Tensor:
        rows = x.shape[0]
        target = -(-rows // self.multiple) * self.multiple
        padded = x.new_zeros((target, x.shape[1]))  # [target, in]
        padded[:rows] = x
        return F.linear(padded, weight, bias)[:rows]

    def linear(self, x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor] = None) -> torch.Tensor:
        """F.linear(x, weight, bias) for x [rows, in], padded with zero rows when that was measured faster."""
        rows = x.shape[0]
        if x.device.type != "cpu" or x.ndim != 2 or rows < self.min_rows or rows % self.multiple == 0:
            return F.linear(x, weight, bias)
        choice = self.pad.get(rows)
        if choice is None:
            return self._calibrate(x, weight, bias)
        return self._padded(x, weight, bias) if choice else F.linear(x, weight, bias)

    def _calibrate(self, x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor]) -> torch.Tensor:
        best = {False: float("inf"), True: float("inf")}
        out = None
        for _ in range(self.trials):
            for pad in (False, True):
                began = time.perf_counter()
                out = self._padded(x, weight, bias) if pad else F.linear(x, weight, bias)
                best[pad] = min(best[pad], time.perf_counter() - began)
        self.pad[x.shape[0]] = best[True] < best[False]
        return out
