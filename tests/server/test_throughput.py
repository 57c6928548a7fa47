"""Throughput measured once and cached on disk; how many blocks and how much KV cache fit in memory."""
from __future__ import annotations

import json
import threading

import pytest
import torch

from server.placement.memory import (
    DEFAULT_CACHE_TOKENS,
    MIN_CACHE_TOKENS,
    bytes_per_block,
    cache_bytes_per_token,
    free_memory_bytes,
    plan_capacity,
)
from server.placement.throughput import cache_key, get_throughput, measure, parse_throughput_mode
from swarm.modeling.checkpoint import Checkpoint


@pytest.fixture(scope="module")
def checkpoint(model_path):
    return Checkpoint(model_path)


@pytest.fixture(scope="module")
def model_config(checkpoint):
    return checkpoint.load_config()


def test_parse_throughput_mode():
    assert parse_throughput_mode("auto") == "auto"
    assert parse_throughput_mode(" EVAL ") == "eval"
    assert parse_throughput_mode("12.5") == 12.5
    assert parse_throughput_mode(3) == 3.0
    for bad in ("fast", "0", "-1", "nan", "inf", ""):
        with pytest.raises(ValueError):
            parse_throughput_mode(bad)


def test_server_config_throughput_flag():
    from server.server import ServerConfig
    from swarm.runtime.config import ConfigError, build_parser, load_config

    parser = build_parser(ServerConfig, "server", "", positional="model")
    assert load_config(ServerConfig, parser.parse_args(["m"]), environ={}).throughput == "auto"
    assert load_config(ServerConfig, parser.parse_args(["m", "--throughput", "eval"]), environ={}).throughput == "eval"
    assert float(load_config(ServerConfig, parser.parse_args(["m", "--throughput", "40"]), environ={}).throughput) == 40
    with pytest.raises(ConfigError, match="throughput"):
        load_config(ServerConfig, parser.parse_args(["m", "--throughput", "quick"]), environ={})
    with pytest.raises(ConfigError, match="max_disk_space"):
        load_config(ServerConfig, parser.parse_args(["m", "--max_disk_space", "lots"]), environ={})
    with pytest.raises(ConfigError, match="disagrees"):
        load_config(ServerConfig, parser.parse_args(["m", "--num_blocks", "3", "--block_indices", "0:4"]), environ={})
    config = load_config(ServerConfig, parser.parse_args(["m", "--balance_period", "5", "--max_disk_space", "2GiB"]),
                         environ={})
    assert config.balance_period == 5 and config.max_disk_space == "2GiB" and config.attn_cache_tokens is None


def test_measure_runs_one_block(checkpoint):
    result = measure(checkpoint, "cpu", "float32", decode_steps=4, forward_passes=1)
    assert result["decode_rps"] > 0 and result["forward_tps"] > 0


def test_throughput_is_measured_once_and_cached(checkpoint, tmp_path):
    value, source = get_throughput("auto", checkpoint, "cpu", torch.float32, "float32", cache_root=tmp_path)
    assert source == "measured" and value > 0
    data = json.loads((tmp_path / "throughput.json").read_text())
    key = cache_key(checkpoint.name, "cpu", torch.float32)
    assert list(data) == [key] and data[key]["decode_rps"] == value
    assert get_throughput("auto", checkpoint, "cpu", torch.float32, "float32", cache_root=tmp_path) == (value, "cache")
    # eval measures again and replaces the cached value
    again, source = get_throughput("eval", checkpoint, "cpu", torch.float32, "float32", cache_root=tmp_path)
    assert source == "measured"
    assert get_throughput("auto", checkpoint, "cpu", torch.float32, "float32", cache_root=tmp_path) == (again, "cache")
    # a given number is announced as is, nothing measured
    assert get_throughput("25", checkpoint, "cpu", torch.float32, cache_root=tmp_path / "none") == (25.0, "given")
    assert not (tmp_path / "none").exists()
    # other dtypes / quantization are other entries
    assert len({cache_key(checkpoint.name, "cpu", torch.float32), cache_key(checkpoint.name, "cpu", torch.bfloat16),
                cache_key(checkpoint.name, "cpu", torch.float32, "nf4")}) == 3


def test_concurrent_servers_measure_once(checkpoint, tmp_path):
    results = []
    threads = [threading.Thread(target=lambda: results.append(
        get_throughput("auto", checkpoint, "cpu", torch.float32, "float32", cache_root=tmp_path))) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert sorted(source for _, source in results) == ["cache", "cache", "measured"]
    assert len({value for value, _ in results}) == 1


def test_block_and_cache_sizes_match_the_real_tensors(checkpoint, model_config):
    from server.compute.blocks import BlockSpan

    span = BlockSpan.load(checkpoint, 0, 1, "float32", "cpu")
    real = sum(p.numel() * p.element_size() for p in span.layers.parameters())
    assert bytes_per_block(model_config, torch.float32) == real
    assert bytes_per_block(model_config, torch.bfloat16) == real // 2
    assert bytes_per_block(model_config, torch.float16, "nf4") < bytes_per_block(model_config, torch.float16, "int8") \
        < bytes_per_block(model_config, torch.float16)
    assert cache_bytes_per_token(model_config, torch.float32) == span.cache_bytes_per_token()
    with pytest.raises(ValueError):
        bytes_per_block(model_config, torch.float32, "int3")
    from swarm.modeling.smallgemm import packing_available

    if packing_available():  # weights packed for two decode batch sizes: two more copies of the linear weights
        packed = BlockSpan.load(checkpoint, 0, 1, "float32", "cpu", packed_rows=(8, 16))
        assert packed.gemms is not None
        packed.gemms.pack_pending(budget=float("inf"))
        gemms = packed.fused[0].gemms
        assert gemms is not None and all(sorted(g.packs) == [8, 16] for g in gemms.values())
        held = sum(g.weight.numel() * g.weight.element_size() * len(g.packs) for g in gemms.values())
        assert bytes_per_block(model_config, torch.float32, packed_copies=2) == real + held


def test_plan_capacity(model_config):
    block = bytes_per_block(model_config, torch.float32)
    token = cache_bytes_per_token(model_config, torch.float32)
    total = model_config.num_hidden_layers
    # plenty of memory: every block and the default budget
    plenty = plan_capacity(model_config, torch.float32, 100 * 2**30)
    assert (plenty.num_blocks, plenty.attn_cache_tokens) == (total, DEFAULT_CACHE_TOKENS)
    # room for about 10 blocks with their default cache share
    ten = 10 * (block + DEFAULT_CACHE_TOKENS * token)
    some = plan_capacity(model_config, torch.float32, int(ten / 0.9) + 1)
    assert some.num_blocks == 10
    assert some.num_blocks * (block + some.attn_cache_tokens * token) <= some.free_bytes
    # little memory: fewer blocks, a smaller cache, but at least the minimum
    small = plan_capacity(model_config, torch.float32, 2 * block + MIN_CACHE_TOKENS * token * 2)
    assert 1 <= small.num_blocks < 10 and MIN_CACHE_TOKENS <= small.attn_cache_tokens < DEFAULT_CACHE_TOKENS
    # given values win
    given = plan_capacity(model_config, torch.float32, 100 * 2**30, num_blocks=7, attn_cache_tokens=333)
    assert (given.num_blocks, given.attn_cache_tokens) == (7, 333)
    assert plan_capacity(model_config, torch.float32, 100 * 2**30, num_blocks=99).num_blocks == total
    with pytest.raises(ValueError, match="not even one block"):
        plan_capacity(model_config, torch.float32, block // 2)
    assert free_memory_bytes("cpu") > 0
