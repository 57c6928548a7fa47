"""Several models on one gateway, in process (issue 48): `--model` parsed from the CLI, YAML and the environment, and
requests routed by their `model` field to per-model state (tokens, engine, metrics), over scripted fake models; the
real swarm's version is tests/gateway/test_gateway_models.py."""
from __future__ import annotations

import time

import pytest
from starlette.testclient import TestClient

from gateway.app import create_app
from gateway.config import GatewayConfig
from gateway.store import open_store
from swarm.client.api import Coverage
from swarm.runtime.config import ConfigError, build_parser, load_config
from tests.fixtures.fake_model import FakeModel
from tests.fixtures.gateway_fixtures import one_torch_thread  # noqa: F401  (autouse: one torch thread in this module)


def parse(argv, environ=None, yaml_path=None):
    parser = build_parser(GatewayConfig, "swarmgate gateway", "test", positional="model")
    return load_config(GatewayConfig, parser.parse_args(argv), yaml_path=yaml_path, environ=environ or {},
                       section="gateway")


def test_model_flag_repeats_and_joins_the_positional_one(tmp_path):
    assert parse(["a"]).model == ["a"]
    assert parse(["a", "--model", "org/b", "--model", "c"]).model == ["a", "org/b", "c"]
    assert parse(["--model", "a", "--model", "b"]).model_names == ["a", "b"]
    assert parse(["a", "b"]).model == ["a", "b"]
    config = parse(["dir/one/", "--model", "org/two"])
    assert config.model_names == ["one", "two"] and config.model_name == "one" and config.model_path == "dir/one/"
    assert parse([], environ={"SWARMGATE_MODEL": "x, org/y"}).model == ["x", "org/y"]
    assert parse(["cli"], environ={"SWARMGATE_MODEL": "x,y"}).model == ["cli"]  # CLI > env
    yaml_file = tmp_path / "gateway.yaml"
    yaml_file.write_text("gateway:\n  model: [p, q]\n")
    assert parse([], yaml_path=str(yaml_file)).model == ["p", "q"]
    yaml_file.write_text("model: one\n")
    assert parse([], yaml_path=str(yaml_file)).model == ["one"]
    assert GatewayConfig(model="m").model == ["m"] and GatewayConfig(model="m").model_name == "m"
    assert parse(["all"]).discover and not parse(["a"]).discover


@pytest.mark.parametrize("argv, message", [
    ([], "model: Field required"),
    (["a", "--model", "dir/a"], "models named twice: a"),
    (["all", "--model", "b"], "'all' (every model the swarm serves) stands alone"),
    (["all", "--served_model_name", "x"], "served_model_name names one model's id"),
    (["a", "b", "--served_model_name", "x"], "served_model_name names one model's id"),
    (["a", "b", "--dht_prefix", "p"], "dht_prefix names one model's id or prefix"),
])
def test_bad_model_settings_are_named(argv, message):
    with pytest.raises(ConfigError, match="invalid GatewayConfig") as e:
        parse(argv)
    assert message in str(e.value)


def test_model_records_reject_what_they_do_not_expect():
    from pydantic import ValidationError

    from swarm.wire.records import ModelRecord

    record = ModelRecord.model_validate({"model": "org/m", "prefix": "m", "num_blocks": 4, "future_field": 1})
    assert record == ModelRecord(model="org/m", prefix="m", num_blocks=4)  # newer fields ignored
    for bad in ({"model": "", "prefix": "m", "num_blocks": 4}, {"model": "m", "prefix": "m", "num_blocks": 0},
                {"model": "m", "prefix": "m"}, {"model": "m" * 600, "prefix": "m", "num_blocks": 4}):
        with pytest.raises(ValidationError):
            ModelRecord.model_validate(bad)


def test_for_model_keeps_every_other_setting():
    config = GatewayConfig(model=["a", "org/b"], api_keys=["k"], max_concurrent=3)
    one = config.for_model("org/b")
    assert one.model == ["org/b"] and one.model_name == "b" and one.accepted_api_keys == ("k",)
    assert one.max_concurrent == 3 and config.model == ["a", "org/b"]
    with pytest.raises(ValueError, match="not one of this gateway's models"):
        config.for_model("c")


@pytest.fixture
def two_models(tokenizer, tmp_path):
    """A gateway over two fake models, each writing its own text; the second misses a block of its swarm."""
    first = FakeModel(tokenizer, "Alpha speaks here.")
    second = FakeModel(tokenizer, "Beta answers there.", coverage=Coverage([3], 4, 2))
    store = open_store(f"sqlite:///{tmp_path / 'state.sqlite3'}")
    config = GatewayConfig(model=["alpha", "org/beta"], api_keys=["key-1"], database_url=f"sqlite:///{tmp_path}/x")
    app = create_app(config, store=store, models=[(first, tokenizer), (second, tokenizer)])
    with TestClient(app, raise_server_exceptions=False,
                    headers={"Authorization": "Bearer key-1"}) as client:
        yield client, first, second, store
    store.close()


