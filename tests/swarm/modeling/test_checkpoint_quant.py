"""Checkpoints as published quantized (`swarm.modeling.checkpoint_quant`): GPT-OSS with MXFP4 experts, DeepSeek-V3,
Qwen3 and Qwen3-MoE (experts one by one) with block-scaled FP8 weights, in tiny checkpoints written in exactly the
official layouts (`tests.fixtures.quant_checkpoints`), against transformers loading the same checkpoint and
dequantizing on the CPU.

In process: the dequantizers equal transformers' on their own (MXFP4 in float32, bfloat16 and float16 over every
e8m0 byte; FP8 of whole 128 x 128 blocks, and of partial ones as DeepSeek's 576-row kv_a_proj_with_mqa needs
them), the loaded blocks' tensors equal transformers' model's bit for bit, their hidden states and logits within 1e-4
(prefill and greedy decode steps), nf4 of them equal to nf4 of the dequantized weights, the memory plan equals the
bytes held after loading, a span opens only its blocks' shards, DeepSeek's multi-token-prediction block is skipped
with one log line, the client's parts load dequantized (an FP8 head), `--revision` / `--token` reach the hub reads,
and each malformed checkpoint fails with its line from the headers (and a server started on one, pinned or not,
exits with it before its DHT starts). Through real processes (extended tier: two servers split mid-model against
transformers' greedy tokens and logits, for MXFP4 and for FP8; two nf4 servers of MXFP4 against transformers' nf4
of the dequantized weights) in `test_split_swarm_*` below; make test covers the same loading path in process here.
"""
from __future__ import annotations

import json
import logging
import re
from pathlib import Path

import pytest
import torch

from server.compute.blocks import BlockSpan
from swarm.modeling.checkpoint import Checkpoint, CheckpointError
from swarm.modeling.checkpoint_quant import dequantize_fp8, dequantize_mxfp4
from swarm.modeling.families.qwen3_moe import from_fused_layout
from tests.fixtures.family_configs import DEEPSEEK, GPT_OSS, VOCAB
from tests.fixtures.quant_checkpoints import quantize_fp8, quantize_mxfp4, reference_of, to_fp8, to_mxfp4
from tests.fixtures.swarm_checks import check_split_swarm
from tests.fixtures.tiny_checkpoints import VOCAB as TINY_VOCAB
from tests.fixtures.tiny_checkpoints import OpenedFiles, save_fused, save_tiny, shard_files

# DeepSeek-V3 wide enough for several 128 x 128 blocks per projection (hidden 256, a dense MLP of 256, experts of 128)
DEEPSEEK_FP8 = dict(DEEPSEEK, hidden_size=256, intermediate_size=256, moe_intermediate_size=128, kv_lora_rank=120,
                    q_lora_rank=128)
QWEN3_FP8 = dict(hidden_size=256, intermediate_size=384, head_dim=64)
QWEN3_MOE_FP8 = dict(hidden_size=256, head_dim=64, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=128)
CASES = {"gpt_oss-mxfp4": ("gpt_oss", GPT_OSS, to_mxfp4), "deepseek_v3-fp8": ("deepseek_v3", DEEPSEEK_FP8, to_fp8),
         "qwen3-fp8": ("qwen3", QWEN3_FP8, to_fp8), "qwen3_moe-fp8": ("qwen3_moe", QWEN3_MOE_FP8, to_fp8)}


def write_quantized(path: Path, case: str, tokenizer_dir=None, mtp: bool = True, **overrides) -> None:
    family, sizes, convert = CASES[case]
    vocab = overrides.pop("vocab_size", VOCAB)
    save_tiny(family, path, tokenizer_dir, vocab_size=vocab, max_shard_size="300KB",
              **dict(sizes, **overrides))
    convert(path, mtp=mtp) if convert is to_fp8 and family == "deepseek_v3" else convert(path)


