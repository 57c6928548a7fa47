"""Spot-checks of servers' outputs (`swarm.client.transport.verify`) on real processes.

A test-only lying server (`tests/fixtures/faulty_server.py --perturb_after_steps`) serves the whole model faster than
two honest ones, so routing picks it: a session through it is caught within a bounded number of steps, the liar is
distrusted, and the greedy text equals the local reference. A server that lies only to some sessions is caught
in those. Honest servers raise no false alarm over 500 decode steps, in float32 and int8.
"""
from __future__ import annotations

import pytest
import torch

from launch.topology import start_servers, terminate_all
from swarm import AutoDistributedModelForCausalLM
from swarm.client.transport.verify import VerifyStats, divergence, tolerance, verifier_for
from tests.fixtures.faulty_server import start_with_honest

PROMPT = "The three most important inventions of the twentieth century were"
NEW = 30
PERTURB_AFTER = 4  # steps of a session the liar serves honestly (the prefill is one)
PROBABILITY = 0.25  # a perturbed step escapes all checks of NEW - PERTURB_AFTER steps with p = 0.75**26 < 0.1%


def _model(swarm, **kwargs):
    return AutoDistributedModelForCausalLM.from_pretrained(
        swarm["model_path"], initial_peers=swarm["initial_peers"], dht_prefix=swarm["prefix"], verify=True,
        max_retries=3, **kwargs)


@pytest.fixture(scope="module")
def lying_swarm(model_path, bootstrap):
    prefix = "tverify"
    liar, honest = start_with_honest(model_path, [bootstrap.maddr], prefix,
                                     ["--perturb_after_steps", str(PERTURB_AFTER), "--perturb_every", "2"],
                                     ["0:30", "0:30"], "server-liar")
    yield {"model_path": model_path, "initial_peers": [bootstrap.maddr], "prefix": prefix, "liar": liar,
           "honest": honest}
    terminate_all([liar, *honest])


@pytest.fixture(scope="module")
def expected(tokenizer, reference_model):
    ids = tokenizer(PROMPT, return_tensors="pt")["input_ids"]
    return ids, reference_model.generate(ids, max_new_tokens=NEW, min_new_tokens=NEW, do_sample=False).tolist()


def test_divergence_and_tolerances():
    torch.manual_seed(0)
    b = torch.randn(2, 3, 576) * 3
    b[..., 7] = 500.0  # a massive activation must not hide changes elsewhere
    assert divergence(b, b) == 0.0
    assert divergence(b * (1 + 1e-4), b) < tolerance("float32", "none")
    assert divergence(b.bfloat16(), b) < tolerance("bfloat16", "none")
    noisy = b + torch.randn_like(b) * b.std()
    assert divergence(noisy, b) > tolerance("bfloat16", "nf4")
    one_position = b.clone()
    one_position[1, 2] += torch.randn(576) * 3
    assert divergence(one_position, b) > tolerance("bfloat16", "nf4")


def _generate(model, ids, new=NEW):
    with model.inference_session(max_length=ids.shape[1] + new) as session:
        out = model.generate(ids, session=session, max_new_tokens=new, min_new_tokens=new, do_sample=False)
        return out.tolist(), session.session, [hop.peer_id for hop in session.session.chain]


def test_a_lying_server_is_caught_and_the_text_is_unchanged(lying_swarm, expected):
    ids, reference = expected
    liar = lying_swarm["liar"].peer_id
    model = _model(lying_swarm, verify_probability=PROBABILITY)
    try:
        # the liar's first session (it lies to every second one): caught, distrusted, the span replayed elsewhere
        out, session, chain = _generate(model, ids)
        stats: VerifyStats = verifier_for(model.manager).stats
        assert out == reference
        assert stats.mismatches == 1 and stats.distrusted == [liar], stats
        assert session.failovers >= 1 and liar not in chain
        assert liar in model.manager.banned()
    finally:
        model.shutdown()

    model = _model(lying_swarm, verify_probability=PROBABILITY)
    try:
        # its second session is served honestly: checked (a new server for this client), no alarm
        out, _, chain = _generate(model, ids)
        stats = verifier_for(model.manager).stats
        assert out == reference and stats.mismatches == 0 and stats.passed >= 1, stats
        assert chain == [liar]
        # the third one is lied to again: caught in that session
        out, _, chain = _generate(model, ids)
        assert out == reference and stats.mismatches == 1 and stats.distrusted == [liar], stats
        assert liar not in chain
    finally:
        model.shutdown()


def _no_false_alarm(swarm, ids, steps=500, **kwargs):
    model = _model(swarm, verify_probability=0.1, **kwargs)
    try:
        if "liar" in swarm:
            model.manager.distrusted.add(swarm["liar"].peer_id)  # the honest part of the swarm
        _generate(model, ids, new=steps)
        stats = verifier_for(model.manager).stats
        assert stats.mismatches == 0 and stats.unresolved == 0 and stats.checks >= 20, stats
        return stats
    finally:
        model.shutdown()


def test_honest_float32_servers_raise_no_false_alarm(lying_swarm, expected):
    ids, _ = expected
    stats = _no_false_alarm(lying_swarm, ids)
    print("float32 honest checks:", stats.as_dict())


@pytest.mark.parametrize("quant_type", ["int8"])
def test_honest_quantized_servers_raise_no_false_alarm(model_path, bootstrap, expected, quant_type):
    prefix = f"tverify-{quant_type}"
    servers = start_servers(model_path, [bootstrap.maddr], ["0:30", "0:30"], prefix, ["--quant_type", quant_type],
                            threads=1)
    try:
        ids, _ = expected
        swarm = {"model_path": model_path, "initial_peers": [bootstrap.maddr], "prefix": prefix}
        stats = _no_false_alarm(swarm, ids)
        print(f"{quant_type} honest checks:", stats.as_dict())
    finally:
        terminate_all(servers)


def test_a_span_without_a_second_server_is_counted_unverifiable(swarms, model_path, expected):
    swarm = dict(swarms.get(("0:15", "15:30")), model_path=model_path)
    ids, reference = expected
    model = _model(swarm, verify_probability=1.0)
    try:
        out, _, _ = _generate(model, ids, new=4)
        stats = verifier_for(model.manager).stats
        assert out[0] == reference[0][:ids.shape[1] + 4]
        assert stats.checks == 0 and stats.unverifiable >= 2 * 3 and stats.mismatches == 0, stats
    finally:
        model.shutdown()
