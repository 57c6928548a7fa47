"""Tensor parallelism: each block of a span split across several devices (`swarmgate server
--tensor_parallel_devices`).

A Llama-family block (`swarm.modeling.families.llama`: llama, mistral, qwen2) or a Mixtral block
(`swarm.modeling.families.mixtral`) is cut into one shard per device, each an ordinary fused (or int8 / nf4 quantized)
layer over its part of the weights:
- attention by heads: shard i holds query heads [i * H/n, (i+1) * H/n) and the key/value heads they read,
  [i * K/n, (i+1) * K/n) (a query head h reads kv head h // (H/K), so each group stays whole), its rows of the
  fused q/k/v weight (and bias) column-split; the output projection row-split (its input columns of those heads);
- the MLP by intermediate columns: gate/up column-split, down row-split (Mixtral: every expert's, the router
  replicated, so each shard routes each token alike and adds its part of the chosen experts' outputs);
- the norms (and the span's rotary tables) replicated; the output and down biases on shard 0 only.

`SplitLayer.step` is the block: each shard's attention on its heads (its keys/values in its own part of the
session's cache), each shard's output projection of its heads' output, summed on the first device with the
residual; then each shard's MLP columns, summed again. Every server path that steps a `BlockLayer` (prefill,
chunked and batched prefill, batched decode, passes without a cache, training's autograd) runs it unchanged: the
shards are `BlockLayer`s with `layer_idx` n * block + i, so a session's `SessionKV` holds n "layers" per block,
each [batch, K/n, length, head_dim] on its shard's device (`cache_layout`). A LoRA adapter's delta is split like
its base projection (`split_lora`): B's columns for q/k/v and gate/up, A's rows for o and down (each shard's
delta of its input part; the sum is the whole delta).

The sum order differs from the unsplit block's, so float results agree to rounding (within 1e-5 in float32).
int8 shards quantize each shard's weight rows (and activations) on their own: a row-split projection's scales are
per shard, so int8 results differ from the unsplit int8 block's within int8's error. nf4 blocks of 64 values stay
the same blocks when every shard's widths are multiples of 64 (`check_splittable` asks so).

CPU devices may repeat (`cpu cpu`: the same code path on one device, for tests); a CUDA device may not.
"""
from __future__ import annotations

from dataclasses import replace
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import torch
from torch import nn

from swarm.modeling.families import FAMILIES, FamilySpec, Quantization
from swarm.modeling.families.llama import attention_output
from swarm.modeling.families.mixtral import FusedMoeLayer, sparse_moe
from swarm.modeling.layers import step_forward
from swarm.modeling.lora import AdaptedLayer, LayerLora, ProjectionLora
from swarm.modeling.lora_experts import ExpertLora
from swarm.modeling.shape import ModelShape

NF4_BLOCK = 64  # bitsandbytes' nf4 block size (`swarm.modeling.quantize.NF4_BLOCKSIZE`)


class TensorParallelError(ValueError):
    """A model or device list that cannot be split: one line naming the reason."""


def supported_families() -> List[str]:
    return sorted(name for name, spec in FAMILIES.items() if spec.tensor_parallel)


def parse_devices(names: Sequence[str], allow_repeat: bool = False) -> List[torch.device]:
    """The devices of `--tensor_parallel_devices`: at least 2; cpu may repeat, a CUDA device may not (unless
    `allow_repeat`: the benchmark's two shards on one GPU); CUDA devices must exist. Raises TensorParallelError."""
    if len(names) < 2:
        raise TensorParallelError(f"needs at least 2 devices, got {list(names)}")
    devices = []
    for name in names:
        try:
            device = torch.device(name)
        except (RuntimeError, ValueError):
            raise TensorParallelError(f"unknown device {name!r} (use cpu, cuda or cuda:N)") from None
        if device.type == "cuda":
            device = torch.device("cuda", 0 if device.index is None else device.index)
        elif device.type != "cpu":
            raise TensorParallelError(f"device {name!r}: only cpu and cuda devices are supported")
        devices.append(device)
    seen = set()
    for device in devices:
        if device.type != "cpu" and device in seen and not allow_repeat:
            raise TensorParallelError(f"{device} is named twice: each shard needs its own GPU (only cpu may repeat, "
                                      f"for testing)")
        seen.add(device)
    cuda = [d for d in devices if d.type == "cuda"]
    if cuda:
        available = torch.cuda.device_count() if torch.cuda.is_available() else 0
        missing = [str(d) for d in cuda if d.index is not None and d.index >= available]
        if missing:
            raise TensorParallelError(f"no such CUDA device: {', '.join(missing)} ({available} available)")
    if len({d.type for d in devices}) > 1:
        raise TensorParallelError(f"mixes cpu and cuda devices ({', '.join(map(str, devices))}); use one kind")
    return devices


