"""How a block server refuses a streamed RPC: one `ErrorReply`, then what the caller already sent is read (bounded)
before the stream closes, since closing at once may reset the stream before the caller has read the reply.

Shared by the inference stream (`server.rpc.handler`) and the training calls (`server.rpc.training`): the
over-limit refusal of a stream past `--max_streams`, and the refusals of a stream's opening request (`Refused`).
"""
from __future__ import annotations

import asyncio
from typing import AsyncIterator, Optional

from hivemind.proto import runtime_pb2

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
