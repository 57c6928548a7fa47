"""Wire benchmark: bytes of hidden states per decode step and per prefill token, by dtype and compression, and
the error compression adds (`swarm.wire.compression`).

For a hidden size (576: SmolLM2-135M, the bundled model; 4096: a 7B Llama) it serializes a decode step
[1, 1, hidden] and a 1,000-token prefill [1, 1000, hidden] of normal activations (what `swarm.wire.protocol`
sends) in float32, bfloat16 and float16, each with compression none / float16 / blockwise8, and reports the bytes,
the relative L2 error after decoding, and the wire time of the 1,000-token prefill at a 50 Mbit/s link
(computed from the bytes: 8 x bytes / 50e6 s, one direction, one hop; not measured). The logits error that
compression adds through a real swarm is measured by tests/swarm/wire/test_compression.py.

Usage (from the repository root): .venv/bin/python bench/bench_wire.py
"""
from __future__ import annotations

import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from swarm.wire import protocol as P  # noqa: E402
from swarm.wire.compression import COMPRESSIONS  # noqa: E402

LINK_BITS_PER_S = 50e6
PREFILL = 1000


def main() -> int:
    torch.manual_seed(0)
    rows, lines = [], ["| hidden | dtype | compression | B / decode step | B / prefill token | rel. L2 error | "
                       "1,000-token prefill at 50 Mbit/s (s) |", "|---|---|---|---|---|---|---|"]
    for hidden in (576, 4096):
        step32, prefill32 = torch.randn(1, 1, hidden), torch.randn(1, PREFILL, hidden)
        for dtype in (torch.float32, torch.bfloat16, torch.float16):
            step, prefill = step32.to(dtype), prefill32.to(dtype)
            for kind in COMPRESSIONS:
                step_bytes = len(P.serialize_tensor(step, kind).buffer)
                sent = P.serialize_tensor(prefill, kind)
                back = P.deserialize_tensor(sent).float()
                error = ((back - prefill.float()).norm() / prefill.float().norm()).item()
                name = str(dtype).replace("torch.", "")
                row = {"hidden": hidden, "dtype": name, "compression": kind, "decode_step_bytes": step_bytes,
                       "prefill_token_bytes": round(len(sent.buffer) / PREFILL, 1), "relative_error": error,
                       "prefill_1000_at_50mbit_s": round(8 * len(sent.buffer) / LINK_BITS_PER_S, 3)}
                rows.append(row)
                lines.append(f"| {hidden} | {name} | {kind} | {step_bytes} | {row['prefill_token_bytes']} | "
                             f"{error:.4f} | {row['prefill_1000_at_50mbit_s']} |")
    print(json.dumps({"rows": rows, "markdown": lines}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
