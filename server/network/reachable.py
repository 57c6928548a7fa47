"""How a starting server is reached: the dial-back check, this peer's own addresses, and what a refusal says.

After its DHT peer has started (and before it places or loads any block), a server that joins a swarm asks up to
three of its initial peers to dial it back on its announced addresses (`swarm.wire.reachability`, `dial_back`):
- reached (or nobody could tell, or `--skip_reachability_check`, or `--new_swarm`): `direct`, as always; the
  server then offers dial-back checks and relay service to others;
- not reached, relays on (the default): the DHT peer is restarted as a DHT client that reserves a slot on a relay
  (`swarm.runtime.relays`; `server.network.identity.ServerNetwork.settle`); the server waits until it has a relay
  circuit address, logs one line, and announces `reachable: relayed` in its record (no slot within `RELAY_WAIT`:
  `Unreachable`);
- not reached, with `--no_relay` or `--no_auto_relay`: `Unreachable`, one line naming the addresses tried and the
  flags that help; the server exits 1 before loading any block.

This peer's own addresses (`own_maddrs`) are always asked of p2pd afresh, and waited for: p2pd answers "No
multiaddrs found for peer <own id>" (hivemind's `ValueError`) while it has none to announce, which is the case of
a relayed peer (its public addresses hidden: reachability `private`) until its relay reservation is in place, and
on a busy machine the reservation comes late. Never ask the DHT peer for them (`DHT.get_visible_maddrs()` without
`latest`): hivemind keeps the list p2pd gave when it started, which for a relayed peer may be empty for ever.
"""
from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, List, Optional

from hivemind.p2p import P2P

from swarm.wire.reachability import check_reachability, checker_peers, dialable_maddrs

if TYPE_CHECKING:  # (only annotations: `swarmgate dht`, which imports this module, loads no model code)
    from server.config import ServerConfig

logger = logging.getLogger("swarmgate.server")

RELAY_WAIT = 60.0  # seconds to get a relay circuit address (a busy machine makes the reservation late)
ADDRS_WAIT = 30.0  # seconds a directly reachable peer waits for p2pd to tell its own addresses
FIRST_RETRY, MAX_RETRY = 0.25, 4.0  # seconds between asks: doubling from FIRST_RETRY up to MAX_RETRY


class Unreachable(RuntimeError):
    """Nobody can dial this server, and it may not use a relay."""


@dataclass(frozen=True)
class DialBackVerdict:
    """What the dial-back check found: `reached` False (nobody could dial `tried`), True, or None (nobody could
    tell, or no check was made)."""

    reached: Optional[bool]
    tried: List[str]
    checkers: int

    def refusal(self, config: ServerConfig) -> Optional[Unreachable]:
        """Not reached and the flags forbid a relay: the one line that ends the server (None: a relay may serve)."""
        if self.reached is not False or not (config.no_relay or config.no_auto_relay):
            return None
        flag = "--no_relay" if config.no_relay else "--no_auto_relay"
        return Unreachable(
            f"no peer of the swarm can dial this server at {', '.join(self.tried)} (checked by {self.checkers} "
            f"peer(s)), and {flag} forbids serving through a relay: forward the port on your router and give "
            f"--public_ip (or --announce_maddrs with the public address), or drop {flag}")

    def no_slot(self) -> Unreachable:
        return Unreachable(f"no peer of the swarm can dial this server at {', '.join(self.tried)}, and no relay gave "
                           f"it a slot within {RELAY_WAIT:.0f}s: forward the port on your router and give --public_ip "
                           f"(or --announce_maddrs)")


async def dial_back(p2p: P2P, config: ServerConfig) -> DialBackVerdict:
    """Ask up to three initial peers to dial this peer back on its own addresses (none asked with `--new_swarm`
    or `--skip_reachability_check`)."""
    if config.new_swarm or config.skip_reachability_check:
        return DialBackVerdict(None, [], 0)
    tried = dialable_maddrs(await own_maddrs(p2p))
    checkers = checker_peers(config.initial_peers)
    began = time.monotonic()
    reached = await check_reachability(p2p, checkers, tried)
    logger.debug(f"reachability check by {len(checkers)} peer(s): {reached} in {time.monotonic() - began:.2f}s")
    if reached is None:
        logger.info("could not check reachability (no initial peer answered a dial-back request): assuming "
                    "this server is directly reachable")
    return DialBackVerdict(reached, tried, len(checkers))


def circuit_maddrs(maddrs) -> List[str]:
    return [str(m) for m in maddrs if "/p2p-circuit" in str(m)]


def relay_ids(circuits: List[str]) -> List[str]:
    """The relays' peer ids in circuit addresses (/.../p2p/RELAY/p2p-circuit/...)."""
    return sorted({m.split("/p2p-circuit")[0].rsplit("/p2p/", 1)[-1] for m in circuits})


async def own_maddrs(p2p, *, relayed: bool = False, timeout: float = ADDRS_WAIT) -> List[str]:
    """This peer's visible addresses as p2pd tells them now (`relayed`: its relay circuit addresses only), asked
    again with back-off while it has none (see the module docstring), for at most `timeout` seconds; logs one line
    if it has to wait. Empty: none within `timeout`."""
    began = time.monotonic()
    delay = FIRST_RETRY
    waiting = False
    while True:
        try:
            maddrs = [str(m) for m in await p2p.get_visible_maddrs(latest=True)]
        except ValueError as e:  # "No multiaddrs found for peer <own id>": none yet
            maddrs, why = [], str(e)
        else:
            why = "p2pd has no relay circuit address for it yet"
        if relayed:
            maddrs = circuit_maddrs(maddrs)
        left = timeout - (time.monotonic() - began)
        if maddrs or left <= 0:
            if waiting:
                logger.debug(f"waited {time.monotonic() - began:.1f}s for this peer's addresses: {maddrs}")
            return maddrs
        if not waiting:
            waiting = True
            what = "its relay reservation" if relayed else "p2pd to tell its addresses"
            logger.info(f"this server has no address to announce yet ({why}): waiting for {what}, up to "
                        f"{timeout:.0f}s")
        await asyncio.sleep(min(delay, left))
        delay = min(MAX_RETRY, 2 * delay)
