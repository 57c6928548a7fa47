"""Tensor parallelism (`--tensor_parallel_devices`, `swarm.modeling.tensor_parallel`): one block unsplit against
the same block split into shards, through the server's own steps (`server.compute.decode.prefill_step` / `decode_step`
with a `SessionKV`, as `BlockSpan` runs them); random weights, no checkpoint.

Measured per block and printed as one JSON object: a prefill of `--prompt` tokens, a single-token decode step of
one session and a batched decode step of 8 sessions (each at `--prompt` tokens of context), in ms (median of
`--steps`, the unsplit and the split block's steps alternating); weight and KV-cache bytes per shard (a session of
`--prompt` + 8 tokens), and on CUDA the weights' memory allocated per GPU and the peak of the whole run (both
blocks and 2 x 9 sessions' caches).
Default: `--devices cpu cpu` with a small block in float32 (hidden 1024); on CUDA `--devices cuda:0 cuda:1` (or
`cuda:0 cuda:0`: two shards on one GPU, which shows the split path's cost on the GPU, not a speed-up: both shards
share one GPU's compute and bandwidth) with `--shape 8b` (hidden 4096, 32 heads, 8 key/value heads, intermediate
14336) in bfloat16.

On the CPU (or with every shard on one GPU) the shards run one after another on the same compute: the split
block can only be slower (the overhead of more, smaller kernels and the sums), never faster. A speed-up needs
shards on different GPUs, whose kernels run at the same time.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
from torch import nn  # noqa: E402

from server.compute.cache import SessionKV  # noqa: E402
from server.compute.decode import decode_step, prefill_step  # noqa: E402
from swarm.modeling.families.llama import FusedLayer  # noqa: E402
from swarm.modeling.shape import ModelShape  # noqa: E402
from swarm.modeling.tensor_parallel import cache_layout, parse_devices, split_layer  # noqa: E402

SHAPES = {"small": dict(hidden_size=1024, num_heads=16, num_kv_heads=8, head_dim=64, intermediate_size=2816),
          "8b": dict(hidden_size=4096, num_heads=32, num_kv_heads=8, head_dim=128, intermediate_size=14336)}
SESSIONS = 8  # the batched decode step's sessions


def random_block(shape: ModelShape, dtype: torch.dtype, device: torch.device) -> FusedLayer:
    """A Llama block's fused weights, random (std 0.02), on `device`."""
    hidden, dim, inter = shape.hidden_size, shape.head_dim, shape.intermediate_size
    g = torch.Generator(device=device).manual_seed(0)

    def w(*size: int) -> torch.Tensor:
        return (torch.randn(*size, generator=g, device=device, dtype=torch.float32) * 0.02).to(dtype)

    return FusedLayer(
        input_norm_weight=torch.ones(hidden, dtype=dtype, device=device),
        post_norm_weight=torch.ones(hidden, dtype=dtype, device=device), eps=1e-5,
        qkv_weight=w((shape.num_heads + 2 * shape.num_kv_heads) * dim, hidden), qkv_bias=None,
        o_weight_t=w(hidden, shape.num_heads * dim).t(), o_bias=None,
        gate_up_weight=w(2 * inter, hidden), gate_up_bias=None,
        down_weight_t=w(hidden, inter).t(), down_bias=None, act=nn.SiLU(),
        heads=shape.num_heads, kv_heads=shape.num_kv_heads, head_dim=dim, scaling=shape.scaling, layer_idx=0)


def new_kv(layer, devices, shape: ModelShape, batch: int, length: int, dtype: torch.dtype) -> SessionKV:
    """A session of `batch` rows' cache for one block, as `BlockSpan.new_session_kv` makes it (split by key/value
    heads when the block is split)."""
    if len(devices) == 1:
        return SessionKV(1, batch, shape.num_kv_heads, shape.head_dim, length, dtype, devices[0])
    layer_devices, windows = cache_layout(devices, [None])
    return SessionKV(len(windows), batch, shape.num_kv_heads // len(devices), shape.head_dim, length, dtype,
                     devices[0], windows=windows, devices=layer_devices)


def tensor_bytes(tensors) -> dict:
    per: dict = {}
    for t in tensors:
        if t is not None:
            per[str(t.device)] = per.get(str(t.device), 0) + t.numel() * t.element_size()
    return per


def layer_bytes(layer) -> dict:
    """Weight bytes per device (a split layer's shards, whose devices may repeat: listed per shard)."""
    shards = getattr(layer, "shards", [layer])
    out = []
    for shard in shards:
        out.append(sum(tensor_bytes([shard.input_norm_weight, shard.post_norm_weight, shard.qkv_weight,
                                     shard.o_weight_t, shard.gate_up_weight, shard.down_weight_t]).values()))
    return {"weight_bytes_per_shard": out}


def sync(devices) -> None:
    for d in {d for d in devices if d.type == "cuda"}:
        torch.cuda.synchronize(d)


def timed_pair(fns, devices, steps: int) -> list:
    """Median ms of each of `fns` (the unsplit and the split block's step), run alternately so that a busy machine's
    load drifts over both alike."""
    for fn in fns:  # warm-up
        for _ in range(2):
            fn()
    sync(devices)
    times: list = [[] for _ in fns]
    for _ in range(steps):
        for fn, out in zip(fns, times):
            start = time.perf_counter()
            fn()
            sync(devices)
            out.append(time.perf_counter() - start)
    return [round(statistics.median(t) * 1000, 3) for t in times]


