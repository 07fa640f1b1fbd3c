"""int8 weights for CPU users (#47 item 4): `LLM(quantization="int8")` quantizes a float
checkpoint at load into int8 with a float scale per group of 32 inputs (llama.cpp's Q8_0
layout); the C++ kernel (kernels/q8_matmul.cpp) against its torch twin, the engine against
float32 on the same weights. Accuracy against a Q8_0 emulation: bench/int8_accuracy.py."""

from __future__ import annotations

import pytest
import torch

from kvsession import LLM, SamplingParams
from kvsession.errors import ConfigError
from kvsession.kernels import q8_matmul
from kvsession.testing import make_tiny_model

ENGINE = {"device": "cpu", "kv_cache_memory": "4MiB", "max_model_len": 160}


def test_quantize_is_q8_0s_rule():
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(48, 128, generator=gen) * 0.05
    w[3, 40] = 2.0  # an outlier spoils only its own group's scale
    q, scale = q8_matmul.quantize(w, 32)
    assert q.dtype == torch.int8 and q.shape == (48, 128) and scale.shape == (48, 4)
    groups = w.reshape(48, 4, 32)
    assert torch.allclose(scale, groups.abs().amax(-1) / 127)
    assert int(q.abs().max()) == 127 and int(q.min()) >= -127
    err = (q8_matmul.dequantize(q, scale, torch.float32) - w).reshape(48, 4, 32).abs()
    assert (err <= scale[..., None] / 2 + 1e-7).all()
    # the outlier's group has a ~10x coarser scale than its neighbours; the others do not
    assert scale[3, 1] > 8 * scale[3, 0] and scale[3, 0] < 2 * scale[4, 0]
    assert q8_matmul.group_for(4096) == 32 and q8_matmul.group_for(96) == 32
    assert q8_matmul.group_for(100) == 100  # no group divides it: one scale per row


def test_quantizing_fused_parts_equals_quantizing_their_concatenation(monkeypatch):
    """A fused q/k/v quantized part by part (no float copy of the whole), in chunks that
    end inside a part: the same q and scales as the concatenation's."""
    gen = torch.Generator().manual_seed(1)
    parts = [torch.randn(n, 64, generator=gen).bfloat16() for n in (40, 8, 8)]
    monkeypatch.setattr(q8_matmul, "QUANTIZE_CHUNK_WEIGHTS", 64 * 12)  # 12 rows a chunk
    q, scale = q8_matmul.quantize(parts, 32)
    want_q, want_scale = q8_matmul.quantize(torch.cat(parts), 32)
    assert torch.equal(q, want_q) and torch.equal(scale, want_scale)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows, out, inp, group", [
    (1, 96, 128, 32), (3, 40, 256, 32), (8, 129, 192, 64), (16, 17, 64, 32)])
def test_the_kernel_equals_its_torch_twin(rows, out, inp, group, dtype):
    fn = q8_matmul.load()
    if fn is None:
        pytest.skip("no C++ compiler: the twin serves (tested below)")
    gen = torch.Generator().manual_seed(rows * out + inp)
    q, scale = q8_matmul.quantize(torch.randn(out, inp, generator=gen), group)
    x = torch.randn(rows, inp, generator=gen).to(dtype)
    got = q8_matmul.matmul(fn, x, q, scale)
    # (with AVX512-VNNI groups of 32 round x to int8 first, as llama.cpp's Q8_0 products do)
    want = q8_matmul.matmul_reference(x.float(), q, scale, q8_matmul.rounds_activations(group))
    assert got.dtype == dtype and got.shape == (rows, out)
    tol = 1e-4 if dtype == torch.float32 else 2e-2
    assert torch.allclose(got.float(), want, rtol=tol, atol=tol * want.abs().max().item())
    # the op compiled one-token steps call: the kernel's bits
    q8_matmul.register_op()
    assert torch.equal(torch.ops.kvsession.q8_matmul(x, q, scale), got)
    # no rows (a chunk of a prompt none of whose rows sample) and past the kernel's rows
    # (a prefill chunk): the twin runs
    assert q8_matmul.matmul(fn, x[:0], q, scale).shape == (0, out)
    many = torch.randn(q8_matmul.KERNEL_MAX_ROWS + 1, inp, generator=gen)
    assert torch.equal(q8_matmul.matmul(fn, many, q, scale),
                       q8_matmul.matmul_reference(many, q, scale))


