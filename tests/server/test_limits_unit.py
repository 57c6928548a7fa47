"""The one admission of a server's streamed RPCs (`server.rpc.refusal.admitted`), in process: a stream counts
against `--max_streams` while it runs, one past the cap gets the `over_limit` refusal without its handler starting
(and what its caller sent is read), and the count drops however a stream ends (its replies done, an error, the
caller gone), after the handler's own teardown. `tests/server/test_limits.py` checks the same caps on a real server
through the inference, round and training RPCs."""
from __future__ import annotations

import asyncio

import pytest

from server.rpc.limits import RpcLimits, StreamLimiter
from server.rpc.refusal import admitted
from swarm.wire import protocol as P


async def _requests(n: int, read: list):
    for i in range(n):
        read.append(i)
        yield P.make_request(P.Step(start_position=i, step_id=i + 1))


def _handler(log: list, replies: int = 2, fail: bool = False, streams=None):
    """A stream handler that logs its start and teardown (with the stream count then, given `streams`)."""
    async def serve():
        log.append("started")
        try:
            for i in range(replies):
                yield P.make_response(P.StepResult(position=i + 1), [])
            if fail:
                raise RuntimeError("the handler failed")
        finally:
            log.append("teardown" if streams is None else ("teardown", streams.streams))
    return serve


def test_a_stream_counts_while_it_runs_and_one_past_the_cap_is_refused():
    async def run():
        streams = StreamLimiter(RpcLimits(max_streams=1))
        log: list = []
        first = admitted(streams, _requests(0, []), _handler(log))
        reply = await first.__anext__()  # the first stream is open: it counts
        assert isinstance(P.decode_reply(reply.metadata), P.StepResult) and streams.streams == 1

        read: list = []
        other: list = []
        refused = [P.decode_reply(r.metadata) async for r in admitted(streams, _requests(3, read), _handler(other))]
        assert len(refused) == 1 and isinstance(refused[0], P.ErrorReply) and refused[0].code == "over_limit"
        assert "max_streams" in refused[0].message and other == [] and read == [0, 1, 2]  # drained, never served
        assert streams.streams == 1

        rest = [r async for r in first]
        assert len(rest) == 1 and streams.streams == 0 and log == ["started", "teardown"]
        # the slot is free again
        again = [r async for r in admitted(streams, _requests(0, []), _handler([]))]
        assert len(again) == 2 and streams.streams == 0

    asyncio.run(run())


def test_the_count_drops_after_the_handlers_teardown_however_the_stream_ends():
    async def run():
        streams = StreamLimiter(RpcLimits(max_streams=4))
        # the handler fails: its error reaches the transport, the count drops
        log: list = []
        with pytest.raises(RuntimeError, match="the handler failed"):
            async for _ in admitted(streams, _requests(0, []), _handler(log, fail=True)):
                pass
        assert streams.streams == 0 and log == ["started", "teardown"]

        # the caller goes away mid-stream (the transport closes the reply stream): the handler is closed first
        log = []
        stream = admitted(streams, _requests(0, []), _handler(log, replies=10, streams=streams))
        await stream.__anext__()
        await stream.aclose()
        assert streams.streams == 0 and log == ["started", ("teardown", 1)]  # still counted in its teardown

    asyncio.run(run())
