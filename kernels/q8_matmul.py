"""Weight-only int8 with a float scale per group of inputs (llama.cpp's Q8_0 layout), and
its product: a C++ kernel (q8_matmul.cpp) for the few rows of a decode step, the torch twin
(`matmul_reference`) for the rest and wherever the kernel does not build.

Quantization (`quantize`): for each output row and each group of GROUP consecutive inputs,
scale = max |w| / 127 and q = round(w / scale) in [-127, 127], as Q8_0 does (which stores
the scale as float16; here float32, 1/8 byte per weight more, so the scale itself is not
rounded). Resident bytes: 1 + 4/GROUP per weight, 0.56x bfloat16's with groups of 32.

The kernel is built at first use like cpu_decode's (kernels/cpp_build.py); without a
compiler `load()` returns None, logged once, and every product runs the twin, which
dequantizes the weight (correct, not fast).
"""

from __future__ import annotations

import ctypes
from pathlib import Path

import torch

from kvsession.kernels.cpp_build import CtypesKernel

GROUP = 32  # Q8_0's block
GROUPS = (32, 64)  # what the kernel is built for
# rows the kernel takes per call (q8_matmul.cpp's MAX_ROWS): a decode batch. Larger ones
# (prefill) are compute-bound, where dequantizing once and one dense product is faster.
KERNEL_MAX_ROWS = 16
_P, _I64 = ctypes.c_void_p, ctypes.c_int64
KERNEL = CtypesKernel(Path(__file__).with_name("q8_matmul.cpp"), "kvs_q8_matmul",
                      [_P, _P, _P, _I64, _I64, _I64, _I64, _P, ctypes.c_int], ctypes.c_int,
                      "the int8 product kernel",
                      "int8 projections dequantize their weights (slow)")


def load():
    """The kernel's entry point (ctypes), built if needed; None when it cannot be."""
    return KERNEL.get()


def group_for(in_features: int) -> int:
    """The group size for a weight with `in_features` inputs: GROUP, or 64, or (a width no
    group divides) the whole row: one scale per output channel."""
    return next((g for g in GROUPS if in_features % g == 0), in_features)


def quantize(w: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(q [out, in] int8, scale [out, in / group] float32) with w ~ q * scale per group."""
    out, inp = w.shape
    g = w.float().reshape(out, inp // group, group)
    scale = (g.abs().amax(dim=-1) / 127).clamp_min(1e-12)
    q = torch.round(g / scale[..., None]).clamp_(-127, 127).to(torch.int8)
    return q.reshape(out, inp).contiguous(), scale.contiguous()


def dequantize(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The weight [out, in] (or rows of it) in `dtype`."""
    out, inp = q.shape
    groups = scale.shape[-1]
    return (q.reshape(out, groups, inp // groups).float() * scale[..., None]).reshape(
        out, inp).to(dtype)


def matmul_reference(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """x [rows, in] @ W^T in x's dtype: the weight dequantized (the kernel's torch twin)."""
    return x @ dequantize(q, scale, x.dtype).t()


def matmul(fn, x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """x [rows, in] @ W^T in x's dtype, by the kernel `fn` (from `load`) for up to
    KERNEL_MAX_ROWS rows of a supported group size, else by the twin."""
    rows, inp = x.shape
    group = inp // scale.shape[1]
    if fn is None or rows > KERNEL_MAX_ROWS or group not in GROUPS or x.device.type != "cpu":
        return matmul_reference(x, q, scale)
    xf = x if x.dtype == torch.float32 and x.is_contiguous() else x.float().contiguous()
    y = torch.empty(rows, q.shape[0], dtype=torch.float32)
    if fn(q.data_ptr(), scale.data_ptr(), xf.data_ptr(), rows, inp, q.shape[0], group,
          y.data_ptr(), torch.get_num_threads()):
        raise ValueError(f"the int8 kernel refused rows={rows}, in={inp}, group={group}")
    return y if x.dtype == torch.float32 else y.to(x.dtype)
