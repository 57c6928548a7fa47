"""Small-batch matrix products on the CPU: the few rows of a batched decode step at the BLAS's best speed.

MKL's sgemm is tuned for large products. For the few rows of a decode step (one per session) against a wide
weight it repacks the weight on every call and picks its kernel by the row count, not monotonically. On the
project's 2-core Xeon (float32, 2 threads, weights not in cache, steady state) the gate/up projections of 15
SmolLM2 blocks ([3072, 576] each) take 2.2 ms for 1 row, 6.9 ms for 8 and 6.2 ms for 16; the LM head
([49152, 576]) 2.3 / 7.7 / 5.7 ms. Two remedies:
- packing (`packed_rows`): MKL's packed GEMM (`cblas_sgemm_pack` / `cblas_sgemm_compute`, through torch.ops.mkl),
  the weight packed once for a row count m (one more copy of the weight per m); a product of `min_packed` to m
  rows, padded with zeros to the smallest such m, runs on it: the gate/up projections above take 3.6-4.1 ms for
  4 to 8 rows packed for 8 and about 5 ms for 9 to 16 packed for 16, the head 3.7 ms for 8 rows. Packed products
  lose their edge for a row or two and right after an idle spell (both ways then take longer), so the rule is
  fixed rather than timed at load: a CPU that was idle would time the wrong winner.
- padding (no memory): where no pack applies, the rows padded with zeros to a multiple (16) when that product
  was timed faster (`calibrate`, per row count, as each weight's product back to back). The timings are kept on
  disk (`<swarmgate cache>/gemm-calibration.json`, keyed by the CPU, torch's version, the product's shape, thread
  count and settings): every later process on the machine (each gateway start: ~0.5 s of CPU for SmolLM2's head)
  takes them instead of timing again, and gets the same answer. Processes starting at once add their entries one
  at a time (a lock file beside it, `_store`), each write replaces the file whole (`swarm.runtime.paths.write_json`),
  and a damaged file or entry is timed again (one warning), never a failed start.
- column blocks (no memory): the product of many rows against a wide weight (an LM head: 49152 outputs) written
  in blocks of `COLUMN_BLOCK` outputs (`torch.mm` into column views of one output), each block's output still in
  cache while it is written: on a 2-core AMD EPYC (one thread), 64 rows against SmolLM2's head 60 -> 48 ms, 16 rows
  27 -> 21 ms, against a hidden-64 head 10 -> 7 ms; the values are the plain product's, bit for bit (each output
  is the same dot product). Used from `multiple` rows up where `calibrate` timed it faster and found the plain
  product's bits (at `multiple` and at four times it; kept in the same file); wide weights only (`COLUMN_MIN_OUT`).
Results differ from the plain product's in the last bits only (another summation order), as between batch sizes.

`GemmGroup` makes the products (`gemm(weight, bias)` -> `SmallGemm`) of one compute thread (a server's span, a
client's LM head) and owns their padding buffers: not thread-safe, one compute thread per group
(`swarm.runtime.taskpool`). Products that need gradients, and inputs of more than 2 dimensions, stay plain.
A `lazy` group packs nothing at first: its owner calls `pack_pending(budget)` where packs would be used (a server,
on its decode batches of several rows), which packs weights in order for about that long; each product uses its
packs once they exist. A server that never batches sessions never spends the time nor the memory, and packing a
large span does not stall one step (15 SmolLM2 blocks: about 0.4 s in all).
"""
from __future__ import annotations

import functools
import os
import platform
import time
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple

import torch
import torch.nn.functional as F
from filelock import FileLock, Timeout

from swarm.runtime.paths import cache_root, read_json, warn_damaged, write_json

# a row count's way: the plain product, padded to the multiple, in column blocks, or a pack's row count
PLAIN, PADDED, COLUMNS = 0, -1, -2
COLUMN_BLOCK = 2048  # outputs per block of a product in column blocks ([rows, 2048] float32: 512 KB for 64 rows)
COLUMN_MIN_OUT = 4 * COLUMN_BLOCK  # narrower weights are never run in column blocks
# `GemmGroup.calibrate`'s timings in this process: (weight shape, has bias, threads, settings) -> {rows: padded}
_TIMED: Dict[tuple, Dict[int, bool]] = {}
CALIBRATION_FILE = "gemm-calibration.json"
STORE_LOCK_TIMEOUT = 10.0  # seconds to wait for another process's write of the file


