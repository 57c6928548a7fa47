"""The client's liveness check of a late step (`swarm.client.transport.liveness`), on a session's own stream and on a
round stream: first without processes (a stand-in manager whose info call answers or hangs, a reply stream that
answers late, never, or ends), then on real processes, a server frozen mid-generation (`tests/e2e/test_multihost.py`
cuts a real link between network namespaces; `tests/gateway/test_engine_round.py` freezes and kills servers under
the gateway's engine rounds)."""
from __future__ import annotations

import asyncio
import time

import pytest
import torch

from swarm.client.transport.manager import ClientConfig
from swarm.client.transport.round_stream import RoundStream
from swarm.client.transport.routing import RouteHop
from swarm.client.transport.span_stream import SpanStream
from swarm.wire import protocol as P

PEER = "12D3KooWQcDwdERqzANxK8BBxoXHhs5q31JtseSoksHmMw3bHuap"


class Manager:
    def __init__(self, config: ClientConfig, ping_answers: bool):
        self.config, self.ping_answers, self.pings = config, ping_answers, 0
        self.liveness_failures = 0

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


async def _silent():
    await asyncio.sleep(3600)
    yield  # pragma: no cover


async def _ended():
    return
    yield  # pragma: no cover


def _round(responses, ping_answers: bool, **config):
    """One round message of two session parts on a stand-in server whose replies come from `responses`: (the
    outcome or error, pings, liveness failures counted, whether the round stream closed)."""
    async def run():
        manager = Manager(ClientConfig(initial_peers=["x"], **config), ping_answers)
        hop = RouteHop(peer_id=PEER, start=0, end=30)
        parts = [SpanStream(manager, hop, f"s{i}", max_length=8, batch_size=1)  # type: ignore[arg-type]
                 for i in range(2)]
        stream = RoundStream(manager, PEER)  # type: ignore[arg-type]
        stream._responses = responses
        try:
            outcome = await stream.step([(part, torch.zeros(1, 1, 8), 0, 1) for part in parts])
        except Exception as e:  # noqa: BLE001
            outcome = e
        return outcome, manager.pings, manager.liveness_failures, stream.closed

    return asyncio.run(run())


def test_a_round_on_a_silent_server_fails_as_unreachable_after_interval_plus_ping_timeout():
    error, pings, failures, closed = _round(_silent(), ping_answers=False, liveness_interval=0.2,
                                            liveness_timeout=0.3, step_timeout=3600)
    assert isinstance(error, P.RemoteError) and error.code == "unreachable" and pings == 1 and failures == 1
    assert closed  # the next round opens a new stream


def test_a_round_stream_that_ends_fails_at_once_without_a_ping():
    error, pings, failures, closed = _round(_ended(), ping_answers=False, liveness_interval=0.2,
                                            liveness_timeout=0.3, step_timeout=3600)
    assert isinstance(error, P.RemoteError) and error.code == "closed" and pings == 0 and failures == 0 and closed


def test_a_round_on_a_live_server_waits_for_the_step_time_out_without_liveness():
    error, pings, failures, closed = _round(_silent(), ping_answers=True, liveness_interval=0.2,
                                            liveness_timeout=0.3, step_timeout=1.0)
    assert isinstance(error, asyncio.TimeoutError) and pings >= 2 and failures == 0 and closed


def test_a_part_failed_on_its_round_stream_raises_at_its_next_reply():
    """`astep_round` marks the session parts of a server found unreachable on a round stream: their next reply on
    their own streams raises that error at once (the session fails over) instead of waiting on the server again."""
    async def run():
        manager = Manager(ClientConfig(initial_peers=["x"], liveness_interval=0.2, liveness_timeout=0.3), False)
        part = SpanStream(manager, RouteHop(peer_id=PEER, start=0, end=30), "s", max_length=8,  # type: ignore
                          batch_size=1)
        part._responses = _silent()
        part.failed = P.RemoteError("unreachable", "no answer to a ping", PEER)
        try:
            await part.receive(0, 1)
        except P.RemoteError as e:
            return e, manager.pings
        raise AssertionError("no error")

    error, pings = asyncio.run(run())
    assert error.code == "unreachable" and pings == 0


@pytest.mark.parametrize("value", [0, -1])
def test_liveness_settings_are_validated(value):
    with pytest.raises(ValueError):
        ClientConfig(liveness_interval=value)


def test_a_frozen_server_mid_generation_is_failed_over_on_loopback(model_path, bootstrap, tokenizer, reference_model):
    """Where network namespaces are not permitted, a frozen server (SIGSTOP to it and its descendants: p2pd included, so
    its connections stay open and say nothing) stands in for a cut link: the default liveness settings fail it
    over and the greedy tokens equal transformers' (the session's step time-out alone would wait 120 s)."""
    import os
    import signal

    from launch.topology import start_servers
    from swarm import AutoDistributedModelForCausalLM
    from tests.fixtures.swarm_checks import KillAfter

    prefix = "tfrozen"
    # no CPU turns: a server frozen while it holds the machine-wide turn (`swarm.runtime.cpu_turns`) would stop the
    # compute of every swarmgate process on the machine, the other server's included, until it is killed
    servers = start_servers(model_path, [bootstrap.maddr], ["0:30", "0:30"], prefix, ["--throughput", "100"],
                            threads=1, env={"SWARMGATE_CPU_TURNS": "0"})
    model = AutoDistributedModelForCausalLM.from_pretrained(model_path, initial_peers=[bootstrap.maddr],
                                                            dht_prefix=prefix)
    try:
        ids = tokenizer("Frozen hosts say nothing, so", return_tensors="pt")["input_ids"]
        new = 16
        ref = reference_model.generate(ids, max_new_tokens=new, min_new_tokens=new, do_sample=False)
        by_peer = {s.peer_id: s for s in servers}
        with model.inference_session(max_length=ids.shape[1] + new) as session:
            def freeze():
                victim = by_peer[session.session.chain[0].peer_id]
                victim.signal_tree(signal.SIGSTOP)
                freeze.victim = victim.peer_id

            began = time.monotonic()
            out = model.generate(ids, session=session, max_new_tokens=new, min_new_tokens=new, do_sample=False,
                                 streamer=KillAfter(6, freeze))
            print(f"\n{new} tokens with a server frozen after 6: {time.monotonic() - began:.1f}s")
            assert session.session.failovers == 1
            assert [hop.peer_id for hop in session.session.chain] != [freeze.victim]
        assert out.tolist() == ref.tolist()
    finally:
        model.shutdown()
        for s in servers:
            s.kill()  # SIGKILL ends stopped processes too


def test_closing_a_round_stream_closes_its_replies_at_once():
    """Between rounds (no reply awaited), `close` ends the replies' stream then, not when the stream object is
    collected (a dead server's entry in the manager's table never was)."""
    ended = []

    async def replies():
        try:
            yield P.make_response(P.StepResult(position=1), [])
            await asyncio.sleep(3600)
            yield P.make_response(P.StepResult(position=2), [])
        finally:
            ended.append(True)

    async def run():
        manager = Manager(ClientConfig(initial_peers=["x"]), ping_answers=True)
        stream = RoundStream(manager, PEER)  # type: ignore[arg-type]
        stream._loop, stream._responses = asyncio.get_running_loop(), replies()
        await stream._responses.__anext__()  # a round answered; the stream waits for the next
        stream.close()
        for _ in range(5):
            await asyncio.sleep(0)
        return list(ended)

    assert asyncio.run(run()) == [True]
