"""Building a C++ kernel with the system's compiler, at first use, for this CPU.

A kernel (cpu_decode.cpp, q8_matmul.cpp) is compiled with `$CXX` (else g++ / c++ /
clang++) into `$KVSESSION_CACHE/kernels` (default ~/.cache/kvsession/kernels) under a name
keyed by its sources, the flags, the compiler, the CPU and torch's version, so a change of
any of them builds anew and an unchanged one loads at once. Callers load the library
(ctypes or torch.ops.load_library) and fall back to their torch twin when it does not
build, saying why once.
"""

from __future__ import annotations

import ctypes
import enum
import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
import threading
from collections.abc import Callable
from pathlib import Path

import torch

log = logging.getLogger("kvsession")

BUILD_TIMEOUT_S = 120.0
# a plain C++ kernel: optimised for this CPU, OpenMP for the threads, no torch headers.
# -ffast-math lets loops call glibc's vector math (libmvec: its declarations need
# finite-math-only too). Compiled and linked in two steps: linking with -ffast-math adds
# gcc's crtfastmath, whose constructor turns on flush-to-zero for the whole process when
# the library loads.
KERNEL_COMPILE_FLAGS = ["-O3", "-march=native", "-ffast-math", "-fopenmp", "-fPIC",
                        "-std=c++17", "-c"]
KERNEL_LINK_FLAGS = ["-shared", "-fopenmp"]


def cache_root() -> Path:
    """kvsession's cache directory: $KVSESSION_CACHE, default ~/.cache/kvsession."""
    return Path(os.environ.get("KVSESSION_CACHE") or Path.home() / ".cache" / "kvsession")


def cache_dir() -> Path:
    return cache_root() / "kernels"


@functools.cache
def _found_compiler() -> str | None:
    return next((c for c in ("g++", "c++", "clang++") if shutil.which(c)), None)


def compiler() -> str | None:
    return os.environ.get("CXX") or _found_compiler()


def cpu_id() -> str:
    """This CPU's identity for caches of code built for it (its feature flags)."""
    try:
        with open("/proc/cpuinfo") as f:
            return next((line for line in f if line.startswith("flags")), "")
    except OSError:
        return platform.processor()


def library_path(cxx: str, directory: Path, name: str, sources: list[Path],
                 flags: list[str]) -> Path:
    """Where the library built from `sources` with `flags` by `cxx` for this CPU and this
    torch lives (a new name whenever any of them changes)."""
    digest = hashlib.sha256(b"\0".join([*(p.read_bytes() for p in sources),
                                        " ".join(flags).encode(), cxx.encode(),
                                        cpu_id().encode(), torch.__version__.encode()]))
    return directory / f"{name}-{digest.hexdigest()[:16]}.so"


def build(cxx: str, lib: Path, errors: list[str], source: Path, compile_flags: list[str],
          link_flags: list[str], libs: tuple[str, ...] = (),
          link_variants: tuple[tuple[str, ...], ...] = ((),)) -> None:
    """Compile `source` and link it into `lib` (`libs` after the object: a linker that drops
    libraries nothing before them needs would drop them otherwise), trying each of
    `link_variants` (extra libraries, best first) until one links; each failed step's
    reason goes to `errors`. Built under temporary names and renamed: processes building
    at once (test workers, Ray replicas) never load a half-written library."""
    lib.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=lib.parent) as tmp:
        obj, out = Path(tmp) / f"{source.stem}.o", Path(tmp) / f"{source.stem}.so"
        steps = [[cxx, *compile_flags, str(source), "-o", str(obj)]]
        for link in link_variants:
            try:
                for cmd in steps + [[cxx, *link_flags, str(obj), "-o", str(out), *libs,
                                     *link]]:
                    subprocess.run(cmd, check=True, capture_output=True,
                                   timeout=BUILD_TIMEOUT_S)
                os.replace(out, lib)
                return
            except (OSError, subprocess.SubprocessError) as e:
                detail = getattr(e, "stderr", b"") or b""
                errors.append(f"{e} {detail.decode(errors='replace')[-500:]}")
                steps = [] if obj.is_file() else steps  # compiled: only link again


