"""Which servers a route may use for a range of blocks, and the error that says why none covers some of them.

`usable_spans` keeps the ONLINE, non-banned spans of an allowed weight format (holding a session's LoRA adapter,
taking its length, supporting the capabilities it needs) that intersect the range, one per peer;
`raise_if_uncovered` raises `RoutingError` naming the uncovered blocks, with what the swarm does serve there (other
quant types, other adapters, shorter sessions, servers of a release without a needed capability). Pure code, used by
`swarm.client.transport.routing`.
"""
from __future__ import annotations

from typing import Collection, Dict, List, Mapping, Optional, Sequence, Tuple

from swarm.wire.records import ServerSpan, ServerState


def quant_allowed(span: ServerSpan, allowed: Optional[Collection[str]]) -> bool:
    """Whether a server's weight format (its record's `quant_type`) is one the client accepts (None: any)."""
    return allowed is None or span.info.quant_type in allowed


class RoutingError(RuntimeError):
    """Some blocks of the requested range are not covered by any usable server."""

    def __init__(self, message: str, missing_blocks: Sequence[int] = ()):
        super().__init__(message)
        self.missing_blocks: Tuple[int, ...] = tuple(missing_blocks)


def _runs(blocks: Sequence[int]) -> List[Tuple[int, int]]:
    """[3, 4, 5, 9] -> [(3, 5), (9, 9)]: sorted block indices as runs of consecutive ones (first, last)."""
    runs: List[Tuple[int, int]] = []
    for block in blocks:
        if runs and block == runs[-1][1] + 1:
            runs[-1] = (runs[-1][0], block)
        else:
            runs.append((block, block))
    return runs


def format_blocks(blocks: Sequence[int]) -> str:
    """[3, 4, 5, 9] -> '3-5, 9'."""
    return ", ".join(str(a) if a == b else f"{a}-{b}" for a, b in _runs(blocks))


def usable_spans(
    spans: Sequence[ServerSpan], start: int, end: int, banned: Collection[str],
    allowed_quant_types: Optional[Collection[str]] = None, adapter: Optional[str] = None, session_length: int = 0,
    needs: Collection[str] = (),
) -> Dict[str, ServerSpan]:
    """ONLINE, non-banned spans of an allowed quant type (holding `adapter`, if given; taking sessions of
    `session_length` tokens if they announce limits; supporting every capability in `needs`,
    `swarm.wire.capabilities`) that intersect [start, end), one per peer (the one covering most of the range)."""
    banned_set = set(banned)
    chosen: Dict[str, ServerSpan] = {}
    for span in spans:
        if span.info.state != ServerState.ONLINE or span.peer_id in banned_set:
            continue
        if not quant_allowed(span, allowed_quant_types):
            continue
        if adapter is not None and adapter not in span.info.adapters:
            continue
        if span.info.limits is not None and span.info.limits.max_length < session_length:
            continue
        if needs and not span.info.capability_set.issuperset(needs):
            continue
        overlap = min(span.end, end) - max(span.start, start)
        if overlap <= 0:
            continue
        previous = chosen.get(span.peer_id)
        if previous is None or overlap > min(previous.end, end) - max(previous.start, start):
            chosen[span.peer_id] = span
    return chosen


def _half_open_ranges(blocks: Sequence[int]) -> str:
    """[15, 16, 17, 40] -> '15:18, 40:41' (half-open, as the CLI and the gateway write block ranges)."""
    return ", ".join(f"{a}:{b + 1}" for a, b in _runs(blocks))


