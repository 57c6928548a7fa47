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
  `min_new_tokens` = `max_new_tokens` (EOS never ends a row), one thread (`--threads`; `--model gpu`: torch's own
  count), timed end to end;
- the ratio gateway / local, and CPU milliseconds per generated token of the gateway process and of each server
  process (each with its children: DHT process, p2pd; psutil `cpu_times` before and after the wave), and of the
  gateway's Python process alone (`gateway_python`: the rest of `gateway` is its p2pd and DHT child).
`--model bundled`: the same waves on the bundled SmolLM2-135M (30 blocks on 2 servers, 0:15 and 15:30, each with a
KV budget for every stream's session at once; local transformers in float32), where compute is no longer nothing
(issue 46's goal there: 16 streams >= 0.9x local).
`--model gpu` (a CUDA device; bench/gpu_session.sh's `overhead` part): random bfloat16 blocks in Llama-3-8B's shape
(hidden 4096, 32 heads, 8 key-value heads, intermediate 14336; `--blocks`, default 8) with the bundled tokenizer's
vocabulary, served by ONE server (all blocks, `--quant_type`, default nf4, CUDA graphs) and a gateway whose embeddings
and head run on the GPU (`--device cuda`); local: transformers with the whole model on the GPU, quantized the same
way (`BitsAndBytesConfig`, nf4 blocksize 64 without double quantization, bfloat16 compute), a batch of N (issue 46's
goal: 16 streams >= 0.8x local nf4 batch-16). `--gateway_devices cuda,cpu` adds a gateway whose head runs on the CPU.
`--shape '{"hidden_size": 256, ...}'` overrides the shape (a small dry run on the CPU: `--device cpu --quant_type
none`, bitsandbytes' nf4 being CUDA's here).
Memory per open stream: each process tree's RSS (psutil, sampled every 0.1 s during the wave) at its peak, less its
RSS after the one-stream warm-up, divided by N (`rss_mb`, `rss_kb_per_stream`: an upper bound for the waves smaller
than the largest, whose warm-up already grew the processes' heaps, which they keep).
Warm-up before the waves: one 2-token stream, then a whole wave of the largest size (a gateway that has served that
many at once keeps their worker threads; servers pack their weights for small batches during their first ones,
`--packed_rows`, about 0.4 s of a SmolLM2 server's CPU, and first touch their caches), so that a measured wave is the
steady state, as local transformers' best of `--local_runs` is. Prints one JSON object. `--profile PATH`: py-spy
records the gateway during each wave (collapsed stacks in PATH.<mode>.<streams>.txt); `--modes round,thread`: a
gateway with engine rounds and one without (`--no-engine_round`), waves alternating between them, the same local
figure for both; `relay`: engine rounds with `--no-push` (the gateway relays every hop; `round` has the servers push
the rows on).

Usage (from the repository root): .venv/bin/python bench/bench_overhead.py [--streams 16,64] [--new_tokens 32]
    [--model tiny|bundled]
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any, Dict, List

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import httpx  # noqa: E402
import torch  # noqa: E402

from bench.harness import cpu_seconds, tree_rss  # noqa: E402
from bench.load_client import stream_chat  # noqa: E402
from launch.topology import ManagedProcess, Topology  # noqa: E402
from swarm.modeling.prepare import prepare_model  # noqa: E402
from tests.fixtures.tiny_checkpoints import save_tiny  # noqa: E402

TINY = "tiny-llama"  # the tiny checkpoint directory's name (a gateway serves its directory's name)
# --model: (description, block spans of the 2 servers)
MODELS = {"tiny": ("tiny llama (hidden 64, 4 blocks)", ["0:2", "2:4"]),
          "bundled": ("bundled smollm2-135m-instruct (hidden 576, 30 blocks)", ["0:15", "15:30"]),
          "gpu": ("llama-3-8b-shaped blocks, random bfloat16", [])}  # spans: one server of every block
GPU_SHAPE = dict(hidden_size=4096, intermediate_size=14336, num_attention_heads=32, num_key_value_heads=8,
                 max_position_embeddings=4096, tie_word_embeddings=False, rms_norm_eps=1e-5, bos_token_id=1,
                 eos_token_id=2)
PROMPT = "Write a short story about a lighthouse keeper who finds a message in a bottle."


def cpu_now(gateway: ManagedProcess, servers: List[ManagedProcess]) -> Dict[str, float]:
    """CPU seconds so far: each process with its children, and the gateway's Python process alone."""
    return {"gateway": cpu_seconds(gateway.proc.pid, tree=True), "gateway_python": cpu_seconds(gateway.proc.pid),
            **{f"server{i}": cpu_seconds(s.proc.pid, tree=True) for i, s in enumerate(servers)}}


def rss_now(gateway: ManagedProcess, servers: List[ManagedProcess]) -> Dict[str, float]:
    """Resident memory (bytes) of each process tree: the gateway's, each server's (with its DHT child and p2pd)."""
    def tree(pid: int) -> float:
        return tree_rss(pid) or 0.0

    return {"gateway": tree(gateway.proc.pid), **{f"server{i}": tree(s.proc.pid) for i, s in enumerate(servers)}}


class PeakRss:
    """Samples `rss_now` every `period` seconds on a thread while in the `with` block: the peak of each process."""

    def __init__(self, gateway: ManagedProcess, servers: List[ManagedProcess], period: float = 0.1):
        self.gateway, self.servers, self.period = gateway, servers, period
        self.peak: Dict[str, float] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)

    def _sample(self) -> None:
        while True:
            for name, value in rss_now(self.gateway, self.servers).items():
                self.peak[name] = max(self.peak.get(name, 0.0), value)
            if self._stop.wait(self.period):
                return

    def __enter__(self) -> "PeakRss":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()


def body(model: str, new_tokens: int) -> dict:
    return {"model": model, "messages": [{"role": "user", "content": PROMPT}], "temperature": 0,
            "max_tokens": new_tokens, "ignore_eos": True, "stream_options": {"include_usage": True}}


async def wave(url: str, model: str, n: int, new_tokens: int) -> Dict[str, Any]:
    limits = httpx.Limits(max_connections=n + 8, max_keepalive_connections=n + 8)
    async with httpx.AsyncClient(timeout=httpx.Timeout(600.0), limits=limits) as http:
        start = time.perf_counter()
        streams = await asyncio.gather(*(stream_chat(http, url, body(model, new_tokens)) for _ in range(n)))
        elapsed = time.perf_counter() - start
    errors = [s.error for s in streams if s.error]
    tokens = sum(s.completion_tokens for s in streams)
    return {"seconds": elapsed, "tokens": tokens, "errors": len(errors), "first_error": errors[0] if errors else None,
            "short_streams": sum(s.completion_tokens != new_tokens for s in streams)}


def save_gpu_model(path: Path, tokenizer_dir: str, blocks: int, device: str, overrides: Dict[str, Any]) -> None:
    """Random bfloat16 weights in Llama-3-8B's block shape (`overrides` on top), the tokenizer's vocabulary and
    files, saved at `path` (built on `device`: seconds on a GPU)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from tests.fixtures.tiny_checkpoints import TOKENIZER_FILES, VOCAB

    if not (Path(tokenizer_dir) / "tokenizer.json").is_file():
        raise FileNotFoundError(f"no tokenizer.json in {tokenizer_dir} (--tokenizer: the tokenizer's files)")
    config = LlamaConfig(**{**GPU_SHAPE, "vocab_size": VOCAB, **overrides, "num_hidden_layers": blocks})
    config.dtype = torch.bfloat16
    torch.manual_seed(0)
    with torch.device(device):
        model = LlamaForCausalLM(config).to(torch.bfloat16)
    model.save_pretrained(path)
    del model
    for name in TOKENIZER_FILES:
        if (Path(tokenizer_dir) / name).is_file():
            shutil.copy(Path(tokenizer_dir) / name, path / name)


def load_gpu_reference(path: Path, device: str, quant: str):
    """The whole model on `device` through transformers, quantized as the server quantizes it."""
    from transformers import AutoModelForCausalLM

    from tests.fixtures.quant_reference import bnb_config

    kwargs: Dict[str, Any] = {} if quant == "none" else {"quantization_config": bnb_config(quant, torch.bfloat16)}
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16, device_map=device, **kwargs).eval()


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@torch.inference_mode()
def local_rate(reference, prompt_ids: List[int], n: int, new_tokens: int, runs: int = 1) -> Dict[str, Any]:
    """transformers `generate`, a batch of n copies of the prompt, greedy, every row `new_tokens` long (on the
    reference's device): the best of `runs` timed runs after a 2-token warm-up (every run's rate kept)."""
    device = reference.device
    ids = torch.tensor([prompt_ids] * n, dtype=torch.long, device=device)
    kwargs = dict(max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False,
                  attention_mask=torch.ones_like(ids), pad_token_id=reference.config.eos_token_id)
    reference.generate(ids[:, :], **{**kwargs, "max_new_tokens": 2, "min_new_tokens": 2})  # warm-up
    rates = []
    for _ in range(runs):
        _sync(device)
        start = time.perf_counter()
        out = reference.generate(ids, **kwargs)
        _sync(device)
        rates.append((out.shape[1] - ids.shape[1]) * n / (time.perf_counter() - start))
    return {"tokens_per_s": max(rates), "runs_tokens_per_s": [round(r, 1) for r in rates]}


def measure(gateway: ManagedProcess, servers: List[ManagedProcess], n: int, args, mode: str,
            idle_rss: Dict[str, float]) -> Dict[str, Any]:
    """One wave of n streams through `gateway`: its rate, the CPU it and the servers spent per token, and their
    peak memory (and its growth per open stream over `idle_rss`)."""
    assert gateway.ready is not None
    before = cpu_now(gateway, servers)
    spies = []
    if args.profile is not None:
        py_spy = shutil.which("py-spy") or os.path.join(os.path.dirname(sys.executable), "py-spy")
        targets = [("gateway", gateway, ["--gil"])]  # the gateway: what holds the interpreter lock
        if args.profile_servers:  # the servers: every thread on the CPU
            targets += [(f"server{i}", s, []) for i, s in enumerate(servers)]
        for name, proc, flags in targets:
            out = f"{args.profile}.{mode}.{n}.txt" if name == "gateway" else f"{args.profile}.{name}.{mode}.{n}.txt"
            spies.append(subprocess.Popen(
                [py_spy, "record", "--format", "raw", *flags, "--rate", "200", "--nonblocking", "-p",
                 str(proc.proc.pid), "-o", out], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
    with PeakRss(gateway, servers) as rss:
        got = asyncio.run(wave(gateway.ready["url"], args.served, n, args.new_tokens))
    for spy in spies:
        spy.send_signal(signal.SIGINT)
        spy.wait(60)
    after = cpu_now(gateway, servers)
    tokens = max(got["tokens"], 1)
    return {"streams": n, "mode": mode, "gateway_tokens": got["tokens"], "errors": got["errors"],
            "first_error": got["first_error"], "short_streams": got["short_streams"],
            "gateway_tokens_per_s": round(got["tokens"] / got["seconds"], 1),
            "cpu_ms_per_token": {k: round(1000 * (after[k] - before[k]) / tokens, 3) for k in before},
            "rss_mb": {k: round(v / 2**20, 1) for k, v in rss.peak.items()},
            "rss_kb_per_stream": {k: round(max(v - idle_rss.get(k, 0.0), 0.0) / 1024 / n, 1)
                                  for k, v in rss.peak.items()}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--streams", default="1,16,64,256", help="comma-separated concurrent stream counts")
    parser.add_argument("--new_tokens", type=int, default=32, help="tokens every stream generates")
    parser.add_argument("--threads", type=int, default=1, help="intra-op threads of local transformers and of "
                                                               "each swarm process")
    parser.add_argument("--model", default="tiny", choices=sorted(MODELS),
                        help="tiny: a random Llama of hidden 64 and 4 blocks (compute nearly nothing); bundled: the "
                             "bundled SmolLM2-135M (30 blocks, 0:15 and 15:30)")
    parser.add_argument("--skip_local", action="store_true", help="only the gateway side")
    parser.add_argument("--local_runs", type=int, default=None, help="timed local runs per size, the best kept "
                                                                      "(default: 1; --model gpu: 3)")
    parser.add_argument("--profile", default=None, help="py-spy the gateway during each wave: collapsed stacks "
                                                       "written to PROFILE.<mode>.<streams>.txt")
    parser.add_argument("--profile_servers", action="store_true", help="with --profile: py-spy each server too "
                                                                       "(PROFILE.server<i>.<mode>.<streams>.txt)")
    parser.add_argument("--log_dir", default=None, help="keep the processes' logs there (default: temporary files)")
    parser.add_argument("--modes", default="round", help="comma-separated gateways to compare, one process each: "
                                                         "round (engine rounds), thread (--no-engine_round: every "
                                                         "request on its own worker thread), relay (engine rounds, "
                                                         "--no-push)")
    parser.add_argument("--device", default="cuda", help="--model gpu: where the server, the gateway's head and "
                                                         "local transformers run")
    parser.add_argument("--gateway_devices", default=None, help="--model gpu: comma-separated devices of the "
                                                                "gateways' heads (default: --device); each mode "
                                                                "gets one gateway per device")
    parser.add_argument("--quant_type", default="nf4", help="--model gpu: the server's and local weights")
    parser.add_argument("--blocks", type=int, default=8, help="--model gpu: blocks of the model")
    parser.add_argument("--shape", default="{}", help="--model gpu: JSON config values over the 8B shape")
    parser.add_argument("--no-cuda_graphs", dest="cuda_graphs", action="store_false",
                        help="--model gpu: the server steps eagerly")
    parser.add_argument("--tokenizer", default=None, help="--model gpu: directory of the tokenizer files "
                                                          "(default: the bundled model's)")
    args = parser.parse_args()
    counts = [int(c) for c in args.streams.split(",") if c]
    modes = [m for m in args.modes.split(",") if m]
    if not modes or set(modes) - {"round", "thread", "relay"}:
        parser.error("--modes takes round, thread and/or relay")
    gpu = args.model == "gpu"
    args.local_runs = (3 if gpu else 1) if args.local_runs is None else args.local_runs
    if args.local_runs < 1:
        parser.error("--local_runs must be at least 1")
    if args.profile_servers and args.profile is None:
        parser.error("--profile_servers needs --profile")
    if gpu and args.device.startswith("cuda") and not torch.cuda.is_available():
        print(json.dumps({"bench": "overhead", "model": MODELS["gpu"][0], "skipped": "no CUDA device"}))
        return
    heads = list(dict.fromkeys(d for d in (args.gateway_devices or args.device).split(",") if d)) if gpu else ["cpu"]
    if args.model != "gpu":  # (on a GPU, local transformers keeps torch's own thread count: its host-side work)
        torch.set_num_threads(args.threads)
    waves: List[Dict[str, Any]] = []
    description, spans = MODELS[args.model]
    result: Dict[str, Any] = {"bench": "overhead", "model": description,
                              "new_tokens": args.new_tokens, "threads": args.threads, "waves": waves}
    with tempfile.TemporaryDirectory(prefix="bench-overhead-") as tmp:
        from transformers import AutoModelForCausalLM, AutoTokenizer

        if args.model == "bundled":
            path = prepare_model()
            reference = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
        elif gpu:
            path = Path(tmp) / "llama-8b-shaped"
            save_gpu_model(path, args.tokenizer or str(prepare_model("smollm2-135m-instruct")), args.blocks,
                           args.device, json.loads(args.shape))
            reference = None if args.skip_local else load_gpu_reference(path, args.device, args.quant_type)
            spans = [f"0:{args.blocks}"]
            result.update(device=torch.cuda.get_device_name() if args.device.startswith("cuda") else args.device,
                          quant_type=args.quant_type, blocks=args.blocks, cuda_graphs=args.cuda_graphs,
                          torch=torch.__version__, shape={**GPU_SHAPE, **json.loads(args.shape)})
        else:
            path = Path(tmp) / TINY
            reference = save_tiny("llama", path, str(prepare_model("smollm2-135m-instruct")))
        args.served = path.name  # what the gateway serves: the checkpoint directory's name

        tokenizer = AutoTokenizer.from_pretrained(path)
        prompt_ids = list(tokenizer.apply_chat_template([{"role": "user", "content": PROMPT}],
                                                        add_generation_prompt=True, tokenize=True,
                                                        return_dict=False))
        top = max(counts)
        server_args = ["--max_sessions_per_peer", str(max(128, 2 * top))]
        if args.model != "tiny":  # every stream's session at once (~600 tokens each: its prompt, max_tokens and
            # the gateway's headroom), past the servers' default KV budget of 16384 tokens from ~27 streams on; each
            # gateway's pool keeps its sessions between waves
            server_args += ["--attn_cache_tokens", str(max(16384, 640 * top * len(modes) * len(heads)))]
        if gpu:
            server_args += ["--device", args.device, "--torch_dtype", "bfloat16", "--quant_type", args.quant_type,
                            "--cuda_graphs" if args.cuda_graphs else "--no-cuda_graphs"]
        with Topology(str(path), spans, f"overhead-{os.getpid()}", server_args, name="bench-overhead",
                      threads=args.threads, ready_timeout=600, log_dir=args.log_dir) as swarm:
            gateways = {}
            for mode in modes:
                for head in heads:
                    extra = ["--max_concurrent", str(max(32, top)), "--max_queue", str(max(64, top)),
                             *(["--no-engine_round"] if mode == "thread" else []),
                             *(["--no-push"] if mode == "relay" else [])]
                    if gpu:  # (a head on the CPU in float32, a CPU gateway's default)
                        extra += ["--device", head, "--torch_dtype", "float32" if head == "cpu" else "bfloat16"]
                    gateways[mode if len(heads) == 1 else f"{mode}@{head}"] = swarm.add_gateway(extra=extra)
            idle: Dict[str, Dict[str, float]] = {}  # mode -> RSS after one stream (what a stream adds is measured)
            for mode, gateway in gateways.items():
                assert gateway.ready is not None
                for count in (1, top):  # warm-up: routes, streams, the head; as many worker threads as streams;
                    # the servers' packs for small batches (module docstring)
                    warm = asyncio.run(wave(gateway.ready["url"], args.served, count,
                                            2 if count == 1 else args.new_tokens))
                    if warm["errors"]:
                        raise RuntimeError(f"a warm-up stream failed: {warm['first_error']}")
                    if count == 1:
                        idle[mode] = rss_now(gateway, swarm.servers)
            for n in counts:
                local = None if args.skip_local else local_rate(reference, prompt_ids, n, args.new_tokens,
                                                                args.local_runs)
                for mode, gateway in gateways.items():
                    row = measure(gateway, swarm.servers, n, args, mode, idle[mode])
                    if local is not None:
                        row["local_tokens_per_s"] = round(local["tokens_per_s"], 1)
                        row["local_runs_tokens_per_s"] = local["runs_tokens_per_s"]
                        row["ratio"] = round(row["gateway_tokens_per_s"] / local["tokens_per_s"], 3)
                    waves.append(row)
                    print(json.dumps(row), file=sys.stderr, flush=True)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
