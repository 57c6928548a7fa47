"""Block placement: which contiguous blocks a server should host, and when it should move.

This module owns the pure decision logic a block server runs against the swarm's announced spans
(`swarm.wire.records.ServerSpan`): the per-block throughput the swarm provides, the least-served window of
blocks for a joining server, whether an already-running server should move to rebalance the swarm, and how
many blocks fit in the memory a server has. No network, no DHT, no clocks.

Rebalancing rule (`should_move`): simulate removing this server and re-placing it at the least-served
window; move only if that re-placement strictly reduces the number of uncovered blocks, or, when every
block is covered, raises the swarm's weakest-block throughput by more than a factor 1/balance_quality.
Each move therefore strictly improves the pair (uncovered blocks, weakest throughput) by a fixed factor,
so in a swarm that does not change, servers evaluating one after another cannot cycle (A -> B -> A) and
the number of moves is bounded.

Filling holes (`uncovered_blocks`, `hole_fill_turn`): free servers watch the swarm for blocks nobody serves; the
servers that would cover some of them by moving take turns in one order that all of them compute alike from the
same records (a hash of peer id and holes), so that the first one moves and the others, looking again after it
had time to, see it there (joining counts) and stay: no thundering herd into one hole. Between full reads of the
swarm they watch only the blocks few servers serve (`thin_blocks`).

`should_move` costs O(servers x span) to sum the swarm's per-block throughput plus O(blocks x span) to decide;
`move_target` is the decision alone on per-block totals, for callers that keep those totals up to date (the
swarm simulation, `bench/sim_swarm.py`).
"""
from __future__ import annotations

import hashlib
import math
from typing import Dict, List, Optional, Sequence, Tuple

from swarm.wire.records import ServerSpan, ServerState

__all__ = ["block_throughputs", "choose_best_span", "should_move", "move_target", "uncovered_blocks",
           "hole_fill_turn", "thin_blocks", "num_blocks_that_fit"]

_SERVING_STATES = (ServerState.JOINING, ServerState.ONLINE)
_REL_EPS = 1e-9  # float sums that differ by less than this (relatively) are considered equal


def _close(a: float, b: float) -> bool:
    return math.isclose(a, b, rel_tol=_REL_EPS, abs_tol=1e-12)


def block_throughputs(
    spans: Sequence[ServerSpan], num_blocks: int, *, exclude_peer: Optional[str] = None
) -> List[float]:
    """Total throughput per block [0, num_blocks) from servers that are JOINING or ONLINE."""
    if num_blocks < 0:
        raise ValueError(f"num_blocks must be >= 0, got {num_blocks}")
    totals = [0.0] * num_blocks
    for span in spans:
        if span.info.state not in _SERVING_STATES or span.peer_id == exclude_peer:
            continue
        for index in range(max(span.start, 0), min(span.end, num_blocks)):
            totals[index] += span.info.throughput
    return totals


def choose_best_span(throughputs: Sequence[float], num_blocks_to_serve: int) -> Tuple[int, int]:
    """The window [start, start + n) whose blocks have the least total throughput.

    Ties (up to float rounding) go to the window whose weakest block is lowest, then to the lowest start.
    `n` larger than the model is clipped to the whole model.
    """
    total_blocks = len(throughputs)
    if total_blocks == 0:
        raise ValueError("no blocks to choose from")
    if num_blocks_to_serve <= 0:
        raise ValueError(f"num_blocks_to_serve must be positive, got {num_blocks_to_serve}")
    length = min(num_blocks_to_serve, total_blocks)
    best_start, best_sum, best_min = 0, math.inf, math.inf
    for window_start in range(total_blocks - length + 1):
        window = throughputs[window_start : window_start + length]
        window_sum, window_min = math.fsum(window), min(window)
        if _close(window_sum, best_sum):
            if window_min < best_min and not _close(window_min, best_min):
                best_start, best_sum, best_min = window_start, window_sum, window_min
        elif window_sum < best_sum:
            best_start, best_sum, best_min = window_start, window_sum, window_min
    return best_start, best_start + length


def _balance(throughputs: Sequence[float]) -> Tuple[int, float]:
    """(number of blocks nobody serves, weakest block throughput)."""
    uncovered = sum(1 for value in throughputs if value <= 0)
    return uncovered, (min(throughputs) if throughputs else 0.0)


def should_move(
    spans: Sequence[ServerSpan], num_blocks: int, my_peer_id: str, *, balance_quality: float = 0.75
) -> Tuple[bool, Optional[Tuple[int, int]]]:
    """Whether the server `my_peer_id` should move, and to which blocks [start, end) (None when staying).

    Simulates removing this server and placing it at `choose_best_span` of what remains. Moves only if
    that reduces the number of uncovered blocks, or (with all blocks covered) if the new weakest-block
    throughput satisfies new_min * balance_quality > old_min. A server that is not in `spans` stays.
    """
    if not 0 < balance_quality <= 1:
        raise ValueError(f"balance_quality must be in (0, 1], got {balance_quality}")
    mine = [span for span in spans if span.peer_id == my_peer_id]
    if not mine or num_blocks <= 0:
        return False, None
    me = max(mine, key=lambda span: span.length)
    current = (max(me.start, 0), min(me.end, num_blocks))
    if current[1] <= current[0]:
        return False, None

    others = [span for span in spans if span.peer_id != my_peer_id]
    without_me = block_throughputs(others, num_blocks)
    target = move_target(without_me, current, me.info.throughput, balance_quality=balance_quality,
                         serving_now=me.info.state in _SERVING_STATES)
    return (True, target) if target is not None else (False, None)


