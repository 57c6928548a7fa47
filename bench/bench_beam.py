"""Beam search through the swarm: the cost of a step whose servers reorder their cache rows in place (the beams'
parent ids in the step message), next to a greedy step of a batch of as many rows (no reorder) and to what a
client without the reorder would pay, re-sending every row's whole sequence (a prefill from 0) each step. Starts
its own bootstrap peer and two servers ("0:15", "15:30") on loopback; prints one JSON object.
"""
from __future__ import annotations

import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from bench.harness import BenchSwarm  # noqa: E402

PROMPT = torch.tensor([[1, 504, 3458, 314, 4086, 28, 260, 1345, 2024, 30, 1530, 260, 1029]])
BEAMS, NEW = 4, 24


def timed_feeds(model, run) -> list:
    """Seconds of each `ModelSession.feed` / `feed_and_pick` made while `run()` goes (the first is the prefill)."""
    from swarm.client.model.causal_lm import ModelSession

    times: list = []
    original = ModelSession._feed

    def timed(self, *args, **kwargs):
        began = time.perf_counter()
        try:
            return original(self, *args, **kwargs)
        finally:
            times.append(time.perf_counter() - began)

    ModelSession._feed = timed  # type: ignore[method-assign]
    try:
        run()
    finally:
        ModelSession._feed = original  # type: ignore[method-assign]
    return times


def main() -> None:
    with BenchSwarm("bench-beam", ["0:15", "15:30"]) as swarm:
        model = swarm.client_model()
        model.generate(PROMPT, max_new_tokens=4, num_beams=BEAMS)  # warm-up
        rows = PROMPT.repeat(BEAMS, 1)
        beam = timed_feeds(model, lambda: model.generate(PROMPT, max_new_tokens=NEW, num_beams=BEAMS,
                                                         early_stopping="never", length_penalty=0.0))
        greedy = timed_feeds(model, lambda: model.generate(rows, max_new_tokens=NEW, min_new_tokens=NEW,
                                                           do_sample=False))
        # without an in-place reorder: each step prefills every row's whole sequence again (new first tokens
        # each time, so the session rewinds to 0)
        length = PROMPT.shape[1] + NEW // 2
        refill = []
        with model.inference_session(max_length=length) as session:
            for _ in range(6):
                ids = torch.randint(0, model.config.vocab_size, (BEAMS, length))
                began = time.perf_counter()
                session.feed(ids)
                refill.append(time.perf_counter() - began)
        refill = refill[1:]  # the first one also opened the session
        ms = lambda xs: round(1000 * statistics.median(xs), 2)  # noqa: E731
        print(json.dumps({
            "beam_search_ms_per_step": ms(beam[1:]),
            "greedy_same_rows_ms_per_step": ms(greedy[1:]),
            "refill_all_rows_ms_per_step": ms(refill),
            "conditions": f"{BEAMS} beams (batch 1) vs a greedy batch of {BEAMS} rows, {NEW} new tokens after a "
                          f"{PROMPT.shape[1]}-token prompt; refill: a {BEAMS}x{length} prefill from position 0 "
                          "in an open session; SmolLM2-135M, 2 servers, one thread each, loopback, CPU",
        }))


if __name__ == "__main__":
    main()
