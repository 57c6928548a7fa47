"""Tests for server.placement.policy on synthetic swarms (no network)."""
from __future__ import annotations

import asyncio
import random
import time
from types import SimpleNamespace
from typing import Callable, Dict, List, Optional, Tuple

import pytest

from server.placement.liveness import HolderLiveness
from server.placement.policy import (
    block_throughputs,
    choose_best_span,
    hole_fill_turn,
    move_target,
    num_blocks_that_fit,
    should_move,
    thin_blocks,
    uncovered_blocks,
)
from server.placement.spans import check_holes, full_read_due, hole_fill_delay
from swarm.wire.records import ServerInfo, ServerSpan, ServerState


def make_span(
    peer: str, start: int, end: int, *, throughput: float = 1.0, state: ServerState = ServerState.ONLINE
) -> ServerSpan:
    info = ServerInfo(state=state, start=start, end=end, throughput=throughput)
    return ServerSpan(peer, start, end, info)


def moved(span: ServerSpan, start: int, end: int) -> ServerSpan:
    return ServerSpan(span.peer_id, start, end, span.info.model_copy(update={"start": start, "end": end}))


def test_block_throughputs_sums_joining_and_online_only():
    spans = [
        make_span("a", 0, 4, throughput=2.0),
        make_span("b", 2, 6, throughput=0.5, state=ServerState.JOINING),
        make_span("c", 0, 6, throughput=100.0, state=ServerState.OFFLINE),
        make_span("d", 5, 9, throughput=1.0),  # runs past the model's end: clipped
    ]
    assert block_throughputs(spans, 6) == [2.0, 2.0, 2.5, 2.5, 0.5, 1.5]
    assert block_throughputs(spans, 6, exclude_peer="a") == [0.0, 0.0, 0.5, 0.5, 0.5, 1.5]
    assert block_throughputs([], 3) == [0.0, 0.0, 0.0]


def test_choose_best_span_picks_least_served_window():
    assert choose_best_span([3, 3, 0, 0, 0, 3], 3) == (2, 5)
    assert choose_best_span([3, 3, 0, 0, 0, 3], 2) == (2, 4)  # (2,4) and (3,5) tie: lowest start
    assert choose_best_span([5, 1, 1, 1, 5], 1) == (1, 2)
    # equal sums: the window containing the weakest block wins, then the lowest start
    assert choose_best_span([1, 1, 2, 0, 2], 2) == (2, 4)
    assert choose_best_span([0.1 + 0.2, 0.3, 0.2, 0.1], 2) == (2, 4)
    # more blocks than the model has: the whole model
    assert choose_best_span([1, 2, 3], 10) == (0, 3)
    with pytest.raises(ValueError):
        choose_best_span([1, 2, 3], 0)


def test_sequential_joins_fill_the_least_served_blocks():
    spans: List[ServerSpan] = []
    for index in range(10):
        start, end = choose_best_span(block_throughputs(spans, 20), 4)
        spans.append(make_span(f"s{index}", start, end))
        if index == 4:  # five servers of 4 blocks tile the 20 blocks exactly
            assert block_throughputs(spans, 20) == [1.0] * 20
    assert block_throughputs(spans, 20) == [2.0] * 20


def test_joiner_goes_to_a_gap():
    spans = [make_span("a", 0, 10), make_span("b", 14, 20), make_span("c", 0, 20, throughput=0.5)]
    assert choose_best_span(block_throughputs(spans, 20), 4) == (10, 14)


def _threshold_swarm(weak: float) -> List[ServerSpan]:
    # blocks 0-1 are served by "other" (1.0) and "me" (1.0); blocks 2-3 by "weak" only
    return [make_span("other", 0, 2), make_span("me", 0, 2), make_span("weak", 2, 4, throughput=weak)]


def test_should_move_only_past_the_threshold():
    # moving "me" to 2:4 changes the weakest block from 0.9 to 1.0: a 1.11x gain, under 1/0.75
    assert should_move(_threshold_swarm(0.9), 4, "me") == (False, None)
    # from 0.5 to 1.0: a 2x gain
    assert should_move(_threshold_swarm(0.5), 4, "me") == (True, (2, 4))
    # a stricter quality requirement makes even the small gain worth it
    assert should_move(_threshold_swarm(0.9), 4, "me", balance_quality=0.95) == (True, (2, 4))
    # exactly at the factor: new_min * q == old_min is not enough
    assert should_move(_threshold_swarm(0.75), 4, "me") == (False, None)
    assert should_move(_threshold_swarm(0.74), 4, "me") == (True, (2, 4))


