"""Routing to the server that holds a prompt's prefix, on real processes (issue 47): two replicas of one tiny Llama's
blocks; after a session computed a prompt on replica A, A's DHT record announces the pages (`ServerInfo.prefixes`),
and a new session that starts with that prompt is routed to A (which routing does not pick without a prefix) and
adopts the pages there (A's counters say hit, the other replica's nothing); greedy tokens equal transformers'.
(The routing rules on synthetic swarms: tests/swarm/client/test_prefix_routing_unit.py.)"""
from __future__ import annotations

import time
import uuid

import pytest
import torch

from launch.topology import start_server, terminate_all, wait_all
from swarm import AutoDistributedModelForCausalLM
from swarm.client.transport.prefix_routing import HeldPrefix
from swarm.runtime import aio
from swarm.wire import protocol as P
from tests.fixtures.tiny_checkpoints import save_tiny

PAGE = 16
SYSTEM = 4 * PAGE
NEW = 5


@pytest.fixture(scope="module")
def replicas(tmp_path_factory, model_path, bootstrap):
    path = tmp_path_factory.mktemp("prefix-routing") / "llama"
    reference = save_tiny("llama", path, model_path)
    prefix = "tprefixroute"
    extra = ["--update_period", "5", "--prefix_page_tokens", str(PAGE), "--throughput", "100"]
    servers = wait_all([start_server(str(path), [bootstrap.maddr], "0:4", prefix, extra, threads=1,
                                     name=f"server-{prefix}-{i}") for i in range(2)])
    # no RTT measurements: without a prefix, routing between the two equal replicas is decided by peer id alone
    model = AutoDistributedModelForCausalLM.from_pretrained(str(path), initial_peers=[bootstrap.maddr],
                                                            dht_prefix=prefix, measure_rtt=False)
    yield model, servers, reference
    model.shutdown()
    terminate_all(servers)


def _generate(model, ids: torch.Tensor, salt: str):
    session = model.inference_session(max_length=ids.shape[1] + NEW + 8)
    session.prefix_salt = salt
    out = model.generate(ids, session=session, max_new_tokens=NEW, min_new_tokens=NEW, do_sample=False)
    peers = [stream.hop.peer_id for stream in session.session._streams]
    return out, session, peers


def _hits(model, peer_id: str) -> int:
    return aio.run(model.manager.prefix_cache(peer_id)).pages_hit


def test_a_new_session_is_routed_to_the_replica_holding_its_prompt(replicas):
    model, servers, reference = replicas
    manager = model.manager
    generator = torch.Generator().manual_seed(47)
    system = torch.randint(3, 1000, (SYSTEM,), generator=generator).tolist()
    first_ids = torch.tensor([system + [11, 12, 13]])
    second_ids = torch.tensor([system + [21, 22, 23, 24]])
    salt = f"tenant-{uuid.uuid4().hex}"
    length = second_ids.shape[1] + NEW + 8

    manager.update(force=True)
    (usual,) = [hop.peer_id for hop in manager.make_inference_chain(session_length=length)]
    (holder,) = [s.peer_id for s in servers if s.peer_id != usual]

    # the first session computes the prompt on the replica that routing would not pick
    manager.ban(usual)
    try:
        out, session, peers = _generate(model, first_ids, salt)
    finally:
        manager.mark_ok(usual)
    session.close()
    assert peers == [holder] and session.session.adopted_tokens == 0
    assert out.tolist() == reference.generate(first_ids, max_new_tokens=NEW, min_new_tokens=NEW,
                                              do_sample=False).tolist()

    # its record announces the pages (re-announced early when the cache holds other pages; a DHT read, read again
    # until the new record reached it, with a generous bound)
    declared = HeldPrefix(P.PrefixDecl(salt=salt, tokens=second_ids[0].tolist()), None, length)
    deadline = time.monotonic() + 120
    while True:
        spans = {span.peer_id: span for span in manager.update(force=True)}
        if holder in spans and declared.held_tokens(spans[holder], 0, 4) == SYSTEM:
            break
        assert time.monotonic() < deadline, "the holder's record never announced the prompt's pages"
        time.sleep(1.0)
    assert usual in spans and declared.held_tokens(spans[usual], 0, 4) == 0

    hits = {peer: _hits(model, peer) for peer in (usual, holder)}
    out, session, peers = _generate(model, second_ids, salt)
    session.close()
    assert peers == [holder] and session.session.adopted_tokens == SYSTEM
    assert _hits(model, holder) - hits[holder] == SYSTEM // PAGE and _hits(model, usual) == hits[usual]
    assert out.tolist() == reference.generate(second_ids, max_new_tokens=NEW, min_new_tokens=NEW,
                                              do_sample=False).tolist()

    # another salt holds nothing there: routed as usual
    out, session, peers = _generate(model, second_ids, f"other-{uuid.uuid4().hex}")
    session.close()
    assert peers == [usual] and session.session.adopted_tokens == 0
