"""Each Llama-like family (llama, mistral, qwen2) and Mixtral end to end on real processes, on a tiny random
checkpoint the test builds (4 blocks, hidden 64, the bundled SmolLM2 tokenizer and chat template), saved sharded
with `model.safetensors.index.json` as a hub repo holds it; Mistral, Qwen2 and Mixtral with a sliding window of 4
that the prompts outgrow. Two servers split the model mid-way (0:2, 2:4); against transformers running the same
checkpoint: greedy tokens for 3 prompts, a 2-turn chat session, 4 concurrent sessions batched on the servers; the
client reads only the shards with the embeddings, final norm and LM head. Mixtral and Qwen2 also through a
gateway (completions; chat completions with Mixtral, a 400 with Qwen2, whose tokenizer here has no chat
template); Mistral and Mixtral sessions fail over (a server killed, the history replayed)."""
from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor
from typing import List, Optional

import pytest
import torch

import swarm.modeling.checkpoint as checkpoint_module
from swarm import AutoDistributedModelForCausalLM
from swarm.launch.topology import start_servers, terminate_all
from tests.fixtures.tiny_checkpoints import save_tiny, shard_files
from tests.swarm.modeling.test_sharded_checkpoint import OpenedFiles

WINDOWS = {"llama": {}, "mistral": dict(sliding_window=4),
           "qwen2": dict(use_sliding_window=True, sliding_window=4, max_window_layers=1),
           "mixtral": dict(sliding_window=4)}
PROMPTS = ["The history of the Roman Empire begins", "def fibonacci(n):\n    ",
           "Three things every gardener should know about soil are", "Once upon a time, in a land far away"]
NEW_TOKENS = 10


def _generate(reference, ids: torch.Tensor, new_tokens: int = NEW_TOKENS) -> torch.Tensor:
    with torch.no_grad():
        return reference.generate(ids, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False)


def _chat_ids(tokenizer, messages) -> torch.Tensor:
    return tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt",
                                         return_dict=True)["input_ids"]


@pytest.mark.parametrize("family", list(WINDOWS))
def test_family_through_a_split_swarm(family, tmp_path, bootstrap, model_path, tokenizer, monkeypatch):
    path = tmp_path / f"tiny-{family}"
    # qwen2's tokenizer here has no chat template: its gateway answers chat completions with a clear 400
    reference = save_tiny(family, path, model_path, max_shard_size="150KB", chat_template=family != "qwen2",
                          **WINDOWS[family])
    gateway = {"mixtral": "chat", "qwen2": "no chat"}.get(family)
    check_split_swarm(path, reference, f"tfs-{family}", bootstrap, tokenizer, monkeypatch, gateway)


def check_split_swarm(path, reference, prefix: str, bootstrap, tokenizer, monkeypatch, gateway: Optional[str] = None,
                      batched: bool = True) -> None:
    """A sharded tiny checkpoint at `path` (at least 4 shards, 4 blocks) on two servers (0:2, 2:4) against
    `reference`, transformers' model of it: greedy tokens and last logits for 3 prompts, a 2-turn session, 4
    concurrent sessions (`batched`: batched on the servers); the client opens only the shards of its tensors.
    `gateway` "chat" / "no chat": also through a gateway (chat completions equal, or a 400 without a chat
    template)."""
    assert len(shard_files(path)) >= 4
    servers = start_servers(str(path), [bootstrap.maddr], ["0:2", "2:4"], prefix, threads=1)
    opened = OpenedFiles(monkeypatch)
    model = AutoDistributedModelForCausalLM.from_pretrained(str(path), initial_peers=[bootstrap.maddr],
                                                            dht_prefix=prefix)
    monkeypatch.setattr(checkpoint_module, "open", open, raising=False)
    try:
        weight_map = json.loads((path / "model.safetensors.index.json").read_text())["weight_map"]
        client_parts = {f for n, f in weight_map.items() if not n.startswith("model.layers.")}
        assert set(opened.names) == client_parts and len(client_parts) < len(shard_files(path))

        prompts = [tokenizer(p, return_tensors="pt")["input_ids"] for p in PROMPTS]
        assert all(ids.shape[1] > 4 for ids in prompts)  # the prompts outgrow the window
        for ids in prompts[:3]:
            ours = model.generate(ids, max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, do_sample=False)
            expected = _generate(reference, ids)
            assert ours.tolist() == expected.tolist()
            with torch.no_grad():
                ref_logits = reference(ours).logits[:, -1]
            assert (model(ours).logits[:, -1] - ref_logits).abs().max().item() < 1e-3

        # two turns of a chat in one session: the second sends only its new tokens
        turn1 = _chat_ids(tokenizer, [{"role": "user", "content": "Name a fruit."}])
        with model.inference_session(max_length=128) as session:
            out1 = model.generate(turn1, session=session, max_new_tokens=6, min_new_tokens=6, do_sample=False)
            follow = tokenizer("<|im_end|>\n<|im_start|>user\nAnd a vegetable?<|im_end|>\n<|im_start|>assistant\n",
                               return_tensors="pt", add_special_tokens=False)["input_ids"]
            turn2 = torch.cat([out1, follow], dim=1)
            out2 = model.generate(turn2, session=session, max_new_tokens=6, min_new_tokens=6, do_sample=False)
        assert out1.tolist() == _generate(reference, turn1, 6).tolist()
        assert out2.tolist() == _generate(reference, turn2, 6).tolist()

        # four sessions in lockstep: their steps batch on the servers, each equals its single-session output
        outputs = lockstep_sessions(model, prompts, NEW_TOKENS)
        for ids, out in zip(prompts, outputs):
            assert out.tolist() == model.generate(ids, max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS,
                                                  do_sample=False).tolist()
            assert out.tolist() == _generate(reference, ids).tolist()
        stats = [model.manager.server_info(s.peer_id) for s in servers]
        assert max(s.largest_batch for s in stats) >= 2 or not batched

        if gateway is not None:
            _check_gateway(path, bootstrap, prefix, reference, tokenizer, chat=gateway == "chat")
    finally:
        model.shutdown()
        terminate_all(servers)


