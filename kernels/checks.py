"""Argument checks shared by the kernel wrappers: everything is verified before a launch,
so a bad call is a clear error instead of a wrong result or a device fault."""

from __future__ import annotations

import torch

from kvsession.errors import ConfigError
from kvsession.kernels.reference import FP8_DTYPE, is_fp8

CACHE_DTYPES = (torch.float32, torch.bfloat16, torch.float16, FP8_DTYPE)


class KernelArgumentError(ConfigError):
    """A kernel wrapper was called with tensors of the wrong shape, dtype or layout (a
    KVSessionError like every error kvsession raises on purpose; also a ValueError)."""


def check(cond: bool, message: str) -> None:
    if not cond:
        raise KernelArgumentError(message)


def next_pow2(n: int) -> int:
    return 1 << max(0, (int(n) - 1).bit_length())


def check_cache(k_cache, v_cache, k_scale, v_scale) -> None:
    check(k_cache.dim() == 4, f"cache must be [num_blocks, block_size, heads, dim], got "
          f"{tuple(k_cache.shape)}")
    check(k_cache.shape == v_cache.shape and k_cache.dtype == v_cache.dtype,
          "k_cache and v_cache must match")
    check(k_cache.dtype in CACHE_DTYPES, f"unsupported cache dtype {k_cache.dtype}")
    check(k_cache.is_contiguous() and v_cache.is_contiguous(), "caches must be contiguous")
    fp8 = is_fp8(k_cache.dtype)
    check(fp8 == (k_scale is not None) == (v_scale is not None),
          "an fp8 cache needs k_scale and v_scale (and only an fp8 cache has them)")
    if fp8:
        check(k_scale.shape == k_cache.shape[:3] and v_scale.shape == k_cache.shape[:3],
              f"scales must be {tuple(k_cache.shape[:3])}")
        check(k_scale.dtype == torch.float16 and k_scale.is_contiguous()
              and v_scale.is_contiguous(), "scales must be contiguous float16")
