"""Clients choosing servers' weight formats (`allowed_quant_types`, issue 14): routing on synthetic swarms (no
network), the client config's validation, the manager's routes and failover, and the model's coverage view."""
from __future__ import annotations

import random
import time
from types import SimpleNamespace
from typing import List, Sequence

import pytest
from pydantic import ValidationError

from swarm.client.api import Coverage, ServerView
from swarm.client.model.causal_lm import DistributedModelForCausalLM
from swarm.client.transport.manager import ClientConfig
from swarm.client.transport.routing import (
    QUANT_TYPES,
    RouteHop,
    RoutingError,
    choose_forward_chain,
    find_inference_chain,
    normalize_quant_types,
)
from swarm.wire.records import ServerSpan, ServerState
from tests.fixtures.synthetic_swarm import fake_manager, span


def quants_of(chain: Sequence[RouteHop], spans: Sequence[ServerSpan]) -> List[str]:
    by_peer = {s.peer_id: s for s in spans}
    return [by_peer[hop.peer_id].info.quant_type for hop in chain]


def assert_covers(chain: Sequence[RouteHop], start: int, end: int) -> None:
    assert chain and chain[0].start == start and chain[-1].end == end
    assert all(a.end == b.start and a.peer_id != b.peer_id for a, b in zip(chain, chain[1:]))


# ---- routing ----------------------------------------------------------------------------------------------------
def test_default_routes_through_any_format_and_picks_the_fastest():
    # the nf4 server is the fastest: with the default (any), a mixed swarm uses it
    spans = [span("f", 0, 30, "none", throughput=1.0), span("q", 0, 30, "nf4", throughput=5.0)]
    assert find_inference_chain(spans, 0, 30) == [RouteHop("q", 0, 30)]
    assert find_inference_chain(spans, 0, 30, allowed_quant_types=None) == [RouteHop("q", 0, 30)]
    assert find_inference_chain(spans, 0, 30, allowed_quant_types=["none"]) == [RouteHop("f", 0, 30)]
    assert find_inference_chain(spans, 0, 30, allowed_quant_types=("int8", "nf4")) == [RouteHop("q", 0, 30)]
    for seed in range(20):
        forward = choose_forward_chain(spans, 0, 30, rng=random.Random(seed), allowed_quant_types=["none"])
        assert forward == [RouteHop("f", 0, 30)]


def test_mixed_swarm_routes_through_allowed_servers_only():
    # float 0:15 and nf4 15:30 (the mixed swarm), plus a fast int8 server over everything
    spans = [span("f", 0, 15, "none"), span("n", 15, 30, "nf4"), span("i", 0, 30, "int8", throughput=10.0)]
    assert find_inference_chain(spans, 0, 30) == [RouteHop("i", 0, 30)]
    chain = find_inference_chain(spans, 0, 30, allowed_quant_types=["none", "nf4"])
    assert chain == [RouteHop("f", 0, 15), RouteHop("n", 15, 30)]
    chain = find_inference_chain(spans, 0, 30, allowed_quant_types=["none", "int8"])
    assert_covers(chain, 0, 30) and set(quants_of(chain, spans)) <= {"none", "int8"}
    assert "n" not in [hop.peer_id for hop in chain]
    for seed in range(20):
        forward = choose_forward_chain(spans, 0, 30, rng=random.Random(seed), allowed_quant_types=["none", "nf4"])
        assert forward == [RouteHop("f", 0, 15), RouteHop("n", 15, 30)]
    # a sub-range (a failover re-route of one span) also keeps to the allowed formats
    assert find_inference_chain(spans, 15, 30, allowed_quant_types=["nf4"]) == [RouteHop("n", 15, 30)]


def test_only_disallowed_servers_on_some_blocks_is_a_clear_error():
    spans = [span("f", 0, 15, "none"), span("n", 15, 30, "nf4")]
    with pytest.raises(RoutingError) as info:
        find_inference_chain(spans, 0, 30, allowed_quant_types=["none"])
    message = str(info.value)
    assert info.value.missing_blocks == tuple(range(15, 30))
    assert "15-29" in message and "blocks 15:30 are served only by nf4 servers" in message
    assert "allowed quant types: none" in message
    with pytest.raises(RoutingError, match="blocks 15:30 are served only by nf4 servers"):
        choose_forward_chain(spans, 0, 30, allowed_quant_types=["none"])


def test_error_distinguishes_gaps_from_other_formats_and_names_each_format():
    spans = [span("f", 0, 10, "none"), span("n", 10, 20, "nf4"), span("i", 15, 25, "int8"),
             span("g", 25, 28, "int8", state=ServerState.JOINING), span("b", 28, 30, "nf4")]
    with pytest.raises(RoutingError) as info:
        find_inference_chain(spans, 0, 30, allowed_quant_types=["none"], banned=["b"])
    message = str(info.value)
    assert info.value.missing_blocks == tuple(range(10, 30))
    assert "blocks 10:15 are served only by nf4 servers" in message
    assert "blocks 15:20 are served only by int8 / nf4 servers" in message
    assert "blocks 20:25 are served only by int8 servers" in message
    # a joining server and a banned one do not count as "served": no note for 25:30
    assert "25:" not in message and "28:30" not in message


def test_error_without_restriction_or_without_other_servers_is_unchanged():
    spans = [span("f", 0, 15, "none")]
    with pytest.raises(RoutingError) as info:
        find_inference_chain(spans, 0, 30)
    assert "served only by" not in str(info.value) and "quant" not in str(info.value)
    with pytest.raises(RoutingError) as info:
        find_inference_chain(spans, 0, 30, allowed_quant_types=["none"])
    assert "served only by" not in str(info.value) and "allowed quant type" in str(info.value)


