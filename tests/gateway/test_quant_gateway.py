"""Weight-format restrictions (`allowed_quant_types`, issue 14) against a real local swarm of float servers
(bootstrap + servers 0:15 and 15:30, which announce quant_type "none"): a gateway and a Python client that accept
only other formats see no usable server and say why; accepting "none" (or any) serves as before."""
from __future__ import annotations

import time

import httpx
import pytest

from launch.topology import terminate_all
from swarm.client.transport.routing import RoutingError
from tests.fixtures.gateway_fixtures import SPANS, one_torch_thread, ready, spawn_gateway  # noqa: F401

MODEL = "smollm2-135m-instruct"


def test_gateway_health_and_routes_follow_allowed_quant_types(swarms, model_path):
    swarm = swarms.get(SPANS)
    # both gateways start together (one start's wait instead of two)
    procs = [spawn_gateway(model_path, swarm["initial_peers"], swarm["prefix"], "--allowed_quant_types", *types,
                           name=f"gateway-{types[0]}") for types in (("nf4", "int8"), ("none",))]
    try:
        only_nf4, floats = [ready(proc, swarm) for proc in procs]
        health = httpx.get(only_nf4.url + "/health", timeout=60)
        assert health.status_code == 503
        body = health.json()
        assert body["missing_blocks"] == list(range(30)) and body["allowed_quant_types"] == ["int8", "nf4"]
        assert "blocks 0:30 are served only by none servers; allowed quant types: int8, nf4" in body["message"]
        assert body["quant_types"] == {"none": 2} and {s["quant_type"] for s in body["server_spans"]} == {"none"}
        assert not any(s["allowed"] for s in body["server_spans"])
        r = httpx.post(only_nf4.url + "/v1/chat/completions", timeout=60, json={
            "model": MODEL, "max_tokens": 2, "messages": [{"role": "user", "content": "Hi"}]})
        assert r.status_code == 503 and "served only by none servers" in r.json()["error"]["message"]

        # (its first reading of the swarm may still lack a server's record on a machine busy with other tests:
        # the float gateway is asked until it sees both, as a load balancer's probe would)
        for _ in range(30):
            body = httpx.get(floats.url + "/health", timeout=60).json()
            if body["status"] == "ok":
                break
            time.sleep(1)
        assert body["status"] == "ok" and body["allowed_quant_types"] == ["none"], body
        assert body["block_quant_types"] == [{"blocks": "0:30", "quant_types": ["none"]}]
        assert sorted(s["blocks"] for s in body["server_spans"]) == ["0:15", "15:30"]
        reply = floats.client().chat.completions.create(model=MODEL, max_tokens=4, temperature=0,
                                                        messages=[{"role": "user", "content": "Hi"}])
        assert reply.choices[0].message.content
    finally:
        terminate_all(procs)


def test_python_client_with_allowed_quant_types(swarms, model_path):
    from swarm import AutoDistributedModelForCausalLM

    swarm = swarms.get(SPANS)
    model = AutoDistributedModelForCausalLM.from_pretrained(
        model_path, initial_peers=swarm["initial_peers"], dht_prefix=swarm["prefix"], allowed_quant_types=["nf4"],
        pad_head_rows=False, max_retries=0, ban_timeout=0.1)
    try:
        with pytest.raises(RoutingError, match="served only by none servers; allowed quant types: nf4"):
            model.check_route()
        coverage = model.coverage(force=True)
        assert coverage.missing == list(range(30)) and coverage.servers == 0 and len(coverage.spans) == 2
        model.manager.config.allowed_quant_types = ["none"]  # the same client, now accepting float servers
        model.check_route()
        assert model.coverage().missing == []
    finally:
        model.shutdown()
