"""Qwen3 (`swarm.modeling.families.qwen3`), Qwen3-MoE (`swarm.modeling.families.qwen3_moe`), Phi-3
(`swarm.modeling.families.phi3`), Gemma 2 and Gemma 3 text (`swarm.modeling.families.gemma`) and GPT-OSS
(`swarm.modeling.families.gpt_oss`) against transformers on tiny random checkpoints the tests build (4 blocks, hidden
64, the bundled SmolLM2 tokenizer; sliding windows of 4 that the prompts outgrow).

In process: the server's `BlockSpan` inside transformers' embeddings and head (prefill logits within 1e-4 in
float32, prefill in two chunks, greedy decoding through batched decode steps, the layer modules' pass without a
cache, four sessions' rows in one step equal to each alone, a left-padded batch), both layouts of Qwen3-MoE's
experts with and without `norm_topk_prob` and a dense layer among the sparse ones, Phi-3 with LongRoPE, Gemma 2's
soft-caps, Gemma 3's two rotary bases (linear scaling on the full layers), GPT-OSS's sinks, experts and YaRN,
int8 / nf4 blocks, training gradients, LoRA adapters against peft (Qwen3, Phi-3), and the configs our
`model_config` builds against transformers' config classes. Through real processes: two servers split mid-model
(`tests.fixtures.swarm_checks.check_split_swarm`: greedy tokens, logits, a 2-turn session, 4 concurrent sessions; Qwen3
also through a gateway; Qwen3-MoE's ends with a session that fails over on its spare 2:4 server, the others' failover,
`check_failover`, is in the extended tier).
"""
from __future__ import annotations

import json

import pytest
import torch

from server.compute.blocks import BlockSpan
from swarm.modeling.checkpoint import Checkpoint
from swarm.modeling.model_config import model_config
from tests.fixtures.family_configs import (
    DEEPSEEK,
    DEEPSEEK_YARN,
    GEMMA2,
    GEMMA3,
    GPT_OSS,
    LONGROPE,
    MOE,
    VOCAB,
    WINDOW,
)
from tests.fixtures.span_checks import check_batched_rows, embed_ids, final_logits, greedy_steps
from tests.fixtures.swarm_checks import check_failover, check_split_swarm
from tests.fixtures.tiny_checkpoints import save_fused, save_tiny, tensor_names

CASES = {
    # windows on blocks 1.. (max_window_layers), a head_dim that is not hidden / heads
    "qwen3": ("qwen3", "hub", dict(WINDOW, max_window_layers=1, head_dim=32)),
    # block 1 dense (mlp_only_layers), the top-k probabilities as they are; the window on every block
    "qwen3_moe": ("qwen3_moe", "hub", dict(**MOE, **WINDOW, mlp_only_layers=[1], norm_topk_prob=False)),
    # transformers 5's fused expert tensors, renormalized top-k
    "qwen3_moe-fused": ("qwen3_moe", "fused", dict(MOE, norm_topk_prob=True)),
    "phi3": ("phi3", "hub", dict(sliding_window=4)),
    # LongRoPE, prompts past original_max_position_embeddings (the long factors throughout)
    "phi3-longrope": ("phi3", "hub", LONGROPE),
    "gemma2": ("gemma2", "hub", GEMMA2),
    "gemma3_text": ("gemma3_text", "hub", GEMMA3),
    "gpt_oss": ("gpt_oss", "hub", GPT_OSS),
    # latent attention with q_lora_rank, interleaved rotary; a dense first block, then grouped routing
    "deepseek_v3": ("deepseek_v3", "hub", DEEPSEEK),
    # queries without q_lora_rank, YaRN with mscale_all_dim, rotary halves, attention biases, the fused experts
    "deepseek_v3-yarn": ("deepseek_v3", "fused", DEEPSEEK_YARN),
}


@pytest.fixture(scope="module", params=list(CASES))
def case(request, tmp_path_factory):
    family, layout, overrides = CASES[request.param]
    path = tmp_path_factory.mktemp(request.param)
    reference = save_tiny(family, path, None, layout=layout, vocab_size=VOCAB, **overrides)
    # make what starts at a trivial value matter: Gemma's norms (a scale of 1 + weight, from 0), GPT-OSS's sinks
    # and its experts (std 0.02)
    # and DeepSeek's router (whose scores go through a sigmoid: spread them) and its choice's correction bias
    perturb = {"gemma2": {"norm": 0.3}, "gemma3_text": {"norm": 0.3}, "gpt_oss": {"sinks": 1.0, "experts": 0.3},
               "deepseek_v3": {"mlp.gate.weight": 0.5, "e_score_correction_bias": 0.1}}
    if family in perturb:
        with torch.no_grad():
            for name, param in list(reference.named_parameters()) + list(reference.named_buffers()):
                for part, std in perturb[family].items():
                    if part in name:
                        param.normal_(0.0, std)
        if layout == "fused":
            save_fused(reference, path)
        else:
            reference.save_pretrained(path)
    return request.param, path, reference, BlockSpan.load(Checkpoint(str(path)), 0, 4, "float32")


