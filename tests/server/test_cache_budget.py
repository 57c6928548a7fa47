"""The KV cache budget: sessions that do not fit wait, then succeed or get "out of cache"; free cache is announced.

Unit tests of `CacheBudget` and the compute queue's priorities, then a real server with a tiny budget driven
through the client library.
"""
from __future__ import annotations

import asyncio
import logging
import threading
import time
import uuid

import hivemind
import pytest
import torch

from launch.topology import start_server
from server.compute.cache import CacheBudget, OutOfCacheError
from swarm.client.transport.session import SessionError
from swarm.runtime.taskpool import PRIORITY_FORWARD, PRIORITY_INFERENCE, TaskPool
from swarm.wire.records import fetch_block_records

BUDGET, SESSION = 64, 48  # two sessions of 48 tokens do not fit in 64
ALLOC_TIMEOUT = 8.0


# ---- units ------------------------------------------------------------------------------------------------
def test_budget_waits_for_room_then_reserves():
    async def scenario():
        budget = CacheBudget(100)
        await budget.reserve("a", 60, timeout=1)
        waiter = asyncio.create_task(budget.reserve("b", 60, timeout=10))
        await asyncio.sleep(0.1)
        assert not waiter.done() and budget.used_tokens == 60
        await budget.release("a")
        await asyncio.wait_for(waiter, 5)
        assert budget.used_tokens == 60 and budget.num_sessions == 1
        with pytest.raises(OutOfCacheError, match="out of cache"):
            await budget.reserve("c", 50, timeout=0.2)
        with pytest.raises(OutOfCacheError, match="whole budget"):
            await budget.reserve("d", 101, timeout=5)  # can never fit: fails at once
        assert budget.free_tokens == 40 and budget.num_sessions == 1

    asyncio.run(scenario())


def test_inference_runs_before_queued_forward_work():
    async def scenario():
        pool = TaskPool()
        gate = threading.Event()
        order = []
        blocker = pool.submit(PRIORITY_FORWARD, gate.wait, 10)
        await asyncio.sleep(0.05)  # the worker is now busy with the blocker
        forward = [pool.submit(PRIORITY_FORWARD, order.append, f"forward{i}") for i in range(3)]
        inference = [pool.submit(PRIORITY_INFERENCE, order.append, f"inference{i}") for i in range(3)]
        gate.set()
        await asyncio.gather(blocker, *forward, *inference)
        pool.shutdown()
        return order

    assert asyncio.run(scenario()) == ["inference0", "inference1", "inference2", "forward0", "forward1", "forward2"]


# ---- a real server ----------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def tight_swarm(model_path, bootstrap):
    prefix = f"cache-{uuid.uuid4().hex[:8]}"
    server = start_server(
        model_path, [bootstrap.maddr], "0:30", prefix,
        ["--throughput", "10", "--attn_cache_tokens", str(BUDGET), "--alloc_timeout", str(ALLOC_TIMEOUT),
         "--update_period", "1"], name=f"server-{prefix}", threads=1)
    try:
        server.wait_ready(300)
        yield {"prefix": prefix, "server": server}
    finally:
        server.terminate()


@pytest.fixture(scope="module")
def model(tight_swarm, model_path, bootstrap):
    from swarm import AutoDistributedModelForCausalLM

    model = AutoDistributedModelForCausalLM.from_pretrained(model_path, initial_peers=[bootstrap.maddr],
                                                            dht_prefix=tight_swarm["prefix"])
    yield model
    model.shutdown()


def _wait_free_cache(reader, tight_swarm, expected: int, timeout: float = 30) -> None:
    peer = tight_swarm["server"].peer_id
    deadline = time.monotonic() + timeout
    seen = None
    while time.monotonic() < deadline:
        info = fetch_block_records(reader, tight_swarm["prefix"], 30)[0].get(peer)
        seen = info.cache_tokens_left if info is not None else None
        if seen == expected:
            return
        time.sleep(0.3)
    raise AssertionError(f"announced free cache is {seen}, expected {expected}")


def test_session_waits_for_cache_and_succeeds_when_another_closes(model, tight_swarm, bootstrap):
    reader = hivemind.DHT(initial_peers=[bootstrap.maddr], client_mode=True, start=True)
    try:
        first = model.inference_session(max_length=SESSION)
        first.feed(torch.tensor([[1, 2, 3]]))
        _wait_free_cache(reader, tight_swarm, BUDGET - SESSION)  # the record announces what is left

        events = []

        def close_first_later():
            time.sleep(2.0)  # the second session is waiting for cache by now
            events.append("closing first")
            first.close()

        closer = threading.Thread(target=close_first_later)
        closer.start()
        with model.inference_session(max_length=SESSION) as second:
            logits = second.feed(torch.tensor([[1, 2, 3]]))  # opens: waits until the first one is closed
            events.append("second opened")
        closer.join(30)
        assert events == ["closing first", "second opened"]
        assert logits.shape == (1, model.config.vocab_size)
        _wait_free_cache(reader, tight_swarm, BUDGET)
    finally:
        reader.shutdown()


def test_session_gets_out_of_cache_after_the_timeout(model, model_path, bootstrap, tight_swarm, caplog):
    caplog.set_level(logging.WARNING)
    with model.inference_session(max_length=SESSION) as first:
        first.feed(torch.tensor([[1, 2, 3]]))
        with model.inference_session(max_length=SESSION) as second:
            with pytest.raises(SessionError) as info:
                second.feed(torch.tensor([[1, 2, 3]]))  # waits --alloc_timeout, then "out of cache"
        # the client routes around the refusal (here there is no other server), then gives up naming the reason
        assert "out_of_cache" in str(info.value), repr(info.value)
        # the first session is untouched
        assert first.feed(torch.tensor([[1, 2, 3, 4]])).shape == (1, model.config.vocab_size)
    # with the first one closed there is room again (a new client: the old one may have banned the server)
    from swarm import AutoDistributedModelForCausalLM

    fresh = AutoDistributedModelForCausalLM.from_pretrained(model_path, initial_peers=[bootstrap.maddr],
                                                            dht_prefix=tight_swarm["prefix"])
    try:
        with fresh.inference_session(max_length=SESSION) as third:
            assert third.feed(torch.tensor([[5, 6]])).shape == (1, fresh.config.vocab_size)
    finally:
        fresh.shutdown()
