"""`swarm.modeling.smallgemm`: padding or packing a small batch's product changes its speed, never its rows' values
(beyond the last bits), and packed spans decode as plain ones do."""
from __future__ import annotations

import logging

import pytest
import torch
import torch.nn.functional as F

from swarm.modeling.smallgemm import (
    COLUMN_BLOCK,
    COLUMN_MIN_OUT,
    COLUMNS,
    PADDED,
    PLAIN,
    GemmGroup,
    SmallGemm,
    packing_available,
)

needs_packing = pytest.mark.skipif(not packing_available(), reason="this torch has no MKL packed GEMM")


def test_every_way_of_a_product_gives_the_plain_rows():
    torch.manual_seed(0)
    weight, bias = torch.randn(3000, 64), torch.randn(3000)
    group = GemmGroup([8, 16] if packing_available() else [])
    gemm = group.gemm(weight, bias)
    for rows in (1, 3, 4, 7, 8, 9, 13, 16):
        x = torch.randn(rows, 64)
        reference = F.linear(x, weight, bias)
        ways = [PLAIN, PADDED] + [m for m in group.packed_rows if m >= rows]
        for way in ways:
            out = gemm.product(x, way)
            assert out.shape == (rows, 3000), way
            torch.testing.assert_close(out, reference, rtol=1e-5, atol=1e-4)
        torch.testing.assert_close(gemm(x), reference, rtol=1e-5, atol=1e-4)  # the group's own way


def test_a_wide_product_in_column_blocks_gives_the_plain_rows():
    """Column blocks (a last block shorter than the others here) compute each output as the plain product does."""
    torch.manual_seed(0)
    out_features = COLUMN_MIN_OUT + COLUMN_BLOCK // 2 + 3
    weight, bias = torch.randn(out_features, 48), torch.randn(out_features)
    gemm = GemmGroup([]).gemm(weight)
    with_bias = GemmGroup([]).gemm(weight, bias)
    for rows in (1, 16, 64):
        x = torch.randn(rows, 48)
        out = gemm.product(x, COLUMNS)
        assert out.shape == (rows, out_features) and out.is_contiguous()
        torch.testing.assert_close(out, F.linear(x, weight), rtol=1e-6, atol=1e-5)
        torch.testing.assert_close(with_bias.product(x, COLUMNS), F.linear(x, weight, bias), rtol=1e-6, atol=1e-5)


def test_column_blocks_apply_from_the_multiple_up_where_timed_faster(monkeypatch, tmp_path):
    from swarm.modeling import smallgemm

    group = GemmGroup([], multiple=16)
    assert [group.by_columns(rows, {16: False, 64: True}) for rows in (8, 16, 63, 64, 500)] == \
        [False, False, False, True, True]
    assert [group.by_columns(rows, {16: True, 64: False}) for rows in (15, 16, 63, 64)] == [False, True, True, False]
    assert not group.by_columns(64, {})  # never timed: plain
    monkeypatch.setenv("SWARMGATE_CACHE", str(tmp_path))
    monkeypatch.setattr(smallgemm, "_TIMED", {})
    narrow, wide = group.gemm(torch.randn(COLUMN_MIN_OUT - 1, 16)), group.gemm(torch.randn(COLUMN_MIN_OUT, 16))
    group.calibrate()
    assert narrow.columns == {} and sorted(wide.columns) == [16, 64]
    wide.columns = {16: True, 64: True}
    ways: list = []
    real = SmallGemm.product
    monkeypatch.setattr(SmallGemm, "product", lambda self, x, way: (ways.append(way), real(self, x, way))[1])
    x = torch.randn(20, 16)
    torch.testing.assert_close(wide(x), F.linear(x, wide.weight), rtol=1e-6, atol=1e-5)
    wide(torch.randn(3, 16))  # below the multiple: as before (plain or padded)
    assert ways[0] == COLUMNS and ways[1] in (PLAIN, PADDED)
    again = GemmGroup([], multiple=16)  # another process on this machine: the kept timing, not timed again
    kept = again.gemm(torch.randn(COLUMN_MIN_OUT, 16))
    monkeypatch.setattr(smallgemm, "_TIMED", {})
    monkeypatch.setattr(SmallGemm, "product", lambda *args: pytest.fail("timed again"))
    again.calibrate()
    assert sorted(kept.columns) == [16, 64]


@needs_packing
def test_the_smallest_pack_that_holds_the_rows_is_used_and_few_or_many_rows_stay_plain():
    group = GemmGroup([16, 8], min_packed=3)
    assert group.packed_rows == (8, 16)
    assert [group.way(rows, {}) for rows in (1, 2, 3, 8, 9, 16, 17, 64)] == [PLAIN, PLAIN, 8, 8, 16, 16, PLAIN, PLAIN]
    assert group.way(2, {2: True}) == PADDED  # below the packs, padding where it was timed faster


