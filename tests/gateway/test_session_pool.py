"""Pooled conversation sessions end to end: the `openai` SDK against real gateway processes on a real swarm
(bootstrap + servers 0:15 and 15:30). Each turn's text is compared with local `transformers` greedy output,
`usage.prompt_tokens_details.cached_tokens` with the prefix that the chat template shares with what the
servers held after the previous turn, and the servers' `inference_tokens_processed` counters with the tokens
that had to be sent: (prompt - cached) + (completion - 1), the last generated token being never fed."""
from __future__ import annotations

import threading

import httpx
import pytest
import torch

from launch.topology import terminate_all
from tests.fixtures.gateway_fixtures import (  # noqa: F401
    SPANS,
    one_torch_thread,
    server_stats,
    start_gateway,
    swarm_model,
    wait_until,
)

MODEL = "smollm2-135m-instruct"


# ---- helpers ------------------------------------------------------------------------------------------------------
def prompt_ids(tokenizer, messages):
    return list(tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_dict=True)["input_ids"])


def reference(tokenizer, reference_model, messages, max_tokens: int):
    """(text, prompt ids, generated ids) of local greedy generation."""
    ids = prompt_ids(tokenizer, messages)
    with torch.no_grad():
        out = reference_model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                                       max_new_tokens=max_tokens, do_sample=False)
    generated = out[0, len(ids):].tolist()
    return tokenizer.decode(generated, skip_special_tokens=True), ids, generated


def common_prefix(a, b) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def expected_cached(held, new_prompt) -> int:
    """What a pooled session holding `held` can spare of `new_prompt` (its last token is always sent)."""
    return min(common_prefix(held, new_prompt), len(new_prompt) - 1)


def processed(model, swarm) -> dict:
    return {p: s.inference_tokens_processed for p, s in server_stats(model, swarm).items()}


def metric(gateway, name: str) -> float:
    for line in httpx.get(gateway.url + "/metrics").text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[-1])
    return 0.0


class Turns:
    """Runs chat turns through a gateway and checks each against the reference and the servers' counters."""

    def __init__(self, gateway, swarm_model, tokenizer, reference_model, api_key: str):
        self.gateway, self.model = gateway, swarm_model
        self.tokenizer, self.reference_model = tokenizer, reference_model
        self.client = gateway.client(api_key=api_key)

    def turn(self, messages, max_tokens: int, stream: bool = False, check_counters: bool = True):
        """Returns (text, cached_tokens, held): `held` are the ids the servers hold after this turn."""
        expected_text, ids, generated = reference(self.tokenizer, self.reference_model, messages, max_tokens)
        before = processed(self.model, self.gateway.swarm) if check_counters else None
        if stream:
            text, usage = "", None
            for chunk in self.client.chat.completions.create(model=MODEL, messages=messages, temperature=0,
                                                             max_tokens=max_tokens, stream=True,
                                                             stream_options={"include_usage": True}):
                if chunk.usage is not None:
                    usage = chunk.usage
                for choice in chunk.choices:
                    text += choice.delta.content or ""
        else:
            r = self.client.chat.completions.create(model=MODEL, messages=messages, temperature=0,
                                                    max_tokens=max_tokens)
            text, usage = r.choices[0].message.content, r.usage
        assert text == expected_text
        assert usage.prompt_tokens == len(ids) and usage.completion_tokens == len(generated)
        cached = usage.prompt_tokens_details.cached_tokens
        if check_counters:
            after = processed(self.model, self.gateway.swarm)
            sent = usage.prompt_tokens - cached + usage.completion_tokens - 1
            assert {p: after[p] - before[p] for p in after} == {p: sent for p in after}, (cached, usage)
        return text, cached, ids + generated[:-1]


@pytest.fixture(scope="module")
def swarm(swarms):
    return swarms.get(SPANS)


@pytest.fixture(scope="module")
def gateway(swarm, model_path):
    gw = start_gateway(model_path, swarm, "--max_concurrent", "4", name="gateway-pool")
    yield gw
    gw.proc.terminate()


