"""Reachability: can other peers dial this one directly, or does it sit behind a NAT/firewall (and need a relay)?

A starting block server asks a few peers of the swarm (its initial peers: the bootstrap peers, or servers) to dial
it back on its announced addresses, before it announces any block: the `rpc_dial_back` RPC of `DialBackService`,
which `swarmgate dht` and every directly reachable server serve. The checker dials from a separate *probe* p2pd
(no listen address, relays off, disconnected again after each dial), so an existing connection from the asking
peer, or a relay, cannot make an unreachable address look reachable; libp2p's handshake checks that the peer
answering is the one that asked. Messages are typed and versioned (`DialBack`, `DialBackResult`, carried like the
block RPCs' in `swarm.wire.protocol`); a checker dials at most `MAX_MADDRS` plain TCP/UDP addresses (no relay
circuits), one at a time. The probe is started at the first request and kept (a check then costs about 10-40 ms on
loopback; the first one about 0.6 s).

`check_reachability` returns `True` (some checker reached us), `False` (checkers answered, none reached us) or
`None` (nobody could tell: no checker, or none answered; the server then assumes it is reachable, as before).
"""
from __future__ import annotations

import asyncio
import logging
import re
from typing import Final, Iterable, List, Literal, Optional, Sequence, Set, Tuple

from hivemind.p2p import P2P, P2PContext, PeerID, ServicerBase
from hivemind.proto import runtime_pb2
from hivemind.utils.multiaddr import Multiaddr
from pydantic import Field, field_validator

from swarm.wire import protocol as P

logger = logging.getLogger("swarmgate.reachability")

MAX_MADDRS = 8
DIAL_TIMEOUT = 5.0  # seconds a checker's probe tries to connect
CHECK_TIMEOUT = 15.0  # seconds a starting server waits for a checker's answer (the probe starts first)
MAX_CHECKERS = 3
MAX_WAITING = 8  # dial-back requests queued at one checker; more are refused as busy
RELAYED: Final = "relayed"
DIRECT: Final = "direct"
Reachable = Literal["direct", "relayed"]
PEER_ID = re.compile(r"[1-9A-HJ-NP-Za-km-z]{40,64}")  # base58 (libp2p peer ids: 46 or 52 characters)


class DialBack(P.Message):
    """Please dial `peer_id` on `maddrs` and say whether it answered."""
    type: Literal["dial_back"] = "dial_back"
    peer_id: str = Field(min_length=1, max_length=128)
    maddrs: List[str] = Field(min_length=1, max_length=MAX_MADDRS)

    @field_validator("peer_id")
    @classmethod
    def _peer(cls, value: str) -> str:
        if not PEER_ID.fullmatch(value):
            raise ValueError("not a base58 peer id")
        return value

    @field_validator("maddrs")
    @classmethod
    def _dialable(cls, value: List[str]) -> List[str]:
        for text in value:
            if len(text) > 256:
                raise ValueError("multiaddr too long")
            protocols = {p.name for p in Multiaddr(text).protocols()}
            if "p2p-circuit" in protocols or not protocols & {"tcp", "udp"}:
                raise ValueError(f"{text}: only direct TCP/UDP addresses are dialed back")
        return value


class DialBackResult(P.Message):
    type: Literal["dial_back_result"] = "dial_back_result"
    reachable: bool
    error: str = Field(default="", max_length=512)


