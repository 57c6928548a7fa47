"""The server's network identity, `server.network`: one `ServerNetwork` owns the DHT peer and p2pd, and the record
reads them from it; a relayed server's `RelayWatch` renews a lost slot in order (handlers off the old p2pd, a
relayed restart, handlers on the new p2pd, the record announced again) and backs off when a renewal fails.

Real processes: the network joins the session's bootstrap peer (`swarmgate dht`, which answers its dial-back check)
on loopback; the watch looks at a real p2pd's own addresses (no relay slot: no circuit address) and dials a real
relay (the bootstrap peer) or a dead address. The relayed restart itself is the watch's `RelayedPeer` side, recorded
here; with real relays in network namespaces it is tests/e2e/test_nat.py (extended)."""
from __future__ import annotations

import asyncio
import time
from typing import List, Optional

import torch
from hivemind.p2p import P2P

from server.config import ServerConfig
from server.network.identity import ServerNetwork
from server.network.relay_watch import RelayWatch
from server.placement.announce import Announcer

CIRCUIT = "/ip4/10.0.0.1/tcp/4001/p2p/QmRelay/p2p-circuit"


class Serving:
    """The serving side of a renewal (`Rehost`), recording what the watch asks of it."""

    def __init__(self, events: list):
        self.events = events

    async def detach_handlers(self, p2p) -> None:
        self.events.append(("detach", p2p))

    async def attach_handlers(self, p2p) -> None:
        self.events.append(("attach", p2p))

    async def reannounce(self) -> None:
        self.events.append("reannounce")


class Relayed:
    """A relayed peer (`RelayedPeer`) over a real p2pd whose restart is recorded: it hands out `new` as its next
    p2pd handle and returns `circuits`, or fails as a restart through a vanished relay does (no handle left)."""

    def __init__(self, p2p: P2P, events: list, new: object, circuits: List[str], fail: bool = False):
        self.p2p: Optional[object] = p2p
        self.events, self.new, self.circuits, self.fail = events, new, circuits, fail

    async def restart_relayed(self) -> List[str]:
        self.events.append("restart")
        self.p2p = None
        if self.fail:
            raise RuntimeError("the relay went away while joining")
        self.p2p = self.new
        return self.circuits


def test_the_network_joins_settles_direct_and_the_record_reads_it(model_path, bootstrap):
    config = ServerConfig(model=model_path, initial_peers=[bootstrap.maddr], host_maddrs=["/ip4/127.0.0.1/tcp/0"])

    async def run():
        network = ServerNetwork(config)
        record = Announcer("tnetwork", 10.0, 4, torch.float32, lambda: 0, peer=network)
        assert network.dht is None and network.p2p is None and record.dht is None
        assert not network.dht_running() and not network.dht_died()
        await network.start()
        try:
            assert await network.settle() == "direct"  # the bootstrap peer dialed it back (or could not tell)
            assert network.dial_back is not None and network.relay_watch is None and network.p2p is not None
            assert record.dht is network.dht and record.reachable == "direct"
            assert record.info(record.state, 0, 1).reachable == "direct"
            maddrs = await network.own_maddrs()
            assert maddrs and all(m.endswith(f"/p2p/{network.peer_id}") for m in maddrs), maddrs
            assert network.dht_running() and not network.dht_died()
            assert await network.watch_relay(Serving([])) is False  # directly reachable: no relay to watch
        finally:
            await network.close()
        assert not network.dht_running()

    asyncio.run(run())


def test_a_lost_relay_slot_is_renewed_in_order_and_a_failed_renewal_backs_off(bootstrap):
    dead_relay = f"/ip4/127.0.0.1/tcp/1/p2p/{bootstrap.maddr.rsplit('/p2p/', 1)[-1]}"

    async def run():
        p2p = await P2P.create()  # a real p2pd without a relay slot: it tells no circuit address
        try:
            events: list = []
            new_handle = object()
            # no relay answers: nothing is restarted (a DHT client cannot join without one)
            watch = RelayWatch(60.0, [dead_relay])
            assert await watch.check(Relayed(p2p, events, new_handle, [CIRCUIT]), Serving(events)) is False
            assert events == [] and watch.lost_since is not None and watch.renewals == 0
            # the relay answers: handlers off the old p2pd, restart, handlers on the new one, announce again
            watch = RelayWatch(60.0, [bootstrap.maddr])
            assert not watch.due()
            assert await watch.check(Relayed(p2p, events, new_handle, [CIRCUIT]), Serving(events)) is True
            assert events == [("detach", p2p), "restart", ("attach", new_handle), "reannounce"], events
            assert watch.renewals == 1 and watch.failures == 0 and watch.lost_since is None
            # a restart that fails backs off (2 periods), and leaves the peer without a handle; the next check then
            # restarts without asking a relay, and a restart that gets no slot backs off longer (4 periods)
            events.clear()
            watch = RelayWatch(10.0, [bootstrap.maddr])
            peer = Relayed(p2p, events, new_handle, [], fail=True)
            began = time.monotonic()
            assert await watch.check(peer, Serving(events)) is False
            assert events == [("detach", p2p), "restart"] and peer.p2p is None and watch.failures == 1
            assert began + 20.0 <= watch.next_check <= time.monotonic() + 20.0
            events.clear()
            peer.fail = False
            assert await watch.check(peer, Serving(events)) is False
            assert events == ["restart", ("attach", new_handle)] and watch.failures == 2 and watch.renewals == 0
            assert 30.0 < watch.next_check - time.monotonic() <= 40.0
        finally:
            await p2p.shutdown()

    asyncio.run(run())
