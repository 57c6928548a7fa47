"""RTTs from this server to the servers that could run the block after its span (published as `next_pings`).

Routing needs the network cost between consecutive servers of a chain; only the sender can measure it. Each
time a server refreshes its DHT record it pings (an `rpc_info` round trip) up to `max_peers` of the online
servers whose span contains its end block, and stores the RTTs in seconds. An unreachable server gets
`UNREACHABLE` (a large finite number, so that the record stays valid JSON).
"""
from __future__ import annotations

import asyncio
import random
import time
from typing import Any, Dict, Sequence

from hivemind.p2p import P2P, PeerID
from hivemind.proto import runtime_pb2

from swarm.wire import protocol as P
from swarm.wire.records import ServerSpan, ServerState

UNREACHABLE = 1e6


async def ping(p2p: P2P, peer_id: str, timeout: float = 2.0, proof: str = "") -> float:
    start = time.perf_counter()
    try:
        stub = P.BlockRPC.get_stub(p2p, PeerID.from_base58(peer_id))
        await stub.rpc_info(runtime_pb2.ExpertUID(uid=proof), timeout=timeout)
    except Exception:
        return UNREACHABLE
    return time.perf_counter() - start


def next_candidates(spans: Sequence[ServerSpan], my_peer_id: str, end: int, max_peers: int,
                    rng: Any = random) -> list:
    """Peer ids of servers that could take over at block `end` (sampled when there are many)."""
    candidates = [s.peer_id for s in spans  # joining servers have no handlers yet: they would look unreachable
                  if s.start <= end < s.end and s.peer_id != my_peer_id and s.info.state == ServerState.ONLINE]
    if len(candidates) > max_peers:
        candidates = rng.sample(candidates, max_peers)
    return candidates


async def measure_next_pings(p2p: P2P, spans: Sequence[ServerSpan], my_peer_id: str, end: int,
                             max_peers: int = 8, timeout: float = 2.0, proof: str = "") -> Dict[str, float]:
    """`proof`: this server's membership proof in a private swarm (`swarm.runtime.swarm_key`)."""
    peers = next_candidates(spans, my_peer_id, end, max_peers)
    rtts = await asyncio.gather(*(ping(p2p, peer, timeout, proof) for peer in peers))
    return dict(zip(peers, rtts))
