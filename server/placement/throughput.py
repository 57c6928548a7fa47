"""A server's throughput: measured once on one block, cached on disk, announced in the DHT.

The announced number (`ServerInfo.throughput`) is decode steps per second for one block: routing charges
1/throughput per block and placement sums it per block. It is measured by running the real serving code
(`BlockSpan.forward` with a session KV cache) on block 0 for a few decode steps, plus a few forward passes of
a longer sequence (logged and cached, for information). Results are cached in
`<swarmgate cache>/throughput.json`, keyed by model, device, dtype, quantization and CPU thread count, under a
file lock, so that several servers starting on one machine measure once and do not disturb each other.

`--throughput auto` uses the cache or measures; `eval` measures again (and updates the cache); a number is
announced as given.
"""
from __future__ import annotations

import logging
import platform
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Dict, Iterator, Optional, Sequence, Union

import torch
from filelock import FileLock

from swarm.runtime.paths import cache_root, read_json, write_json

logger = logging.getLogger(__name__)

CACHE_FILE = "throughput.json"
DECODE_STEPS, DECODE_WARMUP, PREFIX_TOKENS = 16, 3, 32
FORWARD_TOKENS, FORWARD_PASSES = 128, 3


def parse_throughput_mode(value: Union[str, float]) -> Union[str, float]:
    """'auto', 'eval' or a positive number; ValueError otherwise."""
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        number = float(value)
    else:
        text = str(value).strip().lower()
        if text in ("auto", "eval"):
            return text
        try:
            number = float(text)
        except ValueError:
            raise ValueError(f"throughput must be auto, eval or a positive number, got {value!r}") from None
    if not number > 0 or number != number or number == float("inf"):
        raise ValueError(f"throughput must be a positive finite number, got {value!r}")
    return number


def cache_path(root: Optional[Path] = None) -> Path:
    return (root or cache_root()) / CACHE_FILE


def device_key(device: str) -> str:
    dev = torch.device(device)
    if dev.type == "cuda":
        return f"cuda:{torch.cuda.get_device_name(dev)}"
    return f"{dev.type}:{platform.machine()}:{torch.get_num_threads()}threads"


def model_key(model: str) -> str:
    path = Path(model)
    return str(path.resolve()) if path.is_dir() else model


def cache_key(model: str, device: str, dtype: torch.dtype, quant_type: str = "none") -> str:
    """The cache entry's key: a quantized block (`--quant_type`) runs at its own speed."""
    return "|".join([model_key(model), device_key(device), str(dtype).replace("torch.", ""), quant_type or "none"])


@contextmanager
def _locked(path: Path) -> Iterator[None]:
    path.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(str(path.with_name(path.name + ".lock"))):
        yield


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def measure(checkpoint, device: str = "cpu", dtype_name: str = "auto", *, decode_steps: int = DECODE_STEPS,
            forward_passes: int = FORWARD_PASSES, quant_type: str = "none",
            tensor_parallel: Sequence[str] = ()) -> Dict[str, float]:
    """Run block 0 of `checkpoint` and time it: {'decode_rps': steps/s, 'forward_tps': tokens/s} for one block
    (split across the `tensor_parallel` devices, as the server runs it, when given)."""
    from server.compute.blocks import BlockSpan

    span = BlockSpan.load(checkpoint, 0, 1, dtype_name, device, quant_type, tensor_parallel=tensor_parallel)
    dev = span.device
    generator = torch.Generator().manual_seed(0)
    hidden_size, dtype = span.hidden_size, span.dtype

    def hidden(seq: int) -> torch.Tensor:  # [1, seq, hidden]
        return torch.randn(1, seq, hidden_size, generator=generator).to(dev, dtype)

    kv = span.new_session_kv(1, PREFIX_TOKENS + DECODE_WARMUP + decode_steps, 0, 1)
    span.forward(hidden(PREFIX_TOKENS), 0, kv)
    position = PREFIX_TOKENS
    steps = [hidden(1) for _ in range(DECODE_WARMUP + decode_steps)]
    for x in steps[:DECODE_WARMUP]:
        span.forward(x, position, kv)
        position += 1
    _sync(dev)
    began = time.perf_counter()
    for x in steps[DECODE_WARMUP:]:
        span.forward(x, position, kv)
        position += 1
    _sync(dev)
    decode_time = time.perf_counter() - began

    long_input = hidden(FORWARD_TOKENS)
    span.forward(long_input)  # warm-up
    _sync(dev)
    began = time.perf_counter()
    for _ in range(forward_passes):
        span.forward(long_input)
    _sync(dev)
    forward_time = time.perf_counter() - began
    result = {"decode_rps": decode_steps / max(decode_time, 1e-9),
              "forward_tps": forward_passes * FORWARD_TOKENS / max(forward_time, 1e-9)}
    del span, kv
    return result


def get_throughput(mode: Union[str, float], checkpoint, device: str, dtype: torch.dtype, dtype_name: str = "auto",
                   cache_root: Optional[Path] = None, quant_type: str = "none",
                   tensor_parallel: Sequence[str] = ()) -> tuple[float, str]:
    """(decode steps/s per block to announce, where it came from: 'given', 'cache' or 'measured'); a split server
    (`tensor_parallel` devices) measures and caches its split block."""
    mode = parse_throughput_mode(mode)
    if isinstance(mode, float):
        return mode, "given"
    path = cache_path(cache_root)
    key = cache_key(checkpoint.name, device, dtype, quant_type)
    if tensor_parallel:
        key += "|tp=" + ",".join(device_key(d) for d in tensor_parallel)
    with _locked(path):  # one server of a machine measures at a time; the others then read its result
        if mode == "auto":
            entry = read_json(path).get(key)
            rate = entry.get("decode_rps") if isinstance(entry, dict) else None
            if isinstance(rate, (int, float)) and rate > 0:
                return float(rate), "cache"
        began = time.perf_counter()
        result = measure(checkpoint, device, dtype_name, quant_type=quant_type, tensor_parallel=tensor_parallel)
        logger.info(f"measured throughput in {time.perf_counter() - began:.2f}s: {result['decode_rps']:.1f} decode "
                    f"steps/s and {result['forward_tps']:.0f} forward tokens/s per block ({key})")
        data = read_json(path)
        data[key] = {**result, "measured_at": time.time()}
        write_json(path, data)
        return result["decode_rps"], "measured"