def _calibration_path() -> Path:
    return cache_root() / CALIBRATION_FILE


@functools.lru_cache(maxsize=1)
def _machine() -> str:
    """The CPU (model name, cores) and torch's version: a timing holds for these only."""
    name = platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            name = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), name)
    except OSError:
        pass
    return f"{name}|{os.cpu_count()}cpus|torch {torch.__version__}"


def _stored(key: tuple) -> Optional[Dict[int, bool]]:
    """The timing kept on disk for `key` on this machine, if any. A damaged file (unreadable, half-written, not the
    shape `_store` writes) is none, with one warning (`read_json`'s, or this one for a damaged entry): the product
    is timed again and the file's entry replaced."""
    path = _calibration_path()
    entries = read_json(path).get(_machine())
    entry = entries.get(repr(key)) if isinstance(entries, dict) else None
    if entry is None:
        if entries is not None and not isinstance(entries, dict):
            _damaged_entry(path, f"this machine's timings are a {type(entries).__name__}")
        return None
    try:
        if not isinstance(entry, dict) or not all(isinstance(v, bool) for v in entry.values()):
            raise ValueError(f"not an object of true/false by row count: {entry!r:.80}")
        return {int(rows): padded for rows, padded in entry.items()}
    except ValueError as e:
        _damaged_entry(path, e)
        return None


def _damaged_entry(path: Path, why: object) -> None:
    warn_damaged(path, f"holds a damaged timing ({why}): timed again")


def _store(key: tuple, padded: Dict[int, bool]) -> None:
    """Add a timing to the file: read again and written under a lock file beside it, so that processes adding theirs
    at once keep each other's (each would otherwise write back what it read, without the other's new entry)."""
    path = _calibration_path()
    try:
        with FileLock(str(path.with_name(f".{path.name}.lock")), timeout=STORE_LOCK_TIMEOUT):
            data = read_json(path)
            entries = data.get(_machine())
            if not isinstance(entries, dict):
                entries = data[_machine()] = {}
            entries[repr(key)] = {str(rows): value for rows, value in padded.items()}
            write_json(path, data)
    except (OSError, Timeout):
        pass  # a read-only cache, or a writer that holds the lock too long: this process's timing stays its own


def valid_packed_rows(value: Sequence[int]) -> List[int]:
    """A config's packed row counts, sorted without repeats; ValueError outside 3..256 (fewer rows are never
    packed: `GemmGroup.min_packed`)."""
    if any(not 3 <= m <= 256 for m in value):
        raise ValueError(f"each packed row count must be 3 to 256 (fewer rows are never packed), got {list(value)}")
    return sorted(set(value))


def packing_available() -> bool:
    """This torch has MKL's packed GEMM (x86 builds with MKL; not ARM or macOS builds)."""
    return torch.backends.mkl.is_available() and hasattr(torch.ops.mkl, "_mkl_reorder_linear_weight")


