"""Gateway API keys on the in-process app (a fake model): several keys from flags and a file, 401 in OpenAI's error
shape on every protected route, and `/health` / `/metrics` public or protected by `--protect_probes`.
(`tests/gateway/test_gateway.py::test_api_keys` checks a real gateway process with the `openai` client.)"""
from __future__ import annotations

import pytest

from gateway.api.auth import key_matches
from gateway.config import GatewayConfig
from swarm.runtime.config import ConfigError, load_config
from tests.fixtures.fake_model import chat_body, fake_app  # noqa: F401  (the in-process app over a fake model)
from tests.fixtures.gateway_fixtures import one_torch_thread  # noqa: F401  (autouse: one torch thread in this module)

PROTECTED = [("post", "/v1/chat/completions", chat_body()),
             ("post", "/v1/completions", {"model": "fake", "prompt": "hi"}), ("get", "/v1/models", None),
             ("get", "/v1/models/fake", None), ("post", "/tokenize", {"model": "fake", "prompt": "hi"}),
             ("post", "/detokenize", {"model": "fake", "tokens": [1]})]
PROBES = ["/health", "/metrics"]


def _call(client, method, path, body, headers=None):
    return client.request(method.upper(), path, json=body, headers=headers or {})


def _assert_401(response):
    assert response.status_code == 401, response.text
    assert response.json() == {"error": {"message": response.json()["error"]["message"], "type": "authentication_error",
                                         "param": None, "code": "invalid_api_key"}}
    assert "Bearer" in response.json()["error"]["message"] and response.headers["www-authenticate"] == "Bearer"


@pytest.fixture
def key_file(tmp_path):
    path = tmp_path / "keys.txt"
    path.write_text("# one key a line\nfile-key-1\n\n  file-key-2  # the CI's key\n")
    return str(path)


def test_every_configured_key_works_and_anything_else_is_a_401(fake_app, key_file):
    client, _ = fake_app(api_keys=["flag-key"], api_key_file=key_file)
    for key in ("flag-key", "file-key-1", "file-key-2"):
        for method, path, body in PROTECTED:
            r = _call(client, method, path, body, {"Authorization": f"Bearer {key}"})
            assert r.status_code == 200, (key, path, r.text)
    wrong = [{}, {"Authorization": "Bearer nope"}, {"Authorization": "Bearer "}, {"Authorization": "flag-key"},
             {"Authorization": "Basic flag-key"}, {"Authorization": "Bearer flag-key2"},
             {"Authorization": "Bearer # the CI's key"}]
    for headers in wrong:
        for method, path, body in PROTECTED:
            _assert_401(_call(client, method, path, body, headers))
    assert client.get("/health").status_code == 200 and client.get("/metrics").status_code == 200


def test_probes_are_protected_on_request(fake_app):
    client, _ = fake_app(api_keys=["k"], protect_probes=True)
    for path in PROBES:
        _assert_401(client.get(path))
        _assert_401(client.get(path, headers={"Authorization": "Bearer wrong"}))
        assert client.get(path, headers={"Authorization": "Bearer k"}).status_code == 200
    client, _ = fake_app(protect_probes=True)  # no keys configured: nothing to protect with
    assert all(client.get(path).status_code == 200 for path in PROBES)


def test_key_settings_are_validated(tmp_path, key_file):
    config = load_config(GatewayConfig, environ={"SWARMGATE_MODEL": "m", "SWARMGATE_API_KEYS": "a,b",
                                                 "SWARMGATE_API_KEY_FILE": key_file,
                                                 "SWARMGATE_PROTECT_PROBES": "true"})
    assert config.accepted_api_keys == ("a", "b", "file-key-1", "file-key-2") and config.protect_probes
    with pytest.raises(ConfigError, match="cannot read api_key_file"):
        load_config(GatewayConfig, environ={"SWARMGATE_MODEL": "m", "SWARMGATE_API_KEY_FILE": str(tmp_path / "no")})
    empty = tmp_path / "empty.txt"
    empty.write_text("# nothing yet\n")
    with pytest.raises(ConfigError, match="holds no key"):
        load_config(GatewayConfig, environ={"SWARMGATE_MODEL": "m", "SWARMGATE_API_KEY_FILE": str(empty)})
    with pytest.raises(ConfigError, match="must not be empty"):
        load_config(GatewayConfig, environ={"SWARMGATE_MODEL": "m", "SWARMGATE_API_KEYS": '["a", ""]'})


def test_key_comparison_checks_every_key():
    keys = ["k1", "k2", "ké"]
    assert key_matches("k2", keys) and key_matches("ké", keys)
    assert not key_matches("k", keys) and not key_matches("k22", keys) and not key_matches("", keys)
    assert not key_matches("k1", [])


def test_the_check_on_the_event_loop_agrees_with_the_worker_threads(tmp_path):
    """`Authenticator.check_here` (no thread hop per request) answers as `check` where it needs no store, and
    leaves to `check` a store key and a store due a look."""
    from gateway.api.auth import RECHECK, Authenticator
    from gateway.errors import APIError
    from gateway.store import KeyLimits, open_store

    store = open_store(f"sqlite:///{tmp_path / 'keys.db'}")
    now = [100.0]
    open_door = Authenticator([], store, clock=lambda: now[0])
    assert open_door.check_here(None) is None  # whether the store holds keys is not known yet
    assert open_door.check(None).name == "anonymous"  # (looked at now)
    assert open_door.check_here(None).name == "anonymous" and open_door.check_here("nope").name == "anonymous"
    now[0] += RECHECK
    assert open_door.check_here(None) is None  # due another look
    token = store.create_key("alice", KeyLimits())
    assert open_door.check_here(token) is None and open_door.check(token).name == "alice"
    with pytest.raises(APIError):
        open_door.check(None)  # the store holds keys now: a key is required
    with pytest.raises(APIError):
        open_door.check_here(None)
    keyed = Authenticator(["k1"], store, clock=lambda: now[0])
    assert keyed.check_here("k1") == keyed.check("k1")
    for wrong in (None, "k2"):
        with pytest.raises(APIError):
            keyed.check_here(wrong)
    store.close()
