"""LoRA adapters on a server's span (`swarm.modeling.lora`, `server.compute.blocks`), in process against `peft`.

A span of the bundled model loaded with peft-saved adapters gives the hidden states of the same model wrapped by
`peft` (prefill, and single-token decode steps batched with sessions of another adapter and of none), on float and
int8 weights; adapters that cannot be served are refused with errors that say why.
"""
from __future__ import annotations

import json
import shutil

import pytest
import torch

from server.compute.blocks import BlockSpan
from swarm.modeling.checkpoint import Checkpoint
from swarm.modeling.lora_files import AdapterError, AdapterSource, open_adapter
from tests.fixtures.lora_fixtures import make_adapter, peft_reference

END = 6  # the span: blocks 0:END


@pytest.fixture(scope="module")
def adapters(lora_adapters):
    return lora_adapters  # the session's (tests/fixtures/lora_fixtures.py), shared with test_lora_swarm


@pytest.fixture(scope="module")
def reference(lora_reference):
    return lora_reference


def _files(model_path, adapters):
    config = Checkpoint(model_path).load_config()
    return [open_adapter(AdapterSource.parse(f"{name}={path}"), config) for name, path in adapters.items()]


@pytest.fixture(scope="module")
def span(model_path, adapters):
    return BlockSpan.load(Checkpoint(model_path), 0, END, "float32", adapters=_files(model_path, adapters))


@torch.no_grad()
def _reference_hidden(reference, ids: torch.Tensor, adapter):
    """(embeddings [batch, seq, hidden], hidden states after block END) of the peft model with `adapter`."""
    if adapter is None:
        with reference.disable_adapter():
            states = reference(input_ids=ids, output_hidden_states=True).hidden_states
    else:
        reference.set_adapter(adapter)
        states = reference(input_ids=ids, output_hidden_states=True).hidden_states
    return states[0], states[END]


@pytest.mark.parametrize("adapter", ["alpha", "beta", None])
def test_prefill_matches_peft(span, reference, adapter):
    ids = torch.tensor([[1, 504, 3458, 314, 2565, 28, 9453, 30, 1535]])
    embeds, expected = _reference_hidden(reference, ids, adapter)
    kv = span.new_session_kv(1, 32, 0, END, adapter=adapter)
    got = span.forward(embeds, 0, kv)
    assert torch.allclose(got, expected, atol=1e-4), (got - expected).abs().max()
    if adapter is not None:  # the adapter does change the states
        _, base = _reference_hidden(reference, ids, None)
        assert (got - base).abs().max() > 1e-2
    # and without a cache (rpc_forward)
    assert torch.allclose(span.forward(embeds, 0, None, adapter=adapter), expected, atol=1e-4)


def test_mixed_decode_batch_matches_peft(span, reference):
    """Decode steps of five sessions (two adapters, the base, two rows for one) in one batched pass."""
    torch.manual_seed(0)
    sessions = [("alpha", 1), (None, 1), ("beta", 2), ("alpha", 1), (None, 1)]
    prompts = [torch.randint(2, 1000, (batch, 5 + i)) for i, (_, batch) in enumerate(sessions)]
    items, expected = [], []
    for (adapter, batch), prompt in zip(sessions, prompts):
        full = torch.cat([prompt, torch.randint(2, 1000, (batch, 1))], dim=1)
        embeds, states = _reference_hidden(reference, full, adapter)
        kv = span.new_session_kv(batch, 32, 0, END, adapter=adapter)
        span.forward(embeds[:, :-1], 0, kv)
        items.append((embeds[:, -1:], prompt.shape[1], kv))
        expected.append(states[:, -1:])
    outputs = span.forward_batch(items, 0, END)
    for (adapter, _), got, want in zip(sessions, outputs, expected):
        assert torch.allclose(got, want, atol=1e-4), (adapter, (got - want).abs().max())


def test_int8_base_with_adapter(model_path, adapters, reference):
    """On int8 weights the adapter adds its delta: int8 + adapter is as far from float + adapter as int8 is from
    float (the quantization error), and much closer to it than the float model without the adapter is."""
    pytest.importorskip("bitsandbytes")
    files = _files(model_path, adapters)
    spans = {quant: BlockSpan.load(Checkpoint(model_path), 0, 4, "float32", quant_type=quant, adapters=files)
             for quant in ("int8", "none")}
    embeds, _ = _reference_hidden(reference, torch.tensor([[1, 504, 3458, 314, 2565, 28, 9453, 30, 1535]]), None)
    out = {(quant, adapter): span.forward(embeds, 0, span.new_session_kv(1, 16, 0, 4, adapter=adapter))
           for quant, span in spans.items() for adapter in (None, "alpha")}
    quant_error = (out["int8", None] - out["none", None]).norm()
    adapted_error = (out["int8", "alpha"] - out["none", "alpha"]).norm()
    adapter_effect = (out["none", "alpha"] - out["none", None]).norm()
    assert adapted_error < 1.5 * quant_error and adapted_error < 0.5 * adapter_effect, \
        (adapted_error, quant_error, adapter_effect)


