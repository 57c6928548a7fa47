"""Tests for swarm.client.transport.routing on synthetic swarms (no network)."""
from __future__ import annotations

import collections
import math
import random
import time
from types import SimpleNamespace
from typing import List, Sequence

import pytest
import torch

from swarm.client.transport.routing import (
    RouteHop,
    RoutingCosts,
    RoutingError,
    chain_cost,
    choose_forward_chain,
    find_inference_chain,
)
from swarm.wire.records import ServerInfo, ServerSpan, ServerState
from tests.fixtures.synthetic_swarm import make_span


def peers(chain: Sequence[RouteHop]) -> List[str]:
    return [hop.peer_id for hop in chain]


def assert_valid_chain(chain: Sequence[RouteHop], spans: Sequence[ServerSpan], start: int, end: int) -> None:
    by_peer = {span.peer_id: span for span in spans}
    assert chain, "empty chain"
    assert chain[0].start == start and chain[-1].end == end
    for hop in chain:
        span = by_peer[hop.peer_id]
        assert span.start <= hop.start < hop.end <= span.end, (hop, span)
        assert span.info.state == ServerState.ONLINE
    for previous, following in zip(chain, chain[1:]):
        assert previous.end == following.start
        assert previous.peer_id != following.peer_id


def test_single_server_covers_everything():
    spans = [make_span("a", 0, 30)]
    assert find_inference_chain(spans, 0, 30) == [RouteHop("a", 0, 30)]


@pytest.mark.parametrize("fast", ["a", "b"])
def test_lower_client_rtt_wins(fast):
    spans = [make_span("a", 0, 30), make_span("b", 0, 30)]
    rtts = {"a": 0.2, "b": 0.2, fast: 0.005}
    assert peers(find_inference_chain(spans, 0, 30, client_rtts=rtts)) == [fast]


@pytest.mark.parametrize("near", ["y", "z"])
def test_lower_next_ping_wins(near):
    pings = {"y": 0.3, "z": 0.3, near: 0.001}
    spans = [make_span("x", 0, 10, pings=pings), make_span("y", 10, 20), make_span("z", 10, 20)]
    assert peers(find_inference_chain(spans, 0, 20)) == ["x", near]


def test_measured_ping_compared_with_default_for_unmeasured_links():
    # x measured a slow link to y and nothing to z: z (default RTT) wins
    spans = [make_span("x", 0, 10, pings={"y": 0.5}), make_span("y", 10, 20), make_span("z", 10, 20)]
    assert peers(find_inference_chain(spans, 0, 20)) == ["x", "z"]
    # a measured link faster than the default wins
    spans[0] = make_span("x", 0, 10, pings={"y": 0.0001})
    assert peers(find_inference_chain(spans, 0, 20)) == ["x", "y"]


def test_unreachable_and_garbage_measurements():
    # an infinite measured RTT means unreachable: the other next server is used despite its slow link
    spans = [make_span("x", 0, 10, pings={"y": math.inf, "z": 0.05})]
    spans += [make_span("y", 10, 20), make_span("z", 10, 20)]
    assert peers(find_inference_chain(spans, 0, 20)) == ["x", "z"]
    # NaN / negative measurements are ignored (treated as unmeasured: default RTT)
    spans[0] = make_span("x", 0, 10, pings={"y": math.nan, "z": 0.02})
    assert peers(find_inference_chain(spans, 0, 20)) == ["x", "y"]
    spans[0] = make_span("x", 0, 10, pings={"y": -5.0, "z": 0.001})
    assert peers(find_inference_chain(spans, 0, 20)) == ["x", "z"]
    spans = [make_span("a", 0, 10, throughput=100.0), make_span("b", 0, 10, throughput=99.0)]
    assert peers(find_inference_chain(spans, 0, 10)) == ["a"]
    assert peers(find_inference_chain(spans, 0, 10, client_rtts={"a": math.inf})) == ["b"]
    with pytest.raises(RoutingError):
        find_inference_chain(spans, 0, 10, client_rtts={"a": math.inf, "b": math.inf})


