"""An int8 span's decode step with several sessions, in this process: before and after issue 50. Prints one JSON
object.

Blocks 0:30 of the bundled model, `--quant_type int8` (LLM.int8(), threshold 6), float32, one thread. Each of 1, 8,
16 sessions has a 32-token prompt (real tokens' embeddings, prefilled alone); then decode steps of one real token
per session, timed three ways on the same inputs, the three alternating step by step (the machine is shared):
- `alone`: before issue 50, each session's step through the span in a call of its own (`BlockSpan.forward_batch`
  of one item per session, what `sessions_alone` did for every int8 span);
- `merged`: after, one batched step (`BlockSpan.forward_batch` of all items), each session's rows quantized on their
  own (`swarm.modeling.int8_rows`);
- `merged_plain`: the same batch through bitsandbytes' plain call over all rows (outlier columns of every session
  applied to all: not what any session alone computes), the cost floor of a merged step.
Reports the median step time of each (ms) and whether every merged step's outputs equal the alone steps' bit for bit.
"""
from __future__ import annotations

import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from server.compute.blocks import BlockSpan  # noqa: E402
from swarm.modeling.checkpoint import Checkpoint  # noqa: E402
from swarm.modeling.prepare import prepare_model  # noqa: E402

START, END = 0, 30
PROMPT_TOKENS = 32
STEPS = 6  # timed decode steps per mode (after one untimed)
SESSIONS = (1, 8, 16)
MODES = ("alone", "merged", "merged_plain")


def run_step(span: BlockSpan, mode: str, items: list) -> list:
    if mode == "alone":
        return [span.forward_batch([item], START, END)[0] for item in items]
    if mode == "merged":
        return span.forward_batch(items, START, END)
    span.quant_type = "none"  # (the span's steps then set no int8 row groups: each projection is one plain call)
    try:
        return span.forward_batch(items, START, END)
    finally:
        span.quant_type = "int8"


def main() -> None:
    torch.set_num_threads(1)
    checkpoint = Checkpoint(str(prepare_model()))
    embed = checkpoint.load_tensors(lambda name: name.endswith("embed_tokens.weight"), torch.float32)
    embeddings = next(iter(embed.values()))  # [vocab, hidden]
    span = BlockSpan.load(checkpoint, START, END, "float32", "cpu", "int8")
    assert not span.sessions_alone and span.kv_arena is None
    generator = torch.Generator().manual_seed(0)
    result: dict = {"span": f"{START}:{END}", "quant_type": "int8", "dtype": "float32", "threads": 1,
                    "prompt_tokens": PROMPT_TOKENS, "timed_steps": STEPS, "step_ms": {}, "merged_equals_alone": True}
    for n in SESSIONS:
        tokens = torch.randint(100, 10000, (n, PROMPT_TOKENS + STEPS + 1), generator=generator)
        kvs = {}
        for mode in MODES:  # each mode its own sessions, prefilled alone (the same inputs, the same caches)
            kvs[mode] = [span.new_session_kv(1, PROMPT_TOKENS + STEPS + 1, START, END) for _ in range(n)]
            for kv, row in zip(kvs[mode], tokens):
                span.forward(embeddings[row[:PROMPT_TOKENS]][None], 0, kv)
        times: dict = {mode: [] for mode in MODES}
        for step in range(STEPS + 1):
            position = PROMPT_TOKENS + step
            outputs = {}
            for mode in MODES:
                items = [(embeddings[row[position]][None, None], position, kv) for row, kv in zip(tokens, kvs[mode])]
                began = time.perf_counter()
                outputs[mode] = run_step(span, mode, items)
                if step:
                    times[mode].append(time.perf_counter() - began)
            same = all(torch.equal(a, b) for a, b in zip(outputs["alone"], outputs["merged"]))
            result["merged_equals_alone"] = result["merged_equals_alone"] and same
        result["step_ms"][str(n)] = {mode: round(1000 * statistics.median(times[mode]), 1) for mode in MODES}
        print(f"{n} sessions: {result['step_ms'][str(n)]}", file=sys.stderr)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
