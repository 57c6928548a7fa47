"""A relayed server keeps its relay: it notices a lost reservation and makes a new one.

A server behind a NAT (`server.network.reachable`: `reachable: relayed`) can only be dialed through the relay that
holds its slot. When that relay restarts (or its connection drops), the slot is gone, and hivemind 1.1.12's p2pd does
not reserve it again: go-libp2p 0.32's autorelay puts every relay it reserved with on an hour's back-off, so even a
static relay that is back is skipped (measured: no new slot within 140 s). So `RelayWatch.check`, called by the
serving loop every `--relay_check_period` seconds, asks whether the slot is still there:
- the peer's own addresses have no relay circuit address: the slot is lost (p2pd saw its relay's connection end);
- they have one: that is no proof (p2pd keeps the circuit address of a relay that restarted while it never saw the
  old connection end, its FIN and RST lost as behind a router that dropped the connection's state, or was connected
  to the relay again before it did: the DHT reconnects to a restarted relay as a plain peer, so "connected to the
  relay" is no proof either; tests/e2e/test_nat.py makes the first case), so the watch dials the server through its
  relays as a client would (`server.network.relay_probe.RelayProbe`, a small p2pd of the watch's own): a relayed
  connection made: the slot is held; every relay refused (NO_RESERVATION, CONNECTION_FAILED): lost; anything else
  (a relay that does not answer, a timeout): not known, and lost only after `UNSURE_LIMIT` such checks in a row.
Once lost, and once one of the relays (the initial peers) accepts a connection again, the DHT peer and its p2pd are
restarted as a relayed DHT client with the same peer id (`RelayedPeer.restart_relayed`: the server's
`server.network.identity.ServerNetwork`), the block handlers are moved to the new p2pd and the record is announced
again (`Rehost`: the server process; an announcement that fails is left to the serving loop's next refresh), so
clients reach the server through the new slot. While no relay answers, nothing is restarted (a DHT client cannot
join without one).
A renewal that gets no slot, or whose DHT peer fails to start, is tried again after 2, 4, 8, ... check periods
(at most `MAX_BACKOFF` s); a server left without a DHT peer exits at its next record refresh (`Server._heal`),
for its supervisor to start it again.
Clients meanwhile retry a span's only server with a short back-off (`swarm.client.transport.manager`).
"""
from __future__ import annotations

import asyncio
import logging
import time
from typing import List, Optional, Protocol, Sequence

from hivemind.p2p import P2P, PeerID
from hivemind.utils.multiaddr import Multiaddr

from server.network.reachable import circuit_maddrs, relay_ids
from server.network.relay_probe import RelayProbe, SlotProbe, Verdict

logger = logging.getLogger("swarmgate.server")

CONNECT_TIMEOUT = 5.0  # seconds to try connecting to a relay
MAX_BACKOFF = 300.0  # most seconds between checks after renewals that got no slot
UNSURE_LIMIT = 3  # probes in a row that could not tell (the relay silent, a timeout) before the slot counts as lost


async def relay_answers(p2p: P2P, relays: Sequence[str], timeout: float = CONNECT_TIMEOUT) -> bool:
    """Whether one of `relays` (multiaddrs ending in /p2p/ID) accepts a connection from `p2p` now."""
    for text in relays:
        try:
            maddr = Multiaddr(text)
            peer = PeerID.from_base58(maddr["p2p"])
            await asyncio.wait_for(p2p._client.connect(peer, [maddr.decapsulate(Multiaddr(f"/p2p/{peer}"))]),
                                   timeout)
            return True
        except Exception as e:
            logger.debug(f"relay {text} does not answer: {type(e).__name__}: {e}")
    return False


class RelayedPeer(Protocol):
    """What the watch needs of the server's network: its p2pd handle now, and a restart behind a relay."""

    @property
    def p2p(self) -> Optional[P2P]: ...

    async def restart_relayed(self) -> List[str]:
        """A new DHT peer and p2pd with the same peer id, reserving a relay slot; its circuit addresses."""
        ...


class Rehost(Protocol):
    """What a renewal needs of the serving side (the server process)."""

    async def detach_handlers(self, p2p: P2P) -> None:
        """Unregister the RPC handlers from the p2pd that goes."""

    async def attach_handlers(self, p2p: P2P) -> None:
        """Register the RPC handlers (if blocks are served) on the new p2pd."""

    async def reannounce(self) -> None:
        """Announce the record online again (through the new DHT peer)."""


