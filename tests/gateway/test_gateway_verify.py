"""Spot-checks through the gateway (`--verify_rate`, `gateway.serving.verification`) on real processes.

A swarm of one lying server (`tests/fixtures/faulty_server.py`: honest for each session's first steps, then perturbed
outputs) that routing prefers, and two honest servers over the same blocks: greedy chat completions, streamed and not,
give exactly the local `transformers` text; the liar shows as distrusted in `/metrics` and `/status.json`. Over the
shared split swarm (one server per span) nothing can be checked: the unverifiable counter rises, with no false alarm.
"""
from __future__ import annotations

import httpx
import pytest
import torch

from launch.topology import terminate_all
from swarm import AutoDistributedModelForCausalLM
from swarm.client.transport.verify import OutputsRetracted, verifier_for
from tests.fixtures.faulty_server import start_with_honest
from tests.fixtures.gateway_fixtures import SPANS, one_torch_thread, reference_text, start_gateway  # noqa: F401

MODEL = "smollm2-135m-instruct"
NEW = 12  # tokens per completion through the liar's swarm
SHORT = 6  # through the split swarm
PERTURB_AFTER = 3  # steps of each session the liar serves honestly (its first check passes)


def metric(url: str, name: str, labels: str = "") -> float:
    """A sample of the gateway's /metrics (0 when absent)."""
    wanted = f"{name}{{{labels}}}" if labels else name
    for line in httpx.get(url + "/metrics", timeout=30).text.splitlines():
        if line.startswith(wanted + " "):
            return float(line.split()[-1])
    return 0.0


def chat(gw, messages, stream: bool, new: int = NEW) -> str:
    client = gw.client()
    if not stream:
        return client.chat.completions.create(model=MODEL, messages=messages, max_tokens=new,
                                              temperature=0).choices[0].message.content
    return "".join(chunk.choices[0].delta.content or "" for chunk in client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=new, temperature=0, stream=True) if chunk.choices)


@pytest.fixture(scope="module")
def lying_swarm(model_path, bootstrap):
    prefix = "tgwverify"
    liar, honest = start_with_honest(model_path, [bootstrap.maddr], prefix,
                                     ["--perturb_after_steps", str(PERTURB_AFTER)], ["0:30", "0:30"], "server-liar")
    swarm = {"prefix": prefix, "initial_peers": [bootstrap.maddr], "liar": liar, "servers": honest}
    yield swarm
    terminate_all([liar, *honest])


def test_a_lying_server_is_caught_through_the_gateway(lying_swarm, model_path, tokenizer, reference_model):
    # a rare random check: the liar is caught by the full check a stream asks for after 4 held tokens, one step
    # after its first lie, so that pick is retracted and redone (unless a random check, p = 0.001, caught it first)
    gw = start_gateway(model_path, lying_swarm, "--verify_rate", "0.001", "--verify_holdback", "4")
    try:
        liar = lying_swarm["liar"].peer_id
        first = [{"role": "user", "content": "Name three rivers of Europe."}]
        # streamed, through the liar (routing prefers it): its text waits for checks, the wrong picks are redone
        assert chat(gw, first, stream=True) == reference_text(tokenizer, reference_model, first, NEW)
        assert metric(gw.url, "swarmgate_verify_mismatches_total") == 1
        assert metric(gw.url, "swarmgate_verify_distrusted", f'peer_id="{liar}"') == 1
        assert metric(gw.url, "swarmgate_verify_checks_total") >= 2
        assert metric(gw.url, "swarmgate_verify_retracted_tokens_total") >= 1
        status = httpx.get(gw.url + "/status.json", timeout=30).json()
        marks = {s["peer_id"]: s["distrusted"] for s in status["servers"]}
        assert marks[liar] is True and sum(marks.values()) == 1, marks
        assert status["verification"]["distrusted"] == [liar]
        # not streamed, on the honest servers: the same text as transformers, no new alarm
        second = [{"role": "user", "content": "What is the capital of Italy?"}]
        assert chat(gw, second, stream=False) == reference_text(tokenizer, reference_model, second, NEW)
        assert metric(gw.url, "swarmgate_verify_mismatches_total") == 1
    finally:
        gw.proc.terminate()


def test_a_check_asked_for_waits_for_the_checks_and_retracts(lying_swarm, model_path, tokenizer, reference_model):
    # a direct client without random checks: only the liar's first check runs (in the background, at the prompt,
    # which it serves honestly); the check asked for (what the gateway's hold-back does) makes its step wait for
    # the checks of every span and retract from the liar's first lie on; greedy decoding from there gives the
    # reference text
    model = AutoDistributedModelForCausalLM.from_pretrained(
        model_path, initial_peers=lying_swarm["initial_peers"], dht_prefix=lying_swarm["prefix"], verify=True,
        verify_probability=0.0, max_retries=3)
    liar = lying_swarm["liar"].peer_id
    prompt = tokenizer("The capital of France is", return_tensors="pt")["input_ids"]
    prompt_len = prompt.shape[1]
    reference = reference_model.generate(prompt, max_new_tokens=NEW, do_sample=False)
    try:
        with model.inference_session(max_length=prompt_len + NEW) as session:
            ids = prompt
            for _ in range(PERTURB_AFTER + 2):  # the liar lies from its PERTURB_AFTER + 1-th step (the prompt's: 1)
                ids = torch.cat([ids, session.feed(ids).argmax(-1, keepdim=True)], dim=1)
            assert session.servers() == [liar]  # routing prefers it; nothing caught it yet
            assert session.check_next_step()
            with pytest.raises(OutputsRetracted) as retracted:
                session.feed(ids)
            assert retracted.value.position == prompt_len + PERTURB_AFTER - 1  # its first wrong output
            assert liar not in session.servers()
            ids = ids[:, :retracted.value.position + 1]
            out = model.generate(ids, session=session, max_new_tokens=prompt_len + NEW - ids.shape[1],
                                 do_sample=False)
        stats = verifier_for(model.manager).stats
        assert stats.mismatches == 1 and stats.distrusted == [liar], stats
        assert out.tolist() == reference.tolist()
    finally:
        model.shutdown()


def test_one_server_per_span_is_counted_unverifiable(swarms, model_path, tokenizer, reference_model):
    gw = start_gateway(model_path, swarms.get(SPANS), "--verify_rate", "1", name="gateway-verify")
    try:
        messages = [{"role": "user", "content": "Say hello."}]
        assert chat(gw, messages, True, SHORT) == reference_text(tokenizer, reference_model, messages, SHORT)
        assert metric(gw.url, "swarmgate_verify_unverifiable_total") >= 2 * SHORT  # both spans, every step
        assert metric(gw.url, "swarmgate_verify_checks_total") == 0
        assert metric(gw.url, "swarmgate_verify_mismatches_total") == 0
        status = httpx.get(gw.url + "/status.json", timeout=30).json()
        assert not any(s["distrusted"] for s in status["servers"]) and status["verification"]["distrusted"] == []
    finally:
        gw.proc.terminate()