def test_should_move_stays_when_already_best_or_unknown():
    spans = [make_span("a", 0, 2), make_span("b", 2, 4)]
    assert should_move(spans, 4, "a") == (False, None)
    assert should_move(spans, 4, "b") == (False, None)
    assert should_move(spans, 4, "stranger") == (False, None)


def test_should_move_fills_holes_without_herding():
    # a and b both serve 0:2, blocks 2:6 are served by nobody
    spans = {p: make_span(p, 0, 2) for p in ("a", "b", "c")}
    decisions = []
    for _ in range(3):  # evaluate one after another, each seeing the others' moves
        for peer in ("a", "b", "c"):
            move, target = should_move(list(spans.values()), 6, peer)
            if move:
                assert target is not None
                spans[peer] = moved(spans[peer], *target)
                decisions.append((peer, target))
    assert decisions == [("a", (2, 4)), ("b", (4, 6))]  # one hole each, then c stays
    assert min(block_throughputs(list(spans.values()), 6)) == 1.0


def test_static_swarm_never_cycles():
    rng = random.Random(11)
    spans = {
        f"s{i}": make_span(f"s{i}", 0, rng.randint(3, 8), throughput=rng.uniform(0.5, 3)) for i in range(12)
    }
    moves = 0
    for _ in range(30):
        for peer in rng.sample(sorted(spans), len(spans)):
            move, target = should_move(list(spans.values()), 24, peer)
            if move:
                assert target is not None
                spans[peer] = moved(spans[peer], *target)
                moves += 1
    assert moves > 0
    assert all(should_move(list(spans.values()), 24, peer) == (False, None) for peer in spans)
    assert min(block_throughputs(list(spans.values()), 24)) > 0


def test_num_blocks_that_fit():
    assert num_blocks_that_fit(1000, 90, 10, 50) == 9  # 900 usable / 100 per block
    assert num_blocks_that_fit(1000, 90, 10, 50, reserve_fraction=0.0) == 10
    assert num_blocks_that_fit(1000, 90, 10, 5) == 5  # never more than the model has
    assert num_blocks_that_fit(105, 90, 10, 50) == 1  # one block fits if the reserve is given up
    assert num_blocks_that_fit(99, 90, 10, 50) == 0
    assert num_blocks_that_fit(0, 90, 10, 50) == 0
    assert num_blocks_that_fit(10**12, 2 * 10**8, 5 * 10**7, 80) == 80
    assert num_blocks_that_fit(16 * 2**30, 2**30, 2**28, 80) == 11  # 14.4 GiB / 1.25 GiB
    with pytest.raises(ValueError):
        num_blocks_that_fit(1000, 0, 10, 50)
    with pytest.raises(ValueError):
        num_blocks_that_fit(1000, 90, 10, 50, reserve_fraction=1.0)


Decide = Callable[[List[ServerSpan], int, str], Tuple[bool, Optional[Tuple[int, int]]]]
Move = Tuple[int, Tuple[int, int], Tuple[int, int]]  # (round, from, to)


