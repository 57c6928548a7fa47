"""LoRA adapters on a span's blocks: an adapter's tensors for a span (`SpanAdapter`), and the per-row low-rank
deltas of a step (`AdaptedLayer`). Reading and checking an adapter's files: `swarm.modeling.lora_files`.

The math (as peft's `lora.Linear.forward`): `y = base(x) + (x @ A^T) @ B^T * scaling`, scaling = `lora_alpha / r`
(`lora_alpha / sqrt(r)` with `use_rslora`). Per block, the A matrices of the projections that share an input are
concatenated (q/k/v: the input-normed hidden state; gate/up: the post-normed one) and their B matrices (times
their scalings) form one block-diagonal matrix over the fused output's columns, so each projection of a row group
takes two small matmuls, the second added in place into the base output's rows.

`AdaptedLayer` wraps a server block (`swarm.modeling.families.llama.FusedLayer` or `swarm.modeling.quantize.
QuantizedLayer`, a mixture of experts' fused layer, a layer that projects by groups, `project`: BLOOM, Falcon,
Gemma) for one step whose rows [rows, ...] (flattened leading dims) come in groups, each with its own adapter or
none: the base projections run once on all rows, and each group adds its own delta to its rows only. The wrapped
layer is what the block's step reads (`step`, `qkv`, `add_o_proj`, `gate_up`, `add_down`, `project`; `expert_rows`
for the experts, `absorbed` for DeepSeek-V3's kv_b_proj), so the server's decode and prefill paths
(`server.compute.decode`) run it unchanged.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Sequence, Tuple

import torch

from swarm.modeling.families.llama import block_step
from swarm.modeling.lora_experts import ExpertLora, adapted_expert, load_expert_loras
from swarm.modeling.lora_files import AdapterError, AdapterFiles
from swarm.modeling.lora_targets import FUSED_PROJECTIONS, PROJECTIONS, columns
from swarm.modeling.shape import ModelShape


@dataclass
class ProjectionLora:
    """The adapter on the projections that share one input, as one low-rank product: x [rows, in] ->
    (x @ a_t) @ b_t [rows, width], added to the group's whole output (q;k;v, o, gate;up or down columns)."""

    a_t: torch.Tensor  # [in, R]: the targets' A matrices, transposed and concatenated (R = sum of their ranks)
    b_t: torch.Tensor  # [R, width]: block diagonal, target i's B^T * scaling_i at its rows and columns, zeros elsewhere


@dataclass
class LayerLora:
    """An adapter's tensors for one block: group ("qkv", "o", "gate_up", "down"; DeepSeek-V3: "module.target") ->
    ProjectionLora, and its experts' stacked parameters ("gate_up_proj" / "down_proj" -> `ExpertLora`)."""

    projections: Dict[str, ProjectionLora]
    experts: Dict[str, ExpertLora] = field(default_factory=dict)

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for p in self.projections.values() for t in (p.a_t, p.b_t)) \
            + sum(lora.nbytes() for lora in self.experts.values())


@dataclass
class SpanAdapter:
    """An adapter's tensors for the blocks [start, end) of a span: `layers[i]` for block start + i (None: the
    adapter leaves that block alone)."""

    name: str
    start: int
    end: int
    layers: List[Optional[LayerLora]]

    @classmethod
    def load(cls, files: AdapterFiles, start: int, end: int, dtype: torch.dtype, device: torch.device,
             shape: ModelShape) -> "SpanAdapter":
        """Read only the tensors of blocks [start, end) (in `dtype`, on `device`) of a model of `shape`."""
        from safetensors import safe_open

        group_columns = columns(shape)
        layers: List[Optional[LayerLora]] = []
        with safe_open(str(files.weights), framework="pt") as f:
            for block in range(start, end):
                projections: Dict[str, ProjectionLora] = {}
                for spec in ([] if files.grouped else [s for (b, _), s in files.targets.items() if b == block]):
                    a, b = f.get_tensor(spec.a_key).float(), f.get_tensor(spec.b_key).float()  # [r, in], [out, r]
                    projections[f"{spec.module}.{spec.target}"] = ProjectionLora(
                        a.t().to(device, dtype).contiguous(), (b.t() * spec.scaling).to(device, dtype).contiguous())
                for group, targets in (PROJECTIONS if files.grouped else ()):
                    fused = [t for t, g in FUSED_PROJECTIONS.items() if g == group]
                    specs = [files.targets[(block, t)] for t in (*targets, *fused) if (block, t) in files.targets]
                    if not specs:
                        continue
                    a = torch.cat([f.get_tensor(s.a_key).float() for s in specs])  # [R, in]
                    b_t = torch.zeros(a.shape[0], group_columns[specs[0].target][2])  # [R, width]
                    row = 0
                    for spec in specs:
                        c0, c1, _ = group_columns[spec.target]
                        b_t[row:row + spec.rank, c0:c1] = f.get_tensor(spec.b_key).float().t() * spec.scaling
                        row += spec.rank
                    projections[group] = ProjectionLora(a.t().to(device, dtype).contiguous(), b_t.to(device, dtype))
                experts = load_expert_loras(f, [t for (b, _), t in files.experts.items() if b == block],
                                            files.model_config, dtype, device)
                layers.append(LayerLora(projections, experts) if projections or experts else None)
        return cls(files.name, start, end, layers)

    def nbytes(self) -> int:
        return sum(layer.nbytes() for layer in self.layers if layer is not None)


