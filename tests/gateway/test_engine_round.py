"""The gateway's engine round (`gateway.serving.rounds`) on a real swarm: a tiny random Llama (4 blocks) on four
real servers (0:2 and three 2:4) and a real gateway. Concurrent generations stepped together in one round get the
tokens each gets alone (greedy: transformers' own text; seeded sampling, n=2 and logprobs: the same request run
alone); a stream cancelled mid-way and a bad request beside them change no one's tokens; 64 concurrent streams
(256 in the extended tier) complete; a server frozen mid-generation (found by the liveness pings) and one killed
(its streams end at once) fail their sessions over and every stream's text is still its undisturbed one. The
gateway's `swarmgate_round_rows` histogram shows that rows of several generations were picked in one round (else
the test would not test rounds)."""
from __future__ import annotations

import asyncio
import datetime
import json
import re
import signal
from typing import List, Optional

import httpx
import pytest

from launch.topology import start_servers, terminate_all
from swarm.client.transport import rounds
from swarm.client.transport.manager import ClientConfig, SwarmManager
from swarm.runtime import aio
from tests.fixtures.gateway_fixtures import one_torch_thread, reference_text, start_gateway  # noqa: F401
from tests.fixtures.tiny_checkpoints import save_tiny

PROMPTS = ["Name a color.", "Count to five.", "Say hello in French.", "What is two plus two?"]
MAX_TOKENS = 12


def chat(prompt: str, **fields) -> dict:
    return {"messages": [{"role": "user", "content": prompt}], "max_tokens": MAX_TOKENS, "temperature": 0,
            "stream": True, **fields}


def mixed_bodies() -> List[dict]:
    """Greedy requests and seeded sampled ones (warpers, penalties, logit bias, n=2, logprobs)."""
    return [chat(p) for p in PROMPTS] + [
        chat(PROMPTS[0], temperature=0.9, seed=7, ignore_eos=True),
        chat(PROMPTS[1], temperature=1.2, top_p=0.9, top_k=50, seed=8, logprobs=True, top_logprobs=2,
             ignore_eos=True),
        chat(PROMPTS[2], temperature=1.0, presence_penalty=0.6, frequency_penalty=0.4, logit_bias={"11": 4},
             seed=9, ignore_eos=True),
        chat(PROMPTS[3], temperature=0.8, n=2, seed=10, ignore_eos=True),
    ]


async def stream(http: httpx.AsyncClient, url: str, model: str, body: dict, cancel_after: Optional[int] = None,
                 on_chunk=None) -> dict:
    """One streamed chat: {'status', 'texts' per choice, 'finish' per choice, 'logprobs' tokens, 'errors'}."""
    out: dict = {"status": 0, "texts": {}, "finish": {}, "logprobs": [], "errors": [], "chunks": 0}
    async with http.stream("POST", url + "/v1/chat/completions", json={"model": model, **body}) as response:
        out["status"] = response.status_code
        if response.status_code != 200:
            await response.aread()
            out["errors"].append(response.text)
            return out
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if "error" in chunk:
                out["errors"].append(chunk["error"])
                continue
            out["chunks"] += 1
            for choice in chunk["choices"]:
                i = choice["index"]
                out["texts"][i] = out["texts"].get(i, "") + (choice["delta"].get("content") or "")
                if choice.get("finish_reason"):
                    out["finish"][i] = choice["finish_reason"]
                for entry in (choice.get("logprobs") or {}).get("content") or ():
                    out["logprobs"].append((entry["token"], round(entry["logprob"], 4)))
            if on_chunk is not None:
                on_chunk(out["chunks"])
            if cancel_after is not None and out["chunks"] >= cancel_after:
                return out  # leaving the block closes the connection: the gateway cancels the generation
    return out


def run_all(url: str, model: str, bodies: List[dict], **kwargs) -> List[dict]:
    async def go():
        limits = httpx.Limits(max_connections=len(bodies) + 4, max_keepalive_connections=len(bodies) + 4)
        async with httpx.AsyncClient(timeout=httpx.Timeout(240.0), limits=limits) as http:
            return await asyncio.gather(*(stream(http, url, model, b, **kwargs.get(str(i), {}))
                                          for i, b in enumerate(bodies)))
    return asyncio.run(go())


def rounds_with_rows_above(url: str, rows: int) -> int:
    """How many of the gateway's engine rounds picked more than `rows` rows (from /metrics)."""
    text = httpx.get(url + "/metrics", timeout=60).text
    count = float(re.search(r"^swarmgate_round_rows_count(?:\{[^}]*\})? (\S+)$", text, re.M).group(1))
    bucket = float(re.search(rf'^swarmgate_round_rows_bucket\{{[^}}]*le="{float(rows)}"[^}}]*\}} (\S+)$', text,
                             re.M).group(1))
    return int(count - bucket)


