"""The server's network identity, in one object: `ServerNetwork`.

It owns the DHT peer (`start_dht`) and this process's handle on its p2pd, how the server is reached (`direct`, or
`relayed` behind a NAT: `settle`, `server.network.reachable`), the dial-back checks it offers others when directly
reachable, a relayed peer's key file (its peer id survives p2pd restarts), the relay watch
(`server.network.relay_watch`) and the restart as a relayed DHT client (`restart_relayed`), and closing all of it.
A directly reachable server that offers relay service is restarted, before it announces anything, while its p2pd's
relay service serves with libp2p's defaults instead of ours (`server.network.relay_limits`; same peer id with
`--identity_path`, else a new one: no record, proof or READY line named the old one yet; DHT peers that met it
drop it as a dead contact).
Only this object replaces the DHT peer or the p2pd handle; the others read them through `dht` / `p2p` when they use
them (the record through `server.placement.announce.DHTPeer`; the serving side is handed the new p2pd by the relay
watch, `Rehost`), so that a relayed restart reaches everyone at once.
"""
from __future__ import annotations

import asyncio
import logging
import os
import shutil
import tempfile
from typing import List, Optional

import hivemind
from hivemind.p2p import P2P

from server.config import ServerConfig
from server.network.reachable import (
    ADDRS_WAIT,
    RELAY_WAIT,
    dial_back,
    own_maddrs,
    relay_ids,
)
from server.network.relay_limits import keep_our_limits, should_check
from server.network.relay_watch import Rehost, RelayWatch
from swarm.runtime.relays import relay_dht_kwargs
from swarm.runtime.swarm_key import join_dht
from swarm.wire.reachability import DIRECT, RELAYED, DialBackService, Reachable

logger = logging.getLogger("swarmgate.server")

CLOSE_TIMEOUT = 1.0  # seconds to close the dial-back service's probe p2pd, and our handle on p2pd


def start_dht(config: ServerConfig, relayed: bool = False, identity_path: Optional[str] = None,
              restart: bool = False) -> hivemind.DHT:
    """The server's DHT peer: joins `--initial_peers`, or starts a new swarm with `--new_swarm`. Directly
    reachable (`relayed=False`): a full DHT peer that offers relay service (`swarm.runtime.relays`); `relayed`: a
    DHT client that reserves a slot on a relay (its initial peers) and is dialed through it. `identity_path`: the
    private key file (default `--identity_path`); `restart`: it replaces a peer of the same identity."""
    if not config.new_swarm and not config.initial_peers:
        raise ValueError("give --initial_peers to join a swarm, or --new_swarm to start one")
    return join_dht(
        config.load_swarm_key(), initial_peers=[] if config.new_swarm else config.initial_peers,
        host_maddrs=config.listen_maddrs(), announce_maddrs=config.announced_maddrs() or None,
        identity_path=identity_path or config.identity_path, client_mode=relayed,
        # a restart reuses the identity of the peer it replaces, which other peers may still know
        **({"check_if_identity_free": False} if relayed or restart else {}),
        **relay_dht_kwargs(config, offer=not relayed, reserve=relayed, relays=config.initial_peers),
    )