class SmallGemm:
    """x @ weight.T (+ bias) for x [rows, in] -> [rows, out], the group's way for `rows`."""

    def __init__(self, group: "GemmGroup", weight: torch.Tensor, bias: Optional[torch.Tensor]):
        self.group, self.weight, self.bias = group, weight, bias
        # row count m -> the weight packed for m rows (its own storage: one more copy of the weight)
        self.packs: Dict[int, torch.Tensor] = {}
        self.padded: Dict[int, bool] = {}  # row count -> padding to the multiple was timed faster (`calibrate`)
        # row count (the multiple, four times it) -> column blocks were timed faster from there up (`calibrate`)
        self.columns: Dict[int, bool] = {}

    def pack(self) -> None:
        for m in self.group.packed_rows:
            if m not in self.packs:
                self.packs[m] = torch.ops.mkl._mkl_reorder_linear_weight(self.weight, m)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if x.ndim != 2 or x.requires_grad:
            return F.linear(x, self.weight, self.bias)
        way = self.group.way(x.shape[0], self.padded)
        if way == PLAIN or (way > 0 and way not in self.packs):
            way = COLUMNS if self.columns and self.group.by_columns(x.shape[0], self.columns) else PLAIN
        return self.product(x, way)

    def product(self, x: torch.Tensor, way: int) -> torch.Tensor:
        """The product `way` (PLAIN, PADDED, COLUMNS or a pack's row count); a packed one returns a view of its rows
        (of a fresh output), a padded one a copy of them (out of a reused buffer)."""
        rows = x.shape[0]
        if x.shape[1] != self.weight.shape[1]:  # (MKL's packed product does not check the input's width)
            raise ValueError(f"input width {x.shape[1]} does not match the weight's {self.weight.shape[1]}")
        if way == PLAIN:
            return F.linear(x, self.weight, self.bias)
        if way == COLUMNS:  # [rows, out], block by block: each block's product into its column view
            out = x.new_empty((rows, self.weight.shape[0]))
            for start in range(0, self.weight.shape[0], COLUMN_BLOCK):
                end = start + COLUMN_BLOCK
                torch.mm(x, self.weight[start:end].t(), out=out[:, start:end])
            return out if self.bias is None else out.add_(self.bias)
        target = way if way > 0 else -(-rows // self.group.multiple) * self.group.multiple
        padded = self.group.padded_input(target, x)
        if way > 0:
            out = torch.ops.mkl._mkl_linear(padded, self.packs[way], self.weight, None, way)[:rows]
        else:  # into a reused buffer, the rows copied out: fresh outputs of several MB each call (an LM head's)
            # fragmented a gateway's heap (+10 MB of peak RSS with 8 concurrent chats)
            full = self.group.output_buffer(target, self.weight)
            out = torch.mm(padded, self.weight.t(), out=full)[:rows].clone()
        return out if self.bias is None else out.add_(self.bias)


class GemmGroup:
    """The small products of one compute thread. `packed_rows`: row counts to pack every weight for (each costs
    one more copy of the weights; dropped where this torch has no packed GEMM); `min_packed`: fewer rows stay
    unpacked; `multiple`: the row count padding pads to."""

    def __init__(self, packed_rows: Sequence[int] = (), min_packed: int = 3, multiple: int = 16, trials: int = 2,
                 lazy: bool = False):
        if any(int(m) < 1 for m in packed_rows):
            raise ValueError(f"packed row counts must be positive, got {list(packed_rows)}")
        self.packed_rows: Tuple[int, ...] = tuple(sorted({int(m) for m in packed_rows})) \
            if packing_available() else ()
        self.min_packed, self.multiple, self.trials, self.lazy = min_packed, multiple, trials, lazy
        self.members: List[SmallGemm] = []
        self._unpacked = 0  # members[_unpacked:] have no packs yet (a lazy group's)
        self._buffers: Dict[Tuple[int, int, torch.dtype], torch.Tensor] = {}

    def gemm(self, weight: torch.Tensor, bias: Optional[torch.Tensor] = None) -> SmallGemm:
        """A product for `weight` [out, in] (float32, CPU, contiguous), packed for the group's row counts."""
        if weight.device.type != "cpu" or weight.dtype != torch.float32 or not weight.is_contiguous():
            raise ValueError("small-batch products are for contiguous float32 CPU weights")
        member = SmallGemm(self, weight, bias)
        self.members.append(member)
        if not self.lazy:
            member.pack()
            self._unpacked = len(self.members)
        return member

    @property
    def pending(self) -> bool:
        """Some weights still wait for their packs (`pack_pending`)."""
        return bool(self.packed_rows) and self._unpacked < len(self.members)

    def pack_pending(self, budget: float = 0.01) -> None:
        """Pack the next weights in order until about `budget` seconds went by (at least one)."""
        until = time.perf_counter() + budget
        while self.pending:
            self.members[self._unpacked].pack()
            self._unpacked += 1
            if time.perf_counter() >= until:
                break

    def way(self, rows: int, padded: Dict[int, bool]) -> int:
        """How a product of `rows` runs: the smallest pack that holds them, else padded where timed faster."""
        if rows >= self.min_packed:
            for m in self.packed_rows:
                if rows <= m:
                    return m
        return PADDED if padded.get(rows, False) else PLAIN

    def by_columns(self, rows: int, columns: Dict[int, bool]) -> bool:
        """Whether a product of `rows` that no pack or padding takes runs in column blocks: from the multiple up,
        where timed faster at the largest timed row count not above `rows`."""
        timed = [count for count in columns if count <= rows]
        return rows >= self.multiple and bool(timed) and columns[max(timed)]

    def packed_bytes(self) -> int:
        """Memory the packs hold: a weight's size each (MKL reserves more address space than it fills)."""
        return sum(g.weight.numel() * g.weight.element_size() * len(g.packs) for g in self.members)

    def padded_input(self, target: int, x: torch.Tensor) -> torch.Tensor:
        """[target, in]: x's rows, then zeros (a buffer reused by every product of that shape)."""
        key = (target, x.shape[1], x.dtype)
        buffer = self._buffers.get(key)
        if buffer is None:
            buffer = self._buffers[key] = torch.zeros(target, x.shape[1], dtype=x.dtype)
        rows = x.shape[0]
        buffer[:rows].copy_(x)
        buffer[rows:].zero_()
        return buffer

    def output_buffer(self, target: int, weight: torch.Tensor) -> torch.Tensor:
        key = (-target, weight.shape[0], weight.dtype)  # (negative rows: not an input buffer's key)
        buffer = self._buffers.get(key)
        if buffer is None:
            buffer = self._buffers[key] = weight.new_empty((target, weight.shape[0]))
        return buffer

    @torch.inference_mode()
    def calibrate(self, min_rows: int = 4) -> None:
        """Time each member's product plain and padded for every row count from `min_rows` below the multiple
        that no pack takes, and remember which was faster (a client model does it at load: half a second for
        SmolLM2's head, rather than amid its first concurrent sessions). A product of the same shape, thread count
        and settings timed before in this process (`_TIMED`) or on this machine (the file) takes that timing."""
        generator = torch.Generator().manual_seed(0)
        for member in self.members:
            key = (tuple(member.weight.shape), member.bias is not None, torch.get_num_threads(), min_rows,
                   self.multiple, self.trials, self.min_packed, self.packed_rows)
            if key not in _TIMED:
                stored = _stored(key)
                if stored is not None:
                    _TIMED[key] = stored
            self._calibrate_columns(member, generator)
            if key in _TIMED:
                member.padded.update(_TIMED[key])
                continue
            for rows in range(min_rows, self.multiple):
                if self.way(rows, {}) != PLAIN:
                    continue  # a pack takes it
                x = torch.randn(rows, member.weight.shape[1], generator=generator)
                member.padded[rows] = self._faster(member, x, PADDED)
            _TIMED[key] = dict(member.padded)
            _store(key, _TIMED[key])
        self._buffers = {}  # made again at the first padded product

    def _calibrate_columns(self, member: SmallGemm, generator: torch.Generator) -> None:
        """Time a wide weight's product plain and in column blocks at the multiple and four times it (kept like the
        padding's timings, under their own key); column blocks are taken where faster and bit for bit the same."""
        if member.weight.shape[0] < COLUMN_MIN_OUT:
            return
        key = (tuple(member.weight.shape), member.bias is not None, torch.get_num_threads(), "columns, exact",
               COLUMN_BLOCK, self.multiple, self.trials)
        if key not in _TIMED:
            _TIMED[key] = _stored(key) or {}
        if not _TIMED[key]:
            for rows in (self.multiple, 4 * self.multiple):
                x = torch.randn(rows, member.weight.shape[1], generator=generator)
                member.product(x, PLAIN)  # (the weight into the caches first: the first way timed is not cold)
                # (only where its values are the plain product's, bit for bit: a near-tie's pick never moves)
                same = torch.equal(member.product(x, COLUMNS), member.product(x, PLAIN))
                _TIMED[key][rows] = same and self._faster(member, x, COLUMNS)
            _store(key, _TIMED[key])
        member.columns.update(_TIMED[key])

    def _faster(self, member: SmallGemm, x: torch.Tensor, way: int) -> bool:
        """Whether the product `way` of `x` beat the plain one (each's best of `trials`, alternating)."""
        best = {PLAIN: float("inf"), way: float("inf")}
        for _ in range(self.trials):
            for each in (PLAIN, way):
                began = time.perf_counter()
                member.product(x, each)
                best[each] = min(best[each], time.perf_counter() - began)
        return best[way] < best[PLAIN]