@pytest.mark.parametrize("bf16_gemm", [True, False])
def test_a_bf16_prefill_product_of_int8_weights_is_made_in_float32_without_a_bf16_gemm(
        monkeypatch, bf16_gemm):
    """The twin with bfloat16 activations (an int8 model of a bf16 checkpoint, prefill):
    where the CPU has no bfloat16 GEMM (AVX2) the weight is dequantized to float32 a chunk of
    output rows at a time (chunks cut mid-way here) and multiplied in float32; either way
    the float32 product of the same operands, rounded to bfloat16."""
    from kvsession.kernels import bf16_rows

    monkeypatch.setattr(bf16_rows, "BF16_GEMM", bf16_gemm)
    monkeypatch.setattr(bf16_rows, "CONVERT_CHUNK_BYTES", 3 * 4 * 64)
    gen = torch.Generator().manual_seed(3)
    q, scale = q8_matmul.quantize(torch.randn(10, 64, generator=gen), 32)
    x = torch.randn(40, 64, generator=gen).to(torch.bfloat16)
    got = q8_matmul.matmul_reference(x, q, scale)
    want = x.float() @ q8_matmul.dequantize(q, scale, torch.float32).t()
    assert got.dtype == torch.bfloat16 and got.shape == (40, 10)
    rtol = 2 ** -8 if not bf16_gemm else 2e-2  # converted: one rounding to bfloat16
    assert torch.allclose(got.float(), want, rtol=rtol, atol=rtol * want.abs().max().item())


def top1(llm: LLM, prompt: list[int]) -> list[int]:
    params = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=1)
    lps = llm.generate(prompt_token_ids=[prompt], sampling_params=params,
                       use_tqdm=False)[0].prompt_logprobs[1:]
    return [max(lp, key=lp.get) for lp in lps]


@pytest.mark.parametrize("arch, dtype", [("llama", "float32"), ("qwen3", "bfloat16")])
def test_an_int8_model_predicts_as_its_float_checkpoint_at_half_bf16s_bytes(tmp_path, arch,
                                                                           dtype):
    """An untied head (the embedding gets an int8 table of its own) and a tied one (the
    embedding reads the head's int8 rows); float32 and bfloat16 checkpoints."""
    d = make_tiny_model(tmp_path / "m", arch=arch, dtype=dtype)
    prompt = list(range(7, 127))
    with LLM(d, **ENGINE) as ref, LLM(d, quantization="int8", **ENGINE) as q8:
        a, b = top1(ref, prompt), top1(q8, prompt)
        params = SamplingParams(max_tokens=8, temperature=0.0)
        gen = q8.generate(prompt_token_ids=[prompt[:20]], sampling_params=params,
                          use_tqdm=False)[0].outputs[0].token_ids
        assert len(gen) == 8
        # 1 byte per weight and a float32 scale per 32: 0.56x bfloat16 (0.28x float32)
        per_weight = q8.runtime.weight_bytes / (ref.runtime.weight_bytes
                                               / (4 if dtype == "float32" else 2))
        assert 1.0 <= per_weight <= 1.2, per_weight
    assert sum(x == y for x, y in zip(a, b, strict=True)) / len(a) >= 0.9


def test_without_a_compiler_the_twin_computes_the_same_tokens(tmp_path, monkeypatch):
    d = make_tiny_model(tmp_path / "m")
    prompt = list(range(7, 87))
    with LLM(d, quantization="int8", **ENGINE) as llm:
        built = top1(llm, prompt)
    monkeypatch.setenv("CXX", str(tmp_path / "no-c++"))
    monkeypatch.setenv("KVSESSION_CACHE", str(tmp_path / "cache"))
    assert q8_matmul.load() is None
    with LLM(d, quantization="int8", **ENGINE) as llm:
        assert top1(llm, prompt) == built


def test_quantization_is_validated(tmp_path):
    d = make_tiny_model(tmp_path / "m")
    with pytest.raises(ConfigError, match="quantization='int4' is not supported"):
        LLM(d, quantization="int4", **ENGINE)
    if not torch.cuda.is_available():
        with pytest.raises(ConfigError, match="CUDA is not available|runs on the CPU"):
            LLM(d, quantization="int8", **{**ENGINE, "device": "cuda"})
