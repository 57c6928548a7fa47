"""Stored responses (`store: true`, OpenAI's default): what `previous_response_id` and `GET /v1/responses/{id}` read.

What is stored, per response: the Response object as it was returned (its output text and calls, usage, the echoed
request settings, `metadata`, `user`), and the conversation it ended as chat messages (the input of every turn of
the chain and each turn's output; not the instructions, which OpenAI does not carry over either), so that a next
turn can put it before its own input. Where: in this gateway process's memory only; nothing is written to disk, and
everything is lost when the gateway restarts (a `previous_response_id` from before then is a 400 "not found"); other
gateway processes do not see it. For how long: `responses_store_ttl` seconds after it was stored (default 3600), or
until `DELETE /v1/responses/{id}`, or until it is the oldest entry of a full store: at most
`responses_store_max` responses (default 1000; 0: nothing is stored and `store` is answered false). Each entry is
bounded by the context (its conversation fits the model's context), so the store's memory is too.
Entries belong to the API key that made them (`gateway.api.auth.owner_of`): another key gets a 404 / "not found".
Thread-safe; `clock` is injected for tests.
"""
from __future__ import annotations

import threading
import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional

from gateway.schemas import ChatMessage


@dataclass
class StoredResponse:
    owner: str
    response: Dict[str, Any]  # the Response object as JSON
    conversation: List[ChatMessage]  # every turn's input and output, without instructions
    stored_at: float


class ResponseStore:
    def __init__(self, max_entries: int, ttl: float, clock: Callable[[], float] = time.monotonic):
        self.max_entries, self.ttl, self.clock = max_entries, ttl, clock
        self._entries: "OrderedDict[str, StoredResponse]" = OrderedDict()  # oldest first
        self._lock = threading.Lock()

    @property
    def enabled(self) -> bool:
        return self.max_entries > 0

    def __len__(self) -> int:
        with self._lock:
            self._expire()
            return len(self._entries)

    def put(self, owner: str, response: Dict[str, Any], conversation: List[ChatMessage]) -> bool:
        """Store a response (False: the store is off)."""
        if not self.enabled:
            return False
        with self._lock:
            self._expire()
            self._entries[response["id"]] = StoredResponse(owner, response, conversation, self.clock())
            while len(self._entries) > self.max_entries:
                self._entries.popitem(last=False)
        return True

    def get(self, owner: str, response_id: str) -> Optional[StoredResponse]:
        with self._lock:
            self._expire()
            entry = self._entries.get(response_id)
            return entry if entry is not None and entry.owner == owner else None

    def delete(self, owner: str, response_id: str) -> bool:
        with self._lock:
            entry = self._entries.get(response_id)
            if entry is None or entry.owner != owner:
                return False
            del self._entries[response_id]
            return True

    def _expire(self) -> None:
        """Drop entries older than the TTL (the oldest come first)."""
        now = self.clock()
        while self._entries:
            oldest = next(iter(self._entries.values()))
            if now - oldest.stored_at <= self.ttl:
                break
            self._entries.popitem(last=False)
