"""The locally quantized transformers reference of the families' int8 / nf4 block tests (test_deepseek_quant.py,
test_gpt_oss_quant.py), and the comparisons they share.

`quantized_reference`: transformers' model of a checkpoint quantized by its bitsandbytes integration
(`BitsAndBytesConfig`: LLM.int8() with threshold 6, or nf4 with blocksize 64 and float32 compute), the modules a
family keeps in float skipped, and its experts (3D tensors, which the integration leaves in float) replaced by the
family's module of per-expert bitsandbytes linears (`bnb_linear`, the same settings). `compare_calls` runs a chunked
prefill and decode steps through a quantized `BlockSpan` and the reference; `check_nf4_split_swarm` generates through
two nf4 servers.
"""
from __future__ import annotations

from typing import Callable, List, Optional, Sequence, Tuple

import torch
from torch import nn


def bnb_linear(weight: torch.Tensor, quant_type: str, bias: Optional[torch.Tensor] = None) -> nn.Module:
    """A bitsandbytes module of `weight` [out, in] (and `bias` [out]) as transformers' integration makes them on the
    CPU."""
    import bitsandbytes as bnb

    out_features, in_features = weight.shape
    if quant_type == "int8":
        module: nn.Module = bnb.nn.Linear8bitLt(in_features, out_features, bias=bias is not None,
                                                has_fp16_weights=False, threshold=6.0)
        module.weight = bnb.nn.Int8Params(weight.detach().clone(), requires_grad=False, has_fp16_weights=False)
    else:
        module = bnb.nn.Linear4bit(in_features, out_features, bias=bias is not None, compute_dtype=torch.float32,
                                   compress_statistics=False, quant_type="nf4")
        module.weight = bnb.nn.Params4bit(weight.detach().clone(), requires_grad=False, blocksize=64,
                                          compress_statistics=False, quant_type="nf4", module=module)
    if bias is not None:
        module.bias = nn.Parameter(bias.detach().clone(), requires_grad=False)
    return module.to("cpu").eval()


def quantized_reference(path, quant_type: str, skip: Sequence[str], experts: Callable[[nn.Module, str], nn.Module]):
    """transformers' model of `path` quantized by its bitsandbytes integration, the modules named in `skip` (and the
    LM head) in float, each layer's `mlp.experts` replaced by `experts(the float module, quant_type)`."""
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    skip = [*skip, "lm_head"]
    config = (BitsAndBytesConfig(load_in_8bit=True, llm_int8_threshold=6.0, llm_int8_skip_modules=skip)
              if quant_type == "int8" else
              BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=torch.float32,
                                 llm_int8_skip_modules=skip))
    model = AutoModelForCausalLM.from_pretrained(str(path), quantization_config=config, dtype=torch.float32,
                                                 device_map="cpu").eval()
    for layer in model.model.layers:
        if hasattr(layer.mlp, "experts"):
            layer.mlp.experts = experts(layer.mlp.experts, quant_type)
    return model


def max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max())


def compare_calls(span, reference, float_model, ids: torch.Tensor, splits: Sequence[int]) -> List[Tuple[float, float]]:
    """Feed `ids` [1, seq] in the chunks that end at `splits` (a chunk of several tokens: the span's prefill; of one:
    its batched decode step) through `span` (all the model's blocks, a session cache) and through `reference` (with
    its cache: LLM.int8() picks outlier columns from the rows of a call, so each side must see the same rows per
    call), each call's input the reference's embeddings. Returns per call the max abs differences of the normed
    output hidden states and of the logits; asserts each call's logits differ from `float_model`'s by more than 1e-3
    (a layer left in float fails)."""
    blocks = len(span.layers)
    kv = span.new_session_kv(1, 32, 0, blocks)
    past, position, diffs = None, 0, []
    with torch.inference_mode():
        for end in splits:
            chunk = ids[:, position:end]
            out = reference(chunk, past_key_values=past, use_cache=True, output_hidden_states=True)
            past, entering = out.past_key_values, out.hidden_states[0]
            if chunk.shape[1] > 1:
                ours = span.forward(entering, position, kv)  # [1, chunk, hidden]
            else:
                (ours,) = span.forward_batch([(entering, position, kv)], 0, blocks)
            normed = reference.model.norm(ours)
            logits = reference.lm_head(normed)  # [1, chunk, vocab]
            diffs.append((max_diff(normed, out.hidden_states[-1]), max_diff(logits, out.logits)))
            assert max_diff(logits, float_model(ids[:, :end]).logits[:, position:]) > 1e-3
            position = end
    return diffs


def check_nf4_split_swarm(path, reference, bootstrap, tokenizer, prefix: str, prompts: Sequence[str]) -> None:
    """Two servers (0:2, 2:4) of `path` with --quant_type nf4: greedy tokens (10 each) of `prompts` equal
    `reference`'s."""
    from swarm import AutoDistributedModelForCausalLM
    from swarm.launch.topology import start_servers, terminate_all
    from tests.e2e.test_family_swarms import _generate

    servers = start_servers(str(path), [bootstrap.maddr], ["0:2", "2:4"], prefix, ["--quant_type", "nf4"], threads=1)
    model = AutoDistributedModelForCausalLM.from_pretrained(str(path), initial_peers=[bootstrap.maddr],
                                                            dht_prefix=prefix)
    try:
        assert {s.info.quant_type for s in model.manager.update(force=True)} == {"nf4"}
        for prompt in prompts:
            ids = tokenizer(prompt, return_tensors="pt")["input_ids"]
            ours = model.generate(ids, max_new_tokens=10, min_new_tokens=10, do_sample=False)
            assert ours.tolist() == _generate(reference, ids).tolist()
    finally:
        model.shutdown()
        terminate_all(servers)
