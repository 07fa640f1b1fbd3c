"""Inputs for kernel checks, shared by test_kernels.py (interpreter) and gpu_checks.py
(compiled, on a GPU): random paged caches and block tables."""

from __future__ import annotations

import torch

from kvsession.kernels import reference as R

FP8 = torch.float8_e4m3fn


def make_cache(dtype, num_blocks, block_size, num_kv_heads, head_dim, seed=0):
    g = torch.Generator().manual_seed(seed)
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k, v = torch.randn(shape, generator=g), torch.randn(shape, generator=g)
    if dtype == FP8:
        (qk, sk), (qv, sv) = R.quantize_fp8(k), R.quantize_fp8(v)
        return qk, qv, sk, sv
    return k.to(dtype), v.to(dtype), None, None


def tables_for(lens, block_size, max_blocks, num_blocks, seed=0, high=False):
    """Block tables with -1 padding; blocks drawn at random (or from the top of the pool)."""
    g = torch.Generator().manual_seed(seed)
    pool = torch.randperm(num_blocks, generator=g)
    if high:
        pool = torch.arange(num_blocks - 1, -1, -1)
    tables = torch.full((len(lens), max_blocks), -1, dtype=torch.long)
    used = 0
    for i, n in enumerate(lens):
        nb = -(-n // block_size)
        tables[i, :nb] = pool[used:used + nb]
        used += nb
    return tables
