"""End to end on real processes: a bootstrap peer, block servers, the client model; compared with transformers."""
from __future__ import annotations

import json
import time

import pytest
import torch
from hivemind.proto import runtime_pb2

from swarm import AutoDistributedModelForCausalLM
from swarm.client.transport.session import SessionError
from swarm.runtime import aio

TOPOLOGIES = [("0:15", "15:30"), ("0:20", "10:30"), ("0:10", "10:20", "20:30")]
PROMPTS = [
    "The history of the Roman Empire begins",
    "def fibonacci(n):\n    ",
    "Three things every gardener should know about soil are",
]
NEW_TOKENS = 32


@pytest.fixture(scope="module")
def clients(swarms, model_path):
    made = {}

    def get(spans):
        if spans not in made:
            swarm = swarms.get(spans)
            made[spans] = AutoDistributedModelForCausalLM.from_pretrained(
                model_path, initial_peers=swarm["initial_peers"], dht_prefix=swarm["prefix"]
            )
        return made[spans]

    yield get
    for model in made.values():
        model.shutdown()


def _server_stats(model, swarm):
    return {s.peer_id: model.manager.server_info(s.peer_id) for s in swarm["servers"]}


@pytest.mark.parametrize("spans", TOPOLOGIES, ids=["+".join(t) for t in TOPOLOGIES])
def test_greedy_generation_matches_transformers(spans, clients, reference_model, tokenizer):
    model = clients(spans)
    for prompt in PROMPTS:
        ids = tokenizer(prompt, return_tensors="pt")["input_ids"]
        ours = model.generate(ids, max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, do_sample=False)
        ref = reference_model.generate(ids, max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, do_sample=False)
        assert ours.shape[1] == ids.shape[1] + NEW_TOKENS
        assert ours.tolist() == ref.tolist(), (tokenizer.decode(ours[0]), tokenizer.decode(ref[0]))
        with torch.no_grad():
            ref_logits = reference_model(ours).logits[:, -1]
        our_logits = model(ours).logits[:, -1]
        assert (our_logits - ref_logits).abs().max().item() < 1e-3
        # the same last-position logits through an inference session (cached path)
        with model.inference_session(max_length=ours.shape[1]) as session:
            session.feed(ours[:, :-5])
            cached_logits = session.feed(ours)
        assert (cached_logits - ref_logits).abs().max().item() < 1e-3


def test_session_reuse_sends_only_new_tokens(clients, swarms, reference_model, tokenizer):
    spans = TOPOLOGIES[0]
    model, swarm = clients(spans), swarms.get(spans)
    turn1 = tokenizer.apply_chat_template([{"role": "user", "content": "Name a fruit."}], add_generation_prompt=True,
                                          return_tensors="pt", return_dict=True)["input_ids"]
    with model.inference_session(max_length=256) as session:
        out1 = model.generate(turn1, session=session, max_new_tokens=12, do_sample=False)
        follow = tokenizer("<|im_end|>\n<|im_start|>user\nAnd a vegetable?<|im_end|>\n<|im_start|>assistant\n",
                           return_tensors="pt", add_special_tokens=False)["input_ids"]
        turn2 = torch.cat([out1, follow], dim=1)
        before = _server_stats(model, swarm)
        out2 = model.generate(turn2, session=session, max_new_tokens=12, do_sample=False)
        after = _server_stats(model, swarm)
    one_call = model.generate(turn2, max_new_tokens=12, do_sample=False)
    assert out2.tolist() == one_call.tolist()
    ref = reference_model.generate(turn2, max_new_tokens=12, do_sample=False)
    assert out2.tolist() == ref.tolist()
    new_generated = out2.shape[1] - turn2.shape[1]
    # the session held out1 minus its last token; the second call sends the rest of turn2, then one token a step
    expected = (turn2.shape[1] - (out1.shape[1] - 1)) + (new_generated - 1)
    for peer_id in before:
        sent = after[peer_id].inference_tokens_processed - before[peer_id].inference_tokens_processed
        assert sent == expected, (peer_id, sent, expected)


def test_rewind_on_diverging_input(clients, reference_model, tokenizer):
    model = clients(TOPOLOGIES[0])
    a = tokenizer("My favourite colour is blue because", return_tensors="pt")["input_ids"]
    b = tokenizer("My favourite colour is green because", return_tensors="pt")["input_ids"]
    with model.inference_session(max_length=64) as session:
        model.generate(a, session=session, max_new_tokens=4, do_sample=False)
        out = model.generate(b, session=session, max_new_tokens=8, do_sample=False)
    ref = reference_model.generate(b, max_new_tokens=8, do_sample=False)
    assert out.tolist() == ref.tolist()


