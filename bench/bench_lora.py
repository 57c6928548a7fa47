"""What serving LoRA adapters costs: aggregate decode tokens/s of 8 concurrent sessions all on the base model
against 8 sessions spread over 2 adapters and the base (3 + 3 + 2), on a 2-server swarm (blocks 0:15 + 15:30,
float32, one thread each) whose servers hold both adapters (peft-made, rank 8 on q/v/gate/up/down). Also the
servers' compute alone: one batched decode step of 8 rows through blocks 0:15 in this process (`BlockSpan.
forward_batch`), base rows against mixed rows. Prints one JSON object.

Each session feeds a 100-token prompt, then runs 32 greedy decode steps in its own thread; the aggregate rate
counts all sessions' decode tokens over the wall time of the decode phase (best of 3 rounds, the two setups
alternating).
"""
from __future__ import annotations

import json
import statistics
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from launch.topology import Topology  # noqa: E402
from swarm.modeling.prepare import prepare_model  # noqa: E402

DECODE_STEPS = 32
SESSIONS = 8
MIXED = ["alpha", "beta", None] * 2 + ["alpha", "beta"]  # 3 + 3 + 2
TARGETS = ["q_proj", "v_proj", "gate_proj", "up_proj", "down_proj"]


def make_adapter(path: str, out_dir: Path, seed: int) -> str:
    """A peft LoRA adapter (rank 8) with random non-zero weights, saved in peft's format."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    model = get_peft_model(AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32),
                           LoraConfig(r=8, lora_alpha=16, target_modules=TARGETS, task_type="CAUSAL_LM"))
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_" in name:
                param.copy_(torch.randn(param.shape, generator=generator) * 0.05)
    model.save_pretrained(str(out_dir))
    return str(out_dir)


def concurrent_rate(model, prompt, adapters) -> float:
    barrier = threading.Barrier(len(adapters))
    times = []

    def run(i):
        with model.inference_session(max_length=prompt.shape[1] + DECODE_STEPS + 1, adapter=adapters[i]) as s:
            ids = prompt.clone()
            ids[0, 0] = 100 + i  # different sessions, different contents
            s.feed(ids)  # the prompt
            barrier.wait()
            start = time.perf_counter()
            model.generate(ids, session=s, max_new_tokens=DECODE_STEPS, min_new_tokens=DECODE_STEPS, do_sample=False)
            times.append((start, time.perf_counter()))

    with ThreadPoolExecutor(len(adapters)) as pool:
        list(pool.map(run, range(len(adapters))))
    wall = max(t[1] for t in times) - min(t[0] for t in times)
    return len(adapters) * DECODE_STEPS / wall


def span_step_ms(path: str, adapters: dict) -> dict:
    """Milliseconds per batched decode step of 8 one-row sessions through blocks 0:15 (median of 50)."""
    from server.compute.blocks import BlockSpan
    from swarm.modeling.checkpoint import Checkpoint
    from swarm.modeling.lora_files import AdapterSource, open_adapter

    checkpoint = Checkpoint(path)
    files = [open_adapter(AdapterSource(name, location), checkpoint.load_config()) for name, location in
             adapters.items()]
    span = BlockSpan.load(checkpoint, 0, 15, "float32", adapters=files)
    torch.manual_seed(0)
    setups = {"base": [None] * SESSIONS, "mixed": MIXED}
    kvs = {label: [span.new_session_kv(1, 256, 0, 15, adapter=name) for name in names]
           for label, names in setups.items()}
    for label in setups:
        for kv in kvs[label]:
            span.forward(torch.randn(1, 100, span.hidden_size) * 0.05, 0, kv)
    times: dict = {label: [] for label in setups}
    for step in range(60):  # the two setups alternate step by step: a shared machine's load drifts over both alike
        for label in setups:
            items = [(torch.randn(1, 1, span.hidden_size) * 0.05, 100 + step, kv) for kv in kvs[label]]
            start = time.perf_counter()
            span.forward_batch(items, 0, 15)
            times[label].append(time.perf_counter() - start)
    result = {label: round(statistics.median(values[10:]) * 1000, 2) for label, values in times.items()}
    return result


def main() -> None:
    from swarm import AutoDistributedModelForCausalLM

    torch.set_num_threads(1)
    path = str(prepare_model())
    prompt = torch.randint(100, 10000, (1, 100))
    result: dict = {"sessions": SESSIONS, "mixed_adapters": [a or "base" for a in MIXED]}
    with tempfile.TemporaryDirectory() as tmp:
        adapters = {name: make_adapter(path, Path(tmp) / name, seed) for name, seed in (("alpha", 1), ("beta", 2))}
        result["span_step_ms_8_rows_blocks_0_15"] = span_step_ms(path, adapters)
        server_args = ["--attn_cache_tokens", "65536", "--adapters", *(f"{n}={p}" for n, p in adapters.items())]
        with Topology(path, ["0:15", "15:30"], prefix="bench-lora", server_args=server_args, name="bench-lora",
                      threads=1, ready_timeout=300) as topology:
            model = AutoDistributedModelForCausalLM.from_pretrained(path, initial_peers=topology.initial_peers,
                                                                    dht_prefix="bench-lora")
            model.generate(prompt[:, :8], max_new_tokens=2)
            rates: dict = {"base": [], "mixed": []}
            for _ in range(3):
                rates["base"].append(concurrent_rate(model, prompt, [None] * SESSIONS))
                rates["mixed"].append(concurrent_rate(model, prompt, MIXED))
            stats = [model.manager.server_info(s.peer_id) for s in topology.servers]
            model.shutdown()
    base, mixed = max(rates["base"]), max(rates["mixed"])
    result["aggregate_decode_tokens_per_s"] = {"all_base": round(base, 2), "2_adapters_and_base": round(mixed, 2)}
    result["rounds_tokens_per_s"] = {k: [round(v, 2) for v in vs] for k, vs in rates.items()}
    result["mixed_over_base"] = round(mixed / base, 3)
    step = result["span_step_ms_8_rows_blocks_0_15"]
    result["span_step_mixed_over_base"] = round(step["mixed"] / step["base"], 3)
    result["largest_decode_batch"] = max(s.largest_batch for s in stats)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
