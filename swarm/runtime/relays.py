"""libp2p circuit relays: which peers offer relay service, which ones reserve a slot on a relay, and the limits.

A peer behind a NAT cannot be dialed; it can still serve if it keeps a connection open to a relay (a reachable
peer of the swarm) and announces a `/p2p/RELAY/p2p-circuit` address: others then dial it through that relay.
Here (hivemind 1.1.12's p2pd, circuit relay v2):
- *offering* relay service (`swarmgate dht` and every directly reachable server, unless `--no_relay`): p2pd's
  `-relayService` with `--relay_max_circuits` relayed connections per peer, `--relay_data_limit` bytes per
  connection and direction and `--relay_time_limit` seconds per connection; libp2p starts the service only on a
  peer that considers itself publicly reachable, so such a peer forces its reachability to `public` (its
  reachability was checked, or it is a bootstrap peer);
  hivemind 1.1.12's p2pd also installs a relay service with libp2p's defaults (128 KiB per relayed connection) that
  may serve instead: `server.network.relay_limits` checks which one does, and restarts the peer until ours does;
- *using* a relay (an unreachable server, unless `--no_relay` or `--no_auto_relay`): `use_auto_relay` with the
  reachability forced to `private` and its initial peers as static relays (p2pd's `-trustedRelays`, with relay
  discovery off), so that it reserves a slot at once (with discovery, libp2p waits up to 3 minutes for 4
  candidates);
- *dialing through* relays (every peer, clients and gateways included): hivemind's `use_relay`, on by default.

`RelaySettings` are the flags shared by the server's and the bootstrap peer's configs; `relay_dht_kwargs` turns
them into `hivemind.DHT` arguments (the extra p2pd flags go through `swarm.runtime.dht_process.DHTProcess`).
"""
from __future__ import annotations

from typing import Any, Dict, Literal, Sequence

from pydantic import Field

from swarm.runtime.config import ProcessConfig


class RelaySettings(ProcessConfig):
    no_relay: bool = Field(default=False, description="neither offer relay service to peers behind a NAT nor use "
                                                      "relays (an unreachable server then exits)")
    relay_max_circuits: int = Field(default=16, gt=0, le=1024,
                                    description="relay service: most relayed connections open for one peer")
    relay_data_limit: int = Field(default=4 << 30, gt=0,
                                  description="relay service: most bytes relayed in each direction of one relayed "
                                              "connection before it is reset")
    relay_limits_check: Literal["auto", "on", "off"] = Field(
        default="auto", description="at start, check that the relay service serves with these limits and not "
                                    "libp2p's defaults (128 KiB, 2 minutes; hivemind's p2pd runs both), restarting "
                                    "the DHT peer until it does: auto: when the peer listens or announces beyond "
                                    "loopback (a relay only loopback reaches relays for nobody), on, off")
    relay_time_limit: int = Field(default=24 * 3600, gt=0, le=(1 << 32) - 1,
                                  description="relay service: most seconds one relayed connection lasts before it is "
                                              "reset (p2pd's own default, 30 minutes, cut every client's connection "
                                              "to a relayed server, and the sessions on it, twice an hour)")


def relay_dht_kwargs(settings: RelaySettings, *, offer: bool, reserve: bool,
                     relays: Sequence[str] = ()) -> Dict[str, Any]:
    """`hivemind.DHT` arguments: `offer` relay service (a reachable peer), `reserve` a slot on one of `relays`
    (multiaddrs: an unreachable peer's initial peers); `p2pd_extra` are p2pd flags that hivemind does not expose
    (`DHTProcess` passes them)."""
    offer = offer and not settings.no_relay
    reserve = reserve and not settings.no_relay
    kwargs: Dict[str, Any] = {"use_relay": not settings.no_relay, "use_auto_relay": reserve}
    extra: Dict[str, Any] = {"relayService": offer}
    if reserve:
        kwargs["force_reachability"] = "private"
        # static relays: p2pd reserves a slot at once (with discovery, libp2p waits minutes for 4 candidates)
        kwargs["trusted_relays"] = list(relays)
        extra["relayDiscovery"] = False
    elif offer:
        kwargs["force_reachability"] = "public"
    if offer:
        extra.update(relayMaxCircuits=settings.relay_max_circuits, relayDataLimit=settings.relay_data_limit,
                     relayTimeLimit=f"{settings.relay_time_limit}s")
    kwargs["p2pd_extra"] = extra
    return kwargs
