"""Routing by capabilities on synthetic swarms (issue 45): every optional request field belongs to a named capability,
a client sends it only to a server that announces it, and routing keeps a request to servers with what it needs or
says, in one RoutingError, which capability is missing and the releases of the servers that lack it."""
from __future__ import annotations

from types import SimpleNamespace
from typing import Optional, Tuple

import pytest
import torch

from swarm.client.transport.manager import needs_for
from swarm.client.transport.routing import (
    RouteHop,
    RoutingError,
    choose_forward_chain,
    choose_training_chain,
    find_inference_chain,
)
from swarm.client.transport.session import InferenceSession
from swarm.client.transport.span_stream import SpanStream
from swarm.wire import capabilities as C
from swarm.wire import protocol as P
from swarm.wire import rounds as R
from swarm.wire.records import ServerInfo, ServerSpan, ServerState
from tests.fixtures.synthetic_swarm import fake_manager

ALL = C.OWN_CAPABILITIES


def _span(peer: str, start: int, end: int, capabilities: Optional[Tuple[str, ...]], version: str = "0.3.0",
          adapters: Tuple[str, ...] = ()) -> ServerSpan:
    info = ServerInfo(state=ServerState.ONLINE, start=start, end=end, cache_tokens_left=100_000, version=version,
                      capabilities=capabilities, adapters=adapters)
    return ServerSpan(peer, start, end, info)


def _without(*names: str) -> Tuple[str, ...]:
    return tuple(name for name in ALL if name not in names)


def test_every_request_field_is_core_or_names_its_capability():
    fields = {f"{kind.__name__}.{name}" for kind in P.REQUEST_TYPES + R.ROUND_REQUEST_TYPES
              for name in kind.model_fields if name not in ("v", "type")}
    assert fields == set(C.FIELD_CAPABILITIES) | C.CORE_FIELDS, "a request field with no capability and not core"
    assert not set(C.FIELD_CAPABILITIES) & C.CORE_FIELDS
    assert set(C.FIELD_CAPABILITIES.values()) | set(C.MESSAGE_CAPABILITIES.values()) <= set(C.CAPABILITIES)


@pytest.mark.parametrize("message, needed", [
    (P.Step(start_position=0), set()),
    (P.Step(start_position=3, hypo_ids=[0, 0], reorder_id=4), {"beam_reorder"}),
    (P.Step(start_position=0, left_padding=[1, 0]), {"left_padding"}),
    (P.Step(start_position=0, rope_length=9), {"rope_length"}),
    (P.Step(start_position=0, push_chain=[P.PushTarget(peer_id="b", stream_key="s:0")]), {"push"}),
    (P.OpenSession(session_id="s", start=0, end=2, max_length=8), set()),
    (P.OpenSession(session_id="s", start=0, end=2, max_length=8, adapter="x", prompts=True, push_token="t" * 16,
                   compression="float16"), {"adapters", "deep_prompts", "push", "compression"}),
    (P.ForwardRequest(start=0, end=2, left_padding=[0], rope_length=5), {"left_padding", "rope_length"}),
    (P.TrainForward(start=0, end=2), {"training"}),
    (P.TrainBackward(start=0, end=2, adapter="x", prompts=True), {"training", "train_adapters", "deep_prompts"}),
    (P.PushStep(stream_key="s:0", start_position=1, step_id=1), {"push"}),
])
def test_what_a_message_needs_is_what_its_set_fields_name(message, needed):
    assert C.needed_capabilities(message) == needed
    P.check_capabilities(message, needed)
    for name in needed:  # one missing capability is enough to keep the message from that server
        with pytest.raises(P.ProtocolError, match=f"needs {name}.*server b does not announce"):
            P.check_capabilities(message, set(needed) - {name}, "b")