def test_calibrate_times_the_row_counts_no_pack_takes_and_products_needing_gradients_stay_plain():
    group = GemmGroup([], multiple=8, trials=1)
    weight = torch.randn(500, 32)
    gemm = group.gemm(weight)
    group.calibrate(min_rows=3)
    assert sorted(gemm.padded) == [3, 4, 5, 6, 7]
    x = torch.randn(5, 32)
    torch.testing.assert_close(gemm(x), F.linear(x, weight), rtol=1e-5, atol=1e-4)
    x.requires_grad_(True)
    gemm.padded[5] = True
    out = gemm(x)
    out.sum().backward()  # the plain product: differentiable
    torch.testing.assert_close(x.grad, weight.sum(0).expand(5, 32), rtol=1e-5, atol=1e-4)


def test_a_product_timed_before_in_this_process_takes_that_timing(monkeypatch):
    first = GemmGroup([], multiple=8, trials=1)
    timed = first.gemm(torch.randn(300, 24))
    first.calibrate(min_rows=3)
    second = GemmGroup([], multiple=8, trials=1)
    again = second.gemm(torch.randn(300, 24))
    monkeypatch.setattr(SmallGemm, "product", lambda *args: pytest.fail("timed again"))
    second.calibrate(min_rows=3)
    assert again.padded == timed.padded and sorted(again.padded) == [3, 4, 5, 6, 7]


def test_a_product_timed_on_this_machine_before_takes_the_kept_timing(monkeypatch, tmp_path):
    """Another process (here: this one with its in-process timings forgotten) reads the file instead of timing;
    another CPU or torch, or a damaged file, times again."""
    from swarm.modeling import smallgemm

    monkeypatch.setenv("SWARMGATE_CACHE", str(tmp_path))
    monkeypatch.setattr(smallgemm, "_TIMED", {})
    first = GemmGroup([], multiple=8, trials=1)
    timed = first.gemm(torch.randn(200, 40))
    first.calibrate(min_rows=3)
    assert (tmp_path / smallgemm.CALIBRATION_FILE).exists()

    def again(product) -> SmallGemm:
        monkeypatch.setattr(smallgemm, "_TIMED", {})
        monkeypatch.setattr(SmallGemm, "product", product)
        group = GemmGroup([], multiple=8, trials=1)
        gemm = group.gemm(torch.randn(200, 40))
        group.calibrate(min_rows=3)
        return gemm

    real = SmallGemm.product
    assert again(lambda *args: pytest.fail("timed again")).padded == timed.padded
    calls: list = []

    def counted(self, x, way):
        calls.append(way)
        return real(self, x, way)

    monkeypatch.setattr(smallgemm, "_machine", lambda: "another CPU|2cpus|torch 0")
    assert sorted(again(counted).padded) == [3, 4, 5, 6, 7] and calls
    monkeypatch.undo()
    monkeypatch.setenv("SWARMGATE_CACHE", str(tmp_path))
    (tmp_path / smallgemm.CALIBRATION_FILE).write_text("{not json")
    calls.clear()
    assert sorted(again(counted).padded) == [3, 4, 5, 6, 7] and calls