class DialBackService(ServicerBase):
    """The checker side: dials the asking peer back from its probe p2pd, one dial at a time. The probe (no listen
    address, relays off) is started at the first request and kept: after each dial it is disconnected from the peer
    it dialed, so it holds no connection that a later check could reuse, and a peer that asks again gets a fresh
    probe (libp2p dials every address it knows for a peer, not only the ones given). `close()` stops it."""

    def __init__(self, dial_timeout: float = DIAL_TIMEOUT):
        self.dial_timeout = dial_timeout
        self._lock = asyncio.Lock()
        self._waiting = 0
        self._probe: Optional[P2P] = None
        self._dialed: Set[PeerID] = set()  # peers the probe has dialed (it remembers their addresses)
        self.checks = 0  # answered requests (tests, logs)

    @classmethod
    def _get_handle_name(cls, namespace: Optional[str], method_name: str) -> str:
        name = f"swarmgate.v{P.HANDLER_VERSION}.{method_name}"
        return f"{namespace}::{name}" if namespace is not None else name

    async def rpc_dial_back(self, request: runtime_pb2.ExpertRequest,
                            context: P2PContext) -> runtime_pb2.ExpertResponse:
        try:
            ask = P.decode(request.metadata, DialBack)
        except P.ProtocolError as e:
            return P.error_response("bad_request", str(e))
        if ask.peer_id != context.remote_id.to_base58():
            return P.error_response("bad_request", "a peer may only ask to be dialed back itself")
        if self._waiting >= MAX_WAITING:
            return P.error_response("busy", "too many dial-back requests waiting")
        self._waiting += 1
        try:
            async with self._lock:
                reachable, error = await self._dial(PeerID.from_base58(ask.peer_id), ask.maddrs)
        finally:
            self._waiting -= 1
        self.checks += 1
        return P.make_response(DialBackResult(reachable=reachable, error=error[:512]))

    async def _started_probe(self, peer: PeerID) -> P2P:
        child = getattr(self._probe, "_child", None)  # its p2pd process
        if peer in self._dialed:  # libp2p would also dial the addresses it learned then: a fresh probe
            await self.close()
        if self._probe is None or not self._probe.is_alive or child is None or child.returncode is not None:
            self._dialed.clear()
            self._probe = await P2P.create(host_maddrs=[], no_listen=True, use_relay=False, auto_nat=False,
                                           nat_port_map=False, dht_mode="client", idle_timeout=0)
        return self._probe

    async def _dial(self, peer: PeerID, maddrs: Sequence[str]) -> Tuple[bool, str]:
        try:
            probe = await self._started_probe(peer)
            self._dialed.add(peer)
        except Exception as e:
            return False, f"the checker could not start its probe: {type(e).__name__}: {e}"
        try:
            await asyncio.wait_for(probe._client.connect(peer, [Multiaddr(m) for m in maddrs]), self.dial_timeout)
            return True, ""
        except asyncio.TimeoutError:
            return False, f"no answer within {self.dial_timeout:g}s"
        except Exception as e:
            return False, f"{type(e).__name__}: {e}"
        finally:
            try:
                await asyncio.wait_for(probe._client.disconnect(peer), self.dial_timeout)
            except Exception:  # not connected; or the probe died (started again next time)
                pass

    async def close(self) -> None:
        probe, self._probe = self._probe, None
        if probe is not None:
            await probe.shutdown()


def checker_peers(initial_peers: Iterable[str], limit: int = MAX_CHECKERS) -> List[PeerID]:
    """The peer ids named in `initial_peers` (multiaddrs ending in /p2p/ID), in order, without repeats."""
    peers: List[PeerID] = []
    for text in initial_peers:
        try:
            peer = PeerID.from_base58(Multiaddr(text)["p2p"])
        except Exception:
            continue
        if peer not in peers:
            peers.append(peer)
    return peers[:limit]


def dialable_maddrs(maddrs: Iterable) -> List[str]:
    """This peer's own addresses a checker may dial: direct ones, without its /p2p/ suffix and relay circuits."""
    result = []
    for maddr in maddrs:
        text = str(maddr)
        if "/p2p-circuit" in text:
            continue
        text = text.split("/p2p/")[0]
        if text not in result:
            result.append(text)
    return result[:MAX_MADDRS]


async def ask_one(p2p: P2P, checker: PeerID, maddrs: Sequence[str], timeout: float = CHECK_TIMEOUT) -> Optional[bool]:
    """One checker's verdict (None: it did not answer, or does not offer the check)."""
    stub = DialBackService.get_stub(p2p, checker)
    try:
        response = await asyncio.wait_for(
            stub.rpc_dial_back(P.make_request(DialBack(peer_id=p2p.peer_id.to_base58(), maddrs=list(maddrs)))),
            timeout)
        result = P.decode(response.metadata, DialBackResult)
    except Exception as e:
        logger.debug(f"dial-back check by {checker} failed: {type(e).__name__}: {e}")
        return None
    if not result.reachable:
        logger.debug(f"{checker} could not dial {list(maddrs)}: {result.error}")
    return result.reachable


async def check_reachability(p2p: P2P, checkers: Sequence[PeerID], maddrs: Sequence[str],
                             timeout: float = CHECK_TIMEOUT) -> Optional[bool]:
    """True if any checker reached `maddrs`, False if some answered and none did, None if no checker answered."""
    checkers = [c for c in checkers if c != p2p.peer_id]
    if not checkers or not maddrs:
        return None
    verdicts = await asyncio.gather(*(ask_one(p2p, c, maddrs, timeout) for c in checkers))
    answered = [v for v in verdicts if v is not None]
    if not answered:
        return None
    return any(answered)
