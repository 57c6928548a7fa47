"""Whether a relayed server can be dialed through its relay now: `RelayProbe` dials it there, as a client would.

A relayed server's own circuit addresses are no reliable sign that its relay still holds its slot: go-libp2p 0.32's
autorelay (hivemind 1.1.12's p2pd) drops a relay's circuit address only when it sees every connection to that relay
end. When the relay restarts, the peer may never see the old connection end (its FIN and RST lost, as behind a
router that dropped the connection's state: tests/e2e/test_nat.py, where the address alone said "held" for as long
as the drop lasted), or be connected to the relay again (its DHT reconnects as a plain peer) before it does; the
address then stays until the reservation is due for refreshing (about an hour) while the relay holds no slot for it.
Being connected to the relay is no sign either, for that same reason.

The one reliable sign is what a client does: dial the server at its circuit address. A p2pd cannot dial itself, so
the probe keeps a small p2pd of its own (`hivemind.P2P.create`, listening nowhere, no DHT; started at the first
probe: 0.1 s; about 64 MiB resident in test_nat), which at each probe connects to the server through each relay of
its circuit addresses (`/p2p/RELAY/p2p-circuit`, within `PROBE_TIMEOUT`) and disconnects again. The relay answers a
dial to a peer it holds no slot for with NO_RESERVATION; a dial that gets through reaches the server's own p2pd.
Verdicts:
- `HELD`: a relayed connection to the server was made through one of its relays;
- `LOST`: every relay refused: NO_RESERVATION (it holds no slot for the server), or CONNECTION_FAILED (it holds
  one but could not reach the server over it); no client can reach the server then;
- `UNKNOWN`: anything else (a relay that does not answer, a timeout, no probe p2pd, or a direct connection made
  instead: the probe p2pd learned one of the server's LAN addresses); the watch decides after a few in a row.
A probe that is not `HELD` ends its p2pd (the next probe starts a new one): its dial back-off for the server's
address (go-libp2p skips an address that failed for up to minutes) and the addresses it learned would colour the
next probe. Cost of a `HELD` probe: one relayed connection set up and closed (at the server, its relay and the
probe p2pd) over the probe p2pd's standing connection to the relay; the probe p2pd's share, measured in test_nat,
~7 ms of CPU per check (0.4 s in its first 78 s, 0.3 s of it starting).
"""
from __future__ import annotations

import asyncio
import enum
import logging
from typing import Dict, List, Optional, Protocol, Sequence, Tuple

import varint  # (hivemind's multiaddr encodes lengths with it)
from hivemind.p2p import P2P, PeerID
from hivemind.utils.multiaddr import Multiaddr
from hivemind.utils.multiaddr.protocols import protocol_with_name

from server.network.reachable import relay_ids

logger = logging.getLogger("swarmgate.server")

PROBE_TIMEOUT = 5.0  # seconds for one dial through a relay (and for starting or ending the probe p2pd)
# a relay's refusals that mean "no client reaches this peer through me" (circuit relay v2 status codes, as p2pd's
# error names them): it holds no slot for the peer (204), or it holds one but could not reach the peer over it (203)
LOST_STATUSES = ("NO_RESERVATION", "CONNECTION_FAILED")


class Verdict(enum.Enum):
    HELD = "held"
    LOST = "lost"
    UNKNOWN = "unknown"


def relay_circuits(circuits: Sequence[str]) -> Dict[str, str]:
    """One circuit address to dial per relay: {relay id: /.../p2p/RELAY/p2p-circuit} (any /p2p/SELF cut off)."""
    out: Dict[str, str] = {}
    for circuit in circuits:
        base = circuit.split("/p2p-circuit")[0] + "/p2p-circuit"
        out.setdefault(relay_ids([circuit])[0], base)
    return out


def dialable_circuit(circuit: str) -> Multiaddr:
    """`/TRANSPORT/p2p/RELAY/p2p-circuit` as p2pd reads it. Written from text, hivemind's `Multiaddr` encodes a /p2p/
    peer id as a CIDv1, which p2pd (go-multiaddr) rejects ("length greater than remaining number of bytes in
    buffer"): the relay's id goes in as its raw multihash (`PeerID.to_bytes`), as p2pd writes it."""
    transport, relay = circuit.split("/p2p-circuit")[0].rsplit("/p2p/", 1)
    peer = PeerID.from_base58(relay).to_bytes()
    p2p, hop = protocol_with_name("p2p"), protocol_with_name("p2p-circuit")
    return Multiaddr(Multiaddr(transport).to_bytes() + p2p.vcode + varint.encode(len(peer)) + peer + hop.vcode)