def test_the_checkpoint_has_the_family_layout(case):
    name, path, reference, span = case
    names = set(tensor_names(path))
    expected = {"qwen3": {"model.layers.0.self_attn.q_norm.weight", "model.layers.0.self_attn.k_norm.weight"},
                "qwen3_moe": {"model.layers.0.mlp.experts.3.down_proj.weight", "model.layers.1.mlp.gate_proj.weight",
                              "model.layers.0.self_attn.k_norm.weight"},
                "qwen3_moe-fused": {"model.layers.0.mlp.experts.gate_up_proj", "model.layers.0.mlp.gate.weight"},
                "phi3": {"model.layers.0.self_attn.qkv_proj.weight", "model.layers.0.mlp.gate_up_proj.weight"},
                "gemma2": {"model.layers.0.pre_feedforward_layernorm.weight",
                           "model.layers.0.post_feedforward_layernorm.weight"},
                "gemma3_text": {"model.layers.0.self_attn.q_norm.weight",
                                "model.layers.3.post_attention_layernorm.weight"},
                "gpt_oss": {"model.layers.0.self_attn.sinks", "model.layers.0.mlp.experts.gate_up_proj_bias",
                            "model.layers.0.mlp.router.bias"},
                "deepseek_v3": {"model.layers.0.self_attn.kv_a_proj_with_mqa.weight",
                                "model.layers.0.mlp.up_proj.weight", "model.layers.0.self_attn.q_b_proj.weight",
                                "model.layers.1.mlp.experts.7.up_proj.weight",
                                "model.layers.1.mlp.gate.e_score_correction_bias",
                                "model.layers.1.mlp.shared_experts.down_proj.weight"},
                "deepseek_v3-yarn": {"model.layers.0.self_attn.q_proj.weight",
                                     "model.layers.2.mlp.experts.gate_up_proj",
                                     "model.layers.0.self_attn.kv_a_proj_with_mqa.bias"}}
    assert expected.get(name, expected["phi3"]) <= names
    # each block's window as transformers' attention applies it (Phi-3 reads the config's at every layer)
    windows = [getattr(layer.self_attn, "sliding_window", getattr(reference.config, "sliding_window", None))
               for layer in reference.model.layers]
    assert span.windows(0, 4) == windows
    assert any(windows) == (name not in ("qwen3_moe-fused", "phi3-longrope") and not name.startswith("deepseek"))
    assert span.can_batch  # (Gemma 2's soft-capped and GPT-OSS's sink attention: eager in the batched paths too)


def test_prompt_chunks_and_greedy_decoding_match_transformers(case):
    name, _, reference, span = case
    torch.manual_seed(1)
    length = 14 if name == "phi3-longrope" else 9  # past LongRoPE's original 12 positions
    ids = torch.randint(3, VOCAB, (2, length))
    with torch.no_grad():
        expected = reference.generate(ids, max_new_tokens=8, min_new_tokens=8, do_sample=False)
        expected_logits = reference(expected).logits
        prompt_logits = reference(ids).logits
    kv = span.new_session_kv(2, 32, 0, 4)
    hidden = span.forward(embed_ids(reference, ids), 0, kv)
    assert (final_logits(reference, hidden) - prompt_logits).abs().max().item() < 1e-4
    # the prompt again in two chunks (chunked prefill): the same last hidden states
    # (LongRoPE: a step's factors are its largest position's, so both chunks past the original 12 positions)
    split = 13 if name == "phi3-longrope" else 5
    chunked = span.new_session_kv(2, 32, 0, 4)
    span.forward(embed_ids(reference, ids[:, :split]), 0, chunked)
    last = span.forward(embed_ids(reference, ids[:, split:]), split, chunked)[:, -1]
    assert (last - hidden[:, -1]).abs().max().item() < 1e-5 * max(1.0, hidden[:, -1].abs().max().item())
    tokens = greedy_steps(reference, span, kv, ids, hidden, 8)
    assert tokens.tolist() == expected.tolist()
    # the layer modules (a pass without a cache) compute the same
    assert (final_logits(reference, span.forward(embed_ids(reference, expected), 0, None))
            - expected_logits).abs().max().item() < 1e-4


def test_batched_rows_equal_single_steps(case):
    """Four sessions' single-token steps in one pass equal each session's step alone."""
    _, _, _, span = case
    check_batched_rows(span)


@pytest.mark.parametrize("quant_type, min_cosine", [("int8", 0.999), ("nf4", 0.9999)])
@pytest.mark.parametrize("family", ["qwen3", "qwen3_moe", "phi3", "gemma2", "gemma3_text"])
def test_quantized_blocks(family, quant_type, min_cosine, tmp_path):
    """int8 / nf4 blocks: every projection a bitsandbytes module, the norms (Qwen3's q/k norms too) in float; the
    logits stay close to the float model's (int8), or to those of the model with its blocks' weights rounded to
    nf4 and back (nf4: a tiny random model's logits move a few percent with nf4 itself), and the pass without a
    cache equals the cached one."""
    import bitsandbytes as bnb
    import bitsandbytes.functional as bnb_functional

    _, layout, overrides = CASES[family]
    reference = save_tiny(family, tmp_path, None, layout=layout, vocab_size=VOCAB, **overrides)
    span = BlockSpan.load(Checkpoint(str(tmp_path)), 0, 4, "float32", quant_type=quant_type)
    for layer in span.layers:
        linears = [m for m in layer.modules() if isinstance(m, torch.nn.Linear)]
        assert linears and all(isinstance(m, (bnb.nn.Linear8bitLt, bnb.nn.Linear4bit)) for m in linears)
    torch.manual_seed(3)
    ids = torch.randint(3, VOCAB, (2, 12))
    with torch.no_grad():
        if quant_type == "nf4":
            for module in reference.model.layers.modules():
                if isinstance(module, torch.nn.Linear):
                    weight, state = bnb_functional.quantize_4bit(module.weight.data, blocksize=64, quant_type="nf4",
                                                                 compress_statistics=False)
                    module.weight.data = bnb_functional.dequantize_4bit(weight, state).reshape(module.weight.shape)
        expected = reference(ids).logits
    embeds = embed_ids(reference, ids)
    hidden = span.forward(embeds, 0, span.new_session_kv(2, 32, 0, 4))
    got = final_logits(reference, hidden)
    assert torch.nn.functional.cosine_similarity(got.flatten(), expected.flatten(), dim=0).item() > min_cosine
    assert torch.allclose(span.forward(embeds, 0, None), hidden, atol=1e-5, rtol=1e-5)
    # memory planning counts what stays float (norms, Qwen3-MoE's router) at the dtype (block 0: a sparse block)
    from server.placement.memory import block_parameter_counts

    _, other = block_parameter_counts(span.config)
    assert sum(p.numel() for p in span.layers[0].parameters() if p.is_floating_point()) == other


