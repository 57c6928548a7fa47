"""How a block server admits and refuses a streamed RPC: `admitted` counts a stream under `--max_streams` while it
runs and gives the over-limit refusal past it (the one admission of the inference, round and training streams:
`server.rpc.inference`, `server.rpc.rounds`, `server.rpc.training`); a refusal is one `ErrorReply`, then what the
caller already sent is read (bounded) before the stream closes, since closing at once may reset the stream before
the caller has read the reply. `Refused`: the refusals of a stream's opening request.
"""
from __future__ import annotations

import asyncio
from contextlib import aclosing
from typing import AsyncGenerator, AsyncIterator, Callable, Optional

from hivemind.proto import runtime_pb2

from server.rpc.limits import LimitError, StreamLimiter
from swarm.wire import protocol as P


class Refused(Exception):
    """A stream refused before its work starts: the caller gets `code` (an `ErrorReply` code) and the message."""

    def __init__(self, code: str, message: str):
        super().__init__(message)
        self.code = code


async def drain_refused(requests: AsyncIterator, timeout: float = 2.0, max_messages: int = 64) -> None:
    """Read (bounded) what a refused caller already sent: closing the stream early may reset it before the caller
    has read the error reply."""
    try:
        for _ in range(max_messages):
            await asyncio.wait_for(requests.__anext__(), timeout=timeout)
    except (StopAsyncIteration, asyncio.TimeoutError, Exception):
        return


async def refuse(requests: AsyncIterator, code: str, message: str, version: Optional[int] = None
                 ) -> AsyncIterator[runtime_pb2.ExpertResponse]:
    """The refusal of a stream: its one `ErrorReply` (`code`, `message`; in the caller's protocol `version` where
    known), then the caller's requests drained."""
    yield P.error_response(code, message, version)
    await drain_refused(requests)


async def admitted(streams: StreamLimiter, requests: AsyncIterator,
                   serve: Callable[[], AsyncGenerator[runtime_pb2.ExpertResponse, None]]
                   ) -> AsyncIterator[runtime_pb2.ExpertResponse]:
    """A streamed RPC counted as one open stream (`--max_streams`) while it runs: past the cap, the `over_limit`
    refusal (the handler never starts); else `serve()`'s replies, the stream counted out however it ends (the
    handler closed first: its own teardown runs before the count drops)."""
    try:
        streams.enter_stream()
    except LimitError as e:
        async for reply in refuse(requests, "over_limit", str(e)):
            yield reply
        return
    try:
        async with aclosing(serve()) as replies:
            async for reply in replies:
                yield reply
    finally:
        streams.exit_stream()
