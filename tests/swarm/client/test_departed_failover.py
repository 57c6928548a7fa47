"""A server that left the swarm costs forward passes and training calls no ban and no try (issue 45), on synthetic
swarm views: a call fails on a server whose record, read again at once, is no longer online (a graceful stop
announces `offline`), so `SwarmManager.settle_failures` drops it from the view and the pass goes on elsewhere; a
server still online that fails is banned and counted, as before. Inference sessions follow the same rule
(`test_capability_routing.py`, `SessionChain._open_span`).
"""
from __future__ import annotations

import asyncio
from types import SimpleNamespace
from typing import List, Optional

import pytest
import torch

from swarm.client.model.causal_lm import DistributedModelForCausalLM
from swarm.client.transport.manager import SwarmManager
from swarm.client.transport.remote_autograd import RemoteBlocks, TrainingError
from swarm.client.transport.routing import RouteHop
from swarm.client.transport.session import SessionError
from swarm.wire.records import ServerSpan
from tests.fixtures.synthetic_swarm import fake_manager, make_span

HIDDEN = torch.arange(2 * 3 * 4, dtype=torch.float32).reshape(2, 3, 4)  # [batch, seq, hidden]


def _swarm(view: List[ServerSpan], fresh: List[ServerSpan], max_retries: int) -> SwarmManager:
    """A manager whose view is `view` until the records are read again (a forced update), which finds `fresh`."""
    manager = fake_manager(view, None)
    manager.config = manager.config.model_copy(update={"max_retries": max_retries})

    def update(force: bool = False) -> List[ServerSpan]:
        if force:
            manager.spans = list(fresh)
        return manager.spans

    manager.update = update  # type: ignore[method-assign]
    return manager


class Servers:
    """The servers' answers: those in `failing` raise a lost connection; the others add their number to x."""

    def __init__(self, failing: set):
        self.failing = failing
        self.calls: List[str] = []  # peer ids in the order they were called

    async def __call__(self, hop: RouteHop, x: torch.Tensor, *_) -> torch.Tensor:
        self.calls.append(hop.peer_id)
        if hop.peer_id in self.failing:
            raise ConnectionResetError(f"{hop.peer_id} is gone")
        return x + 1


def _forward_pass(manager: SwarmManager, servers: Servers) -> torch.Tensor:
    manager.forward = servers  # type: ignore[method-assign,assignment]
    model = SimpleNamespace(manager=manager)  # `_forward_chain` uses only the model's manager
    return asyncio.run(DistributedModelForCausalLM._forward_chain(model, HIDDEN))  # type: ignore[arg-type]


def test_a_forward_pass_drops_a_departed_server_without_a_ban_or_a_try():
    # no retry allowed: the pass can only succeed if the departed server's failure is not counted
    manager = _swarm([make_span("gone", 0, 30)], [make_span("b", 0, 30)], max_retries=0)
    servers = Servers({"gone"})
    assert torch.equal(_forward_pass(manager, servers), HIDDEN + 1)
    assert servers.calls == ["gone", "b"] and manager.banned() == []
    assert [span.peer_id for span in manager.spans] == ["b"]


def test_a_forward_pass_bans_and_counts_a_server_still_online_that_fails():
    bad = make_span("bad", 0, 30)
    manager = _swarm([bad], [bad], max_retries=0)
    with pytest.raises(SessionError, match="after 1 tries"):
        _forward_pass(manager, Servers({"bad"}))
    assert manager.banned() == ["bad"]

    manager = _swarm([bad], [bad, make_span("b", 0, 30)], max_retries=1)  # a second try, on b
    servers = Servers({"bad"})
    assert torch.equal(_forward_pass(manager, servers), HIDDEN + 1)
    assert servers.calls == ["bad", "b"] and manager.banned() == ["bad"]


def _training_pass(manager: SwarmManager, servers: Servers, backward: bool) -> RemoteBlocks:
    """A training forward of HIDDEN through blocks 0:30, or the backward of a gradient through them."""
    blocks = RemoteBlocks(manager)

    async def backward_hop(hop: RouteHop, x: torch.Tensor, grad: torch.Tensor, prompts: Optional[torch.Tensor],
                           adapter: Optional[str]):
        return await servers(hop, grad), None

    blocks._forward_hop = servers  # type: ignore[method-assign,assignment]
    blocks._backward_hop = backward_hop  # type: ignore[method-assign]
    if backward:
        grad, _ = asyncio.run(blocks._backward_span(0, 30, HIDDEN, HIDDEN, None, None))
        assert torch.equal(grad, HIDDEN + 1)
    else:
        out, records = asyncio.run(blocks._forward_rows(HIDDEN, None, None))
        assert torch.equal(out, HIDDEN + 1) and [(start, end) for start, end, _ in records] == [(0, 30)]
    return blocks


@pytest.mark.parametrize("backward", [False, True], ids=["train_forward", "train_backward"])
def test_a_training_call_drops_a_departed_server_without_a_ban_or_a_try(backward: bool):
    manager = _swarm([make_span("gone", 0, 30)], [make_span("b", 0, 30)], max_retries=0)
    servers = Servers({"gone"})
    blocks = _training_pass(manager, servers, backward)
    assert servers.calls == ["gone", "b"] and manager.banned() == [] and blocks.failed == []


