"""Session channels: many inference sessions' streams in ONE stream per (client, server) pair (`rpc_sessions`,
capability `session_channels`).

Opening a session part on its own `rpc_inference` stream costs a P2P stream each time: on the 2-core machine, a
client's p2pd spent ~1 ms of CPU per session (two parts) and each server's p2pd ~0.6 ms, besides the streams'
Python on both sides (issue 46: per request, the gateway opens and closes a session). A channel carries the parts'
streams as virtual streams instead: every message of a part's stream (its `OpenSession`, its steps, the replies,
an error reply, the end of the stream) travels as it would on its own stream, behind an 8-byte `FrameHeader` at
the start of the message's metadata that names the part (`part`, a number the client picks, increasing within the
channel) and says whether the frame carries a message (`DATA`) or ends that part's stream (`END`). The server runs
each part exactly as a session on its own stream (`server.rpc.channel`): the same opening, limits, steps, pushes,
time-outs and teardown; a part's end (either side's `END`, or the channel's end) is its stream's end.

A frame whose header is malformed, or that names part 0, gets an `ErrorReply` on part 0 (the channel's own) and the
channel goes on; the channel's first frame carries the membership proof for all its parts.
"""
from __future__ import annotations

import struct
from dataclasses import dataclass
from typing import Tuple

from swarm.wire.codec import ProtocolError

CHANNEL_VERSION = 1
MAGIC = b"SG"
DATA, END = 0, 1
_HEADER = struct.Struct(">2sBBI")  # magic, version, kind, part
HEADER_SIZE = _HEADER.size  # 8
MAX_PART = (1 << 32) - 1


@dataclass(frozen=True)
class FrameHeader:
    """What precedes a frame's message: which part of the channel it belongs to, and whether it ends that part."""

    kind: int  # DATA or END
    part: int  # 1..MAX_PART; 0 is the channel's own (its error replies)
    version: int = CHANNEL_VERSION

    def pack(self) -> bytes:
        return _HEADER.pack(MAGIC, self.version, self.kind, self.part)


def frame(kind: int, part: int, metadata: bytes = b"") -> bytes:
    """A frame's metadata: the header, then the part's own message (`metadata`; empty for `END`)."""
    return _HEADER.pack(MAGIC, CHANNEL_VERSION, kind, part) + metadata


def unframe(metadata: bytes) -> Tuple[FrameHeader, bytes]:
    """(header, the part's own message) of a frame's metadata; ProtocolError for anything but a well-formed frame of
    this channel version (an `END` frame carries nothing)."""
    if len(metadata) < HEADER_SIZE:
        raise ProtocolError(f"a channel frame starts with an {HEADER_SIZE}-byte header, got {len(metadata)} bytes")
    magic, version, kind, part = _HEADER.unpack_from(metadata)
    if magic != MAGIC:
        raise ProtocolError("not a channel frame (bad magic)")
    if version != CHANNEL_VERSION:
        raise ProtocolError(f"channel frame version {version}; this peer speaks {CHANNEL_VERSION}")
    if kind not in (DATA, END):
        raise ProtocolError(f"unknown channel frame kind {kind}")
    body = metadata[HEADER_SIZE:]
    if kind == END and body:
        raise ProtocolError("an END frame carries no message")
    return FrameHeader(kind, part, version), body
