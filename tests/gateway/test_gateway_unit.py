"""Gateway pieces without a swarm: stop-string hold-back, incremental decoding, sampling,
schemas and errors, and the whole app in-process over a scripted fake model (no network)."""
from __future__ import annotations

import copy
import json

import pytest
import torch

from gateway.api.auth import key_matches
from gateway.api.completions import StreamResponse, TextChunks
from gateway.api.state import format_ranges
from gateway.config import GatewayConfig
from gateway.schemas import ChatCompletionChunk, ChunkChoice, Delta
from gateway.serving.textstream import StopMatcher, TextStream
from swarm.client.api import Coverage
from swarm.client.decoding.sampling import Sampler, SamplingParams
from tests.fixtures.fake_model import chat_body, fake_app  # noqa: F401  (fake_app: a fixture)
from tests.fixtures.gateway_fixtures import one_torch_thread  # noqa: F401  (autouse: one torch thread in this module)


# ---- stop strings and incremental decoding ------------------------------------------------------------------------
def test_stop_matcher_finds_and_holds_back():
    m = StopMatcher(["END", "\n\n"])
    assert m.find("abc END x") == 4 and m.find("abc\n\nEND") == 3 and m.find("abc") is None
    assert m.safe_length("hello EN") == len("hello ")
    assert m.safe_length("hello E") == len("hello ")
    assert m.safe_length("hello\n") == len("hello")
    assert m.safe_length("hello") == 5
    assert StopMatcher([]).safe_length("abc") == 3


def _char_stream(text, stops):
    stream = TextStream(lambda ids: "".join(chr(i) for i in ids), stops)
    sent, stopped = [], False
    for ch in text:
        delta, stopped = stream.add(ord(ch))
        sent.append(delta)
        if stopped:
            break
    if not stopped:
        sent.append(stream.flush())
    return sent, stopped


@pytest.mark.parametrize("text, stops, expected, stopped", [
    ("Hello world. The end.", ["The end"], "Hello world. ", True),
    ("aaab", ["aab"], "a", True),
    ("abcabd", ["abd"], "abc", True),
    ("Partial mat", ["match"], "Partial mat", False),  # held back while streaming, flushed at the end
    ("x = 1\n\ny = 2", ["\n\n", "y ="], "x = 1", True),
])
def test_text_stream_never_leaks_a_stop_string(text, stops, expected, stopped):
    sent, did_stop = _char_stream(text, stops)
    assert "".join(sent) == expected and did_stop == stopped
    for i in range(len(sent)):  # no prefix of what was sent ends inside a stop string that later matched
        so_far = "".join(sent[:i + 1])
        if did_stop:
            assert all(stop not in so_far for stop in stops)


def test_text_stream_never_splits_multibyte_characters(tokenizer):
    text = "Voilà: 世界, émoji 🎉🧪 and ñ."
    ids = tokenizer.encode(text, add_special_tokens=False)
    stream = TextStream(lambda x: tokenizer.decode(x, skip_special_tokens=True))
    deltas = [stream.add(i)[0] for i in ids] + [stream.flush()]
    assert "".join(deltas) == text
    assert all("\ufffd" not in d for d in deltas)
    assert any(len(tokenizer.decode([i])) and "\ufffd" in tokenizer.decode([i]) for i in ids)  # the case is real


@pytest.mark.parametrize("seed", range(3))
def test_incremental_decoding_gives_the_whole_decode(tokenizer, seed):
    """`Tokens.decode_stream` (tokenizers' DecodeStream) gives exactly the text of decoding the whole list, on real
    text (multi-byte characters, code, specials) and on random ids, while costing the same per token however long
    the text is (it never re-decodes the list)."""
    from gateway.serving.tokens import Tokens
    tokens = Tokens(tokenizer)
    text = "Voilà: 世界, émoji 🎉🧪 and ñ.\n```py\ndef f(x):\n    return x  # done\n```<|im_end|> tail"
    generator = torch.Generator().manual_seed(seed)
    cut = tokenizer.encode("Hi 🎉", add_special_tokens=False)[:-1]  # ends inside a multi-byte character
    for ids in (tokenizer.encode(text, add_special_tokens=False), cut,
                torch.randint(0, len(tokenizer), (300,), generator=generator).tolist()):
        calls = []

        def whole(x):
            calls.append(len(x))
            return tokenizer.decode(x, skip_special_tokens=True)

        stream = TextStream(whole, new_step=tokens.decode_stream())
        half = len(ids) // 2
        deltas = [stream.add(i)[0] for i in ids[:half]]
        snapshot = copy.copy(stream)  # a retraction's snapshot: going on from it gives the same text
        rest = [stream.add(i)[0] for i in ids[half:]] + [stream.flush()]
        assert "".join(deltas + rest) == tokenizer.decode(ids, skip_special_tokens=True)
        again = [snapshot.add(i)[0] for i in ids[half:]] + [snapshot.flush()]
        assert again == rest
        assert all("\ufffd" not in d for d in deltas[:-1]) or "\ufffd" in tokenizer.decode(ids)
        assert calls == [len(ids)] * 2  # the whole list decoded once per flush (a last incomplete character)


