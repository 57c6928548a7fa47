"""The gateway's state store: stored responses, API keys, usage and rate-limit windows, shared by every gateway
process that opens the same database.

`open_store(url)` opens the backend a `--database_url` names: `sqlite:///PATH` (`sqlite.SQLiteStore`, the default:
`default_url()`, a file under the cache directory) or `redis://HOST:PORT/DB` / `rediss://...`
(`redis_store.RedisStore`, for gateways on several machines). `base` is the contract both keep (`Store`) and its
types; it raises `StoreError` when a store cannot be opened, `StoreUnavailable` when an operation fails later.
"""
from __future__ import annotations

import os

from gateway.store.base import (  # noqa: F401  (the package's names)
    Decision,
    KeyLimits,
    KeyRecord,
    Store,
    StoreError,
    StoreUnavailable,
    UsageRow,
    usage_totals,
)
from swarm.runtime.paths import cache_root


def default_url() -> str:
    """The store of a config without `database_url`: `SWARMGATE_DATABASE_URL` when set (the variable the config reads
    too, so that an app built in-process agrees with a process), else the embedded default,
    `sqlite:///<cache directory>/gateway.sqlite3`."""
    return os.environ.get("SWARMGATE_DATABASE_URL") or f"sqlite:///{cache_root() / 'gateway.sqlite3'}"


def open_store(url: str | None = None) -> Store:
    """The store `url` names (None: `default_url()`); `StoreError` with one clear line when it cannot be used."""
    url = url or default_url()
    if url.startswith("sqlite:///"):
        from gateway.store.sqlite import SQLiteStore

        path = url[len("sqlite:///"):]
        if not path:
            raise StoreError(f"bad database URL {url!r}: sqlite:///PATH names a file")
        return SQLiteStore(path)
    if url.startswith(("redis://", "rediss://", "unix://")):
        from gateway.store.redis_store import RedisStore

        return RedisStore(url)
    raise StoreError(f"bad database URL {url!r}: use sqlite:///PATH or redis://HOST:PORT/DB")
