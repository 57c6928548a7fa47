"""Gateway overhead benchmark (issue 46): N concurrent streams through the gateway vs local transformers decoding a
batch of N, on a model whose compute is nearly nothing, so that what is measured is the swarm's and the gateway's
own per-token cost.

A tiny random Llama (hidden 64, 4 blocks, the bundled tokenizer: `tests.fixtures.tiny_checkpoints.save_tiny`) is
saved to a temporary directory and served by 2 real block servers (0:2, 2:4) and a real gateway (`launch.topology`,
one intra-op thread each). For each N (`--streams`, default 1,16,64,256):
- gateway: N streaming chat completions at once (httpx, asyncio; temperature 0, `max_tokens` = `--new_tokens`,
  `ignore_eos` so that every stream generates the same count), timed from the first request to the last stream's
  end; tokens/s = the completion tokens the gateway reported / that time;
- local: transformers `generate` on the same checkpoint, a batch of N copies of the same prompt ids, greedy,
  `min_new_tokens` = `max_new_tokens` (EOS never ends a row), one thread (`--threads`), timed end to end;
- the ratio gateway / local, and CPU milliseconds per generated token of the gateway process and of each server
  process (each with its children: DHT process, p2pd; psutil `cpu_times` before and after the wave), and of the
  gateway's Python process alone (`gateway_python`: the rest of `gateway` is its p2pd and DHT child).
Warm-up before the waves: one stream, then as many 2-token streams as the largest wave (a gateway that has
served that many at once keeps their worker threads). Prints one JSON object. `--profile PATH`: py-spy records the
gateway during each wave (collapsed stacks in PATH.<mode>.<streams>.txt); `--modes round,thread`: a gateway with engine
rounds and one without (`--no-engine_round`), waves alternating between them, the same local figure for both.

Usage (from the repository root): .venv/bin/python bench/bench_overhead.py [--streams 16,64] [--new_tokens 32]
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Dict, List

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import httpx  # noqa: E402
import torch  # noqa: E402

from bench.harness import cpu_seconds  # noqa: E402
from bench.load_client import stream_chat  # noqa: E402
from launch.topology import ManagedProcess, Topology  # noqa: E402
from swarm.modeling.prepare import prepare_model  # noqa: E402
from tests.fixtures.tiny_checkpoints import save_tiny  # noqa: E402

MODEL = "tiny-llama"  # the checkpoint directory's name: what the gateway serves
PROMPT = "Write a short story about a lighthouse keeper who finds a message in a bottle."


def cpu_now(gateway: ManagedProcess, servers: List[ManagedProcess]) -> Dict[str, float]:
    """CPU seconds so far: each process with its children, and the gateway's Python process alone."""
    return {"gateway": cpu_seconds(gateway.proc.pid, tree=True), "gateway_python": cpu_seconds(gateway.proc.pid),
            **{f"server{i}": cpu_seconds(s.proc.pid, tree=True) for i, s in enumerate(servers)}}


def body(new_tokens: int) -> dict:
    return {"model": MODEL, "messages": [{"role": "user", "content": PROMPT}], "temperature": 0,
            "max_tokens": new_tokens, "ignore_eos": True, "stream_options": {"include_usage": True}}


async def wave(url: str, n: int, new_tokens: int) -> Dict[str, Any]:
    limits = httpx.Limits(max_connections=n + 8, max_keepalive_connections=n + 8)
    async with httpx.AsyncClient(timeout=httpx.Timeout(600.0), limits=limits) as http:
        start = time.perf_counter()
        streams = await asyncio.gather(*(stream_chat(http, url, body(new_tokens)) for _ in range(n)))
        elapsed = time.perf_counter() - start
    errors = [s.error for s in streams if s.error]
    tokens = sum(s.completion_tokens for s in streams)
    return {"seconds": elapsed, "tokens": tokens, "errors": len(errors), "first_error": errors[0] if errors else None,
            "short_streams": sum(s.completion_tokens != new_tokens for s in streams)}


@torch.inference_mode()
def local_rate(reference, prompt_ids: List[int], n: int, new_tokens: int) -> Dict[str, float]:
    """transformers `generate`, a batch of n copies of the prompt, greedy, every row `new_tokens` long."""
    ids = torch.tensor([prompt_ids] * n, dtype=torch.long)
    kwargs = dict(max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False,
                  attention_mask=torch.ones_like(ids), pad_token_id=reference.config.eos_token_id)
    reference.generate(ids[:, :], **{**kwargs, "max_new_tokens": 2, "min_new_tokens": 2})  # warm-up
    start = time.perf_counter()
    out = reference.generate(ids, **kwargs)
    elapsed = time.perf_counter() - start
    tokens = (out.shape[1] - ids.shape[1]) * n
    return {"seconds": elapsed, "tokens": tokens, "tokens_per_s": tokens / elapsed}


