"""Several models on one gateway over a real swarm (issue 48): the session's bootstrap, one server per model covering
all its blocks (the bundled SmolLM2 and a tiny random Llama), and one gateway started with `--model` twice. It lists
both with their coverage (the chat page, in Chromium, offers both), answers each greedily as transformers does for
that model, and 404s an unknown model; `--model all` finds both models in the DHT (its discovery in this process; a
second gateway started with it: EXTENDED).
The in-process cases (config parsing, routing, metrics, usage per model) are test_gateway_models_unit.py."""
from __future__ import annotations

import os

import httpx
import pytest

from launch import topology
from launch.topology import terminate_all, wait_all
from tests.fixtures.browser import Page
from tests.fixtures.gateway_fixtures import one_torch_thread, reference_text  # noqa: F401  (autouse fixture)
from tests.fixtures.tiny_checkpoints import save_tiny

MESSAGES = [{"role": "user", "content": "Name a color."}]
MAX_TOKENS = 8


@pytest.fixture(scope="module")
def two_model_gateway(bootstrap, model_path, tmp_path_factory):
    """{'url', 'smol': its path, 'tiny': its path, 'tiny_reference': the transformers model}: one gateway serving
    both. Each model's DHT prefix is derived from its directory's name (unique to this module's swarm)."""
    root = tmp_path_factory.mktemp("models48")
    smol = root / "smollm2-multi"
    os.symlink(model_path, smol)  # the bundled checkpoint under a name (and so a DHT prefix) of this module's own
    tiny = root / "tiny-llama-multi"
    tiny_reference = save_tiny("llama", tiny, model_path)
    peers = [bootstrap.maddr]
    servers = [topology.start_server(str(path), peers, span, name=f"server-{path.name}", threads=1)
               for path, span in ((smol, "0:30"), (tiny, "0:4"))]
    gateway = None
    try:
        wait_all(servers, 180)
        gateway = topology.start_gateway(str(smol), peers, None, ["--model", str(tiny)], name="gateway-models",
                                         threads=1)
        yield {"url": gateway.ready["url"], "smol": smol, "tiny": tiny, "tiny_reference": tiny_reference}
    finally:
        terminate_all(([gateway] if gateway is not None else []) + servers)


def chat(url: str, model: str) -> httpx.Response:
    return httpx.post(url + "/v1/chat/completions", timeout=180,
                      json={"model": model, "messages": MESSAGES, "max_tokens": MAX_TOKENS, "temperature": 0})


def test_models_lists_both_with_their_coverage(two_model_gateway):
    listing = httpx.get(two_model_gateway["url"] + "/v1/models", timeout=60).json()["data"]
    by_id = {card["id"]: card for card in listing}
    assert list(by_id) == ["smollm2-multi", "tiny-llama-multi"]
    assert by_id["smollm2-multi"]["coverage"] == {"blocks": 30, "blocks_served": 30, "servers": 1,
                                                  "missing_blocks": ""}
    assert by_id["tiny-llama-multi"]["coverage"] == {"blocks": 4, "blocks_served": 4, "servers": 1,
                                                     "missing_blocks": ""}
    assert by_id["tiny-llama-multi"]["context_length"] == 256  # each model's own limits
    assert by_id["smollm2-multi"]["context_length"] == 8192
    root = httpx.get(two_model_gateway["url"] + "/", timeout=60).json()
    assert root["models"] == ["smollm2-multi", "tiny-llama-multi"]
    health = httpx.get(two_model_gateway["url"] + "/health", timeout=60).json()
    assert health["status"] == "ok" and set(health["models"]) == {"smollm2-multi", "tiny-llama-multi"}
    with Page(two_model_gateway["url"] + "/chat") as page:  # the chat page offers both
        page.wait_for("document.body.dataset.ready === '1'", timeout=60)
        assert page.evaluate("[...document.querySelectorAll('#model option')].map(o => o.value)") == \
            ["smollm2-multi", "tiny-llama-multi"]


def test_each_model_answers_as_transformers_does(two_model_gateway, tokenizer, reference_model):
    url = two_model_gateway["url"]
    for model, reference in (("tiny-llama-multi", two_model_gateway["tiny_reference"]),
                             ("smollm2-multi", reference_model)):
        response = chat(url, model)
        assert response.status_code == 200, response.text
        body = response.json()
        assert body["model"] == model and body["usage"]["completion_tokens"] > 0
        text = body["choices"][0]["message"]["content"]
        assert text and text == reference_text(tokenizer, reference, MESSAGES, MAX_TOKENS)
    # the path names the model too
    assert chat(url, str(two_model_gateway["tiny"])).json()["model"] == "tiny-llama-multi"
    metrics = httpx.get(url + "/metrics", timeout=60).text
    for model in ("smollm2-multi", "tiny-llama-multi"):
        assert f'swarmgate_completion_tokens_total{{model="{model}"}}' in metrics


def test_an_unknown_model_is_a_404_model_not_found(two_model_gateway):
    response = chat(two_model_gateway["url"], "no-such-model")
    assert response.status_code == 404
    error = response.json()["error"]
    assert error["code"] == "model_not_found" and error["param"] == "model"
    assert error["message"] == ("The model 'no-such-model' does not exist; this gateway serves 'smollm2-multi', "
                                "'tiny-llama-multi'.")



def test_discover_finds_every_model_the_swarm_announces(bootstrap, two_model_gateway):
    """`--model all`'s discovery, in this process: the servers' model records read back from the DHT."""
    from gateway.api.models import discover
    from gateway.config import GatewayConfig

    found = discover(GatewayConfig(model="all", initial_peers=[bootstrap.maddr]))
    assert {str(two_model_gateway["smol"]), str(two_model_gateway["tiny"])} <= set(found.model)
    assert not found.discover and {"smollm2-multi", "tiny-llama-multi"} <= set(found.model_names)


def test_model_all_serves_every_model_the_swarm_announces(bootstrap, two_model_gateway, tokenizer):
    gateway = topology.start_gateway("all", [bootstrap.maddr], None, [], name="gateway-models-all", threads=1)
    try:
        assert {"smollm2-multi", "tiny-llama-multi"} <= set(gateway.ready["models"])
        listing = httpx.get(gateway.ready["url"] + "/v1/models", timeout=60).json()["data"]
        coverage = {card["id"]: card["coverage"]["blocks_served"] for card in listing}
        assert coverage["smollm2-multi"] == 30 and coverage["tiny-llama-multi"] == 4
        response = chat(gateway.ready["url"], "tiny-llama-multi")
        assert response.status_code == 200
        assert response.json()["choices"][0]["message"]["content"] == \
            reference_text(tokenizer, two_model_gateway["tiny_reference"], MESSAGES, MAX_TOKENS)
    finally:
        gateway.terminate()
