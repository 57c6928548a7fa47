"""CUDA-graph decode (`server.compute.graphs`) against the lean eager path (`server.compute.decode`), itself checked
against the layer modules and transformers in test_layers / test_decode, on tiny random checkpoints.

The graphs' computation (`static_decode_step`: positions as a tensor, attention over each session's whole cache
with a mask) is checked on the CPU through `StaticSteps` for several sessions in one step: left-padded rows,
sliding windows past their ring's capacity, ALiBi (BLOOM, Falcon), LoRA adapters' rows, rewinds. Capture and
replay run only where a CUDA device is present: float, bfloat16 and nf4 spans, sets of up to 16 sessions, which
sets get captured, and int8's refusal."""
from __future__ import annotations

import pytest
import torch

from server.compute.blocks import BlockSpan
from server.compute.graphs import StaticSteps
from swarm.modeling.checkpoint import Checkpoint
from tests.fixtures.family_configs import LLAMA_TINY, llama_like_configs
from tests.fixtures.span_checks import graph_sessions, run_graph_steps

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def _save(config, path) -> Checkpoint:
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(path)
    return Checkpoint(str(path))


def _family_config(name: str):
    from transformers import MistralConfig

    from tests.fixtures.family_configs import bloom_falcon_config

    if name == "mistral-window":  # a window of 4: the ring (8 slots) wraps within the test's steps
        return MistralConfig(**LLAMA_TINY, sliding_window=4)
    if name in ("bloom", "falcon-alibi", "falcon-alibi-new"):
        return bloom_falcon_config(name)
    return llama_like_configs()[name]


FAMILIES = ["llama", "qwen2", "mistral-window", "bloom", "falcon-alibi-new"]


@pytest.fixture(scope="module", params=FAMILIES)
def checkpoint(request, tmp_path_factory):
    return _save(_family_config(request.param), tmp_path_factory.mktemp(f"graphs-{request.param}"))


def test_the_graphs_computation_equals_the_lean_path_on_cpu(checkpoint):
    span = BlockSpan.load(checkpoint, 1, 4, "float32")
    specs = [(1, 7, None), (2, 5, [2, 0]), (1, 3, None)]  # one session's two rows left-padded differently
    if span.alibi:
        specs[1] = (2, 5, None)  # left-padded batches are refused on ALiBi blocks (`BlockSpan.forward`)
    pairs, positions = graph_sessions(span, specs, 32, 2, 4)
    static = StaticSteps()
    run_graph_steps(span, static, pairs, positions, 2, 4, steps=12, tol=1e-5)  # mistral-window: past its ring of 8
    assert static.replays == 12


def test_the_graphs_computation_with_adapters_rows_on_cpu(tmp_path):
    from swarm.modeling.lora_files import AdapterSource, open_adapter
    from tests.fixtures.lora_fixtures import make_adapter

    checkpoint = _save(llama_like_configs()["llama"], tmp_path / "llama")
    make_adapter(str(tmp_path / "llama"), tmp_path / "lora", seed=5)
    files = open_adapter(AdapterSource("lora", str(tmp_path / "lora")), checkpoint.load_config())
    span = BlockSpan.load(checkpoint, 0, 4, "float32", adapters=[files])
    pairs, positions = graph_sessions(span, [(1, 6, None), (1, 4, None), (2, 3, None)], 32, 0, 4)
    for kv, ref in pairs[1:]:
        kv.adapter = ref.adapter = "lora"  # (their prompts ran on the base: only the steps matter here)
    run_graph_steps(span, StaticSteps(), pairs, positions, 0, 4, steps=5, tol=1e-5)


def _cuda_span(checkpoint, dtype="float32", quant_type="none", start=0, end=4):
    span = BlockSpan.load(checkpoint, start, end, dtype, "cuda", quant_type=quant_type)
    assert span.enable_cuda_graphs(), span.cuda_graphs_refusal()
    return span


@cuda
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_graphed_steps_equal_the_lean_path_on_cuda(checkpoint, dtype):
    span = _cuda_span(checkpoint, dtype)
    graphs = span.graphs
    tol = 1e-4 if dtype == "float32" else 3e-2
    specs = [(1, 7, None), (2, 3, None if span.alibi else [1, 0]), (1, 5, None)]
    pairs, positions = graph_sessions(span, specs, 32, 0, 4, device="cuda")
    run_graph_steps(span, graphs, pairs, positions, 0, 4, steps=6, tol=tol, device="cuda")
    # the set of three came 6 times: captured the second time, replayed after (the first ran eagerly)
    assert graphs.captures == 1 and graphs.replays == 5 and len(graphs) == 1
    # each session alone is captured at once; a session that closes takes its graphs with it
    for kv, ref in pairs:
        run_graph_steps(span, graphs, [(kv, ref)], [kv.length], 0, 4, steps=2, tol=tol, device="cuda")
    assert graphs.captures == 4 and len(graphs) == 4
    del pairs, kv, ref
    torch.cuda.synchronize()
    pairs, positions = graph_sessions(span, [(1, 4, None)], 16, 0, 4, device="cuda", seed=2)
    run_graph_steps(span, graphs, pairs, positions, 0, 4, steps=2, tol=tol, device="cuda")
    assert graphs.captures == 5 and len(graphs) == 1  # the closed sessions' graphs are gone; the pool still takes one


@cuda
def test_sixteen_sessions_replay_one_graph_with_nf4_weights(tmp_path):
    """nf4 (the CUDA default) under graphs equals nf4 eager: 16 sessions in one batch, and one session alone."""
    from transformers import LlamaConfig

    config = LlamaConfig(**{**LLAMA_TINY, "hidden_size": 128, "intermediate_size": 256}, tie_word_embeddings=False)
    span = _cuda_span(_save(config, tmp_path / "llama"), "float32", "nf4")
    graphs = span.graphs
    assert span.quant_type == "nf4"
    pairs, positions = graph_sessions(span, [(1, 3 + i, None) for i in range(16)], 48, 0, 4, device="cuda")
    run_graph_steps(span, graphs, pairs, positions, 0, 4, steps=4, tol=1e-5, device="cuda")
    assert graphs.captures == 1 and graphs.replays == 3
    kv, ref = pairs[0]
    run_graph_steps(span, graphs, [(kv, ref)], [kv.length], 0, 4, steps=3, tol=1e-5, device="cuda")
    assert graphs.captures == 2
    # another set of several sessions within CAPTURE_SPACING steps of that capture runs eagerly
    run_graph_steps(span, graphs, pairs[1:3], [kv.length for kv, _ in pairs[1:3]], 0, 4, steps=3, tol=1e-5,
                    device="cuda")
    assert graphs.captures == 2


@cuda
def test_int8_spans_decline_graphs_and_say_why(tmp_path):
    span = BlockSpan.load(_save(llama_like_configs()["llama"], tmp_path / "llama"), 0, 2, "float16", "cuda",
                          quant_type="int8")
    assert not span.enable_cuda_graphs() and span.graphs is None
    assert "int8" in (span.cuda_graphs_refusal() or "")


def test_graphs_are_declined_on_the_cpu_with_a_reason(tmp_path):
    span = BlockSpan.load(_save(llama_like_configs()["llama"], tmp_path / "llama"), 0, 2, "float32")
    assert not span.enable_cuda_graphs() and span.graphs is None
    assert "not a CUDA device" in (span.cuda_graphs_refusal() or "")
