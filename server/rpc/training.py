"""Training passes on a block server: the streamed `rpc_train_forward` / `rpc_train_backward` handlers.

The weights stay frozen; only the inputs (and deep prompts) get gradients. A call may name one of the server's LoRA
adapters (`TrainForward.adapter`): each block is then its fused layer with the adapter's deltas, which stay frozen
too (gradients flow through them to the inputs). A training forward runs the span's
layer modules without a cache (`BlockSpan.layers`, the same modules as `rpc_forward`, outside inference mode).
A backward keeps nothing from the forward call: it reruns the span from the hidden states the client sends, with
autograd on for each block's input (and prompt) only, keeping each piece's graph, then walks the blocks backwards
pulling `grad_output` through those graphs (one forward + one backward of work per block).

Scheduling: every piece of work is one block over at most `train_piece_tokens` tokens (whole rows), submitted to
the compute thread at `PRIORITY_TRAINING`, below decode steps, prefill chunks and plain forwards, so a long
training pass yields to live sessions' decode steps between pieces.

Quantized spans (`--quant_type int8 / nf4`) run the same path: bitsandbytes' `Linear8bitLt` / `Linear4bit` pass
gradients to their inputs on the CPU (tests/swarm/client/test_training_unit.py), approximately: int8's gradient is
within ~4% (relative norm) of the float block's, nf4's within ~6% of a finite difference of its own forward; exact
(1e-4) gradients need float servers.

Deep prompts follow Petals: `prompts[i]` `[batch | 1, pre_seq_len, hidden]` is added to the first pre_seq_len
positions of block `start + i`'s input.
"""
from __future__ import annotations

import asyncio
import logging
from typing import TYPE_CHECKING, Any, AsyncGenerator, AsyncIterator, Awaitable, Callable, List, Optional, Tuple

import torch
from hivemind.p2p import P2PContext
from hivemind.proto import runtime_pb2

from server.compute.blocks import add_prompt
from server.compute.decode import attention_backends
from server.rpc.limits import StreamLimiter
from server.rpc.refusal import admitted, refuse
from swarm.modeling.layers import cache_attention, causal_mask
from swarm.modeling.lora import adapt_layers
from swarm.runtime.swarm_key import NOT_A_MEMBER
from swarm.runtime.taskpool import PRIORITY_TRAINING
from swarm.wire import protocol as P
from swarm.wire import streaming

if TYPE_CHECKING:
    from server.compute.blocks import BlockSpan
    from swarm.runtime.taskpool import TaskPool

logger = logging.getLogger(__name__)

TRAIN_PIECE_TOKENS = 1024  # tokens of one piece of a training pass (one block, whole rows)


def _run_block(span: "BlockSpan", index: int, hidden: torch.Tensor, prompt: Optional[torch.Tensor],
               adapter: Optional[str] = None) -> torch.Tensor:
    """Block `index` (of the model) on hidden [batch, seq, hidden], positions from 0, causal, no cache; the prompt
    [batch | 1, pre_seq_len, hidden] is added to the first positions of its input. With LoRA `adapter`: the fused
    layer wrapped with its deltas (`lora.adapt_layers`), as `BlockSpan.forward`'s pass without a cache."""
    if prompt is not None:
        hidden = add_prompt(hidden, prompt, 0)
    batch, seq, _ = hidden.shape
    position_ids = torch.arange(seq, device=span.device).unsqueeze(0).expand(batch, -1)
    embeddings = span.rotary(hidden, position_ids) if span.rotary is not None else None
    layer = span.layers[index - span.start]
    # causal (None: SDPA's own), cut by the layer's sliding window where it has one and the sequence is longer
    mask = causal_mask(0, seq, getattr(layer, "sliding_window", None), hidden.dtype, span.device)
    with attention_backends(span.device):
        if adapter is not None:
            adapted = adapt_layers([span.fused[index - span.start]], [(0, batch * seq, span.adapters[adapter])],
                                   index)[0]
            cos, sin = embeddings if embeddings is not None else (None, None)
            return adapted.step(hidden, cos, sin, cache_attention(None, mask, mask))
        out = layer(hidden, attention_mask=mask, position_ids=position_ids,
                                              past_key_values=None, use_cache=False, position_embeddings=embeddings)
    return out[0] if isinstance(out, tuple) else out


