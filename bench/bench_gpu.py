"""GPU benchmark on a ~1.1B-parameter Llama-architecture model with random weights, bfloat16, one CUDA device.

The model (TinyLlama-1.1B's shape: hidden 2048, 22 blocks, 32 heads / 4 key-value heads) is built here with
random weights and saved as a local checkpoint. Measured, each in one run, and printed as one JSON object:
1. `span_step_ms`: one single-token decode step through all 22 blocks in this process, by `BlockSpan.forward`
   (`layer_modules`: what prefill runs, `server.decode.prefill_step`), by the lean eager path (`server.decode`)
   and by its CUDA graph (`server.graphs`); and 8 sessions' steps as one eager batch and as 8 graph replays;
   with the host's time per kernel launch.
2. local `transformers` generate (the whole model on the GPU) against a 2-server swarm on loopback (blocks
   0:11 + 11:22, both servers and the client on the same GPU), with the servers' CUDA graphs on and off: time
   to first token and decode tokens/s for a 100-token prompt and 64 greedy tokens (best of `--runs`), and the
   aggregate decode rate of 8 concurrent sessions.
Without a CUDA device it prints {"skipped": ...}.
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
from bench_swarm import measure  # noqa: E402  (bench/ is on the path when run as a script)
from bench_throughput import concurrent_rate  # noqa: E402

from swarm.launch.topology import Topology  # noqa: E402

CONFIG = dict(hidden_size=2048, intermediate_size=5632, num_hidden_layers=22, num_attention_heads=32,
              num_key_value_heads=4, vocab_size=32000, max_position_embeddings=2048, tie_word_embeddings=False,
              rms_norm_eps=1e-5, bos_token_id=1, eos_token_id=2)
SPLIT = ("0:11", "11:22")


def build_checkpoint(path: Path) -> int:
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(**CONFIG)
    config.dtype = torch.bfloat16
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = LlamaForCausalLM(config).to(torch.bfloat16)
    model.save_pretrained(path)
    params = sum(p.numel() for p in model.parameters())
    del model
    torch.cuda.empty_cache()
    return params


def measure_generate(generate, ids, new_tokens: int, runs: int) -> dict:
    """bench_swarm's measure (best decode rate of `runs`), with its time to first token named ttft_s."""
    result = measure(generate, ids, new_tokens, runs)
    result["ttft_s"] = result.pop("prefill_s")
    return result


def span_steps(path: str, steps: int = 40) -> dict:
    from server.blocks import BlockSpan
    from swarm.modeling.checkpoint import Checkpoint

    span = BlockSpan.load(Checkpoint(path), 0, CONFIG["num_hidden_layers"], "bfloat16", "cuda")
    n = span.end
    prompt = torch.randn(1, 100, span.hidden_size, device="cuda", dtype=span.dtype)

    def timed(step) -> float:
        kv = span.new_session_kv(1, 100 + steps + 8, 0, n)
        span.forward(prompt, 0, kv)
        for i in range(3):  # warm-up (and the graph's capture)
            step(torch.randn(1, 1, span.hidden_size, device="cuda", dtype=span.dtype), 100 + i, kv)
        torch.cuda.synchronize()
        start = time.perf_counter()
        for i in range(steps):
            step(torch.randn(1, 1, span.hidden_size, device="cuda", dtype=span.dtype), 100 + i, kv)
        torch.cuda.synchronize()
        return round((time.perf_counter() - start) / steps * 1000, 3)

    result = {"layer_modules": timed(lambda x, pos, kv: span.forward(x, pos, kv)),
              "lean_eager": timed(lambda x, pos, kv: span.forward_batch([(x, pos, kv)], 0, n))}
    span.enable_cuda_graphs()
    result["cuda_graph"] = timed(lambda x, pos, kv: span.forward_batch([(x, pos, kv)], 0, n))
    for max_sessions, name in ((1, "lean_eager_8_sessions_batched"), (8, "cuda_graphs_8_sessions_one_by_one")):
        span.graphs.max_sessions = max_sessions
        kvs = [span.new_session_kv(1, 100 + steps + 8, 0, n) for _ in range(8)]
        for kv in kvs:
            span.forward(prompt, 0, kv)
        for i in range(steps + 3):
            if i == 3:  # after warm-up and capture
                torch.cuda.synchronize()
                start = time.perf_counter()
            span.forward_batch([(torch.randn(1, 1, span.hidden_size, device="cuda", dtype=span.dtype), 100 + i, kv)
                                for kv in kvs], 0, n)
        torch.cuda.synchronize()
        result[name] = round((time.perf_counter() - start) / steps * 1000, 3)
    span.graphs = None  # the graphs hold the caches' addresses
    return result


def launch_us(launches: int = 2000) -> float:
    """Host time per tiny CUDA kernel launch (what an eager decode step pays hundreds of times)."""
    x = torch.zeros(1, device="cuda")
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(launches):
        x.add_(1)
    torch.cuda.synchronize()
    return round((time.perf_counter() - start) / launches * 1e6, 2)