def _chat(client, model, **extra):
    return client.post("/v1/chat/completions", json={"model": model, "max_tokens": 10, "temperature": 0,
                                                     "messages": [{"role": "user", "content": "hi"}], **extra})


def test_requests_route_by_model_to_that_models_state(two_models):
    client, first, second, store = two_models
    a, b, b_by_path = _chat(client, "alpha"), _chat(client, "beta"), _chat(client, "org/beta")
    assert a.status_code == b.status_code == b_by_path.status_code == 200, (a.text, b.text)
    assert a.json()["choices"][0]["message"]["content"] == "Alpha speaks here."
    assert b.json()["choices"][0]["message"]["content"] == "Beta answers there."
    assert b.json()["model"] == b_by_path.json()["model"] == "beta" and a.json()["model"] == "alpha"
    assert len(first.sessions) == 1 and len(second.sessions) == 2  # each model's own sessions
    completion = client.post("/v1/completions", json={"model": "beta", "prompt": "x", "max_tokens": 10})
    assert completion.json()["choices"][0]["text"] == "Beta answers there."
    answered = client.post("/v1/responses", json={"model": "alpha", "input": "hi", "max_output_tokens": 16})
    assert answered.status_code == 200, answered.text
    assert answered.json()["output"][0]["content"][0]["text"] == "Alpha speaks here."
    assert answered.json()["model"] == "alpha"
    # usage is recorded per model
    gateway = client.app.state.gateway
    deadline = time.monotonic() + 60  # (only a guard against a hang)
    while gateway.admission.running:  # a slot is released (its usage handed to the writer) once its worker is done
        assert time.monotonic() < deadline, "a request's slot was never released"
        time.sleep(0.01)
    gateway.quota.shutdown()  # waits for the writes
    by_model = {}
    for row in store.usage():
        by_model[row.model] = by_model.get(row.model, 0) + row.requests
    assert by_model == {"alpha": 2, "beta": 3}


def test_unknown_model_is_openais_404_naming_the_served_ones(two_models):
    client = two_models[0]
    for response in (_chat(client, "gamma"), client.post("/v1/completions", json={"model": "gamma", "prompt": "x"}),
                     client.post("/v1/responses", json={"model": "gamma", "input": "x"}),
                     client.get("/v1/models/gamma")):
        assert response.status_code == 404, response.text
        error = response.json()["error"]
        assert error["code"] == "model_not_found" and error["param"] == "model" and error["type"]
        assert "'gamma' does not exist" in error["message"] and "'alpha', 'beta'" in error["message"]
    assert _chat(client, None).status_code == 400  # chat requires a model


def test_models_list_each_with_its_coverage_and_tokenize_routes(two_models, tokenizer):
    client = two_models[0]
    listing = client.get("/v1/models").json()["data"]
    assert [m["id"] for m in listing] == ["alpha", "beta"]
    assert listing[0]["coverage"] == {"blocks": 4, "blocks_served": 4, "servers": 1, "missing_blocks": ""}
    assert listing[1]["coverage"] == {"blocks": 4, "blocks_served": 3, "servers": 2, "missing_blocks": "3:4"}
    assert client.get("/v1/models/org/beta").json()["id"] == "beta"
    ids = client.post("/tokenize", json={"model": "beta", "prompt": "hello"}).json()["tokens"]
    assert ids == tokenizer.encode("hello", add_special_tokens=False) or ids == tokenizer.encode("hello")
    assert client.post("/tokenize", json={"model": "nope", "prompt": "x"}).status_code == 404
    health = client.get("/health")
    assert health.status_code == 503 and health.json()["model"] == "beta"
    assert "blocks 3:4 of beta are not served" in health.json()["message"]
    assert client.get("/", headers={"Accept": "application/json"}).json()["models"] == ["alpha", "beta"]
    page = client.get("/chat").text
    assert "/v1/models" in page and "blocks_served" in page  # the page lists them, marking partial swarms
    enum = client.get("/openapi.json").json()["paths"]["/v1/models/{model_id}"]["get"]["parameters"][0]["schema"]
    assert {"alpha", "beta", "org/beta"} <= set(enum["enum"])


def test_metrics_label_each_models_series(two_models):
    client = two_models[0]
    generated = {"alpha": 0, "beta": 0}
    for model in ("alpha", "beta", "beta"):
        response = _chat(client, model)
        assert response.status_code == 200
        generated[model] += response.json()["usage"]["completion_tokens"]
    text = client.get("/metrics").text
    lines = {line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
             if line and not line.startswith("#")}
    for model, count in generated.items():
        assert count > 0 and lines[f'swarmgate_completion_tokens_total{{model="{model}"}}'] == count
    assert lines['swarmgate_swarm_blocks_covered{model="beta"}'] == 3
    assert lines['swarmgate_swarm_blocks_covered{model="alpha"}'] == 4
    assert lines['swarmgate_requests_total{endpoint="/v1/chat/completions",status="200"}'] == 3  # gateway-wide
    assert text.count("# TYPE swarmgate_completion_tokens_total counter") == 1
