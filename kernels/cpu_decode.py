"""Decode attention over a paged float32 cache on CPU, by a C++ kernel (cpu_decode.cpp).

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
import enum
import logging
import threading
from pathlib import Path

import torch

from kvsession.kernels.cpp_build import (
    KERNEL_COMPILE_FLAGS,
    KERNEL_LINK_FLAGS,
    CtypesKernel,
    build,
    cache_dir,
    compiler,
    library_path,
)

log = logging.getLogger("kvsession")

SOURCE = Path(__file__).with_name("cpu_decode.cpp")
# (built with cpp_build's kernel flags: -ffast-math lets the exp loops call glibc's vector
# exp, so the kernel uses no infinity: -FLT_MAX starts each running max)
LINK = (("-lmvec", "-lm"), ("-lm",))  # libmvec is glibc's; without it exp stays scalar
# tokens per task (the unit split across threads): long enough that a task's setup and
# its merge are small next to reading it, short enough that 2,048 tokens make 8 tasks
TASK_TOKENS = 256

_P, _I64 = ctypes.c_void_p, ctypes.c_int64
KERNEL = CtypesKernel(SOURCE, "kvs_decode_attention",
                      [_P, _P, _I64, _I64, _I64, _P, _I64, _P, _I64, _I64, _P, ctypes.c_float,
                       _I64, _I64, _P, ctypes.c_int, _P, _P, _P], ctypes.c_int,
                      "the CPU decode attention kernel",
                      "decode attention runs the torch reference", link_variants=LINK)
_lock = threading.Lock()  # register_op's


def load(cxx: str | None = None, directory: Path | None = None):
    """The kernel's entry point (a ctypes function), built if needed with `cxx` (default
    `compiler()`) into `directory` (default `cache_dir()`); None when it cannot be built or
    loaded (the reason is logged once per compiler and directory). Cheap once known: a
    dict lookup, so callers may call it per use."""
    return KERNEL.get(cxx, directory)


def applies(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
            k_scale: torch.Tensor | None) -> bool:
    """Whether the kernel reads this cache: float32 on CPU, unscaled, contiguous."""
    return (k_cache.dtype == torch.float32 and q.device.type == "cpu" and k_scale is None
            and k_cache.is_contiguous() and v_cache.is_contiguous())


def paged_attention(fn, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    block_tables: torch.Tensor, seq_lens: torch.Tensor, softmax_scale: float,
                    shared_blocks: int = 0, store: tuple | None = None) -> torch.Tensor:
    """reference.paged_attention's contract (q [num_seqs, heads, D], one token each; rows of
    seq_len 0 give zeros) through the kernel `fn` (from `load`). shared_blocks: leading
    table columns all sequences share (reference.shared_prefix_blocks), read once.
    `store`: (key, value, slots), float32 contiguous [num_seqs, kv_heads, D] rows and int64
    slots (< 0: none), written into the caches first, as reference.store_kv does."""
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
# compiled code calls
# (model/onerow.py's decode step; the kernel must have loaded: the callers check `load()`
# first). The op declares its writes to the caches (`Tensor(a!)`), so inductor performs
# them in place: an index_copy_ into a graph input is functionalized into a copy of the
# whole cache, which inductor did not turn back into an in-place write for the second and
# later layers of one graph (2 x 64 MiB a layer and step with a 1 GiB pool on the bench
# model). Defined through the plain Library API (a `torch.library.custom_op` wrapper cost
# ~25 us a call); its CPU implementation is registered by `register_op` when first needed:
# C++ (cpu_decode_op.cpp, ~2 us a call) where it builds, else Python (`_op`, ~30 us).
_LIBRARY = torch.library.Library("kvsession", "DEF")
_LIBRARY.define("cpu_decode_store_attention(Tensor q, Tensor key, Tensor value, "
                "Tensor(a!) k_cache, Tensor(b!) v_cache, Tensor slots, Tensor block_tables, "
                "Tensor seq_lens, float softmax_scale) -> Tensor")


def store_rows(key: torch.Tensor, value: torch.Tensor, slots: torch.Tensor) -> tuple:
    """paged_attention's `store` for a step's new K/V rows and their slots: the kernel copies
    raw rows, so float32 (the caches it reads are) and int64 slots, contiguous."""
    return key.float().contiguous(), value.float().contiguous(), slots.long().contiguous()


def _op(q, key, value, k_cache, v_cache, slots, block_tables, seq_lens, softmax_scale):
    """The op's implementation in Python: the kernel through ctypes (where the C++ one,
    cpu_decode_op.cpp, could not be built)."""
    return paged_attention(load(), q, k_cache, v_cache, block_tables, seq_lens,
                           softmax_scale, store=store_rows(key, value, slots))


class OpKind(enum.Enum):
    NATIVE = "native"  # cpu_decode_op.cpp: the kernel behind torch's dispatcher, no Python
    PYTHON = "python"  # _op


OP_SOURCE = SOURCE.with_name("cpu_decode_op.cpp")
_op_kind: OpKind | None = None  # the implementation registered, once chosen


def _op_flags() -> tuple[list[str], list[str], tuple[str, ...]]:
    """(compile flags, link flags, libraries) of the op's library: the kernel's, plus
    torch's headers and libraries (those of the torch this process runs)."""
    root = Path(torch.__file__).parent
    include = [root / "include", root / "include" / "torch" / "csrc" / "api" / "include"]
    abi = int(torch._C._GLIBCXX_USE_CXX11_ABI)
    compile_flags = [f for f in KERNEL_COMPILE_FLAGS if not f.startswith("-std=")] + [
        "-std=c++20", f"-DKVS_TASK_TOKENS={TASK_TOKENS}", f"-D_GLIBCXX_USE_CXX11_ABI={abi}",
        *(f"-I{p}" for p in include)]
    lib = root / "lib"
    return compile_flags, KERNEL_LINK_FLAGS + [f"-L{lib}", f"-Wl,-rpath,{lib}"], ("-ltorch_cpu",
                                                                           "-lc10")


