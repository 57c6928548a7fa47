"""Bearer API keys: when `api_keys` is configured, every API route needs `Authorization: Bearer <key>`.

Keys are compared in constant time (`hmac.compare_digest` against every configured key, without stopping at
the first match). `/health` and `/metrics` do not use this dependency and stay public. `owner_of(request)`
names the session pool namespace of a request: a hash of its bearer key (never the key itself), or "anonymous".
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
    keys = request.app.state.gateway.config.api_keys
    if not keys:
        return
    header = request.headers.get("authorization", "")
    scheme, _, token = header.partition(" ")
    if scheme.lower() != "bearer" or not token.strip() or not key_matches(token.strip(), keys):
        raise unauthorized()


def owner_of(request: Request) -> str:
    """The session pool namespace of a request: pooled sessions are only reused by the same API key."""
    scheme, _, token = request.headers.get("authorization", "").partition(" ")
    token = token.strip()
    if scheme.lower() != "bearer" or not token:
        return "anonymous"
    return "key:" + hashlib.sha256(token.encode("utf-8")).hexdigest()[:32]
