"""The OpenAI-compatible gateway, end to end: the official `openai` SDK against real gateway processes on a
real local swarm (bootstrap + servers 0:15 and 15:30), compared with local `transformers` output."""
from __future__ import annotations

import json
import threading
import time

import httpx
import openai
import pytest
import torch

from tests.fixtures.gateway_fixtures import (  # noqa: F401
    API_KEY,
    client,
    gateway,
    one_torch_thread,
    reference_text,
    server_stats,
    side_gateways,
    swarm_model,
    wait_until,
)

MODEL = "smollm2-135m-instruct"
QUESTION = [{"role": "user", "content": "What are three good reasons to learn to play the piano?"}]


def stream_text(client, **kwargs):
    """(text, finish_reason, chunks) of a streamed chat completion with n=1."""
    text, finish, chunks = "", [], []
    for chunk in client.chat.completions.create(stream=True, **kwargs):
        chunks.append(chunk)
        for choice in chunk.choices:
            text += choice.delta.content or ""
            if choice.finish_reason:
                finish.append(choice.finish_reason)
    assert len(finish) == 1, finish
    return text, finish[0], chunks


def sse_events(response: httpx.Response):
    """Raw SSE lines of a response: ('data', payload) and ('comment', text)."""
    for line in response.iter_lines():
        if line.startswith("data: "):
            yield "data", line[len("data: "):]
        elif line.startswith(":"):
            yield "comment", line[1:]


@pytest.fixture(scope="module")
def greedy_reference(tokenizer, reference_model):
    return reference_text(tokenizer, reference_model, QUESTION, 40)


# ---- basics -------------------------------------------------------------------------------------------------------
def test_models_health_metrics_request_id(gateway, client):
    models = client.models.list().data
    assert [m.id for m in models] == [MODEL]
    assert models[0].model_extra["context_length"] == 8192
    health = httpx.get(gateway.url + "/health")
    assert health.status_code == 200 and health.json()["status"] == "ok"
    echoed = httpx.get(gateway.url + "/v1/models", headers={"X-Request-Id": "my-id-42"})
    assert echoed.headers["x-request-id"] == "my-id-42"
    assert len(httpx.get(gateway.url + "/v1/models").headers["x-request-id"]) >= 16
    metrics = httpx.get(gateway.url + "/metrics").text
    for name in ("swarmgate_requests_total", "swarmgate_time_to_first_token_seconds", "swarmgate_queue_length",
                 "swarmgate_inter_token_latency_seconds", "swarmgate_active_sessions",
                 "swarmgate_swarm_blocks_covered", "swarmgate_prompt_tokens_total", "swarmgate_pool_hits_total",
                 "swarmgate_pool_misses_total", "swarmgate_pool_reused_tokens_total", "swarmgate_pool_sessions",
                 "swarmgate_pool_cache_tokens"):
        assert name in metrics, name
    assert "swarmgate_swarm_blocks_covered 30.0" in metrics
    client.chat.completions.create(model=MODEL, messages=QUESTION, temperature=0, max_tokens=1)
    routes = [line for line in httpx.get(gateway.url + "/metrics").text.splitlines()
              if line.startswith('swarmgate_route_seconds_count{part="total"}')]
    assert routes and float(routes[0].split()[-1]) >= 1  # the admission's route check at least


# ---- generation ---------------------------------------------------------------------------------------------------
def test_greedy_streamed_equals_non_streamed_equals_transformers(client, greedy_reference):
    plain = client.chat.completions.create(model=MODEL, messages=QUESTION, temperature=0, max_tokens=40)
    text, finish, chunks = stream_text(client, model=MODEL, messages=QUESTION, temperature=0, max_tokens=40)
    assert plain.choices[0].message.content == greedy_reference
    assert text == greedy_reference
    assert finish == plain.choices[0].finish_reason
    assert chunks[0].choices[0].delta.role == "assistant"
    assert len({c.id for c in chunks}) == 1 and chunks[0].object == "chat.completion.chunk"
    assert plain.usage.completion_tokens <= 40 and plain.usage.prompt_tokens > 10


