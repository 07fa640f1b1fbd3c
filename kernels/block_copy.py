"""Triton kernel: gather / scatter whole blocks (every layer, scales included) between a
pool tensor and a contiguous staging buffer, for spill/restore, copy-on-write and transfers.

Tensors have the block id in dim 1: pool `[num_layers, num_blocks, *block]`, staging
`[num_layers, n, *block]`. `gather`: staging[:, i] = pool[:, ids[i]]; `scatter`:
pool[:, ids[i]] = staging[:, i]. Bytes are copied as they are (any dtype, fp8 included).
Twin: `reference.copy_blocks`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvsession.kernels.checks import check

BLOCK_BYTES = 4096


@triton.jit
def _copy(src, dst, ids, num_ids, src_blocks, dst_blocks, block_bytes,
          GATHER: tl.constexpr, BLOCK: tl.constexpr):
    i = tl.program_id(0)
    layer = tl.program_id(1).to(tl.int64)
    part = tl.program_id(2)
    bid = tl.load(ids + i).to(tl.int64)
    offs = part * BLOCK + tl.arange(0, BLOCK)
    m = (offs < block_bytes) & ((bid + offs * 0) >= 0)
    if GATHER:
        s = (layer * src_blocks + bid) * block_bytes + offs
        d = (layer * dst_blocks + i) * block_bytes + offs
    else:
        s = (layer * src_blocks + i) * block_bytes + offs
        d = (layer * dst_blocks + bid) * block_bytes + offs
    tl.store(dst + d, tl.load(src + s, mask=m), mask=m)


def _launch(src: torch.Tensor, dst: torch.Tensor, ids: torch.Tensor, gather: bool) -> None:
    check(src.dtype == dst.dtype, f"dtype mismatch {src.dtype} vs {dst.dtype}")
    check(src.shape[0] == dst.shape[0] and src.shape[2:] == dst.shape[2:],
          f"shapes {tuple(src.shape)} and {tuple(dst.shape)} differ beyond dim 1")
    check(src.is_contiguous() and dst.is_contiguous(), "tensors must be contiguous")
    check(ids.dtype == torch.long and ids.dim() == 1, "ids must be int64 [n]")
    n = ids.numel()
    check((dst if gather else src).shape[1] >= n, "staging buffer too small")
    if n == 0:
        return
    s8, d8 = src.view(torch.uint8), dst.view(torch.uint8)
    block_bytes = src[0, 0].numel() * src.element_size()
    parts = triton.cdiv(block_bytes, BLOCK_BYTES)
    _copy[(n, src.shape[0], parts)](s8, d8, ids, n, src.shape[1], dst.shape[1], block_bytes,
                                    GATHER=gather, BLOCK=BLOCK_BYTES)


def gather_blocks(pool: torch.Tensor, staging: torch.Tensor, ids: torch.Tensor) -> None:
    """staging[:, i] = pool[:, ids[i]] (ids < 0 are skipped)."""
    _launch(pool, staging, ids, gather=True)


def scatter_blocks(staging: torch.Tensor, pool: torch.Tensor, ids: torch.Tensor) -> None:
    """pool[:, ids[i]] = staging[:, i] (ids < 0 are skipped)."""
    _launch(staging, pool, ids, gather=False)
