"""`server.network.relay_limits` in process: the decision (restart while the limit read is not ours, at most
`max_restarts` times; a failed reading restarts nothing), the circuit v2 STATUS answer read into a limit, and where
the probe dials. The real reading and restarts, on real p2pd: tests/server/test_relay_limits.py."""
from __future__ import annotations

import asyncio
import logging
from typing import List

import pytest

from server.network.relay_limits import (
    LIBP2P_DEFAULT,
    RESERVE,
    STATUS,
    STATUS_OK,
    HopMessage,
    RelayLimit,
    RelayRefused,
    ensure_our_limits,
    limit_of,
    local_maddrs,
    our_limit,
    should_check,
)
from swarm.runtime.relays import RelaySettings

OURS = our_limit(RelaySettings(relay_data_limit=1 << 30))


class Relay:
    """A peer whose successive starts serve with `limits` (one per start; an exception: that reading fails)."""

    def __init__(self, limits: List[object]):
        self.limits, self.start, self.restarts = limits, 0, 0

    async def read(self) -> RelayLimit:
        seen = self.limits[min(self.start, len(self.limits) - 1)]
        if isinstance(seen, Exception):
            raise seen
        assert isinstance(seen, RelayLimit)
        return seen

    async def restart(self) -> None:
        self.start += 1
        self.restarts += 1


def ensure(relay: Relay, max_restarts: int = 5):
    return asyncio.run(ensure_our_limits(relay.read, relay.restart, OURS, max_restarts))


def test_our_limit_is_the_data_and_time_limits():
    assert OURS == RelayLimit(duration=24 * 3600, data=1 << 30) and OURS != LIBP2P_DEFAULT
    assert our_limit(RelaySettings(relay_time_limit=600)).duration == 600
    # the same data limit as libp2p's defaults is still told apart, by the duration
    assert our_limit(RelaySettings(relay_data_limit=128 << 10)) != LIBP2P_DEFAULT


def test_ours_at_once_restarts_nothing():
    relay = Relay([OURS])
    assert ensure(relay) == OURS and relay.restarts == 0


def test_the_defaults_restart_until_ours_serves(caplog):
    relay = Relay([LIBP2P_DEFAULT, LIBP2P_DEFAULT, OURS])
    with caplog.at_level(logging.INFO, "swarmgate.relay"):
        assert ensure(relay) == OURS
    assert relay.restarts == 2
    assert "after 2 restart(s)" in caplog.text and "WARNING" not in caplog.text


def test_restarts_are_bounded_and_end_with_a_warning(caplog):
    relay = Relay([LIBP2P_DEFAULT])
    with caplog.at_level(logging.INFO, "swarmgate.relay"):
        assert ensure(relay, max_restarts=3) == LIBP2P_DEFAULT
    assert relay.restarts == 3
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "libp2p's defaults" in warnings[0] and "cut at that limit" in warnings[0]


def test_another_limit_not_ours_restarts_too():
    relay = Relay([RelayLimit(duration=60, data=1 << 30), OURS])
    assert ensure(relay) == OURS and relay.restarts == 1


def test_a_failed_reading_restarts_nothing_and_warns(caplog):
    relay = Relay([RelayRefused("answered type 2 status 200 to RESERVE")])
    with caplog.at_level(logging.WARNING, "swarmgate.relay"):
        assert ensure(relay) is None
    assert relay.restarts == 0 and "could not read" in caplog.text
    relay = Relay([LIBP2P_DEFAULT, asyncio.TimeoutError()])  # after a restart: stop there too
    assert ensure(relay) is None and relay.restarts == 1


def test_a_status_answer_gives_its_limit_and_a_refusal_raises():
    answer = HopMessage.FromString(HopMessage(type=STATUS, status=STATUS_OK,
                                              limit={"duration": 120, "data": 131072}).SerializeToString())
    assert limit_of(answer) == LIBP2P_DEFAULT
    assert limit_of(HopMessage(type=STATUS, status=STATUS_OK)) == RelayLimit(duration=0, data=0)  # unlimited
    with pytest.raises(RelayRefused):
        limit_of(HopMessage(type=STATUS, status=200))  # RESERVATION_REFUSED
    with pytest.raises(RelayRefused):
        limit_of(HopMessage(type=RESERVE))
    # a RESERVE is what libp2p's circuit.proto writes: field 1 (type) = 0
    assert HopMessage(type=RESERVE).SerializeToString() == b"\x08\x00"


def test_the_probe_dials_visible_addresses_then_fixed_wildcard_ports_on_loopback():
    visible = ["/ip4/203.0.113.7/tcp/31337/p2p/QmPeer", "/ip4/127.0.0.1/tcp/31337/p2p/QmPeer"]
    assert local_maddrs(visible, ["/ip4/0.0.0.0/tcp/31337", "/ip6/::/tcp/31338", "/ip4/0.0.0.0/tcp/0"]) == [
        "/ip4/203.0.113.7/tcp/31337", "/ip4/127.0.0.1/tcp/31337", "/ip6/::1/tcp/31338"]


def test_the_check_runs_where_a_peer_reaches_beyond_loopback_unless_told():
    auto = RelaySettings()
    assert not should_check(auto, ["/ip4/127.0.0.1/tcp/0", "/ip6/::1/tcp/5"])  # only its own host reaches it
    assert should_check(auto, ["/ip4/127.0.0.1/tcp/0", "/ip4/10.0.0.2/tcp/31337"])
    assert should_check(auto, ["/ip4/0.0.0.0/tcp/0"]) and should_check(auto, [])  # every interface
    assert should_check(auto, ["/dns4/relay.example.org/tcp/31337"])
    assert not should_check(auto, ["/dns/localhost/tcp/1"])
    assert should_check(RelaySettings(relay_limits_check="on"), ["/ip4/127.0.0.1/tcp/0"])
    assert not should_check(RelaySettings(relay_limits_check="off"), ["/ip4/10.0.0.2/tcp/1"])
    assert not should_check(RelaySettings(no_relay=True, relay_limits_check="on"), ["/ip4/10.0.0.2/tcp/1"])


def test_a_stop_signal_ends_the_restarts():
    relay = Relay([LIBP2P_DEFAULT] * 10)
    stop_after = iter([False, True])  # the signal comes during the first restart
    seen = asyncio.run(ensure_our_limits(relay.read, relay.restart, OURS, 5, stopping=lambda: next(stop_after)))
    assert seen is None and relay.restarts == 1
