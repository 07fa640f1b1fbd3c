"""The C++ decode attention kernel (kernels/cpu_decode) against its torch twin
(reference.paged_attention), through the engine against transformers, and without a
compiler (the engine keeps the torch reference; asking for it by name is a ConfigError)."""

from __future__ import annotations

import logging
import random

import pytest
import torch
from internals import Internals

from kvsession import LLM, SamplingParams
from kvsession.attention import resolve_backend
from kvsession.config import AttentionBackend
from kvsession.errors import ConfigError
from kvsession.kernels import cpu_decode, reference
from kvsession.model.onerow import OneRowKernels
from oracle import hf_greedy, random_prompts

GREEDY = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def kernel():
    fn = cpu_decode.load()
    if fn is None:
        pytest.fail("the kernel did not build here (this machine has a C++ compiler)")
    return fn


def random_case(rng: random.Random, *, lens, shared, block_size, kv_heads, group, dim,
                num_blocks=96):
    """Caches full of noise (NaN in every slot no sequence uses), a table of scattered
    blocks (the first `shared` blocks the same for all rows), -1 padding past each row."""
    g = torch.Generator().manual_seed(rng.randrange(1 << 30))
    k = torch.full((num_blocks, block_size, kv_heads, dim), float("nan"))
    v = torch.full_like(k, float("nan"))
    free = list(range(num_blocks))
    rng.shuffle(free)
    common = [free.pop() for _ in range(shared)]
    width = max(-(-n // block_size) for n in lens) + 1
    table = torch.full((len(lens), width), -1, dtype=torch.int64)
    for i, n in enumerate(lens):
        ids = common + [free.pop() for _ in range(-(-n // block_size) - shared)] if n else []
        table[i, :len(ids)] = torch.tensor(ids, dtype=torch.int64)
        for j, b in enumerate(ids):  # only the slots this row reads hold numbers
            used = min(block_size, n - j * block_size)
            k[b, :used] = torch.randn(used, kv_heads, dim, generator=g)
            v[b, :used] = torch.randn(used, kv_heads, dim, generator=g)
    q = torch.randn(len(lens), kv_heads * group, dim, generator=g)
    return q, k, v, table, torch.tensor(lens)


CASES = [  # lens, shared blocks, block size, kv heads, group, head dim
    ([1], 0, 16, 4, 2, 64),
    ([700], 0, 16, 2, 4, 128),  # several tasks: split over the threads, merged
    ([37, 0, 300, 16], 0, 16, 4, 2, 64),  # a padding row (no token) gives zeros
    ([300, 290, 401], 10, 16, 2, 2, 64),  # the shared blocks read once for all rows
    ([50, 9, 130], 0, 8, 3, 1, 32),  # the generic head size, MHA
    ([200, 180], 2, 32, 1, 8, 80),
    ([90, 200, 60], 3, 16, 8, 3, 64),  # 24 query rows a sequence: two chunks of scores
    ([300], 0, 16, 8, 4, 128),
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("case", CASES)
def test_kernel_matches_the_torch_twin(case, threads, dtype):
    """Over float32 caches and bfloat16 ones (a bfloat16 model's: widened in registers,
    so the same float32 arithmetic as the twin on the widened cache)."""
    lens, shared, bs, kvh, group, dim = case
    q, k, v, table, seq_lens = random_case(random.Random(str(case)), lens=lens,
                                           shared=shared, block_size=bs, kv_heads=kvh,
                                           group=group, dim=dim)
    k, v = k.to(dtype), v.to(dtype)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        got = cpu_decode.paged_attention(cpu_decode.load(dtype=dtype), q, k, v, table,
                                         seq_lens, dim ** -0.5, shared)
    finally:
        torch.set_num_threads(before)
    # the twin reads only the rows' own slots too; NaN elsewhere would poison either
    want = reference.paged_attention(q, k.float().nan_to_num(0.0), v.float().nan_to_num(0.0),
                                     table, seq_lens, dim ** -0.5)
    assert not got.isnan().any()
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert (got[seq_lens == 0] == 0).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_kernel_stores_each_new_token_at_its_slot_before_attending(dtype):
    """store=(key, value, slots): the rows land where reference.store_kv puts them (a slot
    of -1 is skipped, every other slot untouched), and the attention reads them: the new
    token's own K/V is part of its context."""
    lens = [40, 0, 17]
    q, k, v, table, seq_lens = random_case(random.Random(7), lens=lens, shared=0,
                                           block_size=16, kv_heads=2, group=2, dim=64)
    k, v = k.nan_to_num(0.0).to(dtype), v.nan_to_num(0.0).to(dtype)
    g = torch.Generator().manual_seed(3)
    key, value = torch.randn(3, 2, 64, generator=g), torch.randn(3, 2, 64, generator=g)
    slots = torch.tensor([int(table[0, 2]) * 16 + 7, -1, int(table[2, 1]) * 16])
    want_k, want_v = k.clone(), v.clone()
    reference.store_kv(key, value, want_k, want_v, slots)
    want = reference.paged_attention(q, want_k.float(), want_v.float(), table, seq_lens, 0.125)
    got = cpu_decode.paged_attention(cpu_decode.load(dtype=dtype), q, k, v, table, seq_lens,
                                     0.125, store=cpu_decode.store_rows(key, value, slots,
                                                                        dtype))
    assert torch.equal(k, want_k) and torch.equal(v, want_v)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("case", CASES)
def test_the_ops_cpp_implementation_is_the_kernel_through_ctypes_exactly(kernel, case):
    """register_op gives kvsession::cpu_decode_store_attention its C++ implementation
    here (a compiler, torch's headers): the same kernel, called without Python, so the
    same bits as `_op` (the kernel through ctypes, told the leading blocks every table
    shares: the op finds them itself), stores included; a query in bfloat16 comes back in
    bfloat16; the result is the torch twin's."""
    assert cpu_decode.register_op() == cpu_decode.OpKind.NATIVE
    lens, shared, bs, kvh, group, dim = case
    q, k, v, table, seq_lens = random_case(random.Random(str(case) + "op"), lens=lens,
                                           shared=shared, block_size=bs, kv_heads=kvh,
                                           group=group, dim=dim)
    assert reference.shared_prefix_blocks(table, seq_lens, bs) == shared
    k, v = k.nan_to_num(0.0), v.nan_to_num(0.0)
    g = torch.Generator().manual_seed(5)
    key, value = (torch.randn(len(lens), kvh, dim, generator=g) for _ in range(2))
    slots = torch.tensor([int(table[i, 0]) * bs if n else -1 for i, n in enumerate(lens)])
    k2, v2 = k.clone(), v.clone()
    for query in (q, q.bfloat16()):
        got = torch.ops.kvsession.cpu_decode_store_attention(query, key, value, k, v, slots,
                                                             table, seq_lens, dim ** -0.5)
        want = cpu_decode._op(query, key, value, k2, v2, slots, table, seq_lens, dim ** -0.5)
        assert got.dtype == query.dtype and torch.equal(got, want)
        assert torch.equal(k, k2) and torch.equal(v, v2)
    twin = reference.paged_attention(q, k, v, table, seq_lens, dim ** -0.5)
    torch.testing.assert_close(got.float(), twin, rtol=2e-2, atol=2e-2)  # bfloat16 query


def test_where_the_ops_cpp_implementation_does_not_build_python_serves(tmp_path):
    """A compiler that builds the kernel but fails on the op's source (as one without
    torch's headers would): the op is registered in Python and gives the same answer."""
    import os
    import shutil
    import subprocess
    import sys

    cxx = tmp_path / "cxx"
    cxx.write_text(f"#!/bin/sh\ncase \"$*\" in *cpu_decode_op.cpp*) echo no torch >&2; "
                   f"exit 1;; esac\nexec {shutil.which('g++') or 'c++'} \"$@\"\n")
    cxx.chmod(0o755)
    code = """
import logging, torch
from kvsession.kernels import cpu_decode, reference
logging.basicConfig()
assert cpu_decode.load() is not None
assert cpu_decode.register_op() == cpu_decode.OpKind.PYTHON
g = torch.Generator().manual_seed(0)
k, v = torch.randn(8, 16, 2, 64, generator=g), torch.randn(8, 16, 2, 64, generator=g)
q, key, value = (torch.randn(1, n, 64, generator=g) for n in (4, 2, 2))
table, lens, slots = torch.tensor([[3, 5]]), torch.tensor([20]), torch.tensor([5 * 16 + 3])
want_k, want_v = k.clone(), v.clone()
reference.store_kv(key, value, want_k, want_v, slots)
want = reference.paged_attention(q, want_k, want_v, table, lens, 0.125)
got = torch.ops.kvsession.cpu_decode_store_attention(q, key, value, k, v, slots, table,
                                                     lens, 0.125)
assert torch.equal(k, want_k) and torch.equal(v, want_v)
torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
"""
    env = dict(os.environ, CXX=str(cxx), KVSESSION_CACHE=str(tmp_path / "cache"))
    run = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                         text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    assert "runs its kernel through Python" in run.stderr and "no torch" in run.stderr


def test_engine_batches_through_the_kernel_with_transformers_tokens(model_dirs, monkeypatch):
    """Batched decode (a shared pinned prefix, mixed lengths) and batch-1 decode through
    the one-token regions with the kernel's op: transformers' tokens, the kernel called
    (through Python for the batches, by the op's C++ implementation in the region)."""
    d = model_dirs("llama")
    system = random_prompts(1, [40], 500)[0]
    prompts = [system + p for p in random_prompts(2, [3, 20, 9], 500)]
    ref = hf_greedy(d, prompts, GREEDY.max_tokens)
    calls = []
    real = cpu_decode.paged_attention
    monkeypatch.setattr(cpu_decode, "paged_attention",
                        lambda *a, **kw: calls.append(1) or real(*a, **kw))
    with LLM(d, max_model_len=256, kv_cache_memory="4MiB", cpu_weight_layout="dual") as llm:
        assert Internals(llm).runner.backend == AttentionBackend.CPU
        llm.pin(system)
        got = [o.token_ids for o in llm.generate(prompt_token_ids=prompts,
                                                  sampling_params=GREEDY, use_tqdm=False)]
        batched = len(calls)
        model = Internals(llm).model
        kernels = model.one_row = OneRowKernels.for_model(model)  # tiny: never measured
        kernels.select_attention(kernel=True)
        steps, region = [], kernels.decode
        kernels.decode = lambda *a: steps.append(1) or region(*a)
        one = llm.generate(prompt_token_ids=prompts[:1], sampling_params=GREEDY,
                           use_tqdm=False)[0].token_ids
    assert got == ref and one == ref[0]
    assert batched >= model.spec.num_layers * (GREEDY.max_tokens - 1)
    # each batch-1 decode step: one region call, the kernel's op once per layer inside it,
    # in C++ (cpu_decode_op.cpp): the kernel never through Python's paged_attention
    assert len(steps) == GREEDY.max_tokens - 1
    assert cpu_decode.register_op() == cpu_decode.OpKind.NATIVE and len(calls) == batched


def test_the_one_region_step_stores_every_layers_kv_and_reports_each_layer(model_dirs):
    """A step through decode_logits_kernel (the whole step in one region, from the token
    id) against the same step through decode_layer (a region per layer, from the token's
    embedding row): the same hidden state, logits equal to the output head's product of
    it, the new token's K/V written at its slot of every layer's cache and nowhere else,
    and on_layer_done called for each layer, in order."""
    d = model_dirs("llama")
    with LLM(d, max_model_len=128, kv_cache_memory="2MiB", cpu_weight_layout="dual") as llm:
        ins = Internals(llm)
        model, kv, spec = ins.model, ins.kv_pool, llm.runtime.spec
        kernels = OneRowKernels.for_model(model)
        g = torch.Generator().manual_seed(0)
        with torch.inference_mode():
            for t in kv.tensors().values():  # a cached context of any values
                t.copy_(torch.randn(t.shape, generator=g))
            before = {name: t.clone() for name, t in kv.tensors().items()}
            bs = kv.block_size
            table, pos = torch.tensor([2, 0]), bs + 4  # the new token: block 0, offset 4
            token = torch.tensor([37])
            h = model.embed[token]
            rope = (model.cos[pos].view(1, 1, -1), model.sin_signed[pos].view(1, 1, -1))
            step = (spec, kv, torch.tensor([4]), table, torch.tensor(pos + 1),
                    model.softmax_scale)
            results = []
            for kernel in (True, False):
                for name, t in kv.tensors().items():
                    t.copy_(before[name])
                kernels.select_attention(kernel)
                done = []
                out = kernels.decode_logits(token, torch.tensor([pos]), model.token_tables(),
                                            *step, done.append) if kernel else \
                    (kernels.decode_step(h, rope, *step, done.append), None)
                results.append((out, {n: t.clone() for n, t in kv.tensors().items()}, done))
    ((one, logits), caches, done), ((per_layer, _), want, _) = results
    assert done == list(range(spec.num_layers))
    assert torch.allclose(one, per_layer, atol=1e-4)
    head_w, head_b = kernels.head_args
    assert logits.dtype == torch.float32 and head_b is None
    assert torch.allclose(logits, one @ head_w.t(), atol=1e-4)
    for name, t in caches.items():
        assert torch.allclose(t, want[name], atol=1e-5)
        changed = (t != before[name]).flatten(3).any(-1)  # [layers, blocks, slots]
        assert changed[:, 0, 4].all() and changed.sum() == spec.num_layers


def test_without_a_compiler_the_torch_reference_serves(model_dirs, monkeypatch, tmp_path,
                                                       caplog):
    d = model_dirs("llama")
    monkeypatch.setenv("CXX", str(tmp_path / "no-c++"))
    monkeypatch.setenv("KVSESSION_CACHE", str(tmp_path / "cache"))
    cpu = torch.device("cpu")
    with caplog.at_level(logging.WARNING, logger="kvsession"):
        assert cpu_decode.load() is None
        assert resolve_backend(AttentionBackend.AUTO, cpu, 16) == AttentionBackend.TORCH
    assert "no-c++" in caplog.text and "torch reference" in caplog.text
    with pytest.raises(ConfigError, match="C\\+\\+ compiler"):
        resolve_backend(AttentionBackend.CPU, cpu, 16)
    prompts = random_prompts(3, [5, 30], 500)
    with LLM(d, max_model_len=128, kv_cache_memory="2MiB") as llm:
        assert Internals(llm).runner.backend == AttentionBackend.TORCH
        got = [o.token_ids for o in llm.generate(prompt_token_ids=prompts,
                                                  sampling_params=GREEDY, use_tqdm=False)]
    assert got == hf_greedy(d, prompts, GREEDY.max_tokens)


def test_loading_the_kernel_keeps_subnormal_floats(kernel):
    """Linking with -ffast-math would add gcc's crtfastmath, which turns on flush-to-zero
    for the whole process when the library loads (transformers' and the user's numbers
    included). Loaded in a fresh process, subnormals must survive."""
    import subprocess
    import sys

    code = ("import sys, torch; from kvsession.kernels import cpu_decode; "
            "assert cpu_decode.load() is not None; "
            "x = torch.tensor(1e-39, dtype=torch.float32); "
            "sys.exit(0 if (x * 0.5).item() != 0.0 and float(1e-310) / 2 != 0.0 else 3)")
    assert subprocess.run([sys.executable, "-c", code], timeout=120).returncode == 0


def test_a_cache_directory_that_cannot_be_written_falls_back(tmp_path, caplog):
    """The kernel's cache directory cannot be created (here: a file is in the way): the
    engine keeps the torch reference, and says why."""
    blocker = tmp_path / "not-a-directory"
    blocker.write_text("")
    with caplog.at_level(logging.WARNING, logger="kvsession"):
        assert cpu_decode.load(directory=blocker / "kernels") is None
    assert "not-a-directory" in caplog.text
