"""The client's liveness check of a late step, without processes: a stand-in manager whose info call answers or
hangs, and a reply stream that answers late or never (`tests/test_multihost.py` cuts a real link)."""
from __future__ import annotations

import asyncio
import time

import pytest

from swarm.client.manager import ClientConfig
from swarm.client.routing import RouteHop
from swarm.client.session import SpanStream
from swarm.wire import protocol as P

PEER = "12D3KooWQcDwdERqzANxK8BBxoXHhs5q31JtseSoksHmMw3bHuap"


class Manager:
    def __init__(self, config: ClientConfig, ping_answers: bool):
        self.config, self.ping_answers, self.pings = config, ping_answers, 0

    async def info(self, peer_id: str):
        self.pings += 1
        if not self.ping_answers:
            await asyncio.sleep(3600)  # a silent host: no answer, no error


async def _replies(delay: float):
    await asyncio.sleep(delay)
    yield P.make_response(P.StepResult(position=1), [])


def _wait(reply_after: float, ping_answers: bool, **config):
    async def run():
        manager = Manager(ClientConfig(initial_peers=["x"], **config), ping_answers)
        hop = RouteHop(peer_id=PEER, start=0, end=30)
        stream = SpanStream(manager, hop, "s", max_length=8, batch_size=1)  # type: ignore[arg-type]
        stream._responses = _replies(reply_after)
        began = time.monotonic()
        try:
            reply, _ = await stream._next_reply()
            return reply, time.monotonic() - began, manager.pings
        except Exception as e:
            return e, time.monotonic() - began, manager.pings

    return asyncio.run(run())


def test_a_silent_server_is_unreachable_after_interval_plus_ping_timeout():
    error, waited, pings = _wait(3600, ping_answers=False, liveness_interval=0.2, liveness_timeout=0.3,
                                 step_timeout=60)
    assert isinstance(error, P.RemoteError) and error.code == "unreachable" and pings == 1
    assert waited < 30  # far below the step time-out


def test_a_slow_step_of_a_live_server_is_waited_for():
    reply, waited, pings = _wait(1.0, ping_answers=True, liveness_interval=0.2, liveness_timeout=0.3,
                                 step_timeout=60)
    assert isinstance(reply, P.StepResult) and reply.position == 1 and pings >= 2


def test_without_liveness_pings_the_step_time_out_applies():
    error, waited, pings = _wait(3600, ping_answers=False, liveness_interval=None, step_timeout=0.5)
    assert isinstance(error, asyncio.TimeoutError) and pings == 0 and waited >= 0.5


@pytest.mark.parametrize("value", [0, -1])
def test_liveness_settings_are_validated(value):
    with pytest.raises(ValueError):
        ClientConfig(liveness_interval=value)
