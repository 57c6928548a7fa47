"""The client's side of the servers' prefix caches (`server.compute.prefix_cache`): a session that declares its prompt
(`InferenceSession.prefix`, a `PrefixDecl` of a salt and the prompt's token ids) opens its chain waiting for the
servers' replies, each of which says how many leading positions that server holds already (pages of the same prompt,
salt and adapter that earlier sessions computed) and carries its span's outputs there.

The chain adopts the least of them (`adopt`): every server holds at least that many positions, so the first step
starts there and sends only the rest (a server that holds more drops the surplus: it starts where the step does).
The last token is always sent (its logits are needed). The servers' outputs at the adopted positions become each
block boundary's input history, exactly as if the client had sent those positions: failover replays, spot-checks and
the caller's outputs (`astep` returns every position of its input) are unchanged.

Servers that announce `prefix_outputs` keep those outputs instead of sending them with the opening's reply (when the
session does no spot-checks: `InferenceSession.prefix_outputs_later`): 2.4 MB per server for the bundled model's
1,024 positions was most of an adopting session's time to its first token. The next boundary's history then says
which server holds them (`BoundaryHistory.hold_remote`); a failover replay that needs them fetches them
(`SessionChain._resolve`, `rpc_prefix_outputs`), or, where that server is the one that failed, its replacement
recomputes them from the inputs before it (the first span's are the client's own embeddings). The last span's are
fetched at once unless the caller does not want them (`InferenceSession.adopted_outputs` False: `astep` then returns
the outputs of the positions it sent only; `swarm.client.model.model_session` needs the last positions' only).

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


async def adopt(session: Any, hidden: torch.Tensor) -> Tuple[Optional[torch.Tensor], torch.Tensor]:
    """After the chain of `session` (an `InferenceSession`) opened for its first step `hidden` [1, n, hidden] (at
    position 0): the last span's outputs at the adopted positions [1, m, hidden] (None: none adopted, or not wanted:
    `InferenceSession.adopted_outputs` False) and the rest of `hidden` to send; the boundary histories hold the
    adopted positions (or say which server keeps them) and the session's position is m."""
    streams = session._streams
    if not streams or session.position != 0 or hidden.shape[0] != 1:
        return None, hidden
    held = min(min(stream.held for stream in streams), hidden.shape[1] - 1)
    if held <= 0:
        return None, hidden
    x: Optional[torch.Tensor] = hidden[:, :held]  # [1, held, hidden]: the inputs at the next boundary
    source = None  # the stream whose server keeps them where x is None
    for stream in streams:
        history = session._history.get(stream.hop.start)
        if history is None:
            history = session._history[stream.hop.start] = BoundaryHistory(1, session.max_length, hidden.shape[-1],
                                                                            hidden.dtype)
        if x is not None:
            history.write(0, x)
        else:
            assert source is not None
            history.hold_remote(held, source)
        if stream.held_outputs is not None:
            x = stream.held_outputs[:, :held].to(hidden.dtype)
        else:  # kept by its server (`SpanStream.outputs_later`)
            x, source = None, stream
    if x is None and (session.adopted_outputs or session._verifier is not None):
        assert source is not None
        x = (await source.held_outputs_now(held)).to(hidden.dtype)
    if session._verifier is not None:  # the last span's outputs, which a spot-check compares too
        assert x is not None
        session._boundary(session.end, x).write(0, x)
    session.position = held
    session.adopted_tokens += held
    return x if session.adopted_outputs else None, hidden[:, held:]
