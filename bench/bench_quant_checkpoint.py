"""Loading a block from a checkpoint published quantized (issue 49): MXFP4 (GPT-OSS's experts) and block-scaled FP8
(DeepSeek-V3) against the same weights in bfloat16 shards.

Builds, in a temporary directory, 2-block models of mid sizes the machine holds (GPT-OSS: hidden 1024, 16 experts of
1024; DeepSeek-V3: hidden 1024, MLA with q_lora 512 / kv_lora 256, 16 routed experts of 512 plus a shared one; the
second block is the expert block) and writes each twice: in bfloat16 and in the published quantized layout
(`tests.fixtures.quant_checkpoints`). Then, each in a fresh process, `BlockSpan.load` of block 1 into bfloat16 (and
float32): wall time of the load (one thread) and peak RSS above the process's RSS before loading (VmHWM: ru_maxrss
survives exec, so a child would report its parent's), and the bytes the loaded block holds. Prints one JSON object.

Usage: python bench/bench_quant_checkpoint.py [--repeats 3]
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
MODELS = {
    "gpt_oss": dict(hidden_size=1024, intermediate_size=1024, num_local_experts=16, num_experts_per_tok=4,
                    num_attention_heads=16, num_key_value_heads=4, head_dim=64, num_hidden_layers=2, vocab_size=512),
    "deepseek_v3": dict(hidden_size=1024, intermediate_size=2048, moe_intermediate_size=512, n_routed_experts=16,
                        n_group=4, topk_group=2, num_experts_per_tok=4, num_attention_heads=16,
                        num_key_value_heads=16, q_lora_rank=512, kv_lora_rank=256, qk_rope_head_dim=64,
                        qk_nope_head_dim=64, v_head_dim=64, first_k_dense_replace=1, num_hidden_layers=2,
                        vocab_size=512),
}

CHILD = r"""
import json, sys, time, torch
torch.set_num_threads(1)
from server.compute.blocks import BlockSpan
from swarm.modeling.checkpoint import Checkpoint

def status_kb(key):
    for line in open("/proc/self/status"):
        if line.startswith(key + ":"):
            return int(line.split()[1])

path, dtype = sys.argv[1], sys.argv[2]
before = status_kb("VmRSS")
assert status_kb("VmHWM") - before < 64 * 1024, "the imports peaked above the resident set: the peak would hide"
began = time.perf_counter()
span = BlockSpan.load(Checkpoint(path), 1, 2, dtype)
seconds = time.perf_counter() - began
held = sum(t.numel() * t.element_size() for t in list(span.parameters()) + list(span.buffers()))
peak = status_kb("VmHWM")
print(json.dumps({"seconds": seconds, "peak_above_start_mb": (peak - before) / 1024, "held_mb": held / 2**20}))
"""


def build(tmp: Path) -> dict:
    sys.path.insert(0, str(ROOT))
    from tests.fixtures.quant_checkpoints import _rewrite, to_fp8, to_mxfp4
    from tests.fixtures.tiny_checkpoints import save_tiny

    paths = {}
    for family, sizes in MODELS.items():
        plain, quantized = tmp / f"{family}-bf16", tmp / f"{family}-quantized"
        save_tiny(family, plain, None, max_shard_size="10GB", **sizes)
        shutil.copytree(plain, quantized)
        _rewrite(plain, lambda name, t: {name: t.to(__import__("torch").bfloat16)}, {})
        config = json.loads((plain / "config.json").read_text())
        config.pop("quantization_config")
        (plain / "config.json").write_text(json.dumps(config))
        (to_mxfp4 if family == "gpt_oss" else to_fp8)(quantized)
        paths[family] = {"bf16": plain, "mxfp4" if family == "gpt_oss" else "fp8": quantized}
    return paths


def measure(path: Path, dtype: str, repeats: int) -> dict:
    runs = []
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    for _ in range(repeats):
        out = subprocess.run([sys.executable, "-c", CHILD, str(path), dtype], capture_output=True, text=True, env=env,
                             cwd=ROOT, check=True).stdout
        runs.append(json.loads(out.strip().splitlines()[-1]))
    return {"load_s_median": round(statistics.median(r["seconds"] for r in runs), 3),
            "peak_rss_above_start_mb": round(statistics.median(r["peak_above_start_mb"] for r in runs), 1),
            "held_mb": round(runs[0]["held_mb"], 1),
            "shard_mb": round(sum(f.stat().st_size for f in path.glob("*.safetensors")) / 2**20, 1)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="bench-quant-ckpt-"))
    try:
        paths = build(tmp)
        results = {family: {fmt: {dtype: measure(path, dtype, args.repeats) for dtype in ("bfloat16", "float32")}
                            for fmt, path in formats.items()} for family, formats in paths.items()}
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    print(json.dumps({"benchmark": "quant_checkpoint_load", "block": 1, "threads": 1, "repeats": args.repeats,
                      "sizes": MODELS, "results": results}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