def _simulate_churn(decide: Decide, seed: int, *, num_blocks: int = 80, num_servers: int = 50, rounds: int = 100,
                    churn_rounds: int = 70) -> Tuple[List[int], Dict[str, List[Move]], List[ServerSpan]]:
    """Servers join at the least-served window and leave at random for `churn_rounds` rounds (the swarm size
    drifting around `num_servers`), then the swarm is left alone; every round each server, in random order,
    asks `decide` and moves if told to. Returns (moves per round, moves per server, final spans)."""
    rng = random.Random(seed)
    counter = 0

    def join(spans: Dict[str, ServerSpan]) -> None:
        nonlocal counter
        counter += 1
        length = rng.randint(3, 8)
        start, end = choose_best_span(block_throughputs(list(spans.values()), num_blocks), length)
        spans[f"s{counter}"] = make_span(f"s{counter}", start, end, throughput=rng.lognormvariate(0, 0.8))

    spans: Dict[str, ServerSpan] = {}
    for _ in range(num_servers):
        join(spans)
    history: Dict[str, List[Move]] = {}
    moves_per_round = [0] * rounds
    for round_index in range(rounds):
        if round_index < churn_rounds:  # independent leaves and joins
            for _ in range(rng.randint(0, 4) if len(spans) > num_servers * 0.7 else 0):
                del spans[rng.choice(sorted(spans))]
            for _ in range(rng.randint(0, 4) if len(spans) < num_servers * 1.3 else 0):
                join(spans)
        for peer in rng.sample(sorted(spans), len(spans)):
            move, target = decide(list(spans.values()), num_blocks, peer)
            if not move:
                continue
            assert target is not None
            old = (spans[peer].start, spans[peer].end)
            assert target != old
            spans[peer] = moved(spans[peer], *target)
            history.setdefault(peer, []).append((round_index, old, target))
            moves_per_round[round_index] += 1
    return moves_per_round, history, list(spans.values())


def _ping_pongs(history: Dict[str, List[Move]], window: int) -> List[str]:
    """Servers that moved A -> B and then B -> A within `window` rounds."""
    found = []
    for peer, peer_moves in history.items():
        for (r1, src, dst), (r2, src2, dst2) in zip(peer_moves, peer_moves[1:]):
            if src2 == dst and dst2 == src and r2 - r1 <= window:
                found.append(peer)
    return found


def _always_move_to_best(spans: List[ServerSpan], num_blocks: int, peer: str):
    """A naive policy (no threshold) that the ping-pong check must catch."""
    me = next(span for span in spans if span.peer_id == peer)
    target = choose_best_span(block_throughputs(spans, num_blocks, exclude_peer=peer), me.length)
    return (target != (me.start, me.end)), target


def test_churn_simulation_settles_without_ping_pong():
    churn_rounds = 70
    moves_per_round, history, final = _simulate_churn(should_move, seed=2024, churn_rounds=churn_rounds)
    assert sum(moves_per_round) >= 5  # churn did unbalance the swarm and servers moved
    assert _ping_pongs(history, window=10) == []
    assert max(len(peer_moves) for peer_moves in history.values()) <= 3
    # once churn stops the swarm settles at once and stays put
    assert sum(moves_per_round[churn_rounds : churn_rounds + 3]) <= 3
    assert sum(moves_per_round[churn_rounds + 3 :]) == 0
    assert all(should_move(final, 80, span.peer_id) == (False, None) for span in final)
    assert min(block_throughputs(final, 80)) > 0


def test_churn_simulation_catches_a_naive_policy():
    # the same simulation with "always move to the best window" ping-pongs and moves far more often
    naive_moves, naive_history, _ = _simulate_churn(_always_move_to_best, seed=2024)
    moves, _, _ = _simulate_churn(should_move, seed=2024)
    assert len(_ping_pongs(naive_history, window=10)) >= 10
    assert sum(naive_moves) > 10 * sum(moves)


def test_after_a_crash_exactly_one_of_two_twins_moves():
    # three servers of 15 blocks: two share 0:15, one holds 15:30 and dies
    spans = {"a": make_span("a", 0, 15), "b": make_span("b", 0, 15)}
    # (how they got there: with a on 0:15 and c on 15:30, a third server's windows all tie: lowest start wins)
    assert choose_best_span(block_throughputs([spans["a"], make_span("c", 15, 30)], 30), 15) == (0, 15)
    first, second = ("a", "b") if random.Random(3).random() < 0.5 else ("b", "a")
    move, target = should_move(list(spans.values()), 30, first)
    assert (move, target) == (True, (15, 30))
    # the mover announces its new span (joining counts) before the other one looks again: the other stays
    spans[first] = moved(spans[first], *target)
    spans[first] = ServerSpan(first, 15, 30, spans[first].info.model_copy(update={"state": ServerState.JOINING}))
    assert should_move(list(spans.values()), 30, second) == (False, None)
    assert should_move(list(spans.values()), 30, first) == (False, None)