class RelayWatch:
    """Checks a relayed server's reservation and renews it (see the module docstring); `relays`: the multiaddrs of
    the relays it may use (the server's initial peers)."""

    def __init__(self, period: float, relays: Sequence[str], probe: Optional[SlotProbe] = None):
        self.period = period
        self.relays = tuple(relays)
        self.probe: SlotProbe = probe if probe is not None else RelayProbe()
        self.next_check = time.monotonic() + period
        self.lost_since: Optional[float] = None
        self.renewals = 0  # reservations made again (logs, tests)
        self.failures = 0  # renewals in a row that got no slot: the next check waits longer (up to MAX_BACKOFF)
        self.unsure = 0  # probes in a row that could not tell (UNSURE_LIMIT of them: lost)

    def due(self) -> bool:
        return self.period > 0 and time.monotonic() >= self.next_check

    async def check(self, peer: RelayedPeer, rehost: Rehost) -> bool:
        """One check; True if the reservation was renewed now."""
        self.next_check = time.monotonic() + self.period
        circuits: List[str] = []
        p2p = peer.p2p
        try:
            if p2p is None:
                raise RuntimeError("no p2pd handle")
            circuits = circuit_maddrs(await p2p.get_visible_maddrs(latest=True))
        except Exception as e:  # p2pd gone: treated as a lost slot (the DHT process check stops the server)
            logger.debug(f"reading this peer's addresses failed: {type(e).__name__}: {e}")
        if circuits and p2p is not None:
            why = await self._probe(p2p, circuits)
            if why is None:
                return False
        else:
            why = "p2pd lists no relay circuit address for it (the relay restarted or dropped the connection)"
        if self.lost_since is None:
            self.lost_since = time.monotonic()
            logger.warning(f"relay: this server has no relay slot any more: {why}; renewing it once a relay answers")
        # (no p2p: an earlier renewal failed half-way; its DHT peer is gone, so try again without asking)
        if peer.p2p is not None and not await relay_answers(peer.p2p, self.relays):
            return False
        return await self.renew(peer, rehost)

    async def _probe(self, p2p: P2P, circuits: List[str]) -> Optional[str]:
        """Dial this peer through its relays (`RelayProbe`): None while the slot counts as held, else why not."""
        verdict = await self.probe.probe(p2p.peer_id, circuits)
        if verdict is Verdict.HELD:
            if self.lost_since is not None or self.unsure:
                logger.info("relay: a dial through the relay reaches this server again")
            self.lost_since, self.unsure = None, 0
            return None
        if verdict is Verdict.UNKNOWN:
            self.unsure += 1
            if self.unsure < UNSURE_LIMIT:
                logger.info(f"relay: could not tell whether the relay still holds this server's slot "
                            f"({self.probe.last_error}); asking again at the next check")
                return None
            return (f"{self.unsure} dials through the relay in a row did not get through (last: "
                    f"{self.probe.last_error})")
        return f"its relay refused a dial to it although p2pd still lists the circuit address ({self.probe.last_error})"

    async def close(self) -> None:
        """End the probe's p2pd."""
        await self.probe.close()

    def _back_off(self, what: str) -> None:
        self.failures += 1
        self.next_check = time.monotonic() + min(MAX_BACKOFF, self.period * 2 ** self.failures)
        logger.warning(f"relay: {what}; trying again in {self.next_check - time.monotonic():.0f}s")

    async def renew(self, peer: RelayedPeer, rehost: Rehost) -> bool:
        began = time.monotonic()
        old = peer.p2p
        if old is not None:
            try:
                await asyncio.wait_for(rehost.detach_handlers(old), CONNECT_TIMEOUT)
            except Exception:  # the old p2pd is going anyway
                pass
        try:
            circuits = await peer.restart_relayed()  # (failing, it leaves the peer without a p2pd handle)
        except Exception as e:  # e.g. the relay went away again while the DHT peer joined through it
            self._back_off(f"could not restart the DHT peer ({type(e).__name__}: {e})")
            return False
        new = peer.p2p
        if new is not None:
            await rehost.attach_handlers(new)
        if not circuits:
            self._back_off("restarted the DHT peer but got no relay slot")
            return False
        self.failures = self.unsure = 0
        try:
            await rehost.reannounce()
        except Exception as e:  # the DHT peer is new and may be busy: the serving loop's next refresh announces
            logger.warning(f"relay: announcing after the renewal failed ({type(e).__name__}: {e}); the next record "
                           "refresh announces again")
        self.renewals += 1
        lost_for = time.monotonic() - (self.lost_since or began)
        self.lost_since = None
        logger.info(f"relay: serving through relay {', '.join(relay_ids(circuits))} again (slot lost for "
                    f"{lost_for:.1f}s, renewed in {time.monotonic() - began:.1f}s)")
        return True