@pytest.mark.parametrize("quant_type", ["int8", "nf4"])
def test_gpt_oss_blocks_are_quantized(tmp_path, quant_type):
    """int8 / nf4 GPT-OSS blocks: each expert's gate_up and down give exactly what a bitsandbytes module of that
    expert's transposed weight and bias gives, the router stays float, and the span's output moves off the float
    span's (a layer left float fails) while staying close to it."""
    from tests.fixtures.quant_reference import bnb_linear

    save_tiny("gpt_oss", tmp_path, None, vocab_size=VOCAB, **GPT_OSS)
    ckpt = Checkpoint(str(tmp_path))
    plain = BlockSpan.load(ckpt, 0, 4, "float32")
    quant = BlockSpan.load(ckpt, 0, 4, "float32", quant_type=quant_type)
    torch.manual_seed(0)
    h = torch.randn(5, 64)
    for fl, ql in zip(plain.layers, quant.layers):
        assert isinstance(ql.moe.router, torch.nn.Linear) and ql.moe.router.weight.dtype == torch.float32
        experts = fl.moe.experts
        for e in range(fl.num_experts):
            ref = bnb_linear(experts.gate_up_proj[e].t(), quant_type)(h) + experts.gate_up_proj_bias[e]
            assert torch.allclose(ql.expert_gate_up(e, h), ref, atol=1e-5)
            a = fl.expert_act(ref)
            ref_down = bnb_linear(experts.down_proj[e].t(), quant_type)(a) + experts.down_proj_bias[e]
            assert torch.allclose(ql.expert_down(e, a), ref_down, atol=1e-5)
    # memory planning counts the experts at their quantized size, the router / sinks / norms / biases in float
    from server.placement.memory import bytes_per_block
    from swarm.modeling.quantize import quantized_weight_bytes

    layer = quant.layers[0]
    held = quantized_weight_bytes(layer) + sum(p.numel() * p.element_size() for p in layer.parameters()
                                               if p.is_floating_point())
    planned = bytes_per_block(ckpt.load_config(), torch.float32, quant_type)
    assert held <= planned < 1.1 * held  # (nf4's 64-byte code tables counted)
    x = torch.randn(1, 6, 64)
    got, want = quant.forward(x, 0, None), plain.forward(x, 0, None)
    assert (got - want).abs().max().item() > 1e-4  # (measured: int8 1.2e-3, nf4 1.1e-2 here)
    assert torch.nn.functional.cosine_similarity(got.flatten(), want.flatten(), dim=0).item() > 0.95


def test_model_config_matches_transformers_configs(tmp_path):
    from transformers import AutoConfig

    cases = [("qwen3", {}), ("qwen3", dict(WINDOW, max_window_layers=2, hidden_size=64, head_dim=16)),
             ("qwen3_moe", {}), ("qwen3_moe", dict(MOE, mlp_only_layers=[0], norm_topk_prob=True)),
             ("phi3", {}), ("phi3", dict(LONGROPE, hidden_size=64, num_attention_heads=4, num_key_value_heads=2)),
             ("gemma2", {}), ("gemma2", dict(GEMMA2, num_hidden_layers=5)), ("gemma3_text", {}),
             ("gemma3_text", dict(GEMMA3, num_hidden_layers=4)), ("gpt_oss", {}), ("gpt_oss", GPT_OSS)]
    keys = ("head_dim", "num_key_value_heads", "intermediate_size", "rms_norm_eps", "rope_parameters", "sliding_window",
            "max_position_embeddings", "bos_token_id", "eos_token_id", "tie_word_embeddings", "vocab_size",
            "hidden_size", "num_hidden_layers")
    extra = {"qwen3": ("attention_bias", "max_window_layers", "layer_types"),
             "qwen3_moe": ("num_local_experts", "num_experts_per_tok", "moe_intermediate_size", "norm_topk_prob",
                           "mlp_only_layers", "decoder_sparse_step"),
             "phi3": ("original_max_position_embeddings", "pad_token_id"),
             "gemma2": ("layer_types", "query_pre_attn_scalar", "attn_logit_softcapping", "final_logit_softcapping",
                        "hidden_activation"),
             "gemma3_text": ("layer_types", "query_pre_attn_scalar", "attn_logit_softcapping",
                             "final_logit_softcapping", "hidden_activation"),
             "gpt_oss": ("layer_types", "num_local_experts", "num_experts_per_tok", "swiglu_alpha", "swiglu_limit",
                         "attention_bias")}
    for family, values in cases:
        reference = AutoConfig.for_model(family, **values)
        reference.save_pretrained(tmp_path)
        saved = json.loads((tmp_path / "config.json").read_text())
        for source in ({"model_type": family, **values}, saved):
            ours = model_config(source)
            for key in keys + extra[family]:
                if key == "layer_types" and "layer_types" not in source and family in ("qwen3", "qwen3_moe"):
                    continue  # (derived by transformers' class; `sliding_window_of` derives the same windows)
                if key == "head_dim" and family in ("qwen3_moe", "phi3"):  # (their config classes derive it where used)
                    assert ours.head_dim == reference.hidden_size // reference.num_attention_heads
                    continue
                assert getattr(ours, key) == getattr(reference, key), (family, values, key)
    # Qwen3-MoE's hub files name the experts' count num_experts
    assert model_config({"model_type": "qwen3_moe", "num_experts": 16}).num_local_experts == 16
    # Gemma 3's hub files name the RoPE bases and the layer pattern with the legacy keys
    legacy = AutoConfig.for_model("gemma3_text", num_hidden_layers=7, sliding_window_pattern=3, rope_theta=5e5,
                                  rope_local_base_freq=2e4, rope_scaling={"rope_type": "linear", "factor": 8.0})
    ours = model_config({"model_type": "gemma3_text", "num_hidden_layers": 7, "sliding_window_pattern": 3,
                         "rope_theta": 5e5, "rope_local_base_freq": 2e4,
                         "rope_scaling": {"rope_type": "linear", "factor": 8.0}})
    assert (ours.rope_parameters, ours.layer_types) == (legacy.rope_parameters, legacy.layer_types)


