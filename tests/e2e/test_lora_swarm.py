"""LoRA adapters served by a swarm of real server processes (issue 16), against local transformers + peft.

Two servers (blocks 0:15 and 15:30) hold two peft-saved adapters of the bundled model ("alpha": q/v and the MLP;
"beta": q/k/v/o, rank 4, rsLoRA); a third server over every block holds none. Greedy generation with an adapter
equals peft's, the base equals the base; concurrent sessions with different adapters (and none) on the same
servers each equal their own reference; the DHT records list each server's adapters and adapter sessions are never
routed to the server without them; through the gateway, adapters are model ids of their own. Bad adapters stop a
server at start with a clear error. A tiny Mixtral's adapter on its experts (peft's `target_parameters`) through two
servers: tokens, logits and a training pass's gradients equal peft's (extended tier).
"""
from __future__ import annotations

import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest
import torch

from launch.topology import REPO, start_server, start_servers
from swarm.client.transport.session import SessionError
from swarm.wire.records import fetch_block_records
from tests.fixtures.gateway_fixtures import start_gateway
from tests.fixtures.lora_fixtures import make_adapter, peft_reference, reference_generate

SPANS = ("0:15", "15:30")
PROMPT = "The most surprising thing about octopuses is"
NEW_TOKENS = 12


@pytest.fixture(scope="module")
def lora_dirs(lora_adapters):
    return lora_adapters  # the session's (tests/fixtures/lora_fixtures.py), shared with tests/server/test_lora.py


@pytest.fixture(scope="module")
def lora_swarm(swarms, model_path, lora_dirs):
    extra = ("--adapters", *(f"{name}={path}" for name, path in lora_dirs.items()))
    # a server over every block without adapters: the cheapest route for the base model (one hop), never usable
    # for an adapter; started while the adapters' swarm starts
    plain = start_server(model_path, [swarms.bootstrap.maddr], "0:30", swarms.prefix(SPANS, extra),
                         name="server-lora-plain", threads=1)
    try:
        swarm = swarms.get(SPANS, extra=extra)
        plain.wait_ready(180)
        yield {**swarm, "plain": plain}
    finally:
        plain.terminate()


@pytest.fixture(scope="module")
def reference(lora_reference):
    return lora_reference


@pytest.fixture(scope="module")
def client_model(model_path, lora_swarm):
    from swarm import AutoDistributedModelForCausalLM

    model = AutoDistributedModelForCausalLM.from_pretrained(model_path, initial_peers=lora_swarm["initial_peers"],
                                                            dht_prefix=lora_swarm["prefix"], max_retries=1)
    yield model
    model.shutdown()


@pytest.fixture(scope="module")
def expected(tokenizer, reference):
    """adapter (None: base) -> the peft model's greedy ids [1, prompt + NEW_TOKENS]."""
    ids = tokenizer(PROMPT, return_tensors="pt")["input_ids"]
    return {adapter: reference_generate(reference, ids, NEW_TOKENS, adapter) for adapter in ("alpha", "beta", None)}


def _adapter_peers(swarm) -> set:
    return {server.ready["peer_id"] for server in swarm["servers"]}


def _generate(model, ids, adapter):
    """(ids [1, prompt + NEW_TOKENS], the session's chain) with a session of `adapter`."""
    with model.inference_session(max_length=ids.shape[1] + NEW_TOKENS, adapter=adapter) as session:
        out = model.generate(ids, session=session, max_new_tokens=NEW_TOKENS, do_sample=False)
        return out, session.session.chain


def test_generation_with_and_without_adapter_equals_peft(client_model, tokenizer, expected, lora_swarm, model_path):
    ids = tokenizer(PROMPT, return_tensors="pt")["input_ids"]
    assert not torch.equal(expected["alpha"], expected[None])  # the adapter changes the text
    for adapter in ("alpha", None):
        out, chain = _generate(client_model, ids, adapter)
        assert torch.equal(out, expected[adapter]), (adapter, tokenizer.decode(out[0]))
        if adapter is not None:
            assert {hop.peer_id for hop in chain} <= _adapter_peers(lora_swarm)
    # the model-wide active adapter (from_pretrained(active_adapter=...)) is what generate uses by default
    from swarm import AutoDistributedModelForCausalLM

    model = AutoDistributedModelForCausalLM.from_pretrained(model_path, initial_peers=lora_swarm["initial_peers"],
                                                            dht_prefix=lora_swarm["prefix"], active_adapter="beta")
    try:
        assert torch.equal(model.generate(ids, max_new_tokens=NEW_TOKENS, do_sample=False), expected["beta"])
    finally:
        model.shutdown()


