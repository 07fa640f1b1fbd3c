"""Every Triton kernel against its torch reference twin, on CPU tensors through Triton's
interpreter (TRITON_INTERPRET=1, set in conftest). Cases are chosen so that every dtype,
block size, head_dim and GQA ratio appears with short, block-aligned, partial, padded and
very different sequence lengths, while the interpreter runs stay small."""

from __future__ import annotations

import pytest
import torch
from internals import Internals

from kernel_cases import FP8, make_cache, tables_for
from kvsession import LLM, SamplingParams
from kvsession.kernels import reference as R
from kvsession.kernels.block_copy import copy_blocks, gather_blocks, scatter_blocks
from kvsession.kernels.checks import KernelArgumentError
from kvsession.kernels.paged_attention import paged_attention
from kvsession.kernels.prefill_attention import prefill_attention
from kvsession.kernels.store_kv import store_kv

F16, BF16 = torch.float16, torch.bfloat16
# (cache dtype, query dtype) -> (atol, rtol). fp32 queries: exact float32 products, so fp8
# matches its float32 reference to 1e-4. Half queries: half dot products (tensor cores on a
# GPU); the bounds are bf16 1.5e-2/1e-2 and fp8 1.5e-1.
TOL = {(torch.float32, torch.float32): (1e-5, 1e-5), (BF16, BF16): (1.5e-2, 1e-2),
       (F16, F16): (5e-3, 5e-3), (FP8, torch.float32): (1e-4, 1e-4), (FP8, F16): (1e-2, 1e-2)}


def query_dtype(dtype):
    """The query dtype a cache dtype is tested with (fp8 caches with float32 queries)."""
    return torch.float32 if dtype == FP8 else dtype


def close(got, want, dtype, qdtype=None):
    atol, rtol = TOL[dtype, qdtype or query_dtype(dtype)]
    torch.testing.assert_close(got.float(), want.float(), atol=atol, rtol=rtol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, FP8])
@pytest.mark.parametrize("block_size, head_dim", [(16, 64), (32, 128)])
def test_store_kv_matches_reference_exactly(dtype, block_size, head_dim):
    num_blocks, heads = 6, 2
    cache = [torch.zeros(num_blocks, block_size, heads, head_dim, dtype=dtype)
             for _ in range(4)]
    scales = [torch.ones(num_blocks, block_size, heads, dtype=torch.float16)
              for _ in range(4)] if dtype == FP8 else [None] * 4
    g = torch.Generator().manual_seed(1)
    src_dtype = torch.float32 if dtype == FP8 else dtype
    key = (torch.randn(7, heads, head_dim, generator=g) * 5).to(src_dtype)
    value = torch.randn(7, heads, head_dim, generator=g).to(src_dtype)
    key[2, 1, 3] = float("nan")
    value[4, 0, 0] = float("-inf")
    slots = torch.tensor([0, block_size - 1, -1, block_size, 3 * block_size + 5, -1,
                          num_blocks * block_size - 1])
    R.store_kv(key, value, cache[0], cache[1], slots, scales[0], scales[1])
    store_kv(key, value, cache[2], cache[3], slots, scales[2], scales[3])
    for a, b in ((cache[0], cache[2]), (cache[1], cache[3])):
        assert torch.equal(a.view(torch.uint8), b.view(torch.uint8))
    if dtype == FP8:
        assert torch.equal(scales[0], scales[2]) and torch.equal(scales[1], scales[3])
        # dequantized values against the input: e4m3 keeps 3 mantissa bits, so the relative
        # error is at most 2^-4 (the issue allows rtol 0.1); non-finite inputs excluded
        for src, c, sc in ((key, cache[2], scales[2]), (value, cache[3], scales[3])):
            keep = slots >= 0
            stored = c.view(-1, heads, head_dim)[slots[keep]].float()
            deq = stored * sc.view(-1, heads)[slots[keep]].float()[..., None]
            want = src[keep]
            finite = want.isfinite()
            torch.testing.assert_close(deq[finite], want[finite], atol=1e-3, rtol=0.0625)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, FP8])
