"""The server's network identity, `server.network`: one `ServerNetwork` owns the DHT peer and p2pd, and the record
reads them from it; settled direct, its relay service serves with our limits (`server.network.relay_limits`: the
relay probe's RESERVE reads them); a relayed server's `RelayWatch` renews a lost slot in order (handlers off the
old p2pd, a relayed restart, handlers on the new p2pd, the record announced again) and backs off when a renewal
fails; a circuit address p2pd still lists counts as a slot only while a dial through the relay gets through
(`RelayProbe`).

Real processes: the network joins the session's bootstrap peer (`swarmgate dht`, which answers its dial-back check
and offers relay service) on loopback; the watch looks at a real p2pd's own addresses (no relay slot: no circuit
address; or, for the probe's verdicts, a stale circuit address put in its place) and dials a real relay (the
bootstrap peer) or a dead address; the probe dials a real p2pd through the bootstrap peer, which holds no slot for
it (NO_RESERVATION), or through a dead address. The relayed restart itself is the watch's `RelayedPeer` side,
recorded here; a slot actually held (libp2p reserves only on relays with public addresses) and its loss when the
relay restarts are tests/e2e/test_nat.py (extended, network namespaces)."""
from __future__ import annotations

import asyncio
import time
from typing import List, Optional

import torch
from hivemind.p2p import P2P, PeerID

from server.config import ServerConfig
from server.network.identity import ServerNetwork
from server.network.relay_limits import local_maddrs, our_limit, read_limit
from server.network.relay_probe import RelayProbe, Verdict, dialable_circuit, judge, relay_circuits
from server.network.relay_watch import UNSURE_LIMIT, RelayWatch
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
    config = ServerConfig(model=model_path, initial_peers=[bootstrap.maddr], host_maddrs=["/ip4/127.0.0.1/tcp/0"],
                          relay_limits_check="on")  # (on loopback alone, `auto` would skip it)

    async def run():
        network = ServerNetwork(config)
        record = Announcer("tnetwork", 10.0, 4, torch.float32, lambda: 0, peer=network)
        assert network.dht is None and network.p2p is None and record.dht is None
        assert not network.dht_running() and not network.dht_died()
        await network.start()
        try:
            assert await network.settle() == "direct"  # the bootstrap peer dialed it back (or could not tell)
            probe = RelayProbe()  # (settling restarted it while libp2p's defaults served relayed connections)
            try:
                maddrs = local_maddrs(await network.own_maddrs(), [])
                assert await read_limit(await probe.prober(), network.started_dht.peer_id, maddrs) == our_limit(config)
            finally:
                await probe.close()
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


class Stale:
    """A real p2pd whose own addresses are read as `circuits` (as p2pd lists a circuit address after its relay
    restarted); everything else is the p2pd's."""

    def __init__(self, p2p: P2P, circuits: List[str]):
        self._inner, self.circuits = p2p, circuits

    def __getattr__(self, name):
        return getattr(self._inner, name)

    async def get_visible_maddrs(self, latest: bool = False):
        return self.circuits


class Verdicts:
    """A probe (`SlotProbe`) that answers `verdicts` in turn and records what it was asked."""

    def __init__(self, *verdicts: Verdict):
        self.verdicts, self.closed = list(verdicts), False
        self.asked: List[tuple] = []
        self.last_error = ""

    async def probe(self, peer_id, circuits):
        self.asked.append((peer_id, list(circuits)))
        verdict = self.verdicts.pop(0)
        self.last_error = "" if verdict is Verdict.HELD else f"stub: {verdict.value}"
        return verdict

    async def close(self) -> None:
        self.closed = True