def judge(outcomes: Sequence[Verdict]) -> Verdict:
    """The probe's verdict from one outcome per relay: HELD if any relay got through, LOST if every relay refused
    (`LOST_STATUSES`), else UNKNOWN (no outcome at all: UNKNOWN)."""
    if Verdict.HELD in outcomes:
        return Verdict.HELD
    if outcomes and all(outcome is Verdict.LOST for outcome in outcomes):
        return Verdict.LOST
    return Verdict.UNKNOWN


class SlotProbe(Protocol):
    """What the relay watch needs of a probe (`RelayProbe`; tests give stubs)."""

    last_error: str

    async def probe(self, peer_id: PeerID, circuits: Sequence[str]) -> Verdict: ...

    async def close(self) -> None: ...


class _ProbeP2P(P2P):
    """hivemind's p2pd handle, with a mode hivemind lacks: no libp2p DHT at all (`dht_mode="none"`; a DHT client
    would join the libp2p DHT through the relay and connect to the swarm's peers)."""

    DHT_MODE_MAPPING = {**P2P.DHT_MODE_MAPPING, "none": {}}


class RelayProbe:
    """Dials a relayed server through its relays from a p2pd of its own (see the module docstring)."""

    def __init__(self, timeout: float = PROBE_TIMEOUT):
        self.timeout = timeout
        self._p2p: Optional[P2P] = None
        self.last_error = ""  # why the last probe was not HELD (logs)

    async def prober(self) -> P2P:
        """The probe p2pd (started at the first call; `close` ends it)."""
        if self._p2p is None:
            # (hivemind's own start-up bound: it ends a daemon that did not start, which cancelling `create` from
            # outside, as `wait_for` did, left running until this process exits)
            self._p2p = await _ProbeP2P.create(host_maddrs=[], no_listen=True, auto_nat=False, nat_port_map=False,
                                               use_relay=True, dht_mode="none", conn_manager=False,
                                               startup_timeout=self.timeout)
        return self._p2p

    async def probe(self, peer_id: PeerID, circuits: Sequence[str]) -> Verdict:
        """Dial `peer_id` through each relay of its `circuits` (its own circuit addresses) once; the verdict."""
        outcomes: List[Verdict] = []
        errors: List[str] = []
        try:
            prober = await self.prober()
        except Exception as e:  # e.g. p2pd cannot start on a loaded machine: nothing can be told now
            self.last_error = f"the probe p2pd did not start ({type(e).__name__}: {e})"
            return Verdict.UNKNOWN
        for relay, circuit in relay_circuits(circuits).items():
            outcome, why = await self._dial(prober, peer_id, circuit)
            outcomes.append(outcome)
            if outcome is Verdict.HELD:
                break
            errors.append(f"through {relay}: {why}")
        verdict = judge(outcomes)
        if verdict is not Verdict.HELD:
            self.last_error = "; ".join(errors) or "no circuit address to dial"
            await self.close()  # its dial back-off and learned addresses would colour the next probe
        return verdict

    async def _dial(self, prober: P2P, peer_id: PeerID, circuit: str) -> Tuple[Verdict, str]:
        try:
            await asyncio.wait_for(prober._client.connect(peer_id, [dialable_circuit(circuit)]), self.timeout)
        except asyncio.TimeoutError:
            return Verdict.UNKNOWN, f"no connection within {self.timeout:.0f}s"
        except Exception as e:
            text = f"{type(e).__name__}: {e}"
            return (Verdict.LOST if any(status in str(e) for status in LOST_STATUSES) else Verdict.UNKNOWN), text
        try:
            peers = await asyncio.wait_for(prober._client.list_peers(), self.timeout)
            addrs = [str(a) for info in peers if info.peer_id == peer_id for a in info.addrs]
            await asyncio.wait_for(prober._client.disconnect(peer_id), self.timeout)
        except Exception as e:
            return Verdict.UNKNOWN, f"connected, but p2pd did not say how ({type(e).__name__}: {e})"
        if any("/p2p-circuit" in addr for addr in addrs):
            return Verdict.HELD, ""
        return Verdict.UNKNOWN, f"connected directly ({', '.join(addrs) or 'no address'}), not through the relay"

    async def close(self) -> None:
        """End the probe p2pd (bounded; a later probe starts a new one)."""
        p2p, self._p2p = self._p2p, None
        if p2p is not None:
            try:
                await asyncio.wait_for(p2p.shutdown(), self.timeout)
            except Exception:  # it may be gone already
                pass
