"""Triton kernels: decode attention over block tables (flash-decoding).

One query token per sequence. Pass 1 (`_decode_split`): program (sequence, KV head, split)
walks its share of the sequence's key tiles (`attend.attend_tile`: TILE_N positions, several
blocks per load) with an online softmax; the query heads of a GQA group are the rows of one
tile, so each KV byte is read once for the whole group. fp8 blocks are dequantized in the
load path with their per-token-head scales. With one split the program normalises and writes
the output itself; otherwise pass 2 (`_decode_reduce`) merges the splits by their
log-sum-exp. Block ids and offsets use int64, so block_id * stride cannot overflow; rows with
seq_len 0 (padding) give zeros; block-table entries past a sequence's length (-1 padding) are
never read. Twin: `reference.paged_attention`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvsession.kernels.attend import TILE_N, attend_tile, dot_dtype
from kvsession.kernels.checks import check, check_cache, next_pow2

LOG2E = 1.4426950408889634


@triton.jit
def _decode_split(q, k_cache, v_cache, k_scale, v_scale, block_tables, seq_lens, out,
                  part_acc, part_m, part_l, qk_scale, num_heads, num_kv_heads, head_dim,
                  table_stride, num_splits, tiles_per_split,
                  G: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_D: tl.constexpr,
                  BLOCK_SIZE: tl.constexpr, TILE: tl.constexpr, FP8: tl.constexpr,
                  DOT_T: tl.constexpr, DIRECT: tl.constexpr):
    s = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    sp = tl.program_id(2)
    seq_len = tl.load(seq_lens + s)
    g = tl.arange(0, BLOCK_G)
    d = tl.arange(0, BLOCK_D)
    n = tl.arange(0, TILE)
    gm = g < G
    dm = d < head_dim
    qh = h * G + g
    qv = tl.load(q + (s * num_heads + qh)[:, None] * head_dim + d[None, :],
                 mask=gm[:, None] & dm[None, :], other=0.0).to(DOT_T)
    m_i = tl.full((BLOCK_G,), float("-inf"), tl.float32)
    l_i = tl.zeros((BLOCK_G,), tl.float32)
    acc = tl.zeros((BLOCK_G, BLOCK_D), tl.float32)
    table_row = block_tables + s * table_stride
    first = sp * tiles_per_split
    last = tl.minimum(first + tiles_per_split, tl.cdiv(seq_len, TILE))
    for t in range(first, last):
        pos = t * TILE + n
        pm = pos < seq_len
        acc, m_i, l_i = attend_tile(acc, m_i, l_i, qv, k_cache, v_cache, k_scale, v_scale,
                                    table_row, pos, pm, pm[None, :], d, dm, h, num_kv_heads,
                                    head_dim, qk_scale, BLOCK_SIZE, FP8, DOT_T, True)
    if DIRECT:  # one split: this program has the whole row; seq_len 0 leaves acc = 0
        o = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
        tl.store(out + (s * num_heads + qh)[:, None] * head_dim + d[None, :],
                 o.to(out.dtype.element_ty), mask=gm[:, None] & dm[None, :])
    else:
        base = ((s * num_kv_heads + h) * num_splits + sp) * G + g
        tl.store(part_m + base, m_i, mask=gm)
        tl.store(part_l + base, l_i, mask=gm)
        tl.store(part_acc + base[:, None] * head_dim + d[None, :], acc,
                 mask=gm[:, None] & dm[None, :])


@triton.jit
def _decode_reduce(part_acc, part_m, part_l, seq_lens, out, num_heads, num_kv_heads,
                   head_dim, num_splits, G: tl.constexpr, BLOCK_S: tl.constexpr,
                   BLOCK_D: tl.constexpr):
    s = tl.program_id(0).to(tl.int64)
    qh = tl.program_id(1)
    h = qh // G
    g = qh % G
    sp = tl.arange(0, BLOCK_S)
    d = tl.arange(0, BLOCK_D)
    spm = sp < num_splits
    dm = d < head_dim
    base = ((s * num_kv_heads + h) * num_splits + sp) * G + g
    m = tl.load(part_m + base, mask=spm, other=float("-inf"))
    ll = tl.load(part_l + base, mask=spm, other=0.0)
    acc = tl.load(part_acc + base[:, None] * head_dim + d[None, :],
                  mask=spm[:, None] & dm[None, :], other=0.0)
    m_max = tl.max(m, axis=0)
    m_safe = tl.where(m_max == float("-inf"), 0.0, m_max)
    w = tl.where(m == float("-inf"), 0.0, tl.exp2(m - m_safe))
    denom = tl.sum(w * ll, axis=0)
    o = tl.sum(w[:, None] * acc, axis=0) / tl.where(denom == 0.0, 1.0, denom)
    seq_len = tl.load(seq_lens + s)
    o = tl.where(seq_len > 0, o, 0.0)
    tl.store(out + (s * num_heads + qh) * head_dim + d, o.to(out.dtype.element_ty), mask=dm)


def default_num_splits(num_seqs: int, num_kv_heads: int, max_tiles: int) -> int:
    """Enough programs to fill a GPU (~264 on a 132-SM part: two per SM) without splits of
    under two tiles; one split (no reduction pass) once the batch alone fills it."""
    want = triton.cdiv(264, max(1, num_seqs * num_kv_heads))
    return max(1, min(want, max_tiles // 2, 64))


def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    block_tables: torch.Tensor, seq_lens: torch.Tensor, softmax_scale: float,
                    k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None,
                    num_splits: int | None = None) -> torch.Tensor:
    """q `[num_seqs, num_heads, head_dim]` -> `[num_seqs, num_heads, head_dim]`."""
    check_cache(k_cache, v_cache, k_scale, v_scale)
    num_seqs, num_heads, head_dim = q.shape
    _, block_size, num_kv_heads, cache_dim = k_cache.shape
    check(cache_dim == head_dim, f"q head_dim {head_dim} != cache head_dim {cache_dim}")
    check(num_heads % num_kv_heads == 0, "num_heads must be a multiple of num_kv_heads")
    check(block_size >= 16 and block_size == next_pow2(block_size),
          f"the Triton kernels need a power-of-two block_size >= 16, got {block_size}")
    check(q.is_contiguous(), "q must be contiguous")
    check(block_tables.dtype == torch.long and block_tables.dim() == 2
          and block_tables.shape[0] == num_seqs and block_tables.stride(1) == 1,
          "block_tables must be int64 [num_seqs, max_blocks] with unit stride")
    check(seq_lens.dtype == torch.long and seq_lens.shape == (num_seqs,),
          "seq_lens must be int64 [num_seqs]")
    out = torch.empty_like(q)
    if num_seqs == 0:
        return out
    max_tiles = triton.cdiv(block_tables.shape[1] * block_size, TILE_N)
    splits = num_splits or default_num_splits(num_seqs, num_kv_heads, max_tiles)
    per_split = max(1, triton.cdiv(max_tiles, splits))
    splits = max(1, triton.cdiv(max_tiles, per_split))
    group = num_heads // num_kv_heads
    direct = splits == 1
    if direct:  # the partials are compiled out (DIRECT): any pointer will do
        part_acc = part_m = part_l = out
    else:
        shape = (num_seqs, num_kv_heads, splits, group)
        part_acc = torch.empty((*shape, head_dim), dtype=torch.float32, device=q.device)
        part_m = torch.empty(shape, dtype=torch.float32, device=q.device)
        part_l = torch.empty_like(part_m)
    fp8 = k_scale is not None
    ks, vs = (k_scale, v_scale) if fp8 else (k_cache, v_cache)
    block_d = max(16, next_pow2(head_dim))
    _decode_split[(num_seqs, num_kv_heads, splits)](
        q, k_cache, v_cache, ks, vs, block_tables, seq_lens, out, part_acc, part_m, part_l,
        softmax_scale * LOG2E, num_heads, num_kv_heads, head_dim, block_tables.stride(0),
        splits, per_split, G=group, BLOCK_G=max(16, next_pow2(group)), BLOCK_D=block_d,
        BLOCK_SIZE=block_size, TILE=TILE_N, FP8=fp8,
        DOT_T=dot_dtype(q.dtype, k_cache.dtype), DIRECT=direct, num_warps=4, num_stages=2)
    if not direct:
        _decode_reduce[(num_seqs, num_heads)](
            part_acc, part_m, part_l, seq_lens, out, num_heads, num_kv_heads, head_dim,
            splits, G=group, BLOCK_S=next_pow2(splits), BLOCK_D=block_d)
    return out