# ---- sampling -----------------------------------------------------------------------------------------------------
def test_sampler_greedy_seeded_bias_and_penalties():
    logits = torch.tensor([0.0, 2.0, 1.0, 0.5])
    ids = torch.tensor([3])
    assert Sampler(SamplingParams(max_tokens=1, temperature=0), 1, 4).choose(ids, logits, 1).token_id == 1
    biased = Sampler(SamplingParams(max_tokens=1, temperature=0, logit_bias={0: 100.0}), 1, 4)
    assert biased.choose(ids, logits, 1).token_id == 0
    penalised = Sampler(SamplingParams(max_tokens=1, temperature=0, presence_penalty=2.0, frequency_penalty=1.0), 1, 4)
    assert penalised.choose(torch.tensor([3, 1, 1]), logits, 1).token_id == 2  # token 1 was generated twice

    def draws(seed, index=0):
        s = Sampler(SamplingParams(max_tokens=50, temperature=1.0, seed=seed), 1, 4, index=index)
        return [s.choose(ids, logits, 1).token_id for _ in range(30)]

    assert draws(7) == draws(7) and draws(7) != draws(8) and draws(7, index=1) == draws(8)
    top_k = Sampler(SamplingParams(max_tokens=1, temperature=1.0, top_k=1, seed=1), 1, 4)
    assert {top_k.choose(ids, logits, 1).token_id for _ in range(20)} == {1}
    sampler = Sampler(SamplingParams(max_tokens=1, temperature=0, logprobs=True, top_logprobs=2), 1, 4)
    lp = sampler.choose(ids, logits, 1)
    assert lp.top[0][0] == 1 and lp.top[1][0] == 2 and abs(lp.logprob - torch.log_softmax(logits, 0)[1].item()) < 1e-6


def test_seeded_draws_follow_the_distribution_exactly():
    """`generation.draw` (the gateway's per-request seeded sampling): frequencies over 40000 draws within 4 standard
    deviations of each probability, never a token of probability zero (also at the ends), unnormalized input."""
    from swarm.client.decoding.sampling import draw
    probs = torch.tensor([0.0, 0.5, 0.0, 0.3, 0.15, 0.05, 0.0]) * 3.0  # not normalized
    generator = torch.Generator().manual_seed(123)
    n = 40000
    counts = torch.bincount(torch.tensor([draw(probs, generator) for _ in range(n)]), minlength=7).double()
    expected = probs.double() / probs.sum()
    assert counts[expected == 0].sum() == 0
    sigma = (expected * (1 - expected) / n).sqrt()
    assert ((counts / n - expected).abs() <= 4 * sigma + 1e-12).all(), counts / n
    one = torch.zeros(49152)
    one[-1] = 1.0  # all the mass on the last token; and on the first
    assert draw(one, generator) == 49151 and draw(torch.flip(one, [0]), generator) == 0


@pytest.mark.parametrize("text", ["hello", " world", 'a "quoted" \\ back\\slash', "line\nbreak\ttab\r",
                                  "\x00\x01\x1f\x7f control", "é ü 漢字 🙂", "\u2028\u2029", "</script>", "'"])
def test_text_chunks_are_the_models_own_json(text):
    """The stream's plain text chunks, filled into a template made once per choice, are byte for byte the JSON
    that building and dumping the chunk models gives (what every token did before)."""
    def make(index: int, content: str) -> str:
        return ChatCompletionChunk(id="chatcmpl-x", created=1, model="m", choices=[
            ChunkChoice(index=index, delta=Delta(content=content))]).model_dump_json(exclude={"swarm"})

    chunks = TextChunks(make)
    for index in (0, 3, 0):
        assert chunks.json(index, text) == make(index, text)
        assert json.loads(chunks.json(index, text))["choices"][0]["delta"] == {"content": text}


def test_stream_response_sends_what_sse_starlette_sends():
    """`StreamResponse` (no cancel scope per chunk without a send timeout) writes the bytes sse_starlette's own
    response writes; with a send timeout, a send that never returns still ends the stream with its error."""
    import anyio
    from sse_starlette.sse import EventSourceResponse, SendTimeoutError

    def body():
        async def gen():
            for data in ("one", {"data": "two"}, {"event": "done", "data": "[DONE]"}):
                yield data
        return gen()

    async def serve(response, hang: bool = False):
        sent = []

        async def receive():
            await anyio.sleep(3600)  # the client never disconnects

        async def send(message):
            if hang and message["type"] == "http.response.body":
                await anyio.sleep(3600)
            sent.append(message)

        await response({"type": "http", "method": "POST", "headers": []}, receive, send)
        return [(m["type"], m.get("body"), m.get("more_body")) for m in sent]

    ours = anyio.run(serve, StreamResponse(body(), sep="\n"))
    theirs = anyio.run(serve, EventSourceResponse(body(), sep="\n"))
    assert ours == theirs and [b for _, b, _ in ours if b] == [b"data: one\n\n", b"data: two\n\n",
                                                               b"event: done\ndata: [DONE]\n\n"]
    with pytest.raises(SendTimeoutError):
        anyio.run(serve, StreamResponse(body(), sep="\n", send_timeout=0.05), True)


