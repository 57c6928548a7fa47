"""A block's only servers are retried after a short back-off when they are relayed and could not be reached
(`SwarmManager.ban`, `sole_retry_wait`), on a fixed swarm view (no network); the end-to-end case, a relayed server
whose relay restarted, is in tests/e2e/test_nat.py."""
from __future__ import annotations

import asyncio
import math
import time

import pytest

from swarm.client.transport.manager import unreachable
from swarm.client.transport.routing import RouteHop, RoutingError
from swarm.wire import protocol as P
from swarm.wire.records import ServerInfo, ServerSpan, ServerState
from tests.fixtures.synthetic_swarm import fake_manager, span


def relayed(peer: str, start: int, end: int, throughput: float = 1.0) -> ServerSpan:
    info = ServerInfo(state=ServerState.ONLINE, start=start, end=end, throughput=throughput,
                      cache_tokens_left=100_000, reachable="relayed")
    return ServerSpan(peer, start, end, info)


def due_now(manager, peer: str) -> None:
    """Let `peer`'s short back-off run out (as if its time had passed)."""
    until, failures, _ = manager._bans[peer]
    manager._bans[peer] = (until, failures, time.monotonic() - 0.01)


def test_an_unreachable_sole_server_is_retried_after_a_short_back_off():
    manager = fake_manager([span("a", 0, 15), relayed("b", 15, 30), relayed("c", 15, 30, throughput=0.5)], None)
    manager.ban("b", ConnectionError("all dials failed"))
    assert manager.sole_retry_wait(15, 30) is None  # "c" still serves 15:30: "b" stays banned
    assert manager.make_inference_chain(15, 30) == [RouteHop("c", 15, 30)]
    manager.ban("c", asyncio.TimeoutError())
    wait = manager.sole_retry_wait(15, 30)
    assert wait is not None and 0 < wait <= 1.0  # the first back-off: 1 s
    with pytest.raises(RoutingError):
        manager.make_inference_chain(15, 30)
    due_now(manager, "c")
    assert manager.make_inference_chain(15, 30) == [RouteHop("c", 15, 30)]  # "b"'s turn has not come yet
    assert manager.make_inference_chain(0, 15) == [RouteHop("a", 0, 15)]  # blocks others serve: unchanged
    assert "c" in manager.banned()  # still banned: routing prefers anyone else once there is someone
    # the back-off doubles with each failure, up to ban_timeout (the ban itself keeps doubling)
    for failures in range(2, 8):
        due_now(manager, "c")  # retried after its back-off, and failed again
        manager.ban("c", ConnectionError())
        until, count, retry_at = manager._bans["c"]
        assert count == failures
        assert retry_at - time.monotonic() == pytest.approx(min(2.0 ** (failures - 1), 15.0), abs=0.5)


def test_refusals_and_direct_servers_are_not_retried_and_silent_pings_do_not_rule_a_sole_server_out():
    manager = fake_manager([relayed("a", 0, 30)], None)
    manager.ban("a", P.RemoteError("out_of_cache", "no room"))  # it answered: no reason to hammer it
    assert manager.sole_retry_wait() is None
    with pytest.raises(RoutingError):
        manager.make_inference_chain()
    direct = fake_manager([span("d", 0, 30)], None)
    direct.ban("d", ConnectionError())  # a direct server nobody can reach is most likely gone: fail fast
    assert direct.sole_retry_wait() is None
    manager.mark_ok("a")
    manager.rtts = {"a": math.inf}  # its last ping went unanswered, but nothing else serves the blocks
    assert manager.make_inference_chain() == [RouteHop("a", 0, 30)]


def test_which_errors_mean_unreachable():
    assert unreachable(ConnectionError()) and unreachable(asyncio.TimeoutError()) and unreachable(OSError())
    assert unreachable(P.RemoteError("unreachable", "no answer to a ping"))
    assert not unreachable(P.RemoteError("out_of_cache", "no room")) and not unreachable(None)
    assert not unreachable(P.ProtocolError("bad reply"))


def test_failures_of_one_incident_ban_once():
    """Sessions whose steps were in flight on a server when it failed (a round's rows fail together) report it
    one after another: the ban is not doubled for each; a failure of a later try counts again."""
    manager = fake_manager([span("a", 0, 30), span("b", 0, 30)], None)
    durations = [manager.ban("a", ConnectionError()) for _ in range(4)]
    assert durations[0] == pytest.approx(15.0) and all(d <= 15.0 for d in durations)
    assert manager._bans["a"][1] == 1
    until, failures, retry_at = manager._bans["a"]
    manager._bans["a"] = (time.monotonic() - 0.01, failures, retry_at)  # the ban ran out; the next try fails
    assert manager.ban("a", ConnectionError()) == pytest.approx(30.0) and manager._bans["a"][1] == 2
