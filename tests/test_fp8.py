"""FP8 (e4m3) KV cache: quantization bounds, isolation of bad values, numerics against a
float32 cache, scales travelling with their blocks, capacity."""

from __future__ import annotations

import pytest
import torch
from internals import Internals

from kvsession import LLM, SamplingParams
from kvsession.cache.kv_pool import kv_bytes_per_token
from kvsession.cache.manager import Tier, Transient
from kvsession.kernels.reference import FP8_MAX, dequantize, quantize_fp8
from kvsession.numerics import kv_numerics
from oracle import expected_turn


def roundtrip(x):
    q, s = quantize_fp8(x)
    return dequantize(q, s, torch.float32), s.float()


def assert_within_e4m3(x, d, s):
    # e4m3 keeps 3 mantissa bits: relative error <= 2^-4 for normal values, and the
    # subnormal step is 2^-9 in scaled units (absolute error <= half of it)
    bound = 2.0**-4 * x.abs() + s.unsqueeze(-1) * 2.0**-10 + 1e-12
    assert bool(((d - x).abs() <= bound).all())


@pytest.mark.parametrize("magnitude", [1e-6, 1e-3, 1.0, 30.0, 1e4, 1e6])
def test_roundtrip_error_within_e4m3_bound(magnitude):
    x = torch.randn(64, 4, 128, generator=torch.Generator().manual_seed(0)) * magnitude
    d, s = roundtrip(x)
    assert_within_e4m3(x, d, s)
    assert float((d - x).norm() / x.norm()) < 0.03


def test_zeros_and_per_channel_outliers():
    x = torch.zeros(3, 2, 64)
    d, s = roundtrip(x)
    assert bool((d == 0).all()) and bool(torch.isfinite(s).all())
    k = torch.randn(256, 4, 64, generator=torch.Generator().manual_seed(1))
    k[..., [3, 17]] *= 100.0  # a few channels 100x larger, as in real K caches
    d, s = roundtrip(k)
    assert_within_e4m3(k, d, s)
    outliers = k[..., [3, 17]]
    assert float((d[..., [3, 17]] - outliers).norm() / outliers.norm()) < 0.03


def test_non_finite_values_do_not_poison_other_tokens():
    x = torch.randn(8, 2, 32, generator=torch.Generator().manual_seed(2))
    bad = x.clone()
    bad[3, 0, 5] = float("nan")
    bad[5, 1, 7] = float("inf")
    q_bad, s_bad = quantize_fp8(bad)
    q_ok, s_ok = quantize_fp8(x)
    others = [i for i in range(8) if i not in (3, 5)]
    assert torch.equal(q_bad[others].view(torch.uint8), q_ok[others].view(torch.uint8))
    assert torch.equal(s_bad[others], s_ok[others])
    d = dequantize(q_bad, s_bad, torch.float32)
    assert bool(torch.isfinite(d).all())  # NaN stored as 0, +inf saturated
    assert float(d[3, 0, 5]) == 0.0 and float(d[5, 1, 7]) == FP8_MAX * float(s_bad[5, 1])
    assert torch.equal(q_bad[3, 1].view(torch.uint8), q_ok[3, 1].view(torch.uint8))


def test_huge_values_saturate_instead_of_overflowing():
    x = torch.tensor([[[1e9, -1e9, 1.0, 0.0]]])
    d, s = roundtrip(x)
    assert bool(torch.isfinite(d).all()) and bool(torch.isfinite(s).all())
    assert float(d[0, 0, 0]) > 0 > float(d[0, 0, 1])


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_numerics_against_float32_cache(model_dirs, arch):
    r = kv_numerics(model_dirs(arch), "fp8", num_prompt_tokens=512, num_decode_tokens=64)
    assert max(r["attention_rel_l2_per_layer"]) <= 0.03, r
    assert r["logits_rel_l2"] <= 0.02, r
    bf16 = kv_numerics(model_dirs(arch), "bfloat16", num_prompt_tokens=128,
                       num_decode_tokens=8)
    assert max(bf16["attention_rel_l2_per_layer"]) < max(r["attention_rel_l2_per_layer"])


