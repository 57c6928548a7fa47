"""`swarm.client.rowpad`: padding a small batch's rows changes the speed of the product, never its rows' values."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from swarm.client.rowpad import RowPadding


def test_padded_and_plain_products_agree_and_the_choice_is_remembered():
    torch.manual_seed(0)
    weight, bias = torch.randn(3000, 64), torch.randn(3000)
    padding = RowPadding(multiple=16, min_rows=4, trials=2)
    for rows in (4, 7, 8, 13):
        x = torch.randn(rows, 64)
        reference = F.linear(x, weight, bias)
        first = padding.linear(x, weight, bias)  # times both ways, records the faster
        assert rows in padding.pad
        torch.testing.assert_close(first, reference, rtol=1e-5, atol=1e-4)
        for choice in (False, True):  # whichever was chosen, the rows are the same
            padding.pad[rows] = choice
            out = padding.linear(x, weight, bias)
            assert out.shape == (rows, 3000) and out.is_contiguous()
            torch.testing.assert_close(out, reference, rtol=1e-5, atol=1e-4)


def test_few_rows_and_full_multiples_are_never_padded_or_timed():
    padding = RowPadding(multiple=16, min_rows=4)
    weight = torch.randn(100, 8)
    for rows in (1, 3, 16, 32):
        out = padding.linear(torch.randn(rows, 8), weight)
        assert out.shape == (rows, 100)
    assert padding.pad == {}


def test_calibrate_times_every_row_count_it_may_pad():
    padding = RowPadding(multiple=8, min_rows=3, trials=1)
    padding.calibrate(torch.randn(500, 32))
    assert sorted(padding.pad) == [3, 4, 5, 6, 7]
    x = torch.randn(5, 32)
    weight = torch.randn(500, 32)
    torch.testing.assert_close(padding.linear(x, weight), F.linear(x, weight), rtol=1e-5, atol=1e-4)
