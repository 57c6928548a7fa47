"""The client's side of the servers' prefix caches (`server.compute.prefix_cache`): a session that declares its prompt
(`InferenceSession.prefix`, a `PrefixDecl` of a salt and the prompt's token ids) opens its chain waiting for the
servers' replies, each of which says how many leading positions that server holds already (pages of the same prompt,
salt and adapter that earlier sessions computed) and carries its span's outputs there.

The chain adopts the least of them (`adopt`): every server holds at least that many positions, so the first step
starts there and sends only the rest (a server that holds more drops the surplus: it starts where the step does).
The last token is always sent (its logits are needed). The servers' outputs at the adopted positions become each
block boundary's input history, exactly as if the client had sent those positions: failover replays, spot-checks and
the caller's outputs (`astep` returns every position of its input) are unchanged.

A rewind before the end of the declared prompt cuts the declaration there (`cut`): a replacement server opened later
must not key other tokens' states by it.
"""
from __future__ import annotations

from typing import Any, Optional, Tuple

import torch

from swarm.client.transport.session_chain import BoundaryHistory
from swarm.wire import protocol as P


def cut(prefix: Optional[P.PrefixDecl], position: int) -> Optional[P.PrefixDecl]:
    """The declaration of a session rewound to `position`: its first `position` tokens (None: nothing left)."""
    if prefix is None or position >= len(prefix.tokens):
        return prefix
    return P.PrefixDecl(salt=prefix.salt, tokens=prefix.tokens[:position]) if position > 0 else None


def adopt(session: Any, hidden: torch.Tensor) -> Tuple[Optional[torch.Tensor], torch.Tensor]:
    """After the chain of `session` (an `InferenceSession`) opened for its first step `hidden` [1, n, hidden] (at
    position 0): the last span's outputs at the adopted positions [1, m, hidden] (None: none adopted) and the rest
    of `hidden` to send; the boundary histories hold the adopted positions and the session's position is m."""
    streams = session._streams
    if not streams or session.position != 0 or hidden.shape[0] != 1:
        return None, hidden
    held = min(min(stream.held for stream in streams), hidden.shape[1] - 1)
    if held <= 0:
        return None, hidden
    x = hidden[:, :held]
    for stream in streams:
        history = session._history.get(stream.hop.start)
        if history is None:
            history = session._history[stream.hop.start] = BoundaryHistory(1, session.max_length, x.shape[-1],
                                                                            hidden.dtype)
        history.write(0, x)
        assert stream.held_outputs is not None
        x = stream.held_outputs[:, :held].to(hidden.dtype)
    if session._verifier is not None:  # the last span's outputs, which a spot-check compares too
        session._boundary(session.end, x).write(0, x)
    session.position = held
    session.adopted_tokens += held
    return x, hidden[:, held:]