def test_a_damaged_calibration_file_is_timed_again_with_one_warning_and_replaced(monkeypatch, tmp_path, caplog):
    """A torn (half-written), non-JSON, non-UTF-8 or wrongly shaped file reads as absent: the product is timed again,
    one warning says so, the process starts all the same, and the file is written whole again."""
    import json

    from swarm.modeling import smallgemm
    from swarm.runtime import paths

    monkeypatch.setenv("SWARMGATE_CACHE", str(tmp_path))
    monkeypatch.setattr(smallgemm, "_TIMED", {})
    GemmGroup([], multiple=8, trials=1).gemm(torch.randn(200, 40)).group.calibrate(min_rows=3)
    path = tmp_path / smallgemm.CALIBRATION_FILE
    whole = path.read_text()
    (key, entry), = json.loads(whole)[smallgemm._machine()].items()
    damaged = [whole[:len(whole) // 2], "", b"\xff\xfe{".decode("latin-1"), "[1, 2]",
               json.dumps({smallgemm._machine(): 7}), json.dumps({smallgemm._machine(): {key: {"3": "yes"}}}),
               json.dumps({smallgemm._machine(): {key: {"three": True}}})]
    for text in damaged:
        monkeypatch.setattr(smallgemm, "_TIMED", {})
        monkeypatch.setattr(paths, "_WARNED", set())
        path.write_bytes(text.encode("latin-1"))
        caplog.clear()
        timed: list = []
        real = SmallGemm.product
        monkeypatch.setattr(SmallGemm, "product", lambda self, x, way: timed.append(way) or real(self, x, way))
        group = GemmGroup([], multiple=8, trials=1)
        gemms = [group.gemm(torch.randn(200, 40)) for _ in range(2)]  # (the file is read again before the write)
        with caplog.at_level("WARNING"):
            group.calibrate(min_rows=3)
        assert timed and all(sorted(g.padded) == [3, 4, 5, 6, 7] for g in gemms), text
        warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
        assert len(warnings) == 1 and str(path) in warnings[0].getMessage(), (text, caplog.text)
        assert json.loads(path.read_text())[smallgemm._machine()][key].keys() == entry.keys(), text
        monkeypatch.setattr(SmallGemm, "product", real)
    assert [p.name for p in tmp_path.iterdir() if p.suffix != ".lock"] == [smallgemm.CALIBRATION_FILE]


def test_processes_adding_timings_at_once_keep_each_others(monkeypatch, tmp_path):
    """Two writers add their entries at once: the first reads the file, and the second adds its entry before the
    first writes (the first waits for it, at most 2 s): both entries are in the file after (the first, holding the
    file's lock, keeps the second out until it has written). Without the lock the first wrote back what it had
    read, and the second's entry was lost."""
    import json
    import threading

    from swarm.modeling import smallgemm

    monkeypatch.setenv("SWARMGATE_CACHE", str(tmp_path))
    read_once, second_done = threading.Event(), threading.Event()
    real_read = smallgemm.read_json

    def slow_first_read(path):
        data = real_read(path)
        if not read_once.is_set():  # the first writer: it lets the second go, then waits for it
            read_once.set()
            second_done.wait(2.0)
        return data

    monkeypatch.setattr(smallgemm, "read_json", slow_first_read)
    first = threading.Thread(target=smallgemm._store, args=(("first",), {3: True}))
    first.start()
    read_once.wait(10)
    second = threading.Thread(target=lambda: (smallgemm._store(("second",), {4: False}), second_done.set()))
    second.start()
    first.join()
    second.join()
    entries = json.loads((tmp_path / smallgemm.CALIBRATION_FILE).read_text())[smallgemm._machine()]
    assert entries == {repr(("first",)): {"3": True}, repr(("second",)): {"4": False}}


def test_the_calibration_file_is_written_whole_by_writers_at_once_and_leaves_no_temporary_file(monkeypatch, tmp_path):
    """Threads of one process (as processes) writing the file at once: every write succeeds, the file is always one
    writer's whole file (read while they write), and no temporary file stays, nor after a write that failed."""
    import json
    import os
    import threading

    from swarm.runtime.paths import read_json, write_json

    path = tmp_path / "gemm-calibration.json"
    errors: list = []
    seen: list = []
    done = threading.Event()

    def write(n: int) -> None:
        try:
            for i in range(60):
                write_json(path, {"writer": n, "i": i, "rows": {str(r): bool(r % 2) for r in range(400)}})
        except Exception as e:  # noqa: BLE001 - collected for the assertion
            errors.append(e)

    def read() -> None:
        while not done.is_set():
            if path.exists():
                seen.append(json.loads(path.read_text()))  # never half a file: a torn one would not parse

    reader = threading.Thread(target=read)
    reader.start()
    writers = [threading.Thread(target=write, args=(n,)) for n in range(6)]
    for t in writers:
        t.start()
    for t in writers:
        t.join()
    done.set()
    reader.join()
    assert errors == []
    assert seen and all(len(d["rows"]) == 400 for d in seen)
    assert read_json(path)["i"] == 59 and [p.name for p in tmp_path.iterdir()] == [path.name]

    def failing_replace(src, dst):
        raise OSError("disk full")

    monkeypatch.setattr(os, "replace", failing_replace)
    with pytest.raises(OSError, match="disk full"):
        write_json(path, {"a": 1})
    assert [p.name for p in tmp_path.iterdir()] == [path.name] and read_json(path)["i"] == 59


def test_only_contiguous_float32_cpu_weights_and_positive_row_counts():
    with pytest.raises(ValueError, match="float32"):
        GemmGroup().gemm(torch.randn(10, 4, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="contiguous"):
        GemmGroup().gemm(torch.randn(4, 10).t())
    with pytest.raises(ValueError, match="positive"):
        GemmGroup([0])


@needs_packing
def test_a_lazy_group_packs_in_order_within_its_budget_and_stays_exact_meanwhile():
    torch.manual_seed(1)
    group = GemmGroup([8], lazy=True)
    weights = [torch.randn(300, 32) for _ in range(3)]
    gemms = [group.gemm(w) for w in weights]
    assert group.pending and all(not g.packs for g in gemms) and group.packed_bytes() == 0
    x = torch.randn(5, 32)
    for g, w in zip(gemms, weights):  # unpacked: the plain product
        torch.testing.assert_close(g(x), F.linear(x, w), rtol=1e-5, atol=1e-4)
    group.pack_pending(budget=0.0)  # at least one weight, in order
    assert list(gemms[0].packs) == [8] and not gemms[2].packs
    group.pack_pending(budget=float("inf"))
    assert not group.pending and all(list(g.packs) == [8] for g in gemms)
    assert group.packed_bytes() == sum(w.numel() * 4 for w in weights)
    for g, w in zip(gemms, weights):
        torch.testing.assert_close(g(x), F.linear(x, w), rtol=1e-5, atol=1e-4)