class Steps:
    """One layer's steps through the server's paths: a prefill, a decode step of 1 and of `SESSIONS` sessions."""

    def __init__(self, layer, devices, shape: ModelShape, dtype: torch.dtype, prompt: int, length: int):
        self.layer, self.devices, self.prompt = layer, devices, prompt
        device, hidden = devices[0], shape.hidden_size
        self.x = torch.randn(1, prompt, hidden, device=device, dtype=dtype)
        self.cos = torch.ones(1, prompt, shape.head_dim, device=device, dtype=dtype)  # rotary angles 0: what they
        self.sin = torch.zeros(1, prompt, shape.head_dim, device=device, dtype=dtype)  # are does not change the cost
        self.kv = new_kv(layer, devices, shape, 1, length, dtype)
        self.sessions = [new_kv(layer, devices, shape, 1, length, dtype) for _ in range(SESSIONS)]
        for kv in self.sessions:  # each session holds `prompt` positions
            self._prefill(kv)
        self.rows = torch.randn(SESSIONS, hidden, device=device, dtype=dtype)

    def _prefill(self, kv: SessionKV) -> None:
        kv.begin_step(0)
        prefill_step([self.layer], self.x, self.cos, self.sin, kv, None)
        kv.end_step(self.prompt)

    def prefill(self) -> None:
        self._prefill(self.kv)

    def decode(self, count: int):
        sessions = self.sessions[:count]
        cos, sin = self.cos[0, :1].expand(count, -1), self.sin[0, :1].expand(count, -1)

        def step() -> None:
            for kv in sessions:
                kv.begin_step(self.prompt)
            decode_step([self.layer], self.rows[:count], cos, sin, [(1, kv) for kv in sessions])
            for kv in sessions:
                kv.end_step(1)
        return step

    def sizes(self) -> dict:
        shards = len(self.kv.keys)  # one cache layer per shard (`cache_layout`, one block)
        return {**layer_bytes(self.layer), "cache_bytes_per_shard": [
            sum(tensor_bytes([self.kv.keys[i], self.kv.values[i]]).values()) for i in range(shards)]}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--devices", nargs="+", default=None, help="the split's devices (default: cpu cpu)")
    parser.add_argument("--shape", choices=sorted(SHAPES), default=None, help="default: 8b on CUDA, small on cpu")
    parser.add_argument("--dtype", default=None, help="default: bfloat16 on CUDA, float32 on cpu")
    parser.add_argument("--prompt", type=int, default=None, help="prefill tokens (default 512 on CUDA, 128 on cpu)")
    parser.add_argument("--steps", type=int, default=None, help="timed repetitions of each step, alternating the "
                                                                 "unsplit and the split block (20 on CUDA, 7 on cpu)")
    args = parser.parse_args()
    devices = parse_devices(args.devices or ["cpu", "cpu"], allow_repeat=True)
    cuda = devices[0].type == "cuda"
    shape = ModelShape(**SHAPES[args.shape or ("8b" if cuda else "small")], num_layers=1, rms_norm_eps=1e-5,
                       hidden_act="silu", rope_type="default", dtype=None)
    dtype = getattr(torch, args.dtype or ("bfloat16" if cuda else "float32"))
    prompt = args.prompt or (512 if cuda else 128)
    steps = args.steps or (20 if cuda else 7)
    gpus = sorted({d for d in devices if d.type == "cuda"}, key=str)
    began = time.perf_counter()
    names = ("1_device", f"{len(devices)}_devices")
    with torch.inference_mode():
        runs, memory = [], {}
        for name, devs in zip(names, (devices[:1], devices)):
            before = {str(d): torch.cuda.memory_allocated(d) for d in gpus}
            block = random_block(shape, dtype, devs[0])
            layer = block if len(devs) == 1 else split_layer(block, devs, shape)
            del block
            if gpus:
                torch.cuda.empty_cache()
                memory[name] = {str(d): torch.cuda.memory_allocated(d) - before[str(d)] for d in gpus}
            runs.append(Steps(layer, devs, shape, dtype, prompt, prompt + 8))
        results: dict = {name: run.sizes() for name, run in zip(names, runs)}
        if gpus:
            for name in names:
                results[name]["weights_allocated_bytes_by_gpu"] = memory[name]
        for key, fns in (("prefill_ms", [r.prefill for r in runs]),
                         ("decode_1_session_ms", [r.decode(1) for r in runs]),
                         (f"decode_{SESSIONS}_sessions_ms", [r.decode(SESSIONS) for r in runs])):
            for name, ms in zip(names, timed_pair(fns, devices, steps)):
                results[name][key] = ms
        if gpus:
            results["peak_allocated_bytes_by_gpu"] = {str(d): torch.cuda.max_memory_allocated(d) for d in gpus}
    one, split = results[names[0]], results[names[1]]
    ratio = {k: round(split[k] / one[k], 3) for k in one if k.endswith("_ms")}
    same = len({str(d) for d in devices}) == 1
    print(json.dumps({
        "devices": [str(d) for d in devices], "dtype": str(dtype).replace("torch.", ""),
        "shape": {k: v for k, v in shape.__dict__.items() if k in SHAPES["8b"]}, "prompt_tokens": prompt,
        "steps": steps, "gpu": torch.cuda.get_device_name(devices[0]) if cuda else None, **results,
        "split_over_unsplit": ratio,
        "note": ("every shard on one device: shows the split path's overhead only, not a speed-up" if same or not cuda
                 else "shards on different GPUs run concurrently"),
        "wall_s": round(time.perf_counter() - began, 1)}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