def block_forward(span: "BlockSpan", index: int, hidden: torch.Tensor, prompt: Optional[torch.Tensor],
                  adapter: Optional[str] = None) -> torch.Tensor:
    with torch.no_grad():
        return _run_block(span, index, hidden, prompt, adapter)


def block_graph(span: "BlockSpan", index: int, hidden: torch.Tensor, prompt: Optional[torch.Tensor],
                adapter: Optional[str] = None) -> Tuple[torch.Tensor, List[torch.Tensor]]:
    """The block's output with its autograd graph, and the graph's leaves: the input (and the prompt); the weights
    do not require grad, so the graph keeps only what the input's gradient needs."""
    with torch.enable_grad():
        leaves = [hidden.detach().requires_grad_(True)]
        if prompt is not None:
            leaves.append(prompt.detach().requires_grad_(True))
        return _run_block(span, index, leaves[0], leaves[1] if prompt is not None else None, adapter), leaves


def graph_backward(out: torch.Tensor, leaves: List[torch.Tensor], grad_output: torch.Tensor
                   ) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
    """(grad wrt the input [batch, seq, hidden], grad wrt the prompt or None) through a `block_graph`."""
    grads = torch.autograd.grad(out, leaves, grad_output)
    return grads[0], (grads[1] if len(grads) > 1 else None)


def block_backward(span: "BlockSpan", index: int, hidden: torch.Tensor, prompt: Optional[torch.Tensor],
                   grad_output: torch.Tensor, adapter: Optional[str] = None
                   ) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
    """`block_graph` then `graph_backward`: one block's gradients for its input and prompt."""
    return graph_backward(*block_graph(span, index, hidden, prompt, adapter), grad_output)