@pytest.mark.parametrize("backward", [False, True], ids=["train_forward", "train_backward"])
def test_a_training_call_bans_and_counts_a_server_still_online_that_fails(backward: bool):
    bad = make_span("bad", 0, 30)
    with pytest.raises(TrainingError, match="after 1 tries"):
        _training_pass(_swarm([bad], [bad], max_retries=0), Servers({"bad"}), backward)

    manager = _swarm([bad], [bad, make_span("b", 0, 30)], max_retries=1)
    servers = Servers({"bad"})
    blocks = _training_pass(manager, servers, backward)
    assert servers.calls == ["bad", "b"] and manager.banned() == ["bad"] and blocks.failed == ["bad"]


def test_settle_failures_bans_only_the_servers_still_online_and_counts_all_when_records_cannot_be_read():
    manager = _swarm([make_span("a", 0, 30), make_span("gone", 0, 30)], [make_span("a", 0, 30)], max_retries=0)
    assert manager.settle_failures([("a", None), ("gone", ConnectionResetError())]) == {"gone"}
    assert manager.banned() == ["a"]

    def unreadable(force: bool = False) -> List[ServerSpan]:
        raise TimeoutError("the DHT did not answer")

    manager = _swarm([make_span("gone", 0, 30)], [], max_retries=0)
    manager.update = unreadable
    assert manager.settle_failures([("gone", None)]) == set() and manager.banned() == ["gone"]


class DroppingStub:
    """A server's training RPCs that answer, in turn, with each of `script`: 'lost' (the connection reset before
    the call reached the server: a `ConnectionResetError`), 'dropped' (the stream ended without any reply), or
    'served' (the reply: the first request tensor + 1)."""

    def __init__(self, script: List[str]):
        self.script = list(script)
        self.calls: List[str] = []

    def __getattr__(self, rpc: str):
        async def call(requests):
            from hivemind.proto import runtime_pb2

            from swarm.wire import protocol as P
            from swarm.wire import streaming

            sent = [request async for request in requests]
            what = self.script.pop(0)
            self.calls.append(what)
            if what == "lost":
                raise ConnectionResetError("the connection was reset")
            _, parts = await streaming.collect(as_aiter(sent), 1 << 30)
            first = streaming.unpack(parts)[0]
            replies = [] if what == "dropped" else streaming.pack(runtime_pb2.ExpertResponse, P.TrainResult(),
                                                                  [first + 1])
            return as_aiter(replies)

        return call


def as_aiter(items):
    async def gen():
        for item in items:
            yield item

    return gen()


@pytest.mark.parametrize("backward", [False, True], ids=["train_forward", "train_backward"])
def test_a_sole_server_whose_call_and_resend_got_no_reply_is_called_again_not_banned(monkeypatch, backward: bool):
    """The sequence ci19 met (`test_training_failover.py`, a span's only server dropping a call's reply once): the
    call's connection was reset before it reached the server, then its resend was the call the server dropped.
    Banning the only server left no route at all (RoutingError); it is called again instead, as a try."""
    from swarm.client.transport import remote_autograd

    monkeypatch.setattr(remote_autograd, "RESEND_PAUSE", 0.0)
    only = make_span("only", 0, 30)
    manager = _swarm([only], [only], max_retries=3)
    stub = DroppingStub(["lost", "dropped", "served"])
    manager.stub = lambda peer_id: stub  # type: ignore[method-assign]
    blocks = RemoteBlocks(manager)
    if backward:
        grad, _ = asyncio.run(blocks._backward_span(0, 30, HIDDEN, HIDDEN, None, None))
        assert torch.equal(grad, HIDDEN + 1)
    else:
        out, _ = asyncio.run(blocks._forward_rows(HIDDEN, None, None))
        assert torch.equal(out, HIDDEN + 1)
    assert stub.calls == ["lost", "dropped", "served"] and blocks.resent == 1 and blocks.calls == 3
    assert manager.banned() == [] and blocks.failed == []

    # a sole server that never answers: the pass ends after its tries (each a call and its resend), unbanned
    stub = DroppingStub(["dropped"] * 4)
    manager = _swarm([only], [only], max_retries=1)
    manager.stub = lambda peer_id: stub  # type: ignore[method-assign]
    with pytest.raises(TrainingError, match="after 2 tries"):
        asyncio.run(RemoteBlocks(manager)._forward_rows(HIDDEN, None, None))
    assert stub.calls == ["dropped"] * 4 and manager.banned() == []

    # where another server serves the blocks (routing prefers `only`: the least load per throughput), the one whose
    # call and resend got no reply is banned and failed over
    stub, other = DroppingStub(["dropped", "dropped"]), DroppingStub(["served"])
    spans = [only, make_span("other", 0, 30, throughput=1e-6)]
    manager = _swarm(spans, spans, max_retries=1)
    manager.stub = lambda peer_id: stub if peer_id == "only" else other  # type: ignore[method-assign]
    blocks = RemoteBlocks(manager)
    out, _ = asyncio.run(blocks._forward_rows(HIDDEN, None, None))
    assert torch.equal(out, HIDDEN + 1) and other.calls == ["served"]
    assert manager.banned() == ["only"] and blocks.failed == ["only"]