def test_partial_rotary_phi3_is_a_clear_error(tmp_path):
    reference = save_tiny("phi3", tmp_path, None, vocab_size=VOCAB, partial_rotary_factor=0.5)
    assert reference.config.rope_parameters["partial_rotary_factor"] == 0.5
    with pytest.raises(ValueError, match="partial_rotary_factor"):
        BlockSpan.load(Checkpoint(str(tmp_path)), 0, 2, "float32")


SWARMS = {"qwen3": dict(WINDOW, max_window_layers=1), "qwen3_moe": dict(**MOE, **WINDOW, mlp_only_layers=[1]),
          "phi3": dict(sliding_window=4), "gemma2": GEMMA2, "gemma3_text": GEMMA3, "gpt_oss": GPT_OSS}


@pytest.mark.parametrize("family", list(SWARMS))
def test_family_through_a_split_swarm(family, tmp_path, bootstrap, model_path, tokenizer, monkeypatch):
    path = tmp_path / f"tiny-{family}"
    reference = save_tiny(family, path, model_path, max_shard_size="150KB", **SWARMS[family])
    # Qwen3-MoE's swarm has a second 2:4 server and ends with a session failing over (check_failover_replay), the
    # check `test_failover_replays_a_session` runs for the other families on swarms of their own
    check_split_swarm(path, reference, f"tom-{family}", bootstrap, tokenizer, monkeypatch,
                      gateway="chat" if family == "qwen3" else None, failover=family == "qwen3_moe")


# the replay is the family-agnostic token history: Qwen3-MoE in `make test` (at the end of its split swarm's test,
# above), the others here, in the extended tier
@pytest.mark.parametrize("family", [pytest.param(f, marks=pytest.mark.extended)
                                    for f in ("qwen3", "phi3", "gemma2", "gemma3_text", "gpt_oss")])
def test_failover_replays_a_session(family, tmp_path, bootstrap, model_path, tokenizer):
    path = tmp_path / f"tiny-{family}"
    reference = save_tiny(family, path, model_path, **SWARMS[family])
    check_failover(path, reference, f"tomfo-{family}", bootstrap, tokenizer)


def test_training_gradients_match_transformers(case):
    """A training step's input gradients (the server's `block_forward` / `block_backward`, block by block, as a
    training pass runs them) equal transformers' gradient of the same loss for the input embeddings."""
    _, _, reference, span = case
    torch.manual_seed(4)
    check_training_gradients(reference, span, torch.randint(3, VOCAB, (2, 10)), lambda embeds: embeds,
                             lambda hidden: _logits_with_grad(reference, hidden))


def _logits_with_grad(reference, hidden: torch.Tensor) -> torch.Tensor:
    logits = reference.lm_head(reference.model.norm(hidden))
    cap = getattr(reference.config, "final_logit_softcapping", None)
    return logits if not cap else torch.tanh(logits / cap) * cap


def check_training_gradients(reference, span, ids: torch.Tensor, embed_norm, head, adapter=None) -> None:
    """The gradient of the next-token loss on `ids` [batch, seq] for the input embeddings, through the span's blocks
    as a training pass runs them (`server.rpc.training.block_forward` / `block_backward`, block by block) with
    transformers' `embed_norm` (embeddings -> the first block's input) and `head` (the last block's output ->
    logits) around them, equals transformers' own (`reference(inputs_embeds=..., labels=ids)`), within 1e-4 of
    its largest value. With LoRA `adapter`: the span's adapter, `reference` a peft model with it active."""
    from server.rpc.training import block_backward, block_forward

    embeds = reference.get_input_embeddings()(ids).detach().requires_grad_(True)
    reference(inputs_embeds=embeds, labels=ids).loss.backward()
    with torch.enable_grad():
        first = embed_norm(embeds)  # [batch, seq, hidden], the graph back to the embeddings
    hiddens = [first.detach()]
    for index in range(span.start, span.end):
        hiddens.append(block_forward(span, index, hiddens[-1], None, adapter))
    final = hiddens[-1].requires_grad_(True)
    with torch.enable_grad():
        logits = head(final)
        loss = torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten())
        grad, = torch.autograd.grad(loss, final)
    for index in reversed(range(span.start, span.end)):
        grad, _ = block_backward(span, index, hiddens[index - span.start], None, grad, adapter)
    grad, = torch.autograd.grad(first, embeds, grad)
    assert embeds.grad is not None and embeds.grad.abs().max().item() > 0
    assert (grad - embeds.grad).abs().max().item() < 1e-4 * embeds.grad.abs().max().item() + 1e-7


