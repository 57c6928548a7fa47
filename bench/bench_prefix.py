"""Shared-prefix benchmark (issue 47): time to first token of users who send the same ~1,000-token system prompt,
and the aggregate tokens/s of 16 such users, with the servers' prefix cache used and not.

Starts its own bootstrap peer and two block servers (0:15, 15:30; prefix cache on, the default; a cache budget with
room for 16 sessions at once beside the pages) and drives them with the client library in this process, one thread
per user (`generate`, greedy, EOS ignored; liveness pings off: on a loaded machine a 1,000-token prefill outlasts
them, and a failover would spoil the timing). A user is a fresh session whose prompt is the system prompt and a
question of its own, as the gateway sends a chat's prompt: "on" declares it (`ModelSession.prefix_salt`, what the
gateway's default `--prefix_sharing per_key` does for one API key), "off" does not (every session computes its whole
prompt, as before issue 47). For each mode, with a system prompt of its own (nothing computed in one mode serves the
other):
1. `first`: one user alone, cold (the servers hold nothing of the prompt);
2. `second`: the next user alone, with its own question after the same system prompt;
3. `later`: users 3..16 at once, the same way: their time to first token (mean and max), and the aggregate generated
   tokens/s of those 14;
4. `together`: 16 users at once with another fresh system prompt (nobody has computed it): aggregate tokens/s, and
   the single-flight measures: the pages the servers computed (once: the later users wait for the pages in flight and
   adopt them; `--prefix_wait 0` turns the waiting off), the time to first token of the user who computed the prompt
   and the mean of those who adopted it, against the cold `first`.
Time to first token is from the call to the first generated token. Prints one JSON object; the goal's measures
(<= 0.3 with the cache on) are `ratio_second_over_first` (one user after another) and `ratio_mean_later_over_first`
(14 at once, each also slowed by the other 13 on the same cores).

Usage (from the repository root): .venv/bin/python bench/bench_prefix.py [--users 16] [--system_tokens 1000]
    [--modes on,off] [--repeats 1] [--prefix_wait SECONDS] [--prefill_batch_tokens N]
With `--repeats R` steps 1-3 run R times, each on a system prompt of its own (the runs' spread on a shared machine is
larger than most changes: compare medians).
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


def system_prompt(tokenizer, target: int, tag: str) -> str:
    rules, i = [], 0
    while len(tokenizer(" ".join(rules))["input_ids"]) < target:
        rules.append(f"Rule {i} ({tag}): answer briefly and politely, and say so when you are unsure about item {i}.")
        i += 1
    return " ".join(rules)


def user_turn(model, ids, salt, new_tokens: int) -> dict:
    """One user: a fresh session over `ids` [1, n] (its prompt declared with `salt`, None: not declared)."""
    from harness import Clock

    clock = Clock()
    start = time.perf_counter()
    with model.inference_session(max_length=ids.shape[1] + new_tokens) as session:
        session.prefix_salt = salt
        model.generate(ids, session=session, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False,
                       streamer=clock)
        adopted = session.adopted_tokens
    end = time.perf_counter()
    return {"ttft": clock.times[1] - start, "seconds": end - start, "adopted": adopted}


def at_once(model, prompts, salt, new_tokens: int):
    """Every prompt at once (one thread each): their results and the wall time of the whole batch."""
    results: list = [None] * len(prompts)

    def run(i: int) -> None:
        try:
            results[i] = user_turn(model, prompts[i], salt, new_tokens)
        except Exception as e:  # noqa: BLE001 - raised below, in the caller's thread
            results[i] = e

    began = time.perf_counter()
    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(prompts))]
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
    parser.add_argument("--modes", default="on,off", help="which of on (prompts declared) and off to run")
    parser.add_argument("--repeats", type=int, default=1,
                        help="first, second and later users this many times, each on a system prompt of its own "
                             "(the single figures are the repetition with the median later/first ratio; `repeats` "
                             "lists each)")
    parser.add_argument("--prefix_wait", type=float, default=None,
                        help="the servers' --prefix_wait (default: theirs; 0: no single-flight waiting)")
    parser.add_argument("--prefill_batch_tokens", type=int, default=None,
                        help="the servers' --prefill_batch_tokens (default: theirs)")
    args = parser.parse_args()

    import torch
    from harness import BenchSwarm  # bench/ is on the path when a benchmark runs as a script
    from transformers import AutoTokenizer

    from swarm import AutoDistributedModelForCausalLM
    from swarm.runtime import aio

    # room for 16 sessions of ~1,050 tokens at once beside the kept pages (the default budget is 16,384)
    server_args = ["--attn_cache_tokens", "32768"]
    if args.prefix_wait is not None:
        server_args += ["--prefix_wait", str(args.prefix_wait)]
    if args.prefill_batch_tokens is not None:
        server_args += ["--prefill_batch_tokens", str(args.prefill_batch_tokens)]
    with BenchSwarm("bench-prefix", SPANS, server_args) as swarm:
        tokenizer = AutoTokenizer.from_pretrained(swarm.path)
        model = AutoDistributedModelForCausalLM.from_pretrained(swarm.path, initial_peers=swarm.initial_peers,
                                                                dht_prefix=swarm.prefix, liveness_interval=None)
        torch.set_num_threads(1)

        def pages() -> dict:
            reports = [aio.run(model.manager.prefix_cache(s.peer_id)) for s in swarm.servers]
            return {"hit": sum(r.pages_hit for r in reports), "computed": sum(r.pages_computed for r in reports)}

        def prompts(system: str) -> list:
            return [torch.tensor([tokenizer.apply_chat_template(
                [{"role": "system", "content": system}, {"role": "user", "content": f"User {i}: what is {i} times "
                                                                                     f"{i + 3}?"}],
                add_generation_prompt=True, return_dict=True)["input_ids"]]) for i in range(args.users)]

        result: dict = {"benchmark": "shared_prefix_ttft", "topology": SPANS, "users": args.users,
                        "new_tokens": args.new_tokens, "prefix_wait": args.prefix_wait,
                        "prefill_batch_tokens": args.prefill_batch_tokens}
        user_turn(model, torch.tensor([tokenizer("Say hi.")["input_ids"]]), None, 2)  # warm-up (not measured)
        try:
            for mode, salt in (("on", "bench-app"), ("off", None)):
                if mode not in args.modes.split(","):
                    continue
                before = pages()
                runs = []  # per repetition: (first, second, later, wall), each on a system prompt of its own
                for r in range(args.repeats):
                    shared = prompts(system_prompt(tokenizer, args.system_tokens, f"{mode} shared {r}"))
                    first = user_turn(model, shared[0], salt, args.new_tokens)
                    second = user_turn(model, shared[1], salt, args.new_tokens)
                    runs.append((first, second, *at_once(model, shared[2:], salt, args.new_tokens)))
                after = pages()
                # the repetition whose later/first ratio is the median one gives the single figures below
                ratios = [statistics.mean(u["ttft"] for u in later) / first["ttft"] for first, _, later, _ in runs]
                first, second, later, wall = runs[sorted(range(len(runs)), key=ratios.__getitem__)[len(runs) // 2]]
                together, together_wall = at_once(
                    model, prompts(system_prompt(tokenizer, args.system_tokens, f"{mode} together")), salt,
                    args.new_tokens)
                together_pages = pages()
                computers = [r["ttft"] for r in together if r["adopted"] == 0]
                adopters = [r["ttft"] for r in together if r["adopted"] > 0]
                ttfts = [r["ttft"] for r in later]
                result[mode] = {
                    "first_ttft_s": round(first["ttft"], 3),
                    "second_ttft_s": round(second["ttft"], 3),
                    "ratio_second_over_first": round(second["ttft"] / first["ttft"], 3),
                    "second_adopted_tokens": second["adopted"],
                    "later_ttft_s_mean": round(statistics.mean(ttfts), 3),
                    "later_ttft_s_max": round(max(ttfts), 3),
                    "later_ttft_s_all": sorted(round(t, 2) for t in ttfts),
                    "ratio_mean_later_over_first": round(statistics.mean(ttfts) / first["ttft"], 3),
                    "later_adopted_tokens_mean": round(statistics.mean(r["adopted"] for r in later), 1),
                    "later_tokens_per_s": round(len(later) * args.new_tokens / wall, 2),
                    "together_tokens_per_s": round(len(together) * args.new_tokens / together_wall, 2),
                    "together_ttft_s_mean": round(statistics.mean(r["ttft"] for r in together), 3),
                    "together_computers": len(computers),  # users who adopted nothing
                    "together_computer_ttft_s_mean": round(statistics.mean(computers), 3) if computers else None,
                    "together_adopters_ttft_s_mean": round(statistics.mean(adopters), 3) if adopters else None,
                    "ratio_together_adopters_over_first":
                        round(statistics.mean(adopters) / first["ttft"], 3) if adopters else None,
                    "together_pages_computed": together_pages["computed"] - after["computed"],
                    "together_pages_hit": together_pages["hit"] - after["hit"],
                    "repeats": [{"first_ttft_s": round(f["ttft"], 3), "second_ttft_s": round(sec["ttft"], 3),
                                 "later_ttft_s_mean": round(statistics.mean(u["ttft"] for u in lat), 3),
                                 "later_ttft_s_max": round(max(u["ttft"] for u in lat), 3),
                                 "ratio_mean_later_over_first": round(ratio, 3)}
                                for (f, sec, lat, _), ratio in zip(runs, ratios)],
                    "pages_hit": after["hit"] - before["hit"],
                    "pages_computed": after["computed"] - before["computed"],
                }
                print(json.dumps({mode: result[mode]}), file=sys.stderr, flush=True)
            result["prompt_tokens"] = int(shared[0].shape[1])
            result["cpu_count"] = os.cpu_count()
        finally:
            model.shutdown()
        print(json.dumps(result))
        return 0


if __name__ == "__main__":
    sys.exit(main())
