"""Compiled regions kept on disk, so that a process loads what an earlier one compiled.

Compiling the one-token step (model/onerow.py) is most of a real checkpoint's load time:
dynamo traces the whole step op by op (28 layers of Qwen3-0.6B: ~2.5 s per traced variant
on the 2-vCPU bench VM, twice at start-up, once per thread count the engine may choose)
even when inductor's own on-disk cache already holds the generated code. llama.cpp has
nothing to compile and loads the same checkpoint in ~1.4 s there. So a `StoredRegion`
compiles its function ahead of time (`torch.compile(...).aot_compile`: dynamo's graph,
inductor's code and the wrapper that calls it, serialized) on its first call, writes it
to `$KVSESSION_CACHE/compiled/` (default ~/.cache/kvsession/compiled), and every later
process on the same machine loads it (~0.4 s for the Qwen3-0.6B step) instead of tracing.

What a stored function is valid for, and how that is kept true:
- The file's name is a digest of everything the compiled code depends on (`region_key`):
  torch's and Python's versions, the source of kvsession's model and kernels packages
  (the regions' code and the C++ ops they call), the CPU's identity (inductor generates
  code for this CPU's vector ISA), the function, the compile options, and the first
  call's arguments: each tensor's dtype, shape (a dimension marked unbacked excepted),
  strides, storage offset and which arguments share storage, every other value as is.
  Anything else gets another file.
- A loaded function runs without dynamo's guards: its guards were built on fake tensors
  in autograd's dispatch state and reject the engine's inference tensors (torch 2.13),
  and the key above already covers what they check. Each call compares the top-level
  arguments' shapes, dtypes and values with the first call's (~20 attribute reads, ~5 µs
  of a ~30 ms step); anything different runs through the plain dynamo-compiled region,
  which guards and recompiles as usual.
- The thread count is not in the key: the regions are compiled with
  `cpp.dynamic_threads` (the generated loops ask OpenMP for it per call), so one function
  serves every count the engine's ThreadGovernor chooses.
- A file that fails to load (truncated, written by another build) is logged, removed and
  compiled again; a region that fails to compile ahead of time (or a cache directory that
  cannot be written) falls back to the plain region, logged. Files are written atomically
  (a temporary file renamed), so a reader never sees half of one.
- Like inductor's own cache, the directory is trusted: a stored function is Python
  bytecode and C++ that the process runs. It is the user's own cache directory.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import logging
import platform
import sys
import types
from collections.abc import Callable, Sequence
from pathlib import Path

import torch

from kvsession.kernels import cpp_build

log = logging.getLogger("kvsession")

SUFFIX = ".aot"
# files a store keeps: storing one more removes the least recently used beyond this (a
# model's step is 0.05-2 MB; each model shape, KV budget and kvsession build has its own)
MAX_STORED_FILES = 64


class RegionStore:
    """A directory of ahead-of-time compiled regions, one file per `region_key`.

    Counts what it did (`loaded`, `compiled`, `failed`: functions), which the load log and
    the tests read."""

    def __init__(self, directory: Path):
        self.directory = Path(directory)
        self.loaded = self.compiled = self.failed = 0

    @staticmethod
    def default() -> RegionStore:
        """The store under kvsession's cache directory ($KVSESSION_CACHE/compiled)."""
        return RegionStore(cpp_build.cache_root() / "compiled")

    def path(self, key: str) -> Path:
        return self.directory / f"{key}{SUFFIX}"

    def load(self, key: str, fn: Callable) -> Callable | None:
        """The function stored under `key` (compiled from `fn`), or None when there is
        none or it does not load (then the file is removed, said in the log)."""
        path = self.path(key)
        try:
            with open(path, "rb") as f:
                compiled = torch.compiler.load_compiled_function(f, f_globals=fn.__globals__)
        except FileNotFoundError:
            return None
        except Exception as e:  # noqa: BLE001 - any unreadable file: compile it again
            log.warning("compiled region %s: %s did not load (%s: %s); compiling it again",
                        fn.__name__, path, type(e).__name__, e)
            path.unlink(missing_ok=True)
            self.failed += 1
            return None
        compiled.disable_guard_check()  # why: the module's docstring
        self.loaded += 1
        with contextlib.suppress(OSError):  # a read-only store serves as it is
            path.touch()  # recently used: kept when the store prunes
        return compiled

    def compile(self, key: str, fn: Callable, args: tuple, dynamic: bool | None,
                options: dict) -> Callable | None:
        """`fn` compiled ahead of time for `args` and stored under `key`; None if it
        could not be compiled (said in the log). A store that cannot be written still
        returns the function (it serves this process)."""
        try:
            compiled = torch.compile(fn, fullgraph=True, dynamic=dynamic,
                                     options=options).aot_compile((args, {}))
        except Exception as e:  # noqa: BLE001 - the plain region serves
            log.warning("compiled region %s: ahead-of-time compile failed (%s: %s); "
                        "compiling it in this process only", fn.__name__, type(e).__name__,
                        e)
            self.failed += 1
            return None
        self.compiled += 1
        compiled.disable_guard_check()
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
            compiled.save_compiled_function(str(self.path(key)))
            self._prune()
        except Exception as e:  # noqa: BLE001 - unwritable or unserializable: this process
            log.warning("compiled region %s: not stored in %s (%s: %s)", fn.__name__,
                        self.directory, type(e).__name__, e)
        return compiled

    def _prune(self) -> None:
        """Remove the least recently used files beyond MAX_STORED_FILES (by modification
        time: loading touches a file). Another process may prune at the same time: a file
        already gone is skipped."""
        files = sorted(self.directory.glob(f"*{SUFFIX}"), key=_mtime, reverse=True)
        for f in files[MAX_STORED_FILES:]:
            f.unlink(missing_ok=True)


