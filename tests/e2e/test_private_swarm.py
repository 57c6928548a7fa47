"""A private swarm on real processes: a bootstrap peer and two servers sharing a swarm key (`--swarm_key_file`).

Members route and generate the reference text; a server without the key (or with another key) cannot join the
DHT, so it never serves a member's block; a client without the key is refused; and a peer that reaches a
server directly, knowing its address, gets no session or info without a proof of the key made for its own
peer id (a proof made for another peer is refused too).
"""
from __future__ import annotations

import asyncio
import secrets

import httpx
import pytest
import torch
from hivemind.p2p import P2P, PeerID
from hivemind.proto import runtime_pb2

from launch.topology import Topology, start_gateway, start_server
from swarm import AutoDistributedModelForCausalLM
from swarm.runtime.swarm_key import SwarmKey
from swarm.wire import channel as C
from swarm.wire import protocol as P

pytestmark = pytest.mark.slow

PREFIX = "tprivate"
PROMPT = "A private swarm keeps"
NEW = 8


@pytest.fixture(scope="module")
def key_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("swarmkey") / "swarm.key"
    path.write_text(secrets.token_hex(32) + "\n")
    return str(path)


@pytest.fixture(scope="module")
def private(model_path, key_file):
    keyed = ["--swarm_key_file", key_file]
    with Topology(model_path, ["0:15", "15:30"], prefix=PREFIX, server_args=keyed, dht_args=keyed, threads=1,
                  name="private") as swarm:
        yield swarm


@pytest.fixture(scope="module")
def member(private, model_path, key_file):
    model = AutoDistributedModelForCausalLM.from_pretrained(model_path, initial_peers=private.initial_peers,
                                                            dht_prefix=PREFIX, swarm_key_file=key_file)
    yield model
    model.shutdown()


def _greedy(model, tokenizer):
    ids = tokenizer(PROMPT, return_tensors="pt")["input_ids"]
    return model.generate(ids, max_new_tokens=NEW, min_new_tokens=NEW, do_sample=False)


def test_members_generate_the_reference_text(private, member, key_file, tokenizer, reference_model):
    ids = tokenizer(PROMPT, return_tensors="pt")["input_ids"]
    expected = reference_model.generate(ids, max_new_tokens=NEW, min_new_tokens=NEW, do_sample=False)
    assert torch.equal(_greedy(member, tokenizer), expected)
    assert private.bootstrap.ready["swarm_key"] == SwarmKey.from_file(key_file).fingerprint
    assert {s.peer_id for s in member.manager.update(force=True)} == {s.peer_id for s in private.servers}
    second = next(s for s in private.servers if s.ready["start"] == 15)
    assert member.manager.server_info(second.peer_id).steps_from_push > 0  # server-to-server pushes prove it too


@pytest.mark.parametrize("outsider_key", [None, "wrong"])
def test_outsider_server_never_serves_a_member(private, member, model_path, tokenizer, tmp_path, outsider_key):
    extra = ["--update_period", "5"]
    if outsider_key:
        wrong = tmp_path / "other.key"
        wrong.write_text(secrets.token_hex(32))
        extra += ["--swarm_key_file", str(wrong)]
    outsider = start_server(model_path, private.initial_peers, "0:30", PREFIX, extra, name=f"outsider-{outsider_key}",
                            threads=1)
    try:
        with pytest.raises(RuntimeError, match="exited") as info:
            outsider.wait_ready(timeout=120)
        assert "bootstrap failed" in str(info.value)  # no member answered its DHT ping
        served_before = {s.peer_id: member.manager.server_info(s.peer_id).inference_steps for s in private.servers}
        out = _greedy(member, tokenizer)
        assert out.shape[1] == tokenizer(PROMPT, return_tensors="pt")["input_ids"].shape[1] + NEW
        assert {s.peer_id for s in member.manager.update(force=True)} == {s.peer_id for s in private.servers}
        served_after = {s.peer_id: member.manager.server_info(s.peer_id).inference_steps for s in private.servers}
        assert all(served_after[p] > served_before[p] for p in served_before)  # the members served every step
    finally:
        outsider.kill()


@pytest.mark.parametrize("key", [None, "wrong"])
def test_outsider_client_is_refused(private, model_path, key):
    kwargs = {} if key is None else {"swarm_key": secrets.token_hex(32)}
    with pytest.raises(RuntimeError, match="bootstrap failed"):
        AutoDistributedModelForCausalLM.from_pretrained(model_path, initial_peers=private.initial_peers,
                                                        dht_prefix=PREFIX, **kwargs)