def test_unknown_format_announced_by_a_newer_server_is_used_only_by_unrestricted_clients():
    spans = [span("x", 0, 30, "fp8")]
    assert find_inference_chain(spans, 0, 30) == [RouteHop("x", 0, 30)]
    with pytest.raises(RoutingError, match="served only by fp8 servers"):
        find_inference_chain(spans, 0, 30, allowed_quant_types=list(QUANT_TYPES))


def test_filter_is_cheap_on_a_large_mixed_swarm():
    rng = random.Random(0)
    spans = []
    for i in range(600):
        start = rng.randrange(0, 70)
        spans.append(span(f"p{i:03d}", start, min(80, start + rng.randrange(5, 30)), rng.choice(QUANT_TYPES),
                          throughput=rng.uniform(0.5, 4)))
    spans += [span("cover", 0, 80, "int8", throughput=0.1)]
    started = time.perf_counter()
    chain = find_inference_chain(spans, 0, 80, allowed_quant_types=["int8"])
    assert time.perf_counter() - started < 1.0
    assert_covers(chain, 0, 80) and set(quants_of(chain, spans)) == {"int8"}


# ---- configuration ----------------------------------------------------------------------------------------------
def test_normalize_quant_types():
    assert normalize_quant_types(None) is None
    assert normalize_quant_types(["nf4", "none"]) == ("none", "nf4")
    assert normalize_quant_types("NF4, int8") == ("int8", "nf4")
    assert normalize_quant_types(["none", "none"]) == ("none",)
    with pytest.raises(ValueError, match=r"unknown quant type\(s\) 'fp4'.*none, int8, nf4"):
        normalize_quant_types(["none", "fp4"])
    with pytest.raises(ValueError, match="empty"):
        normalize_quant_types([])
    with pytest.raises(ValueError, match="not a string"):
        normalize_quant_types([8])


def test_client_config_validates_allowed_quant_types():
    assert ClientConfig().allowed_quant_types is None
    assert ClientConfig(allowed_quant_types=["nf4", "none"]).allowed_quant_types == ["none", "nf4"]
    assert ClientConfig(allowed_quant_types="int8").allowed_quant_types == ["int8"]
    with pytest.raises(ValidationError, match=r"allowed_quant_types.*unknown quant type\(s\) 'int4'"):
        ClientConfig(allowed_quant_types=["int4"])
    with pytest.raises(ValidationError, match="allowed_quant_types is empty"):
        ClientConfig(allowed_quant_types=[])


def test_from_pretrained_rejects_a_bad_format_before_loading(tmp_path):
    # client kwargs become the ClientConfig first: a bad value fails before the checkpoint is even looked up
    from swarm import AutoDistributedModelForCausalLM

    with pytest.raises(ValidationError, match="unknown quant type"):
        AutoDistributedModelForCausalLM.from_pretrained(str(tmp_path / "missing"), initial_peers=["/ip4/x"],
                                                        allowed_quant_types=["q4"])


# ---- the manager's routes and the model's coverage, over a fixed swarm view ---------------------------------------


def test_manager_routes_and_fails_over_among_allowed_servers_only():
    spans = [span("f1", 0, 15, "none"), span("f2", 0, 15, "none", throughput=0.5), span("n", 15, 30, "nf4"),
             span("i", 15, 30, "int8", throughput=0.5), span("q", 0, 30, "nf4", throughput=50.0)]
    manager = fake_manager(spans, ["none", "int8"])
    assert manager.make_inference_chain() == [RouteHop("f1", 0, 15), RouteHop("i", 15, 30)]
    assert {hop.peer_id for hop in manager.make_forward_chain()} <= {"f1", "f2", "i"}
    assert [s.peer_id for s in manager.allowed_spans()] == ["f1", "f2", "i"]
    manager.ban("f1")  # a failed server: its span is re-routed to the other float server, never to "q"
    assert manager.make_inference_chain(0, 15) == [RouteHop("f2", 0, 15)]
    manager.ban("i")  # blocks 15:30 are left to nf4 servers only
    with pytest.raises(RoutingError, match="blocks 15:30 are served only by nf4 servers; allowed quant types: "
                                           "none, int8"):
        manager.make_inference_chain(15, 30)
    # the default (any): the mixed swarm works and failover may move from a quantized server to a float one
    manager = fake_manager(spans, None)
    assert manager.make_inference_chain() == [RouteHop("q", 0, 30)]
    manager.ban("q")
    assert manager.make_inference_chain() == [RouteHop("f1", 0, 15), RouteHop("n", 15, 30)]


def test_model_coverage_counts_allowed_servers_and_lists_every_server():
    spans = [span("f", 0, 15, "none"), span("n", 15, 30, "nf4")]
    model = SimpleNamespace(manager=fake_manager(spans, ["none"]))
    coverage = DistributedModelForCausalLM.coverage(model)  # type: ignore[arg-type]
    assert coverage.missing == list(range(15, 30)) and coverage.num_blocks == 30 and coverage.servers == 1
    assert coverage.spans == (ServerView("f", 0, 15, "none", True), ServerView("n", 15, 30, "nf4", False))
    assert coverage.allowed_quant_types == ("none",)
    model = SimpleNamespace(manager=fake_manager(spans, None))
    coverage = DistributedModelForCausalLM.coverage(model)  # type: ignore[arg-type]
    assert (coverage.missing, coverage.servers, coverage.allowed_quant_types) == ([], 2, None)
    assert [v.allowed for v in coverage.spans] == [True, True]
    assert Coverage([], 4, 1).spans == () and Coverage([], 4, 1).allowed_quant_types is None  # old 3-field form
