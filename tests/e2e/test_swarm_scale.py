"""Eight real servers placing themselves (no pinned spans, mixed sizes and throughputs) on a tiny random Llama of 8
blocks: they cover the model, and a chat keeps being served, with the same greedy tokens as transformers, while
two of them are killed (one SIGKILL, one SIGTERM)."""
from __future__ import annotations

import random
import threading
import time
import uuid
from typing import Dict, Optional, Tuple

import hivemind
import torch

from launch.topology import start_server, terminate_all, wait_all
from swarm import AutoDistributedModelForCausalLM
from swarm.wire.records import fetch_block_records, online_spans
from tests.fixtures.swarm_watch import wait_for
from tests.fixtures.tiny_checkpoints import save_tiny

NUM_BLOCKS = 8
SERVERS = [(2, "5"), (3, "20"), (4, "50"), (2, "10"), (3, "5"), (4, "20"), (2, "50"), (3, "10")]  # blocks, speed


def cover(dht, prefix: str, exclude=()) -> Optional[Dict[str, Tuple[int, int]]]:
    spans = [s for s in online_spans(fetch_block_records(dht, prefix, NUM_BLOCKS)) if s.peer_id not in exclude]
    covered = {block for s in spans for block in range(s.start, s.end)}
    return {s.peer_id: (s.start, s.end) for s in spans} if len(covered) == NUM_BLOCKS else None


def test_eight_self_placed_servers_keep_a_chat_going_while_two_die(tmp_path, bootstrap, model_path, tokenizer):
    path = tmp_path / "tiny-llama-8"
    reference = save_tiny("llama", path, model_path, num_hidden_layers=NUM_BLOCKS)
    prefix = f"scale-{uuid.uuid4().hex[:8]}"
    procs = [start_server(str(path), [bootstrap.maddr], None, prefix, threads=1, name=f"server-{prefix}-{i}",
                          extra=["--num_blocks", str(blocks), "--throughput", speed, "--update_period", "5",
                                 "--attn_cache_tokens", "4096"])
             for i, (blocks, speed) in enumerate(SERVERS)]
    dht = hivemind.DHT(initial_peers=[bootstrap.maddr], client_mode=True, start=True)
    model = None
    try:
        wait_all(procs, 300)
        spans = wait_for(lambda: (lambda c: c if c and len(c) == len(SERVERS) else None)(cover(dht, prefix)), 120,
                         "eight servers online covering all blocks")
        # two victims whose loss leaves every block served (each block is served about 3 times over)
        rng = random.Random(0)
        pairs = [(a, b) for a in procs for b in procs if a.peer_id < b.peer_id]
        rng.shuffle(pairs)
        victims = next(pair for pair in pairs if set(range(NUM_BLOCKS)) <= {
            block for peer, (start, end) in spans.items() if peer not in (pair[0].peer_id, pair[1].peer_id)
            for block in range(start, end)})

        model = AutoDistributedModelForCausalLM.from_pretrained(str(path), initial_peers=[bootstrap.maddr],
                                                                dht_prefix=prefix)
        chat = tokenizer.apply_chat_template([{"role": "user", "content": "Tell me about rivers."}],
                                             add_generation_prompt=True, return_tensors="pt",
                                             return_dict=True)["input_ids"]
        result: dict = {}

        def generate():
            try:
                result["ours"] = model.generate(chat, max_new_tokens=40, min_new_tokens=40, do_sample=False)
            except BaseException as e:  # reported below
                result["error"] = e

        thread = threading.Thread(target=generate)
        thread.start()
        time.sleep(1.0)
        victims[0].kill()  # SIGKILL: its records stay until they expire
        victims[1].terminate()  # SIGTERM: it announces offline
        thread.join(300)
        assert not thread.is_alive() and "error" not in result, result
        with torch.no_grad():
            expected = reference.generate(chat, max_new_tokens=40, min_new_tokens=40, do_sample=False)
        assert result["ours"].tolist() == expected.tolist()

        # the survivors still cover the model, and a new chat is served by them alone
        gone = {v.peer_id for v in victims}
        wait_for(lambda: cover(dht, prefix, exclude=gone), 60, "the survivors to cover every block")
        again = model.generate(chat, max_new_tokens=8, min_new_tokens=8, do_sample=False)
        assert again.tolist() == expected[:, :chat.shape[1] + 8].tolist()
        for proc in procs:
            if proc not in victims:
                assert proc.proc.poll() is None, proc.log_tail()
    finally:
        if model is not None:
            model.shutdown()
        dht.shutdown()
        terminate_all(procs)
