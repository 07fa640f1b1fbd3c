"""Correctness checks that need a CUDA GPU: compiled kernels (not the interpreter) against the
torch reference, CUDA-graph decode against eager and against the CPU engine, staged host
moves through pinned memory. Speed is bench/gpu_kernels.py's business, not this file's.

Each check is a plain function that raises on failure. `tests/test_gpu.py` runs each one in
a fresh process without TRITON_INTERPRET (the test session runs the kernels through the
interpreter) and skips them all when CUDA is absent. By hand:
`python tests/gpu_checks.py` on a GPU machine, `python tests/gpu_checks.py --device cpu` for
the same code paths with the interpreter.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile

import torch
from internals import Internals

from kernel_cases import FP8, make_cache, tables_for


def _device() -> torch.device:
    return torch.device(os.environ.get("KVSESSION_CHECK_DEVICE", "cuda"))


def kernels_match_reference() -> None:
    """Decode (one split and split-K), prefill, store and block copy on the device against
    the float32 torch reference on CPU, bf16 and fp8 caches with bf16 queries."""
    from kvsession.kernels import reference as R
    from kvsession.kernels.block_copy import gather_blocks
    from kvsession.kernels.paged_attention import paged_attention
    from kvsession.kernels.prefill_attention import prefill_attention
    from kvsession.kernels.store_kv import store_kv

    dev = _device()
    g = torch.Generator().manual_seed(0)
    heads, kv_heads, dim, bs, num_blocks = 32, 8, 128, 16, 96
    lens = [1, 16, 100, 700, 0]
    tables = tables_for(lens, bs, 48, num_blocks)
    q = torch.randn(len(lens), heads, dim, generator=g).bfloat16()
    for dtype, tol in ((torch.bfloat16, 1.5e-2), (FP8, 1.5e-1)):
        k, v, ks, vs = make_cache(dtype, num_blocks, bs, kv_heads, dim)
        want = R.paged_attention(q.float(), k, v, tables, torch.tensor(lens), 0.088, ks, vs)
        on = [None if t is None else t.to(dev) for t in (k, v, ks, vs)]
        for splits in (1, None):
            got = paged_attention(q.to(dev), on[0], on[1], tables.to(dev),
                                  torch.tensor(lens, device=dev), 0.088, on[2], on[3],
                                  num_splits=splits)
            torch.testing.assert_close(got.float().cpu(), want, atol=tol, rtol=1e-2)
        # prefill: 60 new tokens after a 640-token prefix, and a fresh 100-token prompt
        plan_lens, starts = [700, 100], [0, 60, 160]
        qp = torch.randn(160, heads, dim, generator=g).bfloat16()
        pt = tables[[3, 2]]
        want = R.prefill_attention(qp.float(), k, v, pt, starts, plan_lens, 0.088, ks, vs)
        got = prefill_attention(qp.to(dev), on[0], on[1], pt.to(dev),
                                torch.tensor(starts, device=dev),
                                torch.tensor(plan_lens, device=dev), 0.088, on[2], on[3])
        torch.testing.assert_close(got.float().cpu(), want, atol=tol, rtol=1e-2)
    # store (fp8: same bytes as the reference's rounding) and block copy: exact
    key = torch.randn(5, kv_heads, dim, generator=g) * 3
    slots = torch.tensor([0, 17, -1, 300, 1535])
    cpu = [torch.zeros(num_blocks, bs, kv_heads, dim, dtype=FP8) for _ in range(2)]
    sc = [torch.ones(num_blocks, bs, kv_heads, dtype=torch.float16) for _ in range(2)]
    R.store_kv(key, key, cpu[0], cpu[1], slots, sc[0], sc[1])
    gpu = [t.to(dev) for t in (*cpu, *sc)]
    for t in gpu:
        t.zero_() if t.dtype == FP8 else t.fill_(1)
    store_kv(key.to(dev), key.to(dev), gpu[0], gpu[1], slots.to(dev), gpu[2], gpu[3])
    for a, b in zip((*cpu, *sc), gpu, strict=True):
        assert torch.equal(a.view(torch.uint8), b.cpu().view(torch.uint8))
    pool = torch.stack(make_cache(torch.float32, num_blocks, bs, kv_heads, dim)[:2]).to(dev)
    staging = torch.zeros((2, 3, bs, kv_heads, dim), device=dev)
    gather_blocks(pool, staging, torch.tensor([5, -1, 90], device=dev))
    assert torch.equal(staging[:, 0], pool[:, 5]) and torch.equal(staging[:, 2], pool[:, 90])


def graphs_match_eager_and_cpu() -> None:
    """A float32 tiny model on the device (Triton kernels, decode from CUDA graphs) gives the
    same greedy tokens as the CPU torch path, which tests/test_parity.py ties to
    transformers; batch sizes fill several graph buckets."""
    from kvsession import LLM, SamplingParams
    from kvsession.testing import make_tiny_model

    dev = _device()
    with tempfile.TemporaryDirectory() as tmp:
        model = make_tiny_model(tmp, arch="llama")
        params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
        prompts = [[(i * 13 + j) % 500 + 1 for j in range(5 + 9 * i)] for i in range(7)]
        outs = []
        runs = (("cpu", "torch"), (dev.type, "auto" if dev.type == "cuda" else "triton"))
        for where, backend in runs:
            with LLM(model, device=where, dtype="float32", kv_cache_dtype="float32",
                     kv_cache_memory="8MiB", max_model_len=256,
                     attention_backend=backend) as llm:
                runner = Internals(llm).runner
                outs.append([[o.token_ids for o in llm.generate(
                    prompt_token_ids=prompts[:n], sampling_params=params, use_tqdm=False)]
                    for n in (1, 3, 7)])
                if where == "cuda":
                    assert runner.graphs is not None and runner.graphs.capture
                    assert {1, 4, 8} <= set(runner.graphs._graphs), runner.graphs._graphs
        assert outs[0] == outs[1]


def fp8_default_and_staged_host_tier() -> None:
    """The GPU default (fp8 KV), a bf16 model, a session spilled to pinned host memory
    through the staging path and restored: its continuation equals the never-spilled one."""
    from kvsession import LLM, SamplingParams
    from kvsession.cache.manager import Tier
    from kvsession.testing import make_tiny_model

    dev = _device()
    with tempfile.TemporaryDirectory() as tmp:
        model = make_tiny_model(tmp, arch="qwen3")
        sp = SamplingParams(max_tokens=10, temperature=0.0)
        got = []
        for spill in (False, True):
            with LLM(model, device=dev.type, dtype="bfloat16", kv_cache_memory="8MiB",
                     host_cache_memory="4MiB", max_model_len=512) as llm:
                assert llm.config.kv_cache_dtype == FP8 or dev.type == "cpu"
                assert Internals(llm).host_staged == (dev.type == "cuda")
                with llm.session(system="You are terse.", sampling=sp) as s:
                    turns = [s.send("first question").token_ids]
                    if spill:
                        Internals(llm).spill(s, Tier.HOST)
                        assert s.state == "host"
                    r = s.send("second question")
                    assert r.restored_from == "host" or not spill
                    turns.append(r.token_ids)
                got.append(turns)
        assert got[0] == got[1]


CHECKS = {f.__name__: f for f in (kernels_match_reference, graphs_match_eager_and_cpu,
                                  fp8_default_and_staged_host_tier)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("names", nargs="*", help=f"checks to run (default all): {list(CHECKS)}")
    ap.add_argument("--device", default="cuda")
    args = ap.parse_args()
    os.environ["KVSESSION_CHECK_DEVICE"] = args.device
    if args.device == "cpu":
        os.environ["TRITON_INTERPRET"] = "1"
    for name in args.names or CHECKS:
        CHECKS[name]()
        print(f"ok {name}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
