"""What a running generation reports: the stream events and the client-facing error for a failure of the swarm.

A generation emits `ChoiceDelta` events (text deltas that never split a character nor leak a stop string, with the
tokens they cover for logprobs, and each choice's `finish_reason`), then one `Done` with the token counts. A
failure becomes a `GenerationFailed` event carrying an `APIError` (`swarm_error` picks it); `Cancelled` is raised
when the client went away. `post` hands an event to the request's event loop; inside `batched_events()` (an engine
round: `gateway.serving.rounds`) the events of every generation are handed over together, one call per loop.
"""
from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, Iterator, List, Optional, Tuple

from hivemind.p2p import P2PDaemonError, P2PHandlerError

from gateway.errors import APIError, internal, unavailable
from swarm.client.api import RemoteError, RoutingError, SessionError, TokenChoice

logger = logging.getLogger("swarmgate.gateway")


@dataclass
class ChoiceDelta:
    index: int
    text: str
    tokens: List[TokenChoice] = field(default_factory=list)
    finish_reason: Optional[str] = None


@dataclass
class Done:
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int = 0  # prompt tokens a pooled session already held (not sent to the servers again)
    servers: List[str] = field(default_factory=list)  # peer ids of the session's chain at the end, in chain order


@dataclass
class GenerationFailed:
    error: APIError


class Cancelled(Exception):
    """The client went away: the generation stops before its next step."""


class ShuttingDown(RuntimeError):
    """The gateway is stopping: a generation still running ends with a 503 error event that says so (not an
    internal error: nothing failed)."""


def swarm_error(e: BaseException) -> APIError:
    """The client-facing error for a failure of the swarm (routing, a server, a timeout)."""
    if isinstance(e, APIError):
        return e
    if isinstance(e, ShuttingDown):
        return unavailable("The gateway is shutting down; send the request again (to another gateway).",
                           code="shutting_down")
    if isinstance(e, RoutingError):
        return unavailable(f"The swarm cannot serve this model right now: {e}", code="swarm_unavailable")
    if isinstance(e, (SessionError, RemoteError, P2PDaemonError, P2PHandlerError, TimeoutError, OSError)):
        return unavailable(f"The swarm failed during generation: {type(e).__name__}: {e}", code="swarm_error")
    logger.error("generation failed", exc_info=e)
    return internal()


# ---- handing events to the requests' event loops ----------------------------------------------------------------
_Posted = Tuple[Callable[[Any], None], Any, Callable[[], None]]  # (deliver, event, on_gone)
_batch = threading.local()


def post(loop: asyncio.AbstractEventLoop, deliver: Callable[[Any], None], event: Any,
         on_gone: Callable[[], None]) -> None:
    """`deliver(event)` on `loop` (`on_gone()` here if the loop is gone: nobody listens); batched inside
    `batched_events()` on this thread."""
    buffer: Optional[Dict[asyncio.AbstractEventLoop, List[_Posted]]] = getattr(_batch, "events", None)
    if buffer is not None:
        buffer.setdefault(loop, []).append((deliver, event, on_gone))
        return
    try:
        loop.call_soon_threadsafe(deliver, event)
    except RuntimeError:  # the event loop is gone (shutdown)
        on_gone()


@contextlib.contextmanager
def batched_events() -> Iterator[None]:
    """The events posted on this thread meanwhile go to their loops together at the end: one hand-over per loop."""
    buffer: Dict[asyncio.AbstractEventLoop, List[_Posted]] = {}
    _batch.events = buffer
    try:
        yield
    finally:
        _batch.events = None
        for loop, items in buffer.items():
            try:
                loop.call_soon_threadsafe(_deliver_all, items)
            except RuntimeError:
                for _, _, on_gone in items:
                    on_gone()


def _deliver_all(items: List[_Posted]) -> None:
    for deliver, event, _ in items:
        deliver(event)
