"""Weight-only int8 with a float scale per group of inputs (llama.cpp's Q8_0 layout), and
its product: a C++ kernel (q8_matmul.cpp) for the few rows of a decode step, the torch twin
(`matmul_reference`) for the rest and wherever the kernel does not build.

Quantization (`quantize`): for each output row and each group of GROUP consecutive inputs,
scale = max |w| / 127 and q = round(w / scale) in [-127, 127], as Q8_0 does (which stores
the scale as float16; here float32, 1/8 byte per weight more, so the scale itself is not
rounded). Resident bytes: 1 + 4/GROUP per weight, 0.56x bfloat16's with groups of 32.

Products: with AVX512-VNNI, or AVX2 and FMA, and groups of 32 the kernel rounds a decode
batch's activations to int8 per group as llama.cpp's Q8_0 products do (`round_activations`;
its integer dot products read the weights ~1.3x faster at one row and ~1.6x at eight than
converting them to float32 with AVX512, more with AVX2's 8 float lanes): on the mid model
that costs 1.33x the weight-only error in mean |delta logprob|, within the 1.5x of a
weight-only Q8_0 emulation allowed (bench/int8_accuracy.py, its 16-token-steps variant).
Prefill (more rows than the kernel takes) keeps float activations against the dequantized
weight.

The kernel is built at first use like cpu_decode's (kernels/cpp_build.py); without a
compiler `load()` returns None, logged once, and every product runs the twin, which
dequantizes the weight (correct, not fast).
"""

from __future__ import annotations

import ctypes
from pathlib import Path

import torch

from kvsession.kernels import bf16_rows
from kvsession.kernels.cpp_build import CtypesKernel, OpKind, TorchOp

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


ROUNDS = CtypesKernel(KERNEL.source, "kvs_q8_rounds_activations", [], ctypes.c_int,
                      "the int8 product kernel", "int8 projections dequantize their weights")


def load():
    """The kernel's entry point (ctypes), built if needed; None when it cannot be."""
    return KERNEL.get()


def rounds_activations(group: int) -> bool:
    """Whether the kernel rounds x to int8 (`round_activations`) for weights of `group`:
    groups of 32 on a CPU with AVX512-VNNI or AVX2 and FMA (q8_matmul.cpp's header says
    why)."""
    fn = ROUNDS.get()
    return group == GROUP and fn is not None and fn() == 1


