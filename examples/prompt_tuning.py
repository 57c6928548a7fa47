"""Prompt tuning through the swarm: train soft prompts on the client while the servers' weights stay frozen.

    python examples/prompt_tuning.py --initial_peers /ip4/.../p2p/... [--dht_prefix P] [--tuning_mode deep_ptune]

The default task: whatever the question, answer " banana". `train` is importable (tests/e2e/test_training_example.py
runs a short version on a task of its own): each epoch runs every example once (examples of the same token
length share a batch: the client does not pad), the loss being the cross-entropy of the answer's tokens only,
then one Adam step on the prompts (`model.ptune`, the only parameters that require grad).
"""
from __future__ import annotations

import argparse
import sys
from collections import defaultdict
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import torch

TASK: List[Tuple[str, str]] = [
    ("Question: What is the capital of France?\nAnswer:", " banana"),
    ("Question: What colour is the sky?\nAnswer:", " banana"),
    ("Question: How many legs does a cat have?\nAnswer:", " banana"),
    ("Question: Who wrote Hamlet?\nAnswer:", " banana"),
]


def encode(tokenizer, examples: Sequence[Tuple[str, str]]) -> Dict[int, Tuple[torch.Tensor, torch.Tensor]]:
    """Examples grouped by length: length -> (input ids [n, length], answer mask [n, length] on the answer's
    tokens)."""
    groups: Dict[int, List[Tuple[List[int], int]]] = defaultdict(list)
    for prompt, answer in examples:
        prompt_ids = tokenizer(prompt)["input_ids"]
        answer_ids = tokenizer(answer, add_special_tokens=False)["input_ids"]
        groups[len(prompt_ids) + len(answer_ids)].append((prompt_ids + answer_ids, len(prompt_ids)))
    out = {}
    for length, rows in groups.items():
        ids = torch.tensor([r for r, _ in rows])
        mask = torch.zeros_like(ids, dtype=torch.bool)
        for i, (_, prompt_len) in enumerate(rows):
            mask[i, prompt_len:] = True
        out[length] = (ids, mask)
    return out


def answer_loss(logits: torch.Tensor, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Cross-entropy of the masked tokens given the ones before: logits [n, len, vocab], ids and mask [n, len]."""
    targets = ids[:, 1:][mask[:, 1:]]
    return torch.nn.functional.cross_entropy(logits[:, :-1][mask[:, 1:]].float(), targets)


def train(model, tokenizer, examples: Sequence[Tuple[str, str]], epochs: int, lr: float = 0.05,
          log: Optional[Callable[[str], None]] = print) -> List[float]:
    """Tune the model's trainable parameters on `examples`; returns the mean loss of each epoch."""
    params = [p for p in model.parameters() if p.requires_grad]
    if not params:
        raise ValueError("the model has no trainable parameters: load it with tuning_mode='ptune' or 'deep_ptune'")
    optimizer = torch.optim.Adam(params, lr=lr)
    groups = encode(tokenizer, examples)
    losses = []
    for epoch in range(epochs):
        optimizer.zero_grad()
        total = 0.0
        for ids, mask in groups.values():
            loss = answer_loss(model(ids).logits, ids, mask) * ids.shape[0] / len(examples)
            loss.backward()  # gradients through the swarm to the prompts
            total += loss.item()
        optimizer.step()
        losses.append(total)
        if log is not None:
            log(f"epoch {epoch}: loss {total:.4f}")
    return losses


def answer(model, tokenizer, prompt: str, max_new_tokens: int = 3) -> str:
    """The tuned model's greedy answer (generation through inference sessions, with the prompts)."""
    ids = tokenizer(prompt, return_tensors="pt")["input_ids"]
    out = model.generate(ids, max_new_tokens=max_new_tokens, do_sample=False)
    return tokenizer.decode(out[0, ids.shape[1]:], skip_special_tokens=True)


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="checkpoint directory or name (default: the bundled model)")
    parser.add_argument("--initial_peers", nargs="+", required=True, help="multiaddrs of DHT peers of the swarm")
    parser.add_argument("--dht_prefix", default=None, help="the swarm's DHT prefix (default: from the model name)")
    parser.add_argument("--tuning_mode", default="ptune", choices=["ptune", "deep_ptune"])
    parser.add_argument("--pre_seq_len", type=int, default=8, help="number of soft prompt tokens")
    parser.add_argument("--epochs", type=int, default=30)
    parser.add_argument("--lr", type=float, default=0.05)
    parser.add_argument("--save", default=None, help="write the trained prompts to this .safetensors file")
    args = parser.parse_args(argv)

    from transformers import AutoTokenizer

    from swarm import AutoDistributedModelForCausalLM
    from swarm.modeling.prepare import prepare_model

    path = args.model or str(prepare_model())
    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoDistributedModelForCausalLM.from_pretrained(
        path, initial_peers=args.initial_peers, dht_prefix=args.dht_prefix, tuning_mode=args.tuning_mode,
        pre_seq_len=args.pre_seq_len)
    try:
        train(model, tokenizer, TASK, args.epochs, args.lr)
        for prompt, _ in TASK:
            print(f"{prompt!r} -> {answer(model, tokenizer, prompt)!r}")
        if args.save:
            assert model.ptune is not None
            model.ptune.save(args.save)
            print(f"prompts saved to {args.save}")
    finally:
        model.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
