"""The state store's contract: what a backend (`sqlite.SQLiteStore`, `redis_store.RedisStore`) keeps, and its types.

A store holds four kinds of state, shared by every gateway process that opens the same database:
- stored responses of the Responses API (`put_response` / `get_response` / `delete_response`): one JSON document per
  response (the Response object and its conversation), with its owner, kept `ttl` seconds, at most `max_entries`
  (the oldest dropped first);
- API keys (`create_key`, `authenticate`, `list_keys`, `revoke_key`): a key is `sgk_<12 hex id>_<secret>`; the
  store keeps its id, a random salt and sha256(salt + secret), never the key; with its name, creation and last use
  times, limits and whether it is revoked;
- usage counters (`record_usage`, `usage`): requests and tokens per key, model and UTC day;
- rate-limit windows (`admit`, `finish`; `peek` reads one): per key and calendar minute, the requests and tokens
  counted, and the key's running generations as leases that expire (a gateway killed mid-request does not hold a
  slot for ever).

`admit` checks a key's three limits and counts the request in one atomic step (an SQLite write transaction, a Redis
Lua script), so that gateways sharing a store never let a key past its requests per minute nor its concurrent
streams. Tokens per minute are counted as they are known: the prompt at admission, the generated tokens at the end;
a request is admitted while the window's tokens are under the limit, so the window can end over it by what the
requests admitted before the limit was reached then generate (the documented slack, at most one request per
concurrent stream).

Errors: `StoreError` (the store cannot be opened: bad URL, corrupt or unwritable file, unreachable server, a schema
newer than this code) and its subclass `StoreUnavailable` (an operation failed on a store that was open: the gateway
answers 503 and goes on).
"""
from __future__ import annotations

import hashlib
import hmac
import re
import secrets
import time
from dataclasses import asdict, dataclass, field
from typing import Any, Dict, List, Optional, Protocol

SCHEMA_VERSION = 1
KEY_PATTERN = re.compile(r"^sgk_([0-9a-f]{12})_([A-Za-z0-9_-]{20,128})$")
NAME_PATTERN = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._@-]{0,63}$")
WINDOW = 60  # seconds of one rate-limit window (a calendar minute)


class StoreError(Exception):
    """The store cannot be used (at start: the gateway prints this one line and exits 2)."""


class StoreUnavailable(StoreError):
    """An operation failed on an open store (a lost Redis connection, a locked or failing disk)."""


@dataclass(frozen=True)
class KeyLimits:
    rpm: Optional[int] = None  # requests per minute
    tpm: Optional[int] = None  # tokens (prompt + generated) per minute
    max_streams: Optional[int] = None  # generations running at once

    @property
    def any(self) -> bool:
        return any(v is not None for v in (self.rpm, self.tpm, self.max_streams))


@dataclass
class KeyRecord:
    name: str
    key_id: str
    created: float
    last_used: Optional[float] = None
    limits: KeyLimits = field(default_factory=KeyLimits)
    revoked: bool = False

    def as_dict(self) -> Dict[str, Any]:
        return {"name": self.name, "created": self.created, "last_used": self.last_used,
                "limits": asdict(self.limits), "revoked": self.revoked}


@dataclass
class UsageRow:
    key: str
    model: str
    day: str  # YYYY-MM-DD, UTC
    requests: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    completion_tokens: int = 0


@dataclass
class Decision:
    """What `admit` decided: `refused` names the limit hit (None: admitted); the window's counts after it."""

    refused: Optional[str]  # "requests", "tokens", "streams" or None
    requests: int  # requests counted in this window (with this one when admitted)
    tokens: int  # tokens counted in this window
    streams: int  # generations running (with this one when admitted)
    reset: float  # seconds until the window ends


def new_key() -> tuple[str, str, str]:
    """A new key: (key, its id, its secret)."""
    key_id, secret = secrets.token_hex(6), secrets.token_urlsafe(32)
    return f"sgk_{key_id}_{secret}", key_id, secret


def hash_secret(salt: str, secret: str) -> str:
    return hashlib.sha256((salt + secret).encode("utf-8")).hexdigest()


def new_salt() -> str:
    return secrets.token_hex(16)


def secret_matches(salt: str, digest: str, secret: str) -> bool:
    return hmac.compare_digest(hash_secret(salt, secret), digest)


def split_key(token: str) -> Optional[tuple[str, str]]:
    """(key id, secret) of a well-formed key, else None."""
    match = KEY_PATTERN.match(token)
    return (match.group(1), match.group(2)) if match else None


def check_name(name: str) -> str:
    if not NAME_PATTERN.match(name):
        raise ValueError(f"invalid key name {name!r}: 1-64 letters, digits, '.', '_', '@' or '-', starting with a "
                         f"letter or digit")
    return name


def day_of(when: float) -> str:
    return time.strftime("%Y-%m-%d", time.gmtime(when))


def window_of(now: float) -> tuple[int, float]:
    """(the window's number, seconds until it ends)."""
    return int(now // WINDOW), WINDOW - now % WINDOW


class Store(Protocol):
    url: str  # for messages (no password)

    def close(self) -> None: ...

    # ---- stored responses ----
    def put_response(self, owner: str, response_id: str, document: Dict[str, Any], ttl: float, max_entries: int,
                     now: Optional[float] = None) -> None: ...

    def get_response(self, owner: str, response_id: str, now: Optional[float] = None) -> Optional[Dict[str, Any]]: ...

    def delete_response(self, owner: str, response_id: str) -> bool: ...

    def count_responses(self, now: Optional[float] = None) -> int: ...

    # ---- API keys ----
    def create_key(self, name: str, limits: KeyLimits, now: Optional[float] = None) -> str: ...

    def authenticate(self, token: str, now: Optional[float] = None) -> Optional[KeyRecord]: ...

    def has_keys(self) -> bool: ...

    def list_keys(self) -> List[KeyRecord]: ...

    def revoke_key(self, name: str) -> bool: ...

    # ---- usage ----
    def record_usage(self, key: str, model: str, prompt_tokens: int, cached_tokens: int, completion_tokens: int,
                     requests: int = 1, now: Optional[float] = None) -> None: ...

    def usage(self, key: Optional[str] = None, since_day: Optional[str] = None) -> List[UsageRow]: ...

    # ---- rate limits ----
    def admit(self, key: str, limits: KeyLimits, tokens: int, lease: str, lease_ttl: float,
              now: Optional[float] = None) -> Decision: ...

    def finish(self, key: str, tokens: int, lease: str, now: Optional[float] = None) -> None: ...

    def peek(self, key: str, now: Optional[float] = None) -> Decision: ...


def refusal(limits: KeyLimits, requests: int, tokens: int, streams: int) -> Optional[str]:
    """The limit a new request would pass (None: none): the window's requests and tokens, the running streams."""
    if limits.rpm is not None and requests >= limits.rpm:
        return "requests"
    if limits.tpm is not None and tokens >= limits.tpm:
        return "tokens"
    if limits.max_streams is not None and streams >= limits.max_streams:
        return "streams"
    return None


def usage_totals(rows: List[UsageRow]) -> Dict[str, Dict[str, int]]:
    """Per key: requests, prompt_tokens, cached_tokens, completion_tokens summed over models and days."""
    totals: Dict[str, Dict[str, int]] = {}
    for row in rows:
        t = totals.setdefault(row.key, {"requests": 0, "prompt_tokens": 0, "cached_tokens": 0, "completion_tokens": 0})
        for name in t:
            t[name] += getattr(row, name)
    return totals
