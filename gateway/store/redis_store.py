"""The Redis backend of the state store (`redis://HOST:PORT/DB`, `rediss://` for TLS): several gateways on several
machines share one Redis, and with it stored responses, keys, usage and every key's limits.

Keys (all under `swarmgate:`): `resp:<id>` (a response's JSON with its owner, expiring after the TTL) and the sorted
set `responses` (ids by time, for the most-entries bound); `key:<key id>` (a hash: name, salt, sha256, created, last
used, limits, revoked), `keyname:<name>` (its id) and the set `keys`; `usage:<[day, key, model]>` (a hash of
counters) and the set `usage_index`; `window:<key>:<minute>` (requests and tokens, expiring) and `streams:<key>` (a
sorted set of running generations' leases by expiry). `schema` holds the version; an older one is migrated
(`MIGRATIONS`), a newer one refused. Each operation that reads then writes is one Lua script (atomic on the
server), so limits hold across gateways. The client (`redis` on PyPI) reconnects by itself: while Redis is
unreachable every operation raises `StoreUnavailable` after a short timeout, and works again once it is back.
"""
from __future__ import annotations

import json
import time
from typing import Any, Callable, Dict, List, Optional

import redis

from gateway.store.base import (
    SCHEMA_VERSION,
    WINDOW,
    Decision,
    KeyLimits,
    KeyRecord,
    StoreError,
    StoreUnavailable,
    UsageRow,
    check_name,
    day_of,
    hash_secret,
    new_key,
    new_salt,
    secret_matches,
    split_key,
    window_of,
)

PREFIX = "swarmgate:"
MIGRATIONS: Dict[int, Callable[["RedisStore"], None]] = {1: lambda store: None}  # version 1: nothing to move
LAST_USED_GRANULARITY = 1.0

_PUT = """
local now, max_entries = tonumber(ARGV[3]), tonumber(ARGV[4])
redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[2])
redis.call('ZADD', KEYS[2], now, ARGV[5])
redis.call('ZREMRANGEBYSCORE', KEYS[2], '-inf', now - tonumber(ARGV[2]) / 1000)
local extra = redis.call('ZCARD', KEYS[2]) - max_entries
if extra > 0 then
  local old = redis.call('ZPOPMIN', KEYS[2], extra)
  for i = 1, #old, 2 do redis.call('DEL', ARGV[6] .. old[i]) end
end
return 1
"""
_DELETE = """
local raw = redis.call('GET', KEYS[1])
if not raw then return 0 end
if cjson.decode(raw)['owner'] ~= ARGV[1] then return 0 end
redis.call('DEL', KEYS[1])
redis.call('ZREM', KEYS[2], ARGV[2])
return 1
"""
_CREATE = """
if redis.call('SET', KEYS[1], ARGV[1], 'NX') == false then return 0 end
redis.call('HSET', KEYS[2], unpack(ARGV, 2))
redis.call('SADD', KEYS[3], ARGV[1])
return 1
"""
_ADMIT = """
local rpm, tpm, max_streams = tonumber(ARGV[1]), tonumber(ARGV[2]), tonumber(ARGV[3])
local tokens, now = tonumber(ARGV[4]), tonumber(ARGV[7])
redis.call('ZREMRANGEBYSCORE', KEYS[2], '-inf', now)
local streams = redis.call('ZCARD', KEYS[2])
local requests = tonumber(redis.call('HGET', KEYS[1], 'requests') or '0')
local used = tonumber(redis.call('HGET', KEYS[1], 'tokens') or '0')
local refused = ''
if rpm >= 0 and requests >= rpm then refused = 'requests'
elseif tpm >= 0 and used >= tpm then refused = 'tokens'
elseif max_streams >= 0 and streams >= max_streams then refused = 'streams' end
if refused == '' then
  requests = redis.call('HINCRBY', KEYS[1], 'requests', 1)
  used = redis.call('HINCRBY', KEYS[1], 'tokens', tokens)
  redis.call('EXPIRE', KEYS[1], ARGV[8])
  redis.call('ZADD', KEYS[2], ARGV[6], ARGV[5])
  redis.call('EXPIRE', KEYS[2], ARGV[9])
  streams = streams + 1
end
return {refused, requests, used, streams}
"""