def distinct_devices(names: Sequence[str]) -> List[str]:
    """The different devices among `names` (`cuda` is `cuda:0`), in order: whose free memory a split span uses."""
    normal = []
    for name in names:
        device = torch.device(name)
        if device.type == "cuda" and device.index is None:
            device = torch.device("cuda", 0)
        normal.append(str(device))
    return list(dict.fromkeys(normal))


def check_splittable(family: FamilySpec, shape: ModelShape, n: int, quant_type: str = "none") -> None:
    """Raise TensorParallelError (one line, the reason) unless a block of this model splits into n shards."""
    if not family.tensor_parallel:
        raise TensorParallelError(f"family {family.model_type} cannot be split across devices; tensor parallelism "
                                  f"supports {', '.join(supported_families())}")
    if shape.num_kv_heads % n:
        raise TensorParallelError(f"{n} devices do not divide the model's {shape.num_kv_heads} key/value heads "
                                  f"({shape.num_heads} query heads): each device holds whole head groups")
    if shape.intermediate_size % n:
        raise TensorParallelError(f"{n} devices do not divide the MLP's intermediate size {shape.intermediate_size}")
    if quant_type == "nf4":
        width = shape.num_heads // n * shape.head_dim
        inter = shape.intermediate_size // n
        if width % NF4_BLOCK or inter % NF4_BLOCK:
            raise TensorParallelError(f"nf4 shards need per-device widths divisible by {NF4_BLOCK}: attention "
                                      f"{width}, MLP {inter} with {n} devices")


def _head_rows(heads: int, kv_heads: int, head_dim: int, n: int, i: int) -> torch.Tensor:
    """Shard i's rows of the fused q/k/v output [(heads + 2 * kv_heads) * head_dim]."""
    hs, ks = heads // n * head_dim, kv_heads // n * head_dim
    q, kv = heads * head_dim, kv_heads * head_dim
    return torch.cat([torch.arange(i * hs, (i + 1) * hs), q + torch.arange(i * ks, (i + 1) * ks),
                      q + kv + torch.arange(i * ks, (i + 1) * ks)])


def _mlp_rows(intermediate: int, n: int, i: int) -> torch.Tensor:
    """Shard i's rows of the fused gate/up output [2 * intermediate]."""
    part = intermediate // n
    own = torch.arange(i * part, (i + 1) * part)
    return torch.cat([own, intermediate + own])


