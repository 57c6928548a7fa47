"""Routing sessions with a LoRA adapter on synthetic swarms (no network): only servers whose record lists the
adapter are used, the error when no chain has it names the adapters served, and `served_adapters` lists the
adapters that cover every block. Also the wire's adapter fields and the server config's `--adapters`."""
from __future__ import annotations

import random
from typing import Sequence

import pytest
from pydantic import ValidationError

from server.config import ServerConfig
from swarm.client.transport.routing import (
    RouteHop,
    RoutingError,
    choose_forward_chain,
    find_inference_chain,
    served_adapters,
)
from swarm.wire import protocol as P
from swarm.wire.records import ServerInfo, ServerSpan, ServerState


def span(peer: str, start: int, end: int, adapters: Sequence[str] = (), throughput: float = 1.0,
         state: ServerState = ServerState.ONLINE) -> ServerSpan:
    info = ServerInfo(state=state, start=start, end=end, throughput=throughput, cache_tokens_left=100_000,
                      adapters=tuple(adapters))
    return ServerSpan(peer, start, end, info)


def test_adapter_sessions_route_only_through_servers_that_hold_it():
    # a fast server without adapters covers everything; two slower ones hold "chat" for half each
    spans = [span("plain", 0, 30, throughput=10.0), span("a", 0, 15, ["chat"]), span("b", 15, 30, ["chat", "code"])]
    assert find_inference_chain(spans, 0, 30) == [RouteHop("plain", 0, 30)]
    assert find_inference_chain(spans, 0, 30, adapter="chat") == [RouteHop("a", 0, 15), RouteHop("b", 15, 30)]
    for seed in range(20):
        chain = choose_forward_chain(spans, 0, 30, rng=random.Random(seed), adapter="chat")
        assert [hop.peer_id for hop in chain] == ["a", "b"]
    # a part of the range: only "b" holds "code" there
    assert find_inference_chain(spans, 15, 30, adapter="code") == [RouteHop("b", 15, 30)]


def test_no_chain_with_the_adapter_is_a_clear_error():
    spans = [span("plain", 0, 30), span("a", 0, 15, ["chat"]), span("b", 15, 30, ["code"])]
    with pytest.raises(RoutingError, match=r"holding LoRA adapter 'chat'.* block\(s\) 15-29.*adapters served "
                                           r"there: code") as caught:
        find_inference_chain(spans, 0, 30, adapter="chat")
    assert caught.value.missing_blocks == tuple(range(15, 30))
    with pytest.raises(RoutingError, match="adapters served there: none"):
        find_inference_chain([span("plain", 0, 30)], 0, 30, adapter="chat")
    with pytest.raises(RoutingError, match="holding LoRA adapter 'nope'"):
        choose_forward_chain(spans, 0, 30, adapter="nope")


def test_banned_or_offline_holders_do_not_count():
    spans = [span("a", 0, 30, ["chat"]), span("b", 0, 30, ["chat"], state=ServerState.OFFLINE), span("c", 0, 30)]
    assert find_inference_chain(spans, 0, 30, adapter="chat") == [RouteHop("a", 0, 30)]
    with pytest.raises(RoutingError):
        find_inference_chain(spans, 0, 30, adapter="chat", banned=["a"])


def test_served_adapters_cover_every_block():
    spans = [span("a", 0, 15, ["chat", "code"]), span("b", 15, 30, ["chat"]), span("c", 10, 30, ["math"]),
             span("d", 0, 10, ["math"], state=ServerState.OFFLINE)]
    assert served_adapters(spans, 30) == ["chat"]
    assert served_adapters(spans + [span("e", 0, 10, ["math"])], 30) == ["chat", "math"]
    assert served_adapters(spans, 30, banned=["b"]) == []


def test_wire_messages_carry_an_optional_adapter():
    opened = P.decode(P.encode(P.OpenSession(session_id="s", start=0, end=3, max_length=8, adapter="chat")),
                      P.OpenSession)
    assert opened.adapter == "chat"
    plain = P.OpenSession(session_id="s", start=0, end=3, max_length=8)
    assert P.decode(P.encode(plain), P.OpenSession).adapter is None
    with pytest.raises(P.ProtocolError, match="adapter"):
        P.decode(b'{"v": 1, "type": "open", "session_id": "s", "start": 0, "end": 3, "max_length": 8, '
                 b'"adapter": ""}', P.OpenSession)
    with pytest.raises(P.ProtocolError, match="adapter"):
        P.decode(b'{"v": 1, "type": "forward", "start": 0, "end": 3, "adapter": 5}', P.ForwardRequest)


def test_server_config_checks_adapter_names():
    config = ServerConfig(model="m", adapters=["chat=/tmp/x", "org/repo"])
    assert config.adapters == ["chat=/tmp/x", "org/repo"]
    with pytest.raises(ValidationError, match="must differ"):
        ServerConfig(model="m", adapters=["a=/x", "a=/y"])
    with pytest.raises(ValidationError, match="adapter name"):
        ServerConfig(model="m", adapters=["bad name=/x"])
