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
import logging
import threading
from pathlib import Path

import torch

from kvsession.kernels.cpp_build import build, cache_dir, compiler, library_path

log = logging.getLogger("kvsession")

SOURCE = Path(__file__).with_name("q8_matmul.cpp")
COMPILE_FLAGS = ["-O3", "-march=native", "-ffast-math", "-fopenmp", "-fPIC", "-std=c++17",
                 "-c"]
LINK_FLAGS = ["-shared", "-fopenmp"]
GROUP = 32  # Q8_0's block
GROUPS = (32, 64)  # what the kernel is built for
# rows the kernel takes per call (q8_matmul.cpp's MAX_ROWS): a decode batch. Larger ones
# (prefill) are compute-bound, where dequantizing once and one dense product is faster.
KERNEL_MAX_ROWS = 16

_lock = threading.Lock()
_loaded: dict[tuple, object] = {}


def load():
    """The kernel's entry point (ctypes), built if needed; None when it cannot be (logged
    once per compiler and cache directory)."""
    cxx, directory = compiler(), cache_dir()
    key = (cxx, str(directory))
    fn = _loaded.get(key, _lock)
    if fn is not _lock:
        return fn
    with _lock:
        if key not in _loaded:
            _loaded[key] = _build_and_load(cxx, directory)
        return _loaded[key]


def _build_and_load(cxx: str | None, directory):
    if cxx is None:
        log.warning("the int8 product kernel is not used: no C++ compiler found (set CXX); "
                    "int8 projections dequantize their weights (slow)")
        return None
    lib = library_path(cxx, directory, "q8_matmul", [SOURCE], COMPILE_FLAGS + LINK_FLAGS)
    errors: list[str] = []
    try:
        if not lib.is_file():
            build(cxx, lib, errors, SOURCE, COMPILE_FLAGS, LINK_FLAGS)
        fn = ctypes.CDLL(str(lib)).kvs_q8_matmul
    except (OSError, AttributeError) as e:
        errors.append(str(e))
        log.warning("the int8 product kernel is not used (building it with %s into %s "
                    "failed: %s); int8 projections dequantize their weights (slow)", cxx,
                    directory, " | ".join(errors))
        return None
    P, I64 = ctypes.c_void_p, ctypes.c_int64
    fn.argtypes = [P, P, P, I64, I64, I64, I64, P, ctypes.c_int]
    fn.restype = ctypes.c_int
    return fn


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
