"""Sharded checkpoints (`model.safetensors.index.json` + shards, as a hub repo holds them) per family: a block span
reads only the shards that hold its blocks' tensors, counted by the files `swarm.modeling.checkpoint` opens, and
computes what the unsharded checkpoint's span computes; also through a hub repo id (offline, from a hub cache)."""
from __future__ import annotations

import json

import pytest
import torch

from server.compute.blocks import BlockSpan
from swarm.modeling.checkpoint import Checkpoint
from tests.fixtures.tiny_checkpoints import OpenedFiles, save_tiny, shard_files

FAMILIES = ["llama", "mistral", "qwen2", "mixtral"]


def _shards_of(path, prefixes) -> set:
    weight_map = json.loads((path / "model.safetensors.index.json").read_text())["weight_map"]
    return {file for name, file in weight_map.items() if any(name.startswith(p) for p in prefixes)}


@pytest.mark.parametrize("family", FAMILIES)
def test_a_span_reads_only_the_shards_of_its_blocks(family, tmp_path, monkeypatch):
    sharded, single = tmp_path / "sharded", tmp_path / "single"
    save_tiny(family, sharded, None, max_shard_size="150KB", vocab_size=512)
    save_tiny(family, single, None, vocab_size=512)
    shards = shard_files(sharded)
    assert len(shards) >= 4, shards  # the blocks lie in several shards
    for start, end in [(0, 2), (2, 4), (3, 4)]:
        opened = OpenedFiles(monkeypatch)
        span = BlockSpan.load(Checkpoint(str(sharded)), start, end, "float32")
        wanted = _shards_of(sharded, [f"model.layers.{i}." for i in range(start, end)])
        # the shards that hold these blocks, no other (one holding two blocks is opened for each)
        assert set(opened.names) == wanted, (start, end, opened.names)
        assert len(wanted) < len(shards)
        reference = BlockSpan.load(Checkpoint(str(single)), start, end, "float32")
        x = torch.randn(1, 5, span.hidden_size)
        assert torch.equal(span.forward(x, 0, None), reference.forward(x, 0, None))


@pytest.mark.parametrize("family", ["llama", "mixtral"])
def test_a_hub_repo_needs_only_the_shards_of_its_blocks(family, tmp_path, monkeypatch):
    """The same through a hub repo id (`Checkpoint`'s hub path, `swarm.modeling.disk_cache.hub_download`), offline
    on a hub cache that holds the config, the index and only the shards of blocks 2:4: loading them fetches
    nothing else (offline, any other file would be an error)."""
    import shutil

    import huggingface_hub.constants

    local = tmp_path / "local"
    save_tiny(family, local, None, max_shard_size="150KB", vocab_size=512)
    commit = "0" * 40
    repo = tmp_path / "hub" / "models--tests--tiny" / "snapshots" / commit
    repo.mkdir(parents=True)
    (repo.parent.parent / "refs").mkdir()
    (repo.parent.parent / "refs" / "main").write_text(commit)
    needed = _shards_of(local, ["model.layers.2.", "model.layers.3."])
    for name in ["config.json", "model.safetensors.index.json", *needed]:
        shutil.copy(local / name, repo / name)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    opened = OpenedFiles(monkeypatch)
    span = BlockSpan.load(Checkpoint("tests/tiny", cache_dir=str(tmp_path / "hub")), 2, 4, "float32")
    assert set(opened.names) == needed and len(needed) < len(shard_files(local))
    x = torch.randn(1, 5, span.hidden_size)
    reference = BlockSpan.load(Checkpoint(str(local)), 2, 4, "float32")
    assert torch.equal(span.forward(x, 0, None), reference.forward(x, 0, None))
