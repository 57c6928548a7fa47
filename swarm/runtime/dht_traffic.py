"""Counting one DHT peer's traffic: every DHT RPC message it sends and receives, with its size.

Every hivemind DHT RPC (ping, store, find), outgoing or served, passes through `hivemind.utils.auth.AuthRPCWrapper`
(the DHT protocol wraps both its stubs and its servicer in it). `install()`, called in the DHT child process before
the node starts (`swarm.runtime.dht_process.DHTProcess.run`), swaps in a subclass that counts, per direction, the
protobuf messages and their serialized sizes (`ByteSize()`): a call made counts its request as sent and its
response as received, a call served the reverse. Not counted: p2pd's own framing, encryption and multiplexing,
and libp2p's identify/keep-alive streams, so the bytes are the DHT payload, a lower bound of what crosses the
network. A call that fails or times out counts its request only.

`read_dht_traffic(dht)` returns the counters of a running `hivemind.DHT` (one round trip over its command pipe). A
server refreshes its snapshot at each announcement and reports it through its `rpc_dht_traffic` RPC.
"""
from __future__ import annotations

from typing import Any, Dict

from pydantic import BaseModel, ConfigDict, Field


class DHTTraffic(BaseModel):
    """Totals since the DHT peer started (sizes are serialized protobuf payloads, bytes)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    sent_messages: int = Field(default=0, ge=0, description="requests of calls made plus responses to calls served")
    sent_bytes: int = Field(default=0, ge=0)
    received_messages: int = Field(default=0, ge=0, description="responses to calls made plus requests served")
    received_bytes: int = Field(default=0, ge=0)
    calls_made: Dict[str, int] = Field(default_factory=dict, description="outgoing RPCs by kind (ping, store, find)")
    calls_served: Dict[str, int] = Field(default_factory=dict, description="incoming RPCs by kind")


class TrafficCounter:
    """Mutable counters of one process's DHT peer (`DHTTraffic` is their snapshot)."""

    def __init__(self) -> None:
        self.sent_messages = self.sent_bytes = self.received_messages = self.received_bytes = 0
        self.calls_made: Dict[str, int] = {}
        self.calls_served: Dict[str, int] = {}

    def count(self, kind: str, served: bool, request: Any, response: Any) -> None:
        """One RPC `kind` made (`served` False) or served; `response` None: failed or refused (not counted)."""
        calls = self.calls_served if served else self.calls_made
        calls[kind] = calls.get(kind, 0) + 1
        for message, outgoing in ((request, not served), (response, served)):
            if message is None:
                continue
            size = message.ByteSize()
            if outgoing:
                self.sent_messages, self.sent_bytes = self.sent_messages + 1, self.sent_bytes + size
            else:
                self.received_messages, self.received_bytes = self.received_messages + 1, self.received_bytes + size

    def snapshot(self) -> DHTTraffic:
        return DHTTraffic(sent_messages=self.sent_messages, sent_bytes=self.sent_bytes,
                          received_messages=self.received_messages, received_bytes=self.received_bytes,
                          calls_made=dict(self.calls_made), calls_served=dict(self.calls_served))


COUNTER = TrafficCounter()  # the DHT child's counters (each process has its own copy)


def counting_wrapper_class(counter: TrafficCounter) -> type:
    """An `AuthRPCWrapper` subclass whose `rpc_*` calls are counted into `counter`."""
    from hivemind.utils.auth import AuthRole, AuthRPCWrapper

    class CountingRPCWrapper(AuthRPCWrapper):
        def __getattribute__(self, name: str):
            method = super().__getattribute__(name)
            if not name.startswith("rpc_"):
                return method
            served = object.__getattribute__(self, "_role") == AuthRole.SERVICER

            async def counted(request, *args, **kwargs):
                response = None
                try:
                    response = await method(request, *args, **kwargs)
                    return response
                finally:
                    counter.count(name[len("rpc_"):], served, request, response)

            return counted

    return CountingRPCWrapper


def install(counter: TrafficCounter = COUNTER) -> None:
    """In the DHT process, before its node starts: count every DHT RPC into `counter`."""
    import hivemind.dht.protocol as protocol

    protocol.AuthRPCWrapper = counting_wrapper_class(counter)


async def _read(_dht, _node) -> Dict[str, Any]:
    return COUNTER.snapshot().model_dump()


def read_dht_traffic(dht) -> DHTTraffic:
    """The DHT traffic counters of the running `hivemind.DHT` `dht` (its child process's, since it started)."""
    return DHTTraffic.model_validate(dht.run_coroutine(_read))


async def read_dht_traffic_async(dht) -> DHTTraffic:
    """`read_dht_traffic` without blocking the event loop."""
    return DHTTraffic.model_validate(await dht.run_coroutine(_read, return_future=True))
