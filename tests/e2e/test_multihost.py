"""Several hosts: the bootstrap peer, two servers and the gateway each in a network namespace of its own, with its
own address on a bridge (`launch/netns.py`), every process listening and announcing on that address only.

A chat request through the gateway works; then, mid-stream, the link of the server holding the session is cut
(`ip link set ... down` on its veth: no RST, the peer just goes silent). The gateway's session, with its default
settings, notices when its step is late and a liveness ping gets no answer (`ClientConfig.liveness_interval` +
`liveness_timeout`, 5 + 10 s, instead of the 120 s step time-out), re-routes to the other server, replays the
history, and the streamed text equals the undisturbed run. Skips, saying why, where network namespaces are not
permitted.
"""
from __future__ import annotations

import json
import time
from types import SimpleNamespace

import httpx
import pytest

from launch.netns import NetLab
from launch.topology import start_bootstrap, start_gateway, start_server, wait_all
from swarm.client.transport.manager import ClientConfig, SwarmManager

pytestmark = pytest.mark.slow

PREFIX = "tmultihost"
MESSAGES = [{"role": "user", "content": "List five animals that live in the ocean."}]
MAX_TOKENS = 40
CUT_AT_EVENT = 8


@pytest.fixture(scope="module")
def lab_swarm(model_path):
    reason = NetLab.unavailable()
    if reason:
        pytest.skip(f"the multi-host test needs network namespaces: {reason}")
    with NetLab() as lab:
        hosts = {name: lab.add_host(name) for name in ("dht", "server0", "server1", "gateway")}
        procs = []
        try:
            boot = start_bootstrap(hosts["dht"].address, 0, name="multihost-dht", threads=1, wrap=hosts["dht"].wrap)
            procs.append(boot)
            servers = {}
            for name in ("server0", "server1"):
                servers[name] = start_server(model_path, [boot.maddr], "0:30", PREFIX, ["--update_period", "10"],
                                             name=f"multihost-{name}", host=hosts[name].address, threads=1,
                                             wrap=hosts[name].wrap)
                procs.append(servers[name])
            wait_all(list(servers.values()))
            # port 8000 in its own namespace: no other process on this machine can be in the way
            gateway = start_gateway(model_path, [boot.maddr], PREFIX,
                                    ["--no-session_pool"],
                                    name="multihost-gateway", host=hosts["gateway"].address, port=8000, threads=1,
                                    wrap=hosts["gateway"].wrap)
            procs.append(gateway)
            # the test process reaches the hosts over the bridge (its address .254), as a client on another host
            manager = SwarmManager(ClientConfig(initial_peers=[boot.maddr], measure_rtt=False), PREFIX, 30)
            try:
                yield SimpleNamespace(lab=lab, hosts=hosts, boot=boot, servers=servers, gateway=gateway,
                                      url=gateway.ready["url"] + "/v1", manager=manager)
            finally:
                manager.shutdown()
        finally:
            for proc in reversed(procs):
                proc.kill()


def _stream(url, on_event=None):
    """A greedy chat completion streamed with raw SSE: (text, events)."""
    body = {"model": _model(url), "messages": MESSAGES, "max_tokens": MAX_TOKENS, "temperature": 0, "stream": True}
    text, events = [], []
    with httpx.stream("POST", url + "/chat/completions", json=body, timeout=300) as response:
        assert response.status_code == 200
        for line in response.iter_lines():
            if not line.startswith("data: "):
                continue
            payload = line[len("data: "):]
            events.append((time.monotonic(), payload))
            if payload == "[DONE]":
                break
            chunk = json.loads(payload)
            for choice in chunk.get("choices", []):
                text.append(choice["delta"].get("content") or "")
            if on_event is not None:
                on_event(len(events))
    return "".join(text), events


def _model(url):
    return httpx.get(url + "/models", timeout=30).json()["data"][0]["id"]


def test_every_process_listens_and_announces_on_its_own_host(lab_swarm):
    hosts = lab_swarm.hosts
    assert lab_swarm.boot.maddr.startswith(f"/ip4/{hosts['dht'].address}/tcp/")
    for name, server in lab_swarm.servers.items():
        assert server.ready["maddrs"] and all(m.startswith(f"/ip4/{hosts[name].address}/tcp/")
                                              for m in server.ready["maddrs"]), server.ready["maddrs"]
    assert lab_swarm.gateway.ready["url"] == f"http://{hosts['gateway'].address}:8000"
    seen = {span.peer_id for span in lab_swarm.manager.update(force=True)}
    assert seen == {server.peer_id for server in lab_swarm.servers.values()}
    health = httpx.get(lab_swarm.gateway.ready["url"] + "/health", timeout=30)
    assert health.status_code == 200 and health.json()["servers"] == 2


def test_a_cut_link_mid_stream_fails_over_with_the_same_text(lab_swarm):
    url = lab_swarm.url
    expected, _ = _stream(url)
    answer = httpx.post(url + "/chat/completions", timeout=300, json={
        "model": _model(url), "messages": MESSAGES, "max_tokens": MAX_TOKENS, "temperature": 0}).json()
    assert answer["choices"][0]["message"]["content"] == expected  # a plain request works too

    cut = {}

    def cut_the_busy_server(n):
        if n != CUT_AT_EVENT or cut:
            return
        busy = [name for name, server in lab_swarm.servers.items()
                if lab_swarm.manager.server_info(server.peer_id).sessions_open > 0]
        assert len(busy) == 1, busy
        lab_swarm.lab.cut(lab_swarm.hosts[busy[0]])
        cut.update(name=busy[0], at=time.monotonic())

    try:
        text, events = _stream(url, cut_the_busy_server)
    finally:
        if cut:
            lab_swarm.lab.mend(lab_swarm.hosts[cut["name"]])
    assert cut, "the stream ended before the link could be cut"
    assert not any('"error"' in payload for _, payload in events), [p for _, p in events if '"error"' in p]
    assert events[-1][1] == "[DONE]" and text == expected
    resumed = next(at for at, _ in events if at > cut["at"])
    print(f"\nlink of {cut['name']} cut; the next token came {resumed - cut['at']:.1f}s later (a late step, an "
          f"unanswered liveness ping, then re-route and replay)")
    assert "unreachable" in lab_swarm.gateway.log_tail(200)  # detected by the ping, not by the step time-out
    survivor = next(s for name, s in lab_swarm.servers.items() if name != cut["name"])
    assert lab_swarm.manager.server_info(survivor.peer_id).inference_steps > 0
