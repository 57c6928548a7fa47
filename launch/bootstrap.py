"""`swarmgate dht`: a bootstrap DHT peer that others join; it serves no blocks.

It listens on `--host_maddrs` (optionally with a fixed `--identity_path`, so its address is known in advance),
prints `SWARMGATE_READY {json}` with the multiaddrs others join with, and runs until SIGINT/SIGTERM (then stops
its DHT process and p2pd: `swarm.runtime.lifecycle`). It offers relay service to peers behind a NAT (unless
`--no_relay`; `swarm.runtime.relays`), with our limits: before it prints READY it reads which relay service its
p2pd serves with and restarts the DHT peer while it is libp2p's defaults (`server.network.relay_limits`; about 0.2 s
a restart), and dial-back checks to starting servers (`swarm.wire.reachability`).
"""
from __future__ import annotations

import asyncio
import json
import logging
import os
import sys
import threading
from typing import Any, Callable, List, Optional

from pydantic import Field

from server.network.relay_limits import keep_our_limits, should_check
from swarm.runtime import lifecycle
from swarm.runtime.config import config_from_argv, setup_logging
from swarm.runtime.relays import RelaySettings, relay_dht_kwargs
from swarm.runtime.swarm_key import SwarmKeySettings, join_dht
from swarm.wire.reachability import DialBackService

logger = logging.getLogger("swarmgate.dht")
CHECKS_START_TIMEOUT = 10.0


class BootstrapConfig(SwarmKeySettings, RelaySettings):
    host_maddrs: List[str] = Field(default_factory=lambda: ["/ip4/0.0.0.0/tcp/31337"],
                                   description="multiaddrs to listen on")
    announce_maddrs: List[str] = Field(default_factory=list, description="multiaddrs to announce to others")
    identity_path: Optional[str] = Field(default=None,
                                         description="private key file (created if missing) for a fixed peer id")
    initial_peers: List[str] = Field(default_factory=list, description="other bootstrap peers to connect to")
    write_maddrs: Optional[str] = Field(default=None, description="also write the multiaddrs to join, one a line, "
                                                                  "to this file (for containers that start later)")
    log_level: str = Field(default="INFO", description="logging level")


def main(argv=None) -> int:
    config = config_from_argv(BootstrapConfig, argv, "swarmgate dht", "Run a bootstrap DHT peer for a private swarm.",
                              section="dht")
    setup_logging(config.log_level)
    key = config.load_swarm_key()
    if key is not None:
        logger.info(f"private swarm: DHT requests need the swarm key (fingerprint {key.fingerprint})")
    stop = threading.Event()
    lifecycle.on_stop_signals(stop.set)

    def start(restart: bool = False) -> Any:  # (a restart: the peer id was ours a moment ago)
        return join_dht(key, host_maddrs=config.host_maddrs, announce_maddrs=config.announce_maddrs or None,
                        identity_path=config.identity_path, initial_peers=config.initial_peers,
                        **({"check_if_identity_free": False} if restart else {}),
                        **relay_dht_kwargs(config, offer=True, reserve=False))

    loop = asyncio.new_event_loop()  # our relay limits' check, then the dial-back checks starting servers ask for
    threading.Thread(target=loop.run_forever, name="dial-back", daemon=True).start()
    try:
        dht = start()
        if should_check(config, list(config.host_maddrs) + list(config.announce_maddrs or [])):
            dht = asyncio.run_coroutine_threadsafe(_with_our_relay_limits(dht, lambda: start(restart=True), config,
                                                                          stop.is_set), loop).result()
    except Exception as e:
        print(f"error: cannot start the DHT peer: {e}", file=sys.stderr)
        loop.call_soon_threadsafe(loop.stop)
        return 1
    if stop.is_set():  # a stop signal during the relay limits check: no READY from a peer that is ending
        loop.call_soon_threadsafe(loop.stop)
        dht.shutdown()
        return 0
    checks = DialBackService()
    p2p = asyncio.run_coroutine_threadsafe(_serve_dial_backs(dht, checks), loop).result(CHECKS_START_TIMEOUT)
    maddrs = [str(m) for m in dht.get_visible_maddrs()]
    print("SWARMGATE_READY " + json.dumps({"peer_id": dht.peer_id.to_base58(), "maddrs": maddrs,
                                               "swarm_key": key.fingerprint if key else None}), flush=True)
    for m in maddrs:
        print(f"join with: --initial_peers {m}", flush=True)
    if config.write_maddrs:
        reachable = [m for m in maddrs if "/127.0.0.1/" not in m] + [m for m in maddrs if "/127.0.0.1/" in m]
        tmp = config.write_maddrs + ".tmp"
        with open(tmp, "w") as f:
            f.write("\n".join(reachable) + "\n")
        os.replace(tmp, config.write_maddrs)
    try:
        stop.wait()
        logger.info("shutting down")
    finally:
        try:
            asyncio.run_coroutine_threadsafe(_stop_dial_backs(p2p, checks), loop).result(CHECKS_START_TIMEOUT)
        except Exception:
            pass
        loop.call_soon_threadsafe(loop.stop)
        dht.shutdown()
    return 0


async def _with_our_relay_limits(dht: Any, start: Callable[[], Any], config: BootstrapConfig,
                                 stopping: Callable[[], bool]) -> Any:
    """Restart the DHT peer (`start`) while its p2pd's relay service serves with a limit not ours
    (`server.network.relay_limits`); the DHT peer now. The relay probe's small p2pd reads it, and ends after."""
    loop = asyncio.get_running_loop()

    async def where():
        return dht.peer_id, await loop.run_in_executor(None, dht.get_visible_maddrs)

    async def restart() -> None:
        nonlocal dht
        await loop.run_in_executor(None, dht.shutdown)
        dht = await loop.run_in_executor(None, start)

    await keep_our_limits(config, where, config.host_maddrs, restart, stopping)
    return dht


async def _serve_dial_backs(dht, checks: DialBackService):
    p2p = await dht.replicate_p2p()
    await checks.add_p2p_handlers(p2p)
    return p2p


async def _stop_dial_backs(p2p, checks: DialBackService) -> None:
    await checks.close()
    await p2p.shutdown()