def test_block_copy_gathers_and_scatters_exactly(dtype):
    k, v, ks, _ = make_cache(dtype, 12, 16, 2, 64)
    pool = torch.stack([k, v])  # [layers=2, blocks, ...]: block id in dim 1
    ids = torch.tensor([7, 0, -1, 11, 3])
    staging = torch.zeros((2, 5, *pool.shape[2:]), dtype=dtype)
    gather_blocks(pool, staging, ids)
    want = torch.zeros_like(staging)
    R.copy_blocks(pool, want, ids[ids >= 0], torch.tensor([0, 1, 3, 4]))
    assert torch.equal(staging.view(torch.uint8), want.view(torch.uint8))
    back = torch.zeros_like(pool)
    scatter_blocks(staging, back, ids)
    keep = ids[ids >= 0]
    assert torch.equal(back[:, keep].view(torch.uint8), pool[:, keep].view(torch.uint8))
    assert int(back.view(torch.uint8)[:, [1, 2]].sum()) == 0  # untouched blocks
    if ks is not None:  # scales move the same way
        sp = torch.stack([ks, ks * 2])
        st = torch.zeros((2, 5, *sp.shape[2:]), dtype=sp.dtype)
        gather_blocks(sp, st, ids)
        assert torch.equal(st[:, 3], sp[:, 11])


DECODE_CASES = [  # cache dtype, query dtype, block_size, head_dim, gqa ratio, num_kv_heads
    (torch.float32, torch.float32, 16, 64, 1, 2),
    (BF16, BF16, 32, 128, 4, 2),
    (FP8, torch.float32, 16, 128, 8, 1),
    (torch.float32, torch.float32, 32, 64, 8, 1),
    (BF16, BF16, 16, 64, 4, 1),
    (FP8, torch.float32, 32, 64, 1, 2),
    (F16, F16, 16, 128, 4, 2),  # half-precision dot path
    (FP8, F16, 32, 128, 8, 1),  # fp8 blocks into half dots, scales on the fp32 results
]


@pytest.mark.parametrize("dtype, qdtype, block_size, head_dim, gqa, kv_heads", DECODE_CASES)
@pytest.mark.parametrize("num_splits", [1, 3])
def test_paged_decode_attention(dtype, qdtype, block_size, head_dim, gqa, kv_heads,
                                num_splits):
    # 0: a padded (CUDA graph) row; 150 and 1: very different lengths in one batch
    lens = [1, block_size, 2 * block_size, 37, 0, 150]
    num_blocks = 40
    k, v, ks, vs = make_cache(dtype, num_blocks, block_size, kv_heads, head_dim)
    tables = tables_for(lens, block_size, 12, num_blocks)
    q = torch.randn(len(lens), kv_heads * gqa, head_dim,
                    generator=torch.Generator().manual_seed(11)).to(qdtype)
    seq_lens = torch.tensor(lens)
    scale = head_dim ** -0.5
    before = (k.clone(), v.clone(), q.clone())
    want = R.paged_attention(q, k, v, tables, seq_lens, scale, ks, vs)
    got = paged_attention(q, k, v, tables, seq_lens, scale, ks, vs, num_splits=num_splits)
    close(got, want, dtype, qdtype)
    assert float(got[4].abs().max()) == 0.0
    assert all(torch.equal(a.view(torch.uint8), b.view(torch.uint8))  # inputs untouched
               for a, b in zip(before, (k, v, q), strict=True))


PREFILL_CASES = [  # cache dtype, query dtype, block_size, head_dim, gqa ratio
    (torch.float32, torch.float32, 16, 64, 1),
    (BF16, BF16, 32, 128, 4),
    (FP8, torch.float32, 16, 64, 8),
    (torch.float32, torch.float32, 32, 128, 8),
    (FP8, torch.float32, 32, 128, 4),
    (F16, F16, 16, 64, 4),
    (FP8, F16, 16, 128, 1),
]


@pytest.mark.parametrize("dtype, qdtype, block_size, head_dim, gqa", PREFILL_CASES)
def test_prefill_attention_over_paged_prefix(dtype, qdtype, block_size, head_dim, gqa):
    # (cached prefix, new tokens): fresh prompts, block-aligned, a chunk after a prefix hit,
    # a single token, an empty (padded) entry, and a 70-token chunk over a 130-token prefix
    # (two query tiles, both unmasked and causal key tiles)
    plan = [(0, 1), (0, block_size), (block_size, 9), (37, 20), (5, 0), (0, 23), (130, 70)]
    lens = [c + n for c, n in plan]
    k, v, ks, vs = make_cache(dtype, 40, block_size, 1, head_dim, seed=2)
    tables = tables_for(lens, block_size, 13, 40, seed=3)
    starts = [0]
    for _, n in plan:
        starts.append(starts[-1] + n)
    q = torch.randn(starts[-1], gqa, head_dim,
                    generator=torch.Generator().manual_seed(12)).to(qdtype)
    scale = head_dim ** -0.5
    want = R.prefill_attention(q, k, v, tables, starts, lens, scale, ks, vs)
    got = prefill_attention(q, k, v, tables, torch.tensor(starts), torch.tensor(lens), scale,
                            ks, vs)
    close(got, want, dtype, qdtype)


