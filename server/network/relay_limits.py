"""Which relay service answers on a peer that offers relay service: ours, or libp2p's defaults; restart until ours.

hivemind 1.1.12's p2pd (go-libp2p 0.32) installs two circuit relay v2 services for the one hop protocol
(`HOP_PROTOCOL`) on a peer that offers relay service (`swarm.runtime.relays`): ours, from `-relayService` with
`--relay_data_limit` and `--relay_time_limit` (p2pd's `-relayTimeLimit`), which libp2p's relay manager starts in a
goroutine once it sees the peer's (forced) reachability `public`; and, because `-relay` is on, one from
`relay.New(host)` right after the host is made, with libp2p's defaults (`LIBP2P_DEFAULT`: 128 KiB per direction and
2 minutes per relayed connection). Each sets the protocol's stream handler, so the one that comes second serves for
the p2pd's life: a race with no flag to settle it (`-relay=false` drops both; reachability is fixed at start, so
ours never starts again; source: the learning-at-home go-libp2p-daemon fork, `p2pd/main.go`, `EnableRelayV2`).
Measured: the defaults served in 4 of 6 relay starts of tests/e2e/test_nat.py, and in 22 of 36 starts of a DHT peer
on loopback, cutting relayed connections after 128 KiB (about 55 tokens of the bundled model's hidden states).
(With GOMAXPROCS=1 in p2pd's environment ours served in 10 of 10 starts: Go's scheduler then ran the relay manager's
goroutine after `EnableRelayV2`. Not used: it orders nothing for sure, and caps the relay's p2pd at one core.)

Once the p2pd has started, nothing registers the handler again, so one reading tells which service serves for good.
The reading (`read_limit`): a small p2pd (the relay probe's, `server.network.relay_probe.RelayProbe.prober`)
connects to the peer directly, opens a stream on the hop protocol and sends a circuit v2 RESERVE; the STATUS answer
carries the serving service's `limit` {duration (s), data (bytes)}. Then it disconnects (the relay drops a
reservation when its peer disconnects). `ensure_our_limits` reads, and while the limit is not ours restarts the peer
(a new p2pd: the race is run again), at most `MAX_RESTARTS` times, then logs a warning that relayed connections are
cut at the limit it read (with 20 restarts, about 0.6**21 = 2e-5 of starts end with the defaults). A reading that
fails (no answer, a refusal) restarts nothing: it is logged. Cost, measured for `swarmgate dht`: the probe p2pd
starts in 0.13 s (~45 MiB resident until it ends after the check), a reading takes 0.07 s, a restart 0.2-0.4 s;
ready in 2.2 s instead of 1.8 s (median of 10 starts).
`swarmgate dht` (`launch.bootstrap`) and directly reachable servers (`server.network.identity.ServerNetwork.settle`)
run it before they announce anything, when `should_check` says so (`--relay_limits_check auto`: a peer that listens
and announces on loopback only is reached by no peer that would need a relay, and skips it). The circuit v2 messages
are built field by field with protobuf's descriptor API (`_hop_message`), as libp2p's `circuit.proto` defines them.
"""
from __future__ import annotations

import asyncio
import ipaddress
import logging
from dataclasses import dataclass
from typing import Any, Awaitable, Callable, List, Optional, Sequence, Tuple

from google.protobuf import descriptor_pb2, descriptor_pool, message_factory
from hivemind.p2p import P2P, PeerID
from hivemind.p2p.p2p_daemon_bindings.utils import read_pbmsg_safe, write_pbmsg
from hivemind.utils.multiaddr import Multiaddr

from server.network.relay_probe import RelayProbe
from swarm.runtime.relays import RelaySettings
from swarm.wire.reachability import dialable_maddrs

logger = logging.getLogger("swarmgate.relay")

HOP_PROTOCOL = "/libp2p/circuit/relay/0.2.0/hop"
READ_TIMEOUT = 5.0  # seconds to connect, reserve and read the answer
MAX_RESTARTS = 20  # restarts after a limit not ours is read (the defaults served in 22 of 36 starts: measured)
STATUS_OK = 100  # circuit v2 Status.OK
RESERVE, STATUS = 0, 2  # HopMessage.Type