def test_small_helpers():
    assert format_ranges([0, 1, 2, 5, 7, 8]) == "0:3, 5:6, 7:9"
    assert key_matches("k2", ["k1", "k2"]) and not key_matches("k3", ["k1", "k2"]) and not key_matches("", ["k1"])


def test_config_sources(tmp_path):
    from swarm.runtime.config import load_config

    path = tmp_path / "gw.yaml"
    path.write_text("gateway:\n  model: m\n  port: 9001\n  max_queue: 3\n  api_keys: [a, b]\n")
    environ = {"SWARMGATE_PORT": "1", "SWARMGATE_MAX_N": "2"}
    config = load_config(GatewayConfig, None, yaml_path=str(path), environ=environ, section="gateway")
    assert (config.port, config.max_queue, config.api_keys, config.max_n) == (9001, 3, ["a", "b"], 2)
    assert config.model_name == "m"
    from pathlib import Path

    import yaml

    example = yaml.safe_load(Path(__file__).resolve().parents[2].joinpath("configs/gateway.yaml").read_text())
    assert GatewayConfig.model_validate(example["gateway"]).port == 8000


# ---- the app in-process over a scripted fake model ----------------------------------------------------------------


def _stream(client, body):
    with client.stream("POST", "/v1/chat/completions", json={**body, "stream": True}) as r:
        assert r.status_code == 200
        return [line[6:] for line in r.iter_lines() if line.startswith("data: ")]


def test_fake_app_generates_stops_and_closes_sessions(fake_app):
    client, model = fake_app()
    r = client.post("/v1/chat/completions", json=chat_body(temperature=0, stop=[" STOP"], vendor_field={"x": 1}))
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["message"]["content"] == "Hello there, world!"
    assert r.json()["choices"][0]["finish_reason"] == "stop"
    data = _stream(client, chat_body(temperature=0, stop=["STOP"]))
    assert data[-1] == "[DONE]"
    content = "".join(json.loads(d)["choices"][0]["delta"].get("content", "") for d in data[:-1])
    assert content == "Hello there, world! "
    full = client.post("/v1/chat/completions", json=chat_body(temperature=0)).json()["choices"][0]
    assert (full["message"]["content"], full["finish_reason"]) == ("Hello there, world! STOP after", "stop")
    assert all(s.closed for s in model.sessions) and len(model.sessions) == 3


def test_fake_app_mid_stream_failure_is_an_error_event(fake_app):
    client, model = fake_app(fail_at=3)
    data = _stream(client, chat_body(temperature=0))
    assert data[-1] == "[DONE]"
    error = json.loads(data[-2])["error"]
    assert error["type"] == "service_unavailable" and "went away" in error["message"]
    assert "Traceback" not in "".join(data)
    r = client.post("/v1/chat/completions", json=chat_body(temperature=0))
    assert r.status_code == 503 and r.json()["error"]["code"] == "swarm_error"
    assert all(s.closed for s in model.sessions)