def test_speculative_requests_are_greedy_exact_and_stream(gateway, client, tokenizer, reference_model):
    """n-gram speculation asked per request (the gateway's default is off): the same text as local greedy decoding,
    streamed block by block, with drafts really accepted (the gateway's counters)."""
    code = "def add(a, b):\n    return a + b\n\ndef sub(a, b):\n    return a - b\n\ndef mul(a, b):"
    messages = [{"role": "user", "content": "Continue this code:\n" + code}]
    expected = reference_text(tokenizer, reference_model, messages, 24)
    spec = {"speculative": "ngram", "num_draft_tokens": 5}
    r = client.chat.completions.create(model=MODEL, messages=messages, temperature=0, max_tokens=24, extra_body=spec)
    assert r.choices[0].message.content == expected
    text, _, chunks = stream_text(client, model=MODEL, messages=messages, temperature=0, max_tokens=24,
                                  extra_body=spec)
    assert text == expected and len(chunks) > 3
    accepted = [line for line in httpx.get(gateway.url + "/metrics").text.splitlines()
                if line.startswith("swarmgate_speculative_accepted_tokens_total")]
    assert accepted and float(accepted[0].split()[-1]) > 0


def test_max_tokens_ends_with_length(client, greedy_reference, tokenizer):
    r = client.chat.completions.create(model=MODEL, messages=QUESTION, temperature=0, max_completion_tokens=5)
    assert r.choices[0].finish_reason == "length"
    assert r.usage.completion_tokens == 5
    assert greedy_reference.startswith(r.choices[0].message.content)
    text, finish, _ = stream_text(client, model=MODEL, messages=QUESTION, temperature=0, max_tokens=5)
    assert (text, finish) == (r.choices[0].message.content, "length")


def test_stop_strings_end_the_text_before_them(client, greedy_reference, tokenizer):
    words = greedy_reference.split()
    stop = words[6][:3]  # a piece of a word in the middle of the greedy answer
    expected = greedy_reference[:greedy_reference.index(stop)]
    r = client.chat.completions.create(model=MODEL, messages=QUESTION, temperature=0, max_tokens=40,
                                       stop=["@@never@@", stop])
    assert r.choices[0].message.content == expected
    assert r.choices[0].finish_reason == "stop"
    text, finish, chunks = stream_text(client, model=MODEL, messages=QUESTION, temperature=0, max_tokens=40,
                                       stop=[stop])
    assert (text, finish) == (expected, "stop")
    assert all(stop not in (c.choices[0].delta.content or "") for c in chunks if c.choices)
    ids = tokenizer.encode(greedy_reference, add_special_tokens=False)
    r = client.chat.completions.create(model=MODEL, messages=QUESTION, temperature=0, max_tokens=40,
                                       extra_body={"stop_token_ids": [ids[5]]})
    assert r.choices[0].finish_reason == "stop"
    assert r.choices[0].message.content == tokenizer.decode(ids[:ids.index(ids[5])])


def test_n2_returns_two_choices(client):
    r = client.chat.completions.create(model=MODEL, messages=QUESTION, temperature=1.0, max_tokens=8, n=2, seed=11)
    assert [c.index for c in r.choices] == [0, 1]
    assert all(c.message.content and c.finish_reason in ("stop", "length") for c in r.choices)
    texts, finishes = {0: "", 1: ""}, {0: [], 1: []}
    for chunk in client.chat.completions.create(model=MODEL, messages=QUESTION, temperature=1.0, max_tokens=8, n=2,
                                                seed=11, stream=True):
        for c in chunk.choices:
            texts[c.index] += c.delta.content or ""
            if c.finish_reason:
                finishes[c.index].append(c.finish_reason)
    assert [texts[0], texts[1]] == [c.message.content for c in r.choices]  # same seed, same choices
    assert all(len(f) == 1 for f in finishes.values())


