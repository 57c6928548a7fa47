"""Waiting for a server's late reply while checking that the server is alive: `wait_while_alive`, shared by a
session's own stream (`span_stream.SpanStream`) and a round stream (`rounds.RoundStream`).

A server that dies closes its connections, and its streams end at once (`swarm.wire.duplex`). A server that goes
silent without closing anything (a frozen host, a cut link) sends no error ever: while its reply is late, it is
pinged (an info call on a new stream) every `liveness_interval` seconds, and a ping unanswered within
`liveness_timeout` fails it as `unreachable`, after about interval + timeout seconds instead of the whole
`step_timeout`. A live server that is merely slow answers its pings and is waited for up to `step_timeout`.
"""
from __future__ import annotations

import asyncio
import logging
from typing import Any

from hivemind.p2p import P2PHandlerError

from swarm.client.transport.manager import SwarmManager
from swarm.wire import protocol as P

logger = logging.getLogger(__name__)


async def wait_while_alive(manager: SwarmManager, peer_id: str, pending: "asyncio.Future[Any]") -> Any:
    """`pending`'s result (a reply from `peer_id`), waited for up to the manager's `step_timeout`, pinging the
    server while it is late. Raises `asyncio.TimeoutError` after `step_timeout`, `P.RemoteError("unreachable")` when
    a ping goes unanswered (`pending` itself is left to the caller, not cancelled), or what `pending` raised."""
    config = manager.config
    loop = asyncio.get_running_loop()
    deadline = loop.time() + config.step_timeout
    while True:
        left = deadline - loop.time()
        if left <= 0:
            raise asyncio.TimeoutError(f"no reply within step_timeout={config.step_timeout:g}s")
        interval = config.liveness_interval
        await asyncio.wait({pending}, timeout=left if interval is None else min(left, interval))
        if pending.done():
            return pending.result()
        if interval is not None and not await answers_ping(manager, peer_id) and not pending.done():
            manager.liveness_failures += 1
            message = (f"no reply for {interval:g}s and no answer to a ping within {config.liveness_timeout:g}s")
            logger.warning(f"server {peer_id} is unreachable: {message}")
            raise P.RemoteError("unreachable", message, peer_id)


async def answers_ping(manager: SwarmManager, peer_id: str) -> bool:
    """Whether `peer_id` answers an info call within `liveness_timeout` (an error reply counts: it is reachable)."""
    try:
        await asyncio.wait_for(manager.info(peer_id), manager.config.liveness_timeout)
    except P2PHandlerError:
        return True  # the server answered, if with an error: it is reachable
    except Exception:
        return False
    return True
