"""What a running generation reports: the stream events and the client-facing error for a failure of the swarm.

A generation emits `ChoiceDelta` events (text deltas that never split a character nor leak a stop string, with the
tokens they cover for logprobs, and each choice's `finish_reason`), then one `Done` with the token counts. A
failure becomes a `GenerationFailed` event carrying an `APIError` (`swarm_error` picks it); `Cancelled` is raised
when the client went away.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import List, Optional

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


def swarm_error(e: BaseException) -> APIError:
    """The client-facing error for a failure of the swarm (routing, a server, a timeout)."""
    if isinstance(e, APIError):
        return e
    if isinstance(e, RoutingError):
        return unavailable(f"The swarm cannot serve this model right now: {e}", code="swarm_unavailable")
    if isinstance(e, (SessionError, RemoteError, P2PDaemonError, P2PHandlerError, TimeoutError, OSError)):
        return unavailable(f"The swarm failed during generation: {type(e).__name__}: {e}", code="swarm_error")
    logger.error("generation failed", exc_info=e)
    return internal()