def test_logprobs_with_top_logprobs(client):
    r = client.chat.completions.create(model=MODEL, messages=QUESTION, temperature=0, max_tokens=6, logprobs=True,
                                       top_logprobs=3)
    entries = r.choices[0].logprobs.content
    assert len(entries) == r.usage.completion_tokens == 6
    assert "".join(e.token for e in entries) == r.choices[0].message.content
    for e in entries:
        assert e.logprob <= 0 and bytes(e.bytes).decode("utf-8") == e.token
        assert len(e.top_logprobs) == 3
        values = [t.logprob for t in e.top_logprobs]
        assert values == sorted(values, reverse=True)
        assert e.top_logprobs[0].token == e.token and abs(e.top_logprobs[0].logprob - e.logprob) < 1e-5
    streamed = []
    for chunk in client.chat.completions.create(model=MODEL, messages=QUESTION, temperature=0, max_tokens=6,
                                                logprobs=True, top_logprobs=3, stream=True):
        for c in chunk.choices:
            if c.logprobs and c.logprobs.content:
                streamed.extend(c.logprobs.content)
    assert [e.token for e in streamed] == [e.token for e in entries]


def test_same_seed_same_text_at_temperature_1(client):
    kwargs = dict(model=MODEL, messages=QUESTION, temperature=1.0, top_p=0.95, max_tokens=16, seed=1234)
    a = client.chat.completions.create(**kwargs).choices[0].message.content
    b = client.chat.completions.create(**kwargs).choices[0].message.content
    assert a == b and a


@pytest.mark.parametrize("max_tokens", [60, 10])
def test_json_object_output_parses(client, max_tokens):
    """The output is a JSON object whenever the model ended it; cut short by max_tokens it is finish_reason
    'length' (as OpenAI's): the grammar (llguidance) allows nothing else."""
    messages = [{"role": "user", "content": "Describe a cat as a JSON object with its name, age and colour."}]
    r = client.chat.completions.create(model=MODEL, messages=messages, temperature=0.7, seed=3, max_tokens=max_tokens,
                                       response_format={"type": "json_object"})
    choice = r.choices[0]
    if choice.finish_reason == "stop":
        assert isinstance(json.loads(choice.message.content), dict)
    else:
        assert choice.finish_reason == "length" and r.usage.completion_tokens == max_tokens
        assert choice.message.content.startswith("{")
    assert r.usage.completion_tokens <= max_tokens
    text, _, _ = stream_text(client, model=MODEL, messages=messages, temperature=0.7, seed=3, max_tokens=max_tokens,
                             response_format={"type": "json_object"})
    assert text == choice.message.content


def test_text_completion_with_echo(client, tokenizer, reference_model):
    prompt = "The three primary colours are"
    ids = tokenizer(prompt, return_tensors="pt")
    with torch.no_grad():
        out = reference_model.generate(**ids, max_new_tokens=10, do_sample=False)
    expected = tokenizer.decode(out[0, ids["input_ids"].shape[1]:], skip_special_tokens=True)
    r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=10, temperature=0, echo=True, logprobs=2)
    assert r.choices[0].text == prompt + expected
    # with echo the logprobs cover the prompt's tokens, then the completion's
    assert len(r.choices[0].logprobs.tokens) == r.usage.prompt_tokens + r.usage.completion_tokens
    streamed = "".join(c.choices[0].text for c in client.completions.create(
        model=MODEL, prompt=prompt, max_tokens=10, temperature=0, stream=True) if c.choices)
    assert streamed == expected


def test_echo_logprobs_score_the_prompt_as_transformers(client, tokenizer, reference_model):
    """lm-evaluation-harness style scoring: echo + logprobs + max_tokens 0 gives the prompt's log-likelihoods."""
    prompt = "The three primary colours are red, yellow and blue."
    ids = tokenizer(prompt, return_tensors="pt")["input_ids"]
    with torch.no_grad():
        expected = torch.log_softmax(reference_model(ids).logits[0].float(), dim=-1)
    token_lp = expected[:-1].gather(1, ids[0, 1:, None])[:, 0].tolist()
    r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=0, temperature=0, echo=True, logprobs=1)
    choice = r.choices[0]
    assert choice.text == prompt and choice.finish_reason == "length" and r.usage.completion_tokens == 0
    lp = choice.logprobs
    assert len(lp.tokens) == ids.shape[1] and lp.token_logprobs[0] is None and lp.top_logprobs[0] == {}
    assert max(abs(a - b) for a, b in zip(lp.token_logprobs[1:], token_lp)) < 1e-3
    best = expected[:-1].max(dim=-1)
    for k, top in enumerate(lp.top_logprobs[1:]):
        assert len(top) == 1 and abs(next(iter(top.values())) - best.values[k].item()) < 1e-3
    r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=3, temperature=0, echo=True, logprobs=1)
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == ids.shape[1] + r.usage.completion_tokens
    assert max(abs(a - b) for a, b in zip(lp.token_logprobs[1:ids.shape[1]], token_lp)) < 1e-3
    assert lp.text_offset[ids.shape[1]] == len(prompt)