def _quant_note(spans: Sequence[ServerSpan], missing: Sequence[int], banned: Collection[str],
                allowed_quant_types: Optional[Collection[str]]) -> str:
    """For missing blocks that ONLINE, non-banned servers of disallowed quant types do serve: which types where."""
    if allowed_quant_types is None or not missing:
        return ""
    banned_set = set(banned)
    others: Dict[int, set[str]] = {}
    missing_set = set(missing)
    for span in spans:
        if span.info.state != ServerState.ONLINE or span.peer_id in banned_set:
            continue
        if quant_allowed(span, allowed_quant_types):
            continue
        for block in range(span.start, span.end):
            if block in missing_set:
                others.setdefault(block, set()).add(span.info.quant_type)
    if not others:
        return ""
    by_types: Dict[Tuple[str, ...], List[int]] = {}
    for block in sorted(others):
        by_types.setdefault(tuple(sorted(others[block])), []).append(block)
    allowed_text = ", ".join(allowed_quant_types)
    parts = [f"blocks {_half_open_ranges(blocks)} are served only by {' / '.join(types)} servers"
             for types, blocks in sorted(by_types.items(), key=lambda item: item[1][0])]
    return f"; {'; '.join(parts)}; allowed quant types: {allowed_text}"


def raise_if_uncovered(usable: Mapping[str, ServerSpan], start: int, end: int, *,
                        spans: Sequence[ServerSpan] = (), banned: Collection[str] = (),
                        allowed_quant_types: Optional[Collection[str]] = None, adapter: Optional[str] = None,
                        session_length: int = 0, needs: Collection[str] = ()) -> None:
    delta = [0] * (end - start + 1)
    for span in usable.values():
        delta[max(span.start, start) - start] += 1
        delta[min(span.end, end) - start] -= 1
    missing: List[int] = []
    running = 0
    for offset in range(end - start):
        running += delta[offset]
        if running <= 0:
            missing.append(start + offset)
    if missing:
        what = "online, not banned" + (", allowed quant type" if allowed_quant_types is not None else "")
        if adapter is not None:
            what += f", holding LoRA adapter {adapter!r}"
        raise RoutingError(
            f"no usable ({what}) server covers block(s) {format_blocks(missing)} "
            f"of the requested range [{start}, {end})" + _quant_note(spans, missing, banned, allowed_quant_types)
            + _adapter_note(spans, missing, adapter) + _length_note(spans, missing, session_length)
            + _capability_note(spans, missing, needs),
            missing,
        )


def _length_note(spans: Sequence[ServerSpan], missing: Sequence[int], session_length: int) -> str:
    """For a session longer than what the servers of the missing blocks take: the longest they announce."""
    limits = [span.info.limits.max_length for span in spans if span.info.state == ServerState.ONLINE
              and span.info.limits is not None and span.info.limits.max_length < session_length
              and set(missing).intersection(range(span.start, span.end))]
    if not limits:
        return ""
    return (f"; a session of {session_length} tokens is longer than the servers there take (at most "
            f"{max(limits)} tokens, their --max_length)")


def _adapter_note(spans: Sequence[ServerSpan], missing: Sequence[int], adapter: Optional[str]) -> str:
    """For a session with `adapter`: which adapters the ONLINE servers of the missing blocks do hold."""
    if adapter is None or not missing:
        return ""
    missing_set = set(missing)
    held = sorted({name for span in spans if span.info.state == ServerState.ONLINE
                   and missing_set.intersection(range(span.start, span.end)) for name in span.info.adapters})
    return f"; adapters served there: {', '.join(held) if held else 'none'}"


def _capability_note(spans: Sequence[ServerSpan], missing: Sequence[int], needs: Collection[str]) -> str:
    """For a request that needs capabilities: which of them the ONLINE servers of the missing blocks lack, and
    their releases (upgrading them is the fix)."""
    if not needs or not missing:
        return ""
    missing_set = set(missing)
    lacking: set[str] = set()
    releases: set[str] = set()
    for span in spans:
        if span.info.state == ServerState.ONLINE and missing_set.intersection(range(span.start, span.end)):
            gap = set(needs) - span.info.capability_set
            if gap:
                lacking |= gap
                releases.add(span.info.version or "unknown")
    if not lacking:
        return ""
    return (f"; the servers there lack {', '.join(sorted(lacking))}, which this request needs (their release: "
            f"{', '.join(sorted(releases))})")