def test_higher_throughput_wins():
    spans = [make_span("slow", 0, 30, throughput=1.0), make_span("fast", 0, 30, throughput=5.0)]
    assert peers(find_inference_chain(spans, 0, 30)) == ["fast"]
    # a much faster pair beats a single slow server despite the extra hop
    spans = [
        make_span("slow", 0, 30, throughput=1.0),
        make_span("f1", 0, 15, throughput=50.0),
        make_span("f2", 15, 30, throughput=50.0),
    ]
    assert peers(find_inference_chain(spans, 0, 30)) == ["f1", "f2"]


def test_extra_hop_not_taken_for_negligible_gain():
    # splitting would save 30 * (1/1000 - 1/1001) s of compute but cost a hop (0.002 + 0.005 s)
    spans = [make_span("a", 0, 30, throughput=1000.0), make_span("b", 10, 30, throughput=1001.0)]
    assert peers(find_inference_chain(spans, 0, 30)) == ["a"]


@pytest.mark.parametrize("overhead, expected", [(0.01, ["a"]), (0.0005, ["b", "c"])])
def test_hop_overhead_counts_per_network_hop(overhead, expected):
    # splitting over b and c saves 30 * (1/100 - 1/101) ~ 0.003 s of compute but adds one network hop
    costs = RoutingCosts(hop_overhead=overhead, default_rtt=0.0)
    spans = [make_span("a", 0, 30, throughput=100.0), make_span("b", 0, 15, throughput=101.0),
             make_span("c", 15, 30, throughput=101.0)]
    assert peers(find_inference_chain(spans, 0, 30, costs=costs)) == expected


def test_full_cache_avoided_and_used_only_when_needed():
    full_fast = make_span("full", 0, 30, throughput=10.0, cache=50)
    roomy_slow = make_span("roomy", 0, 30, throughput=1.0, cache=5000)
    assert peers(find_inference_chain([full_fast, roomy_slow], 0, 30, cache_tokens_needed=100)) == ["roomy"]
    assert peers(find_inference_chain([full_fast, roomy_slow], 0, 30, cache_tokens_needed=0)) == ["full"]
    assert peers(find_inference_chain([full_fast, roomy_slow], 0, 30, cache_tokens_needed=50)) == ["full"]
    # the only option: used anyway
    assert peers(find_inference_chain([full_fast], 0, 30, cache_tokens_needed=100)) == ["full"]


def test_full_cache_server_only_runs_the_blocks_nobody_else_covers():
    spans = [
        make_span("full", 0, 30, throughput=10.0, cache=0),
        make_span("b", 0, 10, cache=5000),
        make_span("c", 20, 30, cache=5000),
    ]
    chain = find_inference_chain(spans, 0, 30, cache_tokens_needed=10)
    assert chain == [RouteHop("b", 0, 10), RouteHop("full", 10, 20), RouteHop("c", 20, 30)]


def test_overlapping_spans_give_two_hops():
    spans = [make_span("a", 0, 20), make_span("b", 10, 30)]
    chain = find_inference_chain(spans, 0, 30)
    assert_valid_chain(chain, spans, 0, 30)
    assert peers(chain) == ["a", "b"]
    assert 10 <= chain[0].end <= 20
    # the faster server runs as many of the shared blocks as it can
    spans = [make_span("a", 0, 20, throughput=2.0), make_span("b", 10, 30)]
    assert find_inference_chain(spans, 0, 30) == [RouteHop("a", 0, 20), RouteHop("b", 20, 30)]
    spans = [make_span("a", 0, 20), make_span("b", 10, 30, throughput=2.0)]
    assert find_inference_chain(spans, 0, 30) == [RouteHop("a", 0, 10), RouteHop("b", 10, 30)]


def test_three_way_split():
    spans = [make_span("c", 20, 30), make_span("a", 0, 10), make_span("b", 10, 20)]
    chain = find_inference_chain(spans, 0, 30)
    assert chain == [RouteHop("a", 0, 10), RouteHop("b", 10, 20), RouteHop("c", 20, 30)]