def test_closing_a_session_frees_server_cache(clients, quiet_swarm):
    spans = TOPOLOGIES[0]  # quiet_swarm: no shared gateway's pooled session on it that could expire in between
    model, swarm = clients(spans), quiet_swarm
    session = model.inference_session(max_length=100)
    session.feed(torch.tensor([[1, 2, 3, 4]]))
    during = _server_stats(model, swarm)
    assert all(s.cache_tokens_used >= 100 and s.sessions_open >= 1 for s in during.values())
    session.close()
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        after = _server_stats(model, swarm)
        if all(a.cache_tokens_used == d.cache_tokens_used - 100 for a, d in zip(after.values(), during.values())):
            break
        time.sleep(0.2)
    assert all(a.cache_tokens_used == d.cache_tokens_used - 100 for a, d in zip(after.values(), during.values()))
    assert all(a.sessions_open == d.sessions_open - 1 for a, d in zip(after.values(), during.values()))


def test_exceeding_max_length_is_a_clear_error(clients):
    model = clients(TOPOLOGIES[0])
    with model.inference_session(max_length=8) as session:
        session.feed(torch.tensor([[1, 2, 3, 4, 5, 6]]))
        with pytest.raises(SessionError, match="max_length"):
            session.feed(torch.tensor([[1, 2, 3, 4, 5, 6, 7, 8, 9, 10]]))
        # the session is still usable after the refused step
        logits = session.feed(torch.tensor([[1, 2, 3, 4, 5, 6, 7, 8]]))
        assert logits.shape == (1, model.config.vocab_size)
    with model.inference_session(max_length=8) as session:
        with pytest.raises(SessionError, match="max_length"):
            model.generate(torch.tensor([[1, 2, 3, 4, 5, 6]]), session=session, max_new_tokens=10)


def test_client_holds_no_block_weights(clients):
    model = clients(TOPOLOGIES[0])
    config = model.config
    total = sum(p.numel() for p in model.parameters())
    # tied embeddings / LM head + final norm, nothing else
    assert total == config.vocab_size * config.hidden_size + config.hidden_size
    assert not any("layers" in name for name, _ in model.named_parameters())


def test_sampling_is_seeded_and_valid(clients):
    model = clients(TOPOLOGIES[0])
    ids = torch.tensor([[1, 504, 3458, 314]])
    torch.manual_seed(7)
    a = model.generate(ids, max_new_tokens=6, do_sample=True, temperature=0.8, top_k=20, top_p=0.9,
                       repetition_penalty=1.1)
    torch.manual_seed(7)
    b = model.generate(ids, max_new_tokens=6, do_sample=True, temperature=0.8, top_k=20, top_p=0.9,
                       repetition_penalty=1.1)
    assert a.tolist() == b.tolist() and a.shape[1] <= ids.shape[1] + 6
    with pytest.raises(TypeError, match="unexpected"):
        model.generate(ids, max_new_tokens=2, no_such_argument=3)


@pytest.mark.parametrize("use_push", [True, False])
def test_decode_steps_are_pushed_between_servers(use_push, swarms, model_path, reference_model):
    spans = TOPOLOGIES[2]  # three servers
    swarm = swarms.get(spans)
    model = AutoDistributedModelForCausalLM.from_pretrained(
        model_path, initial_peers=swarm["initial_peers"], dht_prefix=swarm["prefix"], use_push=use_push)
    try:
        ids = torch.tensor([[1, 504, 3458, 314, 4086]])
        before = _server_stats(model, swarm)
        out = model.generate(ids, max_new_tokens=8, min_new_tokens=8, do_sample=False)
        after = _server_stats(model, swarm)
        assert out.tolist() == reference_model.generate(ids, max_new_tokens=8, min_new_tokens=8,
                                                        do_sample=False).tolist()
        steps = {p: after[p].inference_steps - before[p].inference_steps for p in after}
        from_push = {p: after[p].steps_from_push - before[p].steps_from_push for p in after}
        first = swarm["servers"][0].peer_id  # blocks 0:10
        assert all(n == 8 for n in steps.values())  # prefill + 7 decode steps on every server
        if use_push:  # every decode step is pushed; the prefill goes through the client
            assert from_push[first] == 0
            assert all(from_push[p] == steps[p] - 1 for p in after if p != first)
        else:
            assert all(n == 0 for n in from_push.values())
    finally:
        model.shutdown()


