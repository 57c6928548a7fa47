"""The SQLite backend of the state store (`sqlite:///PATH`): one file, safe for several processes of one machine.

The file is opened in WAL mode (readers never wait for the writer) with a busy timeout; every write is one
transaction (`BEGIN IMMEDIATE`: the write lock taken before the reads it depends on), so a SIGKILL leaves each
write done or not done, never half. One connection per thread. The schema's version is SQLite's `user_version`:
a file written by an older swarmgate is migrated in one transaction (`MIGRATIONS`), one written by a newer one is
refused. Tables: `responses`, `api_keys`, `usage` (per key, model and UTC day), `windows` (per key and minute) and
`streams` (running generations' leases). `gateway.store.base` documents what each holds.
"""
from __future__ import annotations

import json
import sqlite3
import threading
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Dict, Iterator, List, Optional

from gateway.store.base import (
    SCHEMA_VERSION,
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
    refusal,
    secret_matches,
    split_key,
    window_of,
)

MIGRATIONS: Dict[int, List[str]] = {
    1: [
        "CREATE TABLE responses (id TEXT PRIMARY KEY, owner TEXT NOT NULL, stored_at REAL NOT NULL, "
        "expires REAL NOT NULL, document TEXT NOT NULL)",
        "CREATE INDEX responses_by_time ON responses (stored_at)",
        "CREATE TABLE api_keys (key_id TEXT PRIMARY KEY, name TEXT NOT NULL UNIQUE, salt TEXT NOT NULL, "
        "hash TEXT NOT NULL, created REAL NOT NULL, last_used REAL, rpm INTEGER, tpm INTEGER, max_streams INTEGER, "
        "revoked INTEGER NOT NULL DEFAULT 0)",
        "CREATE TABLE usage (key TEXT NOT NULL, model TEXT NOT NULL, day TEXT NOT NULL, requests INTEGER NOT NULL, "
        "prompt_tokens INTEGER NOT NULL, cached_tokens INTEGER NOT NULL, completion_tokens INTEGER NOT NULL, "
        "PRIMARY KEY (key, model, day))",
        "CREATE TABLE windows (key TEXT NOT NULL, window INTEGER NOT NULL, requests INTEGER NOT NULL, "
        "tokens INTEGER NOT NULL, PRIMARY KEY (key, window))",
        "CREATE TABLE streams (key TEXT NOT NULL, lease TEXT NOT NULL, expires REAL NOT NULL, "
        "PRIMARY KEY (key, lease))",
    ],
}
LAST_USED_GRANULARITY = 1.0  # seconds: `last_used` is rewritten at most this often per key (not at every request)