def test_concurrent_sessions_of_different_adapters(client_model, tokenizer, expected, lora_swarm):
    ids = tokenizer(PROMPT, return_tensors="pt")["input_ids"]
    adapters = ["alpha", "beta", None]
    with ThreadPoolExecutor(len(adapters)) as pool:
        results = list(pool.map(lambda adapter: _generate(client_model, ids, adapter), adapters))
    for adapter, (out, chain) in zip(adapters, results):
        assert torch.equal(out, expected[adapter]), (adapter, tokenizer.decode(out[0]))
        if adapter is not None:
            assert {hop.peer_id for hop in chain} <= _adapter_peers(lora_swarm)


def test_records_list_adapters_and_routing_avoids_servers_without_them(client_model, lora_swarm):
    records = fetch_block_records(client_model.manager.dht, lora_swarm["prefix"], 30)
    plain = lora_swarm["plain"].ready["peer_id"]
    for block, servers in enumerate(records):
        for peer, info in servers.items():
            if peer == plain:
                assert info.adapters == ()
            else:
                assert peer in _adapter_peers(lora_swarm) and info.adapters == ("alpha", "beta"), (block, peer)
        assert plain in servers
    assert client_model.served_adapters(force=True) == ["alpha", "beta"]
    for _ in range(3):
        chain = client_model.manager.make_inference_chain(0, None, 64, adapter="alpha")
        assert plain not in {hop.peer_id for hop in chain}
    # the base model's cheapest route is the one-hop server without adapters
    assert [hop.peer_id for hop in client_model.manager.make_inference_chain(0, None, 64)] == [plain]


def test_forward_passes_with_adapters_equal_peft(client_model, tokenizer, reference):
    """`model.forward` (rpc_forward, no cache) with each adapter gives the peft model's logits."""
    ids = tokenizer(PROMPT, return_tensors="pt")["input_ids"]
    for adapter in ("beta", None):
        with torch.no_grad():
            if adapter is None:
                with reference.disable_adapter():
                    expected = reference(input_ids=ids).logits
            else:
                reference.set_adapter(adapter)
                expected = reference(input_ids=ids).logits
        got = client_model.forward(ids, adapter=adapter).logits
        assert torch.allclose(got, expected, atol=1e-3), (adapter, (got - expected).abs().max())


def test_unknown_adapter_is_a_clear_error(client_model, tokenizer):
    ids = tokenizer(PROMPT, return_tensors="pt")["input_ids"]
    with pytest.raises(SessionError, match=r"holding LoRA adapter 'gamma'.*adapters served there: alpha, beta"):
        _generate(client_model, ids, "gamma")


def test_gateway_serves_adapters_as_models(model_path, lora_swarm, tokenizer, reference):
    gateway = start_gateway(model_path, lora_swarm, "--max_concurrent", "3", name="gateway-lora")
    try:
        client = gateway.client()
        cards = {card.id: card for card in client.models.list().data}
        base = next(card_id for card_id, card in cards.items() if getattr(card, "parent", None) is None)
        assert {card_id for card_id in cards if card_id != base} == {"alpha", "beta"}
        assert all(getattr(cards[name], "parent") == base for name in ("alpha", "beta"))
        assert httpx.get(gateway.base_url + "/models/alpha").json()["parent"] == base

        messages = [{"role": "user", "content": "Name a colour."}]
        prompt = httpx.post(gateway.url + "/tokenize", json={"messages": messages}).json()["tokens"]
        ids = torch.tensor([prompt])
        texts = {}
        for model_id, adapter in ((base, None), ("alpha", "alpha"), ("beta", "beta")):
            out = reference_generate(reference, ids, 10, adapter)
            expected = tokenizer.decode(out[0, ids.shape[1]:], skip_special_tokens=True)
            # twice: the second request reuses the pooled conversation of that adapter (never another's)
            for _ in range(2):
                r = client.chat.completions.create(model=model_id, messages=messages, max_tokens=10, temperature=0)
                assert r.model == model_id and r.choices[0].message.content == expected, (model_id, adapter)
            texts[model_id] = expected
        assert len(set(texts.values())) == 3
        with pytest.raises(openai.NotFoundError, match="gamma"):
            client.chat.completions.create(model="gamma", messages=messages, max_tokens=4)
        assert httpx.get(gateway.base_url + "/models/gamma").status_code == 404
    finally:
        gateway.proc.terminate()


