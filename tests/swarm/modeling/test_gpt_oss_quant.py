"""GPT-OSS blocks served int8 / nf4 (`GptOssDecoderLayer.quantize`) against transformers' model quantized locally.

The reference (`tests.fixtures.quant_reference.quantized_reference`): transformers' `GptOssForCausalLM` in
float32 from the same tiny checkpoint, its attention projections (q/k/v/o, with their biases) quantized by
transformers' bitsandbytes integration (`BitsAndBytesConfig`, which takes GPT-OSS on the CPU: LLM.int8() with
threshold 6, or nf4 with blocksize 64 and float32 compute), its router (`GptOssTopKRouter`, not an `nn.Linear`),
sinks and norms left in float by the integration; its experts, 3D tensors which the integration leaves in float,
through `QuantizedGptOssExperts` (tests/fixtures/quant_reference.py):
transformers' eager `GptOssExperts.forward` op for op with each expert's
gate_up ([2 * intermediate, hidden], gate and up still interleaved) and down ([hidden, intermediate]) matrices as
bitsandbytes modules of the same settings, their biases inside the modules (as the integration quantizes a linear
layer with a bias, e.g. q_proj here).

The tiny config (tests.fixtures.family_configs.GPT_OSS: hidden 64, 4 heads of 16 and 2 key/value heads, 4 experts of 64,
a sliding window of 4 that the 11 tokens outgrow) already suits nf4 on bitsandbytes' CPU backend: every input width
(64) divisible by 64, every output width (32, 64, 128) by 32. The sinks and experts are perturbed (std 1 and 0.3, as
the family test does) so that the sinks matter and the experts' clamp is reached.

Measured on this CPU (chunked prefill of 5 + 4 tokens, then two decode steps; max abs differences of the normed
hidden states / logits over the four calls): int8 4.8e-7 / 1.5e-7, nf4 4.8e-7 / 6e-8 (the two prefill calls of nf4
equal to the last bit); asserted within 1e-5. What quantization itself moves (the reference's logits from the float
model's, whole prompt): int8 0.22, nf4 0.66, of which the experts' part alone is 0.22 / 0.54 (a reference with
float experts against the quantized one); asserted above 1e-3 on every call, so a layer left in float fails.
The 2-server nf4 swarm (extended tier, tests/conftest.py): about 20 s.
"""
from __future__ import annotations

import pytest
import torch
from torch import nn

from server.compute.blocks import BlockSpan
from swarm.modeling.checkpoint import Checkpoint
from tests.fixtures.family_configs import GPT_OSS, VOCAB
from tests.fixtures.quant_reference import check_nf4_split_swarm, compare_calls, gpt_oss_reference
from tests.fixtures.swarm_checks import PROMPTS
from tests.fixtures.tiny_checkpoints import save_tiny

TOLERANCE = 1e-5


def save_gpt_oss(path, tokenizer_dir=None, **overrides):
    """The tiny GPT-OSS checkpoint at `path`, its sinks and experts perturbed; returns the float model."""
    model = save_tiny("gpt_oss", path, tokenizer_dir, **dict(GPT_OSS, **overrides))
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "sinks" in name or "experts" in name:
                param.normal_(0.0, 1.0 if "sinks" in name else 0.3)
    model.save_pretrained(path)
    return model


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = tmp_path_factory.mktemp("gpt-oss-quant")
    return path, save_gpt_oss(path, vocab_size=VOCAB)


@pytest.mark.parametrize("quant_type", ["int8", "nf4"])
def test_quantized_blocks_equal_the_locally_quantized_model(tiny, quant_type):
    """Blocks 0:4 loaded as a server loads them (every linear layer but the router a bitsandbytes module, the sinks
    in float): chunked prefill (5 then 4 tokens) and two decode steps through the server's batched path, each call's
    output hidden states and logits against the reference run on the same chunks with its cache."""
    import bitsandbytes as bnb

    path, float_model = tiny
    span = BlockSpan.load(Checkpoint(str(path)), 0, 4, "float32", "cpu", quant_type)
    for layer in span.layers:
        quantized = {name for name, m in layer.named_modules() if isinstance(m, (bnb.nn.Linear8bitLt,
                                                                                  bnb.nn.Linear4bit))}
        floats = {name for name, m in layer.named_modules() if isinstance(m, nn.Linear)} - quantized
        assert floats == {"mlp.router"} and layer.moe.router.weight.dtype == torch.float32
        assert len(quantized) == 4 + 2 * 4  # q, k, v, o; each expert's gate_up and down
        assert layer.attention_sinks.dtype == torch.float32
    torch.manual_seed(3)
    ids = torch.randint(3, VOCAB, (1, 11))
    diffs = compare_calls(span, gpt_oss_reference(path, quant_type), float_model, ids, (5, 9, 10, 11))
    print(f"{quant_type}: max abs diff per call (normed hidden, logits) {diffs}")
    assert max(max(d) for d in diffs) <= TOLERANCE


def test_an_nf4_split_swarm_generates_what_the_locally_quantized_model_does(tmp_path, bootstrap, model_path,
                                                                           tokenizer):
    """Two servers (0:2, 2:4) with --quant_type nf4: greedy tokens of three prompts equal the reference's."""
    path = tmp_path / "tiny-gpt-oss-nf4"
    save_gpt_oss(path, model_path)
    check_nf4_split_swarm(path, gpt_oss_reference(path, "nf4"), bootstrap, tokenizer, "tgoq", PROMPTS[:3])