def test_raw_stream_protocol(gateway):
    body = {"model": MODEL, "messages": QUESTION, "temperature": 0, "max_tokens": 6, "n": 2,
            "stream": True, "stream_options": {"include_usage": True}}
    with httpx.stream("POST", gateway.base_url + "/chat/completions", json=body, timeout=120) as response:
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        data = [payload for kind, payload in sse_events(response) if kind == "data"]
    assert data[-1] == "[DONE]"
    chunks = [json.loads(d) for d in data[:-1]]
    assert [c["choices"][0]["delta"] for c in chunks[:2]] == [{"role": "assistant", "content": ""}] * 2
    usage = chunks[-1]
    assert usage["choices"] == [] and usage["usage"]["completion_tokens"] == 12
    assert usage["usage"]["prompt_tokens_details"] == {"cached_tokens": 0}  # n > 1 never uses the pool
    finishes = [(c["choices"][0]["index"], c["choices"][0]["finish_reason"]) for c in chunks[:-1]
                if c["choices"][0]["finish_reason"]]
    assert sorted(finishes) == [(0, "length"), (1, "length")]


def test_tokenize_detokenize(gateway, tokenizer):
    r = httpx.post(gateway.url + "/tokenize", json={"prompt": "Hello there, swarm!"}).json()
    assert r["tokens"] == tokenizer.encode("Hello there, swarm!", add_special_tokens=False)
    assert r["count"] == len(r["tokens"]) and r["max_model_len"] == 8192
    chat = httpx.post(gateway.url + "/tokenize", json={"messages": QUESTION}).json()
    assert chat["tokens"] == list(tokenizer.apply_chat_template(QUESTION, add_generation_prompt=True,
                                                                return_dict=True)["input_ids"])
    detokenized = httpx.post(gateway.url + "/detokenize", json={"tokens": r["tokens"]}).json()
    assert detokenized["prompt"] == "Hello there, swarm!"


# ---- errors -------------------------------------------------------------------------------------------------------
def _envelope(error: openai.APIStatusError) -> dict:
    body = error.response.json()
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}
    assert "Traceback" not in error.response.text
    return body["error"]


@pytest.mark.parametrize("kwargs, param, code", [
    (dict(temperature=3), "temperature", None),
    (dict(top_p=0), "top_p", None),
    (dict(n=0), "n", None),
    (dict(max_tokens=100_000), "messages", "context_length_exceeded"),
    (dict(messages=[{"role": "user", "content": "hello " * 9000}]), "messages", "context_length_exceeded"),
    (dict(messages=[]), "messages", None),
    (dict(messages=[{"role": "wizard", "content": "hi"}]), "messages.0.role", None),
    (dict(logit_bias={"123456789": 5}), "logit_bias", None),
    (dict(top_logprobs=2), "top_logprobs", None),
    (dict(response_format={"type": "json_schema"}), "response_format.json_schema", None),
], ids=lambda v: str(v)[:40])
def test_bad_requests_are_400_with_envelope(client, kwargs, param, code):
    args = dict(model=MODEL, messages=QUESTION, max_tokens=4)
    args.update(kwargs)
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(**args)
    assert info.value.status_code == 400
    error = _envelope(info.value)
    assert error["type"] == "invalid_request_error" and error["param"] == param and error["code"] == code


def test_unknown_model_is_404_and_unknown_fields_are_ignored(client, gateway):
    with pytest.raises(openai.NotFoundError) as info:
        client.chat.completions.create(model="gpt-17", messages=QUESTION, max_tokens=2)
    assert _envelope(info.value)["code"] == "model_not_found"
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("gpt-17")
    r = client.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=2, temperature=0, user="u1",
                                       extra_body={"top_k": 5, "min_p": 0.05, "vendor_thing": {"a": 1}})
    assert r.choices[0].message.content
    raw = httpx.post(gateway.base_url + "/chat/completions", content=b"{not json",
                     headers={"content-type": "application/json"})
    assert raw.status_code == 400 and raw.json()["error"]["type"] == "invalid_request_error"
    missing = httpx.get(gateway.url + "/v2/nothing")
    assert missing.status_code == 404 and "error" in missing.json()