def test_mxfp4_gpt_oss_experts_without_their_config_are_a_clear_error():
    """(with `quantization_config` mxfp4 the reader dequantizes them: test_checkpoint_quant.py)"""
    from swarm.modeling.families.gpt_oss import GptOssDecoderLayer
    from tests.fixtures.tiny_checkpoints import tiny_config

    with torch.device("meta"):
        layer = GptOssDecoderLayer(tiny_config("gpt_oss", **GPT_OSS), 0)
    with pytest.raises(ValueError, match="MXFP4 .* no quantization_config with quant_method mxfp4"):
        layer.load_state_dict({"mlp.experts.gate_up_proj_blocks": torch.zeros(1)}, strict=False)


LLAMA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


EXPERTS = dict(target_parameters=["mlp.experts.gate_up_proj", "mlp.experts.down_proj"])
# (peft 0.21 turns any gate_proj / up_proj / down_proj target on DeepSeek-V3, "mlp.gate_proj" and
# "shared_experts.gate_proj" included, into its routed experts' target_parameters: it cannot adapt the dense and shared
# MLPs, which `test_deepseek_mlp_adapter_matches_merged_weights` checks against merged weights instead)
DEEPSEEK_TARGETS = ("q_proj", "q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj")


@pytest.mark.parametrize("case, targets, extra", [
    ("qwen3", ("q_proj", "k_proj", "v_proj", "o_proj", "up_proj"), {}),
    ("phi3", ("qkv_proj", "o_proj", "gate_up_proj", "down_proj"), {}),
    # the mixtures of experts: their attention and their experts' stacked parameters (`target_parameters`)
    ("mixtral", ("q_proj", "k_proj", "v_proj", "o_proj"), EXPERTS),
    ("qwen3_moe", (), EXPERTS),  # experts only (block 1 dense: none there), the top-k probabilities as they are
    ("gemma2", LLAMA_TARGETS, {}), ("gemma3_text", LLAMA_TARGETS, {}),
    ("gpt_oss", ("q_proj", "k_proj", "v_proj", "o_proj"), EXPERTS),
    # DeepSeek-V3: every projection (kv_b_proj absorbed), the dense block's MLP, the shared and the routed experts
    ("deepseek_v3", DEEPSEEK_TARGETS, EXPERTS),
    # without q_lora_rank; bare gate/up/down targets, which peft turns into the experts' (gate_up with twice the rank)
    ("deepseek_v3-yarn", (*DEEPSEEK_TARGETS, "gate_proj", "up_proj", "down_proj"), dict(use_rslora=True)),
])
def test_lora_adapter_matches_peft(case, targets, extra, tmp_path):
    """A peft LoRA adapter on the span (Qwen3, Gemma 3: its q/k deltas before the q/k norms; Phi-3: its fused
    qkv_proj and gate_up_proj targets; Gemma: every projection, around its pre- and post-norms; the mixtures of
    experts: their attention and their experts (peft's `target_parameters`: each routed token gets its expert's
    delta; GPT-OSS's interleaved gate/up with biases, clamps and sinks); DeepSeek-V3's latent attention with
    kv_b_proj's delta absorbed, its MLPs and experts) gives peft's logits, in a prefill and in a decode step batched
    with a base session; a training pass's input gradients equal peft's."""
    from swarm.modeling.lora_files import AdapterSource, open_adapter
    from tests.fixtures.lora_fixtures import make_adapter, peft_reference

    family, layout, overrides = CASES.get(case, (case, "hub", {}))
    save_tiny(family, tmp_path / "base", None, layout=layout, vocab_size=VOCAB, **overrides)
    adapter = make_adapter(str(tmp_path / "base"), tmp_path / "lora", seed=1, targets=targets, r=4, alpha=8, **extra)
    config = Checkpoint(str(tmp_path / "base")).load_config()
    files = open_adapter(AdapterSource.parse(f"a={adapter}"), config)
    assert bool(files.experts) == (family in ("mixtral", "qwen3_moe", "gpt_oss", "deepseek_v3"))
    if family == "deepseek_v3":  # (kv_b_proj: its delta absorbed into the query and output)
        assert {"kv_b_proj", "o_proj"} <= {t for _, t in files.targets}
    span = BlockSpan.load(Checkpoint(str(tmp_path / "base")), 0, 4, "float32", adapters=[files])
    reference = peft_reference(str(tmp_path / "base"), {"a": adapter})
    torch.manual_seed(5)
    ids = torch.randint(3, VOCAB, (1, 10))
    with torch.no_grad():
        expected = reference(input_ids=ids).logits
        with reference.disable_adapter():
            base = reference(input_ids=ids).logits
    model = reference.base_model.model
    embeds = embed_ids(model, ids)
    kvs = {name: span.new_session_kv(1, 32, 0, 4, adapter=name) for name in ("a", None)}
    got = final_logits(model, span.forward(embeds[:, :-1], 0, kvs["a"]))
    assert (got - expected[:, :-1]).abs().max().item() < 1e-4
    assert (expected - base).abs().max().item() > 1e-2  # the adapter matters
    span.forward(embeds[:, :-1], 0, kvs[None])
    steps = span.forward_batch([(embeds[:, -1:], 9, kvs["a"]), (embeds[:, -1:], 9, kvs[None])], 0, 4)
    assert (final_logits(model, steps[0]) - expected[:, -1:]).abs().max().item() < 1e-4
    assert (final_logits(model, steps[1]) - base[:, -1:]).abs().max().item() < 1e-4
    # a pass without a cache (rpc_forward) with the adapter
    assert (final_logits(model, span.forward(embeds, 0, None, adapter="a")) - expected).abs().max().item() < 1e-4
    # a training pass's input gradients through the adapter's (frozen) deltas
    check_training_gradients(reference, span, torch.randint(3, VOCAB, (2, 10)), lambda e: e,
                             lambda hidden: _logits_with_grad(model, hidden), adapter="a")