@pytest.fixture(scope="module")
def tiny_swarm(bootstrap, model_path, tmp_path_factory):
    from transformers import AutoTokenizer

    path = tmp_path_factory.mktemp("round46") / "tiny-round"
    reference = save_tiny("llama", path, model_path)
    prefix = "tround46"
    # three 2:4 servers: one is frozen, one killed, the last takes their sessions; no CPU turns (a server frozen
    # while it holds the machine-wide turn, `swarm.runtime.cpu_turns`, would stop every other process's compute)
    servers = start_servers(str(path), [bootstrap.maddr], ["0:2", "2:4", "2:4", "2:4"], prefix, threads=1,
                            extra=["--max_sessions_per_peer", "600"], env={"SWARMGATE_CPU_TURNS": "0"})
    swarm = {"prefix": prefix, "servers": servers, "initial_peers": [bootstrap.maddr]}
    gateway = None
    try:
        gateway = start_gateway(str(path), swarm, "--max_concurrent", "256", "--max_queue", "64")
        yield {"url": gateway.url, "model": path.name, "reference": reference, "servers": servers, "gateway": gateway,
               "tokenizer": AutoTokenizer.from_pretrained(path), "bootstrap": bootstrap, "frozen": []}
    finally:
        terminate_all(([gateway.proc] if gateway is not None else []) + servers)


@pytest.fixture(scope="module")
def alone(tiny_swarm):
    """Each of `mixed_bodies` run by itself, one after another: what it must get in any round."""
    return [run_all(tiny_swarm["url"], tiny_swarm["model"], [body])[0] for body in mixed_bodies()]


def test_rows_of_many_generations_get_the_tokens_each_gets_alone(tiny_swarm, alone):
    url, model = tiny_swarm["url"], tiny_swarm["model"]
    for i, prompt in enumerate(PROMPTS):  # greedy alone: transformers' own text
        expected = reference_text(tiny_swarm["tokenizer"], tiny_swarm["reference"],
                                  [{"role": "user", "content": prompt}], MAX_TOKENS)
        assert alone[i]["texts"] == {0: expected}, prompt
    assert all(a["status"] == 200 and not a["errors"] for a in alone)
    assert len(alone[-1]["texts"]) == 2 and alone[-1]["texts"][0] != alone[-1]["texts"][1]  # n=2, seeds 10, 11
    assert len(alone[5]["logprobs"]) == MAX_TOKENS
    before = rounds_with_rows_above(url, 1)
    together = run_all(url, model, mixed_bodies())
    for got, expected in zip(together, alone):
        assert got["errors"] == [] and got["texts"] == expected["texts"] and got["finish"] == expected["finish"]
        assert got["logprobs"] == expected["logprobs"]
    assert rounds_with_rows_above(url, 1) > before  # several generations' rows in one round


def test_a_cancelled_stream_and_a_bad_request_leave_the_others_unchanged(tiny_swarm, alone):
    url, model = tiny_swarm["url"], tiny_swarm["model"]
    bodies = mixed_bodies() + [chat(PROMPTS[0], max_tokens=200, ignore_eos=True),  # cancelled after 3 chunks
                               chat(PROMPTS[1], logit_bias={"999999": 5})]  # a bad request: 400
    got = run_all(url, model, bodies, **{str(len(bodies) - 2): {"cancel_after": 3}})
    cancelled, bad = got[-2], got[-1]
    assert cancelled["chunks"] == 3 and not cancelled["finish"]
    assert bad["status"] == 400 and "logit_bias" in bad["errors"][0]
    for g, expected in zip(got, alone):
        assert g["errors"] == [] and g["texts"] == expected["texts"] and g["logprobs"] == expected["logprobs"]
    after = run_all(url, model, [mixed_bodies()[0]])[0]  # and the engine goes on
    assert after["texts"] == alone[0]["texts"]


def round_counters(tiny_swarm) -> dict:
    """Each server's round counters (`rpc_round_stats`): messages and rows received in round messages."""
    manager = SwarmManager(ClientConfig(initial_peers=[tiny_swarm["bootstrap"].maddr]), "tround46", 30)
    try:
        return {s.peer_id: aio.run(rounds.round_stats(manager, s.peer_id))
                for s in tiny_swarm["servers"] if s.proc.poll() is None}
    finally:
        manager.shutdown()


def concurrent_streams_complete(tiny_swarm, count: int) -> None:
    url, model = tiny_swarm["url"], tiny_swarm["model"]
    bodies = [chat(PROMPTS[i % len(PROMPTS)], max_tokens=8, ignore_eos=True,
                   stream_options={"include_usage": True}) for i in range(count)]
    before = rounds_with_rows_above(url, 8)
    counters = round_counters(tiny_swarm)
    got = run_all(url, model, bodies)
    assert [g["errors"] for g in got] == [[]] * count
    assert all(g["status"] == 200 and g["finish"] == {0: "length"} for g in got)
    by_prompt = {}
    for body, g in zip(bodies, got):  # the same prompt, the same greedy text, whatever the crowd
        by_prompt.setdefault(body["messages"][0]["content"], set()).add(g["texts"][0])
    assert all(len(texts) == 1 for texts in by_prompt.values())
    assert rounds_with_rows_above(url, 8) > before  # many rows per round
    # ... which reached the servers as round messages, many sessions' rows in each (issue 46: one message per
    # server per round): every decode step after the prompt's is a row; far fewer messages than rows
    after = round_counters(tiny_swarm)
    rows = sum(after[peer].rows - counters[peer].rows for peer in after)
    messages = sum(after[peer].messages - counters[peer].messages for peer in after)
    assert rows >= count * 7 and messages * 4 <= rows, (rows, messages)


