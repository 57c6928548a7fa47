"""Failover on real processes: a server dies (SIGKILL) or answers with errors mid-generation; the session
re-routes that span, replays its history, and the greedy tokens equal an undisturbed run."""
from __future__ import annotations

import pytest
import torch

from launch.topology import start_servers, terminate_all
from swarm import AutoDistributedModelForCausalLM
from swarm.client.transport.session import SessionError
from tests.fixtures.faulty_server import start_with_honest
from tests.fixtures.swarm_checks import KillAfter

PROMPT = "The three most important inventions of the twentieth century were"
NEW = 24
KILL_AFTER = 10


@pytest.fixture(scope="module")
def failover_swarm(model_path, bootstrap):
    prefix = "tfailover"
    servers = start_servers(model_path, [bootstrap.maddr], ["0:15", "0:15", "15:30", "15:30"], prefix,
                            ["--update_period", "10"], threads=1)
    model = AutoDistributedModelForCausalLM.from_pretrained(
        model_path, initial_peers=[bootstrap.maddr], dht_prefix=prefix, ban_timeout=60, step_timeout=30,
        max_retries=2)
    yield model, {s.peer_id: s for s in servers}
    model.shutdown()
    for s in servers:
        s.kill()


@pytest.fixture(scope="module")
def expected(tokenizer, reference_model):
    ids = tokenizer(PROMPT, return_tensors="pt")["input_ids"]
    return ids, reference_model.generate(ids, max_new_tokens=NEW, min_new_tokens=NEW, do_sample=False)


def _generate_killing(model, servers, ids, block, **extra):
    with model.inference_session(max_length=ids.shape[1] + NEW) as session:
        def kill():
            victim = next(hop.peer_id for hop in session.session.chain if hop.start <= block < hop.end)
            servers[victim].kill()
            kill.victim = victim

        out = model.generate(ids, session=session, max_new_tokens=NEW, min_new_tokens=NEW, do_sample=False,
                             streamer=KillAfter(KILL_AFTER, kill), **extra)
        assert session.session.failovers >= 1
        assert kill.victim not in [hop.peer_id for hop in session.session.chain]
    return out


def test_servers_publish_rtts_to_their_next_servers(failover_swarm):
    import time

    from swarm.wire.records import fetch_block_records

    model, servers = failover_swarm
    first_span = [p for p, s in servers.items() if s.ready["start"] == 0]
    next_span = {p for p, s in servers.items() if s.ready["start"] == 15}
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:  # records are refreshed every 10 s here
        records = fetch_block_records(model.manager.dht, model.manager.prefix, 30)
        # a span's next pings are announced under its last block only (block 14 for 0:15)
        pings = {p: records[14][p].next_pings for p in first_span if p in records[14]}
        if len(pings) == 2 and all(set(v) == next_span and all(0 < r < 5 for r in v.values())
                                   for v in pings.values()):
            break
        time.sleep(1)
    assert len(pings) == 2 and all(set(v) == next_span for v in pings.values())
    assert all(0 < rtt < 5 for v in pings.values() for rtt in v.values())
    assert all(not records[0][p].next_pings for p in first_span)  # not repeated under the span's other blocks
    assert all(not records[29][p].next_pings for p in next_span)  # nothing after the last block
    model.manager.update(force=True)
    assert model.manager.rtts and all(0 < r < 5 for r in model.manager.rtts.values())  # the client's own RTTs


def test_killing_the_last_span_server_mid_generation(failover_swarm, expected):
    model, servers = failover_swarm
    ids, ref = expected
    out = _generate_killing(model, servers, ids, block=20)
    assert out.tolist() == ref.tolist()


def test_killing_the_first_span_server_mid_generation(failover_swarm, tokenizer, reference_model):
    """With speculative decoding (n-gram drafts, on a prompt that repeats itself): the replacement replays only the
    accepted tokens' inputs (the rejected drafts were rewound) and the output stays exactly greedy. (The last-span
    test covers plain decoding.)"""
    model, servers = failover_swarm
    code = "def add(a, b):\n    return a + b\n\ndef sub(a, b):\n    return a - b\n\ndef mul(a, b):"
    ids = tokenizer(code, return_tensors="pt")["input_ids"]
    ref = reference_model.generate(ids, max_new_tokens=NEW, min_new_tokens=NEW, do_sample=False)
    out = _generate_killing(model, servers, ids, block=0, speculative="ngram", num_draft_tokens=4)
    assert out.tolist() == ref.tolist()
    stats = model.last_speculation
    assert stats.proposed > stats.accepted > 0  # drafts were accepted and rejected (rewinds)


def test_no_replacement_gives_a_clear_error(failover_swarm, expected):
    model, servers = failover_swarm
    ids, _ = expected
    alive = [s for s in servers.values() if s.proc.poll() is None]
    assert len(alive) == 2  # one server per span is left after the two tests above
    with pytest.raises(SessionError, match="15:30|tries"):
        _generate_killing(model, servers, ids, block=20)


def test_a_server_answering_errors_is_replaced(model_path, bootstrap, expected):
    prefix = "tfaulty"
    # a test-only server (tests/fixtures/faulty_server.py) that answers every inference step after the 6th with an error
    faulty, good = start_with_honest(model_path, [bootstrap.maddr], prefix, ["--fail_after_steps", "6"],
                                     ["0:15", "15:30"], "server-faulty")
    model = AutoDistributedModelForCausalLM.from_pretrained(model_path, initial_peers=[bootstrap.maddr],
                                                            dht_prefix=prefix, max_retries=2)
    try:
        ids, ref = expected
        with model.inference_session(max_length=ids.shape[1] + NEW) as session:
            out = model.generate(ids, session=session, max_new_tokens=NEW, min_new_tokens=NEW, do_sample=False)
            assert session.session.failovers == 1
            assert faulty.peer_id not in [hop.peer_id for hop in session.session.chain]
            assert len(session.session.chain) == 2  # the one-hop span 0:30 was replaced by two servers
        assert out.tolist() == ref.tolist()
    finally:
        model.shutdown()
        terminate_all([faulty, *good])
