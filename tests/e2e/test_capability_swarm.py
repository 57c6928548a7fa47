"""Routing by capabilities on real processes (issue 45): a server whose release lacks beam reorders and left
padding (`tests/fixtures/lacking_server.py`: its record does not announce them, and it refuses their fields as an
unknown field is refused) beside a full one. It is preferred (throughput 100) for what needs neither; a padded batch
is routed around it from the start; a beam search that opened on it moves its span to the full server at its first
reorder (history replayed, no ban, no failover); where only it serves, the error names what it lacks and its
release. Every output equals transformers'."""
from __future__ import annotations

import pytest
import torch

from launch.topology import start_server, terminate_all, wait_all
from swarm import AutoDistributedModelForCausalLM
from swarm.wire.capabilities import release

LACKS = "beam_reorder,left_padding"


@pytest.fixture(scope="module")
def lacking_swarm(model_path, bootstrap):
    prefix = "caps-swarm"
    lacking = start_server(model_path, [bootstrap.maddr], "0:30", prefix, ["--throughput", "100", "--without", LACKS],
                           name="caps-lacking", threads=1, module="tests.fixtures.lacking_server")
    full = start_server(model_path, [bootstrap.maddr], "0:30", prefix, ["--throughput", "1"], name="caps-full",
                        threads=1)
    procs = [lacking, full]
    try:
        wait_all(procs, 180)
        model = AutoDistributedModelForCausalLM.from_pretrained(model_path, initial_peers=[bootstrap.maddr],
                                                                dht_prefix=prefix, measure_rtt=False)
    except BaseException:
        terminate_all(procs)
        raise
    yield model, lacking.peer_id, full.peer_id
    model.shutdown()
    terminate_all(procs)


def test_sessions_keep_to_servers_with_what_they_need(lacking_swarm, tokenizer, reference_model):
    model, lacking, full = lacking_swarm
    manager = model.manager
    ids = tokenizer(["The capital of France is"], return_tensors="pt")["input_ids"]
    # greedy needs neither: the preferred server
    with model.inference_session(max_length=32) as session:
        out = model.generate(ids, session=session, max_new_tokens=4, min_new_tokens=4, do_sample=False)
        assert [hop.peer_id for hop in session.session.chain] == [lacking]
    assert out.tolist() == reference_model.generate(ids, max_new_tokens=4, min_new_tokens=4,
                                                    do_sample=False).tolist()
    # a beam search opens there (its first step reorders nothing), then moves at its first reorder
    with model.inference_session(max_length=32) as session:
        out = model.generate(ids, session=session, max_new_tokens=4, num_beams=2)
        inner = session.session
        assert [hop.peer_id for hop in inner.chain] == [full]
        assert (inner.moves, inner.failovers) == (1, 0) and "beam_reorder" in inner.needs
    assert out.tolist() == reference_model.generate(ids, max_new_tokens=4, num_beams=2).tolist()
    # a padded batch: routed around the server without left padding from the start
    batch = tokenizer(["Hi", "The capital of France is"], return_tensors="pt", padding=True, padding_side="left")
    with model.inference_session(max_length=32) as session:
        out = model.generate(**batch, session=session, max_new_tokens=3, min_new_tokens=3, do_sample=False)
        assert [hop.peer_id for hop in session.session.chain] == [full] and session.session.moves == 0
    assert out.tolist() == reference_model.generate(**batch, max_new_tokens=3, min_new_tokens=3,
                                                    do_sample=False).tolist()
    assert manager.banned() == []  # nobody failed: no field went where it is unknown


def test_where_only_a_server_without_it_serves_the_error_names_it(lacking_swarm):
    from swarm.client.transport.routing import RoutingError

    model, lacking, full = lacking_swarm
    manager = model.manager
    manager._bans[full] = (float("inf"), 1, float("inf"))  # as if the full server were gone
    try:
        with pytest.raises(RoutingError) as error:
            manager.make_inference_chain(needs={"left_padding"})
    finally:
        manager.mark_ok(full)
    text = str(error.value)
    assert "lack left_padding" in text and release() in text, text
