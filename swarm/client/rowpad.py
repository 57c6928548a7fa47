"""Padding small-batch matrix products on the CPU to the row count the BLAS runs fastest.

MKL picks its sgemm kernel by the number of rows, and for a wide weight the choice is not monotonic. The client's
LM head ([vocab, hidden] = [49152, 576] for SmolLM2) on this project's 2-core Xeon (float32, 2 threads, weight
not in cache) takes 4.3 ms for 1 row, 8.8 ms for 4, 13.0 ms for 8, 16.6 ms for 12 and 8.4 ms for 16: a batch of
8 sessions' heads runs faster as 16 rows, half of them zeros. Other CPUs and BLAS versions differ, so
`RowPadding` does not assume it: it times the product as it is and padded to the next multiple, a few times
each, for every row count (`calibrate`, at load, or the first time it sees a count), and from then on uses
whichever was faster for that count.
"""
from __future__ import annotations

import time
from typing import Dict, Optional

import torch
import torch.nn.functional as F


class RowPadding:
    def __init__(self, multiple: int = 16, min_rows: int = 4, trials: int = 2):
        self.multiple, self.min_rows, self.trials = multiple, min_rows, trials
        self.pad: Dict[int, bool] = {}  # row count -> whether padding was faster
        self._buffers: Dict[tuple, tuple] = {}  # (target rows, in, out, dtype) -> (input [target, in], output)

    def _product(self, x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor], pad: bool
                 ) -> torch.Tensor:
        """x @ weight.T (+ bias), padded or not, through reused buffers (fresh outputs of several MB each call,
        while timing both ways, fragmented a gateway's heap: +10 MB of peak RSS with 8 concurrent chats);
        returns a tensor of its own, [rows, out]."""
        rows = x.shape[0]
        target = -(-rows // self.multiple) * self.multiple
        key = (target, x.shape[1], weight.shape[0], x.dtype)
        if key not in self._buffers:
            self._buffers = {key: (x.new_zeros((target, x.shape[1])), x.new_empty((target, weight.shape[0])))}
        padded, out = self._buffers[key]
        if pad:
            padded[:rows] = x
            padded[rows:].zero_()
            torch.mm(padded, weight.t(), out=out)
        else:
            torch.mm(x, weight.t(), out=out[:rows])
        result = out[:rows].clone()
        return result if bias is None else result.add_(bias)

    def linear(self, x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor] = None) -> torch.Tensor:
        """F.linear(x, weight, bias) for x [rows, in], padded with zero rows when that was measured faster.
        Not thread-safe (its buffers are reused): one caller thread, like the client's compute thread."""
        rows = x.shape[0]
        if x.device.type != "cpu" or x.ndim != 2 or rows < self.min_rows or rows % self.multiple == 0:
            return F.linear(x, weight, bias)
        choice = self.pad.get(rows)
        if choice is None:
            return self._calibrate(x, weight, bias)
        return self._product(x, weight, bias, choice)

    def calibrate(self, weight: torch.Tensor, bias: Optional[torch.Tensor] = None) -> None:
        """Time every row count from `min_rows` up to `multiple` now (a client model does it at load, half a second
        for SmolLM2's head, rather than amid its first concurrent sessions)."""
        if weight.device.type != "cpu":
            return
        generator = torch.Generator().manual_seed(0)
        with torch.no_grad():
            for rows in range(self.min_rows, self.multiple):
                x = torch.randn(rows, weight.shape[1], generator=generator).to(weight.dtype)
                self._calibrate(x, weight, bias)
        self._buffers = {}  # made again at the first padded product

    def _calibrate(self, x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor]) -> torch.Tensor:
        best = {False: float("inf"), True: float("inf")}
        out = None
        for _ in range(self.trials):
            for pad in (False, True):
                began = time.perf_counter()
                out = self._product(x, weight, bias, pad)
                best[pad] = min(best[pad], time.perf_counter() - began)
        self.pad[x.shape[0]] = best[True] < best[False]
        assert out is not None  # trials >= 1
        return out
