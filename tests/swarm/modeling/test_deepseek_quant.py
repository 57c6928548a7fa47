"""DeepSeek-V3 blocks served int8 / nf4 (`DeepseekV3DecoderLayer.quantize`): every projection a bitsandbytes module
but `kv_b_proj` and the router, in float.

The reference is the same model quantized locally by transformers' bitsandbytes integration, as the other families'
quant tests (tests/server/test_quant.py, tests/e2e/test_quant_swarm.py): `BitsAndBytesConfig` (LLM.int8() with
threshold 6, or nf4 with blocksize 64 and float32 compute) with `kv_b_proj` (and the LM head) skipped; the routed
experts, 3D tensors that transformers' integration leaves in float, through per-expert `Linear8bitLt` / `Linear4bit`
modules of the same settings (`quantized_experts`). Both sides then run the same bitsandbytes modules on the same
weights; what differs is the attention's float arithmetic (the server's absorbed latent attention against
transformers' keys and values expanded per head: 2e-7 apart in float32 logits), which int8's per-row quantization of
each projection's input (and nf4's kernels) mostly rounds away. Measured on this CPU: equal to the last bit. Asserted:
within 1e-5 (absolute, on hidden states and logits of magnitude ~1), a thousandth of what quantization itself moves
them (int8 1e-2, nf4 1e-1 from the float model's logits, asserted above 1e-3 so that a layer left in float fails).

The tiny config's widths suit nf4 on bitsandbytes' CPU backend: inputs divisible by 64 (`quantize_linears`), outputs
by 32 (the AVX512-BF16 kernels repack weights in 32-row blocks): q_lora_rank 64, kv_lora_rank + rope 24 + 8, experts
of 64.
"""
from __future__ import annotations

import pytest
import torch
from torch import nn

from server.compute.blocks import BlockSpan
from server.placement.memory import block_parameter_counts, block_split, bytes_per_block, quantized_bytes
from swarm.modeling.checkpoint import Checkpoint
from swarm.modeling.model_config import model_config
from swarm.wire.quant import NF4
from tests.fixtures.family_configs import DEEPSEEK, VOCAB
from tests.fixtures.quant_reference import (
    bnb_linear,
    check_nf4_split_swarm,
    compare_calls,
    max_diff,
    quantized_reference,
)
from tests.fixtures.swarm_checks import PROMPTS
from tests.fixtures.tiny_checkpoints import save_tiny

QUANT_DEEPSEEK = dict(DEEPSEEK, q_lora_rank=64, kv_lora_rank=24, moe_intermediate_size=64)
TOLERANCE = 1e-5


class QuantizedExperts(nn.Module):
    """transformers' `DeepseekV3Experts` (eager: each expert's gate;up rows, then down, on its tokens) with each
    expert's [2 * moe_intermediate, hidden] and [hidden, moe_intermediate] matrices as bitsandbytes modules."""

    def __init__(self, experts, quant_type: str):
        super().__init__()
        self.num_experts, self.act_fn = experts.num_experts, experts.act_fn
        self.gate_up = nn.ModuleList(bnb_linear(experts.gate_up_proj[e], quant_type)
                                     for e in range(self.num_experts))
        self.down = nn.ModuleList(bnb_linear(experts.down_proj[e], quant_type) for e in range(self.num_experts))

    def forward(self, hidden_states, top_k_index, top_k_weights):
        """hidden_states [tokens, hidden], top_k_index / top_k_weights [tokens, top_k] -> [tokens, hidden]"""
        out = torch.zeros_like(hidden_states)
        for e in range(self.num_experts):
            token_idx, top_k_pos = torch.where(top_k_index == e)
            if token_idx.numel():
                gate, up = self.gate_up[e](hidden_states[token_idx]).chunk(2, dim=-1)
                step = self.down[e](self.act_fn(gate) * up) * top_k_weights[token_idx, top_k_pos, None]
                out.index_add_(0, token_idx, step.to(out.dtype))
        return out


def deepseek_reference(path, quant_type: str):
    """transformers' model of `path` quantized by its bitsandbytes integration, kv_b_proj and the LM head in float,
    the routed experts through `QuantizedExperts`."""
    return quantized_reference(path, quant_type, ["kv_b_proj"], QuantizedExperts)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = tmp_path_factory.mktemp("deepseek-quant")
    return path, save_tiny("deepseek_v3", path, None, vocab_size=VOCAB, **QUANT_DEEPSEEK)


