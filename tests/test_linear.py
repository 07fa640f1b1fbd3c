"""The CPU projection formats give the plain product, and a format oneDNN cannot pack on this
CPU (float16 needs avx512_fp16) falls back to the plain layout instead of failing the load."""

import pytest
import torch

from kvsession.model import linear
from kvsession.model.linear import Linear, measure_one_row


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("fmt", ["float", "onednn", "both"])
@pytest.mark.parametrize("rows", [1, 3, 80])
def test_formats_match_the_plain_product(dtype, fmt, rows):
    g = torch.Generator().manual_seed(rows)
    parts = [torch.randn(48, 32, generator=g).to(dtype) for _ in range(2)]
    x = torch.randn(rows, 32, generator=g).to(dtype)
    y = Linear(parts, None, fmt)(x)
    want = x.float() @ torch.cat(parts).float().t()
    assert y.shape == (rows, 96) and y.dtype == dtype
    tol = 1e-4 if dtype == torch.float32 else 0.2
    assert (y.float() - want).abs().max().item() < tol


def test_measured_one_row_kernel_is_set_on_every_both_projection_and_exact_either_way(
        monkeypatch):
    g = torch.Generator().manual_seed(0)
    both = [Linear(torch.randn(64, 32, generator=g), None, "both") for _ in range(3)]
    plain = Linear(torch.randn(64, 32, generator=g), None, "float")
    assert measure_one_row(both + [plain]) is False  # cache-sized weights: MKL, no timing
    monkeypatch.setattr(linear, "MEASURE_MIN_BYTES", 0)
    choice = measure_one_row(both + [plain])
    assert all(lin.one_row_packed is choice for lin in both)
    assert plain.one_row_packed is False  # a single layout has nothing to choose
    x = torch.randn(1, 32, generator=g)
    for packed in (False, True):  # whichever the machine picks, the product is the same
        both[0].one_row_packed = packed
        want = x @ both[0].weight.t()
        assert (both[0](x) - want).abs().max().item() < 1e-5