def test_fake_app_errors_are_openai_envelopes(fake_app):
    client, _ = fake_app(api_keys=["k"])
    assert client.post("/v1/chat/completions", json=chat_body()).status_code == 401
    auth = {"Authorization": "Bearer k"}
    r = client.post("/v1/chat/completions", json={"model": "fake"}, headers=auth)
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages"
    r = client.post("/v1/chat/completions", json=chat_body(max_tokens=1000), headers=auth)
    assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded"
    bad_part = {"model": "fake", "messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]}
    r = client.post("/v1/chat/completions", json=bad_part, headers=auth)
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages.0.content"
    assert client.get("/health").status_code == 200 and client.get("/metrics").status_code == 200
    assert client.put("/v1/models", headers=auth).status_code == 405
    client, _ = fake_app(covered=False)
    r = client.post("/v1/chat/completions", json=chat_body())
    assert r.status_code == 503 and r.json()["error"]["code"] == "swarm_unavailable"
    health = client.get("/health")
    assert health.status_code == 503 and health.json()["missing_blocks"] == [0, 1, 2, 3]


def test_fake_app_cors_and_request_id(fake_app):
    client, _ = fake_app(cors_origins=["https://app.example"])
    preflight = client.options("/v1/chat/completions", headers={
        "Origin": "https://app.example", "Access-Control-Request-Method": "POST",
        "Access-Control-Request-Headers": "authorization, content-type"})
    assert preflight.status_code == 200
    assert preflight.headers["access-control-allow-origin"] == "https://app.example"
    r = client.get("/v1/models", headers={"Origin": "https://app.example", "X-Request-Id": "abc.123"})
    assert r.headers["access-control-allow-origin"] == "https://app.example" and r.headers["x-request-id"] == "abc.123"
    assert r.json()["data"][0]["context_length"] == 256
    weird = client.get("/v1/models", headers={"X-Request-Id": "bad id with spaces"}).headers["x-request-id"]
    assert weird != "bad id with spaces" and len(weird) == 32


def test_fake_app_completions_n_and_usage(fake_app):
    client, model = fake_app(text="one two three four five")
    r = client.post("/v1/completions", json={"model": "fake", "prompt": ["a b", "c"], "n": 2, "max_tokens": 3,
                                              "temperature": 0, "echo": True}).json()
    assert [c["index"] for c in r["choices"]] == [0, 1, 2, 3]
    assert r["choices"][0]["text"] == "a bone two three" and r["choices"][2]["text"] == "cone two three"
    assert {c["finish_reason"] for c in r["choices"]} == {"length"}
    assert r["usage"]["completion_tokens"] == 12


def test_fake_app_echo_logprobs_cover_the_prompt_then_the_completion(fake_app, tokenizer):
    client, model = fake_app(text="one two three four five")
    prompt = "Hello big world"
    ids = tokenizer.encode(prompt)  # with BOS, as the gateway encodes it
    body = {"model": "fake", "prompt": prompt, "max_tokens": 2, "temperature": 0, "echo": True, "logprobs": 2}
    r = client.post("/v1/completions", json=body)
    assert r.status_code == 200, r.text
    choice, usage = r.json()["choices"][0], r.json()["usage"]
    lp, text = choice["logprobs"], choice["text"]
    assert text == prompt + "one two" and model.scored == [ids]
    assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(lp["top_logprobs"]) == len(lp["text_offset"])
    assert len(lp["tokens"]) == usage["prompt_tokens"] + usage["completion_tokens"] == len(ids) + 2
    # the first prompt token has no context: a null logprob (as OpenAI's legacy API) and no alternatives ({}: the
    # spec types top_logprobs items as objects)
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] == {}
    assert lp["token_logprobs"][1:len(ids)] == pytest.approx([-j / 10 for j in range(1, len(ids))])
    top = lp["top_logprobs"][1]
    assert list(top.values()) == pytest.approx([-0.1, -5.0]) and list(top)[0] == lp["tokens"][1]
    assert len(lp["top_logprobs"][1]) == 2 and len(lp["top_logprobs"][-1]) == 2
    offsets = lp["text_offset"]
    assert offsets[0] == 0 and offsets == sorted(offsets) and offsets[len(ids)] == len(prompt)
    for k in range(len(ids)):  # each prompt token's text is where its offset says in the echoed prompt
        assert text[offsets[k]:offsets[k + 1]] == lp["tokens"][k] == tokenizer.decode(ids[k:k + 1])
    assert text[offsets[len(ids)]:] == "one two"

    with client.stream("POST", "/v1/completions", json={**body, "stream": True}) as s:
        chunks = [json.loads(line[6:]) for line in s.iter_lines() if line.startswith("data: {")]
    first = chunks[0]["choices"][0]
    assert first["text"].startswith(prompt) and first["logprobs"]["tokens"][:len(ids)] == lp["tokens"][:len(ids)]
    assert first["logprobs"]["token_logprobs"][0] is None
    streamed = [c["choices"][0]["logprobs"] for c in chunks if c["choices"] and c["choices"][0]["logprobs"]]
    assert sum((x["tokens"] for x in streamed), []) == lp["tokens"]
    assert sum((x["text_offset"] for x in streamed), []) == offsets


def test_fake_app_echo_with_max_tokens_0_scores_the_prompt_only(fake_app, tokenizer):
    client, model = fake_app()
    body = {"model": "fake", "prompt": ["a b", "c d e"], "max_tokens": 0, "echo": True, "logprobs": 0,
            "temperature": 0}
    r = client.post("/v1/completions", json=body)
    assert r.status_code == 200, r.text
    got = r.json()
    assert [c["text"] for c in got["choices"]] == ["a b", "c d e"]
    assert {c["finish_reason"] for c in got["choices"]} == {"length"}
    assert got["usage"]["completion_tokens"] == 0
    for c, p in zip(got["choices"], ["a b", "c d e"]):
        assert len(c["logprobs"]["tokens"]) == len(tokenizer.encode(p))
        assert c["logprobs"]["token_logprobs"][0] is None and None not in c["logprobs"]["token_logprobs"][1:]
        assert c["logprobs"]["top_logprobs"] == [{}] * len(c["logprobs"]["tokens"])  # logprobs 0: no top list
    assert not model.sessions  # nothing generated: no inference session
    with client.stream("POST", "/v1/completions", json={**body, "prompt": "a b", "stream": True}) as s:
        chunks = [json.loads(line[6:]) for line in s.iter_lines() if line.startswith("data: {")]
    assert [(c["choices"][0]["text"], c["choices"][0]["finish_reason"]) for c in chunks] == [("a b", "length")]
    plain = client.post("/v1/completions", json={**body, "logprobs": None}).json()
    assert [c["text"] for c in plain["choices"]] == ["a b", "c d e"] and plain["choices"][0]["logprobs"] is None
    _error(client.post("/v1/completions", json={**body, "echo": False}), "max_tokens")
    assert client.post("/v1/chat/completions", json=chat_body(max_tokens=0)).status_code == 400
    assert not model.sessions