def test_gateway_serves_with_the_key_and_cannot_start_without_it(private, model_path, key_file, tokenizer, member):
    outsider = start_gateway(model_path, private.initial_peers, PREFIX, name="outsider-gateway", threads=1,
                             timeout=None)
    try:
        with pytest.raises(RuntimeError, match="exited") as info:
            outsider.wait_ready(timeout=120)
        assert "bootstrap failed" in str(info.value) and "--swarm_key_file" in str(info.value)
    finally:
        outsider.kill()
    gateway = start_gateway(model_path, private.initial_peers, PREFIX, ["--swarm_key_file", key_file],
                            name="private-gateway", threads=1)
    try:
        url = gateway.ready["url"]
        assert httpx.get(url + "/health", timeout=30).json()["status"] == "ok"
        body = {"model": httpx.get(url + "/v1/models", timeout=30).json()["data"][0]["id"], "temperature": 0,
                "prompt": PROMPT, "max_tokens": NEW}
        text = httpx.post(url + "/v1/completions", json=body, timeout=300).json()["choices"][0]["text"]
        ids = tokenizer(PROMPT, return_tensors="pt")["input_ids"]
        assert text == tokenizer.decode(_greedy(member, tokenizer)[0, ids.shape[1]:], skip_special_tokens=True)
    finally:
        gateway.terminate()


async def _direct_calls(server_maddr: str, server_peer: str, proof_for_me) -> dict:
    """An info call and a session opened straight at a server (no DHT), with the proof `proof_for_me(my id)`."""
    p2p = await P2P.create(initial_peers=[server_maddr])
    results = {}
    try:
        proof = proof_for_me(p2p.peer_id)
        stub = P.BlockRPC.get_stub(p2p, PeerID.from_base58(server_peer))
        try:
            info = await stub.rpc_info(runtime_pb2.ExpertUID(uid=proof), timeout=10)
            results["info"] = P.parse_stats(info).start
        except Exception as e:
            results["info"] = f"refused: {e}"

        async def requests():
            yield P.make_request(P.OpenSession(session_id="outsider", start=0, end=15, max_length=8), uid=proof)
            await asyncio.sleep(3)

        responses = await stub.rpc_inference(requests())
        reply = P.decode_reply((await asyncio.wait_for(responses.__anext__(), 10)).metadata)
        results["session"] = reply.code if isinstance(reply, P.ErrorReply) else "opened"
        await responses.aclose()

        async def frames():  # the same opening as a part of a session channel (`swarm.wire.channel`)
            request = P.make_request(P.OpenSession(session_id="outsider2", start=0, end=15, max_length=8), uid=proof)
            request.metadata = C.frame(C.DATA, 1, request.metadata)
            yield request
            await asyncio.sleep(3)

        responses = await stub.rpc_sessions(frames())
        header, body = C.unframe((await asyncio.wait_for(responses.__anext__(), 10)).metadata)
        reply = P.decode_reply(body)
        results["channel"] = (header.part, reply.code if isinstance(reply, P.ErrorReply) else "opened")
        await responses.aclose()
    finally:
        await p2p.shutdown()
    return results


def test_block_rpcs_need_a_proof_for_the_callers_own_peer_id(private, key_file):
    server = next(s for s in private.servers if s.ready["start"] == 0)
    key = SwarmKey.from_file(key_file)
    cases = {
        "none": lambda me: "",
        "wrong key": lambda me: SwarmKey(secrets.token_hex(32)).member_proof(me),
        "another peer's proof": lambda me: key.member_proof(private.servers[1].peer_id),
        "member": lambda me: key.member_proof(me),
    }
    results = {name: asyncio.run(_direct_calls(server.maddr, server.peer_id, make)) for name, make in cases.items()}
    for name in ("none", "wrong key", "another peer's proof"):
        assert results[name]["session"] == "forbidden", (name, results[name])
        assert results[name]["channel"] == (0, "forbidden"), (name, results[name])  # on the channel's own part
        assert str(results[name]["info"]).startswith("refused") and "private swarm" in results[name]["info"]
    assert results["member"] == {"info": 0, "session": "opened", "channel": (1, "opened")}
    assert "refused an RPC" in server.log_path.read_text()