def _pieces(batch: int, seq: int, piece_tokens: int) -> List[slice]:
    rows = max(1, piece_tokens // max(seq, 1))
    return [slice(i, i + rows) for i in range(0, batch, rows)]


def _rows(prompt: Optional[torch.Tensor], rows: slice) -> Optional[torch.Tensor]:
    if prompt is None or prompt.shape[0] == 1:
        return prompt
    return prompt[rows]


class TrainingHandler(P.BlockRPC):
    """The training RPCs of `server.rpc.handler.BlockHandler` (which sets the attributes below)."""

    span: "BlockSpan"
    pool: "TaskPool"
    max_length: int
    max_batch_tokens: int
    step_timeout: float
    streams: StreamLimiter
    train_piece_tokens: int = TRAIN_PIECE_TOKENS
    training_tokens: int = 0

    def _check_range(self, start: int, end: int) -> None:
        raise NotImplementedError

    def _check_adapter(self, adapter: Optional[str]) -> None:
        raise NotImplementedError

    def _admits(self, context: P2PContext, proof: str) -> bool:
        """Whether the caller may use this server (`BlockHandler`: members only in a private swarm)."""
        raise NotImplementedError

    async def _admitted(self, requests: AsyncIterator[runtime_pb2.ExpertRequest], context: P2PContext
                        ) -> Optional[AsyncIterator[runtime_pb2.ExpertRequest]]:
        """The stream (its first request put back) when its first request proves the caller's membership (a private
        swarm; any caller in an open one), else None."""
        try:
            first = await requests.__anext__()
        except StopAsyncIteration:
            first = None
        if first is not None and not self._admits(context, first.uid):
            return None

        async def chained() -> AsyncIterator[runtime_pb2.ExpertRequest]:
            if first is not None:
                yield first
            async for request in requests:
                yield request

        return chained()

    # ---- validation ---------------------------------------------------------------------------------------
    def _max_train_bytes(self) -> int:
        # hidden + grad_output + prompts for every block (each at most max_batch_tokens rows of float32)
        return (2 + len(self.span.layers)) * self.max_batch_tokens * self.span.hidden_size * 4

    async def _read_train(self, requests: AsyncIterator[runtime_pb2.ExpertRequest], kind: type):
        """(message, hidden [batch, seq, hidden], grad_output or None, prompts [blocks, batch | 1, pre, hidden] or
        None), all validated, in the span's dtype; ProtocolError otherwise."""
        metadata, parts = await streaming.collect(requests, self._max_train_bytes())
        message: Any = P.decode(metadata, kind)
        self._check_range(message.start, message.end)
        self._check_adapter(message.adapter)
        tensors = streaming.unpack(parts, max_elements=self._max_train_bytes())
        backward = kind is P.TrainBackward
        names = ["hidden"] + (["grad_output"] if backward else []) + (["prompts"] if message.prompts else [])
        if len(tensors) != len(names):
            raise P.ProtocolError(f"expected {len(names)} tensors ({', '.join(names)}), got {len(tensors)}")
        named = dict(zip(names, tensors))
        hidden = named["hidden"]
        if hidden.ndim != 3 or hidden.shape[-1] != self.span.hidden_size or 0 in hidden.shape:
            raise P.ProtocolError(
                f"hidden states must have shape [batch>0, seq>0, {self.span.hidden_size}], got {list(hidden.shape)}")
        batch, seq = hidden.shape[:2]
        if batch * seq > self.max_batch_tokens:
            raise P.ProtocolError(f"{batch * seq} tokens exceed this server's limit of {self.max_batch_tokens} "
                                  f"per call")
        if seq > self.max_length:
            raise P.ProtocolError(f"sequence of {seq} exceeds this server's limit {self.max_length}")
        grad = named.get("grad_output")
        if grad is not None and grad.shape != hidden.shape:
            raise P.ProtocolError(f"grad_output has shape {list(grad.shape)}, hidden states {list(hidden.shape)}")
        prompts = named.get("prompts")
        if prompts is not None:
            expected = (message.end - message.start, batch, seq, self.span.hidden_size)
            if (prompts.ndim != 4 or prompts.shape[0] != expected[0] or prompts.shape[1] not in (1, batch)
                    or not 0 < prompts.shape[2] <= seq or prompts.shape[3] != expected[3]):
                raise P.ProtocolError(
                    f"prompts must have shape [{expected[0]}, {batch} or 1, pre_seq_len <= {seq}, {expected[3]}], "
                    f"got {list(prompts.shape)}")
        for name, tensor in named.items():
            if not torch.isfinite(tensor).all():
                raise P.ProtocolError(f"{name} contains NaN or infinite values")
        cast = [None if t is None else t.to(self.span.device, self.span.dtype) for t in (hidden, grad, prompts)]
        return message, cast[0], cast[1], cast[2]

    # ---- the passes, in pieces ----------------------------------------------------------------------------
    async def _forward_pieces(self, hidden: torch.Tensor, prompts: Optional[torch.Tensor], start: int, end: int,
                              adapter: Optional[str] = None) -> torch.Tensor:
        """The span's output [batch, seq, hidden], without autograd."""
        pieces = _pieces(hidden.shape[0], hidden.shape[1], self.train_piece_tokens)
        for index in range(start, end):
            prompt = None if prompts is None else prompts[index - start]
            outs = [await self.pool.submit(PRIORITY_TRAINING, block_forward, self.span, index, hidden[rows],
                                           _rows(prompt, rows), adapter) for rows in pieces]
            hidden = outs[0] if len(outs) == 1 else torch.cat(outs)
        return hidden

    async def _backward_pieces(self, hidden: torch.Tensor, grad: torch.Tensor, prompts: Optional[torch.Tensor],
                               start: int, end: int, adapter: Optional[str] = None
                               ) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
        """The span's forward again, each piece keeping its autograd graph (the call's only state, dropped block by
        block as the gradients go back), then the pieces' backwards in reverse order."""
        pieces = _pieces(hidden.shape[0], hidden.shape[1], self.train_piece_tokens)
        graphs: List[list] = []  # per block, per piece: (output with its graph, leaves)
        x = hidden
        for index in range(start, end):
            prompt = None if prompts is None else prompts[index - start]
            level = [await self.pool.submit(PRIORITY_TRAINING, block_graph, self.span, index, x[rows],
                                            _rows(prompt, rows), adapter) for rows in pieces]
            graphs.append(level)
            x = torch.cat([out.detach() for out, _ in level]) if len(level) > 1 else level[0][0].detach()
        grad_prompts = None if prompts is None else torch.zeros_like(prompts)
        for index in reversed(range(start, end)):
            level = graphs.pop()
            grads_in = []
            for rows, (out, leaves) in zip(pieces, level):
                grad_in, grad_prompt = await self.pool.submit(PRIORITY_TRAINING, graph_backward, out, leaves,
                                                              grad[rows])
                grads_in.append(grad_in)
                if grad_prompts is not None and grad_prompt is not None:
                    if prompts is not None and prompts.shape[1] == 1:
                        grad_prompts[index - start] += grad_prompt
                    else:
                        grad_prompts[index - start][rows] = grad_prompt
            grad = grads_in[0] if len(grads_in) == 1 else torch.cat(grads_in)
        return grad, grad_prompts

    # ---- RPCs ---------------------------------------------------------------------------------------------
    async def rpc_train_forward(
        self, requests: AsyncIterator[runtime_pb2.ExpertRequest], context: P2PContext
    ) -> AsyncIterator[runtime_pb2.ExpertResponse]:
        async def forward(message, hidden, grad, prompts) -> List[torch.Tensor]:
            return [await self._forward_pieces(hidden, prompts, message.start, message.end, message.adapter)]

        async for response in self._train_rpc(requests, context, P.TrainForward, "forward", forward):
            yield response

    async def rpc_train_backward(
        self, requests: AsyncIterator[runtime_pb2.ExpertRequest], context: P2PContext
    ) -> AsyncIterator[runtime_pb2.ExpertResponse]:
        async def backward(message, hidden, grad, prompts) -> List[torch.Tensor]:
            assert grad is not None
            grad_input, grad_prompts = await self._backward_pieces(hidden, grad, prompts, message.start, message.end,
                                                                   message.adapter)
            return [grad_input] if grad_prompts is None else [grad_input, grad_prompts]

        async for response in self._train_rpc(requests, context, P.TrainBackward, "backward", backward):
            yield response

    async def _train_rpc(self, requests: AsyncIterator[runtime_pb2.ExpertRequest], context: P2PContext,
                         message_type: Any, name: str, compute: Callable[..., Awaitable[List[torch.Tensor]]]
                         ) -> AsyncIterator[runtime_pb2.ExpertResponse]:
        """One training call: admission (private swarms), the streamed request read and checked, `compute`, and
        its tensors streamed back; every failure is an error reply on this call only. A call counts as an open
        stream (`--max_streams`) while it runs, and its request must arrive whole within `step_timeout`."""
        async for response in admitted(self.streams, requests,
                                       lambda: self._train_call(requests, context, message_type, name, compute)):
            yield response

    async def _train_call(self, requests: AsyncIterator[runtime_pb2.ExpertRequest], context: P2PContext,
                          message_type: Any, name: str, compute: Callable[..., Awaitable[List[torch.Tensor]]]
                          ) -> AsyncGenerator[runtime_pb2.ExpertResponse, None]:
        async def read():
            admitted = await self._admitted(requests, context)
            return None if admitted is None else await self._read_train(admitted, message_type)

        try:
            read_call = await asyncio.wait_for(read(), timeout=self.step_timeout)
        except asyncio.TimeoutError:
            yield P.error_response("timeout", f"the request did not arrive whole within {self.step_timeout:g}s "
                                              f"(the server's --step_timeout)")
            return
        except (P.ProtocolError, ValueError) as e:
            async for reply in refuse(requests, "bad_request", str(e)):  # what the caller still sends is read
                yield reply
            return
        if read_call is None:
            yield P.error_response("forbidden", NOT_A_MEMBER)
            return
        message, hidden, grad, prompts = read_call
        try:
            tensors = await compute(message, hidden, grad, prompts)
        except Exception as e:
            logger.exception(f"training {name} failed")
            yield P.error_response("internal", f"training {name} failed: {type(e).__name__}: {e}", message.v)
            return
        self.training_tokens += hidden.shape[0] * hidden.shape[1]
        # in the request's protocol version (a call that could not be read is answered in this server's newest)
        for response in streaming.pack(runtime_pb2.ExpertResponse, P.TrainResult(v=message.v), tensors):
            yield response
