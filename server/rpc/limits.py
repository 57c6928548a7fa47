"""Resource limits of a block server's RPCs: what one peer, one stream and one message may hold.

`RpcLimits` carries the caps (from `ServerConfig`: `--max_sessions_per_peer`, `--max_streams`,
`--max_message_bytes`, `--max_step_tokens`, `--max_queued_steps`); `StreamLimiter` counts the open inference
streams of the whole server and the open sessions and session channels of each peer. Over a cap a request gets a
clear error (`LimitError`, code `over_limit`) before any tensor is built or any cache reserved, so that no peer can
grow the server's memory past what the caps allow. The caps are announced (`announced`: the DHT record and `rpc_info`
carry a `ServerLimits`) so that clients chunk their inputs to fit them.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Dict

from hivemind.proto import runtime_pb2

from swarm.wire.records import ServerLimits


class LimitError(ValueError):
    """A request over one of the server's resource limits; the text is safe to send back to the peer."""


@dataclass(frozen=True)
class RpcLimits:
    max_sessions_per_peer: int = 128
    max_streams: int = 512
    max_message_bytes: int = 64 << 20
    max_step_tokens: int = 16384
    max_queued_steps: int = 64

    def announced(self, max_length: int) -> ServerLimits:
        """These limits (and the server's `--max_length`) as announced in its DHT record and `rpc_info`."""
        return ServerLimits(max_length=max_length, max_sessions_per_peer=self.max_sessions_per_peer,
                            max_streams=self.max_streams, max_message_bytes=self.max_message_bytes,
                            max_step_tokens=self.max_step_tokens, max_queued_steps=self.max_queued_steps)

    def check_message(self, request: runtime_pb2.ExpertRequest) -> None:
        """Reject a message larger than `max_message_bytes` (metadata and tensor buffers)."""
        size = len(request.metadata) + sum(len(t.buffer) for t in request.tensors)
        if size > self.max_message_bytes:
            raise LimitError(f"message of {size} bytes exceeds this server's limit of {self.max_message_bytes} "
                             f"bytes (--max_message_bytes); send long inputs in chunks")

    def check_step_tokens(self, tokens: int) -> None:
        if tokens > self.max_step_tokens:
            raise LimitError(f"a step of {tokens} tokens (batch x sequence) exceeds this server's limit of "
                             f"{self.max_step_tokens} (--max_step_tokens); send long prompts in chunks")


class StreamLimiter:
    """Open inference streams (all peers), and per peer its open sessions and session channels, each under its cap."""

    MAX_CHANNELS_PER_PEER = 64  # session channels (`server.rpc.channel`): a client keeps one per server and swarm
    # manager (a process may run several)

    def __init__(self, limits: RpcLimits):
        self.limits = limits
        self.streams = 0
        self.sessions: Dict[str, int] = {}  # peer id -> sessions open
        self.channels: Dict[str, int] = {}  # peer id -> session channels open

    def enter_stream(self) -> None:
        if self.streams >= self.limits.max_streams:
            raise LimitError(f"this server already has {self.streams} open inference streams (--max_streams)")
        self.streams += 1

    def exit_stream(self) -> None:
        self.streams -= 1

    def open_session(self, peer: str) -> None:
        _enter(self.sessions, peer, self.limits.max_sessions_per_peer, "sessions", " (--max_sessions_per_peer)")

    def close_session(self, peer: str) -> None:
        _leave(self.sessions, peer)

    def open_channel(self, peer: str) -> None:
        _enter(self.channels, peer, self.MAX_CHANNELS_PER_PEER, "session channels", "")

    def close_channel(self, peer: str) -> None:
        _leave(self.channels, peer)


def _enter(counts: Dict[str, int], peer: str, cap: int, what: str, flag: str) -> None:
    held = counts.get(peer, 0)
    if held >= cap:
        raise LimitError(f"peer {peer} already has {held} {what} open on this server{flag}")
    counts[peer] = held + 1


def _leave(counts: Dict[str, int], peer: str) -> None:
    held = counts.get(peer, 0) - 1
    if held > 0:
        counts[peer] = held
    else:
        counts.pop(peer, None)
