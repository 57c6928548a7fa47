"""Real gateway processes over the test swarm sharing a state store (`gateway.store`): a real SQLite file and a real
`redis-server` (tests/fixtures/redis_server.py). Three gateways, started together once for the module: two on one
Redis, one on an SQLite file.

- SIGKILL the SQLite gateway and start another on the same file: the stored response, the key and its usage are
  there, the file is intact, and a `previous_response_id` chain continues.
- Two gateways on one Redis: a response stored by one is read and continued by the other; one key's requests per
  minute are counted across both (the 429 comes from the gateway that saw one of the three earlier requests); a key
  revoked with `swarmgate keys revoke` is refused by both at their next request.
- Redis stopped while they run: what needs the store is a 503 saying so, a config key's chat still works, `/health`
  answers; Redis back: the same gateways serve the stored keys again without a restart.
- A store that cannot be opened at start (a corrupt SQLite file, an unreachable Redis): one line, exit code 2.
The in-process cases (limits, headers, usage, 32 concurrent requests, the command): test_gateway_keys.py."""
from __future__ import annotations

import sqlite3
import subprocess
import sys
import time

import httpx
import pytest

from gateway.store import KeyLimits, open_store, usage_totals
from tests.fixtures.gateway_fixtures import SPANS, one_torch_thread, ready, spawn_gateway, wait_until  # noqa: F401
from tests.fixtures.redis_server import RedisServer, ensure_redis_server, free_port

CONFIG_KEY = "sk-config-key"
MODEL: list = []  # the served model's id, read once the gateways are up


@pytest.fixture(scope="module")
def setup(swarms, model_path, tmp_path_factory):
    """{redis: RedisServer (persisted), sqlite_url, keys: {name: key}, swarm, a, b (Redis gateways), s1 (SQLite)}"""
    swarm = swarms.get(SPANS)
    server = RedisServer(ensure_redis_server(), persist=True)
    server.start()
    sqlite_url = f"sqlite:///{tmp_path_factory.mktemp('state')}/gateway.sqlite3"
    shared, local = open_store(server.url()), open_store(sqlite_url)
    keys = {"shared": shared.create_key("shared", KeyLimits()), "victim": shared.create_key("victim", KeyLimits()),
            "durable": local.create_key("durable", KeyLimits())}
    shared.close()
    local.close()
    common = ("--api_keys", CONFIG_KEY, "--max_concurrent", "2")
    procs = {"a": spawn_gateway(model_path, swarm["initial_peers"], swarm["prefix"], "--database_url", server.url(),
                                *common, name="gateway-redis-a"),
             "b": spawn_gateway(model_path, swarm["initial_peers"], swarm["prefix"], "--database_url", server.url(),
                                *common, name="gateway-redis-b"),
             "s1": spawn_gateway(model_path, swarm["initial_peers"], swarm["prefix"], "--database_url", sqlite_url,
                                 *common, name="gateway-sqlite")}
    try:
        gateways = {name: ready(proc, swarm) for name, proc in procs.items()}
    except BaseException:
        for proc in procs.values():
            proc.kill()
        server.close()
        raise
    model = httpx.get(gateways["a"].base_url + "/models", headers={"Authorization": f"Bearer {CONFIG_KEY}"}
                      ).json()["data"][0]["id"]
    MODEL.append(model)
    yield {"redis": server, "sqlite_url": sqlite_url, "keys": keys, "swarm": swarm, **gateways}
    for proc in procs.values():
        proc.kill() if proc.proc.poll() is None else None
    server.close()


def _post(gateway, path, key, body):
    return httpx.post(gateway.url + path, json=body, headers={"Authorization": f"Bearer {key}"}, timeout=180)


def _respond(gateway, key, text, previous=None):
    body = {"model": MODEL[0], "input": text, "max_output_tokens": 16, "temperature": 0}
    if previous is not None:
        body["previous_response_id"] = previous
    r = _post(gateway, "/v1/responses", key, body)
    assert r.status_code == 200, r.text
    return r.json()


def test_a_sigkilled_gateway_restarted_on_its_sqlite_file_continues(setup, model_path):
    key, url = setup["keys"]["durable"], setup["sqlite_url"]
    first = _respond(setup["s1"], key, "My name is Ada. Say hello to me.")
    store = open_store(url)
    assert wait_until(lambda: usage_totals(store.usage("durable")).get("durable", {}).get("requests") == 1, 60)
    setup["s1"].proc.kill()  # SIGKILL, its process group
    assert sqlite3.connect(url[len("sqlite:///"):]).execute("PRAGMA integrity_check").fetchone()[0] == "ok"
    swarm = setup["swarm"]
    s2 = ready(spawn_gateway(model_path, swarm["initial_peers"], swarm["prefix"], "--database_url", url,
                             "--api_keys", CONFIG_KEY, name="gateway-sqlite-again"), swarm)
    try:
        got = httpx.get(f"{s2.url}/v1/responses/{first['id']}", headers={"Authorization": f"Bearer {key}"},
                        timeout=60)
        assert got.status_code == 200 and got.json()["output"] == first["output"]
        second = _respond(s2, key, "What is my name?", previous=first["id"])
        usage, before = second["usage"], first["usage"]
        assert usage["input_tokens"] > before["input_tokens"] + before["output_tokens"]  # the first turn came first
        assert [k.name for k in store.list_keys()] == ["durable"] and store.list_keys()[0].last_used is not None
        assert wait_until(lambda: usage_totals(store.usage("durable"))["durable"]["requests"] == 2, 60)
        totals = usage_totals(store.usage("durable"))["durable"]
        assert totals["prompt_tokens"] == before["input_tokens"] + usage["input_tokens"]
        assert totals["completion_tokens"] == before["output_tokens"] + usage["output_tokens"]
    finally:
        s2.proc.terminate()
    store.close()