def _to(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    return t.detach().to(device).contiguous()


def _maybe(t: Optional[torch.Tensor], device: torch.device) -> Optional[torch.Tensor]:
    return None if t is None else _to(t, device)


def split_fused(fused, devices: Sequence[torch.device]) -> list:
    """One float block's shards (a llama `FusedLayer` or a Mixtral `FusedMoeLayer`), shard i on devices[i] with
    `layer_idx` n * fused.layer_idx + i."""
    n = len(devices)
    heads, kv_heads, dim = fused.heads, fused.kv_heads, fused.head_dim
    moe = isinstance(fused, FusedMoeLayer)
    # [hidden, intermediate] (llama) or [experts, hidden, intermediate] (Mixtral's experts)
    down = fused.down_weight if moe else fused.down_weight_t.t()
    intermediate, inter = down.shape[-1], down.shape[-1] // n
    o_weight = fused.o_weight_t.t()  # [hidden, heads * head_dim]
    shards = []
    for i, device in enumerate(devices):
        rows, mlp = _head_rows(heads, kv_heads, dim, n, i), _mlp_rows(intermediate, n, i)
        o_cols = slice(i * heads // n * dim, (i + 1) * heads // n * dim)
        own = down[..., i * inter:(i + 1) * inter]
        if moe:  # each expert split by its intermediate columns; the router replicated
            mlp_part: dict = dict(router_weight=_to(fused.router_weight, device), down_weight=_to(own, device),
                                  gate_up_weight=_to(fused.gate_up_weight[:, mlp], device))
        else:
            mlp_part = dict(gate_up_weight=_to(fused.gate_up_weight[mlp], device),
                            gate_up_bias=None if fused.gate_up_bias is None else _to(fused.gate_up_bias[mlp], device),
                            down_weight_t=_to(own, device).t(),
                            down_bias=_maybe(fused.down_bias, device) if i == 0 else None)  # added once, by shard 0
        shards.append(replace(
            fused, **mlp_part,
            input_norm_weight=_to(fused.input_norm_weight, device),
            post_norm_weight=_to(fused.post_norm_weight, device),
            qkv_weight=_to(fused.qkv_weight[rows], device),
            qkv_bias=None if fused.qkv_bias is None else _to(fused.qkv_bias[rows], device),
            o_weight_t=_to(o_weight[:, o_cols], device).t(),
            o_bias=_maybe(fused.o_bias, device) if i == 0 else None,
            heads=heads // n, kv_heads=kv_heads // n, layer_idx=n * fused.layer_idx + i, gemms=None,
        ))
    return shards


def _split_projection(p: ProjectionLora, a_rows: Optional[torch.Tensor], b_cols: Optional[torch.Tensor],
                      device: torch.device) -> ProjectionLora:
    a_t = p.a_t if a_rows is None else p.a_t[a_rows.to(p.a_t.device)]
    b_t = p.b_t if b_cols is None else p.b_t[:, b_cols.to(p.b_t.device)]
    return ProjectionLora(a_t.to(device).contiguous(), b_t.to(device).contiguous())


def split_lora(lora: LayerLora, shape: ModelShape, devices: Sequence[torch.device]) -> List[LayerLora]:
    """An adapter's block split like the block: q/k/v and gate/up deltas by the shard's output columns (B's
    columns), o and down deltas by the shard's input columns (A's rows), each on its shard's device."""
    n = len(devices)
    heads, kv_heads, dim, inter = shape.num_heads, shape.num_kv_heads, shape.head_dim, shape.intermediate_size
    shards = []
    for i, device in enumerate(devices):
        columns: Dict[str, Tuple[Optional[torch.Tensor], Optional[torch.Tensor]]] = {
            "qkv": (None, _head_rows(heads, kv_heads, dim, n, i)),
            "o": (torch.arange(i * heads // n * dim, (i + 1) * heads // n * dim), None),
            "gate_up": (None, _mlp_rows(inter, n, i)),
            "down": (torch.arange(i * inter // n, (i + 1) * inter // n), None)}
        experts = {}  # Mixtral's experts, split like their weights: gate/up by B's columns, down by A's rows
        if "gate_up_proj" in lora.experts:
            p = lora.experts["gate_up_proj"]  # a_t [experts, hidden, r], b_t [experts, r, 2 * intermediate]
            cols = _mlp_rows(p.b_t.shape[2] // 2, n, i).to(p.b_t.device)
            experts["gate_up_proj"] = ExpertLora(p.a_t.to(device), p.b_t[:, :, cols].to(device).contiguous())
        if "down_proj" in lora.experts:
            p = lora.experts["down_proj"]  # a_t [experts, intermediate, r], b_t [experts, r, hidden]
            part = p.a_t.shape[1] // n
            experts["down_proj"] = ExpertLora(p.a_t[:, i * part:(i + 1) * part].to(device).contiguous(),
                                              p.b_t.to(device))
        shards.append(LayerLora({group: _split_projection(p, *columns[group], device)
                                 for group, p in lora.projections.items()}, experts))
    return shards


class SplitLayer(nn.Module):
    """One block as n shards on n devices; a `BlockLayer` (and a layer module: `forward` takes transformers' call,
    for passes without a cache and training). Its input and output live on devices[0]."""

    def __init__(self, shards: Sequence, devices: Sequence[torch.device], shape: ModelShape, layer_idx: int,
                 sliding_window: Optional[int]):
        super().__init__()
        self.shards, self.devices, self.shape = list(shards), list(devices), shape
        self.quantized = nn.ModuleList([s for s in self.shards if isinstance(s, nn.Module)])  # (for .modules())
        self.heads, self.kv_heads, self.head_dim = shape.num_heads, shape.num_kv_heads, shape.head_dim
        self.scaling, self.layer_idx, self.sliding_window = shape.scaling, layer_idx, sliding_window
        self._loras: Dict[int, Tuple[LayerLora, List[LayerLora]]] = {}  # id(block's lora) -> it and its shards

    forward = step_forward  # transformers' layer call, through `step` (`layers.step_forward`)

    def step(self, x: torch.Tensor, cos: Optional[torch.Tensor], sin: Optional[torch.Tensor],
             attend: Callable) -> torch.Tensor:
        """x: [..., hidden] on devices[0]; cos, sin: [..., head_dim]. Returns [..., hidden] on devices[0]."""
        return run_shards(self.shards, self.devices, x, cos, sin, attend)

    def adapt(self, row_groups: Sequence[Tuple[int, int, LayerLora]]) -> "AdaptedSplit":
        """This block for one step whose row groups [r0, r1) add an adapter's deltas (`lora.adapt_layers`)."""
        per_shard: List[List[Tuple[int, int, LayerLora]]] = [[] for _ in self.shards]
        for r0, r1, lora in row_groups:
            if id(lora) not in self._loras:
                self._loras[id(lora)] = (lora, split_lora(lora, self.shape, self.devices))
            for i, part in enumerate(self._loras[id(lora)][1]):
                per_shard[i].append((r0, r1, part))
        return AdaptedSplit(self, [AdaptedLayer(s, g) for s, g in zip(self.shards, per_shard)])


class AdaptedSplit:
    """A `SplitLayer` for one step, its shards wrapped in `AdaptedLayer`s (the attention reads the block's sizes)."""

    def __init__(self, base: SplitLayer, shards: List[AdaptedLayer]):
        self.base, self.shards = base, shards
        self.heads, self.kv_heads, self.head_dim = base.heads, base.kv_heads, base.head_dim
        self.scaling, self.layer_idx, self.sliding_window = base.scaling, base.layer_idx, base.sliding_window

    def step(self, x: torch.Tensor, cos: Optional[torch.Tensor], sin: Optional[torch.Tensor],
             attend: Callable) -> torch.Tensor:
        return run_shards(self.shards, self.base.devices, x, cos, sin, attend)


def _reduce(parts: List[torch.Tensor]) -> torch.Tensor:
    """The sum of the shards' partial outputs, on the first one's device (parts[0] is a fresh tensor)."""
    out = parts[0]
    for part in parts[1:]:
        out = out.add_(part.to(out.device)) if not out.requires_grad else out + part.to(out.device)
    return out


def run_shards(shards: Sequence, devices: Sequence[torch.device], x: torch.Tensor, cos: Optional[torch.Tensor],
               sin: Optional[torch.Tensor], attend: Callable) -> torch.Tensor:
    """One block through its shards: x [..., hidden] -> x + sum_i o_i(attention_i) -> h + sum_i down_i(mlp_i).
    Shard 0 adds the residual (and the row-split projections' biases); the others add their part to zeros."""
    parts = []
    for i, (shard, device) in enumerate(zip(shards, devices)):
        xi = x.to(device)
        ci = None if cos is None else cos.to(device)
        si = None if sin is None else sin.to(device)
        o = attention_output(shard, xi, ci, si, attend)  # type: ignore[arg-type]  # [..., heads / n * head_dim]
        parts.append(shard.add_o_proj(xi if i == 0 else torch.zeros_like(xi), o))  # [..., hidden]
    h = _reduce(parts)
    parts = []
    for i, (shard, device) in enumerate(zip(shards, devices)):
        hi = h.to(device)
        if hasattr(shard, "router"):  # Mixtral: every shard routes alike, each expert's part of its columns
            moe = sparse_moe(shard, shard.post_norm(hi))  # [..., hidden]
            parts.append(hi + moe if i == 0 else moe)
            continue
        gate, up = shard.gate_up(shard.post_norm(hi))  # [..., intermediate / n] each
        parts.append(shard.add_down(hi if i == 0 else torch.zeros_like(hi), shard.act(gate).mul_(up)))
    return _reduce(parts)


def cache_layout(devices: Sequence[torch.device], windows: Sequence[Optional[int]]
                 ) -> Tuple[List[torch.device], List[Optional[int]]]:
    """A session's cache "layers" for blocks with `windows`: n per block (block j's shard i at n * j + i), each on
    its shard's device with the block's window."""
    n = len(devices)
    return [devices[i] for _ in windows for i in range(n)], [w for w in windows for _ in range(n)]


def split_layer(fused, devices: Sequence[torch.device], shape: ModelShape, quant_type: str = "none",
                dtype: Optional[torch.dtype] = None, quant: Optional[Quantization] = None) -> SplitLayer:
    """A loaded block's fused float layer (`llama.fuse_layer` or `mixtral.fuse_layer`, on the CPU) as a
    `SplitLayer` over `devices`, each shard quantized to `quant_type` on its device by its family's `quant` unless
    "none"."""
    shards = split_fused(fused, devices if quant_type == "none" else [torch.device("cpu")] * len(devices))
    if quant_type != "none":
        assert dtype is not None and quant is not None
        shards = [quant.quantize(shard, quant_type, dtype, device) for shard, device in zip(shards, devices)]
    return SplitLayer(shards, devices, shape, fused.layer_idx, fused.sliding_window)
