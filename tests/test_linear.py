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


def test_pack_rows_lays_the_one_row_weights_out_in_one_buffer_in_the_given_order():
    """Each "both" projection's rows move into one allocation, in the order given, each on
    a page of its own start; the products are unchanged; other formats are left alone."""
    g = torch.Generator().manual_seed(1)
    both = [Linear([torch.randn(48, 32, generator=g) for _ in range(2)], None, "both"),
            Linear(torch.randn(17, 40, generator=g), None, "both"),
            Linear(torch.randn(64, 32, generator=g), None, "both")]
    plain = Linear(torch.randn(64, 32, generator=g), None, "float")
    x = [torch.randn(1, lin.weight.shape[1], generator=g) for lin in both]
    want = [lin(xi) for lin, xi in zip(both, x, strict=True)]
    order = [both[2], plain, both[0], both[1]]
    linear.pack_rows(order)
    storages = {lin.rows.untyped_storage().data_ptr() for lin in both}
    assert len(storages) == 1
    starts = [lin.rows.data_ptr() for lin in (both[2], both[0], both[1])]
    assert starts == sorted(starts)  # the given order
    assert all(p % linear.ROWS_ALIGN_BYTES == starts[0] % linear.ROWS_ALIGN_BYTES
               for p in starts)
    assert all(lin.rows.is_contiguous() for lin in both) and plain.rows is None
    for lin, xi, w in zip(both, x, want, strict=True):
        assert torch.equal(lin(xi), w)


def test_a_models_one_row_weights_are_one_buffer_in_decode_order(model_dirs):
    from kvsession.model.config import load_model_spec
    from kvsession.model.llama import LlamaModel
    from kvsession.model.loader import load_weights

    d = model_dirs("llama")
    spec = load_model_spec(d)
    model = LlamaModel(spec, load_weights(d, spec, torch.float32, torch.device("cpu")), 64,
                       "both")
    order = [lin for lw in model.layers for lin in (lw.qkv, lw.o, lw.gate_up, lw.down)]
    starts = [lin.rows.data_ptr() for lin in order + [model.lm_head]]
    assert starts == sorted(starts)
    assert len({lin.rows.untyped_storage().data_ptr() for lin in model.projections()}) == 1


def test_packed_rows_spanning_a_huge_page_start_on_one_in_an_advised_mapping():
    """On Linux the packed buffer is a huge-page tensor (host_memory): the first weight
    starts on a 2 MiB boundary of a mapping advised MADV_HUGEPAGE; products unchanged."""
    import mmap
    import sys

    from test_host_memory import vm_flags

    from kvsession.host_memory import HUGE_PAGE_BYTES

    if not sys.platform.startswith("linux") or not hasattr(mmap, "MADV_HUGEPAGE"):
        pytest.skip("MADV_HUGEPAGE is Linux's")
    g = torch.Generator().manual_seed(2)
    lins = [Linear(torch.randn(1024, 512, generator=g), None, "both") for _ in range(2)]
    x = torch.randn(1, 512, generator=g)
    want = [lin(x) for lin in lins]
    linear.pack_rows(lins)
    assert lins[0].rows.data_ptr() % HUGE_PAGE_BYTES == 0
    assert "hg" in vm_flags(lins[1].rows.data_ptr())
    assert all(torch.equal(lin(x), w) for lin, w in zip(lins, want, strict=True))
