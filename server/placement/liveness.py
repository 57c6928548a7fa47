"""The hole watch's check that the servers it relies on are alive: a SIGKILLed server leaves a hole at once.

A server that stops cleanly announces its blocks offline, and free servers see the hole at their next hole check
(`server.placement.spans.check_holes`). A server that dies without a word (SIGKILL, a crash, a pulled cable) leaves its
record `online` until it expires (`--expiration`, by default twice `--update_period`: 4 minutes), and the hole
stays hidden that long. So at each hole check a free server pings (`server.placement.pings.ping`, one `rpc_info` round
trip) the *sole holders*: the servers that alone serve some block, the only ones whose death makes a hole (at
most `MOST` of them per check, taking turns). A holder that fails `MISSES` pings in a row, `RETRY_PAUSE` apart, is
taken for dead: its records are left out of what the hole watch, the move that fills the hole and the rebalancing
decide on (`without_dead`), until a later ping answers. Everything else (clients' routing, placement at start)
still reads the records as they are.

Cost: no DHT traffic (the records are the ones the hole check reads anyway); up to `MOST` pings per hole check of
each free server, every `--hole_check_period` seconds (stretched in swarms of more than 100 servers), and only
while some block has a single server. Two free servers that both probe the dead holder each see the same hole,
and take turns as for any hole (`placement.hole_fill_turn`).
"""
from __future__ import annotations

import asyncio
import logging
from typing import List, Optional, Sequence, Set

from server.placement.pings import UNREACHABLE, ping
from swarm.wire.records import ServerSpan, ServerState

logger = logging.getLogger("swarmgate.server")

MOST = 4  # sole holders pinged per hole check
MISSES = 2  # pings in a row a holder must fail to be taken for dead
RETRY_PAUSE = 1.0  # seconds between those pings
PING_TIMEOUT = 3.0


def sole_holders(spans: Sequence[ServerSpan], num_blocks: int, my_peer_id: str) -> List[str]:
    """Peer ids (other than ours) of ONLINE servers that are the only ONLINE server of some block, in block order."""
    holders: List[Set[str]] = [set() for _ in range(num_blocks)]
    for span in spans:
        if span.info.state == ServerState.ONLINE:
            for index in range(max(span.start, 0), min(span.end, num_blocks)):
                holders[index].add(span.peer_id)
    result: List[str] = []
    for peers in holders:
        if len(peers) == 1:
            (peer,) = peers
            if peer != my_peer_id and peer not in result:
                result.append(peer)
    return result


class HolderLiveness:
    """Which sole holders did not answer (see the module docstring); `proof`: this server's membership proof for a
    private swarm's pings (`swarm.runtime.swarm_key.proof_for`)."""

    def __init__(self, proof: str = "", most: int = MOST, misses: int = MISSES,
                 retry_pause: float = RETRY_PAUSE, timeout: float = PING_TIMEOUT):
        self.proof, self.most, self.misses, self.retry_pause, self.timeout = proof, most, misses, retry_pause, timeout
        self.dead: Set[str] = set()
        self.pings = 0  # sent so far (logs, tests)
        self._next = 0  # round-robin position among the sole holders

    async def _answers(self, p2p, peer_id: str) -> bool:
        for attempt in range(self.misses):
            if attempt:
                await asyncio.sleep(self.retry_pause)
            self.pings += 1
            if await ping(p2p, peer_id, self.timeout, self.proof) < UNREACHABLE:
                return True
        return False

    async def probe(self, p2p, spans: Sequence[ServerSpan], num_blocks: int, my_peer_id: str) -> Set[str]:
        """Ping up to `most` sole holders (all of them in turn over several checks); returns the dead ones."""
        holders = sole_holders(spans, num_blocks, my_peer_id)
        self.dead &= set(holders)  # a holder no longer alone (or gone from the records) is not ours to judge
        if p2p is None or not holders:
            return set(self.dead)
        start = self._next % len(holders)
        chosen = (holders[start:] + holders[:start])[:self.most]
        self._next = start + len(chosen)
        answers = await asyncio.gather(*(self._answers(p2p, peer) for peer in chosen))
        for peer, alive in zip(chosen, answers):
            if alive:
                self.dead.discard(peer)
            elif peer not in self.dead:
                self.dead.add(peer)
                logger.info(f"hole watch: server {peer}, the only one serving some blocks, does not answer: taking "
                            f"its record for stale")
        return set(self.dead)

    def without_dead(self, spans: Sequence[ServerSpan], dead: Optional[Set[str]] = None) -> List[ServerSpan]:
        dead = self.dead if dead is None else dead
        return [span for span in spans if span.peer_id not in dead]