# ---- OpenAI spec conformance (issue 23): response shapes, required model, no silently ignored parameter ----------
def test_fake_app_response_shapes_have_refusal_and_a_fingerprint(fake_app):
    client, _ = fake_app()
    r = client.post("/v1/chat/completions", json=chat_body(temperature=0, max_tokens=3)).json()
    message = r["choices"][0]["message"]
    assert "refusal" in message and message["refusal"] is None and message["role"] == "assistant"
    assert isinstance(r["system_fingerprint"], str) and r["system_fingerprint"].startswith("swarmgate-")
    for data in _stream(client, chat_body(temperature=0, max_tokens=3, stream_options={"include_usage": True}))[:-1]:
        chunk = json.loads(data)
        assert isinstance(chunk["system_fingerprint"], str)
        assert all(c["delta"].get("refusal", None) is None for c in chunk["choices"])
    r = client.post("/v1/completions", json={"model": "fake", "prompt": "a", "max_tokens": 2}).json()
    assert isinstance(r["system_fingerprint"], str)
    with client.stream("POST", "/v1/completions", json={"model": "fake", "prompt": "a", "max_tokens": 2,
                                                        "stream": True}) as resp:
        chunks = [json.loads(line[6:]) for line in resp.iter_lines() if line.startswith("data: {")]
    assert chunks and all(isinstance(c["system_fingerprint"], str) for c in chunks)


def _error(r, param):
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["type"] == "invalid_request_error" and error["param"] == param and error["message"]
    return error


def test_fake_app_model_is_required(fake_app):
    client, model = fake_app()
    no_model = {k: v for k, v in chat_body().items() if k != "model"}
    _error(client.post("/v1/chat/completions", json=no_model), "model")
    _error(client.post("/v1/chat/completions", json={**no_model, "model": ""}), "model")
    _error(client.post("/v1/chat/completions", json={**no_model, "model": None}), "model")
    _error(client.post("/v1/completions", json={"prompt": "a"}), "model")
    _error(client.post("/v1/completions", json={"prompt": "a", "model": ""}), "model")
    assert client.post("/tokenize", json={"prompt": "a"}).status_code == 200  # optional there, as in vLLM
    assert not model.sessions


