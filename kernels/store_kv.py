"""Triton kernel: write new K/V into their cache slots, quantizing to fp8 with one scale per
token per KV head in the same pass (scale = absmax / 448 over the finite values, stored as
float16; values are divided by the stored scale; NaN -> 0, +-Inf saturates).

Layout (one layer): cache `[num_blocks, block_size, num_kv_heads, head_dim]`, scales
`[num_blocks, block_size, num_kv_heads]`; slot = block_id * block_size + offset (int64).
Slots < 0 are skipped. Twin: `reference.store_kv`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvsession.kernels.checks import check, check_cache, next_pow2

FP8_MAX = 448.0


@triton.jit
def _round_e4m3(x):
    """Round float32 x (|x| <= 448) to the nearest e4m3 value, ties to even, in float32, so
    the final cast is exact on every backend (the Triton interpreter's own fp8 conversion
    mis-rounds values that round up into the next power of two)."""
    bits = x.to(tl.int32, bitcast=True)
    e = ((bits >> 23) & 0xFF) - 127
    e = tl.maximum(e, -6)  # below 2^-6, e4m3 is subnormal with a fixed step of 2^-9
    step = ((e - 3 + 127) << 23).to(tl.float32, bitcast=True)
    y = x / step
    r = tl.floor(y + 0.5)
    odd = (r - 2.0 * tl.floor(r * 0.5)) == 1.0
    r = tl.where((r - y == 0.5) & odd, r - 1.0, r)
    return r * step


@triton.jit
def _store_kv(key, value, k_cache, v_cache, k_scale, v_scale, slots,
              num_kv_heads, head_dim, stride_t, stride_h,
              FP8: tl.constexpr, BLOCK_D: tl.constexpr):
    t = tl.program_id(0)
    h = tl.program_id(1)
    slot = tl.load(slots + t).to(tl.int64)
    d = tl.arange(0, BLOCK_D)
    # a vector compare: a scalar mask breaks the Triton interpreter
    dm = (d < head_dim) & ((slot + d * 0) >= 0)
    src = t.to(tl.int64) * stride_t + h * stride_h + d
    dst = (slot * num_kv_heads + h) * head_dim + d
    k = tl.load(key + src, mask=dm, other=0.0).to(tl.float32)
    v = tl.load(value + src, mask=dm, other=0.0).to(tl.float32)
    if FP8:
        sdst = slot * num_kv_heads + h
        for which in tl.static_range(2):
            x = k if which == 0 else v
            finite = tl.abs(x) < float("inf")
            amax = tl.max(tl.where(finite, tl.abs(x), 0.0), axis=0)
            scale = tl.minimum(tl.maximum(amax / 448.0, 5.960464477539063e-08), 65504.0)
            scale16 = scale.to(tl.float16)
            q = x / scale16.to(tl.float32)
            q = tl.where(x != x, 0.0, q)  # NaN -> 0
            q = _round_e4m3(tl.minimum(tl.maximum(q, -448.0), 448.0))
            if which == 0:
                tl.store(k_cache + dst, q.to(k_cache.dtype.element_ty), mask=dm)
                tl.store(k_scale + sdst + d * 0, scale16 + tl.zeros_like(q).to(tl.float16),
                         mask=dm & (d == 0))
            else:
                tl.store(v_cache + dst, q.to(v_cache.dtype.element_ty), mask=dm)
                tl.store(v_scale + sdst + d * 0, scale16 + tl.zeros_like(q).to(tl.float16),
                         mask=dm & (d == 0))
    else:
        tl.store(k_cache + dst, k.to(k_cache.dtype.element_ty), mask=dm)
        tl.store(v_cache + dst, v.to(v_cache.dtype.element_ty), mask=dm)


def store_kv(key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor,
             v_cache: torch.Tensor, slot_mapping: torch.Tensor,
             k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None) -> None:
    """key/value `[num_tokens, num_kv_heads, head_dim]` into the slots of `slot_mapping`."""
    check_cache(k_cache, v_cache, k_scale, v_scale)
    num_tokens, num_kv_heads, head_dim = key.shape
    check(value.shape == key.shape, f"value shape {tuple(value.shape)} != key {tuple(key.shape)}")
    check(k_cache.shape[2:] == (num_kv_heads, head_dim),
          f"cache heads/dim {tuple(k_cache.shape[2:])} != key {(num_kv_heads, head_dim)}")
    check(slot_mapping.shape == (num_tokens,) and slot_mapping.dtype == torch.long,
          "slot_mapping must be int64 [num_tokens]")
    check(key.stride(2) == 1 and value.stride() == key.stride(),
          "key/value need a unit stride on head_dim and equal strides")
    if num_tokens == 0:
        return
    fp8 = k_scale is not None
    dummy = k_scale if fp8 else k_cache
    _store_kv[(num_tokens, num_kv_heads)](
        key, value, k_cache, v_cache, dummy, v_scale if fp8 else dummy, slot_mapping,
        num_kv_heads, head_dim, key.stride(0), key.stride(1),
        FP8=fp8, BLOCK_D=next_pow2(head_dim))
