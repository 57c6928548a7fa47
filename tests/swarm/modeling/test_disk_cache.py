"""The download cache: LRU eviction under a size limit, the hub cache layout, several processes sharing it.

The hub cannot be reached from the test machine, so downloads are local functions writing files (and, for the
`Checkpoint` wiring, fakes of the three `huggingface_hub` calls it makes).
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from swarm.modeling.disk_cache import LOCK_NAME, DiskCache, DiskCacheError, hub_download, parse_size

REPO = Path(__file__).resolve().parents[3]


def writer(path: Path, size: int):
    def download() -> Path:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(b"x" * size)
        return path

    return download


def put(cache: DiskCache, name: str, size: int) -> Path:
    path = cache.root / name
    return cache.fetch(writer(path, size), size, cached=lambda: path if path.exists() else None)


def set_used(path: Path, when: float) -> None:
    os.utime(path, (when, os.stat(path).st_mtime))


def test_parse_size():
    assert parse_size("500") == 500 and parse_size(1000) == 1000 and parse_size(None) is None
    assert parse_size("2KB") == 2000 and parse_size("1.5GiB") == int(1.5 * 2**30) and parse_size("3 gb") == 3 * 10**9
    for bad in ("lots", "5 parsecs", "-3", "1e3"):
        with pytest.raises(ValueError):
            parse_size(bad)


def test_least_recently_used_files_are_evicted(tmp_path):
    cache = DiskCache(tmp_path, max_bytes=350)
    a, b, c = (put(cache, name, 100) for name in ("a", "b", "c"))
    for i, path in enumerate((a, b, c)):
        set_used(path, 1000 + i)
    assert cache.usage() == 300
    assert put(cache, "a", 100) == a  # a hit: nothing downloaded, `a` is now the most recently used
    put(cache, "d", 100)  # needs room: `b` is the least recently used
    assert sorted(p.name for p in tmp_path.iterdir() if p.name != LOCK_NAME) == ["a", "c", "d"]
    assert cache.usage() <= 350
    put(cache, "e", 250)  # evicts as many as needed, oldest first
    assert cache.usage() <= 350 and (tmp_path / "e").exists() and not (tmp_path / "c").exists()
    with pytest.raises(DiskCacheError, match="does not fit"):
        put(cache, "huge", 351)
    assert not (tmp_path / "huge").exists()


def test_unlimited_cache_never_evicts(tmp_path):
    cache = DiskCache(tmp_path)
    for i in range(5):
        put(cache, f"f{i}", 1000)
    assert cache.usage() == 5000 and cache.make_room(10**12) == []


def test_hub_layout_blobs_links_and_unfinished_downloads(tmp_path):
    """Blobs are counted once (not their snapshot links); evicting one removes its dangling link; unfinished
    downloads are counted but never deleted."""
    repo = tmp_path / "models--org--model"
    blobs, snapshot = repo / "blobs", repo / "snapshots" / "abc123"
    blobs.mkdir(parents=True)
    snapshot.mkdir(parents=True)
    for name, size, used in (("old", 100, 1000), ("new", 100, 3000)):
        (blobs / name).write_bytes(b"x" * size)
        set_used(blobs / name, used)
        (snapshot / f"{name}.safetensors").symlink_to(f"../../blobs/{name}")
    (blobs / "partial.incomplete").write_bytes(b"x" * 50)
    set_used(blobs / "partial.incomplete", 1)
    cache = DiskCache(tmp_path, max_bytes=300)
    assert cache.usage() == 250
    assert cache.make_room(100) == [blobs / "old"]
    assert not os.path.lexists(snapshot / "old.safetensors")
    assert (snapshot / "new.safetensors").read_bytes() == b"x" * 100
    assert (blobs / "partial.incomplete").exists()
    with pytest.raises(DiskCacheError, match="cannot free"):
        cache.make_room(260)  # only `new` can go; the unfinished download stays


WORKER = r"""
import json, os, sys, time
from pathlib import Path
from swarm.modeling.disk_cache import DiskCache
root, limit, names, log = Path(sys.argv[1]), json.loads(sys.argv[2]), json.loads(sys.argv[3]), sys.argv[4]
cache = DiskCache(root, limit)
SIZE = 1000

def record(line):
    with open(log, "a") as f:  # O_APPEND: whole lines from concurrent writers
        f.write(line + "\n")