def register_op() -> OpKind:
    """Give kvsession::cpu_decode_store_attention its CPU implementation, once per process:
    the C++ one (cpu_decode_op.cpp, built like the kernel into the same directory, with
    torch's headers: ~10-20 s once) when it builds and loads, else `_op`. Returns which.
    For callers that found `load()` working (compiled code calls the op per layer)."""
    global _op_kind
    with _lock:
        if _op_kind is not None:
            return _op_kind
        cxx, directory = compiler(), cache_dir()
        errors: list[str] = []
        if cxx is not None:
            compile_flags, link_flags, libs = _op_flags()
            lib = library_path(cxx, directory, "cpu_decode_op", [OP_SOURCE, SOURCE],
                               compile_flags + link_flags + list(libs))
            try:
                if not lib.is_file():
                    build(cxx, lib, errors, OP_SOURCE, compile_flags, link_flags, libs,
                          link_variants=LINK)
                torch.ops.load_library(str(lib))  # its static initialiser registers the op
                _op_kind = OpKind.NATIVE
            except (OSError, RuntimeError) as e:  # not built, or torch refused to load it
                errors.append(str(e))
        if _op_kind is None:
            log.warning("the CPU decode op runs its kernel through Python (building its C++ "
                        "implementation with %s into %s failed: %s)", cxx, directory,
                        " | ".join(errors) or "no C++ compiler")
            _LIBRARY.impl("cpu_decode_store_attention", _op, "CPU")
            _op_kind = OpKind.PYTHON
        return _op_kind


@torch.library.register_fake("kvsession::cpu_decode_store_attention")
def _(q, key, value, k_cache, v_cache, slots, block_tables, seq_lens, softmax_scale):
    return q.new_empty(q.shape)  # contiguous, as the kernel returns it
