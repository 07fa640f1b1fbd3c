"""CPU memory mapped by this process itself: page-aligned anonymous mappings (the disk
tier's O_DIRECT staging) and tensors in transparent huge pages (the packed one-row
weights). Imports nothing of kvsession: the model and the tiers both use it.

Huge pages, why: a batch-1 decode step streams every weight once. In 4 KiB pages that is
a TLB miss and a page walk every 4 KiB, and the hardware prefetchers stop at every page
boundary. With the bench model's packed weights copied into 2 MiB pages, the same
compiled step in the same process took 7.37 ms instead of 8.85 (median of 10 interleaved
rounds; 8.25 vs 8.82 at a 2,048-token context), and the product chain alone read ~10-15%
faster. torch's allocator asks for huge pages only when THP_MEM_ALLOC_ENABLE is set before
its first allocation, which a library cannot arrange inside its user's process; so the
tensor is a private anonymous mapping advised MADV_HUGEPAGE (honoured when the system's
`transparent_hugepage` is `madvise` or `always`), started on a 2 MiB boundary. Not for the
KV pool: committing 1 GiB of it in huge pages took 2.7-4.3 s on the bench VM against
0.25-0.46 s in 4 KiB pages, a cost every engine start would pay.
"""

from __future__ import annotations

import ctypes
import math
import mmap

import torch

HUGE_PAGE_BYTES = 2 << 20


def fresh_memory(nbytes: int) -> mmap.mmap:
    """`nbytes` of zeroed, page-aligned memory (O_DIRECT takes it), private to this
    process."""
    if not hasattr(mmap, "MAP_ANONYMOUS"):  # Windows: no flags, anonymous memory anyway
        return mmap.mmap(-1, max(nbytes, 1))
    return mmap.mmap(-1, max(nbytes, 1), flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)


def huge_page_empty(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A contiguous CPU tensor of `shape` and `dtype`, its contents unspecified: in 2 MiB
    pages, starting on a 2 MiB boundary, when it spans at least one such page and the
    platform has MADV_HUGEPAGE; else torch.empty. The mapping is unmapped when the last
    tensor viewing it is freed."""
    nbytes = math.prod(shape) * dtype.itemsize
    advice = getattr(mmap, "MADV_HUGEPAGE", None)
    if nbytes < HUGE_PAGE_BYTES or advice is None:
        return torch.empty(shape, dtype=dtype)
    try:
        mem = fresh_memory(nbytes + HUGE_PAGE_BYTES)  # room to start on a 2 MiB boundary
        mem.madvise(advice)
    except (OSError, ValueError):  # no memory for the mapping, or the advice refused
        return torch.empty(shape, dtype=dtype)
    skip = -torch.frombuffer(mem, dtype=torch.uint8).data_ptr() % HUGE_PAGE_BYTES
    # a storage of its own that starts on the boundary (offset 0, wherever the mapping
    # landed): a compiled region stored on disk is keyed by its arguments' storage offsets
    # (model/region_store.py), so the weights' views must not move with the address
    raw = torch.frombuffer(mem, dtype=torch.uint8, offset=skip, count=nbytes)  # keeps `mem`
    return raw.view(dtype).view(shape)


def release_free_memory() -> bool:
    """Hand memory the C allocator holds but no one uses back to the system
    (glibc's `malloc_trim(0)`); True when it ran. Why: loading frees as much as the weights
    weigh (each tensor read, then fused or packed and the original dropped), and glibc keeps
    freed memory of large arenas for reuse: after loading a 125 MB bfloat16 checkpoint the
    process held ~1.6x the weights' bytes beyond its KV pool, and ~1.0x once trimmed
    (tests/test_checkpoint_dtype.py measures it). Elsewhere (macOS, musl, Windows) a no-op."""
    try:
        # the process's own symbols: glibc's when it is the C library
        trim = ctypes.CDLL(None).malloc_trim
    except (OSError, AttributeError, TypeError):
        return False
    trim.argtypes, trim.restype = [ctypes.c_size_t], ctypes.c_int
    trim(0)
    return True
