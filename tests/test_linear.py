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


def test_a_rows_buffer_lays_the_one_row_weights_out_in_build_order_fused_in_place():
    """Each "both" or "rows" projection built with a RowsBuffer writes its rows (fused parts
    side by side) into the one allocation, in the order built, each on a page of its own
    start; the products equal those of the same weights kept apart; other formats take no
    room; a part that does not fit is refused."""
    g = torch.Generator().manual_seed(1)
    weights = [[torch.randn(48, 32, generator=g) for _ in range(2)],
               [torch.randn(17, 40, generator=g)], [torch.randn(64, 32, generator=g)]]
    formats = ["both", "rows", "both"]
    apart = [Linear(list(w), None, f) for w, f in zip(weights, formats, strict=True)]
    buffer = linear.RowsBuffer([t.numel() for w in weights for t in w], torch.float32)
    both = [Linear(list(weights[0]), None, formats[0], rows_buffer=buffer),
            Linear(list(weights[1]), None, formats[1], rows_buffer=buffer)]
    plain = Linear(torch.randn(64, 32, generator=g), None, "float", rows_buffer=buffer)
    both.append(Linear(list(weights[2]), None, formats[2], rows_buffer=buffer))
    assert len({lin.rows.untyped_storage().data_ptr() for lin in both}) == 1
    starts = [lin.rows.data_ptr() for lin in both]
    assert starts == sorted(starts)  # the order built
    assert all(p % linear.ROWS_ALIGN_BYTES == starts[0] % linear.ROWS_ALIGN_BYTES
               for p in starts)
    assert all(lin.rows.is_contiguous() for lin in both) and plain.rows is None
    assert torch.equal(both[0].rows, torch.cat(weights[0]))
    for lin, ref in zip(both, apart, strict=True):
        x = torch.randn(3, ref.rows.shape[1], generator=g)
        assert torch.equal(lin.rows, ref.rows) and torch.equal(lin(x), ref(x))
    with pytest.raises(ValueError, match="no room"):
        buffer.take([torch.randn(64, 32)])
    with pytest.raises(ValueError, match="one width"):
        linear.RowsBuffer([64], torch.float32).take([torch.randn(2, 32).double()])


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
    ws = [torch.randn(1024, 512, generator=g) for _ in range(2)]
    x = torch.randn(1, 512, generator=g)
    want = [Linear(w, None, "both")(x) for w in ws]
    buffer = linear.RowsBuffer([w.numel() for w in ws], torch.float32)
    lins = [Linear(w, None, "both", rows_buffer=buffer) for w in ws]
    assert lins[0].rows.data_ptr() % HUGE_PAGE_BYTES == 0
    assert "hg" in vm_flags(lins[1].rows.data_ptr())
    assert all(torch.equal(lin(x), w) for lin, w in zip(lins, want, strict=True))