TOOL = {"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {}}}}


@pytest.mark.parametrize("extra, param", [
    ({"tools": []}, "tools"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tool_choice": "auto"}, "tool_choice"),
    ({"tool_choice": {"type": "function", "function": {"name": "g"}}, "tools": [TOOL]}, "tool_choice"),
    ({"parallel_tool_calls": "sometimes"}, "parallel_tool_calls"),
    ({"tools": [TOOL, TOOL]}, "tools.1.function.name"),
    ({"tools": [{"type": "function", "function": {"name": "f g"}}]}, "tools.0.function.name"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "string"}}}]},
     "tools.0.function.parameters"),
    ({"tools": [TOOL], "tool_choice": "required", "response_format": {"type": "json_object"}}, "response_format"),
    ({"response_format": {"type": "json_schema"}}, "response_format.json_schema"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {
        "type": "object", "dependentSchemas": {"a": {}}}}}}, "response_format.json_schema.schema"),
    ({"functions": [TOOL["function"]]}, "functions"),
    ({"function_call": "auto"}, "function_call"),
    ({"stream_options": {"include_usage": True}}, "stream_options"),
    ({"stream_options": {"include_usage": True}, "stream": False}, "stream_options"),
    ({"echo": True}, "echo"),
    ({"best_of": 2}, "best_of"),
    ({"prompt_logprobs": 1}, "prompt_logprobs"),
    ({"min_tokens": 500, "max_tokens": 5}, "min_tokens"),
    ({"min_tokens": -1}, "min_tokens"),
    ({"chat_template_kwargs": {"tokenize": False}}, "chat_template_kwargs"),
    ({"chat_template_kwargs": {"add_generation_prompt": False}}, "chat_template_kwargs"),
    ({"messages": [{"role": "user", "content": "hi"},
                   {"role": "assistant", "content": None,
                    "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{x"}}]},
                   {"role": "tool", "tool_call_id": "c1", "content": "42"}]},
     "messages.1.tool_calls.0.function.arguments"),
    ({"messages": [{"role": "user", "content": "hi", "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}]}]}, "messages.0.tool_calls"),
    ({"messages": [{"role": "assistant", "content": "x", "function_call": {"name": "f", "arguments": "{}"}}]},
     "messages.0.function_call"),
    ({"messages": [{"role": "function", "name": "f", "content": "42"}]}, "messages.0.role"),
])
def test_fake_app_chat_rejects_unsupported_parameters(fake_app, extra, param):
    client, model = fake_app()
    error = _error(client.post("/v1/chat/completions", json=chat_body(**{"max_tokens": 3, **extra})), param)
    assert param.split(".")[-1] in error["message"] or param.startswith("messages")
    assert not model.sessions  # found before any swarm session


@pytest.mark.parametrize("extra, param", [
    ({"stream_options": {"include_usage": True}}, "stream_options"),
    ({"prompt_logprobs": 0}, "prompt_logprobs"),
    ({"best_of": 3}, "best_of"),
    ({"best_of": 1, "n": 2}, "best_of"),
    ({"min_tokens": 9, "max_tokens": 2}, "min_tokens"),
    ({"suffix": "x"}, "suffix"),
])
def test_fake_app_completions_reject_unsupported_parameters(fake_app, extra, param):
    client, model = fake_app()
    _error(client.post("/v1/completions", json={"model": "fake", "prompt": "a", "max_tokens": 2, **extra}), param)
    assert not model.sessions


def test_fake_app_accepts_no_op_values_and_unknown_vendor_fields(fake_app):
    client, _ = fake_app()
    for extra in ({"tool_choice": "none"}, {"function_call": "none"}, {"tools": None, "tool_choice": None},
                  {"best_of": 1}, {"n": 2, "best_of": 2}, {"echo": False}, {"stream_options": None},
                  {"some_vendor_field": {"a": 1}}, {"min_tokens": 0}):
        r = client.post("/v1/chat/completions", json=chat_body(temperature=0, max_tokens=3, **extra))
        assert r.status_code == 200, (extra, r.text)
    r = client.post("/v1/completions", json={"model": "fake", "prompt": "a", "max_tokens": 2, "best_of": 1,
                                             "vendor_thing": 1})
    assert r.status_code == 200, r.text
    # stream_options with stream true is fine on both endpoints
    assert _stream(client, chat_body(max_tokens=2, stream_options={"include_usage": False}))[-1] == "[DONE]"


def test_fake_app_min_tokens_masks_the_end_of_sequence(fake_app):
    client, _ = fake_app(text="ab")  # the script: 'a', 'b', then eos forever (its logits make eos the argmax)
    short = client.post("/v1/completions", json={"model": "fake", "prompt": "x", "max_tokens": 8,
                                                 "temperature": 0}).json()
    assert short["usage"]["completion_tokens"] < 8 and short["choices"][0]["finish_reason"] == "stop"
    for endpoint, body in (("/v1/completions", {"prompt": "x"}), ("/v1/chat/completions", chat_body())):
        r = client.post(endpoint, json={**body, "model": "fake", "max_tokens": 8, "temperature": 0,
                                        "min_tokens": 6}).json()
        assert r["usage"]["completion_tokens"] >= 6, r
    stopper = client.post("/v1/completions", json={"model": "fake", "prompt": "x", "max_tokens": 8, "temperature": 0,
                                                   "min_tokens": 5, "ignore_eos": False, "stop_token_ids": [2]}).json()
    assert stopper["usage"]["completion_tokens"] >= 5


def test_fake_app_chat_template_kwargs_reach_the_template(fake_app, tokenizer):
    client, _ = fake_app()
    plain = client.post("/tokenize", json={"model": "fake", "messages": [{"role": "user", "content": "hi"}]}).json()
    template = tokenizer.chat_template
    try:
        tokenizer.chat_template = template + "{% if greeting %}{{ greeting }}{% endif %}"
        r = client.post("/tokenize", json={"model": "fake", "messages": [{"role": "user", "content": "hi"}],
                                           "chat_template_kwargs": {"greeting": "HELLO THERE"}}).json()
        assert r["count"] > plain["count"]
        assert tokenizer.decode(r["tokens"]).endswith("HELLO THERE")
        chat = client.post("/v1/chat/completions", json=chat_body(max_tokens=2, temperature=0,
                                                              chat_template_kwargs={"greeting": "HELLO THERE"}))
        assert chat.status_code == 200 and chat.json()["usage"]["prompt_tokens"] > plain["count"] - 5
    finally:
        tokenizer.chat_template = template
    tool = client.post("/tokenize", json={"model": "fake", "messages": [{"role": "tool", "content": "x"}]}).json()
    assert "<tool_response>\nx\n</tool_response>" in tokenizer.decode(tool["tokens"])  # gateway.structured.tools'
    # rendering

# ---- servers' weight formats (allowed_quant_types, issue 14) --------------------------------------------------------
def test_config_allowed_quant_types_from_cli_yaml_env(tmp_path):
    from swarm.runtime.config import ConfigError, build_parser, load_config

    assert GatewayConfig(model="m").allowed_quant_types is None
    path = tmp_path / "gw.yaml"
    path.write_text("gateway:\n  model: m\n  allowed_quant_types: [nf4, none]\n")
    config = load_config(GatewayConfig, None, yaml_path=str(path), environ={}, section="gateway")
    assert config.allowed_quant_types == ["none", "nf4"]
    environ = {"SWARMGATE_MODEL": "m", "SWARMGATE_ALLOWED_QUANT_TYPES": "int8,none"}
    assert load_config(GatewayConfig, None, environ=environ).allowed_quant_types == ["none", "int8"]
    args = build_parser(GatewayConfig, "gw", "", positional="model").parse_args(
        ["m", "--allowed_quant_types", "int8", "nf4"])
    assert load_config(GatewayConfig, args, environ=environ).allowed_quant_types == ["int8", "nf4"]  # CLI wins
    with pytest.raises(ConfigError, match=r"allowed_quant_types.*unknown quant type\(s\) 'fp8'.*none, int8, nf4"):
        load_config(GatewayConfig, None, environ={"SWARMGATE_MODEL": "m", "SWARMGATE_ALLOWED_QUANT_TYPES": "fp8"})
    args = build_parser(GatewayConfig, "gw", "", positional="model").parse_args(["m", "--allowed_quant_types"])
    with pytest.raises(ConfigError, match="allowed_quant_types is empty"):
        load_config(GatewayConfig, args, environ={})


def test_load_model_passes_allowed_quant_types(monkeypatch):
    import swarm
    from gateway.app import load_model

    seen = {}

    def fake_from_pretrained(name, **kwargs):
        seen.update(kwargs, name=name)
        return "model"

    monkeypatch.setattr(swarm.AutoDistributedModelForCausalLM, "from_pretrained", staticmethod(fake_from_pretrained))
    config = GatewayConfig(model="m", initial_peers=["/ip4/1"], allowed_quant_types=["int8"])
    assert load_model(config) == "model" and seen["allowed_quant_types"] == ["int8"] and seen["name"] == "m"
    load_model(GatewayConfig(model="m", initial_peers=["/ip4/1"]))
    assert seen["allowed_quant_types"] is None
    assert str(seen["device"]) == "cpu"


def test_the_device_flag_is_checked_and_a_missing_gpu_is_a_clear_error(monkeypatch):
    import torch

    import swarm
    from gateway.app import load_model
    from swarm.runtime.config import ConfigError, build_parser, load_config

    assert GatewayConfig.model_fields["device"].description
    args = build_parser(GatewayConfig, "gw", "", positional="model").parse_args(["m", "--device", "cuda:1"])
    assert load_config(GatewayConfig, args, environ={}).device == "cuda:1"
    for bad in ("gpu", "cuda:x", "cuda:", ""):
        with pytest.raises(ConfigError, match=r"device.*use cpu, cuda or cuda:N"):
            load_config(GatewayConfig, None, environ={"SWARMGATE_MODEL": "m", "SWARMGATE_DEVICE": bad})
    seen = {}
    monkeypatch.setattr(swarm.AutoDistributedModelForCausalLM, "from_pretrained",
                        staticmethod(lambda name, **kwargs: seen.update(kwargs) or "model"))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ValueError, match="device 'cuda': no such CUDA device here"):
        load_model(GatewayConfig(model="m", initial_peers=["/ip4/1"], device="cuda"))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    with pytest.raises(ValueError, match="device 'cuda:1': no such CUDA device here"):
        load_model(GatewayConfig(model="m", initial_peers=["/ip4/1"], device="cuda:1"))
    assert load_model(GatewayConfig(model="m", initial_peers=["/ip4/1"], device="cuda:0")) == "model"
    assert seen["device"] == torch.device("cuda", 0)  # the embeddings, norm and head go there


def test_health_shows_the_quant_type_of_servers(fake_app):
    from swarm.client.api import ServerView

    views = (ServerView("A", 0, 2, "none", True), ServerView("B", 2, 4, "nf4", True),
             ServerView("C", 0, 4, "int8", True))
    client, _ = fake_app(coverage=Coverage([], 4, 3, views, None))
    health = client.get("/health")
    assert health.status_code == 200
    body = health.json()
    assert (body["status"], body["blocks"], body["servers"], body["model"]) == ("ok", 4, 3, "fake")  # kept fields
    assert body["allowed_quant_types"] is None
    assert body["quant_types"] == {"int8": 1, "nf4": 1, "none": 1}
    assert body["block_quant_types"] == [{"blocks": "0:2", "quant_types": ["int8", "none"]},
                                         {"blocks": "2:4", "quant_types": ["int8", "nf4"]}]
    assert body["server_spans"][0] == {"peer_id": "A", "blocks": "0:2", "quant_type": "none", "allowed": True}
    assert [s["peer_id"] for s in body["server_spans"]] == ["A", "C", "B"]
    # the old three-field coverage of a stub still works, with empty quant details
    client, _ = fake_app()
    body = client.get("/health").json()
    assert body["status"] == "ok" and body["quant_types"] == {} and body["server_spans"] == []
    assert body["block_quant_types"] == [{"blocks": "0:4", "quant_types": []}]


def test_health_names_blocks_served_only_by_disallowed_formats(fake_app):
    from swarm.client.api import ServerView

    views = (ServerView("A", 0, 2, "none", True), ServerView("B", 2, 4, "nf4", False))
    client, _ = fake_app(coverage=Coverage([2, 3], 4, 1, views, ("none",)), allowed_quant_types=["none"])
    health = client.get("/health")
    assert health.status_code == 503
    body = health.json()
    assert body["missing_blocks"] == [2, 3] and body["servers"] == 1 and body["allowed_quant_types"] == ["none"]
    assert "blocks 2:4 are not served by any online server of an allowed quant type" in body["message"]
    assert "blocks 2:4 are served only by nf4 servers; allowed quant types: none" in body["message"]
    assert body["server_spans"][1] == {"peer_id": "B", "blocks": "2:4", "quant_type": "nf4", "allowed": False}
    client, _ = fake_app(covered=False)  # no server at all: the message says only that
    body = client.get("/health").json()
    assert body["message"] == "blocks 0:4 are not served by any online server"


def test_admission_refuses_past_running_plus_queue_even_when_requests_arrive_together():
    """12 requests in the same event-loop turn on max_concurrent=2, max_queue=2: 2 run, 2 wait, 8 get 429 with
    Retry-After (the requests that have their slot but have not resumed yet count as taken); released slots go
    to the waiting ones."""
    import asyncio

    from gateway.api.admission import Admission
    from gateway.errors import APIError

    async def scenario():
        admission = Admission(2, 2, queue_timeout=30, retry_after=3)

        async def one():
            try:
                await admission.acquire()
                return "admitted"
            except APIError as e:
                return e.status, e.headers

        tasks = [asyncio.create_task(one()) for _ in range(12)]
        await asyncio.sleep(0.05)
        first = [t.result() for t in tasks if t.done()]
        assert sorted(map(str, first)) == sorted(["admitted"] * 2 + [str((429, {"Retry-After": "3"}))] * 8)
        assert (admission.running, admission.waiting) == (2, 2)
        admission.release()
        admission.release()
        await asyncio.sleep(0.05)
        assert all(t.done() for t in tasks) and (admission.running, admission.waiting) == (2, 0)
        admission.release()
        admission.release()
        assert admission.running == 0

    asyncio.run(scenario())


def test_metrics_label_each_servers_prefix_cache_counters_and_read_them_once_per_period():
    """`/metrics`' server prefix cache families (the real swarm: test_gateway.py): one sample per server by peer id,
    servers without a cache left out, one reading of the servers shared by the scrapes of a period, a failed reading
    leaves the rest of the scrape."""
    from prometheus_client.parser import text_string_to_metric_families

    from gateway.metrics import Metrics
    from swarm.wire.call_messages import PrefixCacheReport

    calls = []

    def source():
        calls.append(1)
        if len(calls) > 1:
            raise RuntimeError("no DHT")
        return {"peerA": PrefixCacheReport(enabled=True, page_tokens=64, pages_held=3, pages_hit=5, pages_computed=7,
                                           pages_evicted=1),
                "peerB": PrefixCacheReport(enabled=False)}

    metrics = Metrics()
    assert b"swarmgate_server_prefix" not in metrics.render()  # no source: no family
    metrics.prefix_source = source
    samples = {(s.name, s.labels.get("peer_id")): s.value
               for family in text_string_to_metric_families(metrics.render().decode())
               for s in family.samples if s.name.startswith("swarmgate_server_prefix")}
    assert samples == {("swarmgate_server_prefix_pages_held", "peerA"): 3,
                       ("swarmgate_server_prefix_pages_hit_total", "peerA"): 5,
                       ("swarmgate_server_prefix_pages_computed_total", "peerA"): 7,
                       ("swarmgate_server_prefix_pages_evicted_total", "peerA"): 1,
                       ("swarmgate_server_prefix_sessions_declined_total", "peerA"): 0}
    metrics.render()
    assert len(calls) == 1  # the same period: the servers were not asked again
    metrics.prefix_collector._read = None  # the period is over
    text = metrics.render()
    assert len(calls) == 2 and b"swarmgate_server_prefix" not in text and b"swarmgate_requests" in text


def test_a_generation_ended_by_the_gateways_shutdown_is_a_503_that_says_so(caplog):
    """A generation that joins the engine rounds after (or is in them when) the gateway starts stopping ends with
    `ShuttingDown`: a 503 `shutting_down` error for its client, no traceback in the log (nothing failed)."""
    from gateway.serving.events import ShuttingDown, swarm_error
    from gateway.serving.rounds import EngineRounds

    rounds = EngineRounds(vocab_size=8)
    rounds.shutdown()
    with pytest.raises(ShuttingDown) as raised:
        rounds.run(object())  # type: ignore[arg-type]
    with caplog.at_level("ERROR"):
        error = swarm_error(raised.value)
    assert (error.status, error.code) == (503, "shutting_down") and "shutting down" in error.message
    assert caplog.text == ""
