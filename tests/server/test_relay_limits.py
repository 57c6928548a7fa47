"""Which relay service serves on a real p2pd (`server.network.relay_limits`): the relay probe's p2pd sends a circuit
v2 RESERVE and reads the serving service's limit; a DHT peer offering relay service is restarted until it is ours
(hivemind 1.1.12's p2pd races ours against libp2p's defaults at each start), within the bounded restarts; and the
session's bootstrap peer (`swarmgate dht`, which runs that check before it is ready) serves with ours. That relayed
connections then carry more than the defaults' 128 KiB: tests/e2e/test_nat.py (extended, network namespaces), whose
chats go through a relayed server. The decision itself on stubs: test_relay_limits_unit.py."""
from __future__ import annotations

import asyncio
from typing import Any, List

from hivemind.p2p import PeerID

from launch.bootstrap import BootstrapConfig
from server.network.relay_limits import (
    LIBP2P_DEFAULT,
    MAX_RESTARTS,
    RelayLimit,
    ensure_our_limits,
    local_maddrs,
    our_limit,
    read_limit,
)
from server.network.relay_probe import RelayProbe
from swarm.runtime.relays import RelaySettings, relay_dht_kwargs
from swarm.runtime.swarm_key import join_dht


def test_a_relay_peer_is_restarted_until_our_relay_service_serves():
    settings = RelaySettings(relay_data_limit=1 << 30)
    ours = our_limit(settings)

    def start() -> Any:
        return join_dht(None, host_maddrs=["/ip4/127.0.0.1/tcp/0"], **relay_dht_kwargs(settings, offer=True,
                                                                                        reserve=False))

    async def run() -> List[RelayLimit]:
        loop = asyncio.get_running_loop()
        probe, dht, seen = RelayProbe(), await loop.run_in_executor(None, start), []

        async def read() -> RelayLimit:
            maddrs = local_maddrs(await loop.run_in_executor(None, dht.get_visible_maddrs), [])
            seen.append(await read_limit(await probe.prober(), dht.peer_id, maddrs))
            return seen[-1]

        async def restart() -> None:
            nonlocal dht
            await loop.run_in_executor(None, dht.shutdown)
            dht = await loop.run_in_executor(None, start)

        try:
            assert await ensure_our_limits(read, restart, ours) == ours
        finally:
            await probe.close()
            await loop.run_in_executor(None, dht.shutdown)
        return seen

    seen = asyncio.run(run())
    # every start serves with one of the two services, and the check ends at ours within its bound
    assert seen[-1] == ours and set(seen) <= {ours, LIBP2P_DEFAULT} and len(seen) <= MAX_RESTARTS + 1


def test_the_bootstrap_peer_serves_relayed_connections_with_our_limits(bootstrap):
    async def read() -> RelayLimit:
        probe = RelayProbe()
        try:
            peer = PeerID.from_base58(bootstrap.maddr.split("/p2p/")[1])
            return await read_limit(await probe.prober(), peer, [bootstrap.maddr.split("/p2p/")[0]])
        finally:
            await probe.close()

    assert asyncio.run(read()) == our_limit(BootstrapConfig())
