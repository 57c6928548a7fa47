"""The lean inference path (`server.compute.decode`) against the layer modules (`swarm.modeling.families.llama`, which
tests/swarm/modeling/test_layers.py checks against transformers'), per family, on tiny random checkpoints: batched
decode steps of one session and of several sessions of different batch sizes and lengths in one pass, and multi-token
steps (prompts, later turns, single tokens) through `BlockSpan.forward`."""
from __future__ import annotations

import pytest
import torch

from server.compute.blocks import BlockSpan
from swarm.modeling.checkpoint import Checkpoint
from swarm.modeling.smallgemm import packing_available
from tests.fixtures.family_configs import llama_like_configs


@pytest.fixture(scope="module", params=["llama", "mistral", "qwen2", "qwen2 packed"])
def span(request, tmp_path_factory):
    """Blocks 1:4 of a tiny checkpoint; "packed": decode batches of 3 to 8 rows on weights packed for 4 and 8 rows
    (`swarm.modeling.smallgemm`, where this torch has MKL's packed GEMM; qwen2: with q/k/v biases)."""
    from transformers import AutoModelForCausalLM

    family, _, packed = request.param.partition(" ")
    torch.manual_seed(0)
    path = tmp_path_factory.mktemp(f"decode-{family}")
    AutoModelForCausalLM.from_config(llama_like_configs()[family]).save_pretrained(path)
    span = BlockSpan.load(Checkpoint(str(path)), 1, 4, "float32", packed_rows=(4, 8) if packed else ())
    if packed and packing_available():
        assert span.gemms is not None and span.gemms.pending  # packed as decode batches come
        span.gemms.pack_pending(budget=float("inf"))
        assert all(layer.gemms is not None and set(layer.gemms["qkv"].packs) == {4, 8} for layer in span.fused)
    return span


def module_forward(span: BlockSpan, *args) -> torch.Tensor:
    """`span.forward` through the layer modules (`swarm.modeling.families.llama`) instead of the fused kernels."""
    fused, span.fused = span.fused, []
    try:
        return span.forward(*args)
    finally:
        span.fused = fused


def test_fused_weights_are_views_of_the_layers(span):
    def storage(t):
        return t.untyped_storage().data_ptr()

    for layer, fused in zip(span.layers, span.fused):
        attn = layer.self_attn
        assert storage(attn.q_proj.weight) == storage(fused.qkv_weight)
        assert storage(attn.v_proj.weight) == storage(fused.qkv_weight)
        assert storage(layer.mlp.up_proj.weight) == storage(fused.gate_up_weight)
        if attn.q_proj.bias is not None:  # qwen2
            assert fused.qkv_bias is not None
            assert torch.equal(fused.qkv_bias[-attn.v_proj.bias.shape[0]:], attn.v_proj.bias)


def test_batched_decode_matches_the_hf_layers(span):
    torch.manual_seed(1)
    hidden = span.hidden_size
    sessions = [(2, 5), (1, 9), (3, 1)]  # (batch, prompt length)
    reference, lean = [], []
    for batch, length in sessions:
        prompt = torch.randn(batch, length, hidden)
        for kvs in (reference, lean):
            kv = span.new_session_kv(batch, 32, 1, 4)
            if kvs is reference:
                module_forward(span, prompt, 0, kv)
            else:
                span.forward(prompt, 0, kv)
            kvs.append(kv)
    positions = [length for _, length in sessions]
    for step in range(4):
        xs = [torch.randn(batch, 1, hidden) for batch, _ in sessions]
        expected = [module_forward(span, x, pos, kv) for x, pos, kv in zip(xs, positions, reference)]
        if step == 2:  # one session alone also takes the lean path
            got = [span.forward_batch([(xs[0], positions[0], lean[0])], 1, 4)[0]]
            got += span.forward_batch([(x, p, kv) for x, p, kv in zip(xs[1:], positions[1:], lean[1:])], 1, 4)
        else:
            got = span.forward_batch([(x, p, kv) for x, p, kv in zip(xs, positions, lean)], 1, 4)
        for e, g in zip(expected, got):
            assert g.shape == e.shape
            assert torch.allclose(g, e, atol=1e-5, rtol=1e-5), (g - e).abs().max()
        positions = [p + 1 for p in positions]
    assert [kv.length for kv in lean] == positions