@dataclass(frozen=True)
class RelayLimit:
    """A relay service's limit per relayed connection: `duration` seconds, `data` bytes per direction (0: none)."""
    duration: int
    data: int

    def __str__(self) -> str:
        return f"{self.data} bytes per direction, {self.duration}s per relayed connection"


LIBP2P_DEFAULT = RelayLimit(duration=120, data=128 << 10)  # go-libp2p 0.32 relay.DefaultLimit


def should_check(settings: RelaySettings, maddrs: Sequence[str]) -> bool:
    """Whether a peer offering relay service with `settings`, listening on and announcing `maddrs`, checks which
    service serves (`--relay_limits_check`): `auto` when some address reaches beyond loopback (no address: p2pd's
    default, every interface). A relay that only loopback reaches relays for nobody: the peers on its own host dial
    each other directly."""
    if settings.no_relay or settings.relay_limits_check == "off":
        return False
    if settings.relay_limits_check == "on" or not maddrs:
        return True
    return any(not _loopback(m) for m in maddrs)


def _loopback(maddr: str) -> bool:
    parts = maddr.split("/")
    protocol, host = (parts[1], parts[2]) if len(parts) > 2 else ("", "")
    if protocol in ("ip4", "ip6"):
        try:
            return ipaddress.ip_address(host).is_loopback
        except ValueError:
            return False
    return protocol in ("dns", "dns4", "dns6") and host == "localhost"


def our_limit(settings: RelaySettings) -> RelayLimit:
    """The limit our relay service (`-relayService`) announces with these settings."""
    return RelayLimit(duration=settings.relay_time_limit, data=settings.relay_data_limit)


def _hop_message() -> Any:
    """The circuit v2 `HopMessage` class (fields as in libp2p's circuit.proto, proto2), built with protobuf's
    descriptor API in a pool of its own."""
    f = descriptor_pb2.FieldDescriptorProto
    opt, rep = f.LABEL_OPTIONAL, f.LABEL_REPEATED
    file = descriptor_pb2.FileDescriptorProto(name="swarmgate_circuit_v2.proto", package="circuit.pb", syntax="proto2")

    def message(name: str, *fields: tuple) -> None:
        msg = file.message_type.add(name=name)
        for number, (field, label, kind, type_name) in enumerate(fields, start=1):
            msg.field.add(name=field, number=number, label=label, type=kind, **({"type_name": type_name} if type_name
                                                                                else {}))

    message("Peer", ("id", opt, f.TYPE_BYTES, ""), ("addrs", rep, f.TYPE_BYTES, ""))
    message("Reservation", ("expire", opt, f.TYPE_UINT64, ""), ("addrs", rep, f.TYPE_BYTES, ""),
            ("voucher", opt, f.TYPE_BYTES, ""))
    message("Limit", ("duration", opt, f.TYPE_UINT32, ""), ("data", opt, f.TYPE_UINT64, ""))
    # (enums as plain integers: Type RESERVE=0 CONNECT=1 STATUS=2; Status OK=100, refusals 200-204, 400-401)
    message("HopMessage", ("type", opt, f.TYPE_INT32, ""), ("peer", opt, f.TYPE_MESSAGE, ".circuit.pb.Peer"),
            ("reservation", opt, f.TYPE_MESSAGE, ".circuit.pb.Reservation"),
            ("limit", opt, f.TYPE_MESSAGE, ".circuit.pb.Limit"), ("status", opt, f.TYPE_INT32, ""))
    pool = descriptor_pool.DescriptorPool()
    pool.Add(file)
    return message_factory.GetMessageClass(pool.FindMessageTypeByName("circuit.pb.HopMessage"))


HopMessage = _hop_message()


class RelayRefused(Exception):
    """The relay answered the RESERVE with something other than STATUS OK."""


def limit_of(answer: Any) -> RelayLimit:
    """The limit in a STATUS answer to RESERVE (no `limit` field: unlimited, 0/0); `RelayRefused` otherwise."""
    if answer.type != STATUS or answer.status != STATUS_OK:
        raise RelayRefused(f"answered type {answer.type} status {answer.status} to RESERVE")
    if not answer.HasField("limit"):
        return RelayLimit(duration=0, data=0)
    return RelayLimit(duration=answer.limit.duration, data=answer.limit.data)


