"""Quantized block servers end to end: real servers with int8 / nf4 blocks against the same model quantized the same
way by transformers + bitsandbytes locally; mixed swarms; the clients' choice of weight formats."""
from __future__ import annotations

import pytest
import torch

from launch.topology import start_server, terminate_all, wait_all
from swarm import AutoDistributedModelForCausalLM
from swarm.wire.records import fetch_block_records

SPANS = ("0:15", "15:30")
PROMPTS = [
    "The history of the Roman Empire begins",
    "def fibonacci(n):\n    ",
    "Three things every gardener should know about soil are",
]
NEW_TOKENS = 16


@pytest.fixture(scope="module")
def quantized(swarms, model_path, bundled_quantized):
    """quant_type -> (swarm, client model, local reference), each built once per type; `get(quant_type,
    reference=False)` leaves the reference (a whole model quantized locally) unbuilt, for tests that need none."""
    made: dict = {}
    references: dict = {}

    def get(quant_type: str, reference: bool = True):
        if quant_type not in made:
            swarm = swarms.get(SPANS, ("--quant_type", quant_type))
            made[quant_type] = (swarm, AutoDistributedModelForCausalLM.from_pretrained(
                model_path, initial_peers=swarm["initial_peers"], dht_prefix=swarm["prefix"]))
        if reference and quant_type not in references:
            references[quant_type] = bundled_quantized(quant_type)  # the session's (tests/fixtures/quant_reference.py)
        return (*made[quant_type], references.get(quant_type))

    yield get
    for _, model in made.values():
        model.shutdown()


@pytest.mark.parametrize("quant_type", ["int8", "nf4"])
def test_quantized_swarm_generates_what_the_locally_quantized_model_does(quant_type, quantized, tokenizer):
    swarm, model, reference = quantized(quant_type)
    assert [s.ready["quant_type"] for s in swarm["servers"]] == [quant_type, quant_type]
    records = fetch_block_records(model.manager.dht, swarm["prefix"], 30)
    assert {info.quant_type for block in records for info in block.values()} == {quant_type}
    for prompt in PROMPTS:
        ids = tokenizer(prompt, return_tensors="pt")["input_ids"]
        ours = model.generate(ids, max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, do_sample=False)
        with torch.no_grad():
            ref = reference.generate(ids, max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, do_sample=False)
        assert ours.tolist() == ref.tolist(), (tokenizer.decode(ours[0]), tokenizer.decode(ref[0]))


def test_concurrent_int8_sessions_are_batched_and_each_what_the_local_model_computes(quantized, tokenizer):
    """Three sessions in lockstep on the int8 swarm: the servers merge their steps (each session's rows quantized on
    their own, `swarm.modeling.int8_rows`), and every session's tokens are transformers' int8 model's for it alone."""
    from concurrent.futures import ThreadPoolExecutor

    swarm, model, reference = quantized("int8")
    prompts = [tokenizer(p, return_tensors="pt")["input_ids"] for p in PROMPTS]
    steps = 8
    with torch.no_grad():
        expected = [reference.generate(ids, max_new_tokens=steps, min_new_tokens=steps, do_sample=False)
                    for ids in prompts]
    sessions = [model.inference_session(max_length=64) for _ in prompts]
    outputs = list(prompts)
    try:
        with ThreadPoolExecutor(len(prompts)) as pool:
            for _ in range(steps):  # every session's step in flight at once
                logits = list(pool.map(lambda pair: pair[0].feed(pair[1]), zip(sessions, outputs)))
                outputs = [torch.cat([ids, lg.argmax(-1, keepdim=True)], dim=1) for ids, lg in zip(outputs, logits)]
    finally:
        for session in sessions:
            session.close()
    for out, ref in zip(outputs, expected):
        assert out.tolist() == ref.tolist(), (tokenizer.decode(out[0]), tokenizer.decode(ref[0]))
    stats = [model.manager.server_info(s.peer_id) for s in swarm["servers"]]
    assert max(s.largest_batch for s in stats) >= 2