for name in names:
    path = root / name
    def download():
        if limit is not None and cache.usage() + SIZE > limit:
            record(f"OVER {name} {cache.usage()}")
        with open(path, "wb") as f:
            for _ in range(10):  # slowly, so that the others would trip over a half-written file
                f.write(b"y" * (SIZE // 10))
                f.flush()
                time.sleep(0.002)
        record(f"DOWNLOADED {name} {os.getpid()}")
        return path
    got = cache.fetch(download, SIZE, cached=lambda: path if path.exists() else None)
    if got.read_bytes() != b"y" * SIZE:
        record(f"CORRUPT {name}")
"""


def _run_workers(tmp_path: Path, limit, name_lists) -> list:
    root, log = tmp_path / "cache", tmp_path / "log.txt"
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    procs = [subprocess.Popen([sys.executable, "-c", WORKER, str(root), json.dumps(limit), json.dumps(names), str(log)],
                              cwd=REPO, env=env) for names in name_lists]
    for p in procs:
        assert p.wait(120) == 0
    return log.read_text().splitlines() if log.exists() else []


def test_processes_sharing_the_cache_download_each_file_once(tmp_path):
    names = [f"shard{i}" for i in range(6)]
    lines = _run_workers(tmp_path, None, [names, names[::-1], names[2:] + names[:2], names])
    downloads = [line.split()[1] for line in lines if line.startswith("DOWNLOADED")]
    assert sorted(downloads) == sorted(names), lines
    assert not [line for line in lines if not line.startswith("DOWNLOADED")], lines


def test_processes_sharing_a_limited_cache_stay_under_the_limit(tmp_path):
    limit = 3500
    lists = [[f"p{w}-{i}" for i in range(5)] + ["common"] for w in range(4)]
    lines = _run_workers(tmp_path, limit, lists)
    assert not [line for line in lines if line.startswith(("OVER", "CORRUPT"))], lines
    cache = DiskCache(tmp_path / "cache", limit)
    assert 0 < cache.usage() <= limit


def test_checkpoint_hub_downloads_go_through_the_cache(tmp_path, monkeypatch):
    """`Checkpoint.file` for a hub repo -> `hub_download`: size asked before downloading, room made, LRU kept."""
    import huggingface_hub

    from swarm.modeling.checkpoint import Checkpoint

    sizes = {"model-00001.safetensors": 400, "model-00002.safetensors": 400, "config.json": 10}
    calls = []

    def fake_cached(repo_id, filename, cache_dir=None, revision=None):
        path = Path(cache_dir) / "blobs" / filename
        return str(path) if path.exists() else None

    def fake_url(repo_id, filename, revision=None):
        return f"hub://{repo_id}/{filename}"

    class Meta:
        def __init__(self, size):
            self.size = size

    def fake_metadata(url, token=None):
        assert token is None  # huggingface_hub's own (HF_TOKEN, the stored login) when none is given
        calls.append(("metadata", url))
        return Meta(sizes[url.rsplit("/", 1)[1]])

    def fake_download(repo_id, filename, cache_dir=None, revision=None, token=None):
        assert token is None
        calls.append(("download", filename))
        path = Path(cache_dir) / "blobs" / filename
        path.parent.mkdir(parents=True, exist_ok=True)
        if not path.exists():
            path.write_bytes(b"z" * sizes[filename])
        return str(path)

    monkeypatch.setattr(huggingface_hub, "try_to_load_from_cache", fake_cached)
    monkeypatch.setattr(huggingface_hub, "hf_hub_url", fake_url)
    monkeypatch.setattr(huggingface_hub, "get_hf_file_metadata", fake_metadata)
    monkeypatch.setattr(huggingface_hub, "hf_hub_download", fake_download)

    cache_dir = tmp_path / "hub"
    checkpoint = Checkpoint("org/not-a-local-dir", cache_dir=str(cache_dir), max_disk_space=900)
    first = checkpoint.file("model-00001.safetensors")
    assert first.read_bytes() == b"z" * 400
    assert ("metadata", "hub://org/not-a-local-dir/model-00001.safetensors") in calls
    set_used(first, time.time() - 100)
    checkpoint.file("config.json")
    calls.clear()
    checkpoint.file("model-00001.safetensors")  # cached: no size query; marked as just used
    assert calls == [("download", "model-00001.safetensors")]
    set_used(cache_dir / "blobs" / "config.json", time.time() - 50)
    checkpoint.file("model-00002.safetensors")  # 400 + 10 + 400 fits under 900
    assert {p.name for p in (cache_dir / "blobs").iterdir()} == {"model-00001.safetensors", "config.json",
                                                                  "model-00002.safetensors"}
    sizes["model-00003.safetensors"] = 400
    checkpoint.file("model-00003.safetensors")  # must evict: config.json (oldest) is not enough, then shard 1
    assert {p.name for p in (cache_dir / "blobs").iterdir()} == {"model-00002.safetensors", "model-00003.safetensors"}
    # without a limit nothing is asked or evicted beyond the download itself
    calls.clear()
    assert hub_download("org/x", "config.json", cache_dir=str(tmp_path / "other")).read_bytes() == b"z" * 10
    assert calls == [("download", "config.json")]


def test_a_checkpoint_converts_nothing_and_resolve_model_finds_the_bundled_directory(tmp_path, monkeypatch):
    """Opening a `Checkpoint` only reads: a bundled model's name is no directory, so to a `Checkpoint` it is a hub
    repo id, and nothing is written to the swarmgate cache; `prepare.resolve_model` (the entry points') maps the name
    to its prepared directory and leaves paths and hub ids as they are."""
    from swarm.modeling.checkpoint import Checkpoint
    from swarm.modeling.prepare import DEFAULT_MODEL, DONE_MARKER, resolve_model
    from swarm.runtime.paths import models_root

    monkeypatch.setenv("SWARMGATE_CACHE", str(tmp_path / "cache"))
    assert Checkpoint(DEFAULT_MODEL).local_dir is None
    assert not (tmp_path / "cache").exists()
    prepared = models_root() / DEFAULT_MODEL  # as if converted before: no conversion runs here
    prepared.mkdir(parents=True)
    (prepared / DONE_MARKER).write_text("test\n")
    assert resolve_model(DEFAULT_MODEL) == str(prepared) == str(tmp_path / "cache" / "models" / DEFAULT_MODEL)
    assert Checkpoint(resolve_model(DEFAULT_MODEL)).local_dir == prepared
    assert resolve_model(str(tmp_path)) == str(tmp_path)
    assert resolve_model("org/some-model") == "org/some-model"