def test_concurrent_sessions_are_batched_and_correct(clients, swarms, reference_model, tokenizer):
    from concurrent.futures import ThreadPoolExecutor

    spans = TOPOLOGIES[0]
    model, swarm = clients(spans), swarms.get(spans)
    prompts = [tokenizer(p, return_tensors="pt")["input_ids"] for p in PROMPTS + ["Once upon a time"]]
    expected = [reference_model.generate(ids, max_new_tokens=10, min_new_tokens=10, do_sample=False)
                for ids in prompts]
    sessions = [model.inference_session(max_length=64) for _ in prompts]
    outputs = [ids for ids in prompts]
    try:
        with ThreadPoolExecutor(len(prompts)) as pool:
            for _ in range(10):  # lockstep: every session's step is in flight at once
                logits = list(pool.map(lambda pair: pair[0].feed(pair[1]), zip(sessions, outputs)))
                outputs = [torch.cat([ids, lg.argmax(-1, keepdim=True)], dim=1) for ids, lg in zip(outputs, logits)]
    finally:
        for s in sessions:
            s.close()
    for out, ref in zip(outputs, expected):
        assert out.tolist() == ref.tolist()
    stats = _server_stats(model, swarm)
    assert max(s.largest_batch for s in stats.values()) >= 2


def test_no_repeat_ngram_and_bad_words_match_transformers(clients, reference_model, tokenizer):
    """Settings that were silently ignored (issue 23) are applied on a real swarm, as transformers applies them."""
    model = clients(TOPOLOGIES[0])
    ids = tokenizer(PROMPTS[0], return_tensors="pt")["input_ids"]
    bad = [tokenizer(w, add_special_tokens=False)["input_ids"] for w in (" the", " Roman Empire")]
    settings = dict(max_new_tokens=24, do_sample=False, no_repeat_ngram_size=2, bad_words_ids=bad)
    ours = model.generate(ids, **settings)
    ref = reference_model.generate(ids, **settings)
    assert ours.tolist() == ref.tolist(), (tokenizer.decode(ours[0]), tokenizer.decode(ref[0]))
    assert ours.tolist() != model.generate(ids, max_new_tokens=24, do_sample=False).tolist()  # the settings acted


# the fields of `ServerStats` that clients have parsed since the RPC began (they reject any other field)
SERVER_STATS_V1_FIELDS = {
    "v", "type", "version", "model", "start", "end", "num_blocks_total", "dtype", "hidden_size", "cache_tokens_total",
    "cache_tokens_used", "sessions_open", "streams_open", "inference_tokens_processed", "inference_steps",
    "forward_tokens_processed", "steps_from_push", "pushes_sent", "pushes_refused", "decode_batches",
    "largest_batch", "decode_compute_seconds", "training_tokens_processed", "limits"}


def test_routing_time_and_dht_traffic_are_reported(clients, swarms):
    """The client reports each inference chain's routing time (view + search), and each server reports its DHT
    peer's traffic counters through `rpc_dht_traffic` (its announcements are stores it made), while its info stays
    what older clients parse."""
    spans = TOPOLOGIES[0]
    model, swarm = clients(spans), swarms.get(spans)
    timings = []
    model.manager.on_route = timings.append
    try:
        model.manager.update(force=True)  # the view is fresh: this route's view part is only the lock
        model.check_route(16)
        model.manager._last_update = 0.0  # due for a refresh: this route reads the DHT records and pings
        model.check_route(16)
        assert model.manager._last_update > 0.0  # the second route did read the records
    finally:
        model.manager.on_route = None
    assert len(timings) == 2 and all(t.search_s > 0 and t.total_s == t.view_s + t.search_s for t in timings)
    assert all(t.view_s >= 0 for t in timings)
    for server in swarm["servers"]:
        traffic = aio.run(model.manager.dht_traffic(server.peer_id), timeout=60)
        assert traffic is not None
        assert traffic.calls_made.get("store", 0) >= 1 and traffic.sent_bytes > 0
        # the info a client from before rpc_dht_traffic parses: exactly the fields it knows (it rejects others)
        info = aio.run(model.manager.stub(server.peer_id).rpc_info(runtime_pb2.ExpertUID(uid=""), timeout=60),
                       timeout=90)
        assert set(json.loads(info.serialized_info)) == SERVER_STATS_V1_FIELDS
