"""Sliding-window attention (Mistral, Qwen2's windowed layers, Mixtral) on tiny checkpoints with a window of 8 and
sequences three times as long, against transformers running the same checkpoint: a prompt, a prompt in chunks
(later chunks see the cache through the window), decode steps, batched decode of sessions at different positions,
a pass without a cache, and the CUDA-graph step's computation (run eagerly here). A query at position p sees the
keys p - 7 .. p, as transformers' sliding-window mask.

The windowed blocks' caches are ring buffers of 2 windows (`server.compute.cache`): the sequences here wrap them twice,
and a prefill chunk is longer than a ring. A rewind within the ring's slack gives the same results; one farther
back is refused with a clear error.
"""
from __future__ import annotations

import pytest
import torch

from server.compute.blocks import BlockSpan
from swarm.modeling.checkpoint import Checkpoint
from tests.fixtures.tiny_checkpoints import save_tiny

WINDOW = 8
CASES = {
    "mistral": dict(sliding_window=WINDOW),
    # layers 2 and 3 windowed, 0 and 1 full (transformers' layer_types from max_window_layers)
    "qwen2": dict(use_sliding_window=True, sliding_window=WINDOW, max_window_layers=2),
    "mixtral": dict(sliding_window=WINDOW),
}
LENGTH = 5 * WINDOW
MAX_LENGTH = 64


@pytest.fixture(scope="module", params=list(CASES))
def model(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(f"window-{request.param}")
    reference = save_tiny(request.param, path, None, vocab_size=512, **CASES[request.param])
    span = BlockSpan.load(Checkpoint(str(path)), 0, 4, "float32")
    torch.manual_seed(1)
    ids = torch.randint(3, 512, (2, LENGTH))
    with torch.no_grad():
        expected = reference(ids).logits  # [2, LENGTH, vocab]
    return request.param, reference, span, ids, expected


def _logits(reference, hidden: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return reference.lm_head(reference.model.norm(hidden))


def _embed(reference, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return reference.model.embed_tokens(ids)


def _close(got: torch.Tensor, expected: torch.Tensor) -> None:
    assert got.shape == expected.shape
    assert (got - expected).abs().max().item() < 1e-4


def test_the_layers_carry_the_window_and_keep_rings(model):
    family, _, span, _, _ = model
    windows = [layer.sliding_window for layer in span.fused]
    assert windows == ([None, None, WINDOW, WINDOW] if family == "qwen2" else [WINDOW] * 4)
    assert [layer.sliding_window for layer in span.layers] == windows
    kv = span.new_session_kv(2, MAX_LENGTH, 0, 4)
    lengths = [MAX_LENGTH if w is None else 2 * WINDOW for w in windows]
    assert [k.shape[2] for k in kv.keys] == [v.shape[2] for v in kv.values] == lengths
    assert span.cache_tokens(MAX_LENGTH, 0, 4) == sum(lengths) // 4  # what a session reserves per row
    assert span.new_session_kv(1, 12, 0, 4).keys[-1].shape[2] == 12  # shorter than a ring: as before


def test_rewinds_within_the_ring_and_beyond(model):
    _, reference, span, ids, expected = model
    hidden = _embed(reference, ids)
    kv = span.new_session_kv(2, MAX_LENGTH, 0, 4)
    span.forward(hidden[:, :30], 0, kv)
    span.forward(torch.randn(2, 3, span.hidden_size), 30, kv)  # a detour later taken back
    assert kv.can_start_at(30)
    _close(_logits(reference, span.forward(hidden[:, 30:], 30, kv)), expected[:, 30:])
    assert not kv.can_start_at(20)  # positions 13.. are gone from the rings
    with pytest.raises(ValueError, match="sliding-window cache"):
        span.forward(hidden[:, 20:22], 20, kv)


def test_prefill_in_one_step_in_chunks_and_without_a_cache(model):
    _, reference, span, ids, expected = model
    hidden = _embed(reference, ids)
    kv = span.new_session_kv(2, MAX_LENGTH, 0, 4)
    _close(_logits(reference, span.forward(hidden, 0, kv)), expected)
    _close(_logits(reference, span.forward(hidden, 0, None)), expected)  # the layer modules, no cache
    kv = span.new_session_kv(2, MAX_LENGTH, 0, 4)
    chunks = [(0, 5), (5, 14), (14, 15), (15, LENGTH)]  # the last: 25 tokens, more than a ring's 16
    outs = [span.forward(hidden[:, start:end], start, kv) for start, end in chunks]
    _close(_logits(reference, torch.cat(outs, dim=1)), expected)


def test_the_window_matters(model):
    """The same span without its window computes something else past the window (so the tests above can fail)."""
    _, reference, span, ids, expected = model
    saved = [layer.sliding_window for layer in span.fused]
    for layer in span.fused:
        layer.sliding_window = None
    try:
        got = _logits(reference, span.forward(_embed(reference, ids), 0, span.new_session_kv(2, MAX_LENGTH, 0, 4)))
    finally:
        for layer, window in zip(span.fused, saved):
            layer.sliding_window = window
    _close(got[:, :WINDOW], expected[:, :WINDOW])
    assert (got[:, WINDOW:] - expected[:, WINDOW:]).abs().max().item() > 1e-3


def test_decode_steps_batched_across_sessions(model):
    """Two sessions at different positions (one inside the window, one past it) decode in the same passes."""
    _, reference, span, ids, expected = model
    hidden = _embed(reference, ids)
    # session A: both rows, prompt of 10; session B: row 1 alone, prompt of 3
    kv_a, kv_b = span.new_session_kv(2, MAX_LENGTH, 0, 4), span.new_session_kv(1, MAX_LENGTH, 0, 4)
    span.forward(hidden[:, :10], 0, kv_a)
    span.forward(hidden[1:, :3], 0, kv_b)
    got_a, got_b = [], []
    for step in range(LENGTH - 10):
        pa, pb = 10 + step, 3 + step
        out_a, out_b = span.forward_batch([(hidden[:, pa:pa + 1], pa, kv_a), (hidden[1:, pb:pb + 1], pb, kv_b)], 0, 4)
        got_a.append(out_a)
        got_b.append(out_b)
    _close(_logits(reference, torch.cat(got_a, dim=1)), expected[:, 10:])
    _close(_logits(reference, torch.cat(got_b, dim=1)), expected[1:, 3:3 + len(got_b)])


def test_the_graph_step_computation(model):
    """`server.compute.graphs.static_decode_step` (what a CUDA graph captures: the whole cache, a mask) with the
    window."""
    from server.compute.graphs import clear_unfilled, static_decode_step

    _, reference, span, ids, expected = model
    hidden = _embed(reference, ids)
    kv = span.new_session_kv(2, MAX_LENGTH, 0, 4)
    span.forward(hidden[:, :4], 0, kv)
    clear_unfilled(kv)
    key_positions = torch.arange(kv.max_length)
    outs = []
    for position in range(4, LENGTH):
        position_ids = torch.full((2, 1), position)
        cos, sin = span.rotary(hidden, position_ids)
        kv.begin_step(position)
        outs.append(static_decode_step(span.fused, hidden[:, position], cos[:, 0], sin[:, 0], [(2, kv)],
                                       torch.tensor([position]), key_positions))
        kv.end_step(1)
    _close(_logits(reference, torch.stack(outs, dim=1)), expected[:, 4:])
