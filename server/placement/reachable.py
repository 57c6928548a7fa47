"""How a starting server joins the swarm: directly reachable, or behind a NAT and served through a relay.

After its DHT peer has started (and before it places or loads any block), a server that joins a swarm asks up to
three of its initial peers to dial it back on its announced addresses (`swarm.wire.reachability`):
- reached (or nobody could tell, or `--skip_reachability_check`, or `--new_swarm`): `direct`, as always; the
  server then offers dial-back checks and relay service to others;
- not reached, relays on (the default): the DHT peer is restarted as a DHT client that reserves a slot on a relay
  (`swarm.runtime.relays`); the server waits until it has a relay circuit address, logs one line, and announces
  `reachable: relayed` in its record (no slot within `RELAY_WAIT`: `Unreachable`);
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
import os
import tempfile
import time
from typing import List

from server.placement.announce import start_dht
from swarm.wire.reachability import (
    DIRECT,
    RELAYED,
    DialBackService,
    Reachable,
    check_reachability,
    checker_peers,
    dialable_maddrs,
)

logger = logging.getLogger("swarmgate.server")

RELAY_WAIT = 60.0  # seconds to get a relay circuit address (a busy machine makes the reservation late)
ADDRS_WAIT = 30.0  # seconds a directly reachable peer waits for p2pd to tell its own addresses
FIRST_RETRY, MAX_RETRY = 0.25, 4.0  # seconds between asks: doubling from FIRST_RETRY up to MAX_RETRY


class Unreachable(RuntimeError):
    """Nobody can dial this server, and it may not use a relay."""


def circuit_maddrs(maddrs) -> List[str]:
    return [str(m) for m in maddrs if "/p2p-circuit" in str(m)]


async def settle_reachability(server) -> Reachable:
    """Check `server`'s reachability and set up its DHT peer for it (restarting it behind a relay if needed);
    `server.dht` and `server.p2p` are the peer to use afterwards. Returns `direct` or `relayed`."""
    config = server.config
    if server.p2p is None:
        server.p2p = await server.started_dht.replicate_p2p()
    verdict = None
    if not config.new_swarm and not config.skip_reachability_check:
        tried = dialable_maddrs(await own_maddrs(server.p2p))
        checkers = checker_peers(config.initial_peers)
        began = time.monotonic()
        verdict = await check_reachability(server.p2p, checkers, tried)
        logger.debug(f"reachability check by {len(checkers)} peer(s): {verdict} in {time.monotonic() - began:.2f}s")
        if verdict is None:
            logger.info("could not check reachability (no initial peer answered a dial-back request): assuming "
                        "this server is directly reachable")
    if verdict is not False:
        server.dial_back = DialBackService()
        await server.dial_back.add_p2p_handlers(server.p2p)
        return DIRECT
    if config.no_relay or config.no_auto_relay:
        flag = "--no_relay" if config.no_relay else "--no_auto_relay"
        raise Unreachable(
            f"no peer of the swarm can dial this server at {', '.join(tried)} (checked by {len(checkers)} peer(s)), "
            f"and {flag} forbids serving through a relay: forward the port on your router and give "
            f"--public_ip (or --announce_maddrs with the public address), or drop {flag}")
    # the direct peer goes: a DHT client that reserves a relay slot replaces it (before anything was announced)
    circuits = await restart_relayed(server)
    if not circuits:
        raise Unreachable(f"no peer of the swarm can dial this server at {', '.join(tried)}, and no relay gave it a "
                          f"slot within {RELAY_WAIT:.0f}s: forward the port on your router and give --public_ip (or "
                          f"--announce_maddrs)")
    logger.info(f"not reachable directly at {', '.join(tried)}: serving through relay {', '.join(relay_ids(circuits))} "
                f"(DHT in client mode)")
    return RELAYED


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


async def restart_relayed(server, timeout: float = RELAY_WAIT) -> List[str]:
    """Replace `server`'s DHT peer (and p2pd) by a DHT client that reserves a slot on a relay, with the same peer
    id (`--identity_path`, else a key file of this process's own: `server.relay_identity`); returns its circuit
    addresses once it has some (empty: none within `timeout`). p2pd's autorelay (go-libp2p 0.32) backs a relay
    off for an hour after each reservation, so a lost reservation is only made again by a new p2pd."""
    loop = asyncio.get_running_loop()
    if server.relay_identity is None:
        server.relay_identity = server.config.identity_path or os.path.join(
            tempfile.mkdtemp(prefix="swarmgate-identity-"), "relayed.key")
    if server.p2p is not None:
        try:
            await asyncio.wait_for(server.p2p.shutdown(), 5)
        except Exception:  # its p2pd may be gone already
            pass
        server.p2p = None
    if server.dht is not None:
        await loop.run_in_executor(None, server.dht.shutdown)
    server.dht = server.record.dht = await loop.run_in_executor(
        None, lambda: start_dht(server.config, relayed=True, identity_path=server.relay_identity))
    server.p2p = await server.started_dht.replicate_p2p()
    return await own_maddrs(server.p2p, relayed=True, timeout=timeout)
