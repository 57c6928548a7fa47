"""The decode loop's own cost per token, without a swarm: CPU time of the client's generation cycle around a stand-in
session whose step returns fixed logits at once.

What a step through the swarm costs (embeddings, network, servers, LM head) is left out on purpose: this measures
what the loop adds around it (the pick through Hugging Face processors or the gateway's samplers, appending, stop
checks, text streaming and events), the part that issue 32's one decode loop rewrote. Two paths, each over a
[rows, 49152] vocabulary: `generate` (greedy, one row and 8 rows) and the gateway's run (`GenerationRun`, greedy and
sampled with top_p, n=1, text streamed and decoded). CPU time (`time.process_time`), the median of several runs,
so a busy machine moves it less than wall time. Runs on the old layout too (`gateway.runs`), for before/after.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from swarm.client.model.causal_lm import DistributedModelForCausalLM  # noqa: E402

try:  # the layout of issue 32
    from gateway.metrics import Metrics
    from gateway.serving.runs import GenerationJob, GenerationRun
    from gateway.serving.sessions import SessionProvider
    from gateway.serving.tokens import Tokens
except ImportError:  # before it
    from gateway.metrics import Metrics  # type: ignore[no-redef]
    from gateway.runs import GenerationJob, GenerationRun  # type: ignore[no-redef]
    from gateway.sessions import SessionProvider  # type: ignore[no-redef]
    from gateway.tokens import Tokens  # type: ignore[no-redef]
from swarm.client.decoding.sampling import SamplingParams  # noqa: E402

VOCAB = 49152


class _Session:
    """Holds the ids it is fed and returns the same logits for every row at once; the token it favours cycles
    through ordinary words, so the text stream decodes real tokens and nothing ends early."""

    def __init__(self, max_length: int, favoured: list):
        self.max_length, self.favoured = max_length, favoured
        self.token_ids = None
        self.base = torch.randn(VOCAB) * 0.1

    def feed_and_pick(self, ids, pick, num_logits=1, left_padding=None):
        logits = self.base.expand(ids.shape[0], VOCAB).clone()  # [rows, vocab]
        logits[:, self.favoured[ids.shape[1] % len(self.favoured)]] = 10.0
        self.token_ids = ids
        return logits, (None if pick is None else pick(logits))

    def feed(self, ids):
        return self.feed_and_pick(ids, None)[0]

    def rewind(self, length):
        pass

    def settle(self):
        pass

    def check_next_step(self):
        return False

    check_pending = False

    def servers(self):
        return []

    def close(self):
        pass


class _Model(DistributedModelForCausalLM):
    def __init__(self, favoured: list):
        nn.Module.__init__(self)
        self.config = SimpleNamespace(vocab_size=VOCAB, eos_token_id=2, max_position_embeddings=4096)
        from transformers import GenerationConfig
        self.generation_config = GenerationConfig(eos_token_id=2, pad_token_id=2)
        self.favoured, self.last_speculation = favoured, None

    def inference_session(self, max_length, adapter=None):  # type: ignore[override]
        return _Session(max_length, self.favoured)

    def verify_stats(self):
        return None


def timed(fn, runs: int) -> float:
    """The median CPU seconds of fn() over `runs` runs (after one warm-up)."""
    fn()
    out = []
    for _ in range(runs):
        start = time.process_time()
        fn()
        out.append(time.process_time() - start)
    return statistics.median(out)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tokens", type=int, default=256, help="new tokens per generation")
    parser.add_argument("--runs", type=int, default=5)
    args = parser.parse_args()
    torch.set_num_threads(1)
    from transformers import AutoTokenizer

    from swarm.modeling.prepare import prepare_model
    tokenizer = AutoTokenizer.from_pretrained(prepare_model())
    favoured = tokenizer(" the cat sat on a mat and looked at the door while it rained", add_special_tokens=False
                         )["input_ids"]
    model = _Model(favoured)
    prompt = torch.tensor([favoured * 4])
    n = args.tokens
    result = {"benchmark": "decode_loop", "tokens": n, "vocab": VOCAB, "runs": args.runs}

    def generate(rows: int):
        out = model.generate(prompt.repeat(rows, 1), max_new_tokens=n, do_sample=False)
        assert out.shape[1] == prompt.shape[1] + n

    result["generate_1_row_us_per_token"] = round(timed(lambda: generate(1), args.runs) / n * 1e6, 1)
    result["generate_8_rows_us_per_step"] = round(timed(lambda: generate(8), args.runs) / n * 1e6, 1)

    tokens = Tokens(tokenizer, [2])
    sessions = SessionProvider(model)

    def gateway(params: SamplingParams):
        events: list = []
        job = GenerationJob(prompt[0].tolist(), params, stream=True)
        GenerationRun(job, events.append, sessions, tokens, Metrics(), VOCAB).run()
        assert len(events) > n // 4

    greedy = SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)
    sampled = SamplingParams(max_tokens=n, temperature=0.8, top_p=0.9, seed=1, ignore_eos=True)
    result["gateway_greedy_us_per_token"] = round(timed(lambda: gateway(greedy), args.runs) / n * 1e6, 1)
    result["gateway_top_p_us_per_token"] = round(timed(lambda: gateway(sampled), args.runs) / n * 1e6, 1)
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
