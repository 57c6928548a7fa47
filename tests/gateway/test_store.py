"""The gateway's state store (`gateway.store`) against a real SQLite file and a real `redis-server` (started on a free
port by `tests/fixtures/redis_server.py`): stored responses (owner, TTL, most entries), API keys (salted hashes only,
revocation), usage counters, rate-limit windows (requests, tokens, streams), two store objects on one database,
32 threads on one key (exact counts, a limit never passed), schema versions, and the faults: a corrupt, unwritable or
newer file, an unreachable Redis at start, Redis lost and back while open."""
from __future__ import annotations

import os
import sqlite3
import threading
import uuid

import pytest

from gateway.store import KeyLimits, StoreError, StoreUnavailable, open_store, usage_totals
from gateway.store.base import SCHEMA_VERSION
from tests.fixtures.redis_server import RedisServer, ensure_redis_server, free_port, redis_server  # noqa: F401

NOW = 1_800_000_010.0  # 10 s into a minute


@pytest.fixture(params=["sqlite", "redis"])
def url(request, tmp_path):
    if request.param == "sqlite":
        return f"sqlite:///{tmp_path}/state.sqlite3"
    server = request.getfixturevalue("redis_server")
    import redis

    redis.Redis.from_url(server.url(1)).flushdb()
    return server.url(1)


@pytest.fixture
def store(url):
    s = open_store(url)
    yield s
    s.close()


def test_responses_are_kept_per_owner_for_their_ttl_and_bounded(store):
    doc = {"response": {"id": "r0", "output": ["é", 1]}, "conversation": [{"role": "user", "content": "hi"}]}
    store.put_response("alice", "r0", doc, ttl=100, max_entries=3, now=NOW)
    assert store.get_response("alice", "r0", now=NOW + 1) == doc
    assert store.get_response("bob", "r0", now=NOW + 1) is None and not store.delete_response("bob", "r0")
    assert store.delete_response("alice", "r0") and store.get_response("alice", "r0", now=NOW + 1) is None
    for i in range(5):
        store.put_response("alice", f"r{i}", {"i": i}, ttl=100, max_entries=3, now=NOW + i)
    assert [store.get_response("alice", f"r{i}", now=NOW + 5) for i in range(5)] == [None, None, {"i": 2}, {"i": 3},
                                                                                      {"i": 4}]
    assert store.count_responses(now=NOW + 5) == 3


def test_a_response_expires_after_its_ttl(url):
    if url.startswith("redis"):  # Redis expires keys on its own clock: a short real TTL
        store = open_store(url)
        store.put_response("o", "short", {"x": 1}, ttl=0.2, max_entries=10)
        import time

        deadline = time.monotonic() + 30
        while store.get_response("o", "short") is not None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert store.get_response("o", "short") is None
        return
    store = open_store(url)
    store.put_response("o", "short", {"x": 1}, ttl=10, max_entries=10, now=NOW)
    assert store.get_response("o", "short", now=NOW + 10) == {"x": 1}
    assert store.get_response("o", "short", now=NOW + 11) is None


def test_keys_are_stored_as_salted_hashes_and_revocation_is_final(store, url, tmp_path):
    key = store.create_key("alice", KeyLimits(rpm=5, tpm=None, max_streams=2), now=NOW)
    other = store.create_key("bob", KeyLimits(), now=NOW + 1)
    assert key.startswith("sgk_") and key != other
    record = store.authenticate(key, now=NOW + 2)
    assert record.name == "alice" and record.limits == KeyLimits(5, None, 2) and not record.revoked
    assert store.authenticate(key[:-1] + ("A" if key[-1] != "A" else "B")) is None  # a wrong secret
    assert store.authenticate("sgk_000000000000_" + "x" * 43) is None and store.authenticate("nope") is None
    with pytest.raises(ValueError, match="exists already"):
        store.create_key("alice", KeyLimits())
    with pytest.raises(ValueError, match="invalid key name"):
        store.create_key("no spaces", KeyLimits())
    keys = store.list_keys()
    assert [k.name for k in keys] == ["alice", "bob"] and keys[0].last_used == NOW + 2 and keys[1].last_used is None
    assert store.revoke_key("alice") and not store.revoke_key("nobody")
    assert store.authenticate(key) is None and store.authenticate(other).name == "bob"
    assert [k.revoked for k in store.list_keys()] == [True, False] and store.has_keys()
    secret = key.split("_", 2)[2]
    if url.startswith("sqlite"):  # the file holds no key nor secret (the WAL included)
        raw = b"".join(p.read_bytes() for p in tmp_path.iterdir() if p.name.startswith("state.sqlite3"))
    else:
        import redis

        client = redis.Redis.from_url(url)
        raw = b"".join(str(client.dump(k)).encode() for k in client.keys("*"))
    assert secret.encode() not in raw and key.encode() not in raw and raw