class SQLiteStore:
    def __init__(self, path: str, busy_timeout: float = 10.0):
        self.path, self.busy_timeout = path, busy_timeout
        self.url = f"sqlite:///{path}"
        self._local = threading.local()
        self._connections: List[sqlite3.Connection] = []
        self._lock = threading.Lock()
        # one writer at a time within this process: its threads queue on this lock instead of polling SQLite's busy
        # handler, whose sleeps gave 100 concurrent writers a p99 of a second (bench/bench_store.py); processes
        # sharing the file still meet on SQLite's lock and its busy timeout
        self._write_lock = threading.Lock()
        try:
            Path(path).parent.mkdir(parents=True, exist_ok=True)
            self._migrate()
        except (sqlite3.Error, OSError) as e:
            self.close()
            raise StoreError(f"cannot use the SQLite database {path}: {_why(e)}") from None

    # ---- connections and transactions ----
    def _connection(self) -> sqlite3.Connection:
        conn = getattr(self._local, "conn", None)
        if conn is None:
            conn = sqlite3.connect(self.path, timeout=self.busy_timeout, isolation_level=None,
                                   check_same_thread=False)
            conn.execute("PRAGMA journal_mode=WAL")
            conn.execute("PRAGMA synchronous=NORMAL")  # WAL + NORMAL: durable across a process kill
            self._local.conn = conn
            with self._lock:
                self._connections.append(conn)
        return conn

    @contextmanager
    def _write(self) -> Iterator[sqlite3.Connection]:
        conn = self._connection()
        with self._write_lock:
            try:
                conn.execute("BEGIN IMMEDIATE")
                try:
                    yield conn
                except BaseException:
                    conn.execute("ROLLBACK")
                    raise
                conn.execute("COMMIT")
            except sqlite3.Error as e:
                raise StoreUnavailable(f"the SQLite database {self.path} failed: {_why(e)}") from None

    @contextmanager
    def _read(self) -> Iterator[sqlite3.Connection]:
        try:
            yield self._connection()
        except sqlite3.Error as e:
            raise StoreUnavailable(f"the SQLite database {self.path} failed: {_why(e)}") from None

    def _migrate(self) -> None:
        conn = self._connection()
        conn.execute("BEGIN IMMEDIATE")  # also proves the file is writable
        try:
            version = conn.execute("PRAGMA user_version").fetchone()[0]
            if version > SCHEMA_VERSION:
                raise StoreError(f"the SQLite database {self.path} has schema version {version}, newer than this "
                                 f"swarmgate's {SCHEMA_VERSION}: upgrade swarmgate")
            for step in range(version + 1, SCHEMA_VERSION + 1):
                for statement in MIGRATIONS[step]:
                    conn.execute(statement)
                conn.execute(f"PRAGMA user_version = {step}")
        except BaseException:
            conn.execute("ROLLBACK")
            raise
        conn.execute("COMMIT")

    def close(self) -> None:
        with self._lock:
            for conn in self._connections:
                conn.close()
            self._connections.clear()
        self._local = threading.local()

    # ---- stored responses ----
    def put_response(self, owner: str, response_id: str, document: Dict[str, Any], ttl: float, max_entries: int,
                     now: Optional[float] = None) -> None:
        now = time.time() if now is None else now
        data = json.dumps(document)
        with self._write() as conn:
            conn.execute("DELETE FROM responses WHERE expires < ?", (now,))
            conn.execute("INSERT OR REPLACE INTO responses VALUES (?, ?, ?, ?, ?)",
                         (response_id, owner, now, now + ttl, data))
            conn.execute("DELETE FROM responses WHERE id IN (SELECT id FROM responses ORDER BY stored_at DESC "
                         "LIMIT -1 OFFSET ?)", (max_entries,))

    def get_response(self, owner: str, response_id: str, now: Optional[float] = None) -> Optional[Dict[str, Any]]:
        now = time.time() if now is None else now
        with self._read() as conn:
            row = conn.execute("SELECT document FROM responses WHERE id = ? AND owner = ? AND expires >= ?",
                               (response_id, owner, now)).fetchone()
        return None if row is None else json.loads(row[0])

    def delete_response(self, owner: str, response_id: str) -> bool:
        with self._write() as conn:
            return conn.execute("DELETE FROM responses WHERE id = ? AND owner = ?", (response_id, owner)).rowcount > 0

    def count_responses(self, now: Optional[float] = None) -> int:
        now = time.time() if now is None else now
        with self._read() as conn:
            return conn.execute("SELECT COUNT(*) FROM responses WHERE expires >= ?", (now,)).fetchone()[0]

    # ---- API keys ----
    def create_key(self, name: str, limits: KeyLimits, now: Optional[float] = None) -> str:
        check_name(name)
        key, key_id, secret = new_key()
        salt = new_salt()
        with self._write() as conn:
            if conn.execute("SELECT 1 FROM api_keys WHERE name = ?", (name,)).fetchone():
                raise ValueError(f"a key named {name!r} exists already")
            conn.execute("INSERT INTO api_keys (key_id, name, salt, hash, created, rpm, tpm, max_streams) "
                         "VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
                         (key_id, name, salt, hash_secret(salt, secret), time.time() if now is None else now,
                          limits.rpm, limits.tpm, limits.max_streams))
        return key

    def authenticate(self, token: str, now: Optional[float] = None) -> Optional[KeyRecord]:
        parts = split_key(token)
        if parts is None:
            return None
        now = time.time() if now is None else now
        with self._read() as conn:
            row = conn.execute("SELECT salt, hash, revoked, last_used, name, key_id, created, rpm, tpm, max_streams "
                               "FROM api_keys WHERE key_id = ?", (parts[0],)).fetchone()
        if row is None or row[2] or not secret_matches(row[0], row[1], parts[1]):
            return None
        if row[3] is None or now - row[3] >= LAST_USED_GRANULARITY:
            with self._write() as conn:
                conn.execute("UPDATE api_keys SET last_used = ? WHERE key_id = ?", (now, parts[0]))
        return _record(row[4:], last_used=now)

    def has_keys(self) -> bool:
        with self._read() as conn:
            return conn.execute("SELECT 1 FROM api_keys LIMIT 1").fetchone() is not None

    def list_keys(self) -> List[KeyRecord]:
        with self._read() as conn:
            rows = conn.execute("SELECT name, key_id, created, rpm, tpm, max_streams, last_used, revoked "
                                "FROM api_keys ORDER BY created").fetchall()
        return [_record(r[:6], last_used=r[6], revoked=bool(r[7])) for r in rows]

    def revoke_key(self, name: str) -> bool:
        with self._write() as conn:
            return conn.execute("UPDATE api_keys SET revoked = 1 WHERE name = ?", (name,)).rowcount > 0

    # ---- usage ----
    def record_usage(self, key: str, model: str, prompt_tokens: int, cached_tokens: int, completion_tokens: int,
                     requests: int = 1, now: Optional[float] = None) -> None:
        day = day_of(time.time() if now is None else now)
        with self._write() as conn:
            conn.execute("INSERT INTO usage VALUES (?, ?, ?, ?, ?, ?, ?) ON CONFLICT (key, model, day) DO UPDATE SET "
                         "requests = requests + excluded.requests, prompt_tokens = prompt_tokens + "
                         "excluded.prompt_tokens, cached_tokens = cached_tokens + excluded.cached_tokens, "
                         "completion_tokens = completion_tokens + excluded.completion_tokens",
                         (key, model, day, requests, prompt_tokens, cached_tokens, completion_tokens))

    def usage(self, key: Optional[str] = None, since_day: Optional[str] = None) -> List[UsageRow]:
        with self._read() as conn:
            rows = conn.execute("SELECT key, model, day, requests, prompt_tokens, cached_tokens, completion_tokens "
                                "FROM usage WHERE (? IS NULL OR key = ?) AND (? IS NULL OR day >= ?) "
                                "ORDER BY day, key, model", (key, key, since_day, since_day)).fetchall()
        return [UsageRow(*row) for row in rows]

    # ---- rate limits ----
    def admit(self, key: str, limits: KeyLimits, tokens: int, lease: str, lease_ttl: float,
              now: Optional[float] = None) -> Decision:
        now = time.time() if now is None else now
        window, reset = window_of(now)
        with self._write() as conn:
            conn.execute("DELETE FROM streams WHERE expires < ?", (now,))
            conn.execute("DELETE FROM windows WHERE key = ? AND window < ?", (key, window))
            row = conn.execute("SELECT requests, tokens FROM windows WHERE key = ? AND window = ?",
                               (key, window)).fetchone()
            requests, used = row if row is not None else (0, 0)
            streams = conn.execute("SELECT COUNT(*) FROM streams WHERE key = ?", (key,)).fetchone()[0]
            refused = refusal(limits, requests, used, streams)
            if refused is None:
                conn.execute("INSERT INTO windows VALUES (?, ?, 1, ?) ON CONFLICT (key, window) DO UPDATE SET "
                             "requests = requests + 1, tokens = tokens + excluded.tokens", (key, window, tokens))
                conn.execute("INSERT OR REPLACE INTO streams VALUES (?, ?, ?)", (key, lease, now + lease_ttl))
                requests, used, streams = requests + 1, used + tokens, streams + 1
        return Decision(refused, requests, used, streams, reset)

    def peek(self, key: str, now: Optional[float] = None) -> Decision:
        now = time.time() if now is None else now
        window, reset = window_of(now)
        with self._read() as conn:
            row = conn.execute("SELECT requests, tokens FROM windows WHERE key = ? AND window = ?",
                               (key, window)).fetchone()
            streams = conn.execute("SELECT COUNT(*) FROM streams WHERE key = ? AND expires >= ?",
                                   (key, now)).fetchone()[0]
        requests, used = row if row is not None else (0, 0)
        return Decision(None, requests, used, streams, reset)

    def finish(self, key: str, tokens: int, lease: str, now: Optional[float] = None) -> None:
        window, _ = window_of(time.time() if now is None else now)
        with self._write() as conn:
            conn.execute("DELETE FROM streams WHERE key = ? AND lease = ?", (key, lease))
            if tokens:
                conn.execute("INSERT INTO windows VALUES (?, ?, 0, ?) ON CONFLICT (key, window) DO UPDATE SET "
                             "tokens = tokens + excluded.tokens", (key, window, tokens))


def _record(row, last_used: Optional[float] = None, revoked: bool = False) -> KeyRecord:
    name, key_id, created, rpm, tpm, max_streams = row
    return KeyRecord(name=name, key_id=key_id, created=created, last_used=last_used,
                     limits=KeyLimits(rpm, tpm, max_streams), revoked=revoked)


def _why(e: BaseException) -> str:
    text = str(e)
    if isinstance(e, sqlite3.DatabaseError) and "not a database" in text:
        return f"{text} (the file is corrupt or not SQLite)"
    return text or type(e).__name__