def _random_swarm(rng: random.Random, num_servers: int, num_blocks: int) -> List[ServerSpan]:
    spans = []
    for index in range(num_servers):
        start = rng.randrange(num_blocks)
        end = min(num_blocks, start + rng.randint(1, 12))
        state = rng.choice([ServerState.ONLINE, ServerState.ONLINE, ServerState.JOINING])
        spans.append(make_span(f"p{index}", start, end, throughput=10 ** rng.uniform(0, 2), state=state))
    return spans


def test_move_target_on_totals_decides_as_should_move():
    rng = random.Random(7)
    for _ in range(200):
        spans = _random_swarm(rng, rng.randint(1, 12), 30)
        me = rng.choice(spans)
        without_me = block_throughputs(spans, 30, exclude_peer=me.peer_id)
        target = move_target(without_me, (me.start, me.end), me.info.throughput)
        assert should_move(spans, 30, me.peer_id) == ((True, target) if target else (False, None))
    with pytest.raises(ValueError):
        move_target([1.0], (0, 1), 1.0, balance_quality=0)


def test_uncovered_blocks_and_turns_to_fill_a_hole():
    assert uncovered_blocks([1.0, 0.0, 0.0, 2.0, 0.0]) == [1, 2, 4]
    assert uncovered_blocks([1.0, 3.0]) == []
    # 12 blocks; 0:6 served by six servers, 6:12 by nobody: each of the six could fill it
    spans = [make_span(f"p{i}", 0, 6) for i in range(6)] + [make_span("pinned", 0, 6, state=ServerState.JOINING)]
    turns = [hole_fill_turn(spans, 12, f"p{i}") for i in range(6)]
    assert len(set(turns)) == 6 and set(turns) <= set(range(7))  # one order (the joining 7th counts too), no ties
    assert turns == [hole_fill_turn(list(reversed(spans)), 12, f"p{i}") for i in range(6)]  # any listing order
    # another hole, another order; a server that would not cover it, or an unknown one, has no turn
    other = [make_span(f"p{i}", 6, 12) for i in range(6)] + [make_span("pinned", 6, 12)]
    assert [hole_fill_turn(other, 12, f"p{i}") for i in range(6)] != turns
    assert hole_fill_turn(spans + [make_span("far", 0, 12, throughput=0.1)], 12, "p0") is None  # no hole
    assert hole_fill_turn(spans, 12, "stranger") is None
    lone = [make_span("a", 0, 6), make_span("b", 6, 9)]  # each the only server of its blocks: moving opens a hole
    assert hole_fill_turn(lone, 12, "a") is None and hole_fill_turn(lone, 12, "b") is None
    assert hole_fill_turn(spans, 12, "p0", most=2) <= 2


def _fill_a_hole(scheme: str, seed: int, *, period: float = 5.0, dht_delay: float = 1.0) -> int:
    """40 servers of 10 blocks on 40 blocks, four on each window of a tiling; one window's four servers leave.
    Every other server sees the hole at its next hole check (a random moment within 1.5 hole-check periods)
    and schedules a try: at its turn (`hole_fill_turn`, `hole_fill_delay`) or after a uniform delay of up to 2 s
    (`naive`, the balance check's); a try looks at the records as they were `dht_delay` s earlier (a store takes
    that long to be seen) and moves if `should_move` still says so. Returns how many servers moved on a view that
    still showed the hole (after the first one, such a move is a herd's: later moves on a view without it are
    ordinary rebalancing)."""
    rng = random.Random(seed)
    spans = {f"s{i}": make_span(f"s{i}", 10 * (i % 4), 10 * (i % 4) + 10, throughput=rng.uniform(1, 2))
             for i in range(40)}
    for peer in [p for p, span in spans.items() if span.start == 20]:
        del spans[peer]
    history = [(-1.0, dict(spans))]  # (time, the records from then on)
    tries = []
    for peer in spans:
        seen = rng.uniform(0, 1.5 * period)
        if scheme == "turns":
            turn = hole_fill_turn(list(spans.values()), 40, peer)
            assert turn is not None
            tries.append((seen + hole_fill_delay(turn, period, len(spans), rng), peer))
        else:
            tries.append((seen + rng.uniform(0, 2), peer))
    moved = 0
    for when, peer in sorted(tries):
        view = [records for at, records in history if at <= when - dht_delay][-1]
        move, target = should_move(list(view.values()), 40, peer)
        if move and target is not None:
            moved += bool(uncovered_blocks(block_throughputs(list(view.values()), 40)))
            spans[peer] = ServerSpan(peer, *target, spans[peer].info.model_copy(
                update={"start": target[0], "end": target[1], "state": ServerState.JOINING}))
            history.append((when, dict(spans)))
    assert not uncovered_blocks(block_throughputs(list(spans.values()), 40))
    return moved