def local_maddrs(visible: Sequence[Any], host_maddrs: Sequence[str]) -> List[str]:
    """Where a probe on this host dials this peer: its visible addresses (without /p2p/), then each fixed-port
    wildcard listen address on loopback (a peer announcing only a public address may not be reachable at it from
    inside its own network)."""
    out: List[str] = []
    for text in dialable_maddrs(visible) + [
            m.replace("/ip4/0.0.0.0/", "/ip4/127.0.0.1/").replace("/ip6/::/", "/ip6/::1/") for m in host_maddrs
            if not m.endswith("/tcp/0") and "/tcp/0/" not in m and "/udp/0/" not in m]:
        if text not in out:
            out.append(text)
    return out


async def read_limit(prober: P2P, relay: PeerID, maddrs: Sequence[str], timeout: float = READ_TIMEOUT) -> RelayLimit:
    """Connect `prober` to `relay` at `maddrs` (its direct addresses), RESERVE on the hop protocol, and return the
    serving service's limit; disconnects again."""
    async def ask() -> RelayLimit:
        await prober._client.connect(relay, [Multiaddr(m) for m in maddrs])
        _, reader, writer = await prober._client.stream_open(relay, [HOP_PROTOCOL])
        try:
            await write_pbmsg(writer, HopMessage(type=RESERVE))
            answer = HopMessage()
            await read_pbmsg_safe(reader, answer)
        finally:
            writer.close()
        return limit_of(answer)

    try:
        return await asyncio.wait_for(ask(), timeout)
    finally:
        try:
            await asyncio.wait_for(prober._client.disconnect(relay), timeout)
        except Exception:  # not connected
            pass


async def ensure_our_limits(read: Callable[[], Awaitable[RelayLimit]], restart: Callable[[], Awaitable[None]],
                            ours: RelayLimit, max_restarts: int = MAX_RESTARTS,
                            stopping: Callable[[], bool] = lambda: False) -> Optional[RelayLimit]:
    """Read the serving limit (`read`) and `restart` the peer while it is not `ours`, at most `max_restarts` times
    and not once `stopping()` (a stop signal came: the process ends instead). Returns the last limit read (None: the
    reading failed, nothing restarted; or the process is stopping); logs a warning unless it is ours."""
    restarts = 0
    while True:
        if stopping():
            return None
        try:
            seen = await read()
        except Exception as e:
            logger.warning(f"relay: could not read which limits this peer's relay service serves with "
                           f"({type(e).__name__}: {e}); relayed connections may be cut at libp2p's defaults "
                           f"({LIBP2P_DEFAULT})")
            return None
        if seen == ours:
            if restarts:
                logger.info(f"relay: serving with our limits ({ours}) after {restarts} restart(s)")
            return seen
        which = "libp2p's defaults" if seen == LIBP2P_DEFAULT else "a limit not ours"
        if restarts >= max_restarts:
            logger.warning(f"relay: this peer's relay service serves with {which} ({seen}), not ours ({ours}), "
                           f"after {restarts} restart(s): relayed connections through it are cut at that limit")
            return seen
        restarts += 1
        logger.info(f"relay: this peer's relay service serves with {which} ({seen}), not ours ({ours}): "
                    f"restarting its p2pd ({restarts}/{max_restarts}; hivemind 1.1.12's p2pd races two services)")
        await restart()


async def keep_our_limits(settings: RelaySettings, where: Callable[[], Awaitable[Tuple[PeerID, Sequence[Any]]]],
                          host_maddrs: Sequence[str], restart: Callable[[], Awaitable[None]],
                          stopping: Callable[[], bool] = lambda: False) -> Optional[RelayLimit]:
    """`ensure_our_limits` for a peer offering relay service with `settings`: each reading dials the peer at
    `where()` (its current peer id and visible addresses; `local_maddrs` with its `host_maddrs`) from the relay
    probe's small p2pd, which ends after the check."""
    probe = RelayProbe()

    async def read() -> RelayLimit:
        peer, visible = await where()
        return await read_limit(await probe.prober(), peer, local_maddrs(visible, host_maddrs))

    try:
        return await ensure_our_limits(read, restart, our_limit(settings), stopping=stopping)
    finally:
        await probe.close()
