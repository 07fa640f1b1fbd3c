"""Compile every kernel for a GPU without one: `python -m kvsession.kernels.aot [--arch 90]`.

The interpreter (TRITON_INTERPRET=1) checks what the kernels compute; it does not check that
they compile. Triton's compiler needs no GPU, only a target, so this runs the real wrappers
on CPU tensors with Llama-8B-like shapes while `JITFunction.run` is replaced by "compile for
the target, do not launch": the argument checks, launch parameters, constexprs and
specialisation are exactly what a GPU run would use. For each compiled kernel it reports,
from the cubin (`cuobjdump`): registers, shared memory, local memory (register spills) and
whether the dot products became tensor-core instructions (HMMA / HGMMA) or FFMA loops.

Must run without TRITON_INTERPRET (a subprocess does this for the tests); uses Triton 3.9's
launcher internals (`create_function_from_signature`, `_pack_args`).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

SHARED_LIMIT_BYTES = {80: 163 * 1024, 89: 99 * 1024, 90: 227 * 1024}


@dataclass
class Compiled:
    case: str
    kernel: str
    num_warps: int
    num_stages: int
    registers: int
    shared_bytes: int
    local_bytes: int  # > 0: the kernel spills registers to local memory
    tensor_cores: bool  # HMMA / HGMMA in the SASS
    ffma: int  # scalar fused multiply-adds in the SASS


def _cuobjdump() -> Path:
    import triton

    return Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"


def _inspect(case: str, name: str, kernel) -> Compiled:
    with tempfile.TemporaryDirectory() as tmp:
        cubin = Path(tmp) / "k.cubin"
        cubin.write_bytes(kernel.asm["cubin"])
        res = subprocess.run([_cuobjdump(), "-res-usage", cubin], capture_output=True,
                             text=True, check=True).stdout
        sass = subprocess.run([_cuobjdump(), "-sass", cubin], capture_output=True, text=True,
                              check=True).stdout
    field = {k: int(v) for k, v in re.findall(r"(REG|SHARED|LOCAL):(\d+)", res)}
    md = kernel.metadata
    return Compiled(case=case, kernel=name, num_warps=md.num_warps, num_stages=md.num_stages,
                    registers=field.get("REG", 0),
                    shared_bytes=max(md.shared, field.get("SHARED", 0)),
                    local_bytes=field.get("LOCAL", 0),
                    tensor_cores=bool(re.search(r"\bH(G)?MMA\b", sass)),
                    ffma=len(re.findall(r"\bFFMA\b", sass)))


def compile_all(arch: int = 90) -> list[Compiled]:
    """Compile each kernel configuration the engine launches, for sm_<arch>."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource, compile, make_backend
    from triton.runtime.jit import JITFunction, create_function_from_signature

    if os.environ.get("TRITON_INTERPRET") == "1":
        raise RuntimeError("kernels.aot compiles real kernels: unset TRITON_INTERPRET")
    target = GPUTarget("cuda", arch, 32)
    backend = make_backend(target)
    results: list[Compiled] = []
    case = ["?"]

    def compile_only(self, *args, grid, warmup, **kwargs):
        kwargs.setdefault("debug", False)
        binder = create_function_from_signature(self.signature, self.params, backend)
        bound, specialization, options = binder(*args, **kwargs)
        options, signature, constexprs, attrs = self._pack_args(backend, kwargs, bound,
                                                                specialization, options)
        kernel = compile(ASTSource(self, signature, constexprs, attrs), target=target,
                         options=options.__dict__)
        results.append(_inspect(case[0], self.__name__, kernel))
        return kernel

    original = JITFunction.run
    JITFunction.run = compile_only
    try:
        for case[0], launch in _cases():
            launch()
    finally:
        JITFunction.run = original
    return results


