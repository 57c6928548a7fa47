"""An inference session's chain of span streams, and what it keeps to rebuild one (`SessionChain`, which
`swarm.client.transport.session.InferenceSession` extends).

Opening: `_open_span` routes blocks [start, end) and opens a stream on every hop (bounded retries, failed servers
banned, patience while blocks whose only servers failed wait to be tried again). Failover: the session keeps, for
every block boundary where a span starts, the hidden states it sent there (`BoundaryHistory`; positions adopted from
a prefix cache may be held by the previous span's server instead, fetched when a replay needs them: `_resolve`);
`_replace` bans a failed server, re-routes only its span (possibly onto several servers) and replays that boundary's
history from position 0 to rebuild the replacement's cache (`_replay`); `_replace_retrying` tries other replacements
while they fail, up to `max_retries`. Messages are cut to the chain's limits (`_chunk_len`) and carry the step ids and
rotary lengths that a replay shares with the session's steps.
"""
from __future__ import annotations

import asyncio
import logging
import time
from typing import Dict, FrozenSet, List, Optional, Sequence

import torch

from swarm.client.transport.manager import SwarmManager, unreachable
from swarm.client.transport.routing import RoutingError
from swarm.client.transport.span_stream import SessionError, SpanStream
from swarm.wire import protocol as P

logger = logging.getLogger(__name__)

METADATA_ROOM = 64 << 10  # bytes kept for a step's metadata under a server's max_message_bytes


class BoundaryHistory:
    """The hidden states sent into one block boundary, positions [0, length): [batch, capacity, hidden], and
    the rows' left padding sent with them (replayed with position 0). The buffer grows (doubling, up to
    `max_length`) as positions are written: a session reserves its whole `max_length` on the servers, but a
    gateway holding dozens of conversations with hundreds of tokens of headroom each should not hold that
    much hidden state per boundary (2.3 KB per position of SmolLM2) for tokens it never sent."""

    MIN_CAPACITY = 64

    def __init__(self, batch: int, max_length: int, hidden_size: int, dtype: torch.dtype,
                 padding: Optional[List[int]] = None):
        self.max_length = max_length
        self.buffer = torch.empty(batch, min(max_length, self.MIN_CAPACITY), hidden_size, dtype=dtype)
        self.length = 0
        self.padding = padding
        # positions [0, remote) are held by a server, not in the buffer: the outputs there of the span that ends at
        # this boundary, which its server (`remote_source`'s) adopted from its prefix cache and kept
        # (`swarm.client.transport.prefix`); `fill` writes them once fetched, `read` refuses them before
        self.remote = 0
        self.remote_source: Optional[SpanStream] = None

    def hold_remote(self, length: int, source: SpanStream) -> None:
        """Positions [0, length) are `source`'s outputs, kept by its server (not fetched)."""
        self._grow(0, length)
        self.remote, self.remote_source, self.length = length, source, length

    def fill(self, hidden: torch.Tensor) -> None:
        """The held positions' states, fetched (or recomputed): hidden [batch, n, hidden] (n < remote only after a
        rewind before them: positions past the session's are never read before they are written again)."""
        count = min(self.remote, hidden.shape[1])
        self.buffer[:, :count] = hidden[:, :count]
        self.remote, self.remote_source = 0, None

    def reorder(self, hypo_ids: List[int], length: int) -> None:
        """Row i of positions [0, length) becomes row hypo_ids[i], as the servers reordered their caches."""
        index = torch.tensor(hypo_ids)
        self.buffer[:, :length] = self.buffer[:, :length].index_select(0, index)
        if self.padding is not None:
            self.padding = [self.padding[i] for i in hypo_ids]

    def _grow(self, keep: int, end: int) -> None:
        """Room for positions [0, end); positions [0, keep) are kept (`astep` refuses steps past max_length)."""
        capacity = self.buffer.shape[1]
        if end > capacity:
            grown = torch.empty(self.buffer.shape[0], max(end, min(self.max_length, 2 * capacity)),
                                self.buffer.shape[2], dtype=self.buffer.dtype)
            grown[:, :keep] = self.buffer[:, :keep]
            self.buffer = grown

    def write(self, start_position: int, hidden: torch.Tensor) -> None:
        end = start_position + hidden.shape[1]
        self._grow(start_position, end)
        self.buffer[:, start_position:end] = hidden
        self.length = end
        if start_position < self.remote:  # (a rewound session's new positions: the server's are stale there)
            self.remote = start_position
            self.remote_source = self.remote_source if start_position else None

    def read(self, end: int) -> torch.Tensor:
        if min(end, self.remote) > 0:
            raise RuntimeError(f"positions [0, {self.remote}) of this boundary are held by a server: fetch them "
                               f"first (`SessionChain._resolve`)")
        return self.buffer[:, :end]