def test_bad_adapters_stop_the_server_at_start(model_path, lora_dirs, tmp_path):
    (tmp_path / "broken").mkdir()
    (tmp_path / "broken" / "adapter_config.json").write_text("[1, 2")
    (tmp_path / "broken" / "adapter_model.safetensors").write_bytes(b"")
    cases = [  # (--adapters, expected exit status (None: not 0), text in stderr); the servers start together
        ((str(tmp_path / "missing"),), 1, "no such directory"),
        ((str(tmp_path / "broken"),), 1, "cannot read adapter_config.json"),
        ((f"same={lora_dirs['alpha']}", f"same={lora_dirs['beta']}"), None, "must differ"),
    ]
    procs = [subprocess.Popen([sys.executable, "-m", "launch.cli", "server", model_path, "--new_swarm",
                               "--block_indices", "0:2", "--adapters", *adapters], cwd=REPO, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for adapters, _, _ in cases]
    try:
        results = [proc.communicate(timeout=180) for proc in procs]
    finally:
        for proc in procs:
            proc.kill()
    for (adapters, code, text), proc, (_, stderr) in zip(cases, procs, results):
        assert (proc.returncode != 0 if code is None else proc.returncode == code), (adapters, stderr[-2000:])
        assert text in stderr, (adapters, stderr[-2000:])


def test_expert_adapter_through_a_split_swarm(tmp_path, bootstrap, model_path, tokenizer):
    """An adapter on a tiny Mixtral's attention and its experts' stacked parameters (peft's `target_parameters`),
    served by two servers split mid-model (0:2, 2:4): greedy tokens with the adapter and without it, in concurrent
    sessions on the same servers, equal local peft's; a forward pass's logits within 1e-4; a training pass's input
    gradients equal peft's."""
    from launch.topology import terminate_all
    from swarm import AutoDistributedModelForCausalLM
    from tests.fixtures.tiny_checkpoints import save_tiny

    path = tmp_path / "tiny-mixtral"
    save_tiny("mixtral", path, model_path, sliding_window=4)
    adapter = make_adapter(str(path), tmp_path / "moe-lora", seed=3, targets=("q_proj", "v_proj"), r=4, alpha=8,
                           target_parameters=["mlp.experts.gate_up_proj", "mlp.experts.down_proj"])
    reference = peft_reference(str(path), {"moe": adapter})
    ids = tokenizer(PROMPT, return_tensors="pt")["input_ids"]
    expected = {name: reference_generate(reference, ids, NEW_TOKENS, name) for name in ("moe", None)}
    assert not torch.equal(expected["moe"], expected[None])  # the adapter changes the text
    servers = start_servers(str(path), [bootstrap.maddr], ["0:2", "2:4"], "lora-moe", ("--adapters", f"moe={adapter}"),
                            threads=1)
    model = AutoDistributedModelForCausalLM.from_pretrained(str(path), initial_peers=[bootstrap.maddr],
                                                            dht_prefix="lora-moe")
    try:
        names = ["moe", None, "moe"]
        with ThreadPoolExecutor(len(names)) as pool:
            results = list(pool.map(lambda name: _generate(model, ids, name)[0], names))
        for name, out in zip(names, results):
            assert torch.equal(out, expected[name]), (name, tokenizer.decode(out[0]))
        reference.set_adapter("moe")
        with torch.no_grad():
            logits = reference(input_ids=ids).logits
        assert (model.forward(ids, adapter="moe").logits - logits).abs().max().item() < 1e-4
        # a training pass through the adapter (rpc_train_forward / backward): the input embeddings' gradients
        embeds = reference.get_input_embeddings()(ids).detach().requires_grad_(True)
        reference(inputs_embeds=embeds, labels=ids).loss.backward()
        ours = embeds.detach().clone().requires_grad_(True)
        out = model.forward(inputs_embeds=ours, adapter="moe").logits
        torch.nn.functional.cross_entropy(out[0, :-1], ids[0, 1:]).backward()
        assert ours.grad is not None and embeds.grad is not None
        assert (ours.grad - embeds.grad).abs().max().item() < 1e-4 * embeds.grad.abs().max().item()
    finally:
        model.shutdown()
        terminate_all(servers)