@pytest.fixture(scope="module", params=list(CASES))
def quantized(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(request.param)
    write_quantized(path, request.param)
    family = CASES[request.param][0]
    return family, path, reference_of(path, family)


def test_mxfp4_dequantizer_equals_transformers():
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    torch.manual_seed(0)
    blocks = torch.randint(0, 256, (3, 40, 4, 16), dtype=torch.uint8)
    for scales in (torch.randint(120, 134, (3, 40, 4), dtype=torch.uint8),  # (typical)
                   torch.randint(0, 256, (3, 40, 4), dtype=torch.uint8)):  # every e8m0 byte, over- and underflows
        for dtype in (torch.float32, torch.bfloat16, torch.float16):
            ours = dequantize_mxfp4(blocks, scales, dtype)
            assert ours.shape == (3, 128, 40) and ours.dtype == dtype
            torch.testing.assert_close(ours, convert_moe_packed_tensors(blocks, scales, dtype=dtype), rtol=0, atol=0,
                                       equal_nan=True)
    # the test's quantizer: values already on the grid come back as they were
    w = torch.tensor([0.5, -1.5, 6.0, -4.0] * 8).repeat(2, 1) * 2.0 ** -3  # [2, 32]
    b, s = quantize_mxfp4(w)
    assert torch.equal(dequantize_mxfp4(b[None], s[None], torch.float32)[0].t(), w)


def test_fp8_dequantizer_equals_transformers():
    from transformers.integrations.finegrained_fp8 import Fp8Dequantize, _dequantize_fp8_weight

    torch.manual_seed(0)
    w = torch.randn(384, 256)
    q, scale_inv = quantize_fp8(w)
    assert scale_inv.shape == (3, 2)
    ours = dequantize_fp8(q, scale_inv, (128, 128), torch.float32)
    assert torch.equal(ours, Fp8Dequantize(None)._dequantize_one(q, scale_inv, torch.float32))
    assert (ours - w).abs().max() <= w.abs().max() / 16  # (e4m3: 3 mantissa bits)
    # partial blocks: DeepSeek-V3's kv_a_proj_with_mqa [576, 7168 -> here 300]: 5 x 3 scales
    w = torch.randn(576, 300)
    q, scale_inv = quantize_fp8(w)
    assert scale_inv.shape == (5, 3)
    assert torch.equal(dequantize_fp8(q, scale_inv, (128, 128), torch.bfloat16),
                       _dequantize_fp8_weight(q, scale_inv, [128, 128], torch.float32).to(torch.bfloat16))


def _their_state(family: str, reference, index: int) -> dict:
    state = dict(reference.model.layers[index].state_dict())
    if family == "deepseek_v3" and index >= 1:  # (transformers 5 fuses the experts: ours keeps them one by one)
        state = from_fused_layout(state, int(reference.config.n_routed_experts))
    if family == "qwen3_moe":
        state = from_fused_layout(state, int(reference.config.num_experts))
    return state


def test_blocks_equal_transformers_dequantized(quantized):
    family, path, reference = quantized
    span = BlockSpan.load(Checkpoint(str(path)), 0, 4, "float32")
    for i in range(4):
        ours, theirs = span.layers[i].state_dict(), _their_state(family, reference, i)
        assert sorted(ours) == sorted(theirs)
        assert all(torch.equal(ours[k], theirs[k]) for k in theirs), i
    torch.manual_seed(1)
    ids = torch.randint(3, VOCAB, (1, 9))
    with torch.no_grad():
        expected = reference(ids, output_hidden_states=True)
        hidden = span.forward(reference.model.embed_tokens(ids), 0)
        assert (reference.model.norm(hidden) - expected.hidden_states[-1]).abs().max() < 1e-4
        assert (reference.lm_head(reference.model.norm(hidden)) - expected.logits).abs().max() < 1e-4
        # greedy decoding through the server's cached steps
        kv = span.new_session_kv(1, 32, 0, 4)
        tokens = ids
        last = span.forward(reference.model.embed_tokens(ids), 0, kv)[:, -1:]
        for position in range(ids.shape[1], ids.shape[1] + 4):
            token = reference.lm_head(reference.model.norm(last)).argmax(-1)  # [1, 1]
            tokens = torch.cat([tokens, token], dim=1)
            last = span.forward_batch([(reference.model.embed_tokens(token), position, kv)], 0, 4)[0]
        expected_tokens = reference.generate(ids, max_new_tokens=4, do_sample=False, min_new_tokens=4)
        assert tokens.tolist() == expected_tokens.tolist()


def test_memory_plan_equals_the_bytes_held(quantized):
    from server.placement.memory import bytes_per_block

    family, path, _ = quantized
    checkpoint = Checkpoint(str(path))
    config = checkpoint.load_config()
    for dtype in ("float32", "bfloat16"):
        span = BlockSpan.load(checkpoint, 0, 4, dtype)
        held = [sum(t.numel() * t.element_size() for t in list(layer.parameters()) + list(layer.buffers()))
                for layer in span.layers]
        assert bytes_per_block(config, span.dtype) == max(held[0], held[-1]), (dtype, held)


def test_a_span_reads_only_its_shards_and_skips_the_mtp_block(quantized, monkeypatch, caplog):
    family, path, _ = quantized
    weight_map = json.loads((path / "model.safetensors.index.json").read_text())["weight_map"]
    assert len(shard_files(path)) >= 4
    checkpoint = Checkpoint(str(path))  # (one for the server's life: it may load blocks more than once)
    for start, end in [(0, 2), (3, 4)]:
        opened = OpenedFiles(monkeypatch)
        with caplog.at_level(logging.INFO, logger="server.compute.loading"):
            BlockSpan.load(checkpoint, start, end, "float32")
        wanted = {f for n, f in weight_map.items() if n.startswith(tuple(f"model.layers.{i}." for i in
                                                                          range(start, end)))}
        assert set(opened.names) == wanted
    skipped = [r for r in caplog.records if "skipping the tensors of block 4" in r.getMessage()]
    assert len(skipped) == (1 if family == "deepseek_v3" else 0)


def _edit_shard(path: Path, tensor: str, edit) -> None:
    """Apply `edit` to the stored tensors of the shard holding `tensor` (a dict it changes in place)."""
    from safetensors.torch import load_file, save_file

    index_path = path / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    filename = index["weight_map"][tensor]
    tensors = load_file(str(path / filename))
    edit(tensors)
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(path / filename), metadata={"format": "pt"})
    index["weight_map"] = {n: f for n, f in index["weight_map"].items() if f != filename or n in tensors}
    index["weight_map"].update({n: filename for n in tensors})
    index_path.write_text(json.dumps(index))


