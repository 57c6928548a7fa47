"""LoRA adapters in the gateway, over stub models (no swarm): served adapters are model ids of their own (listed
with their base as `parent`, 404 for others), a request for one runs sessions with that adapter, and pooled
conversations are never reused across adapters."""
from __future__ import annotations

import torch

from gateway.app import create_app
from gateway.config import GatewayConfig
from gateway.serving.session_pool import SessionPool
from gateway.serving.sessions import SessionProvider
from tests.fixtures.fake_model import FakeModel as GatewayFakeModel
from tests.fixtures.fake_model import FakeSession as GatewayFakeSession
from tests.fixtures.pool_doubles import FakeModel as PoolFakeModel


class PoolModel(PoolFakeModel):
    def inference_session(self, max_length, adapter=None):
        session = super().inference_session(max_length)
        session.adapter = adapter
        return session


def _turn(provider, prompt, adapter=None):
    lease = provider.acquire(prompt, 1, 4, owner="u", adapter=adapter)
    provider.prefill(lease, torch.tensor([prompt]))
    provider.release(lease, reusable=True)
    return lease


def test_pooled_conversations_stay_with_their_adapter():
    provider = SessionProvider(PoolModel(), SessionPool(8, 100_000, 60.0), headroom=16, context=500,
                               sweep_interval=3600)
    base = _turn(provider, [1, 2, 3])
    alpha = _turn(provider, [1, 2, 3, 4], adapter="alpha")
    assert not alpha.reused and alpha.session is not base.session and alpha.session.adapter == "alpha"
    again = _turn(provider, [1, 2, 3, 4, 5], adapter="alpha")
    assert again.reused and again.session is alpha.session and again.cached_tokens == 4
    beta = _turn(provider, [1, 2, 3, 4, 5], adapter="beta")
    assert not beta.reused and beta.session.adapter == "beta"
    back = _turn(provider, [1, 2, 3, 9])
    assert back.reused and back.session is base.session and back.session.adapter is None


class AdapterModel(GatewayFakeModel):
    """The gateway's stub model, serving adapters "alpha" and "beta"; records each session's adapter."""

    served = ["alpha", "beta"]

    def served_adapters(self, force=False):
        return list(self.served)

    def check_route(self, cache_tokens=0, adapter=None):
        assert adapter is None or adapter in self.served

    def inference_session(self, max_length, adapter=None):
        session = GatewayFakeSession(self, max_length)
        session.adapter = adapter
        return session


def test_adapters_are_models_of_their_own(tokenizer):
    from starlette.testclient import TestClient

    model = AdapterModel(tokenizer, "Hi!")
    config = GatewayConfig(model="fake", session_pool=False)
    client = TestClient(create_app(config, model=model, tokenizer=tokenizer), raise_server_exceptions=False)
    cards = client.get("/v1/models").json()["data"]
    assert [(c["id"], c["parent"]) for c in cards] == [("fake", None), ("alpha", "fake"), ("beta", "fake")]
    assert client.get("/v1/models/beta").json()["parent"] == "fake"
    assert client.get("/v1/models/gamma").status_code == 404
    for model_id, adapter in (("alpha", "alpha"), ("fake", None)):
        r = client.post("/v1/chat/completions", json={"model": model_id, "messages": [{"role": "user", "content": "x"}],
                                                       "max_tokens": 3})
        assert r.status_code == 200 and r.json()["model"] == model_id, r.text
        assert model.sessions[-1].adapter == adapter
    r = client.post("/v1/completions", json={"model": "gamma", "prompt": "x", "max_tokens": 3})
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
    assert "alpha, beta" in r.json()["error"]["message"]
    assert client.post("/tokenize", json={"model": "alpha", "prompt": "x"}).status_code == 200