def test_64_concurrent_streams_complete(tiny_swarm):
    concurrent_streams_complete(tiny_swarm, 64)


def test_256_concurrent_streams_complete(tiny_swarm):
    concurrent_streams_complete(tiny_swarm, 256)


def disturb_mid_generation(tiny_swarm, act) -> tuple:
    """Four greedy streams of 40 tokens; after the first one's 4th chunk, `act(server)` on a live 2:4 server that
    holds a session. Returns (what each stream got, its undisturbed text, the server, the gateway's log)."""
    url, model, servers = tiny_swarm["url"], tiny_swarm["model"], tiny_swarm["servers"]
    bodies = [chat(p, max_tokens=40) for p in PROMPTS]
    undisturbed = [run_all(url, model, [b])[0]["texts"] for b in bodies]
    manager = SwarmManager(ClientConfig(initial_peers=[tiny_swarm["bootstrap"].maddr]), "tround46", 30)
    victims: list = []

    def once(chunks: int) -> None:
        if chunks == 4 and not victims:
            busy = [s for s in servers[1:] if s.proc.poll() is None and s not in tiny_swarm["frozen"]
                    and manager.server_info(s.peer_id).sessions_open > 0]
            assert busy, "no 2:4 server holds a session"
            act(busy[0])
            victims.append(busy[0])

    try:
        got = run_all(url, model, bodies, **{"0": {"on_chunk": once}})
    finally:
        manager.shutdown()
    assert victims, "the streams ended before a server could be disturbed"
    log = tiny_swarm["gateway"].proc.log_path.read_text(errors="replace")
    return got, undisturbed, victims[0], log


def round_failures(log: str, peer_id: str) -> List[str]:
    """The gateway's log lines of round messages to `peer_id` that failed (`swarm.client.transport.rounds`)."""
    return [line for line in log.splitlines() if f"a round message to {peer_id} failed" in line]


def test_a_frozen_server_fails_its_round_rows_over_by_liveness(tiny_swarm):
    """A 2:4 server holding sessions freezes mid-generation (SIGSTOP to it and its p2pd: its connections stay open
    and say nothing, as a frozen host's): the round message waiting on it is failed by the liveness pings (not by
    the 120 s step time-out), its sessions fail over to another 2:4 server, and every stream's text is its
    undisturbed one (transformers' own, `test_rows_of_many_generations_get_the_tokens_each_gets_alone`)."""
    def freeze(server) -> None:
        server.signal_tree(signal.SIGSTOP)
        tiny_swarm["frozen"].append(server)
        print(f"\nfroze {server.peer_id} at {datetime.datetime.now():%H:%M:%S.%f}")  # against the log's times

    got, undisturbed, victim, log = disturb_mid_generation(tiny_swarm, freeze)
    try:
        assert [g["errors"] for g in got] == [[]] * len(got), log[-5000:]
        assert [g["texts"] for g in got] == undisturbed, log[-5000:]
        failures = round_failures(log, victim.peer_id)
        assert failures and all("[unreachable] no reply for" in line for line in failures), failures
        assert f"server {victim.peer_id} is unreachable" in log  # `swarm.client.transport.liveness`
        print("\n" + "\n".join(line for line in log.splitlines() if victim.peer_id in line))
    finally:
        victim.kill()  # SIGKILL ends a stopped process too


def test_a_failover_in_one_generation_leaves_every_text_unchanged(tiny_swarm):
    """(Last: it kills a server.) A 2:4 server holding sessions dies mid-generation (SIGKILL to it and its p2pd):
    its round stream ends at once (the connection closed, `swarm.wire.duplex`: no wait for a time-out or a ping),
    its sessions replay onto another 2:4 server, and every stream's text is its undisturbed one."""
    got, undisturbed, victim, log = disturb_mid_generation(tiny_swarm, lambda server: server.kill())
    assert [g["errors"] for g in got] == [[]] * len(got), log[-5000:]
    assert [g["texts"] for g in got] == undisturbed, log[-5000:]
    failures = round_failures(log, victim.peer_id)
    assert failures and "[closed] the server closed the round stream" in failures[0], failures
    assert f"server {victim.peer_id} is unreachable" not in log  # seen at once, not by the liveness pings
    print("\n" + "\n".join(line for line in log.splitlines() if victim.peer_id in line))
