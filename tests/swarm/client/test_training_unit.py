"""Training pieces without processes: chunked streams (`swarm.wire.streaming`), routing for throughput on synthetic
swarms (`choose_training_chain`), and the server's block backward (`server.rpc.training`) against autograd through
transformers' layer, in float and with bitsandbytes' int8 / nf4 layers on the CPU."""
from __future__ import annotations

import asyncio
import collections

import pytest
import torch
from hivemind.proto import runtime_pb2
from hivemind.utils.asyncio import as_aiter

from swarm.client.transport.routing import RoutingError, choose_training_chain
from swarm.wire import protocol as P
from swarm.wire import streaming
from tests.fixtures.synthetic_swarm import make_span


# ---- streaming --------------------------------------------------------------------------------------------------
def _roundtrip(tensors, chunk_bytes, max_bytes=1 << 30):
    envelopes = streaming.pack(runtime_pb2.ExpertRequest, P.TrainForward(start=0, end=3), tensors, chunk_bytes)
    metadata, parts = asyncio.run(streaming.collect(as_aiter(*envelopes), max_bytes))
    return envelopes, P.decode(metadata, P.TrainForward), streaming.unpack(parts)


def test_stream_roundtrip_in_chunks():
    tensors = [torch.randn(3, 50, 64), torch.randn(2, 1, 4, 64).to(torch.bfloat16), torch.empty(0, 64),
               torch.randn(7)]
    envelopes, message, out = _roundtrip(tensors, chunk_bytes=4096)
    assert len(envelopes) >= 10 and all(sum(len(t.buffer) for t in e.tensors) <= 4096 for e in envelopes)
    assert message == P.TrainForward(start=0, end=3) and not any(e.metadata for e in envelopes[1:])
    assert len(out) == len(tensors)
    for a, b in zip(out, tensors):
        assert a.dtype == b.dtype and torch.equal(a, b)


def test_stream_limits_and_malformed_parts():
    with pytest.raises(P.ProtocolError, match="exceeds this server's limit of 1000 bytes"):
        _roundtrip([torch.randn(1000)], chunk_bytes=512, max_bytes=1000)
    envelopes = streaming.pack(runtime_pb2.ExpertRequest, P.TrainForward(start=0, end=3), [torch.randn(300)], 256)
    with pytest.raises(P.ProtocolError, match="without a header"):
        streaming.unpack(list(envelopes[1].tensors) + list(envelopes[0].tensors))
    with pytest.raises(P.ProtocolError, match="stream ended"):
        streaming.unpack(list(envelopes[0].tensors))
    envelopes[1].metadata = b"{}"
    with pytest.raises(P.ProtocolError, match="first message"):
        asyncio.run(streaming.collect(as_aiter(*envelopes), 1 << 20))
    with pytest.raises(P.ProtocolError, match="empty stream"):
        asyncio.run(streaming.collect(as_aiter(), 1 << 20))


# ---- routing for throughput -------------------------------------------------------------------------------------
def _dispatch(spans, n, start=0, end=30):
    """Route n concurrent sub-batches, each adding its chain to the load (requests in flight)."""
    load: collections.Counter = collections.Counter()
    chains = []
    for _ in range(n):
        chain = choose_training_chain(spans, start, end, load=load)
        load.update(hop.peer_id for hop in chain)
        chains.append(chain)
    return chains, load


def test_training_chains_spread_over_every_server_of_a_span():
    spans = [make_span("a1", 0, 15), make_span("a2", 0, 15), make_span("b", 15, 30), make_span("c", 0, 30)]
    chains, load = _dispatch(spans, 6)
    for chain in chains:
        assert chain[0].start == 0 and chain[-1].end == 30
        assert all(x.end == y.start for x, y in zip(chain, chain[1:]))
    assert set(load) == {"a1", "a2", "b", "c"}  # not only the fastest chain
    assert max(load["a1"], load["a2"], load["c"]) - min(load["a1"], load["a2"], load["c"]) <= 1


def test_training_chains_follow_throughput_and_avoid_banned():
    spans = [make_span("fast", 0, 30, throughput=3.0), make_span("slow", 0, 30, throughput=1.0)]
    _, load = _dispatch(spans, 8)
    assert load == {"fast": 6, "slow": 2}
    assert [h.peer_id for h in choose_training_chain(spans, 0, 30, load={"fast": 10})] == ["slow"]
    assert [h.peer_id for h in choose_training_chain(spans, 0, 30, banned=["fast"])] == ["slow"]
    with pytest.raises(RoutingError):
        choose_training_chain(spans, 0, 30, banned=["fast", "slow"])


def test_training_chain_of_a_sub_range():
    spans = [make_span("a", 0, 20), make_span("b", 10, 30)]
    chain = choose_training_chain(spans, 12, 25)
    assert chain[0].start == 12 and chain[-1].end == 25


# ---- the server's block backward --------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def checkpoint(model_path):
    from swarm.modeling.checkpoint import Checkpoint

    return Checkpoint(model_path)


