"""Decode attention over a paged float32 or bfloat16 cache on CPU, by a C++ kernel
(cpu_decode.cpp).

PyTorch's CPU attention ops read a decode step's KV at a fraction of the memory's rate:
a query of one token makes them a string of skinny products (and MKL's run slowly on AMD
CPUs), and a paged cache must first be gathered or cut into runs. On the AMD EPYC bench
machine 2,048 tokens of one layer's K/V (4 MiB) took ~600 us through the flash op, ~350 us
through compiled torch code, and ~250 us here (a `sum` over the same bytes: ~150 us). The
kernel reads every block in place through the block table, splits long contexts over the
threads and reads a batch's shared leading blocks once (see the .cpp's header).

It is compiled at first use with the system's C++ compiler (`$CXX`, else g++ / c++ /
clang++), for this CPU (-march=native) and with OpenMP (the process's runtime: torch's),
into `$KVSESSION_CACHE/kernels` (default ~/.cache/kvsession/kernels), keyed by the source,
the flags, the compiler and the CPU. Building takes ~1 s once. Without a working compiler
`load()` returns None (and logs why once): the engine keeps the torch reference. The
batch-1 decode step calls the kernel from compiled code as a torch op, whose C++
implementation (cpu_decode_op.cpp, `register_op`) builds the same way with torch's headers
(~10 s once); where it does not build, the op runs the kernel through Python.
"""

from __future__ import annotations

import ctypes
import logging
from pathlib import Path

import torch

from kvsession.kernels import reference
from kvsession.kernels.cpp_build import CtypesKernel, OpKind, TorchOp

log = logging.getLogger("kvsession")

SOURCE = Path(__file__).with_name("cpu_decode.cpp")
# (built with cpp_build's kernel flags: -ffast-math lets the exp loops call glibc's vector
# exp, so the kernel uses no infinity: -FLT_MAX starts each running max)
LINK = (("-lmvec", "-lm"), ("-lm",))  # libmvec is glibc's; without it exp stays scalar
# tokens per task (the unit split across threads): long enough that a task's setup and
# its merge are small next to reading it, short enough that 2,048 tokens make 8 tasks
TASK_TOKENS = 256

_P, _I64 = ctypes.c_void_p, ctypes.c_int64
_ARGS = [_P, _P, _I64, _I64, _I64, _P, _I64, _P, _I64, _I64, _P, ctypes.c_float, _I64, _I64, _P,
         ctypes.c_int, _P, _P, _P]
# the entry point per cache dtype (one library: the same source and flags)
KERNELS = {dtype: CtypesKernel(SOURCE, symbol, _ARGS, ctypes.c_int,
                               "the CPU decode attention kernel",
                               "decode attention runs the torch reference", link_variants=LINK)
           for dtype, symbol in ((torch.float32, "kvs_decode_attention"),
                                 (torch.bfloat16, "kvs_decode_attention_bf16"))}


def load(cxx: str | None = None, directory: Path | None = None,
         dtype: torch.dtype = torch.float32):
    """The kernel's entry point (a ctypes function) for caches of `dtype` (float32 or
    bfloat16), built if needed with `cxx` (default `compiler()`) into `directory` (default
    `cache_dir()`); None when it cannot be built or loaded (the reason is logged once per
    compiler and directory). Cheap once known: a dict lookup, so callers may call it per
    use."""
    return KERNELS[dtype].get(cxx, directory)


def applies(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
            k_scale: torch.Tensor | None) -> bool:
    """Whether the kernel reads this cache: float32 or bfloat16 on CPU, unscaled,
    contiguous."""
    return (k_cache.dtype in KERNELS and q.device.type == "cpu" and k_scale is None
            and k_cache.is_contiguous() and v_cache.is_contiguous())