def _edit_config(path: Path, **quantization) -> None:
    config = json.loads((path / "config.json").read_text())
    config["quantization_config"].update(quantization)
    (path / "config.json").write_text(json.dumps(config))


Q_A = "model.layers.1.self_attn.q_a_proj.weight"
GATE_UP = "model.layers.1.mlp.experts.gate_up_proj"
MALFORMED = {
    "missing FP8 scale": ("deepseek_v3-fp8", lambda p: _edit_shard(p, Q_A, lambda t: t.pop(Q_A + "_scale_inv")),
                          f"{Q_A}_scale_inv is missing"),
    "wrong FP8 scale shape": ("deepseek_v3-fp8", lambda p: _edit_shard(
        p, Q_A, lambda t: t.update({Q_A + "_scale_inv": torch.ones(3, 2)})), f"{Q_A}_scale_inv has shape \\[3, 2\\]"),
    "block size not dividing": ("deepseek_v3-fp8", lambda p: _edit_config(p, weight_block_size=[64, 64]),
                                "weight_block_size \\[64, 64\\] does not divide model.layers.[01]."),
    "unknown quant_method": ("qwen3-fp8", lambda p: _edit_config(p, quant_method="awq"),
                             "quant_method 'awq' is not supported"),
    "missing MXFP4 scales": ("gpt_oss-mxfp4", lambda p: _edit_shard(
        p, GATE_UP + "_blocks", lambda t: t.pop(GATE_UP + "_scales")), f"{GATE_UP}_scales is missing"),
    "wrong MXFP4 scale shape": ("gpt_oss-mxfp4", lambda p: _edit_shard(
        p, GATE_UP + "_blocks", lambda t: t.update({GATE_UP + "_scales": t[GATE_UP + "_scales"][:, :, :1]})),
        f"{GATE_UP}_scales has shape \\[4, 128, 1\\], expected \\[4, 128, 2\\]"),
}