def test_a_listed_circuit_counts_only_while_a_dial_through_the_relay_gets_through(bootstrap):
    relay_id = bootstrap.maddr.rsplit("/p2p/", 1)[-1]
    stale = f"{bootstrap.maddr}/p2p-circuit"

    async def run():
        p2p = await P2P.create()
        try:
            peer_circuit = f"{stale}/p2p/{p2p.peer_id}"
            events: list = []
            new_handle = object()
            # lost while no relay answers (this p2pd is not connected to it yet): nothing is restarted
            watch = RelayWatch(60.0, [f"/ip4/127.0.0.1/tcp/1/p2p/{relay_id}"], probe=Verdicts(Verdict.LOST))
            peer = Relayed(Stale(p2p, [peer_circuit]), events, new_handle, [CIRCUIT])
            assert await watch.check(peer, Serving(events)) is False
            assert events == [] and watch.lost_since is not None
            await watch.close()
            assert isinstance(watch.probe, Verdicts) and watch.probe.closed
            # held: nothing happens, and the probe dials this peer through the circuit p2pd lists
            probe = Verdicts(Verdict.HELD)
            watch = RelayWatch(60.0, [bootstrap.maddr], probe=probe)
            peer = Relayed(Stale(p2p, [peer_circuit]), events, new_handle, [CIRCUIT])
            assert await watch.check(peer, Serving(events)) is False
            assert events == [] and watch.lost_since is None and probe.asked == [(p2p.peer_id, [peer_circuit])]
            # the relay refuses (NO_RESERVATION): lost at once, renewed in order although p2pd lists the circuit
            watch = RelayWatch(60.0, [bootstrap.maddr], probe=Verdicts(Verdict.LOST))
            old = peer.p2p
            assert await watch.check(peer, Serving(events)) is True
            assert events == [("detach", old), "restart", ("attach", new_handle), "reannounce"], events
            assert watch.renewals == 1 and watch.lost_since is None
            # the probe cannot tell (the relay silent, a timeout): lost only after UNSURE_LIMIT checks in a row,
            # and a HELD in between starts the count again
            events.clear()
            unsure = [Verdict.UNKNOWN] * (UNSURE_LIMIT - 1)
            probe = Verdicts(*unsure, Verdict.HELD, *unsure, Verdict.UNKNOWN)
            watch = RelayWatch(60.0, [bootstrap.maddr], probe=probe)
            peer = Relayed(Stale(p2p, [peer_circuit]), events, new_handle, [CIRCUIT])
            for _ in range(2 * UNSURE_LIMIT - 1):
                assert await watch.check(peer, Serving(events)) is False
                assert events == [] and watch.lost_since is None
            assert watch.unsure == UNSURE_LIMIT - 1
            assert await watch.check(peer, Serving(events)) is True
            assert [e for e in events if isinstance(e, str)] == ["restart", "reannounce"] and watch.unsure == 0
        finally:
            await p2p.shutdown()

    asyncio.run(run())


def test_the_probe_dials_through_a_real_relay_and_tells_a_refusal_from_silence(bootstrap):
    relay_id = bootstrap.maddr.rsplit("/p2p/", 1)[-1]

    async def run():
        p2p = await P2P.create()  # no slot on the bootstrap peer (a relay on loopback reserves nothing)
        probe = RelayProbe(timeout=10.0)
        try:
            own = f"{bootstrap.maddr}/p2p-circuit/p2p/{p2p.peer_id}"
            # the relay answers and refuses: it holds no slot for this peer
            assert await probe.probe(p2p.peer_id, [own]) is Verdict.LOST
            assert "NO_RESERVATION" in probe.last_error and relay_id in probe.last_error, probe.last_error
            assert probe._p2p is None  # a probe that did not get through ends its p2pd (its dial back-off goes)
            # the same again (a new probe p2pd): the same verdict, not a back-off's
            assert await probe.probe(p2p.peer_id, [own]) is Verdict.LOST
            # a relay that does not answer: nothing can be told
            dead = f"/ip4/127.0.0.1/tcp/1/p2p/{relay_id}/p2p-circuit"
            assert await probe.probe(p2p.peer_id, [dead]) is Verdict.UNKNOWN
            assert "NO_RESERVATION" not in probe.last_error and probe.last_error
        finally:
            await probe.close()
            await p2p.shutdown()

    asyncio.run(run())


def test_the_probe_judges_per_relay_and_writes_circuits_as_p2pd_reads_them():
    ed = "12D3KooWFbYB8dm9JYxdCBhn4ohj7xRUjke7ekwUy9Cw7aSKUDcy"
    rsa = "QmXVjwzepVA6zJL7iuFDZCdnhgu1QjYGJGSdgSWRzwUyeW"
    circuits = [f"/ip4/1.2.3.4/tcp/1/p2p/{ed}/p2p-circuit/p2p/{rsa}", f"/ip4/1.2.3.5/tcp/2/p2p/{ed}/p2p-circuit",
                f"/ip4/1.2.3.6/tcp/3/p2p/{rsa}/p2p-circuit/p2p/{rsa}"]
    assert relay_circuits(circuits) == {ed: f"/ip4/1.2.3.4/tcp/1/p2p/{ed}/p2p-circuit",
                                        rsa: f"/ip4/1.2.3.6/tcp/3/p2p/{rsa}/p2p-circuit"}
    for relay in (ed, rsa):
        text = f"/ip4/1.2.3.4/tcp/1/p2p/{relay}/p2p-circuit"
        maddr = dialable_circuit(text + f"/p2p/{rsa}")
        assert str(maddr) == text
        raw = PeerID.from_base58(relay).to_bytes()  # the raw multihash, not hivemind's CIDv1 of it
        assert raw in maddr.to_bytes() and maddr.to_bytes().endswith(raw + bytes([0xA2, 0x02]))
    H, L, U = Verdict.HELD, Verdict.LOST, Verdict.UNKNOWN
    assert judge([L, H]) is H and judge([L, L]) is L and judge([L, U]) is U and judge([U]) is U and judge([]) is U
