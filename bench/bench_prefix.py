"""Shared-prefix benchmark (issue 47): time to first token of users who send the same ~1,000-token system prompt,
and the aggregate tokens/s of 16 such users, with the servers' prefix cache used and not.

Starts its own bootstrap peer, two block servers (0:15, 15:30; prefix cache on, the default) and two gateways, both
without the conversation pool (`--no-session_pool`: a pooled session of an earlier user would otherwise be rewound to
the shared prompt, which is the pool's business, not this one's): one with `--prefix_sharing per_key` (the default;
every user here sends one API key) and one with `--prefix_sharing off` (prompts not declared: every session computes
its whole prompt, as before issue 47). For each mode, with a system prompt of its own (so that nothing computed in
one mode serves the other):
1. `first`: one user alone, cold (the servers hold nothing of the prompt);
2. `later`: users 2..16 at once, each with its own question after the same system prompt: their time to first
   token, and the aggregate generated tokens/s of those 15;
3. `together`: 16 users at once with another fresh system prompt (nobody cached it): aggregate tokens/s.
Each user generates `--new_tokens` tokens (EOS ignored), streamed; time to first token is from the request to the
first content chunk. Prints one JSON object; `ratio_mean_later_over_first` is the goal's measure (<= 0.3).

Usage (from the repository root): .venv/bin/python bench/bench_prefix.py [--users 16] [--system_tokens 1000]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

SPANS = ["0:15", "15:30"]
KEY = "bench-prefix-app"


def system_prompt(tokenizer, target: int, tag: str) -> str:
    rules, i = [], 0
    while len(tokenizer(" ".join(rules))["input_ids"]) < target:
        rules.append(f"Rule {i} ({tag}): answer briefly and politely, and say so when you are unsure about item {i}.")
        i += 1
    return " ".join(rules)


def user_turn(client, served: str, system: str, question: str, new_tokens: int) -> dict:
    start = time.perf_counter()
    first, chunks = None, 0
    for chunk in client.chat.completions.create(
            model=served, messages=[{"role": "system", "content": system}, {"role": "user", "content": question}],
            temperature=0, max_tokens=new_tokens, stream=True, extra_body={"ignore_eos": True}):
        if chunk.choices and chunk.choices[0].delta.content:
            chunks += 1
            if first is None:
                first = time.perf_counter()
    end = time.perf_counter()
    return {"ttft": (first or end) - start, "seconds": end - start}


def at_once(client, served: str, system: str, questions, new_tokens: int):
    """Every question at once (one thread each): their results and the wall time of the whole batch."""
    results: list = [None] * len(questions)

    def run(i: int) -> None:
        try:
            results[i] = user_turn(client, served, system, questions[i], new_tokens)
        except Exception as e:  # noqa: BLE001 - raised below, in the caller's thread
            results[i] = e

    began = time.perf_counter()
    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(questions))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    failed = [r for r in results if isinstance(r, BaseException)]
    if failed:
        raise RuntimeError(f"{len(failed)} of {len(results)} users failed: {failed[0]}") from failed[0]
    return results, time.perf_counter() - began


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--users", type=int, default=16)
    parser.add_argument("--system_tokens", type=int, default=1000)
    parser.add_argument("--new_tokens", type=int, default=16)
    args = parser.parse_args()

    import openai
    from harness import BenchSwarm  # bench/ is on the path when a benchmark runs as a script
    from transformers import AutoTokenizer

    # room for 16 sessions of ~1,050 tokens at once beside the kept pages (the default budget is 16,384)
    with BenchSwarm("bench-prefix", SPANS, ["--attn_cache_tokens", "32768"]) as swarm:
        tokenizer = AutoTokenizer.from_pretrained(swarm.path)
        gateways = {
            "on": swarm.add_gateway("bench-prefix-on", ["--no-session_pool"]).ready["url"],
            "off": swarm.add_gateway("bench-prefix-off", ["--no-session_pool", "--prefix_sharing", "off"]).ready["url"],
        }
        model = swarm.client_model()
        from swarm.runtime import aio

        def pages() -> dict:
            reports = [aio.run(model.manager.prefix_cache(s.peer_id)) for s in swarm.servers]
            return {"hit": sum(r.pages_hit for r in reports), "computed": sum(r.pages_computed for r in reports)}

        result: dict = {"benchmark": "shared_prefix_ttft", "topology": SPANS, "users": args.users,
                        "new_tokens": args.new_tokens}
        for mode, url in gateways.items():
            client = openai.OpenAI(base_url=url + "/v1", api_key=KEY, max_retries=0, timeout=600)
            served = client.models.list().data[0].id
            user_turn(client, served, "You are brief.", "Say hi.", 2)  # warm-up (not measured)
            system = system_prompt(tokenizer, args.system_tokens, f"{mode} shared")
            questions = [f"User {i} asks: what is {i} times {i + 3}?" for i in range(args.users)]
            before = pages()
            first = user_turn(client, served, system, questions[0], args.new_tokens)
            later, wall = at_once(client, served, system, questions[1:], args.new_tokens)
            after = pages()
            fresh = system_prompt(tokenizer, args.system_tokens, f"{mode} together")
            together, together_wall = at_once(client, served, fresh, questions, args.new_tokens)
            ttfts = [r["ttft"] for r in later]
            result[mode] = {
                "first_ttft_s": round(first["ttft"], 3),
                "later_ttft_s_mean": round(statistics.mean(ttfts), 3),
                "later_ttft_s_max": round(max(ttfts), 3),
                "ratio_mean_later_over_first": round(statistics.mean(ttfts) / first["ttft"], 3),
                "later_tokens_per_s": round(len(later) * args.new_tokens / wall, 2),
                "together_tokens_per_s": round(len(together) * args.new_tokens / together_wall, 2),
                "together_ttft_s_mean": round(statistics.mean(r["ttft"] for r in together), 3),
                "pages_hit": after["hit"] - before["hit"], "pages_computed": after["computed"] - before["computed"],
            }
        result["system_prompt_tokens"] = len(tokenizer(system)["input_ids"])
        result["cpu_count"] = os.cpu_count()
        print(json.dumps(result))
        return 0


if __name__ == "__main__":
    sys.exit(main())
