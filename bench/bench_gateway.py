"""Gateway benchmark: streamed tokens/s and time to first token through the gateway vs the direct client.

Starts its own bootstrap peer, two block servers (0:15, 15:30) and a gateway as processes (`launch.topology`
via `bench/harness.py`), then, alternating between the two paths so that background load hits both alike:
- gateway: the official `openai` SDK streams a chat completion (temperature 0, `max_tokens` new tokens, EOS
  ignored so that every run has the same length) of a ~100-token chat-templated prompt;
- direct: the client library in this process feeds the same prompt ids through an inference session and
  picks the argmax at each step (what the gateway does on its side).
Time to first token is measured from the request (gateway) or from opening the session (direct) to the first
token; decode tokens/s over the tokens after the first. Prints one JSON object with the medians.

Usage (from the repository root): .venv/bin/python bench/bench_gateway.py [--runs 3] [--new_tokens 64]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

PROMPT = ("You are reviewing a short report about a community garden. The garden has twelve raised beds, a "
          "compost area, two rain barrels and a small tool shed. Volunteers meet on Saturday mornings. Last year "
          "they grew tomatoes, beans, squash and herbs. Summarise the report in a few sentences and suggest one "
          "improvement for next season.")


def gateway_run(client, model: str, messages, new_tokens: int) -> dict:
    start = time.perf_counter()
    times, usage = [], None
    stream = client.chat.completions.create(model=model, messages=messages, temperature=0, max_tokens=new_tokens,
                                            stream=True, stream_options={"include_usage": True},
                                            extra_body={"ignore_eos": True})
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        if chunk.choices and chunk.choices[0].delta.content:
            times.append(time.perf_counter())
    tokens = usage.completion_tokens if usage else len(times)
    return {"ttft": times[0] - start, "decode_tps": (tokens - 1) / (times[-1] - times[0]),
            "e2e_tps": tokens / (times[-1] - start), "tokens": tokens}


@torch.inference_mode()
def direct_run(model, prompt_ids: torch.Tensor, new_tokens: int) -> dict:
    start = time.perf_counter()
    times = []
    ids = prompt_ids
    with model.inference_session(max_length=ids.shape[1] + new_tokens) as session:
        for _ in range(new_tokens):
            logits = session.feed(ids)
            next_token = logits.argmax(dim=-1)
            times.append(time.perf_counter())
            ids = torch.cat([ids, next_token[:, None]], dim=1)
    return {"ttft": times[0] - start, "decode_tps": (new_tokens - 1) / (times[-1] - times[0]),
            "e2e_tps": new_tokens / (times[-1] - start), "tokens": new_tokens}


def summarize(runs) -> dict:
    return {"ttft_s": round(statistics.median(r["ttft"] for r in runs), 4),
            "decode_tokens_per_s": round(statistics.median(r["decode_tps"] for r in runs), 2),
            "end_to_end_tokens_per_s": round(statistics.median(r["e2e_tps"] for r in runs), 2),
            "tokens_per_run": runs[0]["tokens"]}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--new_tokens", type=int, default=64)
    args = parser.parse_args()

    import openai
    from bench_throughput import peak_rss_mb  # bench/ is on the path when a benchmark runs as a script
    from harness import BenchSwarm
    from transformers import AutoTokenizer

    with BenchSwarm("bench-gw", ["0:15", "15:30"]) as swarm:
        path = swarm.path
        gateway = swarm.start_gateway("bench-gateway")
        url = gateway.ready["url"]
        client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=300)
        served = client.models.list().data[0].id

        torch.set_num_threads(1)
        tokenizer = AutoTokenizer.from_pretrained(path)
        model = swarm.client_model()
        messages = [{"role": "user", "content": PROMPT}]
        prompt_ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt",
                                                   return_dict=True)["input_ids"]

        gateway_run(client, served, messages, 8)  # warm-up: connections, routes, caches
        direct_run(model, prompt_ids, 8)
        via_gateway, direct = [], []
        for _ in range(args.runs):
            via_gateway.append(gateway_run(client, served, messages, args.new_tokens))
            direct.append(direct_run(model, prompt_ids, args.new_tokens))
        g, d = summarize(via_gateway), summarize(direct)
        result = {
            "benchmark": "gateway_streaming",
            "topology": ["0:15", "15:30"],
            "prompt_tokens": int(prompt_ids.shape[1]),
            "new_tokens": args.new_tokens,
            "runs": args.runs,
            "gateway": g,
            "direct_client": d,
            "gateway_decode_speed_vs_direct": round(g["decode_tokens_per_s"] / d["decode_tokens_per_s"], 3),
            "gateway_ttft_overhead_s": round(g["ttft_s"] - d["ttft_s"], 4),
            "cpu_count": os.cpu_count(),
            "gateway_peak_rss_mb": peak_rss_mb(gateway.proc.pid),
        }
        print(json.dumps(result))
        return 0


if __name__ == "__main__":
    sys.exit(main())