def paged_attention(fn, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    block_tables: torch.Tensor, seq_lens: torch.Tensor, softmax_scale: float,
                    shared_blocks: int = 0, store: tuple | None = None) -> torch.Tensor:
    """reference.paged_attention's contract (q [num_seqs, heads, D], one token each; rows of
    seq_len 0 give zeros) through the kernel `fn` (from `load`). shared_blocks: leading
    table columns all sequences share (reference.shared_prefix_blocks), read once.
    `store`: (key, value, slots), contiguous [num_seqs, kv_heads, D] rows in the cache's
    dtype and int64 slots (< 0: none), written into the caches first, as reference.store_kv
    does. `fn`: load()'s entry point for the cache's dtype."""
    num_seqs, num_heads, head_dim = q.shape
    _, block_size, kv_heads, _ = k_cache.shape
    # called per layer: every conversion is skipped when not needed (each costs ~1 us)
    qf, tables, lens = (t if t.dtype == dtype and t.is_contiguous() else
                        t.to(dtype).contiguous() for t, dtype in (
                            (q, torch.float32), (block_tables, torch.int64),
                            (seq_lens, torch.int64)))
    out = torch.empty(num_seqs, num_heads, head_dim, dtype=torch.float32)
    new = (0, 0, 0) if store is None else (store[0].data_ptr(), store[1].data_ptr(),
                                           store[2].data_ptr())
    if num_seqs and fn(k_cache.data_ptr(), v_cache.data_ptr(), block_size, kv_heads,
                       head_dim, tables.data_ptr(), tables.stride(0), lens.data_ptr(),
                       num_seqs, num_heads // kv_heads, qf.data_ptr(), softmax_scale,
                       shared_blocks, max(1, TASK_TOKENS // block_size), out.data_ptr(),
                       torch.get_num_threads(), *new):
        raise MemoryError("the CPU decode attention kernel could not allocate its scratch")
    return out if q.dtype == torch.float32 else out.to(q.dtype)


# The new token's K/V stored (by the kernel: two index_copy_ calls cost ~20-40 us a layer
# in a decode step, the caches cold from the weights), then paged_attention, as one op that
# compiled code calls (model/onerow.py's decode steps, one sequence or a batch; the kernel
# must have loaded: the callers check `load()` first). Leading blocks that every
# sequence's table shares are read once (found by the op itself, as
# reference.shared_prefix_blocks finds them). The op declares its writes to the caches
# (`Tensor(a!)`), so inductor performs them in place: an index_copy_ into a graph input is
# functionalized into a copy of the whole cache, which inductor did not turn back into an
# in-place write for the second and later layers of one graph (2 x 64 MiB a layer and step
# with a 1 GiB pool on the bench model). Defined through the plain Library API (a
# `torch.library.custom_op` wrapper cost ~25 us a call); its CPU implementation is
# registered by `register_op` when first needed: C++ (cpu_decode_op.cpp, ~2 us a call)
# where it builds, else Python (`_op`, ~30 us).
_LIBRARY = torch.library.Library("kvsession", "DEF")
_LIBRARY.define("cpu_decode_store_attention(Tensor q, Tensor key, Tensor value, "
                "Tensor(a!) k_cache, Tensor(b!) v_cache, Tensor slots, Tensor block_tables, "
                "Tensor seq_lens, float softmax_scale) -> Tensor")


def store_rows(key: torch.Tensor, value: torch.Tensor, slots: torch.Tensor,
               dtype: torch.dtype = torch.float32) -> tuple:
    """paged_attention's `store` for a step's new K/V rows and their slots: the kernel copies
    raw rows, so in the cache's `dtype`, and int64 slots, contiguous."""
    return (key.to(dtype).contiguous(), value.to(dtype).contiguous(),
            slots.long().contiguous())


def _op(q, key, value, k_cache, v_cache, slots, block_tables, seq_lens, softmax_scale):
    """The op's implementation in Python: the kernel through ctypes (where the C++ one,
    cpu_decode_op.cpp, could not be built)."""
    dtype = k_cache.dtype
    shared = reference.shared_prefix_blocks(block_tables, seq_lens, k_cache.shape[1])
    return paged_attention(load(dtype=dtype), q, k_cache, v_cache, block_tables, seq_lens,
                           softmax_scale, shared, store_rows(key, value, slots, dtype))


OP = TorchOp(_LIBRARY, "cpu_decode_store_attention", SOURCE.with_name("cpu_decode_op.cpp"),
             SOURCE, _op, "the CPU decode op", defines=(f"-DKVS_TASK_TOKENS={TASK_TOKENS}",),
             link_variants=LINK)


def register_op() -> OpKind:
    """Give kvsession::cpu_decode_store_attention its CPU implementation, once per process:
    the C++ one (cpu_decode_op.cpp) when it builds and loads, else `_op` (cpp_build.TorchOp).
    Returns which. For callers that found `load()` working (compiled code calls the op per
    layer)."""
    return OP.register()


@torch.library.register_fake("kvsession::cpu_decode_store_attention")
def _(q, key, value, k_cache, v_cache, slots, block_tables, seq_lens, softmax_scale):
    return q.new_empty(q.shape)  # contiguous, as the kernel returns it