def measure(gateway: ManagedProcess, servers: List[ManagedProcess], n: int, args, mode: str) -> Dict[str, Any]:
    """One wave of n streams through `gateway`: its rate and the CPU it and the servers spent per token."""
    assert gateway.ready is not None
    before = cpu_now(gateway, servers)
    spy = None if args.profile is None else subprocess.Popen(
        [os.path.join(os.path.dirname(sys.executable), "py-spy"), "record", "--format", "raw", "--gil",
         "--rate", "200", "--nonblocking", "-p", str(gateway.proc.pid), "-o", f"{args.profile}.{mode}.{n}.txt"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    got = asyncio.run(wave(gateway.ready["url"], n, args.new_tokens))
    if spy is not None:
        spy.send_signal(signal.SIGINT)
        spy.wait(60)
    after = cpu_now(gateway, servers)
    tokens = max(got["tokens"], 1)
    return {"streams": n, "mode": mode, "gateway_tokens": got["tokens"], "errors": got["errors"],
            "first_error": got["first_error"], "short_streams": got["short_streams"],
            "gateway_tokens_per_s": round(got["tokens"] / got["seconds"], 1),
            "cpu_ms_per_token": {k: round(1000 * (after[k] - before[k]) / tokens, 3) for k in before}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--streams", default="1,16,64,256", help="comma-separated concurrent stream counts")
    parser.add_argument("--new_tokens", type=int, default=32, help="tokens every stream generates")
    parser.add_argument("--threads", type=int, default=1, help="intra-op threads of local transformers and of "
                                                               "each swarm process")
    parser.add_argument("--skip_local", action="store_true", help="only the gateway side")
    parser.add_argument("--profile", default=None, help="py-spy the gateway during each wave: collapsed stacks "
                                                       "written to PROFILE.<mode>.<streams>.txt")
    parser.add_argument("--modes", default="round", help="comma-separated gateways to compare, one process each: "
                                                         "round (engine rounds), thread (--no-engine_round: every "
                                                         "request on its own worker thread)")
    args = parser.parse_args()
    counts = [int(c) for c in args.streams.split(",") if c]
    modes = [m for m in args.modes.split(",") if m]
    if not modes or set(modes) - {"round", "thread"}:
        parser.error("--modes takes round and/or thread")
    torch.set_num_threads(args.threads)
    waves: List[Dict[str, Any]] = []
    result: Dict[str, Any] = {"bench": "overhead", "model": "tiny llama (hidden 64, 4 blocks)",
                              "new_tokens": args.new_tokens, "threads": args.threads, "waves": waves}
    with tempfile.TemporaryDirectory(prefix="bench-overhead-") as tmp:
        path = Path(tmp) / MODEL
        reference = save_tiny("llama", path, str(prepare_model("smollm2-135m-instruct")))
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(path)
        prompt_ids = list(tokenizer.apply_chat_template([{"role": "user", "content": PROMPT}],
                                                        add_generation_prompt=True, tokenize=True,
                                                        return_dict=False))
        top = max(counts)
        server_args = ["--max_sessions_per_peer", str(max(128, 2 * top))]
        with Topology(str(path), ["0:2", "2:4"], f"overhead-{os.getpid()}", server_args, name="bench-overhead",
                      threads=args.threads) as swarm:
            gateways = {mode: swarm.add_gateway(extra=["--max_concurrent", str(max(32, top)),
                                                       "--max_queue", str(max(64, top)),
                                                       *(["--no-engine_round"] if mode == "thread" else [])])
                        for mode in modes}
            for gateway in gateways.values():
                assert gateway.ready is not None
                for count in (1, top):  # warm-up: routes, streams, the head; as many worker threads as streams
                    warm = asyncio.run(wave(gateway.ready["url"], count, 2))
                    if warm["errors"]:
                        raise RuntimeError(f"a warm-up stream failed: {warm['first_error']}")
            for n in counts:
                local = None if args.skip_local else local_rate(reference, prompt_ids, n, args.new_tokens)
                for mode, gateway in gateways.items():
                    row = measure(gateway, swarm.servers, n, args, mode)
                    if local is not None:
                        row["local_tokens_per_s"] = round(local["tokens_per_s"], 1)
                        row["ratio"] = round(row["gateway_tokens_per_s"] / local["tokens_per_s"], 3)
                    waves.append(row)
                    print(json.dumps(row), file=sys.stderr, flush=True)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