@pytest.mark.parametrize("need", ["rope_length", "left_padding", "deep_prompts", "beam_reorder"])
def test_inference_routes_around_servers_without_a_needed_capability(need):
    # b is cheaper (higher throughput) but lacks the capability: the chain goes through a over 0:30
    lacking = _span("b", 0, 30, _without(need), version="0.3.0")
    spans = [_span("a", 0, 30, ALL, version="0.2.0"), lacking]
    spans[1] = ServerSpan("b", 0, 30, lacking.info.model_copy(update={"throughput": 50.0}))
    assert [h.peer_id for h in find_inference_chain(spans, 0, 30)] == ["b"]
    assert [h.peer_id for h in find_inference_chain(spans, 0, 30, needs={need})] == ["a"]
    # a first-release record (no capabilities field) supports them all
    old = _span("c", 0, 30, None, version="0.1.0")
    assert [h.peer_id for h in find_inference_chain([old, spans[1]], 0, 30, needs={need})] == ["c"]
    # where no server has it: one error naming the capability, the blocks and the releases there
    with pytest.raises(RoutingError) as error:
        find_inference_chain([_span("a", 0, 15, ALL), spans[1]], 0, 30, needs={need})
    text = str(error.value)
    assert f"lack {need}" in text and "0.3.0" in text and "15-29" in text
    assert error.value.missing_blocks == tuple(range(15, 30))


def test_forward_and_training_chains_keep_to_servers_with_what_they_need():
    spans = [_span("a", 0, 30, _without("left_padding"), adapters=("x",)),
             _span("b", 0, 30, _without("deep_prompts"), adapters=("x",))]
    for _ in range(10):
        assert [h.peer_id for h in choose_forward_chain(spans, 0, 30, needs=needs_for("x", left_padding=True))] \
            == ["b"]
        assert [h.peer_id for h in choose_training_chain(spans, 0, 30, adapter="x",
                                                         needs=needs_for("x", training=True, prompts=True))] == ["a"]
    with pytest.raises(RoutingError, match="lack deep_prompts, left_padding"):
        choose_forward_chain(spans[:1] + [_span("b", 0, 30, _without("deep_prompts", "left_padding"))], 0, 30,
                             needs={"left_padding", "deep_prompts"})


def test_the_manager_routes_a_session_by_what_it_needs():
    spans = [_span("a", 0, 30, _without("rope_length")), _span("b", 0, 30, ALL)]
    spans[0] = ServerSpan("a", 0, 30, spans[0].info.model_copy(update={"throughput": 50.0}))
    manager = fake_manager(spans, None)
    session = InferenceSession(manager, 16, rope_lengths=True)  # a LongRoPE model's session
    assert "rope_length" in session.needs and "rope_length" not in InferenceSession(manager, 16).needs
    assert [h.peer_id for h in manager.make_inference_chain(needs=session.needs)] == ["b"]
    assert [h.peer_id for h in manager.make_inference_chain()] == ["a"]
    with pytest.raises(RoutingError, match="lack rope_length"):
        fake_manager(spans[:1], None).make_inference_chain(needs=session.needs)


def _stream(capabilities) -> SpanStream:
    hop = RouteHop("a", 0, 30, capabilities=frozenset(capabilities))
    manager = SimpleNamespace(config=SimpleNamespace(compression=None))
    return SpanStream(manager, hop, "s", max_length=8, batch_size=2)  # type: ignore[arg-type]


def test_a_server_without_push_gets_no_push_token_and_no_optional_field_it_does_not_know():
    assert _stream(ALL).pushes and not _stream(_without("push")).pushes
    stream = _stream(_without("rope_length", "push"))
    stream.send(torch.zeros(2, 1, 4), 0, 1)  # a plain step goes
    sent = P.decode(stream._queue.get_nowait().metadata, P.Step)
    assert sent.rope_length is None and sent.push_chain == []
    with pytest.raises(P.ProtocolError, match="needs rope_length"):
        stream.send(torch.zeros(2, 1, 4), 0, 2, edits=dict(rope_length=4))
    with pytest.raises(P.ProtocolError, match="needs push"):
        stream.send(torch.zeros(2, 1, 4), 0, 3, push_chain=[P.PushTarget(peer_id="b", stream_key="s:0")])
    assert stream._queue.empty()  # nothing it does not know went out


def test_a_server_whose_fresh_record_is_gone_or_offline_departed_without_a_ban():
    spans = [_span("a", 0, 30, ALL), _span("b", 0, 30, ALL)]
    manager = fake_manager(spans, None)
    assert manager.departed(["a", "b"]) == set()  # both still online: their failures are failures
    manager.spans = spans[:1]  # b announced offline (online_spans keeps ONLINE records only)
    assert manager.departed(["a", "b"]) == {"b"} and manager.departed([]) == set()
    assert manager.banned() == []
