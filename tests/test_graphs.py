"""CUDA-graph decode (`server.graphs`) against the span's layer modules (`swarm.modeling.llama`, themselves checked
against transformers in test_layers), per family, on tiny random checkpoints.

`static_decode_step` (the computation a graph captures: position as a tensor, attention over the whole cache
with a mask) is checked on the CPU; capture and replay on a CUDA device run only where one is present."""
from __future__ import annotations

import pytest
import torch

from server.blocks import BlockSpan
from server.graphs import clear_unfilled, static_decode_step
from swarm.modeling.checkpoint import Checkpoint
from tests.test_families import _configs

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.fixture(scope="module", params=["llama", "mistral", "qwen2"])
def checkpoint(request, tmp_path_factory):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    path = tmp_path_factory.mktemp(f"graphs-{request.param}")
    AutoModelForCausalLM.from_config(_configs()[request.param]).save_pretrained(path)
    return Checkpoint(str(path))


def _static_step(span, x, position, kv, first, last):
    """forward_batch's bookkeeping around static_decode_step, for x: [batch, 1, hidden]."""
    rows = x.reshape(-1, span.hidden_size)
    cos, sin = span.rotary(rows, torch.full((rows.shape[0], 1), position))
    kv.begin_step(position)
    out = static_decode_step(span.fused[first - span.start:last - span.start], rows, cos[:, 0], sin[:, 0], kv,
                             torch.tensor([position]), torch.arange(kv.max_length))
    kv.end_step(1)
    return out.unsqueeze(1)


def test_static_step_matches_the_hf_layers_on_cpu(checkpoint):
    span = BlockSpan.load(checkpoint, 1, 4, "float32")
    torch.manual_seed(1)
    prompt = torch.randn(2, 5, span.hidden_size)
    ref, static = span.new_session_kv(2, 24, 2, 4), span.new_session_kv(2, 24, 2, 4)
    span.forward(prompt, 0, ref, 2, 4)
    span.forward(prompt, 0, static, 2, 4)
    clear_unfilled(static)
    position = 5
    for step in range(5):
        if step == 3:  # the client rewinds by two positions
            position -= 2
        x = torch.randn(2, 1, span.hidden_size)
        expected = span.forward(x, position, ref, 2, 4)
        got = _static_step(span, x, position, static, 2, 4)
        assert torch.allclose(got, expected, atol=1e-5, rtol=1e-5), (got - expected).abs().max()
        position += 1
    assert static.length == ref.length == position


@cuda
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_graphed_steps_match_the_hf_layers_on_cuda(checkpoint, dtype):
    span = BlockSpan.load(checkpoint, 0, 4, dtype, "cuda")
    assert span.enable_cuda_graphs()
    tol = 1e-4 if dtype == "float32" else 3e-2
    torch.manual_seed(3)
    hidden = span.hidden_size
    sessions = [(1, 7), (2, 3)]  # (batch, prompt length)
    ref_kvs, kvs, positions = [], [], []
    for batch, length in sessions:
        prompt = torch.randn(batch, length, hidden, device="cuda", dtype=span.dtype)
        ref, kv = span.new_session_kv(batch, 32, 0, 4), span.new_session_kv(batch, 32, 0, 4)
        span.forward(prompt, 0, ref)
        span.forward(prompt, 0, kv)
        ref_kvs.append(ref), kvs.append(kv), positions.append(length)
    for step in range(6):
        xs = [torch.randn(b, 1, hidden, device="cuda", dtype=span.dtype) for b, _ in sessions]
        if step == 4:
            positions[0] -= 3  # rewind the first session
        expected = [span.forward(x, p, ref) for x, p, ref in zip(xs, positions, ref_kvs)]
        if step in (2, 3):  # both sessions in one batch: their graphs one after another, then the eager lean path
            span.graphs.max_sessions = 2 if step == 2 else 1
            got = span.forward_batch([(x, p, kv) for x, p, kv in zip(xs, positions, kvs)], 0, 4)
        else:  # each alone: its graph
            got = [span.forward_batch([(x, p, kv)], 0, 4)[0] for x, p, kv in zip(xs, positions, kvs)]
        for e, g in zip(expected, got):
            scale = e.abs().max().item()
            assert (g.float() - e.float()).abs().max().item() <= tol * max(scale, 1.0)
        positions = [p + 1 for p in positions]
    assert span.graphs.captures == 2  # one graph per session, replayed afterwards
    assert [kv.length for kv in kvs] == positions
    # every session closes (their graphs go), then a new one opens: it captures from the same memory pool
    del kvs
    ref, kv = span.new_session_kv(1, 16, 0, 4), span.new_session_kv(1, 16, 0, 4)
    prompt = torch.randn(1, 4, hidden, device="cuda", dtype=span.dtype)
    span.forward(prompt, 0, ref)
    span.forward(prompt, 0, kv)
    x = torch.randn(1, 1, hidden, device="cuda", dtype=span.dtype)
    expected, got = span.forward(x, 4, ref), span.forward_batch([(x, 4, kv)], 0, 4)[0]
    assert (got.float() - expected.float()).abs().max().item() <= tol * max(expected.abs().max().item(), 1.0)
    assert span.graphs.captures == 3