def round_activations(x: torch.Tensor, group: int = GROUP) -> torch.Tensor:
    """x [rows, in] rounded as the kernel's integer paths round it (llama.cpp's Q8_0 rule for
    activations): per group of inputs, d = max |x| / 127 and x ~ round(x / d) * d (halves
    to even), in float32."""
    rows, inp = x.shape
    g = x.float().reshape(rows, inp // group, group)
    d = g.abs().amax(-1, keepdim=True) / 127
    inv = torch.where(d > 0, 127 / g.abs().amax(-1, keepdim=True), torch.zeros_like(d))
    return (torch.round(g * inv) * d).reshape(rows, inp)


def group_for(in_features: int) -> int:
    """The group size for a weight with `in_features` inputs: GROUP, or 64, or (a width no
    group divides) the whole row: one scale per output channel."""
    return next((g for g in GROUPS if in_features % g == 0), in_features)


# quantize's rows per pass: ~this many weights, whose float32 temporaries (the widened
# weight, its magnitudes, the quotients) stay in L2. Over whole weights each of those
# passes went to DRAM: 29 ms for a 6,144 x 1,024 bf16 weight against 3.8-6 ms in chunks of
# 2^16-2^20 weights (bench VM), ~3 s -> ~0.6 s of loading Qwen3-0.6B as int8.
QUANTIZE_CHUNK_WEIGHTS = 1 << 18


def quantize(w: torch.Tensor | list[torch.Tensor], group: int
             ) -> tuple[torch.Tensor, torch.Tensor]:
    """(q [out, in] int8, scale [out, in / group] float32) with w ~ q * scale per group.
    `w` [out, in], or a list of such stacked along out (a fused q/k/v), quantized part by
    part into the one result: no float copy of the whole is made."""
    parts = w if isinstance(w, list) else [w]
    inp = parts[0].shape[1]
    out = sum(p.shape[0] for p in parts)
    q = torch.empty(out, inp, dtype=torch.int8, device=parts[0].device)
    scale = torch.empty(out, inp // group, dtype=torch.float32, device=parts[0].device)
    step = max(1, QUANTIZE_CHUNK_WEIGHTS // inp)
    row = 0  # q's and scale's rows written so far
    for part in parts:
        for start in range(0, part.shape[0], step):  # rows: the same per row
            g = part[start:start + step].float().reshape(-1, inp // group, group)
            s = (g.abs().amax(dim=-1) / 127).clamp_min(1e-12)
            end = row + g.shape[0]
            scale[row:end] = s
            q[row:end] = torch.round(g / s[..., None]).clamp_(-127, 127).reshape(-1, inp)
            row = end
    return q, scale


def dequantize(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The weight [out, in] (or rows of it) in `dtype`."""
    out, inp = q.shape
    groups = scale.shape[-1]
    return (q.reshape(out, groups, inp // groups).float() * scale[..., None]).reshape(
        out, inp).to(dtype)


def matmul_reference(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor,
                     rounded: bool = False) -> torch.Tensor:
    """x [rows, in] @ W^T in x's dtype: the weight dequantized; with `rounded`, x first
    rounded as the kernel's integer paths do (`round_activations`): the kernel's torch twin.
    Prefill (more rows than the kernel takes) runs it unrounded: a dense float product,
    compute-bound, where rounding x would only lose accuracy."""
    if rounded:
        x = round_activations(x, x.shape[1] // scale.shape[1]).to(x.dtype)
    if bf16_rows.converts(x):  # no bfloat16 GEMM here: in float32, a chunk of W at a time
        return bf16_rows.float32_chunks(
            x, q.shape[0], lambda s: dequantize(q[s], scale[s], torch.float32)).to(x.dtype)
    return x @ dequantize(q, scale, x.dtype).t()


def matmul(fn, x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """x [rows, in] @ W^T in x's dtype, by the kernel `fn` (from `load`) for up to
    KERNEL_MAX_ROWS rows of a supported group size, else by the twin."""
    rows, inp = x.shape
    group = inp // scale.shape[1]
    if fn is None or not 1 <= rows <= KERNEL_MAX_ROWS or group not in GROUPS \
            or x.device.type != "cpu":
        return matmul_reference(x, q, scale)
    xf = x if x.dtype == torch.float32 and x.is_contiguous() else x.float().contiguous()
    y = torch.empty(rows, q.shape[0], dtype=torch.float32)
    if fn(q.data_ptr(), scale.data_ptr(), xf.data_ptr(), rows, inp, q.shape[0], group,
          y.data_ptr(), torch.get_num_threads()):
        raise ValueError(f"the int8 kernel refused rows={rows}, in={inp}, group={group}")
    return y if x.dtype == torch.float32 else y.to(x.dtype)


# The product as an op that compiled code calls (model/onerow.py's one-token regions for an
# int8 model): x [rows, in] (1 to KERNEL_MAX_ROWS rows) @ W^T in x's dtype. Its C++
# implementation is q8_matmul_op.cpp (`register_op`).
_LIBRARY = torch.library.Library("kvsession", "FRAGMENT")
_LIBRARY.define("q8_matmul(Tensor x, Tensor q, Tensor scale) -> Tensor")


def _op(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """The op's implementation in Python (where q8_matmul_op.cpp could not be built)."""
    return matmul(load(), x, q, scale)


OP = TorchOp(_LIBRARY, "q8_matmul", Path(__file__).with_name("q8_matmul_op.cpp"),
             Path(__file__).with_name("q8_matmul.cpp"), _op, "the int8 product op")


def register_op() -> OpKind:
    """Give kvsession::q8_matmul its CPU implementation, once per process: C++ where it
    builds, else `_op` (cpp_build.TorchOp). Returns which."""
    return OP.register()


@torch.library.register_fake("kvsession::q8_matmul")
def _(x, q, scale):
    return x.new_empty(x.shape[0], q.shape[0])
