"""Triton kernel: copy whole blocks (every layer at once; run it per tensor: K, V, scales)
from one block-indexed tensor to another, for spill/restore staging and copy-on-write.

Tensors have the block id in dim 1: `[num_layers, num_blocks, *block]`. `copy_blocks`:
dst[:, dst_ids[i]] = src[:, src_ids[i]] (a pair with an id < 0 is skipped);
`gather_blocks` packs pool blocks into a contiguous staging buffer (dst ids 0..n-1),
`scatter_blocks` unpacks one. Bytes are copied as they are (any dtype, fp8 included), in
4 KiB pieces per program with int64 offsets. Twin: `reference.copy_blocks`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvsession.kernels.checks import check

BLOCK_BYTES = 4096


@triton.jit
def _copy(src, dst, src_ids, dst_ids, src_blocks, dst_blocks, block_bytes,
          BLOCK: tl.constexpr):
    i = tl.program_id(0)
    layer = tl.program_id(1).to(tl.int64)
    part = tl.program_id(2)
    s_id = tl.load(src_ids + i).to(tl.int64)
    d_id = tl.load(dst_ids + i).to(tl.int64)
    offs = part * BLOCK + tl.arange(0, BLOCK)
    # a vector compare: a scalar mask breaks the Triton interpreter
    m = (offs < block_bytes) & ((s_id + offs * 0) >= 0) & ((d_id + offs * 0) >= 0)
    s = (layer * src_blocks + s_id) * block_bytes + offs
    d = (layer * dst_blocks + d_id) * block_bytes + offs
    tl.store(dst + d, tl.load(src + s, mask=m), mask=m)


def copy_blocks(src: torch.Tensor, dst: torch.Tensor, src_ids: torch.Tensor,
                dst_ids: torch.Tensor) -> None:
    """dst[:, dst_ids[i]] = src[:, src_ids[i]]; ids int64 on the tensors' device. The ids
    must be in range (not checked on the device: that would synchronise)."""
    check(src.dtype == dst.dtype, f"dtype mismatch {src.dtype} vs {dst.dtype}")
    check(src.device == dst.device, f"device mismatch {src.device} vs {dst.device}")
    check(src.dim() >= 2 and src.shape[0] == dst.shape[0] and src.shape[2:] == dst.shape[2:],
          f"shapes {tuple(src.shape)} and {tuple(dst.shape)} differ beyond dim 1")
    check(src.is_contiguous() and dst.is_contiguous(), "tensors must be contiguous")
    check(src_ids.dtype == torch.long and dst_ids.dtype == torch.long
          and src_ids.dim() == 1 and src_ids.shape == dst_ids.shape,
          "src_ids and dst_ids must be int64 [n] of equal length")
    n = src_ids.numel()
    if n == 0:
        return
    block_bytes = src[0, 0].numel() * src.element_size()
    parts = triton.cdiv(block_bytes, BLOCK_BYTES)
    _copy[(n, src.shape[0], parts)](src.view(torch.uint8), dst.view(torch.uint8), src_ids,
                                    dst_ids, src.shape[1], dst.shape[1], block_bytes,
                                    BLOCK=BLOCK_BYTES)


def gather_blocks(pool: torch.Tensor, staging: torch.Tensor, ids: torch.Tensor) -> None:
    """staging[:, i] = pool[:, ids[i]] (ids < 0 are skipped)."""
    check(staging.shape[1] >= ids.numel(), "staging buffer too small")
    copy_blocks(pool, staging, ids, torch.arange(ids.numel(), device=ids.device))


def scatter_blocks(staging: torch.Tensor, pool: torch.Tensor, ids: torch.Tensor) -> None:
    """pool[:, ids[i]] = staging[:, i] (ids < 0 are skipped)."""
    check(staging.shape[1] >= ids.numel(), "staging buffer too small")
    copy_blocks(staging, pool, torch.arange(ids.numel(), device=ids.device), ids)