@pytest.mark.parametrize("fault", list(MALFORMED))
def test_a_malformed_checkpoint_fails_with_its_line(fault, tmp_path, monkeypatch, capsys):
    case, damage, message = MALFORMED[fault]
    write_quantized(tmp_path, case, mtp=False)
    damage(tmp_path)
    with pytest.raises(CheckpointError, match=message):
        BlockSpan.load(Checkpoint(str(tmp_path)), 0, 4, "float32")

    # a server started on it, pinned or placing itself: the same line, exit 1, before its DHT starts
    from server.server import main

    def run(self):
        raise AssertionError("the server started")

    monkeypatch.setattr("server.server.Server.run", run)
    for pinned in (["--block_indices", "1:3"], []):
        assert main([str(tmp_path), "--throughput", "1", *pinned]) == 1
        assert re.search(message, capsys.readouterr().err)


def test_nf4_blocks_equal_nf4_of_the_dequantized_weights(quantized, tmp_path):
    """`--quant_type nf4` on a quantized checkpoint quantizes the dequantized block: the same blocks, to the bit, as
    nf4 of a float32 checkpoint of transformers' dequantized weights (whose nf4 blocks equal transformers' own nf4
    model: test_gpt_oss_quant.py, test_deepseek_quant.py)."""
    pytest.importorskip("bitsandbytes")
    family, path, reference = quantized
    save_fused(reference, tmp_path)
    config = json.loads((path / "config.json").read_text())
    config.pop("quantization_config")
    (tmp_path / "config.json").write_text(json.dumps(config))
    ours = BlockSpan.load(Checkpoint(str(path)), 0, 4, "float32", quant_type="nf4")
    plain = BlockSpan.load(Checkpoint(str(tmp_path)), 0, 4, "float32", quant_type="nf4")
    torch.manual_seed(2)
    x = torch.randn(1, 7, ours.hidden_size)
    kv_ours, kv_plain = ours.new_session_kv(1, 16, 0, 4), plain.new_session_kv(1, 16, 0, 4)
    assert torch.equal(ours.forward(x, 0, kv_ours), plain.forward(x, 0, kv_plain))
    step = torch.randn(1, 1, ours.hidden_size)
    assert torch.equal(ours.forward_batch([(step, 7, kv_ours)], 0, 4)[0],
                       plain.forward_batch([(step, 7, kv_plain)], 0, 4)[0])
    float_span = BlockSpan.load(Checkpoint(str(path)), 0, 4, "float32")
    assert (float_span.forward(x, 0) - ours.forward(x, 0)).abs().max() > 1e-3  # (nf4 did quantize)


@pytest.mark.parametrize("case", ["gpt_oss-mxfp4", "deepseek_v3-fp8"])
def test_split_swarm_serves_the_published_checkpoint(case, tmp_path, bootstrap, model_path, tokenizer, monkeypatch):
    """Two servers (0:2, 2:4) of the checkpoint as published, and a client whose embeddings and head load from it too:
    greedy tokens and logits equal transformers' dequantized model (`check_split_swarm`; DeepSeek's hidden 64 in
    one partial 128 x 128 block per projection, its MTP block in the last shard)."""
    family = CASES[case][0]
    path = tmp_path / case
    small = dict(DEEPSEEK) if family == "deepseek_v3" else {}
    write_quantized(path, case, model_path, vocab_size=TINY_VOCAB, **small)
    check_split_swarm(path, reference_of(path, family), f"q{family[:3]}", bootstrap, tokenizer, monkeypatch)


def _hub_cache(root: Path, repo: str, revisions: dict) -> None:
    """An offline hub cache holding `repo` at each ref (name -> local checkpoint directory)."""
    import shutil

    base = root / f"models--{repo.replace('/', '--')}"
    (base / "refs").mkdir(parents=True)
    for i, (ref, local) in enumerate(revisions.items()):
        commit = str(i) * 40
        shutil.copytree(local, base / "snapshots" / commit)
        (base / "refs" / ref).write_text(commit)