@pytest.fixture(scope="module")
def small_gateways(swarm, model_path):
    """{'one': a pool of one session, 'short': a pool whose sessions expire after 2 s idle}"""
    from tests.fixtures.gateway_fixtures import ready, spawn_gateway

    one = spawn_gateway(model_path, swarm["initial_peers"], swarm["prefix"], "--pool_max_sessions", "1",
                        name="gateway-pool-one")
    short = spawn_gateway(model_path, swarm["initial_peers"], swarm["prefix"], "--pool_ttl", "2",
                          name="gateway-pool-short")
    try:
        gateways = {"one": ready(one, swarm), "short": ready(short, swarm)}
    except BaseException:
        one.kill()
        short.kill()
        raise
    yield gateways
    terminate_all([gw.proc for gw in gateways.values()])


# ---- tests --------------------------------------------------------------------------------------------------------
def test_three_turns_send_only_new_tokens(gateway, swarm_model, tokenizer, reference_model):
    turns = Turns(gateway, swarm_model, tokenizer, reference_model, api_key="conversation-1")
    hits = metric(gateway, "swarmgate_pool_hits_total")
    messages = [{"role": "user", "content": "Name a famous bridge and the city it is in."}]
    text, cached, held = turns.turn(messages, 30)
    assert cached == 0
    for k, (question, stream) in enumerate([("Why is it famous?", False), ("How long is it?", True)]):
        previous_prompt = prompt_ids(tokenizer, messages)
        messages = messages + [{"role": "assistant", "content": text}, {"role": "user", "content": question}]
        want = expected_cached(held, prompt_ids(tokenizer, messages))
        assert want >= len(previous_prompt)  # at least the previous prompt, plus the answer as far as it re-renders
        text, cached, held = turns.turn(messages, 30, stream=stream)
        assert cached == want, f"turn {k + 2}"
    assert metric(gateway, "swarmgate_pool_hits_total") == hits + 2
    assert metric(gateway, "swarmgate_pool_reused_tokens_total") >= cached
    assert metric(gateway, "swarmgate_pool_sessions") >= 1
    assert metric(gateway, "swarmgate_active_sessions") == 0


def test_edited_history_rewinds_to_the_common_prefix(gateway, swarm_model, tokenizer, reference_model):
    turns = Turns(gateway, swarm_model, tokenizer, reference_model, api_key="conversation-2")
    first = [{"role": "user", "content": "Give me a name for a grey cat."}]
    text1, _, _ = turns.turn(first, 24)
    second = first + [{"role": "assistant", "content": text1}, {"role": "user", "content": "Now one for a dog."}]
    _, cached, held = turns.turn(second, 12)
    assert cached > 0
    edited = first + [{"role": "assistant", "content": text1}, {"role": "user", "content": "Now one for a horse."}]
    want = expected_cached(held, prompt_ids(tokenizer, edited))
    assert want < len(held) - 1  # a real divergence: the servers must drop what follows the common prefix
    _, cached, _ = turns.turn(edited, 12)
    assert cached == want


def test_two_concurrent_continuations_both_correct(gateway, swarm_model, tokenizer, reference_model):
    turns = Turns(gateway, swarm_model, tokenizer, reference_model, api_key="conversation-3")
    first = [{"role": "user", "content": "Suggest a fruit for breakfast."}]
    text1, _, held = turns.turn(first, 20)
    branches = [first + [{"role": "assistant", "content": text1}, {"role": "user", "content": q}]
                for q in ("Why that one?", "Suggest another one.")]
    expected = [reference(tokenizer, reference_model, b, 16)[0] for b in branches]
    results, errors = {}, []

    def worker(i):
        try:
            r = turns.client.chat.completions.create(model=MODEL, messages=branches[i], temperature=0, max_tokens=16)
            results[i] = (r.choices[0].message.content, r.usage.prompt_tokens_details.cached_tokens)
        except Exception as e:  # reported below
            errors.append(repr(e))

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(180)
    assert not errors, errors
    assert [results[i][0] for i in range(2)] == expected
    # at most one of them continued the pooled session; the other opened its own (or, if they did not overlap,
    # continued the first one's, rewound): never the same session twice at once
    wants = [expected_cached(held, prompt_ids(tokenizer, b)) for b in branches]
    assert any(results[i][1] == wants[i] for i in range(2)), (results, wants)


