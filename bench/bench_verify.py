"""The cost of spot-checking servers' outputs (`swarm.client.transport.verify`): decode tokens/s with checks at 0%, 5%
and 100% of steps, and how many steps a corrupting server survives.

Starts its own bootstrap peer and two honest servers over all blocks (each can referee the other), generates
`--new` greedy tokens after a short prompt with `verify=False` and with `verify=True` at each check probability
(every new server is also checked once), and prints one JSON object: tokens/s per setting (best of `--runs`),
the slowdown relative to no checks, and the verifier's counters. The probability that a server corrupting every
step escapes p-rate checks for n steps is (1 - p)^n: at 5%, under 1% after 90 steps.

Detection (`--trials`, 0: skipped): a lying server (`tests/fixtures/faulty_server.py`, test-only: honest for each
session's first `LIE_AFTER` steps, so that the first check of a new server passes, then perturbed outputs) joins the
swarm with a throughput that makes routing prefer it; each trial is a fresh client (verify at `--detect_probability`)
decoding greedily until the liar is outvoted, up to `--max_steps` steps after its first lie. Reported: the steps
from the first lie to detection per trial, the share caught within 90 steps, and (1 - (1 - p)^90) for comparison.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from bench.harness import BenchSwarm  # noqa: E402

PROMPT = "Write a short story about a lighthouse keeper who finds a message in a bottle:"


def run(swarm: BenchSwarm, probability, new: int, runs: int) -> dict:
    from transformers import AutoTokenizer

    from swarm import AutoDistributedModelForCausalLM
    from swarm.client.transport.verify import verifier_for

    kwargs = {} if probability is None else dict(verify=True, verify_probability=probability)
    model = AutoDistributedModelForCausalLM.from_pretrained(swarm.path, initial_peers=swarm.initial_peers,
                                                            dht_prefix=swarm.prefix, **kwargs)
    ids = AutoTokenizer.from_pretrained(swarm.path)(PROMPT, return_tensors="pt")["input_ids"]
    try:
        best = 0.0
        for _ in range(runs):
            began = time.perf_counter()
            model.generate(ids, max_new_tokens=new, min_new_tokens=new, do_sample=False)
            best = max(best, new / (time.perf_counter() - began))
        verifier = verifier_for(model.manager)
        return {"tokens_per_s": round(best, 3), "verifier": verifier.stats.as_dict() if verifier else None}
    finally:
        model.shutdown()


LIE_AFTER = 3
GATEWAY_SETTINGS = [("off", []), ("p5_holdback8", ["--verify_rate", "0.05", "--verify_holdback", "8"]),
                    ("p5_holdback32", ["--verify_rate", "0.05", "--verify_holdback", "32"])]


def through_gateway(swarm: BenchSwarm, new: int, runs: int) -> dict:
    """Streamed chat completions (greedy, `new` tokens, EOS ignored) through a gateway per setting: median time to
    the first text and end-to-end tokens/s (text held back for checks arrives later, in bigger chunks)."""
    import statistics

    import openai

    results = {}
    for name, flags in GATEWAY_SETTINGS:
        gateway = swarm.add_gateway(f"bench-verify-gw-{name}", flags)
        try:
            client = openai.OpenAI(base_url=gateway.ready["url"] + "/v1", api_key="unused", max_retries=0)
            served = client.models.list().data[0].id
            samples = []
            for i in range(runs + 1):  # the first one warms routes and caches up
                began, first = time.perf_counter(), None
                for chunk in client.chat.completions.create(
                        model=served, messages=[{"role": "user", "content": PROMPT}], temperature=0, max_tokens=new,
                        stream=True, extra_body={"ignore_eos": True}):
                    if first is None and chunk.choices and chunk.choices[0].delta.content:
                        first = time.perf_counter() - began
                if i:
                    samples.append((first, new / (time.perf_counter() - began)))
            results[name] = {"first_text_s": round(statistics.median(s[0] for s in samples), 3),
                             "tokens_per_s": round(statistics.median(s[1] for s in samples), 3)}
        finally:
            gateway.terminate()
    return results


def detection(swarm: BenchSwarm, probability: float, trials: int, max_steps: int) -> dict:
    """Steps from the liar's first wrong output to its detection, over `trials` fresh clients."""
    from transformers import AutoTokenizer

    from launch.topology import start_server
    from swarm import AutoDistributedModelForCausalLM
    from swarm.client.transport.verify import OutputsRetracted, verifier_for

    liar = start_server(swarm.path, swarm.initial_peers, "0:30", swarm.prefix,
                        ["--throughput", "1000", "--perturb_after_steps", str(LIE_AFTER)], name="bench-liar",
                        threads=1, module="tests.fixtures.faulty_server")
    steps: list = []
    try:
        liar.wait_ready()
        prompt = AutoTokenizer.from_pretrained(swarm.path)(PROMPT, return_tensors="pt")["input_ids"]
        for _ in range(trials):
            model = AutoDistributedModelForCausalLM.from_pretrained(
                swarm.path, initial_peers=swarm.initial_peers, dht_prefix=swarm.prefix, verify=True,
                verify_probability=probability)
            try:
                stats = verifier_for(model.manager).stats
                ids, feeds, caught = prompt, 0, None
                with model.inference_session(max_length=prompt.shape[1] + LIE_AFTER + max_steps + 1) as session:
                    if liar.peer_id not in [h.peer_id for h in model.manager.make_inference_chain(0, None)]:
                        raise RuntimeError("routing does not prefer the liar: raise its --throughput")
                    while caught is None and feeds < LIE_AFTER + max_steps:
                        feeds += 1  # the liar's steps of this session (it lies from step LIE_AFTER + 1 on)
                        try:
                            logits = session.feed(ids)
                        except OutputsRetracted as retracted:
                            ids = ids[:, :max(retracted.position + 1, prompt.shape[1])]
                        else:
                            ids = torch.cat([ids, logits.argmax(-1, keepdim=True)], dim=1)
                        if stats.mismatches:
                            caught = feeds - LIE_AFTER
                steps.append(caught)  # None: not caught within max_steps
            finally:
                model.shutdown()
    finally:
        liar.terminate()
    within = [s for s in steps if s is not None and s <= 90]
    return {"probability": probability, "trials": trials, "steps_to_detection": steps,
            "mean_steps": round(sum(s for s in steps if s is not None) / max(1, len([s for s in steps if s])), 1),
            "caught_within_90": round(len(within) / max(1, trials), 3),
            "expected_within_90": round(1 - (1 - probability) ** 90, 4)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--new", type=int, default=64, help="new tokens per generation")
    parser.add_argument("--runs", type=int, default=2, help="generations per setting (best kept)")
    parser.add_argument("--trials", type=int, default=10, help="detection trials (0: skip)")
    parser.add_argument("--detect_probability", type=float, default=0.05, help="check rate of the detection trials")
    parser.add_argument("--max_steps", type=int, default=120, help="steps after the first lie a trial may run")
    parser.add_argument("--skip_speed", action="store_true", help="only the detection trials")
    parser.add_argument("--gateway", action="store_true", help="also streamed through gateways (off, 5%% with "
                                                               "holdbacks of 8 and 32 tokens)")
    args = parser.parse_args()
    results: dict = {}
    caught, gateway = None, None
    with BenchSwarm("bench-verify", ["0:30", "0:30"]) as swarm:
        for name, probability in [("off", None), ("p0", 0.0), ("p5", 0.05), ("p100", 1.0)]:
            if not args.skip_speed:
                results[name] = run(swarm, probability, args.new, args.runs)
        if args.gateway:
            gateway = through_gateway(swarm, args.new, args.runs)
        if args.trials:
            caught = detection(swarm, args.detect_probability, args.trials, args.max_steps)
    base = results["off"]["tokens_per_s"] if results else None
    for entry in results.values():
        entry["slowdown"] = round(1 - entry["tokens_per_s"] / base, 4) if base else None
    print(json.dumps({"benchmark": "verify", "new_tokens": args.new, "runs": args.runs, "cpus": os.cpu_count(),
                      "note": "two servers over all 30 blocks on one shared machine; p0 = only the first check of "
                              "each new server", "results": results, "gateway": gateway,
                      "detection": caught}))


if __name__ == "__main__":
    main()
