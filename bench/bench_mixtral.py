"""Mixtral blocks in one process (`server.compute.blocks.BlockSpan`, no swarm) against transformers' MixtralForCausalLM
on a small random model (4 blocks, hidden 512, 8 experts, top-2, float32, one thread): decode ms per step for one
session, and for 8 sessions batched in one pass (rows routed to different experts) vs the same 8 one by one.
transformers' figure is its whole model's step (embeddings and LM head of a 1000-token vocabulary included, a
small part here). Prints one JSON object.
"""
from __future__ import annotations

import json
import os
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

PROMPT, STEPS, SESSIONS = 32, 32, 8


def main() -> None:
    from transformers import MixtralConfig, MixtralForCausalLM

    from server.compute.blocks import BlockSpan
    from swarm.modeling.checkpoint import Checkpoint

    torch.set_num_threads(1)
    torch.manual_seed(0)
    config = MixtralConfig(vocab_size=1000, hidden_size=512, intermediate_size=1024, num_hidden_layers=4,
                           num_attention_heads=8, num_key_value_heads=4, num_local_experts=8, num_experts_per_tok=2)
    reference = MixtralForCausalLM(config).eval()
    reference.set_experts_implementation("eager")
    result = {}
    with tempfile.TemporaryDirectory() as path, torch.inference_mode():
        reference.save_pretrained(path)
        span = BlockSpan.load(Checkpoint(path), 0, 4, "float32")
        ids = torch.randint(0, 1000, (1, PROMPT))
        out = reference(ids, use_cache=True)
        past, token = out.past_key_values, out.logits[:, -1:].argmax(-1)
        begin = time.perf_counter()
        for _ in range(STEPS):
            out = reference(token, past_key_values=past, use_cache=True)
            past, token = out.past_key_values, out.logits[:, -1:].argmax(-1)
        result["transformers_decode_ms"] = round((time.perf_counter() - begin) / STEPS * 1000, 2)

        sessions = []
        for _ in range(SESSIONS):
            kv = span.new_session_kv(1, PROMPT + STEPS, 0, 4)
            span.forward(torch.randn(1, PROMPT, 512), 0, kv)
            sessions.append(kv)
        x = [torch.randn(1, 1, 512) for _ in range(SESSIONS)]

        def timed(groups) -> float:
            for kv in sessions:
                kv.begin_step(PROMPT)
            begin = time.perf_counter()
            for step in range(STEPS):
                for group in groups:
                    span.forward_batch([(x[i], PROMPT + step, sessions[i]) for i in group], 0, 4)
            return (time.perf_counter() - begin) / STEPS * 1000

        result["swarmgate_decode_ms_1_session"] = round(timed([[0]]), 2)
        batched = timed([list(range(SESSIONS))])
        alone = timed([[i] for i in range(SESSIONS)])
        result[f"swarmgate_decode_ms_{SESSIONS}_sessions_batched"] = round(batched, 2)
        result[f"swarmgate_decode_ms_{SESSIONS}_sessions_one_by_one"] = round(alone, 2)
        layer = span.fused[0]
        rows = layer.post_norm(torch.cat(x).reshape(SESSIONS, -1))
        chosen = torch.topk(layer.router(rows), 2, dim=-1).indices
        result["experts_hit_by_the_batch_in_block_0"] = len(set(chosen.flatten().tolist()))
    print(json.dumps(result))


if __name__ == "__main__":
    main()
