"""Training through the swarm: forward+backward tokens/s through a 2-server swarm vs local transformers on the same
batch, and the decode latency of a live inference session on the same servers with and without a training load.
Starts its own bootstrap peer and servers (one intra-op thread each) on loopback; prints one JSON object.

- Throughput: the gradient of a next-token loss with respect to the input embeddings of a [BATCH, SEQ] batch
  (weights frozen, as when tuning prompts), `model(inputs_embeds=...)` + `loss.backward()`; the swarm's backward
  recomputes each span's forward (the servers keep nothing between calls), so it does about twice the local work.
  The local reference runs `LlamaForCausalLM` with one intra-op thread, like each server.
- Decode latency: the per-token gap of a greedy generation (median and p90), alone and while another client
  process runs training passes on the same servers (their training pieces run below decode steps:
  `PRIORITY_TRAINING`, one block of at most 1024 tokens each). On a shared CPU the training client's own work
  (the LM head's forward and backward) competes for the cores too.
"""
from __future__ import annotations

import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from bench.harness import BenchSwarm, Clock  # noqa: E402

BATCH, SEQ, ROUNDS = 4, 64, 3
NEW_TOKENS = 40
PROMPT = torch.tensor([[1, 504, 3458, 314, 4086, 28, 260, 1345, 2024, 30, 1530, 260, 1029]])


def loss_of(logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]).float(),
                                             ids[:, 1:].reshape(-1))


def train_step(model, embed, ids) -> None:
    embeds = embed(ids).detach().requires_grad_(True)
    out = model(inputs_embeds=embeds)
    loss_of(out.logits, ids).backward()


def tokens_per_s(model, embed, ids, rounds: int = ROUNDS) -> float:
    train_step(model, embed, ids)  # warm-up
    began = time.perf_counter()
    for _ in range(rounds):
        train_step(model, embed, ids)
    return round(rounds * ids.numel() / (time.perf_counter() - began), 1)


def decode_gaps(model) -> list:
    clock = Clock()
    model.generate(PROMPT, max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, do_sample=False, streamer=clock)
    return [b - a for a, b in zip(clock.times[1:], clock.times[2:])]  # decode steps only (no prefill)


def summary(gaps: list) -> dict:
    ordered = sorted(gaps)
    return {"median_ms": round(1000 * statistics.median(ordered), 2),
            "p90_ms": round(1000 * ordered[int(0.9 * (len(ordered) - 1))], 2)}


def main() -> None:
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(1)
    torch.manual_seed(0)
    ids = torch.randint(100, 40000, (BATCH, SEQ))
    result: dict = {"batch": BATCH, "seq": SEQ, "servers": "0:15 + 15:30, 1 thread each, fp32, CPU"}
    with BenchSwarm("bench-train", ["0:15", "15:30"]) as swarm:
        reference = AutoModelForCausalLM.from_pretrained(swarm.path, dtype=torch.float32).eval()
        reference.requires_grad_(False)
        result["local_train_tokens_per_s"] = tokens_per_s(reference, reference.get_input_embeddings(), ids)
        del reference
        model = swarm.client_model()
        result["swarm_train_tokens_per_s"] = tokens_per_s(model, model.embed_tokens, ids)
        result["ratio_swarm_vs_local"] = round(result["swarm_train_tokens_per_s"] /
                                               result["local_train_tokens_per_s"], 3)

        decode_gaps(model)  # warm-up
        result["decode_idle"] = summary(decode_gaps(model))
        trainer = subprocess.Popen([sys.executable, __file__, "--load", swarm.initial_peers[0], swarm.prefix],
                                   stdout=subprocess.PIPE, text=True)
        try:
            assert trainer.stdout is not None
            assert trainer.stdout.readline().strip() == "training", "the training load did not start"
            before = _training_tokens(model)
            result["decode_while_training"] = summary(decode_gaps(model))
            result["training_tokens_during_decode"] = _training_tokens(model) - before
        finally:
            trainer.terminate()
            trainer.wait(30)
    print(json.dumps(result))


def _training_tokens(model) -> int:
    return sum(model.manager.server_info(s.peer_id).training_tokens_processed for s in model.manager.update())


def load(initial_peer: str, prefix: str) -> None:
    """The training load: training passes on the swarm until terminated."""
    from swarm import AutoDistributedModelForCausalLM
    from swarm.modeling.prepare import prepare_model

    torch.set_num_threads(1)
    model = AutoDistributedModelForCausalLM.from_pretrained(str(prepare_model()), initial_peers=[initial_peer],
                                                           dht_prefix=prefix, pad_head_rows=False)
    ids = torch.randint(100, 40000, (BATCH, SEQ))
    train_step(model, model.embed_tokens, ids)
    print("training", flush=True)
    while True:
        train_step(model, model.embed_tokens, ids)


if __name__ == "__main__":
    if sys.argv[1:2] == ["--load"]:
        load(sys.argv[2], sys.argv[3])
    else:
        main()
