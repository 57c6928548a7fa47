"""Stored responses (`store: true`, OpenAI's default): what `previous_response_id` and `GET /v1/responses/{id}` read.

What is stored, per response: the Response object as it was returned (its output text and calls, usage, the echoed
request settings, `metadata`, `user`), and the conversation it ended as chat messages (the input of every turn of
the chain and each turn's output; not the instructions, which OpenAI does not carry over either), so that a next
turn can put it before its own input. Where: the gateway's state store (`gateway.store`, `--database_url`: an SQLite
file by default, or Redis), so stored responses survive a restart, and every gateway sharing the store answers for
any of them. For how long: `responses_store_ttl` seconds after it was stored (default 3600), or until
`DELETE /v1/responses/{id}`, or until it is the oldest entry of a full store: at most `responses_store_max`
responses (default 1000; 0: nothing is stored and `store` is answered false). Each entry is bounded by the context
(its conversation fits the model's context), so the store's size is too.
Entries belong to the API key that made them (`gateway.api.auth.owner_of`): another key gets a 404 / "not found".
Every method does I/O (call it from a worker thread); a store that fails raises `gateway.store.StoreUnavailable`.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional

from gateway.schemas import ChatMessage
from gateway.store import Store


@dataclass
class StoredResponse:
    owner: str
    response: Dict[str, Any]  # the Response object as JSON
    conversation: List[ChatMessage]  # every turn's input and output, without instructions


class ResponseStore:
    def __init__(self, store: Store, max_entries: int, ttl: float, clock: Callable[[], float] = time.time):
        self.store, self.max_entries, self.ttl, self.clock = store, max_entries, ttl, clock

    @property
    def enabled(self) -> bool:
        return self.max_entries > 0

    def __len__(self) -> int:
        return self.store.count_responses(now=self.clock())

    def put(self, owner: str, response: Dict[str, Any], conversation: List[ChatMessage]) -> bool:
        """Store a response (False: the store is off)."""
        if not self.enabled:
            return False
        document = {"response": response, "conversation": [m.model_dump(mode="json") for m in conversation]}
        self.store.put_response(owner, response["id"], document, self.ttl, self.max_entries, now=self.clock())
        return True

    def get(self, owner: str, response_id: str) -> Optional[StoredResponse]:
        document = self.store.get_response(owner, response_id, now=self.clock())
        if document is None:
            return None
        return StoredResponse(owner, document["response"],
                              [ChatMessage.model_validate(m) for m in document["conversation"]])

    def delete(self, owner: str, response_id: str) -> bool:
        return self.store.delete_response(owner, response_id)
