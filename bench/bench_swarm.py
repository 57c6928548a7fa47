"""Prefill time and decode tokens/s: local `transformers` vs a 2-server swarm (blocks 0:15 + 15:30) on loopback.

Starts its own bootstrap peer and servers, runs a ~100-token prompt with 64 greedy new tokens through both,
and prints one JSON object. Prefill = time to the first new token, the median of 7 one-token generations;
decode rate = (64 - 1) new tokens over the time after the first one, best of `--runs`.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from launch.topology import Topology  # noqa: E402
from swarm.modeling.prepare import prepare_model  # noqa: E402

PROMPT = (
    "The history of computing is a story of people and machines. In the early nineteenth century, Charles "
    "Babbage designed the Analytical Engine, a mechanical general-purpose computer, and Ada Lovelace wrote what "
    "is often called the first program for it. A century later, Alan Turing described a universal machine that "
    "could simulate any other, and during the Second World War engineers built electronic computers to break "
    "codes and compute artillery tables. Write a short summary of the most important ideas in this history:"
)


class _Timer:
    """A streamer that records when each new token arrives."""

    def __init__(self):
        self.times = []
        self.first = True

    def put(self, value):
        value.cpu()  # on a GPU: waits until the token is there
        if self.first:  # the prompt
            self.first = False
            return
        self.times.append(time.perf_counter())

    def end(self):
        pass


def median_ttft(generate, ids, runs: int = 7) -> float:
    """Median time to the first new token over `runs` one-token generations (a single run varies by up to 2x on
    a shared 2-core machine)."""
    times = []
    for _ in range(runs):
        timer = _Timer()
        start = time.perf_counter()
        generate(ids, max_new_tokens=1, min_new_tokens=1, do_sample=False, streamer=timer)
        times.append(timer.times[0] - start)
    return round(statistics.median(times), 4)


def measure(generate, ids, new_tokens: int, runs: int) -> dict:
    best = None
    for _ in range(runs):
        timer = _Timer()
        start = time.perf_counter()
        out = generate(ids, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False, streamer=timer)
        assert out.shape[1] == ids.shape[1] + new_tokens
        prefill = timer.times[0] - start
        decode = (len(timer.times) - 1) / (timer.times[-1] - timer.times[0])
        if best is None or decode > best["decode_tokens_per_s"]:
            best = {"prefill_s": round(prefill, 4), "decode_tokens_per_s": round(decode, 2), "tokens": out[0].tolist()}
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--new_tokens", type=int, default=64)
    parser.add_argument("--runs", type=int, default=2)
    args = parser.parse_args()
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from swarm import AutoDistributedModelForCausalLM

    path = str(prepare_model())
    tokenizer = AutoTokenizer.from_pretrained(path)
    ids = tokenizer(PROMPT, return_tensors="pt")["input_ids"]
    local_model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.inference_mode():
        local_model.generate(ids[:, :8], max_new_tokens=2)  # warm-up
    local = measure(local_model.generate, ids, args.new_tokens, args.runs)
    local["prefill_s"] = median_ttft(local_model.generate, ids)
    del local_model

    with Topology(path, ["0:15", "15:30"], prefix="bench", name="bench", ready_timeout=300) as topology:
        model = AutoDistributedModelForCausalLM.from_pretrained(path, initial_peers=topology.initial_peers,
                                                                dht_prefix="bench")
        model.generate(ids[:, :8], max_new_tokens=2)  # warm-up (routing, streams)
        swarm = measure(model.generate, ids, args.new_tokens, args.runs)
        swarm["prefill_s"] = median_ttft(model.generate, ids)
        model.shutdown()
    result = {
        "machine": f"{platform.machine()} {os.cpu_count()} cores, torch {torch.__version__}, float32",
        "prompt_tokens": ids.shape[1],
        "new_tokens": args.new_tokens,
        "local_prefill_s": local["prefill_s"],
        "local_decode_tokens_per_s": local["decode_tokens_per_s"],
        "swarm_prefill_s": swarm["prefill_s"],
        "swarm_decode_tokens_per_s": swarm["decode_tokens_per_s"],
        "decode_ratio_swarm_over_local": round(swarm["decode_tokens_per_s"] / local["decode_tokens_per_s"], 3),
        "prefill_ratio_swarm_over_local": round(swarm["prefill_s"] / local["prefill_s"], 3),
        "same_tokens": swarm["tokens"] == local["tokens"],
    }
    print(json.dumps(result))


if __name__ == "__main__":
    main()
