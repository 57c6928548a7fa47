"""Through the gateway: an SSE stream survives the death (SIGKILL) of the server serving its last span, and
the streamed text equals an undisturbed run; with no replacement left, the stream ends with an error event
and `[DONE]`."""
from __future__ import annotations

import json
import time

import httpx
import pytest

from launch.topology import start_servers, terminate_all
from swarm.client.transport.manager import ClientConfig, SwarmManager
from tests.fixtures.gateway_fixtures import start_gateway

MESSAGES = [{"role": "user", "content": "List five animals that live in the ocean."}]


@pytest.fixture(scope="module")
def failover_gateway(model_path, bootstrap):
    prefix = "tgwfail"
    servers = start_servers(model_path, [bootstrap.maddr], ["0:15", "15:30", "15:30"], prefix, threads=1)
    swarm = {"prefix": prefix, "servers": servers, "initial_peers": [bootstrap.maddr]}
    gateway = start_gateway(model_path, swarm)
    manager = SwarmManager(ClientConfig(initial_peers=[bootstrap.maddr]), prefix, 30)
    yield gateway, servers, manager
    manager.shutdown()
    gateway.proc.terminate()
    terminate_all(servers)


def _stream(gateway, on_chunk=None, max_tokens=40):
    """Stream a greedy chat completion with raw SSE; returns (text, events)."""
    model = httpx.get(gateway.base_url + "/models", timeout=30).json()["data"][0]["id"]
    body = {"model": model, "messages": MESSAGES, "max_tokens": max_tokens, "temperature": 0, "stream": True}
    text, events = [], []
    with httpx.stream("POST", gateway.base_url + "/chat/completions", json=body, timeout=300) as response:
        assert response.status_code == 200
        for line in response.iter_lines():
            if not line.startswith("data: "):
                continue
            payload = line[len("data: "):]
            events.append(payload)
            if payload == "[DONE]":
                break
            chunk = json.loads(payload)
            if "error" in chunk:
                continue
            for choice in chunk["choices"]:
                text.append(choice["delta"].get("content") or "")
            if on_chunk is not None:
                on_chunk(len(events))
    return "".join(text), events


def _busy_last_span_server(manager, servers):
    """The 15:30 server that holds the gateway's session right now (its cache is in use)."""
    for s in servers[1:]:
        if s.proc.poll() is None and manager.server_info(s.peer_id).sessions_open > 0:
            return s
    return None


def test_stream_survives_a_server_dying(failover_gateway):
    gateway, servers, manager = failover_gateway
    expected, _ = _stream(gateway)
    killed = []

    def kill_after_ten(n):
        if n == 10 and not killed:
            victim = _busy_last_span_server(manager, servers)
            assert victim is not None
            victim.kill()
            killed.append(victim)

    text, events = _stream(gateway, kill_after_ten)
    assert killed, "the stream ended before the server could be killed"
    assert not any('"error"' in e for e in events)
    assert text == expected and events[-1] == "[DONE]"


def test_stream_without_replacement_ends_with_error_then_done(failover_gateway):
    gateway, servers, manager = failover_gateway
    alive = [s for s in servers[1:] if s.proc.poll() is None]
    assert len(alive) == 1  # the previous test killed the other 15:30 server

    def kill_after_five(n):
        if n == 5 and alive[0].proc.poll() is None:
            alive[0].kill()

    started = time.monotonic()
    _, events = _stream(gateway, kill_after_five, max_tokens=60)
    assert events[-1] == "[DONE]"
    errors = [json.loads(e) for e in events[:-1] if '"error"' in e]
    assert len(errors) == 1 and errors[0]["error"]["message"]
    assert time.monotonic() - started < 600  # bounded retries: it ended by itself
