"""`swarm.modeling.int8_rows`: one LLM.int8() call over several sessions' rows gives each session, bit for bit, what
bitsandbytes' `Linear8bitLt` gives its rows in a call of their own (and what one plain call over all rows does not)."""
from __future__ import annotations

import pytest
import torch

from swarm.modeling import int8_rows
from swarm.modeling.int8_rows import RowGroups, grouped_linear, row_groups
from swarm.modeling.quantize import quantized_linear


def _module(out_features: int, in_features: int, bias: bool, seed: int):
    generator = torch.Generator().manual_seed(seed)
    weight = torch.randn(out_features, in_features, generator=generator) * 0.05
    return quantized_linear(weight, torch.randn(out_features, generator=generator) if bias else None, "int8",
                            torch.float32, torch.device("cpu"))


def _rows(sizes, in_features: int, seed: int) -> torch.Tensor:
    """Rows of sessions of `sizes`: group 0 without outliers (every |x| < 6), the others with outliers in columns of
    their own (group g: g + 1 columns, in some rows of the group only), some columns shared by two groups."""
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(sum(sizes), in_features, generator=generator).clamp(-4, 4)
    row = sizes[0]
    for g, size in enumerate(sizes[1:], start=1):
        columns = torch.randperm(in_features, generator=generator)[:g + 1]
        columns[0] = 17  # a column two groups share
        x[row, columns] = 25.0 * torch.randn(g + 1, generator=generator).sign()
        if size > 1:  # another row of the group: an outlier in one more column, only there
            x[row + size - 1, (5 * g) % in_features] = -40.0
        row += size
    return x


@pytest.mark.parametrize("shape", [(960, 576, True), (3072, 576, False), (576, 1536, False)])
@pytest.mark.parametrize("sizes", [[1] * 16, [1, 3, 1, 5, 2], [4, 4, 4]])
def test_each_group_equals_its_rows_alone_bit_for_bit(shape, sizes):
    out_features, in_features, bias = shape
    module = _module(out_features, in_features, bias, seed=len(sizes))
    x = _rows(sizes, in_features, seed=sum(sizes))
    groups = RowGroups(sizes)
    outliers = [set(torch.nonzero((x[r0:r1].half().abs() >= 6).any(0)).view(-1).tolist()) for r0, r1 in groups.bounds]
    assert not outliers[0] and all(outliers[1:]) and len({frozenset(o) for o in outliers}) == len(sizes)
    with torch.inference_mode():
        alone = torch.cat([module(x[r0:r1]) for r0, r1 in groups.bounds])  # [rows, out]
        merged = grouped_linear(module, x, groups)
        as_3d = grouped_linear(module, x[None], groups)  # [1, rows, in]: a prefill's shape
        plain = module(x)  # one call over all rows: every group's outlier columns apply to all
    assert torch.equal(merged, alone)
    assert torch.equal(as_3d[0], alone)
    assert not torch.equal(plain, alone)  # (what grouping prevents)


def test_linear_groups_only_inside_row_groups_and_checks_rows():
    module = _module(96, 64, False, seed=1)
    x = _rows([1, 1, 2], 64, seed=2)
    with torch.inference_mode():
        assert torch.equal(int8_rows.linear(module, x), module(x))  # no groups set: the module's own call
        with row_groups([4]):  # one group: the module's own call
            assert torch.equal(int8_rows.linear(module, x), module(x))
        with row_groups([1, 1, 2]):
            assert torch.equal(int8_rows.linear(module, x), torch.cat([module(x[:1]), module(x[1:2]), module(x[2:])]))
            with pytest.raises(ValueError, match="row groups of 4 rows, but the call has 3"):
                int8_rows.linear(module, x[:3])
        assert int8_rows._GROUPS.get() is None
    with pytest.raises(ValueError, match="at least 1 row"):
        RowGroups([2, 0])
