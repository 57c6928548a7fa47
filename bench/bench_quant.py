"""Quantized block servers: none / int8 / nf4 on this machine. Prints one JSON object.

For each weight format, a 2-server swarm (blocks 0:15 + 15:30, `--quant_type`): server RSS once loaded and its
peak over the run (15 blocks each),
aggregate decode tokens/s for 1 and 8 concurrent sessions (32 greedy steps from a 100-token prompt), time to
first token for a 256-token prompt. Quality against float32, on the whole model quantized by transformers'
bitsandbytes integration the same way (LM head and embeddings float): top-1 agreement and mean KL(fp32 || quant)
of the next-token distributions at every position of a fixed set of prompts.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))  # bench_throughput, also when imported by the tests

import torch  # noqa: E402
from bench_throughput import concurrent_rate, peak_rss_mb, ttft  # noqa: E402

from launch.topology import Topology  # noqa: E402
from swarm.modeling.prepare import prepare_model  # noqa: E402

QUALITY_PROMPTS = [
    "The history of the Roman Empire begins with the founding of the city, traditionally dated to 753 BC.",
    "def fibonacci(n):\n    if n < 2:\n        return n\n    return fibonacci(n - 1) + fibonacci(n - 2)",
    "Three things every gardener should know about soil are its texture, its acidity and how well it drains.",
    "Photosynthesis is the process by which green plants turn light, water and carbon dioxide into sugar.",
    "To make a good cup of tea, first warm the pot, then add one spoon of leaves for each cup.",
]


def quality(path: str) -> dict:
    from transformers import AutoModelForCausalLM, AutoTokenizer, BitsAndBytesConfig

    tokenizer = AutoTokenizer.from_pretrained(path)
    batches = [tokenizer(p, return_tensors="pt")["input_ids"] for p in QUALITY_PROMPTS]
    full = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        ref = [full(ids).logits[0].log_softmax(-1) for ids in batches]  # [seq, vocab] each
    del full
    configs = {"int8": BitsAndBytesConfig(load_in_8bit=True, llm_int8_threshold=6.0),
               "nf4": BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4",
                                         bnb_4bit_compute_dtype=torch.float32)}
    out = {}
    for name, config in configs.items():
        model = AutoModelForCausalLM.from_pretrained(path, quantization_config=config, dtype=torch.float32,
                                                     device_map="cpu").eval()
        agree = total = 0
        kl = 0.0
        with torch.no_grad():
            for ids, r in zip(batches, ref):
                q = model(ids).logits[0].float().log_softmax(-1)
                agree += int((q.argmax(-1) == r.argmax(-1)).sum())
                total += r.shape[0]
                kl += float((r.exp() * (r - q)).sum(-1).sum())
        out[name] = {"top1_agreement_vs_fp32": round(agree / total, 4), "mean_kl_vs_fp32": round(kl / total, 4),
                     "positions": total}
        del model
    return out


def rss_mb(pid: int) -> float:
    """Current RSS (VmRSS) of one process, in MB."""
    for line in open(f"/proc/{pid}/status"):
        if line.startswith("VmRSS:"):
            return round(int(line.split()[1]) / 1024, 1)
    return 0.0


def swarm_figures(path: str, quant_type: str, prompt: torch.Tensor) -> dict:
    from swarm import AutoDistributedModelForCausalLM

    prefix = f"bench-q-{quant_type}"
    with Topology(path, ["0:15", "15:30"], prefix=prefix, name=prefix, threads=1, ready_timeout=300,
                  server_args=["--quant_type", quant_type, "--attn_cache_tokens", "16384"]) as topology:
        loaded_rss = [rss_mb(s.proc.pid) for s in topology.servers]
        model = AutoDistributedModelForCausalLM.from_pretrained(path, initial_peers=topology.initial_peers,
                                                                dht_prefix=prefix)
        try:
            model.generate(prompt[:, :8], max_new_tokens=2)
            result = {
                "decode_tokens_per_s_1_session": round(concurrent_rate(model, prompt, 1), 2),
                "decode_tokens_per_s_8_sessions": round(concurrent_rate(model, prompt, 8), 2),
                "ttft_s_256_tokens": round(ttft(model, 256), 3),
                "server_rss_mb_after_load": loaded_rss,
                "server_peak_rss_mb": [peak_rss_mb(s.proc.pid) for s in topology.servers],
            }
        finally:
            model.shutdown()
    return result


def main() -> None:
    torch.manual_seed(0)
    path = str(prepare_model())
    prompt = torch.randint(100, 10000, (1, 100))
    result: dict = {"topology": ["0:15", "15:30"], "server_threads": 1}
    for quant_type in ("none", "int8", "nf4"):
        result[quant_type] = swarm_figures(path, quant_type, prompt)
    for quant_type, figures in quality(path).items():
        result[quant_type].update(figures)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
