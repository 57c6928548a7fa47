"""The gateway under load (issue 17): concurrent streaming chat completions against the local transformers limit.

Starts a bootstrap peer, two block servers (0:15, 15:30, float32, every core each, as `swarmgate up` runs them:
the processes take CPU turns, so each pass has all cores, as local transformers has; `--one_thread`: one intra-op
thread per process, as the benchmark ran before, which leaves a core idle) and two real gateway processes
(`bench/harness.py`): the measured one (admission limits above the largest wave) and a small one
(`--max_concurrent 2 --max_queue 2`) for overload. An asyncio client (`bench/load_client.py`, httpx reading SSE)
drives them over HTTP. Every request's prompt is distinct (a running number), so no pooled session helps.

Measures, in one run:
- local limit: transformers greedy `generate` (float32, KV cache, same chat prompts left-padded, `--tokens` new
  tokens) for a batch of 1, 8, 16, in a process of its own (all cores): tokens/s over the whole call
  (prefill included, like the gateway's figure) and over decoding only;
- waves of N concurrent streaming /v1/chat/completions (temperature 1, distinct seeds, `ignore_eos`,
  `stream_options.include_usage`): aggregate completion tokens/s (usage) over the wave's wall time, TTFT and
  inter-chunk latency p50/p95/p99, the ratio to local batch-N, CPU seconds per token of the gateway process
  (and its DHT children) and of the two servers (psutil), gateway RSS;
- continuous batching: a 9th request (short prompt, and a ~500-token one) arriving while 8 stream: its TTFT
  against its idle TTFT, and the 8 others' inter-chunk gaps overlapping its prefill against those before;
- early finishers: 4 long streams with 4 that stop early (max_tokens, a stop string, EOS): the long ones'
  aggregate rate while the short ones run and after they finished;
- a py-spy profile of the gateway during a wave of 8 (top functions by share of busy samples);
- overload: 12 requests at once on the small gateway: 200s, 429s (Retry-After), their latency, hangs.
The swarm's processes take CPU turns (swarm/runtime/cpu_turns.py) with each other only: their TMPDIR holds a
lock of their own (`--shared_cpu_turns`: the machine-wide one). Prints one JSON object (with a `markdown`
section that run_all writes) and replaces the bench_load section of docs/benchmarks.md.

Usage: python bench/bench_load.py [--concurrency 1,4,8,16,32] [--tokens 64] [--quick] [--no_profile]
"""
from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import httpx  # noqa: E402
import psutil  # noqa: E402
from harness import Clock, cpu_seconds  # noqa: E402
from load_client import Stream, chunks_in, gaps_in, percentiles, stream_chat, wait_for, wave_stats  # noqa: E402
from load_report import markdown, profile_summary, write_section  # noqa: E402

TOPICS = ["a lighthouse", "a lost key", "the first snow", "a robot gardener", "a night train", "an old map",
          "a quiet library", "a stubborn goat", "a paper boat", "a desert well", "a jazz drummer", "a broken clock",
          "a fox and a crow", "a city bridge", "a beekeeper", "a sailing race", "a mountain hut", "a kite festival",
          "a tea merchant", "a chess prodigy", "a glass blower", "a rainy market", "a comet", "a forgotten song",
          "a baker at dawn", "a river ferry", "a tiny dragon", "a school play", "a moon base", "a letter at sea",
          "an orchard", "a winter fair", "a marathon", "a street painter", "a museum guard", "a hidden garden"]
LONG_TEXT = ("The committee met on Tuesday to review the harbour renovation. The engineers reported that the "
             "northern wall needs new foundations, that two cranes must be replaced, and that the fish market "
             "will move to the eastern quay during the works. Residents asked about noise, traffic and the "
             "ferry timetable. ")
_uid = itertools.count(1)


def chat(topic: int) -> list:
    return [{"role": "user", "content": f"({next(_uid)}) Write a short story about {TOPICS[topic % len(TOPICS)]}."}]


def body(model: str, i: int, tokens: int, **extra) -> dict:
    return {"model": model, "messages": chat(i), "max_tokens": tokens, "temperature": 1.0, "seed": 1000 + i,
            "stream_options": {"include_usage": True}, "ignore_eos": True, **extra}


