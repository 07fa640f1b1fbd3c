"""Attention reads only a sequence's own context: whatever the other slots of the KV pool
hold (NaN, an fp8 byte that is NaN, a NaN scale) never reaches an output.

Decode batches of unequal lengths are read together up to the longest one; the positions
past a shorter sequence's end (its last block's unused slots, and -1 table padding, which
reads block 0) are hidden from the softmax, but a hidden NaN key still scores NaN and a
0 x NaN value is NaN, so the torch reference zeroes them. The Triton twins never load them.
Both are checked against the clean run, and so is the whole engine over a NaN-filled pool.
"""

from __future__ import annotations

import pytest
import torch
from internals import Internals

from kernel_cases import FP8, make_cache, tables_for
from kvsession import LLM, SamplingParams
from kvsession.kernels import reference as R
from kvsession.kernels.paged_attention import paged_attention
from kvsession.kernels.prefill_attention import prefill_attention

BF16 = torch.bfloat16
BS, KV_HEADS, GQA, HEAD_DIM, NUM_BLOCKS, MAX_BLOCKS = 16, 2, 2, 64, 40, 12


def tables_without_block_0(lens: list[int]) -> torch.Tensor:
    """Fragmented block tables (-1 padded) that never use block 0, so that poisoning block 0
    poisons only what -1 padding reads."""
    tables = tables_for(lens, BS, MAX_BLOCKS, NUM_BLOCKS - 1, seed=5)
    return torch.where(tables >= 0, tables + 1, tables)


def poisoned(cache: torch.Tensor, scale: torch.Tensor | None, tables: torch.Tensor,
             lens: list[int]) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Copies of a layer's cache (and scales) with NaN in every slot outside the contexts:
    block 0, the unused slots of last blocks, the unused blocks."""
    valid = torch.zeros(cache.shape[:2], dtype=torch.bool)
    for row, n in zip(tables.tolist(), lens, strict=True):
        for p in range(n):
            valid[row[p // BS], p % BS] = True
    assert not valid[0].any() and not valid.all()
    out = cache.clone()
    if out.dtype == FP8:
        out.view(torch.uint8)[~valid] = 0x7F  # a NaN in float8_e4m3fn
    else:
        out[~valid] = float("nan")
    if scale is None:
        return out, None
    bad_scale = scale.clone()
    bad_scale[~valid] = float("nan")
    return out, bad_scale


@pytest.mark.parametrize("dtype", [torch.float32, BF16, FP8], ids=["float32", "bf16", "fp8"])
@pytest.mark.parametrize("flash_op", [True, False], ids=["flash", "matmul"])
def test_nan_outside_the_contexts_changes_no_output(dtype, flash_op, monkeypatch):
    if not flash_op:  # the matmul fallback of the reference
        monkeypatch.setattr(R, "_FLASH_CPU", None)
    qdtype = torch.float32 if dtype == FP8 else dtype
    k, v, ks, vs = make_cache(dtype, NUM_BLOCKS, BS, KV_HEADS, HEAD_DIM, seed=4)
    scale = HEAD_DIM ** -0.5
    g = torch.Generator().manual_seed(6)

    # decode: a padded row (0), very different lengths, partial and -1 padded last blocks
    lens = [1, BS, 37, 0, 150, 2 * BS + 3]
    tables, seq_lens = tables_without_block_0(lens), torch.tensor(lens)
    (bk, bks), (bv, bvs) = poisoned(k, ks, tables, lens), poisoned(v, vs, tables, lens)
    q = torch.randn(len(lens), KV_HEADS * GQA, HEAD_DIM, generator=g).to(qdtype)
    clean = R.paged_attention(q, k, v, tables, seq_lens, scale, ks, vs)
    dirty = R.paged_attention(q, bk, bv, tables, seq_lens, scale, bks, bvs)
    assert torch.isfinite(clean).all() and torch.equal(dirty, clean)
    if flash_op:  # the Triton twin (interpreted) once per dtype
        got = paged_attention(q, bk, bv, tables, seq_lens, scale, bks, bvs, num_splits=3)
        assert torch.isfinite(got).all()
        torch.testing.assert_close(got.float(), clean.float(), atol=2e-2, rtol=2e-2)

    # a mixed step: decode rows of unequal lengths (read together) beside prefill chunks
    plan = [(0, 1), (BS, 9), (36, 1), (5, 0), (129, 1), (40, 20)]  # (cached, new tokens)
    lens = [c + n for c, n in plan]
    tables = tables_without_block_0(lens)
    (bk, bks), (bv, bvs) = poisoned(k, ks, tables, lens), poisoned(v, vs, tables, lens)
    starts = [0]
    for _, n in plan:
        starts.append(starts[-1] + n)
    q = torch.randn(starts[-1], KV_HEADS * GQA, HEAD_DIM, generator=g).to(qdtype)
    clean = R.prefill_attention(q, k, v, tables, starts, lens, scale, ks, vs)
    dirty = R.prefill_attention(q, bk, bv, tables, starts, lens, scale, bks, bvs)
    assert torch.isfinite(clean).all() and torch.equal(dirty, clean)
    if flash_op:
        got = prefill_attention(q, bk, bv, tables, torch.tensor(starts), torch.tensor(lens),
                                scale, bks, bvs)
        assert torch.isfinite(got).all()
        torch.testing.assert_close(got.float(), clean.float(), atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("kv_dtype", ["float32", "fp8"])
def test_engine_over_a_nan_filled_pool_generates_the_same_tokens(llama_dir, kv_dtype):
    """Every slot of the pool NaN (fp8: NaN bytes and NaN scales) before anything runs, as
    an uninitialised pool would be: prompts of unequal lengths decode together, reading
    partial last blocks and -1 padding, and give the tokens of a clean pool."""
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    prompts = [[(i * 7 + j) % 500 for j in range(n)] for i, n in enumerate([5, 20, 37, 70])]
    outs = []
    for poison in (False, True):
        with LLM(llama_dir, kv_cache_memory="4MiB", max_model_len=128,
                 kv_cache_dtype=kv_dtype) as llm:
            if poison:
                for name, t in Internals(llm).kv_pool.tensors().items():
                    if t.dtype == FP8:
                        t.view(torch.uint8).fill_(0x7F)
                    else:
                        t.fill_(float("nan"))
                    assert name in ("k", "v", "k_scale", "v_scale")
            outs.append([o.token_ids for o in llm.generate(
                prompt_token_ids=prompts, sampling_params=params, use_tqdm=False)])
    assert outs[1] == outs[0]