def test_blocks_move_with_their_scales_bit_identically(llama_dir, tmp_path):
    with LLM(llama_dir, kv_cache_dtype="fp8", kv_cache_memory="4MiB", max_model_len=256,
             host_cache_memory="1MiB", session_dir=tmp_path) as llm:
        ins = Internals(llm)
        pool, manager = ins.kv_pool, ins.manager
        assert pool.k.dtype == torch.float8_e4m3fn and pool.k_scale is not None
        s = llm.session(sampling=SamplingParams(max_tokens=9, temperature=0.0))
        s.send("hello there, read the file")
        child = s.fork()
        # the child's next turn writes into the shared partial tail block: copy-on-write
        bs = llm.config.block_size
        n = len(s.kv.tokens) - (1 if len(s.kv.tokens) % bs == 0 else 0)
        target = Transient()  # stands for the child's next turn
        valid = ins.on_engine(lambda: manager.checkout(child.kv, target, n))
        kept = target.blocks
        tail = s.kv.blocks[n // bs]
        assert valid == n and kept[-1] is not tail and len(kept) == n // bs + 1
        for name, t in pool.tensors().items():
            a, b = t[:, tail.block_id, : n % bs], t[:, kept[-1].block_id, : n % bs]
            assert torch.equal(a.view(torch.uint8), b.view(torch.uint8)), name
        ins.on_engine(lambda: manager.release(target))
        # out through the real spill paths and back, bit for bit: host, then disk. The
        # device copies are evicted and overwritten first, so the load really copies
        for rate in ("host", "disk_read"):
            ins.fix_rate(rate, 1e12)  # loading beats recomputing, whatever this machine's speed

        def session_bytes():
            ids = torch.tensor([b.block_id for b in s.kv.blocks])
            return {k: t[:, ids].clone() for k, t in pool.tensors().items()}

        def wipe_the_device():
            wipe = Transient()
            manager.allocate_slots(wipe, manager.pool.num_free)  # evicts every cached copy
            ids = torch.tensor([b.block_id for b in wipe.blocks])
            for t in pool.tensors().values():
                t[:, ids] = torch.zeros((), dtype=torch.float32).to(t.dtype)
            manager.release(wipe)

        before = ins.on_engine(session_bytes)
        for tier in (Tier.HOST, Tier.DISK):
            assert ins.spill(s, tier) is tier and s.kv.blocks == ()
            ins.on_engine(wipe_the_device)
            assert ins.restore(s) == tier.value
            after = ins.on_engine(session_bytes)
            for k in before:
                assert torch.equal(after[k].view(torch.uint8), before[k].view(torch.uint8)), \
                    (tier, k)
        assert llm.stats().restores == {"host": 1, "disk": 1}
        # and the session continues as if nothing happened
        before = s.token_ids
        r = s.send("again")
        assert r.token_ids == expected_turn(llm, s, before, r, SamplingParams(
            max_tokens=9, temperature=0.0))
        s.close()
        child.close()


def test_fp8_pool_holds_twice_the_tokens(model_dirs):
    d = model_dirs("llama", head_dim=64, num_attention_heads=2, num_key_value_heads=1)
    stats = {}
    for dtype in ("bfloat16", "fp8"):
        with LLM(d, kv_cache_dtype=dtype, kv_cache_memory="8MiB", max_model_len=256) as llm:
            stats[dtype] = st = llm.stats().tiers["device"]
            # the reported size per token is what the pool really allocated, scales included
            allocated = sum(t.numel() * t.element_size()
                            for t in Internals(llm).kv_pool.tensors().values())
            assert st.bytes_per_token * st.tokens_capacity == allocated <= 8 * 2**20
            out = llm.generate("the agent reads a file", SamplingParams(max_tokens=4),
                               use_tqdm=False)
            assert len(out[0].token_ids) == 4
    assert stats["fp8"].tokens_capacity >= 1.9 * stats["bfloat16"].tokens_capacity
    assert kv_bytes_per_token(32, 8, 128, torch.float8_e4m3fn) * 1.9 <= \
        kv_bytes_per_token(32, 8, 128, torch.bfloat16)


def test_fp8_and_bf16_blocks_never_share_hashes(llama_dir):
    scopes = []
    for dtype in ("bfloat16", "fp8"):
        with LLM(llama_dir, kv_cache_dtype=dtype, kv_cache_memory="4MiB",
                 max_model_len=128) as llm:
            scopes.append(Internals(llm).hasher.scope_digest)
    assert scopes[0] != scopes[1]


def test_fp8_generation_with_prefix_reuse_and_chunking(llama_dir):
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    prompt = [[(7 * i) % 500 for i in range(150)]]
    with LLM(llama_dir, kv_cache_dtype="fp8", kv_cache_memory="4MiB", max_model_len=256,
             max_num_batched_tokens=32) as llm:
        first = llm.generate(prompt_token_ids=prompt, sampling_params=params, use_tqdm=False)
        again = llm.generate(prompt_token_ids=prompt, sampling_params=params, use_tqdm=False)
    assert again[0].num_cached_tokens == 144
    assert first[0].token_ids == again[0].token_ids