def test_block_ids_beyond_int32_offsets():
    # 2^31 / (16 * 8 * 128) blocks: byte offsets of the top blocks do not fit in int32.
    # torch.zeros is lazily committed: only the pages touched here use memory.
    bs, heads, dim = 16, 8, 128
    num_blocks = 2**31 // (bs * heads * dim) + 64
    k = torch.zeros(num_blocks, bs, heads, dim, dtype=FP8)
    v = torch.zeros_like(k)
    ks = torch.ones(num_blocks, bs, heads, dtype=torch.float16)
    vs = torch.ones_like(ks)
    lens = [40, 17]
    tables = tables_for(lens, bs, 3, num_blocks, high=True)
    g = torch.Generator().manual_seed(4)
    slots = torch.cat([tables[i, torch.arange(n) // bs] * bs + torch.arange(n) % bs
                       for i, n in enumerate(lens)])
    store_kv(torch.randn(57, heads, dim, generator=g), torch.randn(57, heads, dim, generator=g),
             k, v, slots, ks, vs)
    assert int(tables.max()) * bs * heads * dim >= 2**31
    q = torch.randn(2, heads * 2, dim, generator=g)
    seq_lens = torch.tensor(lens)
    want = R.paged_attention(q, k, v, tables, seq_lens, 0.1, ks, vs)
    got = paged_attention(q, k, v, tables, seq_lens, 0.1, ks, vs, num_splits=2)
    close(got, want, FP8)
    assert float(want.abs().max()) > 0
    # prefill of each sequence's last 9 tokens over the rest, and a block gather, up there too
    qp = torch.randn(18, heads * 2, dim, generator=g)
    starts = [0, 9, 18]
    want = R.prefill_attention(qp, k, v, tables, starts, lens, 0.1, ks, vs)
    got = prefill_attention(qp, k, v, tables, torch.tensor(starts), seq_lens, 0.1, ks, vs)
    close(got, want, FP8)
    top = tables[0, :3]
    staging = torch.zeros((1, 3, bs, heads, dim), dtype=FP8)
    gather_blocks(k.unsqueeze(0), staging, top)
    assert torch.equal(staging[0].view(torch.uint8), k[top].view(torch.uint8))


def test_wrappers_reject_bad_arguments():
    from kvsession import KVSessionError

    assert issubclass(KernelArgumentError, KVSessionError)
    assert issubclass(KernelArgumentError, ValueError)
    k, v, _, _ = make_cache(torch.float32, 4, 16, 2, 64)
    q = torch.randn(2, 4, 64)
    tables = torch.zeros(2, 2, dtype=torch.long)
    with pytest.raises(KernelArgumentError, match="head_dim"):
        paged_attention(torch.randn(2, 4, 32), k, v, tables, torch.tensor([1, 1]), 0.1)
    with pytest.raises(KernelArgumentError, match="int64"):
        paged_attention(q, k, v, tables.int(), torch.tensor([1, 1]), 0.1)
    with pytest.raises(KernelArgumentError, match="fp8"):
        paged_attention(q, k, v, tables, torch.tensor([1, 1]), 0.1,
                        torch.ones(4, 16, 2, dtype=torch.float16), None)
    k8, v8, _, _ = make_cache(torch.float32, 4, 8, 2, 64)
    with pytest.raises(KernelArgumentError, match="block_size"):
        paged_attention(q, k8, v8, tables, torch.tensor([1, 1]), 0.1)
    with pytest.raises(KernelArgumentError, match="slot_mapping"):
        store_kv(torch.randn(3, 2, 64), torch.randn(3, 2, 64), k, v, torch.zeros(2).long())
    with pytest.raises(KernelArgumentError, match="equal length"):
        copy_blocks(k[None], k[None].clone(), torch.tensor([0, 1]), torch.tensor([2]))
    with pytest.raises(KernelArgumentError, match="dtype mismatch"):
        copy_blocks(k[None], k[None].double(), torch.tensor([0]), torch.tensor([1]))


@pytest.mark.parametrize("kv_dtype", ["float32", "fp8"])
def test_engine_generation_with_triton_backend_matches_torch(llama_dir, kv_dtype):
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    prompts = [[(i * 7 + j) % 500 for j in range(n)] for i, n in enumerate([5, 20, 40])]
    outs = {}
    for backend in ("torch", "triton"):
        with LLM(llama_dir, kv_cache_memory="4MiB", max_model_len=128, kv_cache_dtype=kv_dtype,
                 attention_backend=backend, max_num_batched_tokens=32) as llm:
            outs[backend] = [o.token_ids for o in llm.generate(
                prompt_token_ids=prompts, sampling_params=params, use_tqdm=False)]
            again = llm.generate(prompt_token_ids=prompts[2:], sampling_params=params,
                                 use_tqdm=False)[0]
            assert again.num_cached_tokens == 32 and again.token_ids == outs[backend][2]
    assert outs["triton"] == outs["torch"]


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_padded_decode_buckets_match_unpadded(llama_dir, backend):
    """The CUDA-graph decode path pads each step to a bucket (slot -1, seq_len 0, -1 table
    rows); on CPU it runs the same padded step eagerly. Outputs must not change."""
    from kvsession.cache.block_pool import blocks_for
    from kvsession.engine.graphs import DecodeGraphs

    params = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
    ps = [[(i * 5 + j) % 500 for j in range(n)] for i, n in enumerate([3, 17, 30])]
    outs = []
    for padded in (False, True):
        with LLM(llama_dir, kv_cache_memory="4MiB", max_model_len=128,
                 attention_backend=backend) as llm:
            ins = Internals(llm)
            runner = ins.runner
            if padded:
                runner.graphs = DecodeGraphs(ins.model, ins.kv_pool, llm.config.device,
                                             runner.backend, blocks_for(128, 16), 8,
                                             capture=False)
                assert runner.graphs.buckets == [1, 2, 4, 8]
            outs.append([o.token_ids for o in llm.generate(
                prompt_token_ids=ps, sampling_params=params, use_tqdm=False)])
    assert outs[0] == outs[1]


@pytest.mark.parametrize("dtype", [torch.float32, FP8])
@pytest.mark.parametrize("flash_op", [True, False])
def test_reference_cascade_for_a_shared_prefix_matches_plain(dtype, flash_op, monkeypatch):
    """Decode batches whose sequences share leading blocks (a pinned system prompt) read
    them once (two partial softmaxes merged by log-sum-exp); same result as the plain path,
    with PyTorch's CPU flash kernel and with the matmul fallback. The last sequence ends
    exactly at the shared prefix: its suffix part has no key at all."""
    if not flash_op:
        monkeypatch.setattr(R, "_FLASH_CPU", None)
    bs, blocks_shared = 16, R.CASCADE_MIN_BLOCKS
    lens = [blocks_shared * bs + 5, blocks_shared * bs + 40, blocks_shared * bs]
    k, v, ks, vs = make_cache(dtype, 40, bs, 2, 64)
    tables = torch.full((3, 20), -1, dtype=torch.long)
    nxt = blocks_shared
    for i, n in enumerate(lens):
        tables[i, :blocks_shared] = torch.arange(blocks_shared)
        own = -(-n // bs) - blocks_shared
        tables[i, blocks_shared:blocks_shared + own] = torch.arange(nxt, nxt + own)
        nxt += own
    assert R.shared_prefix_blocks(tables, torch.tensor(lens), bs) == blocks_shared
    q = torch.randn(3, 8, 64, generator=torch.Generator().manual_seed(13))
    cascade = R.paged_attention(q, k, v, tables, torch.tensor(lens), 0.125, ks, vs)
    monkeypatch.setattr(R, "CASCADE_MIN_BLOCKS", 10**9)
    plain = R.paged_attention(q, k, v, tables, torch.tensor(lens), 0.125, ks, vs)
    torch.testing.assert_close(cascade, plain, atol=1e-5, rtol=1e-5)
    triton_out = paged_attention(q, k, v, tables, torch.tensor(lens), 0.125, ks, vs)
    torch.testing.assert_close(triton_out, plain, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_reference_prefill_reads_a_run_of_blocks_in_place(dtype, monkeypatch):
    """A chunk over a context whose blocks are consecutive ids attends over a view of the
    cache (no gather); the same blocks scattered are gathered: the same output, bit for
    bit, and the view path copies no context."""
    bs, lens = 16, [75, 40, 33]  # (cached, new): (60, 15), (0, 40), (30, 3)
    k, v, _, _ = make_cache(dtype, 20, bs, 2, 64, seed=4)
    run = torch.full((3, 6), -1, dtype=torch.long)
    run[0, :5] = torch.arange(3, 8)  # one run
    run[1, :3] = torch.tensor([9, 10, 11])  # a fresh prompt over a run
    run[2, :3] = torch.tensor([12, 13, 15])  # not a run: gathered
    perm = torch.randperm(20, generator=torch.Generator().manual_seed(5))
    scattered = perm[run.clamp_min(0)].masked_fill(run < 0, -1)
    ks, vs = torch.empty_like(k), torch.empty_like(v)
    ks[perm], vs[perm] = k, v  # block b's data at perm[b]
    starts = [0, 15, 55, 58]
    q = torch.randn(58, 4, 64, generator=torch.Generator().manual_seed(6)).to(dtype)
    gathered = []
    real = R.gather_kv
    monkeypatch.setattr(R, "gather_kv", lambda *a, **kw: gathered.append(a[2]) or real(*a, **kw))
    memo: dict = {}
    got = R.prefill_attention(q, k, v, run, starts, lens, 0.125, memo=memo)
    assert len(gathered) == 2 and torch.equal(gathered[0], run[2])  # only the non-run
    assert memo[("prefill_run", 0)] == 3 and memo[("prefill_run", 2)] is None
    want = R.prefill_attention(q, ks, vs, scattered, starts, lens, 0.125)
    assert torch.equal(got, want)


def test_kernels_compile_for_hopper_without_spills():
    """The interpreter checks what the kernels compute, not that they compile: compile every
    configuration the engine launches for sm_90 (no GPU needed), through the real wrappers.
    Half-precision attention must use tensor cores, float32 exact FMAs; nothing may spill or
    exceed shared memory."""
    import json
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_DEFAULT_FP_FUSION"] = "1"
    proc = subprocess.run([sys.executable, "-m", "kvsession.kernels.aot", "--arch", "90",
                           "--json"], capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    assert report["problems"] == []
    by_case = {(r["case"], r["kernel"]): r for r in report["kernels"]}
    for dtype in ("bf16", "fp8"):
        assert by_case[f"decode {dtype} one split", "_decode_split"]["tensor_cores"]
        assert by_case[f"prefill {dtype}", "_prefill"]["tensor_cores"]
        assert (f"decode {dtype} one split", "_decode_reduce") not in by_case  # no 2nd pass
        assert (f"decode {dtype} split-K", "_decode_reduce") in by_case
    fp32 = by_case["decode fp32", "_decode_split"]
    assert not fp32["tensor_cores"] and fp32["ffma"] > 1000
    assert {k for _, k in by_case} == {"_decode_split", "_decode_reduce", "_prefill",
                                      "_store_kv", "_copy"}


def test_staged_host_moves_and_copy_on_write_through_the_kernel():
    """With use_kernels (the CUDA setting) host-tier moves are staged through the block-copy
    kernel and copy-on-write launches it; bytes must equal the plain slice-copy path's, for
    fragmented ids on both sides, fp8 scales included."""
    from kvsession.cache.kv_pool import KVPool
    from kvsession.tiers.host import HostPool

    cpu = torch.device("cpu")
    pools = [KVPool(2, 12, 16, 2, 64, FP8, cpu, use_kernels=u) for u in (False, True)]
    g = torch.Generator().manual_seed(5)
    for name, t in pools[0].tensors().items():
        raw = t.view(torch.uint8)
        raw.copy_(torch.randint(0, 256, raw.shape, generator=g, dtype=torch.uint8))
        pools[1].tensors()[name].view(torch.uint8).copy_(raw)
    hosts = [HostPool(p, 10) for p in pools]
    assert [h.staged for h in hosts] == [False, True]
    for h, p in zip(hosts, pools, strict=True):
        h.tensors = {n: torch.zeros_like(t) for n, t in h.tensors.items()}
        assert h.store(p, [7, 2, 3, 11], [9, 0, 4, 5]) / 4 == h.load(p, [5, 9, 0],
                                                                    [0, 1, 8]) / 3
        p.copy_block(3, 6)
    for name in pools[0].tensors():
        a, b = (h.tensors[name].view(torch.uint8) for h in hosts)
        assert torch.equal(a, b) and int(a[:, [1, 2, 3]].sum()) == 0
        assert torch.equal(b[:, 9], pools[1].tensors()[name].view(torch.uint8)[:, 7])
        p0, p1 = (p.tensors()[name].view(torch.uint8) for p in pools)
        assert torch.equal(p0, p1)
        assert torch.equal(p1[:, 0], p1[:, 11]) and torch.equal(p1[:, 6], p1[:, 3])
