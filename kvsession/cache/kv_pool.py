"""The physical KV tensors: one K and one V tensor for all layers, indexed by block id.

Layout: `k[layer, block, slot_in_block, kv_head, head_dim]` (same for `v`). With an fp8 cache,
`k_scale[layer, block, slot_in_block, kv_head]` (float16, one scale per token per KV head)
sits beside it, indexed by the same block id, so anything that copies block b (spill,
snapshot, copy-on-write, remote transfer) copies `k[:, b]`, `v[:, b]` and the scales of b
together: scales travel with their block by construction.

KVPool holds bytes only. Which block belongs to whom is BlockPool's business.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvsession.kernels.reference import is_fp8

# float16 scales: 2 bytes per token-head keeps an fp8 pool at >= 1.94x the tokens of a
# bf16 pool for head_dim >= 64 (float32 scales: 1.88x at head_dim 64). Quantization uses the
# stored (rounded) scale, so write and read agree exactly; absmax below ~2.7e-5 is clamped
# to the smallest float16 scale, i.e. such near-zero tokens are stored as (near) zero.
SCALE_DTYPE = torch.float16


def kv_bytes_per_token(num_layers: int, num_kv_heads: int, head_dim: int,
                       dtype: torch.dtype) -> int:
    """K + V bytes of one token over all layers, fp8 scales included: the engine's one
    answer (pool sizing, cost model inputs, stats)."""
    elem = torch.empty((), dtype=dtype).element_size()
    per_head = head_dim * elem + (torch.empty((), dtype=SCALE_DTYPE).element_size()
                                  if is_fp8(dtype) else 0)
    return 2 * num_layers * num_kv_heads * per_head


@dataclass(frozen=True)
class LayerKV:
    """Views of one layer's cache; valid as long as the KVPool lives."""

    k: torch.Tensor
    v: torch.Tensor
    k_scale: torch.Tensor | None
    v_scale: torch.Tensor | None


class KVPool:
    def __init__(self, num_layers: int, num_blocks: int, block_size: int, num_kv_heads: int,
                 head_dim: int, dtype: torch.dtype, device: torch.device,
                 use_kernels: bool = False):
        """use_kernels: block copies (copy-on-write here, spill/restore staging in the host
        tier) run the Triton block-copy kernel; the engine sets it with the Triton backend."""
        self.use_kernels = use_kernels
        self.num_layers, self.num_blocks, self.block_size = num_layers, num_blocks, block_size
        self.num_kv_heads, self.head_dim, self.dtype = num_kv_heads, head_dim, dtype
        shape = (num_layers, num_blocks, block_size, num_kv_heads, head_dim)
        # zeros, not empty: masked-out slots still enter matmuls (x 0), and NaN x 0 = NaN.
        # Written, not calloc'ed: on CPU a large torch.zeros is lazily committed, and the
        # page faults then land on the first prefill or restore into each block (a disk
        # restore into fresh blocks ran at half speed). The pool is memory the user sized;
        # committing it up front, as on a GPU, keeps every later write at memory speed.
        self.k = torch.empty(shape, dtype=dtype, device=device).zero_()
        self.v = torch.empty(shape, dtype=dtype, device=device).zero_()
        self.k_scale = self.v_scale = None
        if is_fp8(dtype):
            self.k_scale = torch.ones(shape[:-1], dtype=SCALE_DTYPE, device=device)
            self.v_scale = torch.ones(shape[:-1], dtype=SCALE_DTYPE, device=device)

    def layer(self, i: int) -> LayerKV:
        return LayerKV(self.k[i], self.v[i],
                       None if self.k_scale is None else self.k_scale[i],
                       None if self.v_scale is None else self.v_scale[i])

    def tensors(self) -> dict[str, torch.Tensor]:
        """Every tensor whose dim 1 is the block id (what a block copy must move)."""
        out = {"k": self.k, "v": self.v}
        if self.k_scale is not None:
            out |= {"k_scale": self.k_scale, "v_scale": self.v_scale}
        return out

    def reset_blocks(self, num_blocks: int) -> None:
        """Blocks [0, num_blocks) of every layer as the pool was built (K/V zero, fp8 scales
        one): start-up's warm-up and timing steps write into the first blocks."""
        self.k[:, :num_blocks] = 0
        self.v[:, :num_blocks] = 0
        if self.k_scale is not None:
            self.k_scale[:, :num_blocks] = 1
            self.v_scale[:, :num_blocks] = 1

    def copy_block(self, src: int, dst: int) -> None:
        """Copy block `src` onto block `dst` in every layer, scales included (copy-on-write)."""
        if self.use_kernels:
            from kvsession.kernels.block_copy import copy_blocks

            dev = self.k.device
            s, d = torch.tensor([src], device=dev), torch.tensor([dst], device=dev)
            for t in self.tensors().values():
                copy_blocks(t, t, s, d)
            return
        for t in self.tensors().values():
            t[:, dst] = t[:, src]


def block_runs(src_ids: list[int], dst_ids: list[int]) -> list[tuple[int, int, int]]:
    """(src start, dst start, count) for runs of ids consecutive on both sides: moving blocks
    run by run turns many small copies (or transfer descriptors) into a few large ones."""
    runs, start = [], 0
    for i in range(1, len(src_ids) + 1):
        if i == len(src_ids) or src_ids[i] != src_ids[i - 1] + 1 \
                or dst_ids[i] != dst_ids[i - 1] + 1:
            runs.append((src_ids[start], dst_ids[start], i - start))
            start = i
    return runs
