"""Shared fixtures: the bundled model checkpoint, a bootstrap peer, swarms of real server processes.

Processes are started by `swarm.launch.topology` with one intra-op thread each (`threads=1`): the tests share two
cores with them."""
from __future__ import annotations

import pytest
import torch

from swarm.launch.topology import start_bootstrap, start_servers

MODEL = "smollm2-135m-instruct"

# The servers under test run on the same two cores: one intra-op thread in the test process avoids
# oversubscription (the reference model is about 10x slower with two threads under that load).
torch.set_num_threads(1)


# Every fixture that starts block servers or gateways depends on `bootstrap`: a test that needs it is `slow`,
# so that `pytest -m "not slow"` is the fast loop (pure code, single layers, local models) while `make test`
# runs everything.
PROCESS_FIXTURES = {"bootstrap"}


def pytest_collection_modifyitems(config, items):
    for item in items:
        if PROCESS_FIXTURES & set(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.slow)


@pytest.fixture(scope="session")
def model_path():
    from swarm.modeling.prepare import prepare_model

    return str(prepare_model(MODEL))


@pytest.fixture(scope="session")
def bootstrap():
    proc = start_bootstrap(threads=1)
    yield proc
    proc.terminate()


class SwarmFactory:
    """Starts (once per test session) a set of servers for a topology under its own DHT prefix."""

    def __init__(self, model_path: str, bootstrap):
        self.model_path, self.bootstrap = model_path, bootstrap
        self.swarms: dict = {}

    def get(self, spans: tuple, extra: tuple = ()) -> dict:
        key = (spans, extra)
        if key not in self.swarms:
            prefix = "t" + "-".join(s.replace(":", "_") for s in spans) + ("-x" + str(abs(hash(extra)) % 10**6) if extra else "")
            servers = start_servers(self.model_path, [self.bootstrap.maddr], list(spans), prefix, list(extra),
                                    threads=1)
            self.swarms[key] = {"prefix": prefix, "servers": servers, "initial_peers": [self.bootstrap.maddr]}
        return self.swarms[key]

    def close(self) -> None:
        for swarm in self.swarms.values():
            for server in swarm["servers"]:
                server.terminate()


@pytest.fixture(scope="session")
def swarms(model_path, bootstrap):
    factory = SwarmFactory(model_path, bootstrap)
    yield factory
    factory.close()


@pytest.fixture(scope="session")
def reference_model(model_path):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    return AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).eval()


@pytest.fixture(scope="session")
def tokenizer(model_path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_path)