def test_deepseek_mlp_adapter_matches_merged_weights(tmp_path):
    """LoRA on DeepSeek-V3's dense MLP (block 0) and shared experts (blocks 1-3), which peft 0.21 cannot make (it
    turns those targets into the routed experts'): an adapter in peft's format written here gives the logits of
    transformers' model with the deltas merged into its weights (W + alpha / r * B @ A), in a prefill and in a decode
    step batched with a base session."""
    from safetensors.torch import save_file

    from swarm.modeling.lora_files import AdapterSource, open_adapter

    reference = save_tiny("deepseek_v3", tmp_path / "base", None, vocab_size=VOCAB, **DEEPSEEK)
    names = ("gate_proj", "up_proj", "down_proj")
    generator = torch.Generator().manual_seed(3)
    tensors = {}
    for name, module in reference.named_modules():
        if name.rpartition(".")[2] in names and ".experts." not in f"{name}.":
            prefix = f"base_model.model.{name}"
            a = torch.randn(4, module.in_features, generator=generator) * 0.1
            b = torch.randn(module.out_features, 4, generator=generator) * 0.1
            tensors[f"{prefix}.lora_A.weight"], tensors[f"{prefix}.lora_B.weight"] = a, b
            with torch.no_grad():
                module.weight += 2.0 * b @ a  # alpha 8 / r 4
    (tmp_path / "lora").mkdir()
    save_file(tensors, str(tmp_path / "lora" / "adapter_model.safetensors"))
    (tmp_path / "lora" / "adapter_config.json").write_text(json.dumps(dict(
        peft_type="LORA", r=4, lora_alpha=8, task_type="CAUSAL_LM",
        target_modules=[f"{part}.{name}" for part in ("mlp", "shared_experts") for name in names])))
    config = Checkpoint(str(tmp_path / "base")).load_config()
    files = open_adapter(AdapterSource.parse(f"a={tmp_path / 'lora'}"), config)
    assert {(0, "gate_proj"), (1, "shared_experts.down_proj"), (3, "shared_experts.up_proj")} <= set(files.targets)
    span = BlockSpan.load(Checkpoint(str(tmp_path / "base")), 0, 4, "float32", adapters=[files])
    base = BlockSpan.load(Checkpoint(str(tmp_path / "base")), 0, 4, "float32")
    torch.manual_seed(5)
    ids = torch.randint(3, VOCAB, (1, 10))
    with torch.no_grad():
        expected = reference(input_ids=ids).logits
    embeds = embed_ids(reference, ids)
    kvs = {name: span.new_session_kv(1, 32, 0, 4, adapter=name) for name in ("a", None)}
    got = final_logits(reference, span.forward(embeds[:, :-1], 0, kvs["a"]))
    assert (got - expected[:, :-1]).abs().max().item() < 1e-4
    without = final_logits(reference, base.forward(embeds, 0, base.new_session_kv(1, 32, 0, 4)))
    assert (without - expected).abs().max().item() > 1e-2  # the adapter matters
    span.forward(embeds[:, :-1], 0, kvs[None])
    steps = span.forward_batch([(embeds[:, -1:], 9, kvs["a"]), (embeds[:, -1:], 9, kvs[None])], 0, 4)
    assert (final_logits(reference, steps[0]) - expected[:, -1:]).abs().max().item() < 1e-4
    assert (final_logits(reference, steps[1]) - without[:, -1:]).abs().max().item() < 1e-4


def test_lora_adapters_that_cannot_be_served_are_clear_errors(tmp_path):
    """target_parameters other than the experts' stacked weights (an expert bias), expert tensors for a model without
    experts or on a dense block, and an expert's own module: refused with one line each. On int8 experts the
    adapter adds its deltas (`check_int8_adapter`)."""
    from safetensors.torch import load_file, save_file

    from swarm.modeling.lora_files import AdapterError, AdapterSource, open_adapter
    from tests.fixtures.lora_fixtures import make_adapter
    from tests.fixtures.tiny_checkpoints import tiny_config

    save_tiny("qwen3_moe", tmp_path / "base", None, vocab_size=VOCAB, **MOE, mlp_only_layers=[1])
    config = Checkpoint(str(tmp_path / "base")).load_config()
    adapter = make_adapter(str(tmp_path / "base"), tmp_path / "lora", seed=1, targets=(), r=4, alpha=8, **EXPERTS)

    def refused(match: str, model_config=config):
        with pytest.raises(AdapterError, match=match):
            open_adapter(AdapterSource.parse(f"a={adapter}"), model_config)

    raw = json.loads((adapter / "adapter_config.json").read_text())
    (adapter / "adapter_config.json").write_text(json.dumps(dict(raw, target_parameters=[
        "mlp.experts.down_proj", "experts.down_proj_bias"])))
    refused(r"does not implement target_parameters \['experts.down_proj_bias'\]")
    (adapter / "adapter_config.json").write_text(json.dumps(raw))
    refused("qwen3 has no routed experts", tiny_config("qwen3", vocab_size=VOCAB))
    tensors = load_file(str(adapter / "adapter_model.safetensors"))
    save_file({k.replace("layers.0.", "layers.1."): v for k, v in tensors.items() if "layers.0." in k},
              str(adapter / "adapter_model.safetensors"))
    refused("experts of block 1, which has none")  # (mlp_only_layers: a dense block)
    save_file({"base_model.model.model.layers.0.mlp.experts.0.up_proj.lora_A.weight": torch.zeros(4, 64)},
              str(adapter / "adapter_model.safetensors"))
    refused("adapts one expert's own module")
    save_file(tensors, str(adapter / "adapter_model.safetensors"))
    check_int8_adapter(tmp_path / "base", open_adapter(AdapterSource.parse(f"a={adapter}"), config))


