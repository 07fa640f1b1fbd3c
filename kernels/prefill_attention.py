"""Triton kernel: causal attention for each sequence's new tokens (a prefill chunk, or the
rest of a prompt after a prefix hit) over its paged cached prefix and the chunk itself,
variable-length batch. The chunk's K/V must already be stored (store_kv).

Program (sequence, query tile, query head): BLOCK_M new tokens of one head walk the
sequence's key tiles (`attend.attend_tile`) with an online softmax, in two loops: tiles that
end before the query tile's first position are visible to every row and need no mask (all
of a cached prefix but the last tile); the rest carry the causal mask key position <= query
position. fp8 blocks are dequantized in the load path. Twin: `reference.prefill_attention`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvsession.kernels.attend import TILE_N, attend_tile, dot_dtype
from kvsession.kernels.checks import check, check_cache, next_pow2
from kvsession.kernels.paged_attention import LOG2E

BLOCK_M = 64  # query rows per program: tensor-core sized, and few enough programs idle


@triton.jit
def _prefill(q, k_cache, v_cache, k_scale, v_scale, block_tables, query_start_loc, seq_lens,
             out, qk_scale, num_heads, num_kv_heads, head_dim, table_stride,
             G: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr,
             BLOCK_SIZE: tl.constexpr, TILE: tl.constexpr, FP8: tl.constexpr,
             DOT_T: tl.constexpr):
    s = tl.program_id(0).to(tl.int64)
    tile = tl.program_id(1)
    qh = tl.program_id(2)
    h = qh // G
    q_start = tl.load(query_start_loc + s)
    q_len = tl.load(query_start_loc + s + 1) - q_start
    seq_len = tl.load(seq_lens + s)
    ctx = seq_len - q_len  # position of the first new token
    mi = tile * BLOCK_M + tl.arange(0, BLOCK_M)
    qm = mi < q_len
    d = tl.arange(0, BLOCK_D)
    dm = d < head_dim
    n = tl.arange(0, TILE)
    rows = (q_start + mi).to(tl.int64)
    qv = tl.load(q + (rows * num_heads + qh)[:, None] * head_dim + d[None, :],
                 mask=qm[:, None] & dm[None, :], other=0.0).to(DOT_T)
    qpos = ctx + mi
    m_i = tl.full((BLOCK_M,), float("-inf"), tl.float32)
    l_i = tl.zeros((BLOCK_M,), tl.float32)
    acc = tl.zeros((BLOCK_M, BLOCK_D), tl.float32)
    table_row = block_tables + s * table_stride
    live = tile * BLOCK_M < q_len  # tiles past a short sequence's end do nothing
    first_q = ctx + tile * BLOCK_M
    last_q = ctx + tl.minimum((tile + 1) * BLOCK_M, q_len) - 1
    num_full = tl.where(live, first_q // TILE, 0)  # keys < first_q: seen by every row
    num_tiles = tl.where(live, last_q // TILE + 1, 0)
    for t in range(0, num_full):
        pos = t * TILE + n
        acc, m_i, l_i = attend_tile(acc, m_i, l_i, qv, k_cache, v_cache, k_scale, v_scale,
                                    table_row, pos, pos >= 0, None, d, dm, h, num_kv_heads,
                                    head_dim, qk_scale, BLOCK_SIZE, FP8, DOT_T, False)
    for t in range(num_full, num_tiles):
        pos = t * TILE + n
        pm = pos < seq_len
        visible = (pos[None, :] <= qpos[:, None]) & pm[None, :] & qm[:, None]
        acc, m_i, l_i = attend_tile(acc, m_i, l_i, qv, k_cache, v_cache, k_scale, v_scale,
                                    table_row, pos, pm, visible, d, dm, h, num_kv_heads,
                                    head_dim, qk_scale, BLOCK_SIZE, FP8, DOT_T, True)
    o = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
    tl.store(out + (rows * num_heads + qh)[:, None] * head_dim + d[None, :],
             o.to(out.dtype.element_ty), mask=qm[:, None] & dm[None, :])


def prefill_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                      block_tables: torch.Tensor, query_start_loc: torch.Tensor,
                      seq_lens: torch.Tensor, softmax_scale: float,
                      k_scale: torch.Tensor | None = None,
                      v_scale: torch.Tensor | None = None,
                      max_query_len: int | None = None) -> torch.Tensor:
    """q `[num_tokens, num_heads, head_dim]` packed by `query_start_loc` (int64,
    num_seqs + 1); `seq_lens[i]` is sequence i's length after this chunk."""
    check_cache(k_cache, v_cache, k_scale, v_scale)
    num_tokens, num_heads, head_dim = q.shape
    _, block_size, num_kv_heads, cache_dim = k_cache.shape
    num_seqs = seq_lens.shape[0]
    check(cache_dim == head_dim, f"q head_dim {head_dim} != cache head_dim {cache_dim}")
    check(num_heads % num_kv_heads == 0, "num_heads must be a multiple of num_kv_heads")
    check(block_size >= 16 and block_size == next_pow2(block_size),
          f"the Triton kernels need a power-of-two block_size >= 16, got {block_size}")
    check(q.is_contiguous(), "q must be contiguous")
    check(query_start_loc.dtype == torch.long and query_start_loc.shape == (num_seqs + 1,),
          "query_start_loc must be int64 [num_seqs + 1]")
    check(seq_lens.dtype == torch.long and block_tables.dtype == torch.long
          and block_tables.shape[0] == num_seqs and block_tables.stride(1) == 1,
          "seq_lens and block_tables must be int64, one row per sequence")
    out = torch.empty_like(q)
    if num_tokens == 0:
        return out
    if max_query_len is None:
        max_query_len = int((query_start_loc[1:] - query_start_loc[:-1]).max())
    fp8 = k_scale is not None
    ks, vs = (k_scale, v_scale) if fp8 else (k_cache, v_cache)
    grid = (num_seqs, triton.cdiv(max_query_len, BLOCK_M), num_heads)
    _prefill[grid](q, k_cache, v_cache, ks, vs, block_tables, query_start_loc, seq_lens, out,
                   softmax_scale * LOG2E, num_heads, num_kv_heads, head_dim,
                   block_tables.stride(0), G=num_heads // num_kv_heads, BLOCK_M=BLOCK_M,
                   BLOCK_D=max(16, next_pow2(head_dim)), BLOCK_SIZE=block_size, TILE=TILE_N,
                   FP8=fp8, DOT_T=dot_dtype(q.dtype, k_cache.dtype), num_warps=4,
                   num_stages=2)
    return out