def move_target(without_me: Sequence[float], current: Tuple[int, int], my_throughput: float, *,
                balance_quality: float = 0.75, serving_now: bool = True) -> Optional[Tuple[int, int]]:
    """`should_move`'s decision on per-block totals: `without_me[b]` is the throughput of block b from every other
    JOINING or ONLINE server, `current` this server's blocks [start, end), `my_throughput` what it adds to each
    block it serves (to `current` only if `serving_now`). The blocks to move to, or None to stay.
    O(blocks x span)."""
    if not 0 < balance_quality <= 1:
        raise ValueError(f"balance_quality must be in (0, 1], got {balance_quality}")
    num_blocks = len(without_me)
    if num_blocks == 0 or current[1] <= current[0] or current[1] > num_blocks:
        return None
    target = choose_best_span(without_me, current[1] - current[0])
    if target == current:
        return None
    before, after = list(without_me), list(without_me)
    for index in range(*current):
        before[index] += my_throughput if serving_now else 0.0
    for index in range(*target):
        after[index] += my_throughput
    old_uncovered, old_min = _balance(before)
    new_uncovered, new_min = _balance(after)
    if new_uncovered != old_uncovered:
        improves = new_uncovered < old_uncovered
    else:
        improves = old_uncovered == 0 and new_min * balance_quality > old_min * (1 + _REL_EPS)
    return target if improves else None


def uncovered_blocks(throughputs: Sequence[float]) -> List[int]:
    """The blocks nobody serves (a hole), from `block_throughputs`."""
    return [index for index, value in enumerate(throughputs) if value <= 0]


def thin_blocks(spans: Sequence[ServerSpan], num_blocks: int, most: int = 2) -> List[int]:
    """The blocks that at most `most` JOINING or ONLINE servers serve (the hole watch reads these more often: a
    hole opens where the last servers of a block leave)."""
    served: Dict[str, set] = {}  # peer id -> the blocks it serves (a peer listed twice counts once)
    for span in spans:
        if span.info.state in _SERVING_STATES:
            served.setdefault(span.peer_id, set()).update(range(max(span.start, 0), min(span.end, num_blocks)))
    counts = [0] * num_blocks
    for blocks in served.values():
        for index in blocks:
            counts[index] += 1
    return [index for index, count in enumerate(counts) if count <= most]


def _fill_order_key(peer_id: str, holes: Sequence[int]) -> bytes:
    return hashlib.sha256(f"{peer_id}|{','.join(map(str, holes))}".encode()).digest()


def hole_fill_turn(spans: Sequence[ServerSpan], num_blocks: int, my_peer_id: str, *, balance_quality: float = 0.75,
                   most: int = 8) -> Optional[int]:
    """This server's turn to fill the swarm's holes: None if there is no hole or its moving would not cover any
    (`should_move` says stay); else how many other servers that could fill them (by `move_target` on the same
    records) come before it in an order that every server computes alike and that differs from hole to hole (a hash
    of peer id and holes), counted up to `most`. Turn 0 moves at once; the others wait for it, then look again.
    O(servers x span) to sum the records, plus O(blocks x span) per server ahead (each tried in hash order)."""
    serving = [span for span in spans if span.info.state in _SERVING_STATES and span.end > span.start]
    totals, counts = [0.0] * num_blocks, [0] * num_blocks
    by_peer: Dict[str, ServerSpan] = {}
    for span in serving:
        if span.peer_id not in by_peer or span.length > by_peer[span.peer_id].length:
            by_peer[span.peer_id] = span
    for span in by_peer.values():
        for index in range(max(span.start, 0), min(span.end, num_blocks)):
            totals[index] += span.info.throughput
            counts[index] += 1
    holes = uncovered_blocks(totals)
    if not holes or my_peer_id not in by_peer:
        return None

    def would_fill(span: ServerSpan) -> bool:
        current = (max(span.start, 0), min(span.end, num_blocks))
        without = list(totals)
        for index in range(*current):
            without[index] = without[index] - span.info.throughput if counts[index] > 1 else 0.0
        return move_target(without, current, span.info.throughput, balance_quality=balance_quality) is not None

    if not would_fill(by_peer[my_peer_id]):
        return None
    mine = _fill_order_key(my_peer_id, holes)
    ahead = sorted((key, peer) for peer in by_peer if peer != my_peer_id
                   for key in [_fill_order_key(peer, holes)] if key < mine)
    turn = 0
    for _, peer in ahead:
        if turn >= most:
            break
        turn += would_fill(by_peer[peer])
    return turn


def num_blocks_that_fit(
    free_bytes: int,
    bytes_per_block: int,
    cache_bytes_per_block: int,
    total_blocks: int,
    *,
    reserve_fraction: float = 0.1,
) -> int:
    """How many blocks (weights plus their share of the KV cache budget) fit in `free_bytes` after keeping
    `reserve_fraction` of it free; clipped to `total_blocks`.

    If not even one block fits once the reserve is kept, but one block does fit in `free_bytes` itself,
    returns 1 (a small server still contributes one block, giving up the reserve); 0 if not even that fits.
    """
    if bytes_per_block <= 0:
        raise ValueError(f"bytes_per_block must be positive, got {bytes_per_block}")
    if cache_bytes_per_block < 0 or free_bytes < 0 or total_blocks < 0:
        raise ValueError("free_bytes, cache_bytes_per_block and total_blocks must be non-negative")
    if not 0 <= reserve_fraction < 1:
        raise ValueError(f"reserve_fraction must be in [0, 1), got {reserve_fraction}")
    per_block = bytes_per_block + cache_bytes_per_block
    fitting = int(free_bytes * (1 - reserve_fraction)) // per_block
    if fitting == 0 and per_block <= free_bytes:
        fitting = 1
    return max(0, min(fitting, total_blocks))