def check_int8_adapter(path, files) -> None:
    """On int8 blocks an adapter adds its deltas: int8 + adapter is about as far from float + adapter as int8 is from
    float, and much closer to it than the float blocks without the adapter are."""
    embeds = torch.randn(1, 6, 64, generator=torch.Generator().manual_seed(2))
    out = {}
    for quant in ("none", "int8"):
        span = BlockSpan.load(Checkpoint(str(path)), 0, 4, "float32", quant_type=quant, adapters=[files])
        for name in ("a", None):
            out[quant, name] = span.forward(embeds, 0, span.new_session_kv(1, 16, 0, 4, adapter=name))
    quant_error, adapted_error = [(out["int8", a] - out["none", a]).norm() for a in (None, "a")]
    adapter_effect = (out["none", "a"] - out["none", None]).norm()
    assert adapted_error < 1.5 * quant_error and adapted_error < 0.5 * adapter_effect, \
        (adapted_error, quant_error, adapter_effect)


def test_deepseek_adapter_on_int8_blocks(tmp_path):
    """DeepSeek-V3 int8 blocks (bitsandbytes projections, kv_b_proj in float) take an adapter on every attention
    projection (kv_b_proj's delta absorbed) and the routed experts (`check_int8_adapter`)."""
    from swarm.modeling.lora_files import AdapterSource, open_adapter
    from tests.fixtures.lora_fixtures import make_adapter

    save_tiny("deepseek_v3", tmp_path / "base", None, vocab_size=VOCAB, **DEEPSEEK)
    adapter = make_adapter(str(tmp_path / "base"), tmp_path / "lora", seed=1, targets=DEEPSEEK_TARGETS, r=4, alpha=8,
                           **EXPERTS)
    config = Checkpoint(str(tmp_path / "base")).load_config()
    check_int8_adapter(tmp_path / "base", open_adapter(AdapterSource.parse(f"a={adapter}"), config))


def test_gpt_oss_adapter_on_int8_blocks(tmp_path):
    """GPT-OSS int8 blocks (per-expert bitsandbytes modules) take an adapter on q/k/v/o and the experts' stacked
    parameters: the deltas add on top of the quantized experts' outputs (`check_int8_adapter`)."""
    from swarm.modeling.lora_files import AdapterSource, open_adapter
    from tests.fixtures.lora_fixtures import make_adapter

    save_tiny("gpt_oss", tmp_path / "base", None, vocab_size=VOCAB, **GPT_OSS)
    adapter = make_adapter(str(tmp_path / "base"), tmp_path / "lora", seed=1,
                           targets=("q_proj", "k_proj", "v_proj", "o_proj"), r=4, alpha=8, **EXPERTS)
    config = Checkpoint(str(tmp_path / "base")).load_config()
    check_int8_adapter(tmp_path / "base", open_adapter(AdapterSource.parse(f"a={adapter}"), config))


def test_left_padded_batch_matches_transformers(case):
    """A batch of two prompts, the shorter left-padded by 4: the server hides the padding keys and counts each
    row's positions from its first token (prefill, then decode steps), as transformers' generate with the
    attention mask does. (Phi-3 with LongRoPE: the generation crosses its original 12 positions, where the session
    is computed again.)"""
    name, _, reference, span = case
    torch.manual_seed(6)
    ids = torch.randint(3, VOCAB, (2, 11))
    ids[1, :4] = reference.config.pad_token_id
    attention_mask = torch.ones_like(ids)
    attention_mask[1, :4] = 0
    with torch.no_grad():
        expected = reference.generate(ids, attention_mask=attention_mask, max_new_tokens=6, min_new_tokens=6,
                                      do_sample=False)
    kv = span.new_session_kv(2, 32, 0, 4)
    kv.set_padding([0, 4])
    hidden = span.forward(embed_ids(reference, ids), 0, kv)
    tokens = greedy_steps(reference, span, kv, ids, hidden, 6)
    assert tokens.tolist() == expected.tolist()


@pytest.mark.parametrize("case", ["bloom", "falcon-new", "falcon-mq", "falcon-alibi", "mixtral"])
def test_training_gradients_of_the_older_families(case, tmp_path, model_path):
    """BLOOM (its embeddings' LayerNorm on the client's side of the first block), Falcon's layouts (rotary and
    ALiBi) and Mixtral: a training step's input gradients through the server's blocks equal transformers'."""
    from tests.fixtures.family_configs import build_bloom_falcon

    if case == "mixtral":
        reference = save_tiny("mixtral", tmp_path, None, vocab_size=VOCAB)
        final_norm, embed_norm = reference.model.norm, torch.nn.Identity()
    else:
        reference = build_bloom_falcon(case, tmp_path, model_path)
        final_norm = reference.transformer.ln_f
        embed_norm = reference.transformer.word_embeddings_layernorm if case == "bloom" else torch.nn.Identity()
    span = BlockSpan.load(Checkpoint(str(tmp_path)), 0, reference.config.num_hidden_layers, "float32")
    torch.manual_seed(7)
    check_training_gradients(reference, span, torch.randint(3, 500, (2, 9)), embed_norm,
                             lambda hidden: reference.lm_head(final_norm(hidden)))


