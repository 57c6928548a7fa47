"""A delaying TCP relay: the wide-area link of the latency lab (`launch.latency_lab`), as real traffic.

`python -m launch.relay --listen HOST:PORT --target HOST:PORT --links FILE` (`RelayConfig`) accepts connections on
`--listen` and forwards each one to `--target`, in both directions. Every chunk read is released to the other
side after the one-way delay of that connection's link: the link is named by the connecting side's source IP
address (`LinkTable.delays`, seconds; `default` for any other source), so one relay in front of a peer gives
each of the peer's neighbours its own latency, both ways. Optional `jitter` (uniform +-, seconds) never reorders
bytes (a chunk is never released before the one read before it), and an optional `bandwidth` (bytes/s) delays a
chunk until the link has sent the bytes before it. The table is a JSON file (`LinkTable`), read again on SIGHUP,
so a running swarm's latencies can change without restarting it (chunks already in flight keep their release
time). The relay prints `SWARMGATE_READY {"listen": ..., "target": ...}` once it listens (`launch.topology`
waits for that line) and runs until SIGTERM/SIGINT.
"""
from __future__ import annotations

import asyncio
import json
import random
import signal
import socket
import sys
from typing import Dict, Optional, Tuple

from pydantic import BaseModel, ConfigDict, Field, field_validator

from swarm.runtime.config import ProcessConfig, config_from_argv

READY = "SWARMGATE_READY "
RELOADED = "relay: links version "  # printed after each reload (`LatencyLab.set_links` waits for it)
CHUNK = 1 << 16


class LinkTable(BaseModel):
    """The links of one relay: one-way delay (s) by the connecting side's IP address."""
    model_config = ConfigDict(extra="forbid")
    version: int = 1
    delays: Dict[str, float] = Field(default_factory=dict, description="source IP -> one-way delay (s)")
    default: float = Field(default=0.0, ge=0, description="one-way delay (s) of sources not in `delays`")
    jitter: float = Field(default=0.0, ge=0, description="uniform +- jitter (s) per chunk, order kept")
    bandwidth: Optional[float] = Field(default=None, gt=0, description="bytes/s per direction of a connection")

    def delay(self, source: str) -> float:
        return self.delays.get(source, self.default)


def parse_hostport(text: str) -> Tuple[str, int]:
    """'HOST:PORT' -> (host, port); ValueError with a readable message otherwise."""
    host, _, port = text.rpartition(":")
    if not host or not port.isdigit() or int(port) > 65535:
        raise ValueError(f"expected HOST:PORT, got {text!r}")
    return host, int(port)


class RelayConfig(ProcessConfig):
    listen: str = Field(description="HOST:PORT to accept connections on (port 0: any free one)")
    target: str = Field(description="HOST:PORT to forward them to")
    links: str = Field(description="JSON file of the link table (LinkTable), read again on SIGHUP")

    @field_validator("listen", "target")
    @classmethod
    def _hostport(cls, value: str) -> str:
        parse_hostport(value)
        return value

    @field_validator("links")
    @classmethod
    def _table(cls, value: str) -> str:
        try:
            load_table(value)
        except OSError as e:
            raise ValueError(f"cannot read {value}: {e}") from None
        return value


class Relay:
    """Forwards connections accepted on `listen` to `target`, each direction delayed per `table` (replaceable)."""

    def __init__(self, target: Tuple[str, int], table: LinkTable):
        self.target, self.table = target, table
        self.connections = 0  # accepted so far
        self.bytes = 0  # forwarded, both directions
        self._tasks: set = set()

    async def serve(self, host: str, port: int) -> asyncio.Server:
        return await asyncio.start_server(self._accept, host, port)

    async def _accept(self, client_r: asyncio.StreamReader, client_w: asyncio.StreamWriter) -> None:
        self.connections += 1
        source = client_w.get_extra_info("peername")[0]
        try:
            target_r, target_w = await asyncio.open_connection(*self.target)
        except OSError:
            client_w.close()
            return
        for writer in (client_w, target_w):
            sock = writer.get_extra_info("socket")
            if sock is not None:
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        try:
            await asyncio.gather(self._pump(client_r, target_w, source), self._pump(target_r, client_w, source))
        finally:
            for writer in (client_w, target_w):
                writer.close()

    async def _pump(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, source: str) -> None:
        """Copy reader -> writer, each chunk released `delay` after it was read (in order)."""
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue = asyncio.Queue()

        async def read() -> None:
            last_release = sent_until = 0.0
            try:
                while data := await reader.read(CHUNK):
                    table, now = self.table, loop.time()
                    start = now
                    if table.bandwidth:  # serialization: after the bytes before it have left
                        sent_until = max(now, sent_until) + len(data) / table.bandwidth
                        start = sent_until
                    jitter = random.uniform(-table.jitter, table.jitter) if table.jitter else 0.0
                    last_release = max(last_release, start + max(0.0, table.delay(source) + jitter))
                    queue.put_nowait((last_release, data))
            except (ConnectionError, OSError):
                pass
            finally:
                queue.put_nowait((None, b""))

        async def write() -> None:
            while True:
                release, data = await queue.get()
                if release is None:
                    break
                wait = release - loop.time()
                if wait > 0:
                    await asyncio.sleep(wait)
                writer.write(data)
                self.bytes += len(data)
                await writer.drain()
            if writer.can_write_eof():
                writer.write_eof()

        reading = asyncio.ensure_future(read())
        try:
            await write()
        except (ConnectionError, OSError):
            pass
        finally:
            reading.cancel()


def load_table(path: str) -> LinkTable:
    with open(path) as f:
        return LinkTable.model_validate(json.load(f))


async def _main(config: RelayConfig) -> int:
    relay = Relay(parse_hostport(config.target), load_table(config.links))
    server = await relay.serve(*parse_hostport(config.listen))
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)

    def reload() -> None:
        try:
            relay.table = load_table(config.links)
            print(f"{RELOADED}{relay.table.version}", flush=True)
        except (OSError, ValueError) as e:  # keep the old table
            print(f"relay: cannot reload {config.links}: {e}", file=sys.stderr, flush=True)

    loop.add_signal_handler(signal.SIGHUP, reload)
    host, port = server.sockets[0].getsockname()[:2]
    print(READY + json.dumps({"listen": f"{host}:{port}", "target": config.target}), flush=True)
    await stop.wait()
    server.close()
    return 0


def main(argv=None) -> int:
    config = config_from_argv(RelayConfig, argv, "python -m launch.relay", __doc__.split("\n\n")[0])
    return asyncio.run(_main(config))


if __name__ == "__main__":
    sys.exit(main())