# ---- the local limit (in a process of its own) --------------------------------------------------------------------
def local_limit(batches, tokens: int) -> dict:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from swarm.modeling.prepare import prepare_model

    path = str(prepare_model())
    tok = AutoTokenizer.from_pretrained(path, padding_side="left")
    tok.pad_token = tok.pad_token or tok.eos_token
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    out = {"threads": torch.get_num_threads()}
    with torch.inference_mode():
        for n in batches:
            texts = [tok.apply_chat_template(chat(i), add_generation_prompt=True, tokenize=False) for i in range(n)]
            enc = tok(texts, padding=True, return_tensors="pt", add_special_tokens=False)
            model.generate(**enc, max_new_tokens=2, do_sample=False)  # warm-up
            best = {"e2e": 0.0, "decode": 0.0}
            for _ in range(2):
                clock = Clock()
                start = time.perf_counter()
                model.generate(**enc, max_new_tokens=tokens, min_new_tokens=tokens, do_sample=False,
                               streamer=clock, pad_token_id=tok.pad_token_id)
                end = time.perf_counter()
                best["e2e"] = max(best["e2e"], n * tokens / (end - start))
                best["decode"] = max(best["decode"], n * (tokens - 1) / (clock.times[-1] - clock.times[1]))
            out[str(n)] = {k: round(v, 2) for k, v in best.items()}
    return out


# ---- processes: CPU and memory --------------------------------------------------------------------------------------
class Monitor:
    """CPU time snapshots of the gateway (process, process with children) and servers; the gateway's RSS sampled
    every 0.2 s (peak since the last `reset`)."""

    def __init__(self, gateway_pid: int, server_pids):
        self.gateway, self.servers = gateway_pid, list(server_pids)
        self.rss_peak = 0
        self._task = None

    def snapshot(self) -> dict:
        return {"gateway": cpu_seconds(self.gateway), "gateway_tree": cpu_seconds(self.gateway, tree=True),
                "servers": sum(cpu_seconds(p, tree=True) for p in self.servers)}

    @staticmethod
    def per_token(before: dict, after: dict, tokens: int) -> dict:
        return {f"{k}_cpu_ms_per_token": round(1000 * (after[k] - before[k]) / max(tokens, 1), 2) for k in before}

    def rss_mb(self) -> float:
        return round(psutil.Process(self.gateway).memory_info().rss / 2**20, 1)

    def reset(self) -> None:
        self.rss_peak = 0

    async def sample(self) -> None:
        while True:
            self.rss_peak = max(self.rss_peak, psutil.Process(self.gateway).memory_info().rss)
            await asyncio.sleep(0.2)


# ---- scenarios ------------------------------------------------------------------------------------------------------
async def wave(http, url, model, n, tokens, monitor: Monitor) -> dict:
    before = monitor.snapshot()
    monitor.reset()
    streams = await asyncio.gather(*(stream_chat(http, url, body(model, i, tokens)) for i in range(n)))
    stats = wave_stats(streams)
    stats.update(monitor.per_token(before, monitor.snapshot(), stats["completion_tokens"]))
    stats["gateway_rss_peak_mb"] = round(monitor.rss_peak / 2**20, 1)
    return stats


async def join(http, url, model, tokens: int, probe_messages) -> dict:
    """Idle TTFT of a probe (median of 3), then the probe's TTFT while 8 streams run and their gaps around it."""
    def probe_body(k):
        messages = probe_messages()
        return {"model": model, "messages": messages, "max_tokens": 4, "temperature": 1.0, "seed": k,
                "ignore_eos": True}

    idle = [(await stream_chat(http, url, probe_body(k))).ttft for k in range(3)]
    background = [Stream(sent=0.0) for _ in range(8)]
    tasks = [asyncio.create_task(stream_chat(http, url, body(model, i, 2 * tokens), background[i]))
             for i in range(8)]
    await wait_for(lambda: all(len(s.times) >= 4 for s in background))
    steady = time.perf_counter()
    await wait_for(lambda: all(len(s.times) >= 16 for s in background))
    probe = await stream_chat(http, url, probe_body(9))
    await asyncio.gather(*tasks)
    start, first = probe.sent, probe.times[0]
    before, during = gaps_in(background, steady, start), gaps_in(background, start, first)
    idle_ttft = statistics.median(idle)
    return {"idle_ttft_ms": round(1000 * idle_ttft, 1), "ttft_amid_8_ms": round(1000 * probe.ttft, 1),
            "ttft_ratio": round(probe.ttft / idle_ttft, 2),
            "others_itl_before_ms": round(1000 * statistics.mean(before), 1),
            "others_itl_during_prefill_ms": round(1000 * statistics.mean(during), 1) if during else None,
            "others_itl_max_during_prefill_ms": round(1000 * max(during), 1) if during else None,
            "itl_ratio": round(statistics.mean(during) / statistics.mean(before), 2) if during else None}