def _reference_block(reference_model, index, hidden, prompt):
    model = reference_model.model
    h = torch.cat([hidden[:, :prompt.shape[1]] + prompt, hidden[:, prompt.shape[1]:]], dim=1)
    position_ids = torch.arange(h.shape[1]).unsqueeze(0)
    embeddings = model.rotary_emb(h, position_ids)
    mask = torch.full((h.shape[1], h.shape[1]), float("-inf")).triu(1)[None, None]
    out = model.layers[index](h, attention_mask=mask, position_ids=position_ids, position_embeddings=embeddings)
    return out[0] if isinstance(out, tuple) else out


def test_block_backward_matches_transformers(checkpoint, reference_model):
    from server.compute.blocks import BlockSpan
    from server.rpc.training import block_backward, block_forward

    span = BlockSpan.load(checkpoint, 3, 5)
    torch.manual_seed(0)
    hidden, grad = torch.randn(2, 7, 576) * 0.5, torch.randn(2, 7, 576)
    prompt = torch.randn(1, 3, 576) * 0.1
    leaves = [hidden.clone().requires_grad_(True), prompt.clone().requires_grad_(True)]
    ref_out = _reference_block(reference_model, 4, *leaves)
    ref_grads = torch.autograd.grad(ref_out, leaves, grad)
    torch.testing.assert_close(block_forward(span, 4, hidden, prompt), ref_out.detach(), atol=1e-5, rtol=1e-5)
    grad_in, grad_prompt = block_backward(span, 4, hidden, prompt, grad)
    torch.testing.assert_close(grad_in, ref_grads[0], atol=1e-4, rtol=1e-5)
    torch.testing.assert_close(grad_prompt, ref_grads[1], atol=1e-4, rtol=1e-5)
    assert not any(p.requires_grad or p.grad is not None for p in span.parameters())  # weights stay frozen


@pytest.mark.parametrize("quant_type", ["int8", "nf4"])
def test_quantized_blocks_pass_input_gradients_on_cpu(checkpoint, quant_type):
    """bitsandbytes' Linear8bitLt / Linear4bit propagate gradients to their inputs on the CPU. nf4 (float
    activations) agrees with a finite difference of its own forward to within 10% only (measured: 6%; its
    backward is not bit-for-bit the derivative of its CPU forward); int8 (activations quantized per row, a
    piecewise function) stays within 10% of the float block's gradient."""
    pytest.importorskip("bitsandbytes")
    from server.compute.blocks import BlockSpan
    from server.rpc.training import block_backward, block_forward

    torch.manual_seed(0)
    hidden, grad = torch.randn(2, 7, 576) * 0.5, torch.randn(2, 7, 576)
    span = BlockSpan.load(checkpoint, 0, 1, quant_type=quant_type)
    grad_in, _ = block_backward(span, 0, hidden, None, grad)
    assert torch.isfinite(grad_in).all()
    if quant_type == "nf4":
        direction, eps = torch.randn_like(hidden), 1e-2
        plus = block_forward(span, 0, (hidden + eps * direction).double().float(), None)
        minus = block_forward(span, 0, hidden - eps * direction, None)
        numeric = ((plus - minus) * grad).sum() / (2 * eps)
        analytic = (grad_in * direction).sum()
        assert abs(numeric - analytic) < 0.1 * abs(analytic)
    else:
        float_grad, _ = block_backward(BlockSpan.load(checkpoint, 0, 1), 0, hidden, None, grad)
        assert (grad_in - float_grad).norm() < 0.1 * float_grad.norm()


def test_a_long_training_pass_lets_decode_steps_in_between(checkpoint, monkeypatch):
    """A training forward runs in one-block pieces of at most `train_piece_tokens` at `PRIORITY_TRAINING`: a decode
    step submitted while it runs goes before the pass's next pieces, not after the whole pass."""
    import server.rpc.training as training
    from server.compute.blocks import BlockSpan
    from swarm.runtime.taskpool import PRIORITY_DECODE, TaskPool

    log: list = []
    original = training.block_forward

    def logged(span, index, hidden, prompt, adapter=None):
        log.append(("train", index, hidden.shape[0]))
        return original(span, index, hidden, prompt, adapter)

    monkeypatch.setattr(training, "block_forward", logged)

    class Handler(training.TrainingHandler):
        def __init__(self, span, pool):
            self.span, self.pool, self.max_length, self.max_batch_tokens = span, pool, 1024, 1 << 16
            self.train_piece_tokens = 16  # 2 rows of 8 tokens per piece

    pool = TaskPool(adapt_threads=False)
    handler = Handler(BlockSpan.load(checkpoint, 0, 2), pool)
    hidden = torch.randn(8, 8, 576)

    async def run():
        task = asyncio.ensure_future(handler._forward_pieces(hidden, None, 0, 2))
        while not log:
            await asyncio.sleep(0.001)
        await pool.submit(PRIORITY_DECODE, lambda: log.append(("decode",)))
        return await task

    try:
        output = asyncio.run(run())
    finally:
        pool.shutdown()
    assert [entry[0] for entry in log].count("train") == 8  # 2 blocks x 4 pieces of 2 rows
    assert log.index(("decode",)) <= 2  # after the piece under way (and at most one more), not after all 8
    torch.testing.assert_close(output, training.block_forward(handler.span, 1, original(handler.span, 0, hidden, None),
                                                               None))