def test_usage_counts_per_key_model_and_day(store):
    store.record_usage("alice", "m1", 10, 4, 3, now=NOW)
    store.record_usage("alice", "m1", 5, 0, 2, now=NOW + 1)
    store.record_usage("alice", "m2", 1, 0, 1, now=NOW + 86_400)
    store.record_usage("bob", "m1", 7, 0, 0, now=NOW)
    rows = store.usage()
    assert [(r.key, r.model, r.requests, r.prompt_tokens, r.cached_tokens, r.completion_tokens) for r in rows] == [
        ("alice", "m1", 2, 15, 4, 5), ("bob", "m1", 1, 7, 0, 0), ("alice", "m2", 1, 1, 0, 1)]
    assert rows[0].day < rows[2].day
    assert [r.model for r in store.usage("alice", since_day=rows[2].day)] == ["m2"]
    assert usage_totals(store.usage("alice"))["alice"] == {"requests": 3, "prompt_tokens": 16, "cached_tokens": 4,
                                                           "completion_tokens": 6}


def test_rate_limit_windows_requests_tokens_and_streams(store):
    limits = KeyLimits(rpm=3, tpm=100, max_streams=2)
    first = store.admit("k", limits, 10, "a", 60, now=NOW)
    assert (first.refused, first.requests, first.tokens, first.streams, first.reset) == (None, 1, 10, 1, 50)
    peeked = store.peek("k", now=NOW + 1)
    assert (peeked.refused, peeked.requests, peeked.tokens, peeked.streams, peeked.reset) == (None, 1, 10, 1, 49)
    assert store.peek("k", now=NOW + 60).requests == 0 and store.peek("nobody", now=NOW).streams == 0
    assert store.admit("k", limits, 10, "b", 60, now=NOW).refused is None
    assert store.admit("k", limits, 10, "c", 60, now=NOW).refused == "streams"  # two running
    store.finish("k", 5, "a", now=NOW)
    third = store.admit("k", limits, 10, "c", 60, now=NOW)
    assert (third.refused, third.requests, third.tokens) == (None, 3, 35)
    store.finish("k", 0, "b", now=NOW)
    store.finish("k", 0, "c", now=NOW)
    assert store.admit("k", limits, 10, "d", 60, now=NOW + 1).refused == "requests"  # 3 this minute
    later = store.admit("k", limits, 90, "d", 60, now=NOW + 60)  # the next minute
    assert (later.refused, later.requests, later.tokens) == (None, 1, 90)
    store.finish("k", 20, "d", now=NOW + 60)  # what it generated counts: 110 >= 100
    assert store.admit("k", limits, 1, "e", 60, now=NOW + 61).refused == "tokens"
    assert store.admit("other", limits, 1, "e", 60, now=NOW + 61).refused is None  # per key
    lost = store.admit("s", KeyLimits(max_streams=1), 0, "lost", 5, now=NOW)  # a gateway killed mid-request
    assert lost.refused is None and store.admit("s", KeyLimits(max_streams=1), 0, "x", 5, now=NOW + 1).refused
    assert store.admit("s", KeyLimits(max_streams=1), 0, "x", 5, now=NOW + 6).refused is None  # its lease expired


def test_two_store_objects_share_one_database(url):
    one, two = open_store(url), open_store(url)
    key = one.create_key("shared", KeyLimits(rpm=2))
    one.put_response("o", "r", {"from": "one"}, ttl=100, max_entries=10)
    assert two.get_response("o", "r") == {"from": "one"} and two.authenticate(key).name == "shared"
    assert one.admit("shared", KeyLimits(rpm=2), 0, "a", 60, now=NOW).refused is None
    assert two.admit("shared", KeyLimits(rpm=2), 0, "b", 60, now=NOW).refused is None
    assert one.admit("shared", KeyLimits(rpm=2), 0, "c", 60, now=NOW).refused == "requests"
    two.revoke_key("shared")
    assert one.authenticate(key) is None
    one.close()
    two.close()


