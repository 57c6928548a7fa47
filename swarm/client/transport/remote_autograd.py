"""The swarm's blocks as one differentiable function: `RemoteBlocks(manager)(hidden, prompts)`.

`RemoteBlocks.__call__` applies a `torch.autograd.Function` whose forward sends hidden states `[batch, seq,
hidden]` (and deep prompts `[num_blocks, batch | 1, pre_seq_len, hidden]`) through every block of the model with
the servers' streamed training RPCs (`rpc_train_forward` / `rpc_train_backward`, `swarm.wire.streaming`), and
whose backward sends the gradients back through the same blocks, returning the gradients for the hidden states
and the prompts. The servers keep nothing between the two: the client keeps each span's input. With a LoRA
adapter, only servers that hold it are used, and each call names it (`TrainForward.adapter`).

- Sub-batches: a batch is split into parts of at most `training_sub_batch_tokens` tokens, all in flight at once.
- Routing for throughput: each sub-batch's chain is chosen by `routing.choose_training_chain` with this client's
  requests in flight per server as the load, so concurrent sub-batches spread over every server of a span.
- Failover: a failed call bans its server (`SwarmManager.ban`, back-off) and the rest of the pass is routed again
  from that span's first block, at most `max_retries` times per sub-batch and pass; a server that left the swarm
  (its record, read again at once, is no longer online) is dropped from the view instead, without a ban or a try
  (`SwarmManager.settle_failures`, the rule inference sessions and forward passes follow too). A call that ended
  without any reply (its stream or connection dropped: no answer, not an error from the server) is first sent once
  more to the same server: a span's only server is not banned for a transport hiccup. If the resend got no reply
  either, the server is banned and failed over as above only where another server serves its blocks; where it
  alone serves some of them (a ban would leave no route: the pass would fail on a server that may well be up) it
  is not banned and the pass routes again, to it, as a try. In backward, a span whose
  server left is rerouted over whatever chain now covers it; the new chain's inner inputs are recomputed by
  training forwards before the gradients go back through it.
"""
from __future__ import annotations

import asyncio
import logging
from typing import Dict, List, Optional, Tuple

import torch
from hivemind.proto import runtime_pb2
from hivemind.utils.asyncio import as_aiter

from swarm.client.transport.manager import SwarmManager
from swarm.client.transport.routing import RouteHop
from swarm.runtime import aio
from swarm.wire import protocol as P
from swarm.wire import streaming

logger = logging.getLogger(__name__)

Record = Tuple[int, int, torch.Tensor]  # (start, end, the span's input [rows, seq, hidden]) of one sub-batch
RESEND_PAUSE = 0.2  # seconds before a call that got no reply is sent again to the same server
MIN_RESEND_SHARE = 0.25  # a resend needs at least this share of `training_timeout` left, or the call fails over


def no_reply(error: BaseException) -> bool:
    """The call's stream ended without an answer from the server (dropped in transport), not with an error reply,
    a bad reply or a time-out. A stream that could not be opened (hivemind's `ControlFailure`: the server is
    unreachable) and an error raised by the server's handler (`P2PHandlerError`) are answers: not resent."""
    if isinstance(error, P.ProtocolError):
        return str(error) == streaming.EMPTY_STREAM
    if isinstance(error, ConnectionRefusedError):
        return False
    return isinstance(error, (ConnectionError, EOFError, asyncio.IncompleteReadError))


class TrainingError(RuntimeError):
    """A training pass could not be completed within the retry bound."""


