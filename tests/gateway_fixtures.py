"""Fixtures for the gateway tests: real gateway processes over the shared test swarm, SDK clients, helpers.

`start_gateway` runs `swarmgate gateway MODEL ...` through `swarm.launch.topology.start_gateway` (readiness
line, log file, SIGTERM then SIGKILL on cleanup). `gateway` is one gateway per test module over the
("0:15", "15:30") swarm; `side_gateways` starts, in parallel, one with API keys and a tiny queue (auth,
429, keep-alives) and one pointed at a DHT prefix that no server announces (503).
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Dict, List, Optional

import pytest

from swarm.launch import topology
from swarm.launch.topology import ManagedProcess, terminate_all

SPANS = ("0:15", "15:30")
API_KEY = "sk-test-gateway-key"


@dataclass
class Gateway:
    proc: ManagedProcess
    url: str
    swarm: Optional[dict] = None

    @property
    def base_url(self) -> str:
        return self.url + "/v1"

    def client(self, api_key: str = "unused", **kwargs):
        import openai

        return openai.OpenAI(base_url=self.base_url, api_key=api_key, max_retries=0,
                             timeout=kwargs.pop("timeout", 180), **kwargs)


def spawn_gateway(model_path: str, initial_peers: List[str], prefix: str, *extra: str,
                  name: str = "gateway", env: Optional[Dict[str, str]] = None) -> ManagedProcess:
    """A gateway on a free port of 127.0.0.1 with one intra-op thread, not yet waited for."""
    return topology.start_gateway(model_path, initial_peers, prefix, extra, name=name, threads=1, env=env,
                                  timeout=None)


def ready(proc: ManagedProcess, swarm: Optional[dict] = None, timeout: float = 180) -> Gateway:
    try:
        info = proc.wait_ready(timeout)
    except BaseException:
        proc.kill()
        raise
    return Gateway(proc, info["url"], swarm)


def start_gateway(model_path: str, swarm: dict, *extra: str, name: str = "gateway") -> Gateway:
    return ready(spawn_gateway(model_path, swarm["initial_peers"], swarm["prefix"], *extra, name=name), swarm)


@pytest.fixture(scope="module", autouse=True)
def one_torch_thread():
    """The reference model in this process shares 2 cores with servers and gateways: with 2 OpenMP threads on
    an oversubscribed machine its forward passes get ~10x slower (spinning threads), so use one here."""
    import torch

    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


@pytest.fixture(scope="module")
def gateway(swarms, model_path):
    swarm = swarms.get(SPANS)
    gw = start_gateway(model_path, swarm, "--max_concurrent", "4", "--max_queue", "8")
    yield gw
    gw.proc.terminate()


@pytest.fixture(scope="module")
def client(gateway):
    return gateway.client()


@pytest.fixture(scope="module")
def side_gateways(swarms, model_path):
    """{'keyed': gateway with API keys, max_concurrent=1, max_queue=1, fast keep-alives;
        'orphan': gateway whose DHT prefix no server announces}"""
    swarm = swarms.get(SPANS)
    keyed = spawn_gateway(model_path, swarm["initial_peers"], swarm["prefix"], "--api_keys", API_KEY, "other-key",
                          "--max_concurrent", "1", "--max_queue", "1", "--retry_after", "3",
                          "--sse_keepalive", "0.2", name="gateway-keyed")
    orphan = spawn_gateway(model_path, swarm["initial_peers"], "no-such-swarm", name="gateway-orphan")
    try:
        gateways = {"keyed": ready(keyed, swarm), "orphan": ready(orphan)}
    except BaseException:
        keyed.kill()
        orphan.kill()
        raise
    yield gateways
    terminate_all([gw.proc for gw in gateways.values()])


@pytest.fixture(scope="module")
def swarm_model(swarms, model_path):
    """A direct client model of the test swarm (for servers' info and as the direct-client reference)."""
    from swarm import AutoDistributedModelForCausalLM

    swarm = swarms.get(SPANS)
    model = AutoDistributedModelForCausalLM.from_pretrained(model_path, initial_peers=swarm["initial_peers"],
                                                            dht_prefix=swarm["prefix"])
    yield model
    model.shutdown()


def server_stats(model, swarm) -> dict:
    return {s.peer_id: model.manager.server_info(s.peer_id) for s in swarm["servers"]}


def reference_text(tokenizer, reference_model, messages, max_new_tokens: int) -> str:
    """The reply local transformers gives greedily to a chat (what the gateway's greedy text must equal)."""
    import torch

    enc = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt", return_dict=True)
    with torch.no_grad():
        out = reference_model.generate(enc["input_ids"], attention_mask=enc["attention_mask"],
                                       max_new_tokens=max_new_tokens, do_sample=False)
    return tokenizer.decode(out[0, enc["input_ids"].shape[1]:], skip_special_tokens=True)


def wait_until(predicate, timeout: float = 60, interval: float = 0.2):
    """Poll `predicate` until it returns a truthy value (returned) or the bounded wait ends (last value)."""
    deadline = time.monotonic() + timeout
    value = predicate()
    while not value and time.monotonic() < deadline:
        time.sleep(interval)
        value = predicate()
    return value
