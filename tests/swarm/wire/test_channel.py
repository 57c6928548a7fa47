"""The session channel's frame header (`swarm.wire.channel`): what it packs, and every malformed frame refused."""
from __future__ import annotations

import struct

import pytest

from swarm.wire import channel as C
from swarm.wire.codec import ProtocolError


def test_a_frame_round_trips_with_its_message():
    data = C.frame(C.DATA, 7, b'{"type":"step"}')
    assert len(data) == C.HEADER_SIZE + len(b'{"type":"step"}')
    header, body = C.unframe(data)
    assert header == C.FrameHeader(C.DATA, 7) and body == b'{"type":"step"}'
    assert C.unframe(C.frame(C.END, C.MAX_PART)) == (C.FrameHeader(C.END, C.MAX_PART), b"")
    assert C.FrameHeader(C.END, 3).pack() == C.frame(C.END, 3)


@pytest.mark.parametrize("data, reason", [
    (b"", "8-byte header"),
    (b"SG\x01\x00\x00\x00", "8-byte header"),
    (b'{"type":"open_session"}', "bad magic"),
    (struct.pack(">2sBBI", b"SG", 2, 0, 1), "version 2"),
    (struct.pack(">2sBBI", b"SG", 0, 0, 1), "version 0"),
    (struct.pack(">2sBBI", b"SG", 1, 2, 1), "kind 2"),
    (struct.pack(">2sBBI", b"SG", 1, 1, 1) + b"{}", "END frame carries no message"),
])
def test_malformed_frames_are_refused_with_a_reason(data, reason):
    with pytest.raises(ProtocolError, match=reason):
        C.unframe(data)