def _cases():
    """(name, launch) for the configurations a bf16 / fp8 Llama-8B-shaped engine uses."""
    from kvsession.kernels import reference as R
    from kvsession.kernels.block_copy import gather_blocks, scatter_blocks
    from kvsession.kernels.paged_attention import paged_attention
    from kvsession.kernels.prefill_attention import prefill_attention
    from kvsession.kernels.store_kv import store_kv

    heads, kv_heads, dim, bs, num_blocks = 32, 8, 128, 16, 64
    bf16 = torch.bfloat16
    k = torch.zeros(num_blocks, bs, kv_heads, dim, dtype=bf16)
    (k8, s8) = R.quantize_fp8(k.float())
    tables = torch.arange(num_blocks).view(2, 32)
    lens = torch.tensor([500, 300])
    q = torch.zeros(2, heads, dim, dtype=bf16)
    qp = torch.zeros(64, heads, dim, dtype=bf16)
    qsl = torch.tensor([0, 40, 64])
    new = torch.zeros(2, kv_heads, dim, dtype=bf16)
    slots = torch.tensor([3, 70])
    pool = torch.zeros(4, num_blocks, bs, kv_heads, dim, dtype=bf16)
    staging = torch.zeros(4, 8, bs, kv_heads, dim, dtype=bf16)
    ids = torch.arange(8)
    for name, kv, ks in (("bf16", k, None), ("fp8", k8, s8)):
        yield f"decode {name} one split", lambda kv=kv, ks=ks: paged_attention(
            q, kv, kv, tables, lens, 0.1, ks, ks, num_splits=1)
        yield f"decode {name} split-K", lambda kv=kv, ks=ks: paged_attention(
            q, kv, kv, tables, lens, 0.1, ks, ks, num_splits=4)
        yield f"prefill {name}", lambda kv=kv, ks=ks: prefill_attention(
            qp, kv, kv, tables, qsl, lens, 0.1, ks, ks, max_query_len=40)
        yield f"store_kv {name}", lambda kv=kv, ks=ks: store_kv(new, new, kv, kv, slots, ks, ks)
    yield "decode fp32", lambda: paged_attention(q.float(), k.float(), k.float(), tables, lens,
                                                 0.1, num_splits=1)
    yield "block gather", lambda: gather_blocks(pool, staging, ids)
    yield "block scatter", lambda: scatter_blocks(staging, pool, ids)


def problems(results: list[Compiled], arch: int) -> list[str]:
    """What would hurt on the GPU: spills, shared memory over the limit, half-precision
    attention without tensor cores."""
    out = []
    limit = SHARED_LIMIT_BYTES.get(arch, 99 * 1024)
    for r in results:
        if r.local_bytes:
            out.append(f"{r.case} / {r.kernel}: {r.local_bytes} bytes of local memory (spills)")
        if r.shared_bytes > limit:
            out.append(f"{r.case} / {r.kernel}: {r.shared_bytes} bytes shared > {limit}")
        half = ("bf16" in r.case or "fp8" in r.case) and r.kernel in ("_decode_split",
                                                                     "_prefill")
        if half and not r.tensor_cores:
            out.append(f"{r.case} / {r.kernel}: no tensor-core instructions")
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--arch", type=int, default=90, help="compute capability, e.g. 80, 90")
    ap.add_argument("--json", action="store_true", help="print the results as JSON")
    args = ap.parse_args(argv)
    results = compile_all(args.arch)
    bad = problems(results, args.arch)
    if args.json:
        print(json.dumps({"arch": args.arch, "kernels": [asdict(r) for r in results],
                          "problems": bad}))
    else:
        for r in results:
            print(f"{r.case:22s} {r.kernel:14s} warps {r.num_warps} stages {r.num_stages} "
                  f"regs {r.registers:3d} shared {r.shared_bytes:6d} local {r.local_bytes} "
                  f"tensor-cores {r.tensor_cores} ffma {r.ffma}")
        for b in bad:
            print("PROBLEM:", b)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
