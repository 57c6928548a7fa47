"""A server's steps that may fail for a while and must not end it: tried again with back-off, logged once.

A volunteer's machine is often busy: its DHT peer or p2pd may be slow to answer, and a relayed peer has no address
of its own until its relay reservation is in place (issue 52). Such failures are no reason to end a server; only
errors the volunteer can fix (one clear line, `server.server.main`) and the DHT process dying (a supervisor starts
the server again) are. `until_done` runs one step of the start (placing, announcing) until it succeeds; the
serving loop itself is restarted with the same back-off by `Server._supervise`.
"""
from __future__ import annotations

import asyncio
import logging
from typing import Awaitable, Callable, Optional, TypeVar

logger = logging.getLogger("swarmgate.server")

T = TypeVar("T")

FIRST_DELAY = 0.5  # seconds before the first retry; doubled after each failure


def backoff(failures: int, max_delay: float) -> float:
    """Seconds to wait after `failures` failures in a row: FIRST_DELAY doubling, at most `max_delay`."""
    return min(max_delay, FIRST_DELAY * 2 ** (failures - 1))


async def until_done(what: str, step: Callable[[], Awaitable[T]], *, sleep: Callable[[float], Awaitable[bool]],
                     check: Callable[[], None], max_delay: float) -> Optional[T]:
    """`step()`, tried again with back-off while it fails: one warning line for the first failure, one info line
    once it succeeded. `check()` runs after each failure and may end the server (e.g. SystemExit when the DHT
    process died); `sleep(seconds)` returns True when the server is stopping: then None."""
    failures = 0
    while True:
        try:
            result = await step()
        except asyncio.CancelledError:
            raise
        except Exception as e:
            check()
            failures += 1
            delay = backoff(failures, max_delay)
            if failures == 1:
                logger.warning(f"{what} failed ({type(e).__name__}: {e}); trying again with back-off")
            else:
                logger.debug(f"{what} failed again ({type(e).__name__}: {e}); next try in {delay:.1f}s")
            if await sleep(delay):
                return None
            continue
        if failures:
            logger.info(f"{what}: done after {failures + 1} tries")
        return result