async def early_finishers(http, url, model, tokens: int) -> dict:
    """4 long streams (2x tokens) with 4 that end early: their aggregate rate while the short ones run vs after."""
    longs = [body(model, i, 2 * tokens) for i in range(4)]
    shorts = [body(model, 4, 8), body(model, 5, 16),
              body(model, 6, tokens, stop=["."]),
              {"model": model, "max_tokens": tokens, "temperature": 0.0, "stream_options": {"include_usage": True},
               "messages": [{"role": "user", "content": f"({next(_uid)}) Answer with one word: what colour is the "
                                                        f"sky on a clear day?"}]}]
    streams = await asyncio.gather(*(stream_chat(http, url, b) for b in longs + shorts))
    long_s, short_s = streams[:4], streams[4:]
    started = max(s.times[0] for s in long_s)  # every long stream is decoding
    shorts_done = max(s.ended for s in short_s)
    first_long_end = min(s.times[-1] for s in long_s)
    during_s, after_s = shorts_done - started, first_long_end - shorts_done
    during = chunks_in(long_s, started, shorts_done) / during_s if during_s > 0.3 else None
    after = chunks_in(long_s, shorts_done, first_long_end) / after_s if after_s > 0.3 else None
    return {"short_finishes": [f"{s.finish_reason}@{s.completion_tokens}" for s in short_s],
            "long_rate_while_short_run": round(during, 2) if during else None,
            "long_rate_after_short_done": round(after, 2) if after else None,
            "rate_ratio_after_vs_during": round(after / during, 2) if during and after else None}


async def profiled_wave(http, url, model, tokens, gateway_pid: int, out_dir: Path) -> dict:
    """A wave of 8 with py-spy sampling the gateway process (raw collapsed stacks, busy samples only)."""
    spy = shutil.which("py-spy") or str(Path(sys.executable).parent / "py-spy")
    if not Path(spy).exists():
        return {"error": "py-spy not installed (pip install py-spy)"}
    raw = out_dir / "gateway-profile.txt"
    proc = subprocess.Popen([spy, "record", "--pid", str(gateway_pid), "--rate", "100", "--nonblocking",
                             "--format", "raw", "--output", str(raw)], stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True)
    await asyncio.sleep(1.5)  # attached
    start = time.perf_counter()
    streams = await asyncio.gather(*(stream_chat(http, url, body(model, i, tokens)) for i in range(8)))
    wall = time.perf_counter() - start
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=60)
    if not raw.exists():
        return {"error": f"py-spy wrote nothing: {err[-300:]}"}
    summary = profile_summary(raw.read_text(), wall + 1.5, rate=100)
    summary["tokens"] = sum(s.completion_tokens for s in streams)
    return summary


async def overload(http, url, model, tokens: int, requests: int = 12) -> dict:
    """`requests` streams at once on the small gateway: 200s (complete), 429s (Retry-After, latency), hangs."""
    async def one(i):
        try:
            return await asyncio.wait_for(stream_chat(http, url, body(model, i, tokens)), 300)
        except asyncio.TimeoutError:
            return None

    streams = await asyncio.gather(*(one(i) for i in range(requests)))
    done = [s for s in streams if s is not None]
    limited = [s for s in done if s.status == 429]
    ok = [s for s in done if s.status == 200 and s.error is None]
    return {"requests": requests, "ok": len(ok), "ok_complete": sum(s.completion_tokens == tokens for s in ok),
            "http_429": len(limited), "with_retry_after": sum("retry-after" in s.headers for s in limited),
            "other": len(done) - len(ok) - len(limited), "hung": requests - len(done),
            "latency_429_ms": percentiles([s.ended - s.sent for s in limited])}


