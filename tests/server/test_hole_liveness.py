"""The hole watch's pings of sole holders (`server.placement.liveness`) on synthetic records, with a scripted ping (no
network); on real processes: the SIGKILL case of tests/e2e/test_gap_fill.py."""
from __future__ import annotations

import asyncio

from server.placement import liveness
from server.placement.liveness import HolderLiveness, sole_holders
from server.placement.pings import UNREACHABLE
from swarm.wire.records import ServerState
from tests.fixtures.synthetic_swarm import span


def test_sole_holders_are_the_servers_a_hole_would_follow():
    spans = [span("a", 0, 10), span("b", 0, 20), span("c", 20, 30), span("d", 25, 30),
             span("e", 10, 20, state=ServerState.JOINING), span("me", 10, 15)]
    # 10..15: b and me; 15..20: b alone; 20..25: c alone; 25..30: c and d; e is not online
    assert sole_holders(spans, 30, "me") == ["b", "c"]
    assert sole_holders(spans, 30, "b") == ["c"]  # one's own blocks are not probed


def test_a_silent_sole_holder_is_dropped_until_it_answers(monkeypatch):
    answers = {"b": True, "c": False}
    sent = []

    async def ping(p2p, peer_id, timeout=2.0, proof=""):
        sent.append(peer_id)
        return 0.01 if answers[peer_id] else UNREACHABLE

    monkeypatch.setattr(liveness, "ping", ping)
    spans = [span("a", 0, 10), span("b", 10, 20), span("c", 20, 30)]
    watch = HolderLiveness(most=2, retry_pause=0.0)
    dead = asyncio.run(watch.probe(object(), spans, 30, "a"))
    assert dead == {"c"} and sent == ["b", "c", "c"]  # "c" failed twice in a row
    assert [s.peer_id for s in watch.without_dead(spans)] == ["a", "b"]
    answers["c"] = True
    assert asyncio.run(watch.probe(object(), spans, 30, "a")) == set()
    # no p2p yet (or no sole holder): nothing is pinged, nothing judged
    sent.clear()
    assert asyncio.run(watch.probe(None, spans, 30, "a")) == set() and sent == []
    # more sole holders than `most`: they take turns
    many = [span(f"p{i}", i * 3, i * 3 + 3) for i in range(10)]
    answers.update({f"p{i}": True for i in range(10)})
    watch, sent[:] = HolderLiveness(most=2, retry_pause=0.0), []
    for _ in range(5):
        asyncio.run(watch.probe(object(), many, 30, "p0"))
    assert sent == [f"p{i}" for i in range(1, 10)] + ["p1"]