@pytest.mark.parametrize("case", ["bloom", "falcon-alibi", "falcon-alibi-new"])
def test_left_padded_batch_on_alibi_blocks_matches_transformers(case, tmp_path, model_path):
    """ALiBi blocks (BLOOM, Falcon with `alibi`) on a left-padded batch: the bias over key positions is
    shift-invariant per query, so with the padding keys hidden, prefill and batched decode steps give transformers'
    generate with the attention mask (which counts each row's positions from its first token)."""
    from tests.fixtures.family_configs import build_bloom_falcon

    reference = build_bloom_falcon(case, tmp_path, model_path)
    span = BlockSpan.load(Checkpoint(str(tmp_path)), 0, reference.config.num_hidden_layers, "float32")
    base = reference.transformer
    torch.manual_seed(8)
    ids = torch.randint(3, 500, (2, 9))
    ids[1, :3] = 0
    attention_mask = torch.ones_like(ids)
    attention_mask[1, :3] = 0
    with torch.no_grad():
        expected = reference.generate(ids, attention_mask=attention_mask, max_new_tokens=6, min_new_tokens=6,
                                      do_sample=False, pad_token_id=0)

    def embed(tokens: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            hidden = base.word_embeddings(tokens)
            return base.word_embeddings_layernorm(hidden) if case == "bloom" else hidden

    kv = span.new_session_kv(2, 32, 0, span.end)
    kv.set_padding([0, 3])
    hidden = span.forward(embed(ids), 0, kv)
    tokens = ids
    for position in range(9, 15):
        with torch.no_grad():
            logits = reference.lm_head(base.ln_f(hidden[:, -1:]))
        logits[..., reference.config.eos_token_id] = float("-inf")  # as generate's min_new_tokens
        next_token = logits.argmax(-1)
        tokens = torch.cat([tokens, next_token], dim=1)
        hidden = span.forward_batch([(embed(next_token), position, kv)], 0, span.end)[0]
    assert tokens.tolist() == expected.tolist()


@pytest.mark.parametrize("case", ["bloom", "falcon-new", "falcon-alibi"])
def test_lora_adapter_on_bloom_and_falcon_matches_peft(case, tmp_path, model_path):
    """A peft LoRA adapter on BLOOM's / Falcon's fused query_key_value, dense and MLP projections gives peft's
    logits: a prefill, and a decode step batched with a base session; and its input gradients in a training pass."""
    from swarm.modeling.lora_files import AdapterSource, open_adapter
    from tests.fixtures.family_configs import build_bloom_falcon
    from tests.fixtures.lora_fixtures import make_adapter, peft_reference

    build_bloom_falcon(case, tmp_path / "base", model_path)
    targets = ("query_key_value", "dense", "dense_h_to_4h", "dense_4h_to_h")
    adapter = make_adapter(str(tmp_path / "base"), tmp_path / "lora", seed=1, targets=targets, r=4, alpha=8)
    config = Checkpoint(str(tmp_path / "base")).load_config()
    blocks = config.num_hidden_layers
    span = BlockSpan.load(Checkpoint(str(tmp_path / "base")), 0, blocks, "float32",
                          adapters=[open_adapter(AdapterSource.parse(f"a={adapter}"), config)])
    peft_model = peft_reference(str(tmp_path / "base"), {"a": adapter})
    torch.manual_seed(9)
    ids = torch.randint(3, 500, (1, 8))
    with torch.no_grad():
        expected = peft_model(input_ids=ids).logits
        with peft_model.disable_adapter():
            base_logits = peft_model(input_ids=ids).logits
        model = peft_model.base_model.model.transformer
        embeds = model.word_embeddings(ids)
        if case == "bloom":
            embeds = model.word_embeddings_layernorm(embeds)

    def logits(hidden: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            return peft_model.base_model.model.lm_head(model.ln_f(hidden))

    kvs = {name: span.new_session_kv(1, 32, 0, blocks, adapter=name) for name in ("a", None)}
    assert (logits(span.forward(embeds[:, :-1], 0, kvs["a"])) - expected[:, :-1]).abs().max().item() < 1e-4
    assert (expected - base_logits).abs().max().item() > 1e-2  # the adapter matters
    span.forward(embeds[:, :-1], 0, kvs[None])
    steps = span.forward_batch([(embeds[:, -1:], 7, kvs["a"]), (embeds[:, -1:], 7, kvs[None])], 0, blocks)
    assert (logits(steps[0]) - expected[:, -1:]).abs().max().item() < 1e-4
    assert (logits(steps[1]) - base_logits[:, -1:]).abs().max().item() < 1e-4
    # a pass without a cache (rpc_forward) with the adapter
    assert (logits(span.forward(embeds, 0, None, adapter="a")) - expected).abs().max().item() < 1e-4
    # a training pass's input gradients through the adapter (ALiBi: the step's biased mask)
    check_training_gradients(peft_model, span, ids.repeat(2, 1), model.word_embeddings_layernorm if case == "bloom"
                             else torch.nn.Identity(), lambda hidden: peft_model.base_model.model.lm_head(
                                 model.ln_f(hidden)), adapter="a")
