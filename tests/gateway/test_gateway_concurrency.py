"""The gateway under concurrency (issue 17), end to end on the session's shared gateway over the test swarm
(max_concurrent 8, max_queue 2: tests/fixtures/shared_processes.py SHARED_FLAGS): greedy requests give the same
text whether they run alone or with 7 others (streamed, not streamed, some of them finishing early on max_tokens or
a stop string), the same as local `transformers`; past the admission limits the excess gets 429 with Retry-After at
once, the queued requests complete correctly once slots free, and the gateway stays up. Speed is measured by
bench/bench_load.py, not here."""
from __future__ import annotations

import json
import threading

import httpx
import pytest
import torch

from tests.fixtures.gateway_fixtures import gateway, one_torch_thread, wait_until  # noqa: F401

MODEL = "smollm2-135m-instruct"
PROMPTS = ["Name a fruit that is yellow.", "What is the capital of France?", "Give me a word that rhymes with cat.",
           "Why is the sky blue?", "Write a haiku about rain.", "How many legs does a spider have?",
           "Suggest a name for a puppy.", "What do bees make?"]
TOKENS = 16
SHORT = {1: 3, 5: 5}  # requests that stop early on max_tokens in the mixed round


def request(i: int, max_tokens: int = TOKENS, **extra) -> dict:
    return {"model": MODEL, "messages": [{"role": "user", "content": PROMPTS[i]}], "temperature": 0,
            "max_tokens": max_tokens, **extra}


def run(url: str, body: dict, stream: bool) -> tuple:
    """(text, finish_reason) of one chat completion, streamed or not."""
    if not stream:
        r = httpx.post(url + "/v1/chat/completions", json=body, timeout=180)
        assert r.status_code == 200, r.text
        choice = r.json()["choices"][0]
        return choice["message"]["content"], choice["finish_reason"]
    text, finish = "", None
    with httpx.stream("POST", url + "/v1/chat/completions", json={**body, "stream": True}, timeout=180) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if line.startswith("data: {"):
                for choice in json.loads(line[6:])["choices"]:
                    text += choice["delta"].get("content") or ""
                    finish = choice.get("finish_reason") or finish
    return text, finish


def first_content(lines) -> str:
    """The first non-empty text of a streamed chat completion, read from its `iter_lines()` (which the caller
    keeps: closing that iterator closes the stream)."""
    for line in lines:
        if line.startswith("data: {"):
            for choice in json.loads(line[6:])["choices"]:
                if choice["delta"].get("content"):
                    return choice["delta"]["content"]
    raise AssertionError("the stream ended without text")


def concurrently(calls) -> list:
    """Run the zero-argument callables at once in threads; their results in order (exceptions re-raised)."""
    results: list = [None] * len(calls)

    def worker(i):
        try:
            results[i] = calls[i]()
        except BaseException as e:  # re-raised below
            results[i] = e

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(len(calls))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    for r in results:
        if isinstance(r, BaseException):
            raise r
    return results


@pytest.fixture(scope="module")
def alone(gateway):
    """Each request's text run alone: {(i, max_tokens): text} for the full and the early-stopping lengths."""
    texts = {}
    for i in range(len(PROMPTS)):
        for tokens in (TOKENS, SHORT.get(i)):
            if tokens:
                texts[i, tokens] = run(gateway.url, request(i, tokens), stream=False)[0]
    return texts


def test_eight_concurrent_greedy_streams_equal_their_single_runs(gateway, alone, tokenizer, reference_model):
    for i in (0, 3):  # alone equals local transformers
        enc = tokenizer.apply_chat_template(request(i)["messages"], add_generation_prompt=True, return_tensors="pt",
                                            return_dict=True)
        with torch.no_grad():
            out = reference_model.generate(**enc, max_new_tokens=TOKENS, do_sample=False)
        assert alone[i, TOKENS] == tokenizer.decode(out[0, enc["input_ids"].shape[1]:], skip_special_tokens=True)
    texts = concurrently([lambda i=i: run(gateway.url, request(i), stream=True)[0] for i in range(len(PROMPTS))])
    assert texts == [alone[i, TOKENS] for i in range(len(PROMPTS))]


def test_mixed_concurrent_requests_with_early_finishers(gateway, alone):
    """Streamed and non-streamed requests at once; two stop on max_tokens, one on a stop string taken from its
    single-run text: every text equals its single run's (cut at the stop string)."""
    words = alone[3, TOKENS].split()
    assert len(words) >= 3, alone[3, TOKENS]
    stop = " " + words[2]
    bodies = [request(i, SHORT.get(i, TOKENS)) for i in range(len(PROMPTS))]
    bodies[3]["stop"] = [stop]
    results = concurrently([lambda i=i: run(gateway.url, bodies[i], stream=i % 2 == 0) for i in range(len(PROMPTS))])
    expected = [alone[i, SHORT.get(i, TOKENS)] for i in range(len(PROMPTS))]
    expected[3] = alone[3, TOKENS][:alone[3, TOKENS].index(stop)]
    assert [text for text, _ in results] == expected
    assert results[1][1] == results[5][1] == "length" and results[3][1] == "stop"


def test_overload_is_429_and_the_queued_requests_complete(gateway, alone):
    """8 long streams hold every slot and 2 requests wait: 3 more get 429 with Retry-After at once; once the long
    streams are closed, the 2 queued ones complete with their single-run text and the gateway serves on."""
    metrics = lambda: httpx.get(gateway.url + "/metrics").text  # noqa: E731
    # the shared gateway: no earlier module's request still holds a slot or waits (a precondition, not a timing)
    assert wait_until(lambda: "swarmgate_running_requests 0.0" in (m := metrics()) and
                      "swarmgate_queue_length 0.0" in m, 120)
    http = httpx.Client(timeout=180)
    try:
        blockers = [http.send(http.build_request("POST", gateway.url + "/v1/chat/completions",
                                                 json=request(i, 300, ignore_eos=True, stream=True)), stream=True)
                    for i in range(8)]
        assert [r.status_code for r in blockers] == [200] * 8
        streams = [r.iter_lines() for r in blockers]
        for i, lines in enumerate(streams):  # each generates: its first text is the beginning of its single run's
            assert alone[i, TOKENS].startswith(first_content(lines))
        assert "swarmgate_running_requests 8.0" in metrics()
        queued: list = []
        waiter = threading.Thread(target=lambda: queued.extend(concurrently(
            [lambda i=i: run(gateway.url, request(i), stream=i == 2) for i in (2, 5)])), daemon=True)
        waiter.start()
        assert wait_until(lambda: "swarmgate_queue_length 2.0" in metrics(), 60)
        for i in range(3):
            refused = httpx.post(gateway.url + "/v1/chat/completions", json=request(i, stream=i == 0), timeout=30)
            assert refused.status_code == 429, refused.text
            assert refused.headers["retry-after"] == "2"
            assert refused.json()["error"]["code"] == "rate_limit_exceeded"
    finally:
        http.close()  # closes the long streams: their slots free
    waiter.join(240)
    assert [text for text, _ in queued] == [alone[2, TOKENS], alone[5, TOKENS]]
    assert httpx.get(gateway.url + "/health").status_code == 200
    assert run(gateway.url, request(7), stream=True)[0] == alone[7, TOKENS]
