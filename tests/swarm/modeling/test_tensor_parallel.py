"""Tensor parallelism in process (`swarm.modeling.tensor_parallel`): a span split across 2 and 3 `cpu` devices
against the same span unsplit, on tiny random checkpoints (12 query / 6 key-value heads, so both counts divide):
llama (biases), qwen2 (q/k/v biases, a sliding window on its upper layers), mistral (a sliding window of 4 that the
steps outgrow, so the ring buffers wrap), mixtral (4 experts, top 2, window 4). Every path of the block core: a
prefill and a second multi-token step (chunked prefill), single-token steps, a batched decode of sessions at
different positions, several sessions' prefills in one pass, beam reordering, a rewind, a sub-range of the span, a
pass without a cache (with left padding), and training's forward + backward per block with a deep prompt; float32
within 1e-5. Also int8 / nf4 shards (llama, Mixtral), a LoRA adapter on every projection, the start-up checks'
one-line errors, the sizing over every device's free memory and the split block's throughput cache key, and (with
CUDA) two shards on one GPU.
"""
from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from server.compute.blocks import BlockSpan
from server.rpc.training import block_backward, block_forward
from swarm.modeling.checkpoint import Checkpoint
from swarm.modeling.families import FAMILIES
from swarm.modeling.shape import ModelShape
from swarm.modeling.tensor_parallel import TensorParallelError, check_splittable, parse_devices
from tests.fixtures.tiny_checkpoints import save_tiny

SHAPE = dict(hidden_size=96, num_attention_heads=12, num_key_value_heads=6, intermediate_size=192)
FAMILIES_UNDER_TEST = {"llama": dict(attention_bias=True), "qwen2": dict(use_sliding_window=True, sliding_window=4,
                                                                         max_window_layers=2),
                       "mistral": dict(sliding_window=4), "mixtral": dict(sliding_window=4)}
TOL = 1e-5


def _max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max())