async def drive(args, gateway, small, servers, local: dict, out_dir: Path) -> dict:
    url, small_url = gateway.ready["url"], small.ready["url"]
    monitor = Monitor(gateway.proc.pid, [s.proc.pid for s in servers])
    result: dict = {"gateway_rss_at_start_mb": monitor.rss_mb()}
    limits = httpx.Limits(max_connections=256, max_keepalive_connections=256)
    async with httpx.AsyncClient(timeout=httpx.Timeout(600, connect=30), limits=limits) as http:
        model = (await http.get(url + "/v1/models")).json()["data"][0]["id"]
        sampler = asyncio.create_task(monitor.sample())
        await asyncio.gather(*(stream_chat(http, url, body(model, i, 8)) for i in range(2)))  # warm-up
        result["gateway_rss_after_warmup_mb"] = monitor.rss_mb()
        waves = {}
        for n in args.concurrency:
            stats = await wave(http, url, model, n, args.tokens, monitor)
            if str(n) in local:
                stats["local_e2e_tokens_per_s"] = local[str(n)]["e2e"]
                stats["ratio_to_local_e2e"] = round(stats["tokens_per_s"] / local[str(n)]["e2e"], 2)
                stats["ratio_to_local_decode"] = round(stats["tokens_per_s"] / local[str(n)]["decode"], 2)
            waves[str(n)] = stats
            print(f"wave {n}: {json.dumps(stats)}", file=sys.stderr, flush=True)
        result["waves"] = waves
        result["join_short_prompt"] = await join(http, url, model, args.tokens, lambda: chat(0))
        long_words = LONG_TEXT * args.long_repeats
        result["join_long_prompt"] = await join(
            http, url, model, args.tokens,
            lambda: [{"role": "user", "content": f"({next(_uid)}) {long_words} Summarise the meeting."}])
        result["long_prompt_tokens"] = args.long_prompt_tokens
        print(f"join: {result['join_short_prompt']} {result['join_long_prompt']}", file=sys.stderr, flush=True)
        result["early_finishers"] = await early_finishers(http, url, model, args.tokens)
        if not args.no_profile:
            result["profile_8_streams"] = await profiled_wave(http, url, model, args.tokens, gateway.proc.pid,
                                                              out_dir)
        sampler.cancel()
        result["gateway_rss_peak_mb"] = max(round(monitor.rss_peak / 2**20, 1),
                                            max(w["gateway_rss_peak_mb"] for w in waves.values()))
        result["overload"] = await overload(http, small_url, model, args.tokens)
        result["overload"]["gateway_up_after"] = (await http.get(small_url + "/health")).status_code == 200
    return result


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--concurrency", default="1,4,8,16,32", help="wave sizes, comma-separated")
    parser.add_argument("--tokens", type=int, default=64, help="completion tokens per request")
    parser.add_argument("--local_batches", default="1,8,16", help="batch sizes of the local transformers limit")
    parser.add_argument("--quick", action="store_true", help="waves of 1 and 8, 32 tokens, no profile")
    parser.add_argument("--no_profile", action="store_true", help="skip the py-spy profile")
    parser.add_argument("--shared_cpu_turns", action="store_true",
                        help="let the swarm take CPU turns (swarm/runtime/cpu_turns.py) with every other swarmgate "
                             "process of this user on the machine (default: a lock of its own, so that other "
                             "swarms' work does not block it while the local baseline runs free)")
    parser.add_argument("--no_write", action="store_true", help="do not write docs/benchmarks.md")
    parser.add_argument("--one_thread", action="store_true",
                        help="one intra-op thread per swarm process (default: all cores, taking CPU turns)")
    parser.add_argument("--local_only", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.quick:
        args.concurrency, args.tokens, args.local_batches, args.no_profile = "1,8", 32, "1,8", True
    args.concurrency = [int(x) for x in args.concurrency.split(",")]
    batches = [int(x) for x in args.local_batches.split(",")]
    if args.local_only:
        print(json.dumps(local_limit(batches, args.tokens)))
        return 0

    from harness import BenchSwarm
    from transformers import AutoTokenizer

    # the local limit first, in its own process (its OpenMP team must not share the process with the client)
    out = subprocess.run([sys.executable, __file__, "--local_only", "--local_batches", args.local_batches,
                          "--tokens", str(args.tokens)], capture_output=True, text=True, check=True)
    local = json.loads(out.stdout.strip().splitlines()[-1])
    print(f"local: {local}", file=sys.stderr, flush=True)
    out_dir = Path(os.environ.get("BENCH_OUT", "/tmp")) / f"bench-load-{os.getpid()}"
    out_dir.mkdir(parents=True, exist_ok=True)
    if not args.shared_cpu_turns:  # the swarm's processes take CPU turns among themselves only (a lock of their own)
        (out_dir / "tmp").mkdir(exist_ok=True)
        os.environ["TMPDIR"] = str(out_dir / "tmp")
    biggest = max(args.concurrency)
    with BenchSwarm("bench-load", ["0:15", "15:30"], server_args=["--attn_cache_tokens", "40000"],
                    threads=1 if args.one_thread else None) as swarm:
        tok = AutoTokenizer.from_pretrained(swarm.path)
        args.long_repeats = max(1, round(500 / len(tok(LONG_TEXT)["input_ids"])))
        args.long_prompt_tokens = len(tok(LONG_TEXT * args.long_repeats)["input_ids"])
        gateway = swarm.add_gateway("bench-load-gateway", ["--max_concurrent", str(max(biggest, 9) + 4),
                                                           "--max_queue", "64"], wait=False)
        small = swarm.add_gateway("bench-load-small", ["--max_concurrent", "2", "--max_queue", "2",
                                                       "--retry_after", "1"], wait=False)
        gateway.wait_ready(swarm.ready_timeout)
        small.wait_ready(swarm.ready_timeout)
        result = {"benchmark": "gateway_load", "topology": ["0:15", "15:30"], "tokens": args.tokens,
                  "cpu_count": os.cpu_count(), "load_average_at_start": [round(x, 2) for x in os.getloadavg()],
                  "local_transformers": local}
        result.update(asyncio.run(drive(args, gateway, small, swarm.servers, local, out_dir)))
        result["load_average_at_end"] = [round(x, 2) for x in os.getloadavg()]
    result["markdown"] = markdown(result)
    if not args.no_write:
        write_section(Path(__file__).resolve().parents[1] / "docs" / "benchmarks.md", "bench_load",
                      result["markdown"])
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