def swarm_run(path: str, ids, new_tokens: int, runs: int, graphs: bool, prefix: str, local: dict) -> dict:
    from swarm import AutoDistributedModelForCausalLM

    server_args = ["--device", "cuda", "--torch_dtype", "bfloat16", "--max_length", "2048", "--attn_cache_tokens",
                   "32768", "--throughput", "1", "--cuda_graphs" if graphs else "--no-cuda_graphs"]
    topology = Topology(path, prefix=prefix, server_args=server_args, name=prefix, ready_timeout=600)
    try:
        topology.start()
        topology.add_servers(SPLIT)
        model = AutoDistributedModelForCausalLM.from_pretrained(path, initial_peers=topology.initial_peers,
                                                                dht_prefix=prefix, device="cuda",
                                                                torch_dtype=torch.bfloat16)
        model.generate(ids[:, :8], max_new_tokens=4)  # routing, streams
        result = measure_generate(model.generate, ids, new_tokens, runs)
        result["aggregate_tokens_per_s_8_sessions"] = round(concurrent_rate(model, ids, 8), 1)
        result["logits_vs_local_along_local_tokens"] = compare_logits(model, local["tokens"], ids.shape[1],
                                                                      local["logits"])
        model.shutdown()
        return result
    except Exception:
        for p in topology.procs:
            print(f"--- {p.name}\n{p.log_tail(30)}", file=sys.stderr)
        raise
    finally:
        topology.close()


def local_run(path: str, ids, new_tokens: int, runs: int) -> dict:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).cuda().eval()
    with torch.inference_mode():
        model.generate(ids[:, :8].cuda(), max_new_tokens=4)
        result = measure_generate(lambda x, **kw: model.generate(x.cuda(), **kw), ids, new_tokens, runs)
        # the reference logits along local's own greedy sequence, for the swarm's teacher-forced steps
        seq = torch.tensor([result["tokens"]]).cuda()
        result["logits"] = model(seq).logits[0, ids.shape[1] - 1:-1].float().cpu()  # [new_tokens, vocab]
    return result


def compare_logits(model, tokens: list, prompt_len: int, reference: torch.Tensor) -> dict:
    """Feed local's greedy sequence through a swarm session token by token (the decode path, graphs included)
    and compare each step's logits with local transformers' along the same sequence."""
    seq = torch.tensor([tokens])
    rows = []
    with model.inference_session(max_length=seq.shape[1]) as session:
        for end in range(prompt_len, seq.shape[1]):
            rows.append(session.feed(seq[:, :end])[0])
    ours = torch.stack(rows)  # [new_tokens, vocab]
    scale = reference.abs().max().item()
    return {"top1_agreement": round((ours.argmax(-1) == reference.argmax(-1)).float().mean().item(), 3),
            "max_abs_logit_diff": round((ours - reference).abs().max().item(), 4),
            "max_abs_logit": round(scale, 3)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--new_tokens", type=int, default=64)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--workdir", default=None, help="where to save the random checkpoint (default: a temp dir)")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print(json.dumps({"skipped": "no CUDA device"}))
        return
    work = Path(args.workdir or tempfile.mkdtemp(prefix="swarmgate-gpu-"))
    path = str(work / "llama-1b-random")
    params = build_checkpoint(Path(path))
    torch.manual_seed(1)
    ids = torch.randint(100, CONFIG["vocab_size"], (1, 100))
    result = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "dtype": "bfloat16",
              "parameters": params, "blocks": CONFIG["num_hidden_layers"], "prompt_tokens": ids.shape[1],
              "new_tokens": args.new_tokens}

    local = local_run(path, ids, args.new_tokens, args.runs)
    torch.cuda.empty_cache()
    result["local"] = {k: v for k, v in local.items() if k not in ("tokens", "logits")}
    for graphs in (True, False):
        swarm = swarm_run(path, ids, args.new_tokens, args.runs, graphs, f"bench-gpu-{int(graphs)}", local)
        tokens = swarm.pop("tokens")
        differ = next((i for i, (a, b) in enumerate(zip(tokens, local["tokens"])) if a != b), len(tokens))
        # greedy tokens equal to local transformers' before the first difference (bfloat16 kernels differ)
        swarm["new_tokens_equal_to_local"] = differ - ids.shape[1]
        swarm["decode_ratio_over_local"] = round(swarm["decode_tokens_per_s"] / local["decode_tokens_per_s"], 2)
        swarm["ttft_ratio_over_local"] = round(swarm["ttft_s"] / local["ttft_s"], 2)
        result["swarm_cuda_graphs" if graphs else "swarm_no_cuda_graphs"] = swarm
    # last: right after writing the checkpoint the host is busy and launches are several times slower
    result["span_step_ms"] = span_steps(path)
    result["kernel_launch_us"] = launch_us()
    print(json.dumps(result))


if __name__ == "__main__":
    main()
