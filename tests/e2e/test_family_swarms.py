"""Each Llama-like family (llama, mistral, qwen2) and Mixtral end to end on real processes, on a tiny random
checkpoint the test builds (4 blocks, hidden 64, the bundled SmolLM2 tokenizer and chat template), saved sharded
with `model.safetensors.index.json` as a hub repo holds it; Mistral, Qwen2 and Mixtral with a sliding window of 4
that the prompts outgrow. Two servers split the model mid-way (0:2, 2:4); against transformers running the same
checkpoint: greedy tokens for 3 prompts, a 2-turn chat session, 4 concurrent sessions batched on the servers; the
client reads only the shards with the embeddings, final norm and LM head. Mixtral and Qwen2 also through a
gateway (completions; chat completions with Mixtral, a 400 with Qwen2, whose tokenizer here has no chat
template); Mistral and Mixtral sessions fail over (a server killed, the history replayed)."""
from __future__ import annotations

import pytest

from tests.fixtures.swarm_checks import check_failover, check_split_swarm
from tests.fixtures.tiny_checkpoints import save_tiny

WINDOWS = {"llama": {}, "mistral": dict(sliding_window=4),
           "qwen2": dict(use_sliding_window=True, sliding_window=4, max_window_layers=1),
           "mixtral": dict(sliding_window=4)}


@pytest.mark.parametrize("family", list(WINDOWS))
def test_family_through_a_split_swarm(family, tmp_path, bootstrap, model_path, tokenizer, monkeypatch):
    path = tmp_path / f"tiny-{family}"
    # qwen2's tokenizer here has no chat template: its gateway answers chat completions with a clear 400
    reference = save_tiny(family, path, model_path, max_shard_size="150KB", chat_template=family != "qwen2",
                          **WINDOWS[family])
    gateway = {"mixtral": "chat", "qwen2": "no chat"}.get(family)
    check_split_swarm(path, reference, f"tfs-{family}", bootstrap, tokenizer, monkeypatch, gateway)


@pytest.mark.parametrize("family", ["mistral", "mixtral"])
def test_failover_replays_a_session(family, tmp_path, bootstrap, model_path, tokenizer):
    """A server of blocks 2:4 dies mid-generation (past the window): the session replays its history to the
    other 2:4 server and the greedy tokens equal transformers'."""
    path = tmp_path / f"tiny-{family}"
    reference = save_tiny(family, path, model_path, **WINDOWS[family])
    check_failover(path, reference, f"tfo-{family}", bootstrap, tokenizer)

