"""Speculative decoding across the swarm: tokens/s of one greedy session with and without speculation, on prompts
where drafting helps (repeating a paragraph, editing code, a quote) and where it does not (open questions), with
the acceptance rate and whether the output is the same token for token. Prints one JSON object.

Where the swarm comes from is decided in one place (`connect`): by default a private loopback swarm of
`--spans` (bootstrap + servers, one thread each); with `--initial_peers` (and `--dht_prefix`) an existing swarm,
for example one whose links a latency lab delays, so the same measurement runs against wide-area latencies:

    python bench/bench_speculative.py                                  # loopback, 0:15 + 15:30
    python bench/bench_speculative.py --initial_peers /ip4/.../p2p/... --dht_prefix lab-swarm
    python bench/bench_speculative.py --draft_model /path/to/small-llama   # add the draft-model drafter

On loopback a step of k + 1 tokens costs more compute than a 1-token step and a hop costs well under a
millisecond, so speculation can only win there when most drafts are accepted; it is meant for links of tens of ms.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import time
from typing import Any, Dict, Iterator, List, Optional, Tuple

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

PARAGRAPH = ("The lighthouse stood at the end of the rocky point for more than a century. Every night its keeper "
             "climbed the spiral stairs, trimmed the wick and wound the clockwork that turned the great lens, so "
             "that ships far out at sea could find their way past the reef.")
CODE = ("def total_price(items, tax_rate):\n    total = 0\n    for item in items:\n        total += item.price * "
        "item.quantity\n    total = total * (1 + tax_rate)\n    return round(total, 2)\n")
HELPFUL = {
    "repeat_paragraph": f"Repeat this paragraph word for word:\n\n{PARAGRAPH}",
    "edit_code": f"Rename the variable `total` to `amount` in this code and print the whole code:\n\n{CODE}",
    "quote": "Quote the first sentence of this text exactly, then the whole text again:\n\n" + PARAGRAPH,
}
UNHELPFUL = {
    "open_question": "What are three good reasons to learn to play the piano?",
    "story": "Write a short story about a dragon who is afraid of the dark.",
}


@contextlib.contextmanager
def connect(args) -> Iterator[Tuple[Any, str]]:
    """The client model of the swarm under test, and a description of it: an existing swarm (`--initial_peers`,
    `--dht_prefix`) or a private loopback one of `--spans`."""
    from swarm import AutoDistributedModelForCausalLM
    from swarm.modeling.prepare import prepare_model

    if args.initial_peers:
        path = str(prepare_model())
        model = AutoDistributedModelForCausalLM.from_pretrained(
            path, initial_peers=args.initial_peers, **({"dht_prefix": args.dht_prefix} if args.dht_prefix else {}))
        try:
            yield model, f"existing swarm {args.dht_prefix or '(default prefix)'}"
        finally:
            model.shutdown()
        return
    from bench.harness import BenchSwarm

    with BenchSwarm("bench-spec", args.spans) as swarm:
        yield swarm.client_model(), f"loopback, servers {'+'.join(args.spans)}"


def timed(model, ids: torch.Tensor, new_tokens: int, **spec) -> Tuple[torch.Tensor, float]:
    start = time.perf_counter()
    out = model.generate(ids, max_new_tokens=new_tokens, do_sample=False, **spec)
    return out, time.perf_counter() - start


def measure(model, tokenizer, prompts: Dict[str, str], args, drafters: List[Tuple[str, dict]]) -> Dict[str, Any]:
    results: Dict[str, Any] = {}
    for name, text in prompts.items():
        ids = tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                            return_tensors="pt", return_dict=True)["input_ids"]
        # best of --repeats rounds, each running plain then every drafter: the machine may be shared, and the best
        # run is the least disturbed one
        best: Dict[str, float] = {}
        outputs: Dict[str, torch.Tensor] = {}
        stats_of: Dict[str, Any] = {}
        for _ in range(args.repeats):
            for label, spec in [("plain", {}), *drafters]:
                out, seconds = timed(model, ids, args.new_tokens, **spec)
                best[label] = min(seconds, best.get(label, float("inf")))
                outputs.setdefault(label, out)
                if spec:
                    stats_of.setdefault(label, model.last_speculation)
        plain_out, plain_s = outputs["plain"], best["plain"]
        new = plain_out.shape[1] - ids.shape[1]
        row: Dict[str, Any] = {"new_tokens": new, "plain_tokens_per_s": round(new / plain_s, 2)}
        for label, spec in drafters:
            out, seconds, stats = outputs[label], best[label], stats_of[label]
            n = out.shape[1] - ids.shape[1]
            row[label] = {"tokens_per_s": round(n / seconds, 2), "speedup": round((n / seconds) / (new / plain_s), 3),
                          "acceptance": round(stats.acceptance, 3), "drafted": stats.proposed,
                          "accepted": stats.accepted, "steps": stats.steps,
                          "same_output": out.tolist() == plain_out.tolist()}
        results[name] = row
    return results


def main(argv: Optional[List[str]] = None) -> Dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--initial_peers", nargs="*", default=[], help="an existing swarm (default: start one)")
    parser.add_argument("--dht_prefix", default=None, help="the existing swarm's DHT prefix")
    parser.add_argument("--spans", nargs="+", default=["0:15", "15:30"], help="servers of the loopback swarm")
    parser.add_argument("--new_tokens", type=int, default=64)
    parser.add_argument("--num_draft_tokens", type=int, default=6)
    parser.add_argument("--repeats", type=int, default=2, help="runs of each case (the fastest is reported)")
    parser.add_argument("--draft_model", default=None, help="a local small model of the same tokenizer")
    args = parser.parse_args(argv)
    from transformers import AutoTokenizer

    from swarm.modeling.prepare import prepare_model

    torch.set_num_threads(1)
    tokenizer = AutoTokenizer.from_pretrained(str(prepare_model()))
    drafters = [("ngram", {"speculative": "ngram", "num_draft_tokens": args.num_draft_tokens})]
    if args.draft_model:
        drafters.append(("draft_model", {"speculative": "draft_model", "draft_model": args.draft_model,
                                         "num_draft_tokens": args.num_draft_tokens}))
    with connect(args) as (model, where):
        timed(model, torch.tensor([[1, 504, 3458]]), 4)  # warm-up: routes, streams, the head's threads
        report = {"swarm": where, "new_tokens": args.new_tokens, "repeats": args.repeats,
                  "num_draft_tokens": args.num_draft_tokens,
                  "drafters": [label for label, _ in drafters],
                  "helpful": measure(model, tokenizer, HELPFUL, args, drafters),
                  "unhelpful": measure(model, tokenizer, UNHELPFUL, args, drafters)}
    for group in ("helpful", "unhelpful"):
        for label, _ in drafters:
            speedups = [row[label]["speedup"] for row in report[group].values()]
            report[f"{group}_{label}_mean_speedup"] = round(sum(speedups) / len(speedups), 3)
    print(json.dumps(report))
    return report


if __name__ == "__main__":
    main()