def test_32_threads_on_one_key_count_exactly_and_never_pass_a_limit(url):
    """32 threads, each with its own store object (its own connection), admit and record 8 times each: exactly rpm
    requests are admitted in the window, never more streams than the limit run at once, a tokens-per-minute window
    ends over its limit by no more than the documented slack, and usage adds up exactly."""
    stores = [open_store(url) for _ in range(32)]
    limits = KeyLimits(rpm=100, max_streams=5)
    tpm = KeyLimits(tpm=200, max_streams=5)
    admitted, running, peak, errors = [0], [0], [0], []
    lock = threading.Lock()

    def worker(store) -> None:
        try:
            for _ in range(8):
                lease = uuid.uuid4().hex
                decision = store.admit("busy", limits, 3, lease, 60, now=NOW)
                if decision.refused is None:
                    with lock:
                        admitted[0] += 1
                        running[0] += 1
                        peak[0] = max(peak[0], running[0], decision.streams)
                    with lock:
                        running[0] -= 1
                    store.finish("busy", 2, lease, now=NOW)
                store.record_usage("busy", "m", 3, 1, 2, now=NOW)
                lease = uuid.uuid4().hex
                if store.admit("tokens", tpm, 3, lease, 60, now=NOW).refused is None:
                    store.finish("tokens", 2, lease, now=NOW)
        except Exception as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=worker, args=(s,)) for s in stores]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    assert admitted[0] == 100 and peak[0] <= 5
    # tokens per minute: admitted while the window is under the limit, so over it by at most the documented slack:
    # the last admitted prompt (3) and what the streams running then generate (5 x 2)
    assert 200 <= stores[0].peek("tokens", now=NOW).tokens < 200 + 3 + 5 * 2
    assert usage_totals(stores[0].usage("busy"))["busy"] == {"requests": 256, "prompt_tokens": 768,
                                                             "cached_tokens": 256, "completion_tokens": 512}
    for s in stores:
        s.close()


# ---- versions and faults --------------------------------------------------------------------------------------------
def test_sqlite_schema_is_versioned_and_bad_files_are_one_clear_error(tmp_path):
    path = tmp_path / "state.sqlite3"
    open_store(f"sqlite:///{path}").close()
    assert sqlite3.connect(path).execute("PRAGMA user_version").fetchone()[0] == SCHEMA_VERSION
    assert sqlite3.connect(path).execute("PRAGMA journal_mode").fetchone()[0] == "wal"
    newer = tmp_path / "newer.sqlite3"
    conn = sqlite3.connect(newer)
    conn.execute(f"PRAGMA user_version = {SCHEMA_VERSION + 1}")
    conn.close()
    with pytest.raises(StoreError, match="newer than this swarmgate"):
        open_store(f"sqlite:///{newer}")
    corrupt = tmp_path / "corrupt.sqlite3"
    corrupt.write_bytes(os.urandom(8192))
    with pytest.raises(StoreError, match="corrupt"):
        open_store(f"sqlite:///{corrupt}")
    with pytest.raises(StoreError, match="cannot use the SQLite database"):
        open_store(f"sqlite:///{tmp_path}")  # a directory, not a file
    (tmp_path / "file").write_text("x")
    with pytest.raises(StoreError, match="cannot use the SQLite database"):
        open_store(f"sqlite:///{tmp_path}/file/state.sqlite3")  # its directory cannot be made
    for bad in ("postgres://x", "sqlite:///", "nonsense"):
        with pytest.raises(StoreError, match="bad database URL"):
            open_store(bad)


def test_redis_unreachable_newer_lost_and_back(redis_server):
    import redis

    with pytest.raises(StoreError, match="cannot use Redis at redis://127.0.0.1"):
        open_store(f"redis://127.0.0.1:{free_port()}/0")
    client = redis.Redis.from_url(redis_server.url(2))
    client.flushdb()
    client.set("swarmgate:schema", SCHEMA_VERSION + 1)
    with pytest.raises(StoreError, match="newer than this swarmgate"):
        open_store(redis_server.url(2))
    client.flushdb()
    # a Redis of its own, stopped and started again under an open store
    own = RedisServer(ensure_redis_server())
    own.start()
    try:
        store = open_store(own.url())
        key = store.create_key("k", KeyLimits())
        own.stop()
        with pytest.raises(StoreUnavailable, match="is unreachable"):
            store.authenticate(key)
        with pytest.raises(StoreUnavailable):
            store.put_response("o", "r", {}, ttl=10, max_entries=10)
        own.start()  # an empty Redis again (no persistence): the store works without being reopened
        store.put_response("o", "r", {"back": True}, ttl=10, max_entries=10)
        assert store.get_response("o", "r") == {"back": True}
        store.close()
    finally:
        own.close()