def test_unknown_adapter_is_refused(span):
    with pytest.raises(AdapterError, match="not served here"):
        span.new_session_kv(1, 8, 0, END, adapter="gamma")


# ---- bad adapters ---------------------------------------------------------------------------------------------------
def _copy(adapters, tmp_path, name="alpha"):
    target = tmp_path / name
    shutil.copytree(adapters[name], target)
    return target


def _edit_config(path, **changes):
    config = json.loads((path / "adapter_config.json").read_text())
    config.update(changes)
    (path / "adapter_config.json").write_text(json.dumps(config))


def _open(model_path, path):
    return open_adapter(AdapterSource.parse(str(path)), Checkpoint(model_path).load_config())


def test_missing_and_malformed_adapters(model_path, adapters, tmp_path):
    with pytest.raises(AdapterError, match="no such directory"):
        _open(model_path, tmp_path / "nowhere")
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(AdapterError, match="adapter_config.json not found"):
        _open(model_path, empty)
    broken = _copy(adapters, tmp_path)
    (broken / "adapter_config.json").write_text("{not json")
    with pytest.raises(AdapterError, match="cannot read adapter_config.json"):
        _open(model_path, broken)
    truncated = _copy(adapters, tmp_path, "beta")
    (truncated / "adapter_model.safetensors").write_bytes(b"\x05")
    with pytest.raises(AdapterError, match="not a safetensors file"):
        _open(model_path, truncated)


def test_unsupported_features_are_refused(model_path, adapters, tmp_path):
    path = _copy(adapters, tmp_path)
    _edit_config(path, use_dora=True)
    with pytest.raises(AdapterError, match="DoRA"):
        _open(model_path, path)
    _edit_config(path, use_dora=False, peft_type="IA3")
    with pytest.raises(AdapterError, match="not LORA"):
        _open(model_path, path)


def test_rank_and_target_mismatches_are_refused(model_path, adapters, tmp_path):
    path = _copy(adapters, tmp_path)
    _edit_config(path, r=4)
    with pytest.raises(AdapterError, match="rank 4"):
        _open(model_path, path)
    _edit_config(path, r=8, target_modules=["q_proj", "v_proj"])
    with pytest.raises(AdapterError, match="do not target"):
        _open(model_path, path)
    _edit_config(path, target_modules=["q_proj", "v_proj", "k_proj", "gate_proj", "up_proj", "down_proj"])
    with pytest.raises(AdapterError, match=r"targets \['k_proj'\] but the weights hold none"):
        _open(model_path, path)


def test_adapter_for_another_model_is_refused(model_path, tmp_path):
    from transformers import AutoModelForCausalLM, LlamaConfig

    other = tmp_path / "other-model"
    config = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=300)
    AutoModelForCausalLM.from_config(config).save_pretrained(other)
    adapter = make_adapter(str(other), tmp_path / "other-adapter", seed=3)
    with pytest.raises(AdapterError, match="another model"):
        _open(model_path, adapter)


def test_adapter_names():
    assert AdapterSource.parse("chat=/x/y") == AdapterSource("chat", "/x/y")
    assert AdapterSource.parse("org/repo-lora") == AdapterSource("org/repo-lora", "org/repo-lora")
    with pytest.raises(AdapterError, match="adapter name"):
        AdapterSource.parse("bad name=/x")


def test_gate_up_outputs_that_are_not_halves_of_one_tensor(span):
    """`AdaptedLayer.gate_up` adds the same deltas when the base's gate and up are tensors of their own."""
    from swarm.modeling.lora import AdaptedLayer

    class Separate:  # the fused layer, with gate and up returned as separate tensors
        def __init__(self, layer):
            self.layer = layer

        def __getattr__(self, name):
            return getattr(self.layer, name)

        def gate_up(self, h):
            return tuple(t.clone() for t in self.layer.gate_up(h))

    torch.manual_seed(0)
    h = torch.randn(5, span.hidden_size)
    groups = [(1, 3, span.adapters["alpha"].layers[0])]
    joined = AdaptedLayer(span.fused[0], groups).gate_up(h)
    separate = AdaptedLayer(Separate(span.fused[0]), groups).gate_up(h)
    base = span.fused[0].gate_up(h)
    for got, want, plain in zip(separate, joined, base):
        assert torch.allclose(got, want, atol=1e-6)
        assert torch.equal(got[[0, 3, 4]], plain[[0, 3, 4]]) and not torch.allclose(got[1:3], plain[1:3])