def test_missing_block_raises_naming_it():
    spans = [make_span("a", 0, 10), make_span("b", 11, 30)]
    with pytest.raises(RoutingError) as info:
        find_inference_chain(spans, 0, 30)
    assert info.value.missing_blocks == (10,)
    assert "10" in str(info.value)
    with pytest.raises(RoutingError) as info:
        choose_forward_chain(spans, 0, 30, rng=random.Random(0))
    assert info.value.missing_blocks == (10,)

    spans = [make_span("a", 0, 10), make_span("b", 12, 25)]
    with pytest.raises(RoutingError) as info:
        find_inference_chain(spans, 0, 30)
    assert info.value.missing_blocks == (10, 11, 25, 26, 27, 28, 29)
    assert "10-11" in str(info.value) and "25-29" in str(info.value)


def test_invalid_range_rejected():
    spans = [make_span("a", 0, 10)]
    with pytest.raises(ValueError):
        find_inference_chain(spans, 5, 5)
    with pytest.raises(ValueError):
        choose_forward_chain(spans, -1, 5)


def test_banned_servers_skipped():
    spans = [make_span("best", 0, 30, throughput=10.0), make_span("other", 0, 30)]
    assert peers(find_inference_chain(spans, 0, 30)) == ["best"]
    assert peers(find_inference_chain(spans, 0, 30, banned={"best"})) == ["other"]
    with pytest.raises(RoutingError):
        find_inference_chain(spans, 0, 30, banned=["best", "other"])
    for seed in range(20):
        chain = choose_forward_chain(spans, 0, 30, banned={"best"}, rng=random.Random(seed))
        assert peers(chain) == ["other"]


@pytest.mark.parametrize("state", [ServerState.OFFLINE, ServerState.JOINING])
def test_non_online_servers_not_used(state):
    spans = [make_span("gone", 0, 30, throughput=100.0, state=state), make_span("ok", 0, 30)]
    assert peers(find_inference_chain(spans, 0, 30)) == ["ok"]
    assert all(peers(choose_forward_chain(spans, 0, 30, rng=random.Random(s))) == ["ok"] for s in range(20))
    with pytest.raises(RoutingError) as info:
        find_inference_chain([spans[0], make_span("half", 0, 15)], 0, 30)
    assert info.value.missing_blocks == tuple(range(15, 30))


def test_sub_range_routing():
    spans = [make_span("a", 0, 20), make_span("b", 20, 40), make_span("c", 30, 40, throughput=9.0)]
    chain = find_inference_chain(spans, 15, 30)
    assert chain == [RouteHop("a", 15, 20), RouteHop("b", 20, 30)]
    assert find_inference_chain(spans, 32, 35) == [RouteHop("c", 32, 35)]
    forward = choose_forward_chain(spans, 15, 30, rng=random.Random(1))
    assert forward == [RouteHop("a", 15, 20), RouteHop("b", 20, 30)]


def _brute_force_best(spans, start, end, **kwargs) -> float:
    best = math.inf

    def extend(position: int, chain: List[RouteHop]) -> None:
        nonlocal best
        if position == end:
            best = min(best, chain_cost(chain, spans, **kwargs))
            return
        for span in spans:
            if span.info.state != ServerState.ONLINE or not span.start <= position < span.end:
                continue
            if chain and chain[-1].peer_id == span.peer_id:
                continue
            for hop_end in range(position + 1, min(span.end, end) + 1):
                extend(hop_end, chain + [RouteHop(span.peer_id, position, hop_end)])

    extend(start, [])
    return best