@pytest.mark.parametrize("quant_type", ["int8", "nf4"])
def test_quantized_blocks_equal_the_locally_quantized_model(tiny, quant_type):
    """Blocks 0:4 (block 0 dense, 1-3 experts) loaded as a server loads them: chunked prefill (5 then 4 tokens) and
    two decode steps through the server's batched path, each call's output hidden states and logits against the
    reference model run on the same chunks with its cache (LLM.int8() picks outlier columns from the rows of a call,
    so each side must see the same rows per call)."""
    import bitsandbytes as bnb

    path, float_model = tiny
    span = BlockSpan.load(Checkpoint(str(path)), 0, 4, "float32", "cpu", quant_type)
    for layer in span.layers:
        floats = {name for name, m in layer.named_modules() if isinstance(m, nn.Linear)
                  and not isinstance(m, (bnb.nn.Linear8bitLt, bnb.nn.Linear4bit))}
        assert floats == {"self_attn.kv_b_proj"}
        assert layer.self_attn.kv_b_proj.weight.dtype == torch.float32
        if layer.sparse:
            assert len([m for m in layer.mlp.experts.modules() if isinstance(m, nn.Linear)]) == 3 * 8
            assert layer.mlp.gate.weight.dtype == torch.float32  # the router
    torch.manual_seed(3)
    ids = torch.randint(3, VOCAB, (1, 11))
    diffs = compare_calls(span, deepseek_reference(path, quant_type), float_model, ids, (5, 9, 10, 11))
    print(f"{quant_type}: max abs diff per call (normed hidden, logits) {diffs}")
    assert max(max(d) for d in diffs) <= TOLERANCE


def test_memory_planning_counts_kv_b_proj_in_float(tiny):
    """`server.placement.memory` counts kv_b_proj (and the router, the norms) at the serving dtype, the other linear
    weights at their quantized size: what a loaded span holds, for the dense first block and an expert block; and at
    DeepSeek-V3's own sizes the plan is the expert block's, kv_b_proj 32 MiB of it in bfloat16."""
    import bitsandbytes as bnb

    from swarm.modeling.quantize import quantized_weight_bytes

    path, _ = tiny
    config = Checkpoint(str(path)).load_config()
    split = block_split(config, 3)  # an expert block
    for quant_type in ("int8", "nf4"):
        span = BlockSpan.load(Checkpoint(str(path)), 0, 4, "float32", "cpu", quant_type)
        sizes = []
        for layer in span.layers:
            floats = sum(t.numel() * t.element_size() for t in list(layer.parameters()) + list(layer.buffers())
                         if t.is_floating_point())
            sizes.append(quantized_weight_bytes(layer) + floats)
        expert = span.layers[3]
        # kv_b_proj among them, and the router's correction bias (a buffer)
        assert sum(t.numel() for t in list(expert.parameters()) + list(expert.buffers())
                   if t.is_floating_point()) == split.other
        # (each nf4 module also holds its 16-value float32 code table, 64 bytes, which the plan counts)
        modules = sum(isinstance(m, (bnb.nn.Linear4bit, bnb.nn.Linear8bitLt)) for m in expert.modules())
        assert modules == len(split.modules)
        assert split.quantized * (1.0 if quant_type == "int8" else 0.5) < quantized_weight_bytes(expert) \
            == quantized_bytes(split.modules, quant_type)
        assert max(sizes) == bytes_per_block(config, torch.float32, quant_type)
    real = model_config({"model_type": "deepseek_v3"})
    linear, other = block_parameter_counts(real)
    kv_b = 128 * (128 + 128) * 512
    assert other >= kv_b and linear + other > 11e9  # the expert block's parameters
    expert_split = block_split(real, real.num_hidden_layers - 1)
    assert (linear, other) == (expert_split.quantized, expert_split.other)
    assert bytes_per_block(real, torch.bfloat16, "nf4") == \
        int(linear * NF4.bytes_per_param) + 64 * len(expert_split.modules) + other * 2
    assert kv_b * 2 / 2**20 == 32


def test_chunked_and_single_pass_prefill_agree(tiny):
    """nf4 quantizes weights only, so a prompt sent in chunks through the cache gives (to float rounding) the pass
    without a cache; the quantized span batches decode rows of several sessions like the float one."""
    from tests.fixtures.span_checks import check_batched_rows

    path, _ = tiny
    span = BlockSpan.load(Checkpoint(str(path)), 0, 4, "float32", "cpu", "nf4")
    torch.manual_seed(5)
    x = torch.randn(1, 9, span.hidden_size)
    kv = span.new_session_kv(1, 16, 0, 4)
    chunked = torch.cat([span.forward(x[:, :4], 0, kv), span.forward(x[:, 4:], 4, kv)], dim=1)
    assert max_diff(chunked, span.forward(x, 0, None)) < 1e-5
    check_batched_rows(span)


@pytest.mark.extended  # (40 s on the 2 shared cores: two server processes and a transformers model)
def test_an_nf4_split_swarm_generates_what_the_locally_quantized_model_does(tmp_path, bootstrap, model_path,
                                                                           tokenizer):
    """Two servers (0:2, 2:4) with --quant_type nf4: greedy tokens of three prompts equal the reference's."""
    path = tmp_path / "tiny-deepseek-nf4"
    save_tiny("deepseek_v3", path, model_path, **QUANT_DEEPSEEK)
    check_nf4_split_swarm(path, deepseek_reference(path, "nf4"), bootstrap, tokenizer, "tdsq", PROMPTS[:3])