def test_api_keys(side_gateways):
    gw = side_gateways["keyed"]
    with pytest.raises(openai.AuthenticationError) as info:
        gw.client(api_key="wrong-key").chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=2)
    assert info.value.status_code == 401 and _envelope(info.value)["type"] == "authentication_error"
    unauthenticated = httpx.post(gw.base_url + "/chat/completions", json={"model": MODEL, "messages": QUESTION})
    assert unauthenticated.status_code == 401 and unauthenticated.json()["error"]["code"] == "invalid_api_key"
    assert httpx.get(gw.base_url + "/models").status_code == 401
    assert httpx.post(gw.url + "/tokenize", json={"prompt": "x"}).status_code == 401
    r = gw.client(api_key=API_KEY).chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=3,
                                                           temperature=0)
    assert r.choices[0].message.content
    assert gw.client(api_key="other-key").models.list().data[0].id == MODEL
    assert httpx.get(gw.url + "/health").status_code == 200  # public
    assert httpx.get(gw.url + "/metrics").status_code == 200  # public


def test_full_queue_is_429_with_retry_after(side_gateways):
    gw = side_gateways["keyed"]  # max_concurrent=1, max_queue=1
    headers = {"Authorization": f"Bearer {API_KEY}"}
    body = {"model": MODEL, "messages": QUESTION, "max_tokens": 2000, "temperature": 0, "stream": True,
            "ignore_eos": True}
    queued_status = {}

    def queued():
        with httpx.stream("POST", gw.base_url + "/chat/completions", json=body, headers=headers,
                          timeout=180) as response:
            queued_status["status"] = response.status_code  # arrives once the first request is gone

    with httpx.stream("POST", gw.base_url + "/chat/completions", json=body, headers=headers, timeout=180) as first:
        assert first.status_code == 200
        events = sse_events(first)
        assert next(kind for kind, _ in events) == "data"  # the generation runs
        waiter = threading.Thread(target=queued, daemon=True)
        waiter.start()
        assert wait_until(lambda: "swarmgate_queue_length 1.0" in httpx.get(gw.url + "/metrics").text, 60)
        with pytest.raises(openai.RateLimitError) as info:
            gw.client(api_key=API_KEY).chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=2)
        assert info.value.status_code == 429
        assert info.value.response.headers["retry-after"] == "3"
        assert _envelope(info.value)["code"] == "rate_limit_exceeded"
        comments = 0
        for kind, _ in events:  # keep-alive comments (every 0.2 s on this gateway) interleave with data
            comments += kind == "comment"
            if comments >= 2:
                break
        assert comments >= 2
    waiter.join(120)
    assert queued_status.get("status") == 200


def test_swarm_that_cannot_serve_is_503(side_gateways):
    gw = side_gateways["orphan"]
    health = httpx.get(gw.url + "/health")
    assert health.status_code == 503
    assert health.json()["missing_blocks"] == list(range(30)) and "0:30" in health.json()["message"]
    with pytest.raises(openai.InternalServerError) as info:
        gw.client().chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=2)
    assert info.value.status_code == 503
    assert _envelope(info.value)["type"] == "service_unavailable"
    with pytest.raises(openai.InternalServerError):
        gw.client().chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=2, stream=True)


# ---- cancellation and concurrency ---------------------------------------------------------------------------------
def _pool_cache(gateways) -> int:
    """Cache tokens that the gateways' session pools reserve on each server (pooled sessions span all blocks)."""
    total = 0
    for gw in gateways:
        for line in httpx.get(gw.url + "/metrics").text.splitlines():
            if line.startswith("swarmgate_pool_cache_tokens "):
                total += int(float(line.split()[1]))
    return total