@pytest.mark.parametrize("seed", range(12))
def test_matches_brute_force_on_small_random_swarms(seed):
    rng = random.Random(seed)
    num_blocks, names = 7, [f"p{i}" for i in range(5)]
    spans = []
    for name in names:
        start = rng.randrange(num_blocks)
        end = rng.randint(start + 1, num_blocks)
        pings = {other: rng.uniform(0.0, 0.05) for other in names if other != name and rng.random() < 0.5}
        spans.append(
            make_span(name, start, end, throughput=rng.uniform(5, 200), cache=rng.choice([0, 1000]), pings=pings)
        )
    spans.append(make_span("base", 0, num_blocks, throughput=2.0))  # guarantees coverage
    kwargs = dict(
        client_rtts={name: rng.uniform(0.0, 0.05) for name in names if rng.random() < 0.7},
        cache_tokens_needed=rng.choice([0, 100]),
        costs=RoutingCosts(hop_overhead=rng.uniform(0, 0.01), default_rtt=0.02, cache_penalty=1000.0),
    )
    chain = find_inference_chain(spans, 0, num_blocks, **kwargs)
    assert_valid_chain(chain, spans, 0, num_blocks)
    assert chain_cost(chain, spans, **kwargs) == pytest.approx(_brute_force_best(spans, 0, num_blocks, **kwargs))


def random_swarm(rng: random.Random, num_servers: int, num_blocks: int) -> List[ServerSpan]:
    starts = [rng.randrange(num_blocks) for _ in range(num_servers)]
    spans = []
    for index, start in enumerate(starts):
        end = min(num_blocks, start + rng.randint(5, 30))
        pings = {f"s{other}": rng.uniform(0.001, 0.1) for other in rng.sample(range(num_servers), 8)}
        spans.append(
            make_span(
                f"s{index}",
                start,
                end,
                throughput=rng.lognormvariate(0, 0.7),
                cache=rng.choice([0, 10_000]),
                state=ServerState.ONLINE if rng.random() < 0.9 else ServerState.JOINING,
                pings=pings,
            )
        )
    spans.append(make_span("full-cover", 0, num_blocks, throughput=0.5))
    return spans


def test_large_swarm_routes_quickly():
    rng = random.Random(7)
    spans = random_swarm(rng, 1000, 80)
    rtts = {span.peer_id: rng.uniform(0.001, 0.2) for span in spans}
    started = time.perf_counter()
    chain = find_inference_chain(spans, 0, 80, client_rtts=rtts, cache_tokens_needed=100)
    elapsed = time.perf_counter() - started
    assert_valid_chain(chain, spans, 0, 80)
    assert elapsed < 1.0, f"routing 1000 servers took {elapsed:.3f}s"
    # the chosen chain is no worse than the single server covering everything
    single = [RouteHop("full-cover", 0, 80)]
    kwargs = dict(client_rtts=rtts, cache_tokens_needed=100)
    assert chain_cost(chain, spans, **kwargs) < chain_cost(single, spans, **kwargs)
    started = time.perf_counter()
    forward = choose_forward_chain(spans, 0, 80, rng=random.Random(0))
    assert time.perf_counter() - started < 1.0
    assert_valid_chain(forward, spans, 0, 80)


def test_forward_chain_covers_everything_and_spreads_by_throughput():
    spans = [
        make_span("a1", 0, 10, throughput=1.0),
        make_span("a3", 0, 10, throughput=3.0),
        make_span("b", 5, 20, throughput=2.0),
        make_span("c", 10, 30, throughput=1.0),
        make_span("d", 20, 30, throughput=1.0),
    ]
    rng = random.Random(42)
    first_counts: collections.Counter = collections.Counter()
    used: collections.Counter = collections.Counter()
    draws = 4000
    for _ in range(draws):
        chain = choose_forward_chain(spans, 0, 30, rng=rng)
        assert_valid_chain(chain, spans, 0, 30)
        first_counts[chain[0].peer_id] += 1
        used.update(peers(chain))
    # block 0 is covered by a1 (throughput 1) and a3 (throughput 3): about 1:3
    assert first_counts["a1"] + first_counts["a3"] == draws
    assert first_counts["a3"] / draws == pytest.approx(0.75, abs=0.03)
    # every server gets some traffic; an inference chain would always pick the same one
    assert set(used) == {"a1", "a3", "b", "c", "d"}
    assert min(used.values()) > draws * 0.1
    assert len({tuple(peers(find_inference_chain(spans, 0, 30))) for _ in range(5)}) == 1