def test_two_gateways_on_one_redis_share_responses_limits_and_revocations(setup, model_path):
    a, b, keys = setup["a"], setup["b"], setup["keys"]
    first = _respond(a, keys["shared"], "My name is Ada. Say hello to me.")
    second = _respond(b, keys["shared"], "What is my name?", previous=first["id"])  # continued on the other
    assert second["previous_response_id"] == first["id"]
    assert second["usage"]["input_tokens"] > first["usage"]["input_tokens"] + first["usage"]["output_tokens"]
    got = httpx.get(f"{b.url}/v1/responses/{first['id']}", headers={"Authorization": f"Bearer {keys['shared']}"})
    assert got.status_code == 200 and got.json()["id"] == first["id"]
    # one key's requests per minute across both gateways: 3 a minute, two on a, one on b, then a 429 from b
    chat = {"model": MODEL[0], "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 1}
    store = open_store(setup["redis"].url())
    for attempt in range(3):  # a rate-limit window is a calendar minute: again with a new key if one turned
        window = int(time.time() // 60)
        key = store.create_key(f"rpm-{attempt}", KeyLimits(rpm=3))
        replies = [_post(gateway, "/v1/chat/completions", key, chat) for gateway in (a, a, b, b)]
        if int(time.time() // 60) == window:
            break
    store.close()
    assert [r.status_code for r in replies] == [200, 200, 200, 429]
    assert [r.headers["x-ratelimit-remaining-requests"] for r in replies] == ["2", "1", "0", "0"]
    assert replies[3].json()["error"]["code"] == "rate_limit_exceeded" and int(replies[3].headers["retry-after"]) >= 1
    # a revocation on the command line: both gateways refuse the key at its next request
    for gateway in (a, b):
        assert httpx.get(gateway.base_url + "/models", headers={"Authorization": f"Bearer {keys['victim']}"}
                         ).status_code == 200
    done = subprocess.run([sys.executable, "-m", "launch.cli", "keys", "revoke", "victim", "--database_url",
                           setup["redis"].url()], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    for gateway in (a, b):
        r = httpx.get(gateway.base_url + "/models", headers={"Authorization": f"Bearer {keys['victim']}"})
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"


def test_redis_lost_while_running_is_a_503_then_recovers_by_itself(setup):
    a, keys, server = setup["a"], setup["keys"], setup["redis"]
    server.stop()
    try:
        r = httpx.get(a.base_url + "/models", headers={"Authorization": f"Bearer {keys['shared']}"}, timeout=60)
        assert r.status_code == 503, r.text
        error = r.json()["error"]
        assert error["code"] == "store_unavailable" and "Redis" in error["message"] and "unreachable" in \
            error["message"]
        chat = {"model": MODEL[0], "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}
        assert _post(a, "/v1/chat/completions", CONFIG_KEY, chat).status_code == 200  # needs no store
        assert httpx.get(a.url + "/health", timeout=60).status_code == 200
    finally:
        server.start()  # its data back (persisted), the same port
    assert wait_until(lambda: httpx.get(a.base_url + "/models", timeout=60,
                                        headers={"Authorization": f"Bearer {keys['shared']}"}).status_code == 200, 60)
    assert "usage of key" in a.proc.log_tail(200)  # the config key's usage write that failed was logged


@pytest.mark.parametrize("kind", ["corrupt sqlite", "unreachable redis"])
def test_a_store_that_cannot_be_opened_is_one_line_and_exit_2(kind, tmp_path, model_path):
    if kind == "corrupt sqlite":
        path = tmp_path / "corrupt.sqlite3"
        path.write_bytes(b"\x00not sqlite\xff" * 1000)
        url, expected = f"sqlite:///{path}", "corrupt"
    else:
        url, expected = f"redis://127.0.0.1:{free_port()}/0", "cannot use Redis"
    done = subprocess.run([sys.executable, "-m", "launch.cli", "gateway", model_path, "--initial_peers",
                           "/ip4/127.0.0.1/tcp/9/p2p/QmUnused", "--database_url", url],
                          capture_output=True, text=True, timeout=120)
    lines = done.stderr.strip().splitlines()
    assert done.returncode == 2 and len(lines) == 1 and lines[0].startswith("error: ") and expected in lines[0], \
        done.stderr