class ServerNetwork:
    """The server's DHT peer, p2pd handle, reachability and relay (see the module docstring)."""

    def __init__(self, config: ServerConfig):
        self.config = config
        self._dht: Optional[hivemind.DHT] = None
        self._p2p: Optional[P2P] = None
        self.reachable: Reachable = DIRECT  # `settle` decides: or "relayed", served through a relay
        self.dial_back: Optional[DialBackService] = None  # the dial-back checks offered others (directly reachable)
        self.relay_identity: Optional[str] = None  # a relayed peer's key file (its peer id survives p2pd restarts)
        self.relay_watch: Optional[RelayWatch] = None  # a relayed server's check of its relay slot

    # ---- what the others read ------------------------------------------------------------------------------
    @property
    def dht(self) -> Optional[hivemind.DHT]:
        """The DHT peer now (None before `start`; a relayed restart replaces it)."""
        return self._dht

    @property
    def p2p(self) -> Optional[P2P]:
        """This process's handle on the DHT peer's p2pd now (None until `handle`, and after a failed restart)."""
        return self._p2p

    @property
    def started_dht(self) -> hivemind.DHT:
        assert self._dht is not None, "start() starts the DHT peer first"
        return self._dht

    @property
    def peer_id(self) -> str:
        return self.started_dht.peer_id.to_base58()

    def dht_running(self) -> bool:
        """Whether the DHT peer's process is up (False before `start`)."""
        return self._dht is not None and self._dht.is_alive()

    def dht_died(self) -> bool:
        """Whether a started DHT peer's process has died (a server then exits for its supervisor to restart it)."""
        return self._dht is not None and not self._dht.is_alive()

    # ---- starting, settling, restarting ----------------------------------------------------------------------
    async def start(self) -> None:
        """Start the DHT peer (directly reachable until `settle` says otherwise)."""
        self._dht = await asyncio.get_running_loop().run_in_executor(None, start_dht, self.config)

    async def handle(self) -> P2P:
        """This process's p2pd handle (made once, again after a restart)."""
        if self._p2p is None:
            self._p2p = await self.started_dht.replicate_p2p()
        return self._p2p

    async def settle(self) -> Reachable:
        """Check reachability and set the DHT peer up for it (restarting it behind a relay if needed: then a relay
        watch is kept); `Unreachable` when nobody can dial it and it may not use a relay. Returns `reachable`."""
        p2p = await self.handle()
        verdict = await dial_back(p2p, self.config)
        if verdict.reached is not False:
            if should_check(self.config, self.config.listen_maddrs() + self.config.announced_maddrs()):
                p2p = await self._with_our_relay_limits()
            self.dial_back = DialBackService()
            await self.dial_back.add_p2p_handlers(p2p)
            self.reachable = DIRECT
            return self.reachable
        refusal = verdict.refusal(self.config)
        if refusal is not None:
            raise refusal
        # the direct peer goes: a DHT client that reserves a relay slot replaces it (before anything was announced)
        circuits = await self.restart_relayed()
        if not circuits:
            raise verdict.no_slot()
        logger.info(f"not reachable directly at {', '.join(verdict.tried)}: serving through relay "
                    f"{', '.join(relay_ids(circuits))} (DHT in client mode)")
        self.reachable = RELAYED
        self.relay_watch = RelayWatch(self.config.relay_check_period, self.config.initial_peers)
        return self.reachable

    async def _with_our_relay_limits(self) -> P2P:
        """Restart the (direct) DHT peer while its relay service serves with a limit not ours
        (`server.network.relay_limits`, read by the relay probe's small p2pd, ended after); the p2pd handle now."""
        async def where():
            p2p = await self.handle()
            return p2p.peer_id, await own_maddrs(p2p)

        async def restart() -> None:
            await self._drop_dht()
            self._dht = await asyncio.get_running_loop().run_in_executor(
                None, lambda: start_dht(self.config, restart=True))

        await keep_our_limits(self.config, where, self.config.listen_maddrs(), restart)
        return await self.handle()

    async def _drop_dht(self) -> None:
        """End our p2pd handle and the DHT peer (bounded)."""
        if self._p2p is not None:
            try:
                await asyncio.wait_for(self._p2p.shutdown(), 5)
            except Exception:  # its p2pd may be gone already
                pass
            self._p2p = None
        if self._dht is not None:
            await asyncio.get_running_loop().run_in_executor(None, self._dht.shutdown)

    async def restart_relayed(self, timeout: float = RELAY_WAIT) -> List[str]:
        """Replace the DHT peer (and p2pd) by a DHT client that reserves a slot on a relay, with the same peer id
        (`--identity_path`, else a key file of this process's own: `relay_identity`); returns its circuit addresses
        once it has some (empty: none within `timeout`). p2pd's autorelay (go-libp2p 0.32) backs a relay off for an
        hour after each reservation, so a lost reservation is only made again by a new p2pd. Failing half-way, it
        leaves no p2pd handle (and a dead DHT peer, which ends the server at its next record refresh)."""
        loop = asyncio.get_running_loop()
        if self.relay_identity is None:
            self.relay_identity = self.config.identity_path or os.path.join(
                tempfile.mkdtemp(prefix="swarmgate-identity-"), "relayed.key")
        identity = self.relay_identity
        await self._drop_dht()
        self._dht = await loop.run_in_executor(
            None, lambda: start_dht(self.config, relayed=True, identity_path=identity))
        return await own_maddrs(await self.handle(), relayed=True, timeout=timeout)

    async def own_maddrs(self) -> List[str]:
        """This peer's addresses to tell (relayed: its circuit addresses, waited for as long as a reservation may
        take); empty: none yet."""
        relayed = self.reachable == RELAYED
        return await own_maddrs(await self.handle(), relayed=relayed, timeout=RELAY_WAIT if relayed else ADDRS_WAIT)

    async def watch_relay(self, rehost: Rehost) -> bool:
        """A relayed server's periodic check of its relay slot, when due (`RelayWatch`); True if renewed now."""
        if self.relay_watch is None or not self.relay_watch.due():
            return False
        return await self.relay_watch.check(self, rehost)

    # ---- closing ---------------------------------------------------------------------------------------------
    async def close(self) -> None:
        """Close the relay watch's probe, the dial-back service, our p2pd handle and the DHT process (each bounded),
        and remove a relayed peer's own key file."""
        if self.relay_watch is not None:
            try:  # the relay probe's own p2pd
                await asyncio.wait_for(self.relay_watch.close(), CLOSE_TIMEOUT)
            except Exception:
                pass
        if self.dial_back is not None:
            try:  # the probe p2pd of the dial-back checks it answered
                await asyncio.wait_for(self.dial_back.close(), CLOSE_TIMEOUT)
            except Exception:
                pass
        if self._p2p is not None:
            try:  # our handle on p2pd: its reader tasks end instead of being destroyed pending at exit
                await asyncio.wait_for(self._p2p.shutdown(), CLOSE_TIMEOUT)
            except Exception:
                pass
        if self._dht is not None:
            await asyncio.get_running_loop().run_in_executor(None, self._dht.shutdown)
        if self.relay_identity is not None and self.relay_identity != self.config.identity_path:
            shutil.rmtree(os.path.dirname(self.relay_identity), ignore_errors=True)  # our own key file
