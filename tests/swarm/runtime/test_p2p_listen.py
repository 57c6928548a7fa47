"""A burst of incoming streams larger than asyncio's default accept backlog (100) reaches its handler
(`swarm.runtime.p2p_listen`): two real p2pd daemons on loopback, the receiving peer's event loop held busy while
the streams arrive (as a loaded server's is during a burst of session openings)."""
from __future__ import annotations

import asyncio
import threading
from typing import List

from hivemind.p2p import P2P

from swarm.runtime import p2p_listen

BURST = 160  # streams that arrive while the receiver's loop accepts none (over the default backlog of 100)


async def _echo(_info, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    data = await P2P.receive_raw_data(reader)
    await P2P.send_raw_data(data, writer)
    writer.close()


class _Receiver(threading.Thread):
    """A peer with an echo stream handler, on an event loop of its own."""

    def __init__(self):
        super().__init__(daemon=True)
        self.loop = asyncio.new_event_loop()
        self.ready = threading.Event()
        self.p2p: P2P = None  # type: ignore[assignment]
        self.maddrs: List = []

    def run(self) -> None:
        asyncio.set_event_loop(self.loop)

        async def start() -> None:
            self.p2p = await P2P.create(host_maddrs=["/ip4/127.0.0.1/tcp/0"])
            await self.p2p.add_binary_stream_handler("echo", _echo)
            self.maddrs = await self.p2p.get_visible_maddrs()
            self.ready.set()

        self.loop.run_until_complete(start())
        self.loop.run_forever()

    def stop(self) -> None:
        asyncio.run_coroutine_threadsafe(self.p2p.shutdown(), self.loop).result(timeout=30)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.join(timeout=30)


def test_a_burst_of_streams_over_the_default_backlog_all_reach_the_handler():
    p2p_listen.install()
    receiver = _Receiver()
    receiver.start()
    assert receiver.ready.wait(timeout=60)
    release = threading.Event()

    async def burst() -> List[object]:
        sender = await P2P.create(initial_peers=receiver.maddrs)
        try:
            async def one(i: int) -> bytes:
                _, reader, writer = await sender.call_binary_stream_handler(receiver.p2p.peer_id, "echo")
                await P2P.send_raw_data(b"stream %d" % i, writer)
                opened.append(i)
                if len(opened) == BURST:  # every stream is waiting for the receiver: let its loop accept them
                    asyncio.get_running_loop().call_later(0.5, release.set)
                return await asyncio.wait_for(P2P.receive_raw_data(reader), timeout=60)

            opened: List[int] = []
            # the receiver's loop accepts nothing until every stream of the burst has been opened and written to
            receiver.loop.call_soon_threadsafe(release.wait, 60)
            return await asyncio.gather(*(one(i) for i in range(BURST)), return_exceptions=True)
        finally:
            release.set()
            await sender.shutdown()

    try:
        replies = asyncio.run(burst())
    finally:
        receiver.stop()
    failed = [r for r in replies if not isinstance(r, bytes)]
    assert not failed, f"{len(failed)} of {BURST} streams failed, e.g. {failed[0]!r}"
    assert replies == [b"stream %d" % i for i in range(BURST)]


def test_the_listener_asks_for_the_backlog(monkeypatch, tmp_path):
    """Deterministic: the patched listen passes `STREAM_BACKLOG` to asyncio (the burst above needs p2pd to dial
    every connection while the receiver is held, which a slow machine may not do in time)."""
    from hivemind.p2p.p2p_daemon_bindings import control
    from hivemind.utils.multiaddr import Multiaddr

    p2p_listen.install()
    asked = {}
    real = asyncio.start_unix_server

    async def spy(*args, **kwargs):
        asked.update(kwargs)
        return await real(*args, **kwargs)

    monkeypatch.setattr(asyncio, "start_unix_server", spy)
    client = control.ControlClient.__new__(control.ControlClient)
    client.listen_maddr = Multiaddr(f"/unix{tmp_path}/listen.sock")
    client.handlers = {}

    async def listen_once() -> None:
        async with client.listen():
            pass

    asyncio.run(listen_once())
    assert asked["backlog"] == p2p_listen.STREAM_BACKLOG
