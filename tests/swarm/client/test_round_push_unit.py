"""A round stream's pushed results (`swarm.client.transport.round_stream.RoundStream`, capability `round_push`),
without processes: a stand-in server whose replies are scripted. The server answers rows that the previous server
pushed to it with results the client did not ask for (`RoundResult.pushed`); the stream's reader keeps each for
the row that waits for it (`wait_pushed`), whether it came before the wait or during it; a wait with nothing coming
ends after `push_timeout` (the client then sends the step itself), and at once when the stream has ended; a reply to
no message ends the stream. The same on real processes (a late copy answered from the server's kept output
included): `tests/e2e/test_rounds.py` (counts) and `tests/e2e/test_round_push.py`."""
from __future__ import annotations

import asyncio

import torch

from swarm.client.transport.manager import ClientConfig
from swarm.client.transport.round_stream import RoundStream
from swarm.client.transport.routing import RouteHop
from swarm.client.transport.span_stream import SpanStream
from swarm.wire import protocol as P
from swarm.wire import rounds as R

PEER = "12D3KooWQcDwdERqzANxK8BBxoXHhs5q31JtseSoksHmMw3bHuap"
HIDDEN = 8
S0, S1 = P.stream_key("s0", 15), P.stream_key("s1", 15)  # the parts' keys (`_parts`)


class Manager:
    def __init__(self):
        self.config = ClientConfig(initial_peers=["x"], liveness_interval=None, step_timeout=30)


def _parts(manager, count: int):
    hop = RouteHop(peer_id=PEER, start=15, end=30, capabilities=("rounds", "push", "round_push"))
    return [SpanStream(manager, hop, f"s{i}", max_length=8, batch_size=1) for i in range(count)]  # type: ignore


def _pushed(rows, values, pushed_on=()) -> object:
    """A pushed result: (stream key, step id, position or error code) per row, one [hidden] value per row done;
    the rows of `pushed_on` (keys) went on to the next server."""
    results = [R.RoundRowResult(stream_key=key, step_id=step, position=outcome, pushed=key in pushed_on)
               if isinstance(outcome, int) else R.RoundRowResult(stream_key=key, step_id=step, code=outcome,
                                                                  message="no") for key, step, outcome in rows]
    tensors = [torch.stack(values)] if values else []
    return P.make_response(R.RoundResult(rows=results, pushed=True), tensors)


def _stream(script):
    """A round stream on a stand-in server whose replies are `script()`'s (an async generator)."""
    manager = Manager()
    stream = RoundStream(manager, PEER)  # type: ignore[arg-type]
    stream._loop = asyncio.get_running_loop()
    stream._responses = script()
    stream._reader = asyncio.ensure_future(stream._read(stream._responses))
    return manager, stream


def test_pushed_results_reach_their_rows_whether_they_come_before_or_during_the_wait():
    later = asyncio.Event()

    async def script():
        yield _pushed([(S0, 7, 4)], [torch.full((HIDDEN,), 1.0)])  # before anyone waits
        await later.wait()
        yield _pushed([(S1, 9, 4)], [torch.full((HIDDEN,), 2.0)], pushed_on=[S1])  # while s1 waits
        await asyncio.sleep(3600)

    async def run():
        manager, stream = _stream(script)
        a, b = _parts(manager, 2)
        await asyncio.sleep(0.01)
        first, first_on = await stream.wait_pushed(a, 1, 3, 7, timeout=5)
        waiting = asyncio.ensure_future(stream.wait_pushed(b, 1, 3, 9, timeout=5))
        await asyncio.sleep(0.01)
        later.set()
        second, second_on = await waiting
        stream.close()
        return first, second, (first_on, second_on), a.position, b.position, stream.pushed_rows

    first, second, pushed_on, pos_a, pos_b, count = asyncio.run(run())
    assert torch.equal(first, torch.full((1, 1, HIDDEN), 1.0)) and torch.equal(second, torch.full((1, 1, HIDDEN), 2.0))
    assert pushed_on == (False, True)  # the second went on to its next server: its result comes there
    assert (pos_a, pos_b, count) == (4, 4, 2)


def test_a_pushed_row_error_and_a_wrong_position_are_that_rows_errors():
    async def script():
        yield _pushed([(S0, 7, "closed"), (S1, 9, 6)], [torch.zeros(HIDDEN)])
        await asyncio.sleep(3600)

    async def run():
        manager, stream = _stream(script)
        a, b = _parts(manager, 2)
        got = [(await stream.wait_pushed(a, 1, 3, 7, timeout=5))[0],
               (await stream.wait_pushed(b, 1, 3, 9, timeout=5))[0]]
        stream.close()
        return got

    closed, wrong = asyncio.run(run())
    assert isinstance(closed, P.RemoteError) and closed.code == "closed"
    assert isinstance(wrong, P.RemoteError) and wrong.code == "bad_reply" and "position 6" in wrong.message


async def _wait_on(script, timeout: float):
    """One row's `wait_pushed` on a stream of `script`'s replies: (what it returned, the stream). A wait that should
    end at once is given an hour and a guard of 30 s: if it hangs, the guard's TimeoutError fails the test."""
    manager, stream = _stream(script)
    [a] = _parts(manager, 1)
    await asyncio.sleep(0.01)
    got = await asyncio.wait_for(stream.wait_pushed(a, 1, 3, 7, timeout=timeout), 30)
    return got, stream


def test_a_reply_to_no_message_ends_the_stream_and_wakes_its_waiters():
    """The reader takes only as many replies as messages were sent: a server that sends more (a flood the client
    would otherwise buffer without limit) has its stream ended, and whoever waits on it returns."""
    async def script():
        yield P.make_response(R.RoundResult(round_id=1, rows=[]))  # nobody asked
        yield P.make_response(R.RoundResult(round_id=2, rows=[]))
        await asyncio.sleep(3600)

    async def run():
        got, stream = await _wait_on(script, timeout=3600)
        return got, stream.usable, stream._replies.qsize()

    got, usable, queued = asyncio.run(run())
    assert got is None and not usable
    assert queued == 1  # only the end mark


def test_a_wait_ends_after_the_timeout_and_when_the_stream_ends():
    async def silent():
        await asyncio.sleep(3600)
        yield  # pragma: no cover

    async def ended():
        yield _pushed([("other", 1, 4)], [torch.zeros(HIDDEN)])  # someone else's row, then the end

    async def run():
        timed_out, stream = await _wait_on(silent, timeout=0.1)  # nothing comes: None after the timeout
        assert stream.usable
        stream.close()
        at_end, stream = await _wait_on(ended, timeout=3600)
        return timed_out, at_end, stream.usable

    timed_out, at_end, usable = asyncio.run(run())
    assert timed_out is None and at_end is None and not usable


def test_a_malformed_pushed_result_is_dropped_and_the_stream_goes_on():
    async def script():
        yield _pushed([(S0, 7, 4), (S1, 9, 4)], [torch.zeros(HIDDEN)])  # two rows done, one output
        yield _pushed([(S1, 9, 4)], [torch.full((HIDDEN,), 4.0)])
        await asyncio.sleep(3600)

    async def run():
        manager, stream = _stream(script)
        a, b = _parts(manager, 2)
        got, _ = await stream.wait_pushed(b, 1, 3, 9, timeout=5)
        missing = await stream.wait_pushed(a, 1, 3, 7, timeout=0.05)
        stream.close()
        return got, missing

    got, missing = asyncio.run(run())
    assert torch.equal(got, torch.full((1, 1, HIDDEN), 4.0)) and missing is None