def test_servers_taking_turns_fill_a_hole_once_where_random_delays_herd():
    turns = [_fill_a_hole("turns", seed) for seed in range(20)]
    naive = [_fill_a_hole("naive", seed) for seed in range(20)]
    assert turns == [1] * 20, turns
    assert min(naive) >= 2 and sum(naive) >= 3 * sum(turns), naive


def test_thin_blocks_are_those_few_servers_hold():
    spans = [make_span("a", 0, 4), make_span("b", 0, 4), make_span("c", 2, 6),
             make_span("d", 4, 8, state=ServerState.JOINING), make_span("gone", 0, 8, state=ServerState.OFFLINE)]
    assert thin_blocks(spans, 8) == [0, 1, 4, 5, 6, 7]  # 2, 2, 3, 3, 2, 2, 1, 1 servers; offline ones do not count
    assert thin_blocks(spans, 8, most=1) == [6, 7]
    assert thin_blocks(spans + [make_span("a", 0, 4)], 8) == [0, 1, 4, 5, 6, 7]  # a server listed twice counts once
    assert thin_blocks([], 3) == [0, 1, 2]


class _Record:
    """The records a hole check reads: `spans` (all blocks) and `unserved` (a few blocks), counted."""

    def __init__(self, spans, seen_ago: float):
        self.now_spans, self.full_reads, self.partial_reads = list(spans), 0, []
        self.view = (time.monotonic() - seen_ago, list(spans))

    async def spans(self):
        self.full_reads += 1
        self.view = (time.monotonic(), list(self.now_spans))
        return list(self.now_spans)

    async def unserved(self, blocks):
        self.partial_reads.append(list(blocks))
        covered = set(b for s in self.now_spans for b in range(s.start, s.end) if s.info.state == ServerState.ONLINE)
        return [b for b in blocks if b not in covered]


def _host(record, peer="p0"):
    # (no p2p: the hole watch's pings of sole holders judge nobody, `server.placement.liveness`)
    return SimpleNamespace(record=record, num_blocks_total=12, peer_id=peer, rng=random.Random(0),
                           config=SimpleNamespace(hole_check_period=5.0, balance_quality=0.75),
                           liveness=HolderLiveness(), p2p=None)


def test_hole_checks_between_full_reads_read_only_the_thin_blocks():
    # 20 servers: 0:6 served by ten, 6:12 by nine plus one that alone serves 11
    spans = [make_span(f"p{i}", 0, 6) for i in range(10)] + [make_span(f"q{i}", 6, 11) for i in range(9)]
    spans.append(make_span("lone", 11, 12))
    assert full_read_due(0.0, 5.0, 8) and not full_read_due(12.0, 5.0, 20) and full_read_due(12.5, 5.0, 20)
    record = _Record(spans, seen_ago=1.0)
    assert asyncio.run(check_holes(_host(record))) == (None, 20)
    assert (record.full_reads, record.partial_reads) == (0, [[11]])  # one key read, not twelve
    record.now_spans = spans[:-1]  # the lone server of block 11 left: the next check reads everything
    delay, servers = asyncio.run(check_holes(_host(record)))
    assert record.full_reads == 1 and servers == 19
    assert (delay is None) == (hole_fill_turn(spans[:-1], 12, "p0") is None)
    record = _Record(spans, seen_ago=13.0)  # the last full read is due again
    asyncio.run(check_holes(_host(record)))
    assert (record.full_reads, record.partial_reads) == (1, [])
    small = _Record(spans[:6] + spans[10:12], seen_ago=0.0)  # up to 8 servers: every check reads everything
    asyncio.run(check_holes(_host(small)))
    assert (small.full_reads, small.partial_reads) == (1, [])