def _unpooled_cache_used(swarm_model, swarm, gateways) -> dict:
    """Each server's cache in use less what the gateways' pools reserve (pooled sessions come and go on their
    own: idle ones expire), read until two readings agree."""
    def read():
        return {p: s.cache_tokens_used - _pool_cache(gateways) for p, s in server_stats(swarm_model, swarm).items()}

    previous = read()
    for _ in range(50):
        time.sleep(0.3)
        current = read()
        if current == previous:
            return current
        previous = current
    return previous


def test_cancelled_stream_frees_the_servers_cache(client, gateway, side_gateways, swarm_model):
    swarm = gateway.swarm
    gateways = [gateway, side_gateways["keyed"]]
    before = _unpooled_cache_used(swarm_model, swarm, gateways)
    stream = client.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=1500, temperature=0,
                                            stream=True, extra_body={"ignore_eos": True})
    received = 0
    for chunk in stream:
        received += bool(chunk.choices and chunk.choices[0].delta.content)
        if received >= 3:
            break
    during = _unpooled_cache_used(swarm_model, swarm, gateways)
    assert all(during[p] >= before[p] + 1500 for p in before), (before, during)
    stream.close()
    freed = wait_until(lambda: _unpooled_cache_used(swarm_model, swarm, gateways) == before, timeout=60)
    assert freed, (before, _unpooled_cache_used(swarm_model, swarm, gateways))
    # a non-streaming request whose client gives up is cancelled too
    with pytest.raises(httpx.TimeoutException):
        httpx.post(gateway.base_url + "/chat/completions", timeout=httpx.Timeout(180, read=3),
                   json={"model": MODEL, "messages": QUESTION, "max_tokens": 1500, "ignore_eos": True})
    freed = wait_until(lambda: _unpooled_cache_used(swarm_model, swarm, gateways) == before, timeout=60)
    assert freed, (before, _unpooled_cache_used(swarm_model, swarm, gateways))
    metrics = httpx.get(gateway.url + "/metrics").text
    assert "swarmgate_active_sessions 0.0" in metrics  # cancelled generations are never pooled


def test_metrics_show_each_servers_prefix_cache_counters(gateway, client):
    """/metrics carries each server's prefix cache counters by peer id (`rpc_prefix_cache`, read at the scrape): a
    fresh conversation whose prompt spans full pages makes each server of the swarm compute them; the numbers are the
    ones /status.json reads from the servers."""
    import uuid

    peers = {p.peer_id for p in gateway.swarm["servers"]}

    def scrape() -> dict:
        values = {}
        for line in httpx.get(gateway.url + "/metrics", timeout=60).text.splitlines():
            if line.startswith("swarmgate_server_prefix_"):
                name, value = line.rsplit(" ", 1)
                values[name] = float(value)
        return values

    def computed(values: dict, peer: str) -> float:
        return values.get(f'swarmgate_server_prefix_pages_computed_total{{peer_id="{peer}"}}', 0.0)

    before = scrape()
    tag = uuid.uuid4().hex  # a system prompt no earlier test sent: its pages are computed now
    system = " ".join(f"Rule {i} ({tag}): answer briefly and politely about topic {i}." for i in range(30))
    reply = client.chat.completions.create(model=MODEL, messages=[{"role": "system", "content": system}] + QUESTION,
                                           temperature=0, max_tokens=1)
    prompt_pages = reply.usage.prompt_tokens // 64  # the servers' default --prefix_page_tokens
    assert prompt_pages >= 4
    deadline = time.monotonic() + 60  # (a reading serves scrapes for 2 s: wait for one taken after the request)
    while True:
        after = scrape()
        if all(computed(after, p) - computed(before, p) >= prompt_pages for p in peers) or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    for peer in peers:
        assert computed(after, peer) - computed(before, peer) >= prompt_pages, (peer, before, after)
        assert after[f'swarmgate_server_prefix_pages_held{{peer_id="{peer}"}}'] >= prompt_pages
        for name in ("pages_hit", "pages_evicted", "sessions_declined"):
            assert f'swarmgate_server_prefix_{name}_total{{peer_id="{peer}"}}' in after
    # the same counters as /status.json's (each read from the servers; nothing runs in between)
    status = httpx.get(gateway.url + "/status.json", timeout=60).json()
    again = scrape()
    for server in status["servers"]:
        if server["peer_id"] in peers:
            assert server["prefix_pages"]["computed"] == computed(again, server["peer_id"])
