"""Bearer API keys: when keys are configured (`--api_keys`, `--api_key_file`, `SWARMGATE_API_KEYS`), every API
route needs `Authorization: Bearer <key>` with any one of them.

Keys are compared in constant time (`hmac.compare_digest` against every configured key, without stopping at
the first match). A request without a valid key gets 401 in OpenAI's error shape (`gateway.errors.unauthorized`:
type `authentication_error`, code `invalid_api_key`, a `WWW-Authenticate: Bearer` header). `/health` and
`/metrics` use `require_probe_key`: public unless `--protect_probes`. `owner_of(request)` names the session
pool namespace of a request: a hash of its bearer key (never the key itself), or "anonymous".
"""
from __future__ import annotations

import hashlib
import hmac

from fastapi import Request

from gateway.errors import unauthorized


def key_matches(presented: str, keys) -> bool:
    data = presented.encode("utf-8")
    ok = False
    for key in keys:
        ok |= hmac.compare_digest(data, key.encode("utf-8"))
    return ok


async def require_api_key(request: Request) -> None:
    keys = request.app.state.gateway.config.accepted_api_keys
    if not keys:
        return
    header = request.headers.get("authorization", "")
    scheme, _, token = header.partition(" ")
    if scheme.lower() != "bearer" or not token.strip() or not key_matches(token.strip(), keys):
        raise unauthorized()


async def require_probe_key(request: Request) -> None:
    """The check of the operators' probes (`/health`, `/metrics`): an API key only with `--protect_probes`."""
    if request.app.state.gateway.config.protect_probes:
        await require_api_key(request)


def owner_of(request: Request) -> str:
    """The session pool namespace of a request: pooled sessions are only reused by the same API key."""
    scheme, _, token = request.headers.get("authorization", "").partition(" ")
    token = token.strip()
    if scheme.lower() != "bearer" or not token:
        return "anonymous"
    return "key:" + hashlib.sha256(token.encode("utf-8")).hexdigest()[:32]
