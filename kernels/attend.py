"""The inner step both attention kernels share: one tile of keys through an online softmax.

A tile is TILE_N consecutive token positions of one sequence, independent of the cache's
block size: each position looks up its own block id (`table_row[pos // BLOCK_SIZE]`), so a
tile spans several blocks and the loads stay large enough to keep HBM busy even with
16-token blocks. Positions outside `pm` are never read (not even their block-table entry), so
-1 table padding past a sequence's length is harmless.

Precision: the dot products run in DOT_T, the query's compute dtype (bf16/fp16 tensor cores
on a GPU; float32 when the model or the cache is float32, with exact "ieee" products). fp8
blocks are converted to DOT_T as they load and their per-token scales are applied to the
fp32 results, not to every element: q.(s*k) = s*(q.k) for keys, and (p*s).v for values.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl


@triton.jit
def attend_tile(acc, m_i, l_i, qv, k_cache, v_cache, k_scale, v_scale, table_row, pos, pm,
                visible, d, dm, h, num_kv_heads, head_dim, qk_scale,
                BLOCK_SIZE: tl.constexpr, FP8: tl.constexpr, DOT_T: tl.constexpr,
                MASKED: tl.constexpr):
    """Returns the updated (acc [R, BLOCK_D] fp32, running max m_i [R], running sum l_i [R]),
    exponents in base 2 (qk_scale includes log2(e)).

    qv: [R, BLOCK_D] queries in DOT_T; pos: [TILE_N] key positions, pm: which exist;
    visible: [R, TILE_N] mask (used only when MASKED; rows may have no visible key, their
    m_i stays -inf and l_i 0)."""
    bid = tl.load(table_row + pos // BLOCK_SIZE, mask=pm, other=0).to(tl.int64)
    row = bid * BLOCK_SIZE + pos % BLOCK_SIZE  # slot index, int64: no overflow
    off = (row * num_kv_heads + h)[:, None] * head_dim + d[None, :]
    m2 = pm[:, None] & dm[None, :]
    k = tl.load(k_cache + off, mask=m2, other=0.0)
    if FP8:
        k = k.to(tl.float32)
    scores = tl.dot(qv, tl.trans(k.to(DOT_T)), input_precision="ieee")
    if FP8:
        ks = tl.load(k_scale + row * num_kv_heads + h, mask=pm, other=0.0).to(tl.float32)
        scores = scores * (ks * qk_scale)[None, :]
    else:
        scores = scores * qk_scale
    if MASKED:
        scores = tl.where(visible, scores, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(scores, axis=1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row with nothing visible yet
    alpha = tl.exp2(m_i - m_safe)
    p = tl.exp2(scores - m_safe[:, None])
    l_i = l_i * alpha + tl.sum(p, axis=1)
    v = tl.load(v_cache + off, mask=m2, other=0.0)
    if FP8:
        v = v.to(tl.float32)
        vs = tl.load(v_scale + row * num_kv_heads + h, mask=pm, other=0.0).to(tl.float32)
        p = p * vs[None, :]
    acc = acc * alpha[:, None] + tl.dot(p.to(DOT_T), v.to(DOT_T), input_precision="ieee")
    return acc, m_new, l_i


def dot_dtype(q_dtype, cache_dtype):
    """The Triton dtype of the dot products: float32 when the query or the cache is float32
    (exact products), else the query's half type. Under Triton's interpreter bf16 becomes
    float32: the interpreter multiplies bf16 tiles as raw 16-bit integers (triton-lang/triton
    #11584, "not supported yet"), while its fp16 dots are right, so fp16 is what the CPU
    tests run the half path with."""
    if q_dtype == torch.float32 or cache_dtype == torch.float32:
        return tl.float32
    if q_dtype == torch.bfloat16:
        return tl.float32 if os.environ.get("TRITON_INTERPRET") == "1" else tl.bfloat16
    return tl.float16


TILE_N = 64  # keys per tile: 16 KiB of bf16 K at head_dim 128, several blocks per load