def test_decode_over_part_of_the_span_and_after_a_rewind(span):
    torch.manual_seed(2)
    prompt = torch.randn(1, 6, span.hidden_size)
    ref, lean = span.new_session_kv(1, 16, 2, 4), span.new_session_kv(1, 16, 2, 4)
    module_forward(span, prompt, 0, ref, 2, 4)
    span.forward(prompt, 0, lean, 2, 4)
    x = torch.randn(1, 1, span.hidden_size)
    span.forward_batch([(torch.randn(1, 1, span.hidden_size), 6, lean)], 2, 4)  # a step later taken back
    expected = module_forward(span, x, 4, ref, 2, 4)  # rewind: position 4 overwrites what was there
    got = span.forward_batch([(x, 4, lean)], 2, 4)[0]
    assert torch.allclose(got, expected, atol=1e-5, rtol=1e-5)
    assert lean.length == ref.length == 5


@pytest.mark.parametrize("batch", [1, 2])
def test_multi_token_steps_match_the_hf_layers(span, batch):
    """A prompt, a later turn (keys before it in the cache: an explicit causal mask), one token, a rewind into the
    middle of the cache, and a step over part of the span: the fused path against the layer modules."""
    torch.manual_seed(3)
    ref, lean = span.new_session_kv(batch, 32, 1, 4), span.new_session_kv(batch, 32, 1, 4)
    for position, seq in [(0, 7), (7, 5), (12, 1), (9, 4)]:
        x = torch.randn(batch, seq, span.hidden_size)
        expected = module_forward(span, x, position, ref)
        got = span.forward(x, position, lean)
        assert got.shape == expected.shape == (batch, seq, span.hidden_size)
        assert torch.allclose(got, expected, atol=1e-5, rtol=1e-5), (position, seq, (got - expected).abs().max())
        assert lean.length == ref.length == position + seq
    for kv_layer in range(3):  # the caches hold the same keys and values
        assert torch.allclose(lean.keys[kv_layer][:, :, :13], ref.keys[kv_layer][:, :, :13], atol=1e-5, rtol=1e-5)
    part_ref, part_lean = span.new_session_kv(batch, 16, 2, 4), span.new_session_kv(batch, 16, 2, 4)
    for position, seq in [(0, 6), (6, 3)]:  # blocks 2:4 of the span: a prompt, then a later turn
        x = torch.randn(batch, seq, span.hidden_size)
        assert torch.allclose(span.forward(x, position, part_lean, 2, 4),
                              module_forward(span, x, position, part_ref, 2, 4), atol=1e-5, rtol=1e-5)


def test_prefills_of_several_sessions_in_one_pass_match_each_alone(span):
    """`BlockSpan.forward_prefill_batch`: sessions' multi-token steps (a first prompt, a later turn over a held
    prefix, a single token) as one pass of rows give each session's own output and cache, as separate passes do."""
    torch.manual_seed(4)
    hidden = span.hidden_size
    alone = [span.new_session_kv(1, 32, 1, 4) for _ in range(3)]
    together = [span.new_session_kv(1, 32, 1, 4) for _ in range(3)]
    held = torch.randn(1, 6, hidden)  # the second session holds 6 positions before its step
    span.forward(held, 0, alone[1])
    span.forward(held, 0, together[1])
    steps = [(torch.randn(1, 5, hidden), 0), (torch.randn(1, 4, hidden), 6), (torch.randn(1, 1, hidden), 0)]
    assert all(span.can_batch_prefill(kv) for kv in together)
    expected = [span.forward(x, start, kv) for (x, start), kv in zip(steps, alone)]
    got = span.forward_prefill_batch([(x, start, kv) for (x, start), kv in zip(steps, together)], 1, 4)
    for e, g in zip(expected, got):
        assert g.shape == e.shape
        assert torch.allclose(g, e, atol=1e-5, rtol=1e-5), (g - e).abs().max()
    assert [kv.length for kv in together] == [kv.length for kv in alone] == [5, 10, 1]
    for a, t in zip(alone, together):  # the caches hold the same keys
        assert torch.allclose(a.keys[0][:, :, :a.length], t.keys[0][:, :, :t.length], atol=1e-5, rtol=1e-5)
    x = torch.randn(1, 1, hidden)  # and decode goes on from there alike
    assert torch.allclose(span.forward_batch([(x, 10, together[1])], 1, 4)[0],
                          span.forward_batch([(x, 10, alone[1])], 1, 4)[0], atol=1e-5, rtol=1e-5)