def lockstep_sessions(model, prompts: List[torch.Tensor], new_tokens: int) -> List[torch.Tensor]:
    """One inference session per prompt ([1, length] ids each), fed in lockstep from as many threads (so their
    steps can batch on the servers): each prompt extended by `new_tokens` greedy tokens; the sessions closed."""
    sessions = [model.inference_session(max_length=64) for _ in prompts]
    outputs = list(prompts)
    try:
        with ThreadPoolExecutor(len(prompts)) as pool:
            for _ in range(new_tokens):
                logits = list(pool.map(lambda pair: pair[0].feed(pair[1]), zip(sessions, outputs)))
                outputs = [torch.cat([ids, lg.argmax(-1, keepdim=True)], dim=1) for ids, lg in zip(outputs, logits)]
    finally:
        for s in sessions:
            s.close()
    return outputs


def _check_gateway(path, bootstrap, prefix, reference, tokenizer, chat: bool) -> None:
    """Completions equal transformers' greedy tokens; chat completions too where the tokenizer has a chat
    template, else a 400 that says so."""
    import openai

    from tests.fixtures.gateway_fixtures import ready, spawn_gateway

    gateway = ready(spawn_gateway(str(path), [bootstrap.maddr], prefix, name=f"gateway-{prefix}"))
    try:
        client = gateway.client()
        prompt = PROMPTS[0]
        completion = client.completions.create(model=str(path), prompt=prompt, max_tokens=6, temperature=0)
        ids = tokenizer(prompt, return_tensors="pt")["input_ids"]
        expected = _generate(reference, ids, 6)[0, ids.shape[1]:]
        assert completion.choices[0].text == tokenizer.decode(expected, skip_special_tokens=True)
        messages = [{"role": "user", "content": "Name a fruit."}]
        if not chat:
            with pytest.raises(openai.BadRequestError, match="no chat template"):
                client.chat.completions.create(model=str(path), messages=messages, max_tokens=6, temperature=0)
            return
        answer = client.chat.completions.create(model=str(path), messages=messages, max_tokens=6, temperature=0)
        ids = _chat_ids(tokenizer, messages)
        expected = _generate(reference, ids, 6)[0, ids.shape[1]:]
        assert answer.choices[0].message.content == tokenizer.decode(expected, skip_special_tokens=True)
    finally:
        gateway.proc.terminate()


@pytest.mark.parametrize("family", ["mistral", "mixtral"])
def test_failover_replays_a_session(family, tmp_path, bootstrap, model_path, tokenizer):
    """A server of blocks 2:4 dies mid-generation (past the window): the session replays its history to the
    other 2:4 server and the greedy tokens equal transformers'."""
    path = tmp_path / f"tiny-{family}"
    reference = save_tiny(family, path, model_path, **WINDOWS[family])
    check_failover(path, reference, f"tfo-{family}", bootstrap, tokenizer)


def check_failover(path, reference, prefix: str, bootstrap, tokenizer) -> None:
    """Servers 0:2, 2:4, 2:4 of the checkpoint at `path`; the 2:4 server of a session dies after 6 of 12 greedy
    tokens: the session fails over, replays its history, and its tokens equal `reference`'s."""
    from tests.e2e.test_failover import KillAfter

    servers = {s.peer_id: s for s in start_servers(str(path), [bootstrap.maddr], ["0:2", "2:4", "2:4"], prefix,
                                                   threads=1)}
    model = AutoDistributedModelForCausalLM.from_pretrained(str(path), initial_peers=[bootstrap.maddr],
                                                            dht_prefix=prefix, ban_timeout=60, max_retries=2)
    try:
        check_failover_replay(model, reference, tokenizer(PROMPTS[2], return_tensors="pt")["input_ids"], servers)
    finally:
        model.shutdown()
        for s in servers.values():
            s.kill()


def check_failover_replay(model, reference, ids: torch.Tensor, servers: dict) -> None:
    """Kill the server of block 2 that the session uses after 6 of 12 greedy tokens (`servers`: peer id -> process):
    the session fails over, replaying its history, and its tokens equal transformers'."""
    from tests.e2e.test_failover import KillAfter

    with model.inference_session(max_length=ids.shape[1] + 12) as session:
        def kill():
            victim = next(hop.peer_id for hop in session.session.chain if hop.start <= 2 < hop.end)
            servers[victim].kill()

        out = model.generate(ids, session=session, max_new_tokens=12, min_new_tokens=12, do_sample=False,
                             streamer=KillAfter(6, kill))
        assert session.session.failovers >= 1
    assert out.tolist() == _generate(reference, ids, 12).tolist()