def test_forward_chain_is_reproducible_with_seeded_rng():
    spans = random_swarm(random.Random(3), 200, 40)
    first = choose_forward_chain(spans, 0, 40, rng=random.Random(5))
    second = choose_forward_chain(list(reversed(spans)), 0, 40, rng=random.Random(5))
    assert first == second
    assert len({tuple(peers(choose_forward_chain(spans, 0, 40, rng=random.Random(s)))) for s in range(20)}) > 10


def test_a_chain_carries_each_servers_dtype_and_the_client_sends_in_it():
    """Hidden states go out in the server's serving dtype (`SpanStream.send`): a float32 client's bfloat16 server
    gets bfloat16 (half the bytes), a float32 one float32; ids and other integer tensors are left as they are."""
    from swarm.client.transport.span_stream import SpanStream
    from swarm.wire import protocol as P

    spans = [ServerSpan("a", 0, 15, ServerInfo(state=ServerState.ONLINE, start=0, end=15, dtype="bfloat16")),
             ServerSpan("b", 15, 30, ServerInfo(state=ServerState.ONLINE, start=15, end=30))]
    chain = find_inference_chain(spans, 0, 30)
    assert [(hop.peer_id, hop.dtype) for hop in chain] == [("a", "bfloat16"), ("b", "float32")]
    hidden = torch.randn(1, 3, 8)
    for hop, dtype in zip(chain, (torch.bfloat16, torch.float32)):
        manager = SimpleNamespace(config=SimpleNamespace(compression=None))  # what send reads of the manager
        stream = SpanStream(manager, hop, "session", 16, 1)  # type: ignore[arg-type]  (send only queues)
        stream.send(hidden, 0, 1)
        request = stream._queue.get_nowait()
        sent = P.deserialize_tensor(request.tensors[0], max_elements=1 << 20)  # type: ignore[union-attr]
        assert sent.dtype == dtype and torch.equal(sent, hidden.to(dtype))


def test_large_swarms_search_only_the_cheapest_servers_of_each_block(monkeypatch):
    import swarm.client.transport.routing as routing

    rng = random.Random(5)
    spans = []
    for index in range(600):  # ~100 servers on each of 24 blocks: more than MAX_SERVERS_PER_BLOCK
        start = rng.randrange(24)
        spans.append(make_span(f"s{index:03d}", start, min(24, start + rng.randint(2, 6)),
                               throughput=10 ** rng.uniform(0, 2), cache=rng.choice([0, 100_000])))
    rtts = {span.peer_id: rng.uniform(0.001, 0.05) for span in spans}
    pruned = find_inference_chain(spans, 0, 24, client_rtts=rtts, cache_tokens_needed=10)
    assert_valid_chain(pruned, spans, 0, 24)
    monkeypatch.setattr(routing, "MAX_SERVERS_PER_BLOCK", 10**9)
    full = find_inference_chain(spans, 0, 24, client_rtts=rtts, cache_tokens_needed=10)
    costs = [chain_cost(chain, spans, client_rtts=rtts, cache_tokens_needed=10) for chain in (pruned, full)]
    assert costs[1] <= costs[0] <= costs[1] * 1.05, costs  # the same chain here; at worst a near-optimal one
    assert all(span.info.cache_tokens_left >= 10 for span in spans if span.peer_id in peers(pruned))
    # a swarm within the limit is searched whole: the same chain either way
    small = spans[:60]
    monkeypatch.setattr(routing, "MAX_SERVERS_PER_BLOCK", 64)
    ours = find_inference_chain(small, 0, 24, client_rtts=rtts)
    monkeypatch.setattr(routing, "MAX_SERVERS_PER_BLOCK", 10**9)
    assert find_inference_chain(small, 0, 24, client_rtts=rtts) == ours
