"""The socket on which p2pd hands this process its incoming streams: its accept backlog (`install`).

hivemind 1.1.12 (`ControlClient.listen`) opens that unix socket with asyncio's default backlog of 100. p2pd (Go)
connects to it once for every incoming stream (every session's `rpc_inference` stream, every round stream, every
training call); when more than 100 of those connections wait for this process's event loop to accept them (a burst
of session openings: 256 one-token streams through a gateway at once), the next connect fails at once with EAGAIN
and p2pd resets the stream, so the caller sees its stream closed without a reply ("the server closed the session")
and retries or fails. `install()` makes that listen use `STREAM_BACKLOG` pending connections (the kernel caps it at
`net.core.somaxconn`, 4096 on current Linux); the TCP form of the socket gets the same backlog.

`swarm.runtime.dht_process.DHTProcess` installs it, before any DHT peer (or its replica's handlers) listens.
"""
from __future__ import annotations

import asyncio
import logging
from contextlib import asynccontextmanager
from typing import AsyncIterator, Optional

logger = logging.getLogger(__name__)

STREAM_BACKLOG = 4096
HIVEMIND_VERSION = "1.1.12"  # whose `ControlClient.listen` this reproduces, backlog aside
SOMAXCONN = "/proc/sys/net/core/somaxconn"

_installed = False


def kernel_cap() -> Optional[int]:
    """The kernel's cap on any listen backlog (`net.core.somaxconn`), where it can be read."""
    try:
        with open(SOMAXCONN) as f:
            return int(f.read().strip())
    except (OSError, ValueError):
        return None


def install() -> None:
    """Make hivemind's `ControlClient.listen` accept up to `STREAM_BACKLOG` pending stream connections (idempotent)."""
    global _installed
    if _installed:
        return
    import hivemind
    from hivemind.p2p.p2p_daemon_bindings import control

    if hivemind.__version__ != HIVEMIND_VERSION:
        logger.warning(f"hivemind {hivemind.__version__}: its stream listener is replaced by the one of hivemind "
                       f"{HIVEMIND_VERSION} with a backlog of {STREAM_BACKLOG} (swarm.runtime.p2p_listen); check it")
    cap = kernel_cap()
    if cap is not None and cap < STREAM_BACKLOG:
        logger.warning(f"net.core.somaxconn is {cap}: more than {cap} streams arriving at once may be reset by p2pd "
                       f"(raise it to {STREAM_BACKLOG})")
    from hivemind.utils.multiaddr import protocols

    @asynccontextmanager
    async def listen(self) -> AsyncIterator["control.ControlClient"]:
        proto_code = control.parse_conn_protocol(self.listen_maddr)
        if proto_code == protocols.P_UNIX:
            path = self.listen_maddr.value_for_protocol(protocols.P_UNIX)
            server = await asyncio.start_unix_server(self._handler, path=path, backlog=STREAM_BACKLOG)
        elif proto_code == protocols.P_IP4:
            host = self.listen_maddr.value_for_protocol(protocols.P_IP4)
            port = int(self.listen_maddr.value_for_protocol(protocols.P_TCP))
            server = await asyncio.start_server(self._handler, port=port, host=host, backlog=STREAM_BACKLOG)
        else:
            raise ValueError(f"Protocol not supported: {protocols.protocol_with_code(proto_code)}")
        async with server:
            yield self

    control.ControlClient.listen = listen
    _installed = True