def test_evicted_session_falls_back_cleanly(small_gateways, swarm_model, tokenizer, reference_model):
    gw = small_gateways["one"]  # a pool of one session
    turns = Turns(gw, swarm_model, tokenizer, reference_model, api_key="conversation-4")
    other = Turns(gw, swarm_model, tokenizer, reference_model, api_key="conversation-4b")
    a = [{"role": "user", "content": "What colour is the sky at noon?"}]
    b = [{"role": "user", "content": "What colour is the sky at noon? Answer briefly."}]
    text_a, _, _ = turns.turn(a, 16)
    evicted = metric(gw, 'swarmgate_pool_evictions_total{reason="capacity"}')
    _, cached_b, _ = other.turn(b, 16)  # another key: never a's session; pooling b evicts a
    assert cached_b == 0
    assert metric(gw, 'swarmgate_pool_evictions_total{reason="capacity"}') == evicted + 1
    a2 = a + [{"role": "assistant", "content": text_a}, {"role": "user", "content": "And at night?"}]
    _, cached, _ = turns.turn(a2, 16)
    assert cached == 0


def test_expired_session_falls_back_cleanly(small_gateways, swarm_model, tokenizer, reference_model):
    gw = small_gateways["short"]  # pooled sessions expire after 2 s idle
    turns = Turns(gw, swarm_model, tokenizer, reference_model, api_key="conversation-5")
    first = [{"role": "user", "content": "Name a planet with rings."}]
    text1, _, _ = turns.turn(first, 16)
    assert wait_until(lambda: metric(gw, "swarmgate_pool_sessions") == 0, timeout=30)
    assert metric(gw, 'swarmgate_pool_evictions_total{reason="ttl"}') >= 1
    second = first + [{"role": "assistant", "content": text1}, {"role": "user", "content": "Which is largest?"}]
    _, cached, _ = turns.turn(second, 16)
    assert cached == 0


# ---- a swarm with no cache to spare ---------------------------------------------------------------------------------
TIGHT_CACHE = 400  # tokens: three pooled sessions of this test fill the server


@pytest.fixture(scope="module")
def tight(model_path, bootstrap):
    """One server (all blocks) with a 400-token cache that refuses sessions after 1 s, and a gateway over it whose
    pooled sessions reserve 16-token prompts' worth of headroom (the pool's own limits never bind here)."""
    from launch.topology import start_server
    from swarm import AutoDistributedModelForCausalLM

    prefix = "tpool-tight"
    server = start_server(model_path, [bootstrap.maddr], "0:30", prefix,
                          ["--throughput", "10", "--attn_cache_tokens", str(TIGHT_CACHE), "--alloc_timeout", "1"],
                          name="server-tpool-tight", threads=1)
    gw = model = None
    try:
        server.wait_ready(300)
        swarm = {"prefix": prefix, "servers": [server], "initial_peers": [bootstrap.maddr]}
        gw = start_gateway(model_path, swarm, "--pool_headroom", "64", "--pool_max_tokens", "100000",
                           name="gateway-pool-tight")
        model = AutoDistributedModelForCausalLM.from_pretrained(model_path, initial_peers=[bootstrap.maddr],
                                                                dht_prefix=prefix)
        yield gw, model
    finally:
        if model is not None:
            model.shutdown()
        if gw is not None:
            gw.proc.terminate()
        server.terminate()


def test_out_of_cache_evicts_pooled_sessions_and_retries(tight, tokenizer, reference_model):
    gw, model = tight
    questions = ["Name a red fruit.", "Name a green vegetable.", "Name a blue flower.", "Name a yellow bird."]
    for i, q in enumerate(questions):  # each pooled session reserves ~38 + 16 + 64 tokens of the 400
        turns = Turns(gw, model, tokenizer, reference_model, api_key=f"conversation-6-{i}")  # no reuse among them
        _, cached, _ = turns.turn([{"role": "user", "content": q}], 16)
        assert cached == 0
        if i < 3:
            assert metric(gw, "swarmgate_pool_sessions") == i + 1
    # the fourth could not open until the least recently used pooled session was closed; no error reached us
    evicted = (metric(gw, 'swarmgate_pool_evictions_total{reason="out_of_cache"}')
               + metric(gw, 'swarmgate_pool_evictions_total{reason="open_failed"}'))
    assert evicted >= 1
    stats = model.manager.server_info(gw.swarm["servers"][0].peer_id)
    assert stats.cache_tokens_used <= TIGHT_CACHE and stats.sessions_open == metric(gw, "swarmgate_pool_sessions")