def test_a_batched_prefill_that_fails_leaves_every_session_able_to_go_on_alone(span):
    """One session's step that cannot start (a rewind past what a cache holds, which the handler refuses first)
    fails the pass; the sessions before and after it keep their fill marks and run alone as they would have."""
    torch.manual_seed(5)
    hidden = span.hidden_size
    kvs = [span.new_session_kv(1, 32, 1, 4) for _ in range(3)]
    for kv in kvs:
        span.forward(torch.randn(1, 4, hidden), 0, kv)
    bad = [(torch.randn(1, 2, hidden), 4, kvs[0]), (torch.randn(1, 2, hidden), 9, kvs[1]),
           (torch.randn(1, 2, hidden), 4, kvs[2])]
    with pytest.raises(AssertionError):  # position 9 is past the 4 tokens the second session holds
        span.forward_prefill_batch(bad, 1, 4)
    assert [kv.length for kv in kvs] == [4, 4, 4]
    for x, _, kv in (bad[0], bad[2]):
        assert span.forward(x, 4, kv).shape == (1, 2, hidden)
    assert [kv.length for kv in kvs] == [6, 4, 6]


def test_queued_prefills_run_in_passes_within_the_token_budget_and_match_each_alone(span, monkeypatch):
    """The server's scheduling of concurrent prefills (`InferenceHandler._compute` on a real `TaskPool`): chunks
    queued together run in passes of at most `prefill_batch_tokens` tokens, in arrival order (a long prompt in
    `prefill_chunk` pieces, its next piece queued after the pass of its previous one), and every session's output
    and cache equal its prefill computed alone."""
    import asyncio
    import threading

    from server.rpc.inference import InferenceHandler
    from swarm.runtime.taskpool import PRIORITY_DECODE, TaskPool

    torch.manual_seed(6)
    handler = InferenceHandler.__new__(InferenceHandler)
    handler.span, handler.prefill_chunk, handler.prefill_batch_tokens = span, 8, 12
    handler.pool = TaskPool(adapt_threads=False)
    passes = []
    batched = span.forward_prefill_batch
    monkeypatch.setattr(span, "forward_prefill_batch", lambda items, first, last: passes.append(
        [x.shape[1] for x, _, _ in items]) or batched(items, first, last))
    prompts = [torch.randn(1, n, span.hidden_size) for n in (5, 4, 20, 3)]
    alone = [span.new_session_kv(1, 32, 1, 4) for _ in prompts]
    together = [span.new_session_kv(1, 32, 1, 4) for _ in prompts]
    expected = [span.forward(x, 0, kv, 1, 4) for x, kv in zip(prompts, alone)]

    async def concurrently():
        release = threading.Event()
        blocker = threading.Thread(target=handler.pool.call, args=(PRIORITY_DECODE, release.wait, 30))
        blocker.start()  # the worker is busy while the four prompts' first chunks queue up, in this order
        while handler.pool._queue.qsize():
            await asyncio.sleep(0.001)
        tasks = []
        for x, kv in zip(prompts, together):
            tasks.append(asyncio.ensure_future(handler._compute(x, 0, kv, 1, 4)))
            while handler.pool._queue.qsize() < len(tasks):
                await asyncio.sleep(0.001)
        release.set()
        outputs = await asyncio.gather(*tasks)
        blocker.join()
        return outputs

    try:
        got = asyncio.run(concurrently())
    finally:
        handler.pool.shutdown()
    assert passes == [[5, 4], [8, 3], [8], [4]]  # 9, then 11 of 12 tokens; the long prompt's chunks in turn
    for e, g in zip(expected, got):
        assert g.shape == e.shape
        assert torch.allclose(g, e, atol=1e-5, rtol=1e-5), (g - e).abs().max()
    assert [kv.length for kv in together] == [5, 4, 20, 3]


def test_host_outputs_leaves_host_tensors_and_errors_as_they_are():
    from server.compute.decode import host_outputs

    outputs = [torch.randn(2, 1, 8), ValueError("that row's pass failed"), torch.randn(1, 3, 8)]
    assert all(a is b for a, b in zip(host_outputs(outputs), outputs))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (the copy from it is what is checked)")
def test_host_outputs_brings_a_batch_from_the_gpu_in_one_copy_with_each_rows_part():
    from server.compute.decode import host_outputs

    rows = [torch.randn(b, 1, 8, device="cuda") for b in (2, 1, 3)]
    odd = torch.randn(1, 5, 8, device="cuda")  # another shape: copied alone
    error = RuntimeError("failed")
    got = host_outputs([rows[0], error, rows[1], odd, rows[2]])
    assert got[1] is error
    for g, e in zip([got[0], got[2], got[3], got[4]], [rows[0], rows[1], odd, rows[2]]):
        assert g.device.type == "cpu" and torch.equal(g, e.cpu())
