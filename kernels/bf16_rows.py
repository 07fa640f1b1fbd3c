"""The product of a decode step's few rows with bfloat16 weights kept as `[out, in]` rows
(a tied output head): a C++ kernel (bf16_rows.cpp; why, in its header), `F.linear`
where it does not build or the rows do not fit it."""

from __future__ import annotations

import ctypes
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

from kvsession.kernels.cpp_build import CtypesKernel, OpKind, TorchOp

KERNEL_MAX_ROWS = 16  # bf16_rows.cpp's MAX_ROWS
_P, _I64 = ctypes.c_void_p, ctypes.c_int64
KERNEL = CtypesKernel(Path(__file__).with_name("bf16_rows.cpp"), "kvs_bf16_matmul",
                      [_P, _P, _I64, _I64, _I64, _P, ctypes.c_int], ctypes.c_int,
                      "the bfloat16 rows kernel", "a tied head's decode product runs F.linear")


NATIVE = CtypesKernel(Path(__file__).with_name("bf16_rows.cpp"), "kvs_bf16_native", [],
                      ctypes.c_int, "the bfloat16 rows kernel",
                      "bfloat16 projections keep oneDNN's packed layout")


def load():
    """The kernel's entry point (ctypes), built if needed; None when it cannot be."""
    return KERNEL.get()


def native() -> bool:
    """Whether the kernel builds here with vector products: AVX512-BF16, or AVX2 and FMA
    (its portable loop converts element by element and runs several times slower than
    oneDNN's packed layout)."""
    fn = NATIVE.get()
    return fn is not None and fn() == 1


def applies(w: torch.Tensor) -> bool:
    """Whether the kernel can take weight `w` (bfloat16 rows on the CPU, inputs a multiple
    of 32, contiguous)."""
    return (w.dtype == torch.bfloat16 and w.device.type == "cpu" and w.dim() == 2
            and w.shape[1] % 32 == 0 and w.is_contiguous())


def _mkldnn_supports(probe: str) -> bool:
    """torch.ops.mkldnn.<probe>() (whether oneDNN multiplies a 16-bit float type at speed on
    this CPU); False on a build without oneDNN."""
    try:
        return bool(getattr(torch.ops.mkldnn, probe)())
    except (AttributeError, RuntimeError):
        return False


# Whether ATen multiplies bfloat16 matrices at speed here: oneDNN's bfloat16 GEMM needs
# AVX512 (BW/VL) or AMX. Without it (AVX2 machines) F.linear on bfloat16 ran ~7.6 GFLOP/s at
# a 512-row prefill on the AVX2 bench VM, where the same product converted to float32 ran
# ~38 (conversion included): `dense` converts there.
BF16_GEMM = _mkldnn_supports("_is_mkldnn_bf16_supported")
# ... and float16 (AVX512-FP16 or AMX-FP16): config.py computes a float16 checkpoint in
# bfloat16 without it
FP16_GEMM = _mkldnn_supports("_is_mkldnn_fp16_supported")
# Output rows of w converted to float32 at a time by `dense` (x [rows, in] @ w^T without a
# bfloat16 GEMM): 4 MiB of float32 per chunk, so that a large head (152k x 1024) is not
# copied whole (~0.6 GB) for one product.
CONVERT_CHUNK_BYTES = 4 << 20


def converts(x: torch.Tensor) -> bool:
    """Whether a product with `x` [rows, in] should be made in float32 (`float32_chunks`):
    x is bfloat16 on a CPU without a bfloat16 GEMM (`BF16_GEMM`)."""
    return not BF16_GEMM and x.dtype == torch.bfloat16 and x.device.type == "cpu"


def float32_chunks(x: torch.Tensor, out: int, rows_of: Callable[[slice], torch.Tensor],
                   bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [rows, in] @ W^T (+ bias) in float32, W [out, in] made float32 CONVERT_CHUNK_BYTES
    at a time: `rows_of(s)` returns W[s] in float32 (a slice of bfloat16 rows converted, or
    of int8 ones dequantized). The products of two bfloat16 values are exact in float32, as
    in a bfloat16 GEMM; only the sums' order and rounding differ."""
    xf = x.float()
    y = torch.empty(x.shape[0], out, dtype=torch.float32)
    step = max(1, CONVERT_CHUNK_BYTES // (4 * x.shape[1]))
    for o in range(0, out, step):
        s = slice(o, min(o + step, out))
        torch.mm(xf, rows_of(s).t(), out=y[:, s])
    if bias is not None:
        y += bias
    return y


def dense(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [rows, in] @ w^T (+ bias) in x's dtype for any number of rows: F.linear, except
    where that would be a bfloat16 GEMM the CPU lacks (`converts`): then in float32,
    `float32_chunks` of w's rows."""
    if not converts(x) or w.dtype != torch.bfloat16:
        return F.linear(x, w, bias)
    return float32_chunks(x, w.shape[0], lambda s: w[s].float(), bias).to(x.dtype)


def matmul(fn, x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None
           ) -> torch.Tensor:
    """x [rows, in] @ w^T (+ bias) in x's dtype: the kernel `fn` (from `load`) for up to
    KERNEL_MAX_ROWS rows of a weight it `applies` to, else `dense`."""
    rows = x.shape[0]
    if fn is None or not 1 <= rows <= KERNEL_MAX_ROWS:
        return dense(x, w, bias)
    xb = x if x.dtype == torch.bfloat16 and x.is_contiguous() else \
        x.to(torch.bfloat16).contiguous()
    y = torch.empty(rows, w.shape[0], dtype=torch.float32)
    if fn(w.data_ptr(), xb.data_ptr(), rows, w.shape[1], w.shape[0], y.data_ptr(),
          torch.get_num_threads()):
        raise ValueError(f"the bfloat16 rows kernel refused rows={rows}, in={w.shape[1]}")
    if bias is not None:
        y += bias
    return y.to(x.dtype)


# The product as an op that compiled code calls (model/onerow.py's one-token regions for a
# bfloat16 model): x [rows, in] (1 to KERNEL_MAX_ROWS rows) @ w^T in x's dtype, w bfloat16
# [out, in] rows. Its C++ implementation is bf16_rows_op.cpp (`register_op`).
_LIBRARY = torch.library.Library("kvsession", "FRAGMENT")
_LIBRARY.define("bf16_rows_matmul(Tensor x, Tensor w) -> Tensor")


def _op(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """The op's implementation in Python (where bf16_rows_op.cpp could not be built)."""
    return matmul(load(), x, w)


OP = TorchOp(_LIBRARY, "bf16_rows_matmul", Path(__file__).with_name("bf16_rows_op.cpp"),
             Path(__file__).with_name("bf16_rows.cpp"), _op, "the bfloat16 rows op")


def register_op() -> OpKind:
    """Give kvsession::bf16_rows_matmul its CPU implementation, once per process: C++ where
    it builds, else `_op` (cpp_build.TorchOp). Returns which."""
    return OP.register()


@torch.library.register_fake("kvsession::bf16_rows_matmul")
def _(x, w):
    return x.new_empty(x.shape[0], w.shape[0])