@pytest.fixture(scope="module", params=list(FAMILIES_UNDER_TEST))
def family_path(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(f"tp-{request.param}")
    save_tiny(request.param, path, None, seed=3, **SHAPE, **FAMILIES_UNDER_TEST[request.param])
    return request.param, path


@pytest.fixture(scope="module", params=[2, 3])
def spans(request, family_path):
    _, path = family_path
    checkpoint = Checkpoint(str(path))
    return (BlockSpan.load(checkpoint, 0, 4, "float32", "cpu"),
            BlockSpan.load(checkpoint, 0, 4, "float32", "cpu", tensor_parallel=["cpu"] * request.param))


def _hidden(*shape: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def test_prefill_chunks_decode_and_beams_equal_the_unsplit_span(spans):
    plain, split = spans
    assert split.kv_heads == plain.kv_heads and len(split.tp_devices) in (2, 3)
    kvs = [span.new_session_kv(2, 32, 0, 4) for span in (plain, split)]
    steps = [(_hidden(2, 5, 96, seed=1), 0), (_hidden(2, 3, 96, seed=2), 5)]  # a prompt in two chunks
    steps += [(_hidden(2, 1, 96, seed=10 + i), 8 + i) for i in range(6)]  # decode past the window's ring (8)
    for i, (hidden, position) in enumerate(steps):
        outs = [span.forward(hidden, position, kv) for span, kv in zip((plain, split), kvs)]
        assert _max_diff(*outs) < TOL, f"step {i}"
        if i == 4:  # beams: row 0 becomes row 1's history
            for kv in kvs:
                kv.reorder(torch.tensor([1, 1]), kv.length)
    # a rewind: the last 2 positions again
    outs = [span.forward(steps[-1][0], 13, kv) for span, kv in zip((plain, split), kvs)]
    assert _max_diff(*outs) < TOL


def test_batched_decode_and_ragged_prefill_equal_the_unsplit_span(spans):
    plain, split = spans
    results = []
    for span in (plain, split):
        kvs = [span.new_session_kv(1, 32, 0, 4) for _ in range(3)]
        lengths = [3, 7, 10]
        prefilled = span.forward_prefill_batch([(_hidden(1, n, 96, seed=n), 0, kv) for n, kv in zip(lengths, kvs)],
                                               0, 4)
        batch = [(_hidden(1, 1, 96, seed=20 + i), n, kv) for i, (n, kv) in enumerate(zip(lengths, kvs))]
        decoded = span.forward_batch(batch, 0, 4)
        decoded2 = span.forward_batch([(h, n + 1, kv) for h, n, kv in batch[:2]], 0, 4)
        # a sub-range of the span: blocks 1:3
        sub = span.new_session_kv(1, 16, 1, 3)
        part = span.forward(_hidden(1, 4, 96, seed=5), 0, sub, 1, 3)
        results.append(prefilled + decoded + decoded2 + [part])
    for a, b in zip(*results):
        assert _max_diff(a, b) < TOL


def test_plain_forward_and_training_backward_equal_the_unsplit_span(spans):
    plain, split = spans
    hidden, grad = _hidden(2, 9, 96, seed=4), _hidden(2, 9, 96, seed=5)
    assert _max_diff(plain.forward(hidden), split.forward(hidden)) < TOL
    padding = torch.tensor([0, 3])
    assert _max_diff(plain.forward(hidden, padding=padding), split.forward(hidden, padding=padding)) < TOL
    prompt = _hidden(1, 2, 96, seed=6)
    for index in range(4):
        outs = [block_forward(span, index, hidden, prompt) for span in (plain, split)]
        assert _max_diff(*outs) < TOL
        grads = [block_backward(span, index, hidden, prompt, grad) for span in (plain, split)]
        assert _max_diff(grads[0][0], grads[1][0]) < TOL and _max_diff(grads[0][1], grads[1][1]) < TOL


@pytest.fixture(scope="module", params=["llama", "mixtral"])
def quant_path(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(f"tp-quant-{request.param}")  # widths nf4's 64-value blocks divide on 2 devices
    save_tiny(request.param, path, None, seed=4, hidden_size=128, num_attention_heads=4, num_key_value_heads=2,
              intermediate_size=256)
    return path


@pytest.mark.parametrize("quant_type, tol", [("nf4", 1e-2), ("int8", 0.1)])
def test_quantized_shards(quant_path, quant_type, tol):
    """nf4 shards quantize the same 64-value blocks as the unsplit block, but bitsandbytes' CPU backend repacks some
    weight shapes with bfloat16 block scales (the unsplit 128-wide rows here, not the 64-wide shards): equal within
    that rounding (measured 3e-4 relative). int8 shards scale each shard's rows and activations on their own: close
    to the unsplit int8 span, within int8's error."""
    checkpoint = Checkpoint(str(quant_path))
    spans = [BlockSpan.load(checkpoint, 0, 4, "float32", "cpu", quant_type, tensor_parallel=devices)
             for devices in ((), ("cpu", "cpu"))]
    kvs = [span.new_session_kv(1, 16, 0, 4) for span in spans]
    for hidden, position in [(_hidden(1, 6, 128, seed=1), 0), (_hidden(1, 1, 128, seed=2), 6)]:
        outs = [span.forward(hidden, position, kv) for span, kv in zip(spans, kvs)]
        scale = float(outs[0].abs().max())
        assert _max_diff(*outs) < tol * max(1.0, scale)
    hidden, grad = _hidden(1, 5, 128, seed=3), _hidden(1, 5, 128, seed=4)
    grads = [block_backward(span, 1, hidden, None, grad)[0] for span in spans]
    assert float((grads[0] - grads[1]).norm() / grads[0].norm()) < tol


@pytest.mark.parametrize("family_path, targets, extra", [
    ("llama", ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"), {}),
    # the attention and the experts' stacked parameters (each expert's delta split like its weights)
    ("mixtral", ("q_proj", "k_proj", "v_proj", "o_proj"),
     dict(target_parameters=["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]))], indirect=["family_path"])
def test_adapter_deltas_are_split_like_their_projections(family_path, targets, extra, tmp_path_factory):
    from swarm.modeling.lora_files import AdapterSource, open_adapter
    from tests.fixtures.lora_fixtures import make_adapter

    _, path = family_path
    root = tmp_path_factory.mktemp("tp-lora")
    make_adapter(str(path), root / "alpha", seed=1, targets=targets, r=4, std=0.1, **extra)
    checkpoint = Checkpoint(str(path))
    files = [open_adapter(AdapterSource.parse(f"alpha={root / 'alpha'}"), checkpoint.load_config())]
    spans = [BlockSpan.load(checkpoint, 0, 4, "float32", "cpu", adapters=files, tensor_parallel=devices)
             for devices in ((), ("cpu", "cpu", "cpu"))]
    results = []
    for span in spans:
        with_adapter, base = span.new_session_kv(1, 16, 0, 4, "alpha"), span.new_session_kv(1, 16, 0, 4)
        prompt = _hidden(1, 5, 96, seed=1)
        out = [span.forward(prompt, 0, with_adapter), span.forward(prompt, 0, base)]
        out += span.forward_batch([(_hidden(1, 1, 96, seed=2), 5, base), (_hidden(1, 1, 96, seed=3), 5, with_adapter)],
                                  0, 4)
        out.append(span.forward(_hidden(1, 5, 96, seed=1), adapter="alpha"))  # a pass without a cache
        results.append(out)
    assert _max_diff(results[0][0], results[0][1]) > 1e-2  # the adapter changes the output
    for a, b in zip(*results):
        assert _max_diff(a, b) < TOL * max(1.0, float(a.abs().max()))  # (the adapter's outputs grow large)


def test_what_cannot_be_split_is_one_clear_error():
    shape = ModelShape(hidden_size=576, num_heads=9, num_kv_heads=3, head_dim=64, num_layers=30,  # SmolLM2-135M
                       intermediate_size=1536, rms_norm_eps=1e-5, hidden_act="silu", rope_type="default", dtype=None)
    check_splittable(FAMILIES["llama"], shape, 3)
    with pytest.raises(TensorParallelError, match="2 devices do not divide the model's 3 key/value heads"):
        check_splittable(FAMILIES["llama"], shape, 2)
    with pytest.raises(TensorParallelError, match="family bloom cannot be split.*llama, mistral, mixtral, qwen2"):
        check_splittable(FAMILIES["bloom"], shape, 3)
    with pytest.raises(TensorParallelError, match="nf4 shards need per-device widths divisible by 64"):
        check_splittable(FAMILIES["llama"], replace(shape, num_heads=12, num_kv_heads=6, head_dim=8), 2, "nf4")
    assert parse_devices(["cpu", "cpu"]) == [torch.device("cpu")] * 2
    for devices, message in [(["cpu"], "at least 2"), (["cpu", "tpu9"], "unknown device 'tpu9'"),
                             (["cuda:0", "cuda"], "cuda:0 is named twice"), (["cpu", "meta"], "only cpu and cuda")]:
        with pytest.raises(TensorParallelError, match=message):
            parse_devices(devices)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_shards_on_one_gpu_equal_the_unsplit_span(family_path):
    """The CUDA path (two shards on cuda:0, which the server's config refuses but the span allows): float32
    prefill, decode, batched decode and backward equal the unsplit span on the same GPU."""
    _, path = family_path
    checkpoint = Checkpoint(str(path))
    plain, split = (BlockSpan.load(checkpoint, 0, 4, "float32", "cuda:0", tensor_parallel=devices)
                    for devices in ((), ("cuda:0", "cuda:0")))
    kvs = [span.new_session_kv(1, 32, 0, 4) for span in (plain, split)]
    for hidden, position in [(_hidden(1, 7, 96, seed=1), 0)] + [(_hidden(1, 1, 96, seed=i), 7 + i) for i in range(4)]:
        outs = [span.forward(hidden, position, kv) for span, kv in zip((plain, split), kvs)]
        assert _max_diff(*outs) < 1e-4
    batch = [[(_hidden(1, 1, 96, seed=9), 11, kv)] for kv in kvs]
    outs = [span.forward_batch(items, 0, 4)[0] for span, items in zip((plain, split), batch)]
    assert _max_diff(*outs) < 1e-4
    hidden, grad = _hidden(2, 9, 96, seed=4).cuda(), _hidden(2, 9, 96, seed=5).cuda()
    grads = [block_backward(span, 1, hidden, None, grad)[0] for span in (plain, split)]
    assert _max_diff(*grads) < 1e-4


def test_sizing_counts_every_device_and_the_throughput_key_names_the_split(model_path, monkeypatch, tmp_path):
    """`spans.plan` sizes a split server on its devices' free memory together (a device named twice counts once);
    the cached throughput of a split block is kept apart from the unsplit one's."""
    import server.placement.spans as spans_module
    from server.config import ServerConfig

    free = {"cuda:0": 3 << 30, "cuda:1": 5 << 30, "cpu": 4 << 30}
    asked: list = []
    monkeypatch.setattr(spans_module, "free_memory_bytes", lambda device: asked.append(device) or free[device])
    model_config = Checkpoint(model_path).load_config()
    # (constructed without validation: this machine has no CUDA device for the config's check)
    config = ServerConfig.model_construct(**{**ServerConfig(model=model_path).model_dump(),
                                             "tensor_parallel_devices": ["cuda", "cuda:1"]})
    capacity = spans_module.plan(config, model_config, torch.bfloat16, model_config.num_hidden_layers)
    assert asked == ["cuda:0", "cuda:1"] and capacity.free_bytes == 8 << 30
    cpu = ServerConfig(model=model_path, tensor_parallel_devices=["cpu", "cpu"])
    assert cpu.devices == ["cpu"] and cpu.span_device == "cpu"
    asked.clear()
    assert spans_module.plan(cpu, model_config, torch.float32, 30).free_bytes == 4 << 30 and asked == ["cpu"]
    import server.placement.throughput as throughput_module

    calls: list = []

    def fake_measure(checkpoint, device, dtype_name, quant_type="none", tensor_parallel=()):
        calls.append(tuple(tensor_parallel))
        return {"decode_rps": 10.0 + len(calls), "forward_tps": 1.0}

    monkeypatch.setattr(throughput_module, "measure", fake_measure)
    checkpoint = Checkpoint(model_path)
    root = tmp_path
    split = throughput_module.get_throughput("auto", checkpoint, "cpu", torch.float32, cache_root=root,
                                             tensor_parallel=["cpu", "cpu"])
    plain = throughput_module.get_throughput("auto", checkpoint, "cpu", torch.float32, cache_root=root)
    assert split == (11.0, "measured") and plain == (12.0, "measured") and calls == [("cpu", "cpu"), ()]
    assert throughput_module.get_throughput("auto", checkpoint, "cpu", torch.float32, cache_root=root,
                                            tensor_parallel=["cpu", "cpu"]) == (11.0, "cache")


def test_families_without_a_split_layer_are_refused_by_name():
    """The newer families (their own q/k norms, soft-caps, sinks, experts) are not split yet: one line each."""
    from swarm.modeling.tensor_parallel import supported_families

    assert set(supported_families()) == {"llama", "mistral", "qwen2", "mixtral"}
    shape = ModelShape(hidden_size=64, num_heads=4, num_kv_heads=2, head_dim=16, num_layers=4, intermediate_size=128,
                       rms_norm_eps=1e-5, hidden_act="silu", rope_type="default", dtype=None)
    for name in ("qwen3", "qwen3_moe", "phi3", "gemma2", "gemma3_text", "gpt_oss", "falcon"):
        with pytest.raises(TensorParallelError, match=f"family {name} cannot be split"):
            check_splittable(FAMILIES[name], shape, 2)