async def _open_in_order(streams: List[SpanStream]) -> list:
    """Open `streams` one after the other (each result: None, its error, or "skipped" after an error).
    A session that declares a prompt opens so: a server may hold its opening until another session has computed the
    pages of that prompt (`server.rpc.prefix`), and one that opens every hop at once could wait at one server for a
    session that waits for it at another; in chain order, the session computing a prefix page at a hop has opened
    every hop before it, so none of them holds it."""
    results: list = []
    for stream in streams:
        if any(isinstance(r, BaseException) for r in results):
            results.append("skipped")
            continue
        try:
            await stream.open(True)
            results.append(None)
        except Exception as e:  # noqa: BLE001 - returned as gather(return_exceptions=True) would
            results.append(e)
    return results


class SessionChain:
    """The chain of an `InferenceSession` (which sets the attributes below): its streams, opened, replaced and
    replayed."""

    manager: SwarmManager
    max_length: int
    adapter: Optional[str]
    prompts: Optional[torch.Tensor]
    rope_lengths: bool
    session_id: str
    position: int
    batch_size: Optional[int]
    failovers: int
    moves: int
    needs: FrozenSet[str]  # capabilities every server of the chain must announce (`InferenceSession.needs`)
    _streams: List[SpanStream]
    _history: Dict[int, BoundaryHistory]  # block index where a span starts -> inputs sent there
    _step_end: Optional[int]
    _step_id: int
    prefix: Optional[P.PrefixDecl] = None  # the prompt declared to prefix caches (`swarm.client.transport.prefix`)
    # whether servers keep their outputs at the prefix positions they adopt until asked (`SpanStream.outputs_later`)
    prefix_outputs_later: bool = False

    async def _open_span(self, start: int, end: int, batch_size: int, wait: bool = True,
                         reasons: Sequence[str] = ()) -> List[SpanStream]:
        """Route blocks [start, end) and open a stream on every hop (bounded retries, failed servers banned).
        With `wait=False` the servers' OpenSession replies are left for the first step to read (`SpanStream.open`).
        `reasons`: what made earlier servers of this span fail, named in the error if no server is left."""
        last_error: Optional[BaseException] = None
        server_errors: List[str] = list(reasons)  # what the servers said, kept when routing runs out of servers
        config, tries = self.manager.config, 0
        patience_ends = time.monotonic() + config.sole_retry_patience
        while tries <= config.max_retries or self._patient(start, end, patience_ends):
            try:
                hops = await asyncio.get_running_loop().run_in_executor(
                    None, lambda: self.manager.make_inference_chain(start, end, batch_size * self.max_length,
                                                                    adapter=self.adapter,
                                                                    session_length=self.max_length,
                                                                    needs=self.needs, prefix=self.prefix))
            except RoutingError as e:
                last_error = e
                turn = self.manager.sole_retry_wait(start, end)
                if turn is not None and time.monotonic() + turn < patience_ends:  # blocks whose only servers
                    await asyncio.sleep(max(turn, 0.05))  # failed: wait for their turn (not counted as a try)
                    continue
                tries += 1
                await asyncio.sleep(min(1.0, config.ban_timeout))
                continue
            streams = [SpanStream(self.manager, hop, self.session_id, self.max_length, batch_size, self.adapter,
                                  None if self.prompts is None else self.prompts[hop.start:hop.end], self.prefix,
                                  self.prefix_outputs_later) for hop in hops]
            if self.prefix is not None and wait:
                results = await _open_in_order(streams)
            else:
                results = await asyncio.gather(*(s.open(wait) for s in streams), return_exceptions=True)
            failed = [(s, r) for s, r in zip(streams, results) if isinstance(r, BaseException)]
            if not failed:
                return streams
            await asyncio.gather(*(s.close() for s in streams), return_exceptions=True)
            # servers that left since the view was read (their records say offline now): dropped from the view by
            # that refresh, neither banned nor a failed try (no phantom first try after a graceful stop)
            left = await asyncio.get_running_loop().run_in_executor(
                None, self.manager.settle_failures, [(stream.hop.peer_id, error) for stream, error in failed])
            for stream, error in failed:
                if stream.hop.peer_id not in left:
                    logger.warning(f"cannot open a session on {stream.hop.peer_id}: {error}")
                    server_errors.append(str(error))
                    last_error = error
            if any(stream.hop.peer_id not in left for stream, _ in failed):
                tries += 1
        reasons = "; ".join(dict.fromkeys(server_errors + ([str(last_error)] if last_error else [])))
        raise SessionError(f"cannot serve blocks {start}:{end} after {tries} tries: {reasons}") from last_error

    def _patient(self, start: int, end: int, patience_ends: float) -> bool:
        """Whether to go on past `max_retries`: some of blocks [start, end) have only banned servers, and one of
        them may be tried again before the session's `sole_retry_patience` runs out."""
        wait = self.manager.sole_retry_wait(start, end)
        return wait is not None and time.monotonic() + wait < patience_ends

    async def _replace(self, index: int, error: BaseException, ban: bool = True) -> None:
        """Replace failed stream `index` by a fresh route over its span, replaying that span's history (`ban`:
        the server failed; else it only lacks a capability the session now needs, `_require`)."""
        failed = self._streams[index]
        assert self.batch_size is not None, "the session is not open"
        logger.warning(f"server {failed.hop.peer_id} {'failed' if ban else 'cannot go on'} on blocks "
                       f"{failed.hop.start}:{failed.hop.end}: {type(error).__name__}: {error}; re-routing that span")
        if ban:
            self.manager.ban(failed.hop.peer_id, error)
            if unreachable(error):
                failed.drop_channel()
        asyncio.ensure_future(failed.close())
        began = time.monotonic()
        if self.position > 0:  # the inputs to replay, all here (from the previous span's server, or recomputed)
            await self._resolve(failed.hop.start)
            index = self._streams.index(failed)  # (a failover there may have split the previous span)
        replacement = await self._open_span(failed.hop.start, failed.hop.end, self.batch_size, reasons=[str(error)])
        if self.position > 0:
            x = self._history[failed.hop.start].read(self.position)  # [batch, position, hidden]
            for stream in replacement:
                if stream.hop.start != failed.hop.start:  # a new boundary inside the span: record its inputs
                    history = BoundaryHistory(self.batch_size, self.max_length, x.shape[-1], x.dtype,
                                       self._history[failed.hop.start].padding)
                    history.write(0, x)
                    self._history[stream.hop.start] = history
                try:
                    x = await self._replay(stream, x, self._history[failed.hop.start].padding)
                except Exception as replay_error:
                    self.manager.ban(stream.hop.peer_id, replay_error)
                    await asyncio.gather(*(s.close() for s in replacement), return_exceptions=True)
                    raise
            following = self._history.get(failed.hop.end)
            if following is not None and following.remote:  # the failed server kept its prefix outputs: recomputed
                following.fill(x)
        self._streams[index:index + 1] = replacement
        self.failovers += int(ban)  # a move to a server with a capability the session now needs is no failure
        self.moves += int(not ban)
        logger.info(f"blocks {failed.hop.start}:{failed.hop.end} re-routed to {[s.hop.peer_id for s in replacement]} "
                    f"and {self.position} positions replayed in {time.monotonic() - began:.1f}s")

    async def _resolve(self, block: int) -> None:
        """Fetch the positions of boundary `block`'s history that a server kept (`BoundaryHistory.remote`) from it;
        where that server fails, its span fails over first (its replay recomputes them: `_replace`)."""
        history = self._history.get(block)
        if history is None or not history.remote:
            return
        source = history.remote_source
        if source is None or source not in self._streams:
            raise SessionError(f"the inputs of blocks from {block} were kept by a server no longer in the chain")
        try:
            history.fill(await source.held_outputs_now(history.remote))
        except Exception as e:  # noqa: BLE001 - the server that kept them failed: its span fails over
            logger.warning(f"cannot fetch the prefix outputs kept by {source.hop.peer_id}: {type(e).__name__}: {e}")
            await self._replace_retrying(self._streams.index(source), e, 0)
            if history.remote:
                raise SessionError(f"the inputs of blocks from {block} were not recomputed") from e

    async def _replay(self, stream: SpanStream, x: torch.Tensor, padding: Optional[List[int]]) -> torch.Tensor:
        """Send positions [0, len) of `x` [batch, len, hidden] (rows left-padded by `padding`) through `stream` in
        chunks; return its output. Their rotary factors are those the positions got: a failover in the middle of a
        step replays with that step's end (positions held before a step that crosses LongRoPE's boundary are sent
        again in it: `phi3.recomputes_cache`), else with the replay's."""
        chunk = self._chunk_len(x)
        end = max(x.shape[1], self._step_end or 0)
        outputs = [await stream.step(x[:, offset:offset + chunk], offset, self._next_step_id(),
                                     dict(left_padding=padding if offset == 0 else None,
                                          rope_length=self._rope_length(end, offset + chunk)))
                   for offset in range(0, x.shape[1], chunk)]
        return torch.cat(outputs, dim=1)

    def _rope_length(self, step_end: int, message_end: int) -> Optional[int]:
        """The `rope_length` a message ending at `message_end` of a step (or replay) ending at `step_end` carries:
        None where it changes nothing (the message's own end, or a model whose rotary ignores it)."""
        return step_end if self.rope_lengths and step_end > message_end else None

    def _next_step_id(self) -> int:
        self._step_id += 1
        return self._step_id

    def _chunk_len(self, hidden: torch.Tensor) -> int:
        """Positions per message: under the client's `max_chunk_bytes` and every chain server's announced
        `max_message_bytes` (less room for the metadata) and `max_step_tokens`."""
        batch, _, hidden_size = hidden.shape
        row_bytes = batch * hidden_size * hidden.element_size()
        chunk = self.manager.config.max_chunk_bytes // row_bytes
        for limits in (s.hop.limits for s in self._streams if s.hop.limits is not None):
            chunk = min(chunk, (limits.max_message_bytes - METADATA_ROOM) // row_bytes, limits.max_step_tokens // batch)
        return max(1, chunk)

    async def _replace_retrying(self, index: int, error: BaseException, failures: int) -> int:
        """`_replace` the failed stream `index`, trying other replacements while they fail; returns the failures
        counted so far (SessionError past `max_retries`)."""
        while True:
            failures += 1
            if failures > self.manager.config.max_retries:
                raise SessionError(f"step failed after {failures} tries; last error: {error}") from error
            try:
                await self._replace(index, error)
                return failures
            except SessionError:
                raise
            except Exception as replay_error:  # the replacement failed too: try another one
                error = replay_error