class RemoteBlocks:
    """All blocks of the model on the swarm, differentiable with respect to their inputs and deep prompts."""

    def __init__(self, manager: SwarmManager):
        self.manager = manager
        self.load: Dict[str, int] = {}  # requests in flight per server (on the client loop only)
        self.calls = 0  # training calls sent (forward and backward), for tests and benchmarks
        self.resent = 0  # calls sent again to the same server after they got no reply
        self.failed: List[str] = []  # servers whose calls failed (then banned), oldest first

    def __call__(self, hidden: torch.Tensor, prompts: Optional[torch.Tensor] = None, adapter: Optional[str] = None
                 ) -> torch.Tensor:
        """hidden [batch, seq, hidden] -> the last block's output [batch, seq, hidden]; prompts (optional)
        [num_blocks, batch | 1, pre_seq_len, hidden] are added to each block's first positions; `adapter`: the
        servers' LoRA adapter the blocks run with (only servers that hold it; None: the base model)."""
        empty = torch.empty(0, dtype=hidden.dtype)
        return _RemoteFunction.apply(hidden, prompts if prompts is not None else empty, self, adapter)

    # ---- one call to one server ---------------------------------------------------------------------------
    async def _call(self, hop: RouteHop, message: P.Message, tensors: List[torch.Tensor]) -> List[torch.Tensor]:
        config = self.manager.config
        rpc = "rpc_train_backward" if isinstance(message, P.TrainBackward) else "rpc_train_forward"
        P.check_capabilities(message, hop.capabilities, hop.peer_id)  # routing kept to servers that take it
        requests = streaming.pack(runtime_pb2.ExpertRequest, message, tensors, config.max_chunk_bytes)
        self.load[hop.peer_id] = self.load.get(hop.peer_id, 0) + 1
        try:
            async def exchange() -> List[torch.Tensor]:
                self.calls += 1
                responses = await getattr(self.manager.stub(hop.peer_id), rpc)(as_aiter(*requests))
                _, out = await streaming.read_reply(responses, P.TrainResult, max_bytes=1 << 40, peer_id=hop.peer_id)
                return out

            loop = asyncio.get_running_loop()
            deadline = loop.time() + config.training_timeout  # one budget for the call and its resend
            try:
                out = await asyncio.wait_for(exchange(), config.training_timeout)
            except Exception as e:
                left = deadline - loop.time() - RESEND_PAUSE
                if not no_reply(e) or left < config.training_timeout * MIN_RESEND_SHARE:
                    raise
                logger.info(f"training call to {hop.peer_id} (blocks {hop.start}:{hop.end}) got no reply ({e!r}); "
                            f"sending it once more")
                self.resent += 1
                await asyncio.sleep(RESEND_PAUSE)
                out = await asyncio.wait_for(exchange(), left)
        finally:
            self.load[hop.peer_id] -= 1
        expected = [tuple(tensors[0].shape)]
        if isinstance(message, P.TrainBackward) and message.prompts:
            expected.append(tuple(tensors[-1].shape))
        if [tuple(t.shape) for t in out] != expected:
            raise P.RemoteError("bad_reply", f"reply tensors {[list(t.shape) for t in out]}, expected {expected}",
                                hop.peer_id)
        return [t.to(tensors[0].dtype) for t in out]

    async def _forward_hop(self, hop: RouteHop, x: torch.Tensor, prompts: Optional[torch.Tensor],
                           adapter: Optional[str]) -> torch.Tensor:
        message = P.TrainForward(start=hop.start, end=hop.end, prompts=prompts is not None, adapter=adapter)
        tensors = [x] + ([prompts[hop.start:hop.end]] if prompts is not None else [])
        return (await self._call(hop, message, tensors))[0]

    async def _backward_hop(self, hop: RouteHop, x: torch.Tensor, grad: torch.Tensor, prompts: Optional[torch.Tensor],
                            adapter: Optional[str]) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
        message = P.TrainBackward(start=hop.start, end=hop.end, prompts=prompts is not None, adapter=adapter)
        tensors = [x, grad] + ([prompts[hop.start:hop.end]] if prompts is not None else [])
        out = await self._call(hop, message, tensors)
        return out[0], (out[1] if prompts is not None else None)

    def _route(self, start: int, end: int, adapter: Optional[str], prompts: bool = False) -> List[RouteHop]:
        return self.manager.make_training_chain(start, end, load=self.load, adapter=adapter, prompts=prompts)

    async def _failed(self, hop: RouteHop, error: BaseException, tries: int, adapter: Optional[str],
                      prompts: bool) -> int:
        """The tries of a pass after its call to `hop` failed with `error`: a server that left the swarm (its record
        is no longer online) is dropped without a ban and costs no try; a call that got no reply (resent already)
        from a server that alone serves some of its blocks is counted without a ban (the pass routes to it again);
        any other is banned and counted (`SwarmManager.settle_failures`). Raises when the request itself is wrong
        or the tries run out. `adapter`, `prompts`: the pass's (what a route without the server must take)."""
        logger.warning(f"training call to {hop.peer_id} (blocks {hop.start}:{hop.end}) failed: {error}")
        if isinstance(error, P.RemoteError) and error.code == "bad_request" and "not served here" not in error.message:
            raise error  # the request itself is wrong: another server would refuse it too
        loop = asyncio.get_running_loop()
        if no_reply(error) and not await loop.run_in_executor(None, self.manager.training_route_without, hop.peer_id,
                                                              hop.start, hop.end, adapter, prompts):
            logger.info(f"{hop.peer_id} alone serves some of blocks {hop.start}:{hop.end}: not banned for a call "
                        f"that got no reply; routing to it again")
        else:
            left = await loop.run_in_executor(None, self.manager.settle_failures, [(hop.peer_id, None)])
            if hop.peer_id in left:
                return tries
            self.failed.append(hop.peer_id)
        if tries + 1 > self.manager.config.max_retries:
            raise TrainingError(f"training pass failed after {tries + 1} tries: {error}") from error
        return tries + 1

    # ---- a sub-batch's passes -----------------------------------------------------------------------------
    async def _forward_rows(self, x: torch.Tensor, prompts: Optional[torch.Tensor], adapter: Optional[str]
                            ) -> Tuple[torch.Tensor, List[Record]]:
        records: List[Record] = []
        position, tries = 0, 0
        while position < self.manager.num_blocks:
            hops = await asyncio.get_running_loop().run_in_executor(None, self._route, position,
                                                                    self.manager.num_blocks, adapter,
                                                                    prompts is not None)
            for hop in hops:
                try:
                    y = await self._forward_hop(hop, x, prompts, adapter)
                except Exception as e:
                    tries = await self._failed(hop, e, tries, adapter, prompts is not None)
                    break  # route the rest again from this hop's first block
                records.append((hop.start, hop.end, x))
                x, position = y, hop.end
        return x, records

    async def _backward_span(self, start: int, end: int, x: torch.Tensor, grad: torch.Tensor,
                             prompts: Optional[torch.Tensor], adapter: Optional[str]
                             ) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
        """Gradients through blocks [start, end) of one sub-batch whose input there was `x`."""
        tries = 0
        while True:
            hops = await asyncio.get_running_loop().run_in_executor(None, self._route, start, end, adapter,
                                                                    prompts is not None)
            hop = hops[0]
            try:
                inputs = [x]
                for hop in hops[:-1]:  # a span rerouted over several servers: their inputs, recomputed
                    inputs.append(await self._forward_hop(hop, inputs[-1], prompts, adapter))
                g, grads_p = grad, []
                for hop, inp in zip(reversed(hops), reversed(inputs)):
                    g, gp = await self._backward_hop(hop, inp, g, prompts, adapter)
                    if gp is not None:
                        grads_p.append(gp)
                grad_prompts = torch.cat(grads_p[::-1]) if prompts is not None else None
                return g, grad_prompts
            except Exception as e:
                tries = await self._failed(hop, e, tries, adapter, prompts is not None)

    async def _backward_rows(self, records: List[Record], grad: torch.Tensor, prompts: Optional[torch.Tensor],
                             adapter: Optional[str]) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
        grad_prompts = None if prompts is None else torch.zeros_like(prompts)
        for start, end, x in reversed(records):
            grad, gp = await self._backward_span(start, end, x, grad, prompts, adapter)
            if grad_prompts is not None and gp is not None:
                grad_prompts[start:end] = gp
        return grad, grad_prompts

    # ---- the whole batch ----------------------------------------------------------------------------------
    def _sub_batches(self, hidden: torch.Tensor) -> List[slice]:
        batch, seq = hidden.shape[:2]
        rows = max(1, self.manager.config.training_sub_batch_tokens // seq)
        return [slice(i, i + rows) for i in range(0, batch, rows)]

    def forward(self, hidden: torch.Tensor, prompts: Optional[torch.Tensor], adapter: Optional[str] = None
                ) -> Tuple[torch.Tensor, List[Tuple[slice, List[Record]]]]:
        parts = self._sub_batches(hidden)

        async def run():
            return await asyncio.gather(*(self._forward_rows(hidden[rows], _rows(prompts, rows), adapter)
                                          for rows in parts))

        results = aio.run(run())
        output = torch.cat([out for out, _ in results])
        return output, [(rows, records) for rows, (_, records) in zip(parts, results)]

    def backward(self, saved: List[Tuple[slice, List[Record]]], grad_output: torch.Tensor,
                 prompts: Optional[torch.Tensor], adapter: Optional[str] = None
                 ) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
        async def run():
            return await asyncio.gather(*(self._backward_rows(records, grad_output[rows], _rows(prompts, rows),
                                                              adapter) for rows, records in saved))

        results = aio.run(run())
        grad_input = torch.cat([g for g, _ in results])
        if prompts is None:
            return grad_input, None
        if prompts.shape[1] == 1:  # one prompt for every row: the sub-batches' gradients add up
            grad_prompts = torch.stack([gp for _, gp in results if gp is not None]).sum(0)
        else:
            grad_prompts = torch.cat([gp for _, gp in results if gp is not None], dim=1)
        return grad_input, grad_prompts


def _rows(prompts: Optional[torch.Tensor], rows: slice) -> Optional[torch.Tensor]:
    """The prompts of some rows: [num_blocks, batch | 1, pre, hidden] -> [num_blocks, rows | 1, pre, hidden]."""
    if prompts is None or prompts.shape[1] == 1:
        return prompts
    return prompts[:, rows]


class _RemoteFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden: torch.Tensor, prompts: torch.Tensor, blocks: RemoteBlocks, adapter: Optional[str]
                ) -> torch.Tensor:
        deep = prompts if prompts.numel() else None
        output, saved = blocks.forward(hidden.detach(), None if deep is None else deep.detach(), adapter)
        ctx.blocks, ctx.saved, ctx.deep, ctx.adapter = blocks, saved, deep is not None, adapter
        ctx.save_for_backward(prompts.detach())
        return output.to(hidden.dtype)

    @staticmethod
    def backward(ctx, grad_output: torch.Tensor):
        (prompts,) = ctx.saved_tensors
        grad_input, grad_prompts = ctx.blocks.backward(ctx.saved, grad_output.contiguous(),
                                                       prompts if ctx.deep else None, ctx.adapter)
        if not ctx.deep or not ctx.needs_input_grad[1]:
            grad_prompts = None
        return grad_input, grad_prompts, None, None
