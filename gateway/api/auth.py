"""Bearer API keys: who a request is (`Caller`), and whether it may come in.

Two kinds of keys: those of the gateway's config (`--api_keys`, `--api_key_file`, `SWARMGATE_API_KEYS`: no limits,
read at start) and those of the state store (`swarmgate keys create`: named, with limits, checked against the store
at every request, so that a key revoked on any gateway sharing the store is refused by all at the next request).
Authentication is on when the config names keys or the store holds any key (looked at once a second until it does;
from then on for the process's life); then every API route needs `Authorization: Bearer <key>`.

Config keys are compared in constant time (`hmac.compare_digest` against every one, without stopping at the first
match); a stored key by its id, then its salted hash (`gateway.store.base`). A request without a valid key gets 401
in OpenAI's error shape (`gateway.errors.unauthorized`: type `authentication_error`, code `invalid_api_key`, a
`WWW-Authenticate: Bearer` header); one whose key the store must check while the store fails gets 503
(`store_unavailable`): config keys keep working then. `/health` and `/metrics` use `require_probe_key`: public unless
`--protect_probes`. `owner_of(request)` names the namespace of a request's pooled sessions and stored responses: a
hash of its bearer key (never the key itself), or "anonymous". `caller_of(request)` is the `Caller` the check found:
its name (for usage and metrics: a stored key's name, `config-<8 hex>` for a config key, `anonymous`), its limits
and its `x-ratelimit-*` headers (a key with limits: its window as read here, then as its admission left it).
"""
from __future__ import annotations

import hashlib
import hmac
import threading
import time
from dataclasses import dataclass, field
from typing import Callable, Dict, Optional, Sequence

from fastapi import Request
from starlette.concurrency import run_in_threadpool

from gateway.errors import unauthorized
from gateway.store import Decision, KeyLimits, Store
from gateway.store.base import split_key

RECHECK = 1.0  # seconds between looks at whether the store holds keys (while it holds none)


@dataclass
class Caller:
    name: str
    limits: KeyLimits = field(default_factory=KeyLimits)
    headers: Dict[str, str] = field(default_factory=dict)  # x-ratelimit-* of its admission (`gateway.api.quota`)


def _duration(seconds: float) -> str:
    return f"{max(0.0, round(seconds, 1)):g}s"


def ratelimit_headers(limits: KeyLimits, decision: Decision) -> Dict[str, str]:
    headers: Dict[str, str] = {}
    if limits.rpm is not None:
        headers.update({"x-ratelimit-limit-requests": str(limits.rpm),
                        "x-ratelimit-remaining-requests": str(max(0, limits.rpm - decision.requests)),
                        "x-ratelimit-reset-requests": _duration(decision.reset)})
    if limits.tpm is not None:
        headers.update({"x-ratelimit-limit-tokens": str(limits.tpm),
                        "x-ratelimit-remaining-tokens": str(max(0, limits.tpm - decision.tokens)),
                        "x-ratelimit-reset-tokens": _duration(decision.reset)})
    return headers


def key_matches(presented: str, keys) -> bool:
    data = presented.encode("utf-8")
    ok = False
    for key in keys:
        ok |= hmac.compare_digest(data, key.encode("utf-8"))
    return ok


class Authenticator:
    """The keys of one gateway: its config's and its store's. `check` runs on a worker thread (it reads the store);
    `check_here` on the event loop, where it needs no store."""

    def __init__(self, config_keys: Sequence[str], store: Store, clock: Callable[[], float] = time.monotonic):
        self.config_keys, self.store, self.clock = tuple(config_keys), store, clock
        self._store_has_keys = False
        self._looked_at: Optional[float] = None
        self._lock = threading.Lock()

    def required(self) -> bool:
        if self.config_keys or self._store_has_keys:
            return True
        with self._lock:
            now = self.clock()
            if self._looked_at is None or now - self._looked_at >= RECHECK:
                self._store_has_keys = self.store.has_keys()  # StoreUnavailable: a 503 (who may come in is unknown)
                self._looked_at = now
        return self._store_has_keys

    def check(self, token: Optional[str]) -> Caller:
        if token and self.config_keys and key_matches(token, self.config_keys):
            return Caller("config-" + hashlib.sha256(token.encode("utf-8")).hexdigest()[:8])
        if token and split_key(token) is not None:
            record = self.store.authenticate(token)
            if record is not None:
                headers = ratelimit_headers(record.limits, self.store.peek(record.name)) if record.limits.any else {}
                return Caller(record.name, record.limits, headers)
        if self.required():
            raise unauthorized()
        return Caller("anonymous")


    def check_here(self, token: Optional[str]) -> Optional[Caller]:
        """`check` where it needs no store (no thread hop per request, issue 46): no key or a config key, while
        whether keys are required is known (config keys, or the store looked at within `RECHECK` s); raises as
        `check`. None: `check` must run (on a worker thread: a store key, or the store is due a look)."""
        if token and self.config_keys and key_matches(token, self.config_keys):
            return Caller("config-" + hashlib.sha256(token.encode("utf-8")).hexdigest()[:8])
        if token and split_key(token) is not None:
            return None
        if self.config_keys or self._store_has_keys:
            raise unauthorized()
        looked_at = self._looked_at
        if looked_at is None or self.clock() - looked_at >= RECHECK:
            return None
        return Caller("anonymous")


def _bearer(request: Request) -> Optional[str]:
    scheme, _, token = request.headers.get("authorization", "").partition(" ")
    token = token.strip()
    return token if scheme.lower() == "bearer" and token else None


async def require_api_key(request: Request) -> None:
    authenticator: Authenticator = request.app.state.authenticator
    token = _bearer(request)
    caller = authenticator.check_here(token)
    request.state.caller = caller if caller is not None else await run_in_threadpool(authenticator.check, token)


async def require_probe_key(request: Request) -> None:
    """The check of the operators' probes (`/health`, `/metrics`): an API key only with `--protect_probes`."""
    if request.app.state.gateway.config.protect_probes:
        await require_api_key(request)


def caller_of(request: Request) -> Caller:
    caller = getattr(request.state, "caller", None)
    return caller if caller is not None else Caller("anonymous")


def owner_of(request: Request) -> str:
    """The session pool namespace of a request: pooled sessions are only reused by the same API key."""
    token = _bearer(request)
    if token is None:
        return "anonymous"
    return "key:" + hashlib.sha256(token.encode("utf-8")).hexdigest()[:32]