class CtypesKernel:
    """One C++ entry point, built at first use with the plain kernel flags and bound with
    ctypes; `get()` is the function, or None where it cannot be built (why is logged once
    per compiler and cache directory: the caller's torch twin serves). `link_variants`:
    extra libraries to link with, best first (`build`)."""

    def __init__(self, source: Path, symbol: str, argtypes: list, restype, what: str,
                 fallback: str, link_variants: tuple[tuple[str, ...], ...] = ((),)):
        self.source, self.symbol, self.argtypes, self.restype = source, symbol, argtypes, restype
        self.what, self.fallback = what, fallback  # for the log: "the int8 product kernel"
        self.link_variants = link_variants
        self._lock = threading.Lock()
        # (compiler, directory) -> the entry point or None; also by get()'s arguments and
        # the environment variables that decide them, so that a known answer costs one
        # lookup (callers may call get() per use)
        self._loaded: dict[tuple, Callable | None] = {}

    def get(self, cxx: str | None = None, directory: Path | None = None) -> Callable | None:
        """The entry point, built if needed with `cxx` (default `compiler()`) into
        `directory` (default `cache_dir()`); None when it cannot be built or loaded."""
        env = os.environ
        fast = (cxx, directory, env.get("CXX"), env.get("KVSESSION_CACHE"))
        fn = self._loaded.get(fast, self._lock)
        if fn is not self._lock:
            return fn
        cxx = cxx or compiler()
        directory = directory or cache_dir()
        key = (cxx, str(directory))
        with self._lock:
            if key not in self._loaded:
                self._loaded[key] = self._build_and_load(cxx, directory)
            self._loaded[fast] = self._loaded[key]
            return self._loaded[key]

    def _build_and_load(self, cxx: str | None, directory: Path) -> Callable | None:
        if cxx is None:
            log.warning("%s is not used: no C++ compiler found (set CXX); %s", self.what,
                        self.fallback)
            return None
        lib = library_path(cxx, directory, self.source.stem, [self.source],
                           KERNEL_COMPILE_FLAGS + KERNEL_LINK_FLAGS)
        errors: list[str] = []
        try:
            if not lib.is_file():
                build(cxx, lib, errors, self.source, KERNEL_COMPILE_FLAGS, KERNEL_LINK_FLAGS,
                      link_variants=self.link_variants)
            fn = getattr(ctypes.CDLL(str(lib)), self.symbol)
        except (OSError, AttributeError) as e:  # no library (the build failed), a directory
            # that cannot be written, a library without the entry point
            errors.append(str(e))
            log.warning("%s is not used (building it with %s into %s failed: %s); %s",
                        self.what, cxx, directory, " | ".join(errors), self.fallback)
            return None
        fn.argtypes, fn.restype = self.argtypes, self.restype
        return fn


class OpKind(enum.Enum):
    NATIVE = "native"  # a C++ implementation behind torch's dispatcher, no Python
    PYTHON = "python"  # the op's Python implementation (its kernel through ctypes)


def torch_flags(defines: tuple[str, ...] = ()) -> tuple[list[str], list[str], tuple[str, ...]]:
    """(compile flags, link flags, libraries) of an op's library: the kernel flags, plus
    torch's headers and libraries (those of the torch this process runs) and `defines`
    (-D...)."""
    root = Path(torch.__file__).parent
    include = [root / "include", root / "include" / "torch" / "csrc" / "api" / "include"]
    abi = int(torch._C._GLIBCXX_USE_CXX11_ABI)
    compile_flags = [f for f in KERNEL_COMPILE_FLAGS if not f.startswith("-std=")] + [
        "-std=c++20", *defines, f"-D_GLIBCXX_USE_CXX11_ABI={abi}",
        *(f"-I{p}" for p in include)]
    lib = root / "lib"
    return compile_flags, KERNEL_LINK_FLAGS + [f"-L{lib}", f"-Wl,-rpath,{lib}"], ("-ltorch_cpu",
                                                                           "-lc10")


class TorchOp:
    """The CPU implementation of an op a `torch.library.Library` defines: C++ (`source`,
    which includes its kernel's source `kernel`, built like a kernel with torch's headers:
    ~10-20 s once) where it builds and loads, else `python` registered for the CPU. Why
    C++: compiled code (model/onerow.py's one-token regions) calls such ops per layer, and
    a Python implementation's argument boxing, Python and ctypes cost ~30 us a call against
    ~2 us (measured on the decode attention op). `register()` once per process, by callers
    that found the kernel itself loading (`CtypesKernel.get`)."""

    def __init__(self, library: torch.library.Library, name: str, source: Path, kernel: Path,
                 python: Callable, what: str, defines: tuple[str, ...] = (),
                 link_variants: tuple[tuple[str, ...], ...] = ((),)):
        self.library, self.name, self.source, self.kernel = library, name, source, kernel
        self.python, self.what, self.defines = python, what, defines
        self.link_variants = link_variants
        self._lock = threading.Lock()
        self.kind: OpKind | None = None  # the implementation registered, once chosen

    def register(self) -> OpKind:
        """Give the op its CPU implementation, once per process; which one it got."""
        with self._lock:
            if self.kind is not None:
                return self.kind
            cxx, directory = compiler(), cache_dir()
            errors: list[str] = []
            if cxx is not None:
                compile_flags, link_flags, libs = torch_flags(self.defines)
                lib = library_path(cxx, directory, self.source.stem, [self.source, self.kernel],
                                   compile_flags + link_flags + list(libs))
                try:
                    if not lib.is_file():
                        build(cxx, lib, errors, self.source, compile_flags, link_flags, libs,
                              link_variants=self.link_variants)
                    torch.ops.load_library(str(lib))  # its static initialiser registers it
                    self.kind = OpKind.NATIVE
                except (OSError, RuntimeError) as e:  # not built, or torch refused to load it
                    errors.append(str(e))
            if self.kind is None:
                log.warning("%s runs its kernel through Python (building its C++ "
                            "implementation with %s into %s failed: %s)", self.what, cxx,
                            directory, " | ".join(errors) or "no C++ compiler")
                self.library.impl(self.name, self.python, "CPU")
                self.kind = OpKind.PYTHON
            return self.kind