# one group of a step's rows: rows [r0, r1) of the flattened leading dims use `lora`
RowGroup = Tuple[int, int, LayerLora]


def _joined(gate: torch.Tensor, up: torch.Tensor) -> Optional[torch.Tensor]:
    """The [..., 2 * intermediate] tensor whose halves `gate` and `up` are (the fused gate/up output that `chunk`
    split), or None if they are not such views."""
    width = gate.shape[-1]
    if (gate.shape != up.shape or gate.stride() != up.stride() or gate.stride(-1) != 1
            or up.data_ptr() != gate.data_ptr() + width * gate.element_size()
            or any(gate.stride(d) != 2 * width * math.prod(gate.shape[d + 1:-1]) for d in range(gate.dim() - 1))):
        return None
    return gate.as_strided((*gate.shape[:-1], 2 * width), (*gate.stride()[:-1], 1))


class AdaptedLayer:
    """A block for one step whose row groups carry adapters; `block_step` reads it like the wrapped layer."""

    def step(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, attend) -> torch.Tensor:
        """The wrapped layer's block step (`llama.block_step`, or a mixture of experts' `moe_block_step`) on this
        layer's projections."""
        return getattr(type(self.base), "step", block_step)(self, x, cos, sin, attend)

    def __init__(self, base, groups: Sequence[RowGroup]):
        self.base, self.groups = base, groups
        self.heads, self.kv_heads, self.head_dim = base.heads, base.kv_heads, base.head_dim
        self.scaling, self.layer_idx = base.scaling, base.layer_idx
        for name in ("act", "input_norm", "post_norm"):  # (read every step; BLOOM's and Falcon's layers have none)
            if hasattr(base, name):
                setattr(self, name, getattr(base, name))

    def __getattr__(self, name: str):  # anything else an attention may read (e.g. a sliding window)
        return getattr(self.base, name)

    def _add(self, group: str, x: torch.Tensor, out: torch.Tensor) -> None:
        """Add each row group's delta for projection `group` on input x [..., in] into its rows of `out`
        [..., width] (the base result, in place)."""
        x2, out2 = x.reshape(-1, x.shape[-1]), out.view(-1, out.shape[-1])  # [rows, in], [rows, width]
        for r0, r1, lora in self.groups:
            projection = lora.projections.get(group)
            if projection is not None:  # rows [r0, r1) += (x @ A^T) @ B^T * scaling, for every target at once
                out2[r0:r1].addmm_(x2[r0:r1] @ projection.a_t, projection.b_t)

    def qkv(self, h: torch.Tensor) -> torch.Tensor:
        """[..., hidden] -> [..., heads + 2 * kv_heads, head_dim], with each row group's q/k/v deltas (added to
        the projections' output, before a family's q/k norms: Qwen3's `qkv_projection` and `qk_norm`)."""
        norm = getattr(self.base, "qk_norm", None)
        out = self.base.qkv(h) if norm is None else self.base.qkv_projection(h)
        flat = out.flatten(-2)  # [..., (heads + 2 * kv_heads) * head_dim]
        assert flat.data_ptr() == out.data_ptr(), "the deltas must go into the returned tensor's memory"
        self._add("qkv", h, flat)
        return out if norm is None else norm(out)

    def add_o_proj(self, x: torch.Tensor, o: torch.Tensor) -> torch.Tensor:
        out = self.base.add_o_proj(x, o)  # a new tensor: [..., hidden]
        self._add("o", o, out)
        return out

    def project(self, group: str, h: torch.Tensor) -> torch.Tensor:
        """BLOOM's and Falcon's projections (their layers' `project`), with each row group's deltas."""
        out = self.base.project(group, h)  # a new tensor [..., width]
        self._add(group, h, out)
        return out

    def gate_up(self, h: torch.Tensor):
        gate, up = self.base.gate_up(h)  # [..., intermediate] each (the halves of one output)
        joined = None if gate.requires_grad else _joined(gate, up)  # (autograd: chunk's views are not written)
        if joined is not None:
            self._add("gate_up", h, joined)
            return gate, up
        delta = torch.zeros(*gate.shape[:-1], 2 * gate.shape[-1], dtype=gate.dtype, device=gate.device)
        self._add("gate_up", h, delta)  # separate tensors: the delta on its own, then into each
        return gate + delta[..., :gate.shape[-1]], up + delta[..., gate.shape[-1]:]

    def add_down(self, x: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
        out = self.base.add_down(x, h)  # a new tensor: [..., hidden]
        self._add("down", h, out)
        return out

    def expert_rows(self, e: int, h: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        """Expert e on h [n, hidden], the tokens of rows `tokens` [n] (`mixtral.sparse_moe`), with each row
        group's deltas on the experts' stacked parameters (`lora_experts`) -> [n, hidden]."""
        groups = [(r0, r1, lora.experts) for r0, r1, lora in self.groups if lora.experts]
        return adapted_expert(self.base, groups, e, h, tokens) if groups else self.base.expert(e, h)

    def absorbed(self, group: str) -> List[Tuple[int, int, ProjectionLora]]:
        """[(r0, r1, lora)]: the row groups' deltas on projection `group` for a layer that reads its weight as a
        matrix rather than projecting through `project` (DeepSeek-V3's kv_b_proj)."""
        return [(r0, r1, lora.projections[group]) for r0, r1, lora in self.groups if group in lora.projections]


def check_layers(adapter: SpanAdapter, layers: Sequence) -> None:
    """AdapterError where a block of the span (`layers`: its fused layers, blocks start, start + 1, ...) cannot take
    the adapter's deltas: experts that are not given in parts (`lora_experts`), a layer of per-module groups
    (DeepSeek-V3's) without its `project`. (Every layer served today has them; a new family's layers might not.)"""
    for offset, (lora, layer) in enumerate(zip(adapter.layers, layers)):
        if lora is None:
            continue
        block = adapter.start + offset
        if lora.experts and not all(hasattr(part, "expert_gate_up") for part in getattr(layer, "shards", [layer])):
            raise AdapterError(f"adapter {adapter.name!r}: block {block} ({type(layer).__name__}) does not take LoRA "
                               f"deltas on its experts (they are not given in parts: expert_gate_up, expert_act, "
                               f"expert_down)")
        if any("." in group for group in lora.projections) and not hasattr(layer, "project"):
            raise AdapterError(f"adapter {adapter.name!r}: block {block} ({type(layer).__name__}) does not take LoRA "
                               f"deltas (its projections do not go through `project`)")


def adapt_layers(layers: Sequence, groups: Sequence[Tuple[int, int, Optional[SpanAdapter]]], first: int) -> list:
    """`layers` (blocks first, first + 1, ...) for one step whose rows [r0, r1) use adapter `a` (None: the base):
    each block wrapped in an `AdaptedLayer` where some group's adapter touches it, else left as it is."""
    adapted = []
    for offset, layer in enumerate(layers):
        block = first + offset
        row_groups: List[RowGroup] = []
        for r0, r1, adapter in groups:
            if adapter is not None:
                lora = adapter.layers[block - adapter.start]
                if lora is not None:
                    row_groups.append((r0, r1, lora))
        if not row_groups:
            adapted.append(layer)
        else:  # a tensor-parallel block splits the deltas like itself (`swarm.modeling.tensor_parallel`)
            adapted.append(layer.adapt(row_groups) if hasattr(layer, "adapt") else AdaptedLayer(layer, row_groups))
    return adapted
