"""Session pool benchmark: time to first token of a chat turn with ~1000 tokens of history, pooled vs cold.

Starts its own bootstrap peer, two block servers (0:15, 15:30) and a gateway (session pool on, default
settings) as processes (`launch.topology` via `bench/harness.py`). Each run:
1. builds a conversation of about `--history_tokens` tokens (a system prompt and canned exchanges, different
   in every run so that nothing is shared between runs) and sends it once under a fresh API key, so that the
   gateway pools its session (not measured);
2. pooled: the next turn (the generated answer plus a new question) under the same key: the servers already
   hold the history, only the new tokens are sent;
3. cold: the very same messages under another fresh key (pool namespaces are per key): the whole prompt is
   sent, as it would be without the pool.
Pooled and cold alternate which goes first, so that background load hits both alike. Time to first token is
measured from the request to the first streamed content chunk (the turn generates `--new_tokens` tokens with
EOS ignored). The servers' `inference_tokens_processed` counters give the tokens each turn really sent.
Prints one JSON object with the medians.

Usage (from the repository root): .venv/bin/python bench/bench_pool.py [--runs 5] [--history_tokens 1050]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


SPANS = ["0:15", "15:30"]
TOPICS = ["tides", "bread", "volcanoes", "chess", "bees", "glaciers", "lighthouses", "comets", "maple trees",
          "coral reefs", "windmills", "owls", "deserts", "printing presses", "submarines", "violins"]


def exchange(topic: str, run: int) -> list:
    question = f"(run {run}) Please tell me a few things about {topic}, in plain words."
    answer = (f"Here are a few things about {topic}. People have studied {topic} for a long time, and there is "
              f"always more to learn. Many books describe how {topic} changed over the centuries, why they matter "
              f"to the people who live near them, and what scientists still do not understand about them. If you "
              f"want to learn more about {topic}, a good library or a local museum is a fine place to start.")
    return [{"role": "user", "content": question}, {"role": "assistant", "content": answer}]


def history(tokenizer, target: int, run: int) -> list:
    """A system prompt and exchanges until the chat-templated prompt reaches about `target` tokens."""
    messages = [{"role": "system", "content": f"You are a patient tutor (session {run})."}]
    for i in range(len(TOPICS) * 4):
        candidate = messages + exchange(TOPICS[(i + run) % len(TOPICS)], run)
        if count(tokenizer, candidate + [{"role": "user", "content": "x"}]) > target:
            break
        messages = candidate
    return messages + [{"role": "user", "content": "Which of these would you visit first, and why?"}]


def count(tokenizer, messages) -> int:
    return len(tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_dict=True)["input_ids"])


def processed(model, peers) -> int:
    return sum(model.manager.server_info(p).inference_tokens_processed for p in peers)


def turn(client, served: str, messages, new_tokens: int) -> dict:
    start = time.perf_counter()
    first, usage = None, None
    for chunk in client.chat.completions.create(model=served, messages=messages, temperature=0, max_tokens=new_tokens,
                                                stream=True, stream_options={"include_usage": True},
                                                extra_body={"ignore_eos": True}):
        if chunk.usage is not None:
            usage = chunk.usage
        if first is None and chunk.choices and chunk.choices[0].delta.content:
            first = time.perf_counter()
    return {"ttft": first - start, "prompt_tokens": usage.prompt_tokens,
            "cached_tokens": usage.prompt_tokens_details.cached_tokens}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--history_tokens", type=int, default=1050)
    parser.add_argument("--new_tokens", type=int, default=8)
    args = parser.parse_args()

    import openai
    import torch
    from harness import BenchSwarm  # bench/ is on the path when a benchmark runs as a script
    from transformers import AutoTokenizer

    with BenchSwarm("bench-pool", SPANS) as swarm:
        path = swarm.path
        url = swarm.start_gateway("bench-pool-gateway").ready["url"]
        servers = swarm.servers
        peers = [s.peer_id for s in servers]

        torch.set_num_threads(1)
        tokenizer = AutoTokenizer.from_pretrained(path)
        model = swarm.client_model()

        def client(key: str):
            return openai.OpenAI(base_url=url + "/v1", api_key=key, max_retries=0, timeout=300)

        served = client("warm-up").models.list().data[0].id
        warm = history(tokenizer, 200, -1)
        client("warm-up").chat.completions.create(model=served, messages=warm, max_tokens=4, temperature=0)

        pooled, cold = [], []
        for run in range(args.runs):
            key = f"bench-conversation-{run}"
            messages = history(tokenizer, args.history_tokens, run)
            first = client(key).chat.completions.create(model=served, messages=messages, temperature=0,
                                                        max_tokens=args.new_tokens)
            messages = messages + [{"role": "assistant", "content": first.choices[0].message.content},
                                   {"role": "user", "content": "Thank you. What would you bring along?"}]
            order = [("pooled", key), ("cold", f"bench-cold-{run}")]
            if run % 2:
                order.reverse()
            for kind, turn_key in order:
                before = processed(model, peers)
                result = turn(client(turn_key), served, messages, args.new_tokens)
                result["server_tokens"] = processed(model, peers) - before
                (pooled if kind == "pooled" else cold).append(result)

        def summary(results) -> dict:
            return {"ttft_s_median": round(statistics.median(r["ttft"] for r in results), 4),
                    "ttft_s_all": [round(r["ttft"], 4) for r in results],
                    "cached_tokens_median": statistics.median(r["cached_tokens"] for r in results),
                    "server_tokens_per_turn_median": statistics.median(r["server_tokens"] for r in results)}

        p, c = summary(pooled), summary(cold)
        result = {
            "benchmark": "session_pool_ttft",
            "topology": SPANS,
            "prompt_tokens_median": statistics.median(r["prompt_tokens"] for r in pooled),
            "new_tokens": args.new_tokens,
            "runs": args.runs,
            "pooled": p,
            "cold": c,
            "ttft_speedup_cold_over_pooled": round(c["ttft_s_median"] / p["ttft_s_median"], 2),
            "note": "server_tokens: tokens received by both servers together (prefill + decode steps)",
            "cpu_count": os.cpu_count(),
        }
        print(json.dumps(result))
        return 0


if __name__ == "__main__":
    sys.exit(main())