def test_hub_flags_pick_the_revision(tmp_path, monkeypatch, capsys):
    """`--revision` / `--token` (CLI, YAML, SWARMGATE_REVISION / SWARMGATE_TOKEN; in --help) reach the hub reads: a
    server of a hub repo whose branch `mxfp4` holds the published checkpoint and `main` a float one reads the one
    its revision names (offline, from a hub cache: any download would be an error)."""
    import argparse

    import huggingface_hub.constants

    from gateway.config import GatewayConfig
    from server.config import ServerConfig
    from server.server import Server
    from swarm.runtime.config import build_parser, load_config

    write_quantized(tmp_path / "quantized", "gpt_oss-mxfp4")
    save_tiny("gpt_oss", tmp_path / "float", None, vocab_size=VOCAB, **GPT_OSS)
    _hub_cache(tmp_path / "hub", "tests/tiny-gpt-oss", {"main": tmp_path / "float", "mxfp4": tmp_path / "quantized"})
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)

    yaml_file = tmp_path / "server.yaml"
    yaml_file.write_text(f"model: tests/tiny-gpt-oss\ncache_dir: {tmp_path / 'hub'}\nrevision: mxfp4\n")
    config = load_config(ServerConfig, argparse.Namespace(config=str(yaml_file)),
                         environ={"SWARMGATE_TOKEN": "hf_from_env"})
    assert (config.revision, config.token) == ("mxfp4", "hf_from_env")
    server = Server(config)
    assert server.checkpoint.revision == "mxfp4" and server.checkpoint.token == "hf_from_env"
    fmt = server.checkpoint.quantization()
    assert fmt is not None and fmt.method == "mxfp4"
    span = BlockSpan.load(server.checkpoint, 2, 4, "float32")
    local = BlockSpan.load(Checkpoint(str(tmp_path / "quantized")), 2, 4, "float32")
    assert all(torch.equal(a, b) for a, b in zip(span.state_dict().values(), local.state_dict().values()))
    main = load_config(ServerConfig, argparse.Namespace(model="tests/tiny-gpt-oss", cache_dir=str(tmp_path / "hub")),
                       environ={"SWARMGATE_REVISION": "main"})
    assert main.revision == "main" and Server(main).checkpoint.quantization() is None

    gateway = load_config(GatewayConfig, argparse.Namespace(model="m", revision="v2", token="hf_cli"), environ={})
    assert (gateway.revision, gateway.token) == ("v2", "hf_cli")
    for config_cls in (ServerConfig, GatewayConfig):
        text = build_parser(config_cls, "swarmgate", "", positional="model").format_help()
        assert "--revision" in text and "--token" in text and "HF_TOKEN" in text


def test_the_client_parts_load_dequantized(tmp_path):
    """The client's tensors (`load_tensors` by name, as `DistributedModelForCausalLM.from_pretrained` reads the
    embeddings, norm and head) come dequantized where the checkpoint quantized them: here an FP8 LM head with its
    `weight_scale_inv`, whose scale is read with it though only `lm_head.weight` is asked for."""
    write_quantized(tmp_path, "qwen3-fp8")
    head = "lm_head.weight"
    original = Checkpoint(str(tmp_path)).load_tensors(lambda name: name == head)[head]
    weight, scale_inv = quantize_fp8(original)
    _edit_shard(tmp_path, head, lambda t: t.update({head: weight, head + "_scale_inv": scale_inv}))
    tensors = Checkpoint(str(tmp_path)).load_tensors(lambda name: name in (head, "model.norm.weight"),
                                                     torch.float32)
    assert sorted(tensors) == [head, "model.norm.weight"]
    assert torch.equal(tensors[head], dequantize_fp8(weight, scale_inv, (128, 128), torch.float32))
    reference = reference_of(tmp_path, "qwen3")
    assert torch.equal(tensors[head], reference.lm_head.weight)


def test_split_swarm_nf4_of_the_mxfp4_checkpoint(tmp_path, bootstrap, model_path, tokenizer):
    """Two `--quant_type nf4` servers of GPT-OSS's MXFP4 checkpoint: greedy tokens equal transformers' nf4 model
    (its bitsandbytes integration) of the dequantized weights (`tests.fixtures.quant_reference.gpt_oss_reference`)."""
    from tests.fixtures.quant_reference import check_nf4_split_swarm, gpt_oss_reference
    from tests.fixtures.swarm_checks import PROMPTS

    path, plain = tmp_path / "mxfp4", tmp_path / "dequantized"
    write_quantized(path, "gpt_oss-mxfp4", model_path, vocab_size=TINY_VOCAB)
    plain.mkdir()
    save_fused(reference_of(path, "gpt_oss"), plain)
    config = json.loads((path / "config.json").read_text())
    config.pop("quantization_config")
    (plain / "config.json").write_text(json.dumps(config))
    check_nf4_split_swarm(path, gpt_oss_reference(plain, "nf4"), bootstrap, tokenizer, "qgon", PROMPTS[:3])