@pytest.mark.parametrize("quant_type", ["int8", "nf4"])
def test_a_quantized_session_goes_on_across_turns(quant_type, quantized, tokenizer):
    _, model, reference = quantized(quant_type)
    first = tokenizer(PROMPTS[0], return_tensors="pt")["input_ids"]
    follow_up = tokenizer(" and then", return_tensors="pt", add_special_tokens=False)["input_ids"]
    with model.inference_session(max_length=128) as session:
        turn1 = model.generate(first, session=session, max_new_tokens=8, min_new_tokens=8, do_sample=False)
        turn2 = model.generate(torch.cat([turn1, follow_up], dim=1), session=session, max_new_tokens=8,
                               min_new_tokens=8, do_sample=False)
    # the reference keeps its KV cache between turns too: LLM.int8() picks outlier columns from the rows of each
    # call, so a turn must send the same rows (only its new tokens) for the same numbers
    with torch.no_grad():
        out1 = reference.generate(first, max_new_tokens=8, min_new_tokens=8, do_sample=False,
                                  return_dict_in_generate=True)
        ref1 = out1.sequences
        ref2 = reference.generate(torch.cat([ref1, follow_up], dim=1), past_key_values=out1.past_key_values,
                                  max_new_tokens=8, min_new_tokens=8, do_sample=False)
    assert turn1.tolist() == ref1.tolist() and turn2.tolist() == ref2.tolist()


def test_clients_choose_the_weight_formats_they_accept(quantized, model_path):
    swarm, _, _ = quantized("nf4", reference=False)
    strict = AutoDistributedModelForCausalLM.from_pretrained(
        model_path, initial_peers=swarm["initial_peers"], dht_prefix=swarm["prefix"], allowed_quant_types=["none"])
    try:
        with pytest.raises(Exception, match="nf4"):
            strict.generate(torch.tensor([[1, 2, 3]]), max_new_tokens=1)
    finally:
        strict.shutdown()


def test_quality_against_float32_is_reported(model_path):
    """Reported, not asserted as equality (bench_quant prints it too): loose bounds that catch a broken
    quantization (random-level agreement) without pinning bitsandbytes' exact numerics."""
    from bench.bench_quant import quality

    figures = quality(model_path)
    print("quality vs float32:", figures)
    assert figures["int8"]["top1_agreement_vs_fp32"] >= 0.85 and figures["nf4"]["top1_agreement_vs_fp32"] >= 0.6
    assert figures["int8"]["mean_kl_vs_fp32"] < figures["nf4"]["mean_kl_vs_fp32"] < 1.0


def test_a_mixed_swarm_fails_over_from_nf4_to_int8_to_float(model_path, bootstrap, tokenizer):
    prefix, peers = "tquant-mixed", [bootstrap.maddr]
    servers = wait_all([start_server(model_path, peers, "0:15", prefix, threads=1, name="mixed-float"),
                        start_server(model_path, peers, "15:30", prefix, ("--quant_type", "nf4"), threads=1,
                                     name="mixed-nf4")], 180)
    spares: list = []
    model = AutoDistributedModelForCausalLM.from_pretrained(model_path, initial_peers=peers, dht_prefix=prefix)
    try:
        ids = tokenizer(PROMPTS[2], return_tensors="pt")["input_ids"]
        with model.inference_session(max_length=96) as session:
            out = model.generate(ids, session=session, max_new_tokens=6, do_sample=False, min_new_tokens=6)
            assert servers[1].peer_id in [hop.peer_id for hop in session.session.chain]
            victim = servers[1]
            for quant_type in ("int8", "none"):  # nf4 -> int8 -> float, each replacement up before the kill
                spare = wait_all([start_server(model_path, peers, "15:30", prefix, ("--quant_type", quant_type),
                                               threads=1, name=f"mixed-{quant_type}")], 180)[0]
                spares.append(spare)
                victim.kill()
                out = model.generate(torch.cat([out, ids[:, :3]], dim=1), session=session, max_new_tokens=6,
                                     min_new_tokens=6, do_sample=False)
                assert spare.peer_id in [hop.peer_id for hop in session.session.chain]
                assert model.manager.server_info(spare.peer_id).inference_tokens_processed > 0
                victim = spare
        assert out.shape[1] == ids.shape[1] + 6 + 2 * (3 + 6)
    finally:
        model.shutdown()
        terminate_all(servers + spares)