class RedisStore:
    def __init__(self, url: str, timeout: float = 2.0):
        self.url = _safe(url)
        try:
            self.client = redis.Redis.from_url(url, socket_connect_timeout=timeout, socket_timeout=timeout,
                                               decode_responses=True)
            self.client.ping()
            self._put = self.client.register_script(_PUT)
            self._delete = self.client.register_script(_DELETE)
            self._create = self.client.register_script(_CREATE)
            self._admit = self.client.register_script(_ADMIT)
            self._migrate()
        except (redis.RedisError, ValueError) as e:
            raise StoreError(f"cannot use Redis at {self.url}: {e}") from None

    def _migrate(self) -> None:
        version = int(self.client.get(PREFIX + "schema") or 0)
        if version > SCHEMA_VERSION:
            raise StoreError(f"Redis at {self.url} has schema version {version}, newer than this swarmgate's "
                             f"{SCHEMA_VERSION}: upgrade swarmgate")
        for step in range(version + 1, SCHEMA_VERSION + 1):
            MIGRATIONS[step](self)
            self.client.set(PREFIX + "schema", step)

    def _call(self, what: Callable[[], Any]) -> Any:
        try:
            return what()
        except redis.RedisError as e:
            raise StoreUnavailable(f"the state store (Redis at {self.url}) is unreachable: {e}") from None

    def close(self) -> None:
        self.client.close()

    # ---- stored responses ----
    def put_response(self, owner: str, response_id: str, document: Dict[str, Any], ttl: float, max_entries: int,
                     now: Optional[float] = None) -> None:
        now = time.time() if now is None else now
        data = json.dumps({"owner": owner, "document": document})
        self._call(lambda: self._put(keys=[PREFIX + "resp:" + response_id, PREFIX + "responses"],
                                     args=[data, max(1, int(ttl * 1000)), now, max_entries, response_id,
                                           PREFIX + "resp:"]))

    def get_response(self, owner: str, response_id: str, now: Optional[float] = None) -> Optional[Dict[str, Any]]:
        raw = self._call(lambda: self.client.get(PREFIX + "resp:" + response_id))
        if raw is None:
            return None
        entry = json.loads(raw)
        return entry["document"] if entry["owner"] == owner else None

    def delete_response(self, owner: str, response_id: str) -> bool:
        return bool(self._call(lambda: self._delete(keys=[PREFIX + "resp:" + response_id, PREFIX + "responses"],
                                                    args=[owner, response_id])))

    def count_responses(self, now: Optional[float] = None) -> int:
        return int(self._call(lambda: self.client.zcard(PREFIX + "responses")))

    # ---- API keys ----
    def create_key(self, name: str, limits: KeyLimits, now: Optional[float] = None) -> str:
        check_name(name)
        key, key_id, secret = new_key()
        salt = new_salt()
        fields: Dict[str, str] = {"name": name, "salt": salt, "hash": hash_secret(salt, secret),
                                  "created": repr(time.time() if now is None else now), "revoked": "0",
                                  **{k: str(v) for k, v in (("rpm", limits.rpm), ("tpm", limits.tpm),
                                                            ("max_streams", limits.max_streams)) if v is not None}}
        flat = [item for pair in fields.items() for item in pair]
        # the name, the key's hash and the index in one script: a writer killed half-way leaves nothing half-written
        if not self._call(lambda: self._create(keys=[PREFIX + "keyname:" + name, PREFIX + "key:" + key_id,
                                                     PREFIX + "keys"], args=[key_id, *flat])):
            raise ValueError(f"a key named {name!r} exists already")
        return key

    def authenticate(self, token: str, now: Optional[float] = None) -> Optional[KeyRecord]:
        parts = split_key(token)
        if parts is None:
            return None
        now = time.time() if now is None else now
        fields = self._call(lambda: self.client.hgetall(PREFIX + "key:" + parts[0]))
        if not fields or fields.get("revoked") == "1" or not secret_matches(fields["salt"], fields["hash"], parts[1]):
            return None
        if not fields.get("last_used") or now - float(fields["last_used"]) >= LAST_USED_GRANULARITY:
            self._call(lambda: self.client.hset(PREFIX + "key:" + parts[0], "last_used", repr(now)))
        fields["last_used"] = repr(now)
        return _record(parts[0], fields)

    def has_keys(self) -> bool:
        return bool(self._call(lambda: self.client.scard(PREFIX + "keys")))

    def list_keys(self) -> List[KeyRecord]:
        ids = sorted(self._call(lambda: self.client.smembers(PREFIX + "keys")))

        def read() -> List[Dict[str, str]]:
            with self.client.pipeline(transaction=False) as pipe:
                for key_id in ids:
                    pipe.hgetall(PREFIX + "key:" + key_id)
                return pipe.execute()

        records = [_record(key_id, fields) for key_id, fields in zip(ids, self._call(read)) if fields]
        return sorted(records, key=lambda r: r.created)

    def revoke_key(self, name: str) -> bool:
        key_id = self._call(lambda: self.client.get(PREFIX + "keyname:" + name))
        if key_id is None:
            return False
        self._call(lambda: self.client.hset(PREFIX + "key:" + key_id, "revoked", "1"))
        return True

    # ---- usage ----
    def record_usage(self, key: str, model: str, prompt_tokens: int, cached_tokens: int, completion_tokens: int,
                     requests: int = 1, now: Optional[float] = None) -> None:
        member = json.dumps([day_of(time.time() if now is None else now), key, model])

        def write() -> None:
            with self.client.pipeline(transaction=True) as pipe:
                name = PREFIX + "usage:" + member
                for field, value in (("requests", requests), ("prompt_tokens", prompt_tokens),
                                     ("cached_tokens", cached_tokens), ("completion_tokens", completion_tokens)):
                    pipe.hincrby(name, field, value)
                pipe.sadd(PREFIX + "usage_index", member)
                pipe.execute()

        self._call(write)

    def usage(self, key: Optional[str] = None, since_day: Optional[str] = None) -> List[UsageRow]:
        members = [m for m in self._call(lambda: self.client.smembers(PREFIX + "usage_index"))
                   if (key is None or json.loads(m)[1] == key) and (since_day is None or json.loads(m)[0] >= since_day)]

        def read() -> List[Dict[str, str]]:
            with self.client.pipeline(transaction=False) as pipe:
                for member in members:
                    pipe.hgetall(PREFIX + "usage:" + member)
                return pipe.execute()

        rows = []
        for member, counts in zip(members, self._call(read)):
            day, name, model = json.loads(member)
            rows.append(UsageRow(name, model, day, **{k: int(v) for k, v in counts.items()}))
        return sorted(rows, key=lambda r: (r.day, r.key, r.model))

    # ---- rate limits ----
    def admit(self, key: str, limits: KeyLimits, tokens: int, lease: str, lease_ttl: float,
              now: Optional[float] = None) -> Decision:
        now = time.time() if now is None else now
        window, reset = window_of(now)
        refused, requests, used, streams = self._call(lambda: self._admit(
            keys=[f"{PREFIX}window:{key}:{window}", f"{PREFIX}streams:{key}"],
            args=[_limit(limits.rpm), _limit(limits.tpm), _limit(limits.max_streams), tokens, lease, now + lease_ttl,
                  now, 2 * WINDOW, int(lease_ttl) + 1]))
        return Decision(refused or None, int(requests), int(used), int(streams), reset)

    def peek(self, key: str, now: Optional[float] = None) -> Decision:
        now = time.time() if now is None else now
        window, reset = window_of(now)

        def read() -> List[Any]:
            with self.client.pipeline(transaction=False) as pipe:
                pipe.hmget(f"{PREFIX}window:{key}:{window}", ["requests", "tokens"])
                pipe.zcount(f"{PREFIX}streams:{key}", now, "+inf")
                return pipe.execute()

        (requests, used), streams = self._call(read)
        return Decision(None, int(requests or 0), int(used or 0), int(streams), reset)

    def finish(self, key: str, tokens: int, lease: str, now: Optional[float] = None) -> None:
        window, _ = window_of(time.time() if now is None else now)

        def write() -> None:
            with self.client.pipeline(transaction=True) as pipe:
                pipe.zrem(f"{PREFIX}streams:{key}", lease)
                if tokens:
                    pipe.hincrby(f"{PREFIX}window:{key}:{window}", "tokens", tokens)
                    pipe.expire(f"{PREFIX}window:{key}:{window}", 2 * WINDOW)
                pipe.execute()

        self._call(write)


def _limit(value: Optional[int]) -> int:
    return -1 if value is None else value


def _record(key_id: str, fields: Dict[str, str]) -> KeyRecord:
    def number(name: str) -> Optional[int]:
        return int(fields[name]) if fields.get(name) else None

    return KeyRecord(name=fields["name"], key_id=key_id, created=float(fields["created"]),
                     last_used=float(fields["last_used"]) if fields.get("last_used") else None,
                     limits=KeyLimits(number("rpm"), number("tpm"), number("max_streams")),
                     revoked=fields.get("revoked") == "1")


def _safe(url: str) -> str:
    """The URL without a password, for messages."""
    from urllib.parse import urlsplit, urlunsplit

    parts = urlsplit(url)
    if parts.password:
        host = parts.hostname or ""
        netloc = f"{parts.username or ''}:***@{host}" + (f":{parts.port}" if parts.port else "")
        return urlunsplit(parts._replace(netloc=netloc))
    return url
