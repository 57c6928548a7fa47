"""Memory planning counts exactly what loading holds: for every family and int8 / nf4, the planned bytes of a block
(`server.placement.memory`, from the family's `Quantization.split` of a layer on the meta device) equal the bytes
of that block as loaded and quantized (bitsandbytes' modules with their statistics, the float tensors at the dtype),
and `bytes_per_block` is the larger of the first and the last block's."""
from __future__ import annotations

import pytest
import torch

from server.compute.blocks import BlockSpan
from server.placement.memory import block_split, bytes_per_block, quantized_bytes
from swarm.modeling.checkpoint import Checkpoint
from swarm.modeling.families import FAMILIES
from tests.fixtures.family_configs import (
    DEEPSEEK,
    GEMMA2,
    GEMMA3,
    GPT_OSS,
    MOE,
    VOCAB,
    bloom_falcon_config,
)
from tests.fixtures.tiny_checkpoints import save_tiny

# per family: config overrides with sizes nf4 takes (inputs of 64, outputs of 32 on the CPU); each mixes its kinds of
# block where it has several (Qwen3-MoE's dense block 1, DeepSeek-V3's dense block 0)
OVERRIDES = {
    "qwen3": dict(head_dim=32),
    "qwen3_moe": dict(MOE, mlp_only_layers=[1]),
    "gemma2": GEMMA2,
    "gemma3_text": GEMMA3,
    "gpt_oss": GPT_OSS,
    "deepseek_v3": dict(DEEPSEEK, q_lora_rank=64, kv_lora_rank=24, moe_intermediate_size=64),
}
LAYER_NORM_CASES = {"bloom": "bloom", "falcon": "falcon-new"}


def _save(family: str, path) -> None:
    if family in LAYER_NORM_CASES:
        from transformers import AutoModelForCausalLM

        config = bloom_falcon_config(LAYER_NORM_CASES[family])
        config.vocab_size = VOCAB
        torch.manual_seed(0)
        AutoModelForCausalLM.from_config(config).save_pretrained(path)
    else:
        save_tiny(family, path, None, vocab_size=VOCAB, **OVERRIDES.get(family, {}))


def _held(layer: torch.nn.Module) -> int:
    from swarm.modeling.quantize import quantized_weight_bytes

    return quantized_weight_bytes(layer) + sum(t.numel() * t.element_size()
                                               for t in list(layer.parameters()) + list(layer.buffers())
                                               if t.is_floating_point())


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_the_plan_equals_the_bytes_a_quantized_block_holds(family, tmp_path):
    _save(family, tmp_path)
    checkpoint = Checkpoint(str(tmp_path))
    config = checkpoint.load_config()
    for quant_type in ("int8", "nf4"):
        span = BlockSpan.load(checkpoint, 0, config.num_hidden_layers, "float32", "cpu", quant_type)
        held = [_held(layer) for layer in span.layers]
        for index, got in enumerate(held):
            split = block_split(config, index)
            assert split.modules, (family, index)  # (something is quantized)
            assert got == quantized_bytes(split.modules, quant_type) + split.other * 4, (family, quant_type, index)
        assert bytes_per_block(config, torch.float32, quant_type) == max(held[0], held[-1]), (family, quant_type)
    # and in float: every parameter and float buffer at the dtype
    span = BlockSpan.load(checkpoint, 0, config.num_hidden_layers, "float32")
    held = [_held(layer) for layer in span.layers]
    assert bytes_per_block(config, torch.float32) == max(held[0], held[-1]), family