class StoredRegion:
    """`fn` compiled: ahead of time through a `RegionStore` when one is attached (its
    first call loads or compiles and stores it), else (and for calls unlike the first) by
    dynamo in this process, as `torch.compile` does. A dimension the caller marked
    unbacked (`torch._dynamo.mark_unbacked`: it varies per call, one graph for every
    length) is left out of the signatures."""

    def __init__(self, fn: Callable, dynamic: bool | None, options: dict):
        # a copy of the code object: a dynamo cache of its own for each model's region
        # (dynamo's per-code cache has a small limit, past which it runs eagerly)
        self.fn = _clone(fn)
        self.dynamic, self.options = dynamic, options
        self.plain = torch.compile(self.fn, dynamic=dynamic, options=options)
        self.store: RegionStore | None = None
        self.compiled: Callable | None = None
        self.first: tuple | None = None  # the first call's top-level signature
        self.stored_calls = 0  # calls the ahead-of-time function served

    def attach(self, store: RegionStore | None) -> None:
        """Compile through `store` from the next first call (None: dynamo only)."""
        self.store = store

    def __call__(self, *args):
        if self.first is None and self.store is not None:
            self.first = _signature(args, deep=False)
            key = region_key(self.fn, args, self.options)
            self.compiled = self.store.load(key, self.fn) or self.store.compile(
                key, self.fn, args, self.dynamic, self.options)
        if self.compiled is not None and \
                _signature(args, deep=False) == self.first:
            self.stored_calls += 1
            return self.compiled(*args)
        return self.plain(*args)


def region_key(fn: Callable, args: tuple, options: dict) -> str:
    """The digest a compiled `fn` for `args` is stored under (what it depends on: the
    module's docstring)."""
    parts = [_build_identity(), fn.__module__, fn.__qualname__, repr(sorted(options.items())),
             repr(_signature(args, deep=True))]
    return hashlib.sha256("\0".join(parts).encode()).hexdigest()[:32]


@functools.cache
def _build_identity() -> str:
    """torch, Python, this CPU and the source of the code the regions run (kvsession's
    model and kernels packages, Python and C++)."""
    digest = hashlib.sha256()
    for package in (Path(__file__).parent, Path(cpp_build.__file__).parent):
        for f in sorted(package.iterdir()):
            if f.suffix in (".py", ".cpp"):
                digest.update(f.name.encode() + b"\0" + f.read_bytes())
    return "\0".join([torch.__version__, sys.version, platform.machine(), cpp_build.cpu_id(),
                      torch.backends.cpu.get_cpu_capability(), digest.hexdigest()])


def _signature(args: Sequence, deep: bool) -> tuple:
    """What compiled code for `args` depends on. Tensors: dtype, device, shape (a dimension
    marked unbacked as -1), and with `deep` strides, storage offset and the position of the
    first argument sharing its storage, nested sequences included; other values as
    themselves (top level only, without `deep`)."""
    storages: dict[int, int] = {}

    def sig(a):
        if isinstance(a, torch.Tensor):
            # the marks dynamo itself reads (torch/_dynamo/decorators.py, torch 2.13)
            marked = getattr(a, "_dynamo_unbacked_indices", ())
            shape = tuple(-1 if d in marked else n for d, n in enumerate(a.shape))
            if not deep:
                return (a.dtype, a.device, shape)
            ptr = a.untyped_storage().data_ptr()
            return (a.dtype, a.device, shape, a.stride(), a.storage_offset(),
                    storages.setdefault(ptr, len(storages)))
        if isinstance(a, (list, tuple)):
            return (type(a).__name__, tuple(sig(x) for x in a)) if deep \
                else (type(a).__name__, len(a))
        return (type(a).__name__, a)

    return tuple(sig(a) for a in args)


def _mtime(path: Path) -> float:
    try:
        return path.stat().st_mtime
    except FileNotFoundError:
        return 0.0


def _clone(fn: Callable) -> Callable:
    return types.FunctionType(fn.__code__.replace(), fn.__globals__, fn.__name__)
