"""The checkpoint's dtype, held once (#47 item 3): dtype="auto" follows the checkpoint on
every device (bfloat16 stays bfloat16 on the CPU), the weights are resident once by default
(the second layout kept for batch-1 speed is `cpu_weight_layout="dual"`), and what loading
leaves behind is given back."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest
import torch
from internals import Internals

from kvsession import LLM, SamplingParams
from kvsession.errors import ConfigError
from kvsession.kernels import bf16_rows
from kvsession.testing import make_tiny_model

ENGINE = {"kv_cache_memory": "4MiB", "max_model_len": 128}


def onednn_packs_bf16() -> bool:
    """Whether oneDNN packs bfloat16 weights on this CPU (it needs AVX512BW/VL or
    AVX-NE-CONVERT): elsewhere a bf16 projection keeps the plain layout, one copy whatever
    the layout asked (model/linear.py)."""
    try:
        torch.ops.mkldnn._reorder_linear_weight(torch.zeros(8, 8, dtype=torch.bfloat16), 64)
    except RuntimeError:
        return False
    return True


def checkpoint_bytes(model_dir) -> int:
    return sum(p.stat().st_size for p in model_dir.glob("*.safetensors"))


# float16 is computed as such only where the CPU has a float16 GEMM (AVX512-FP16, AMX-FP16);
# elsewhere as bfloat16 (config.py: ATen's float16 product is ~25x slower than the bf16 kernel)
CPU_FLOAT16 = torch.float16 if bf16_rows.FP16_GEMM else torch.bfloat16


@pytest.mark.parametrize("layout, dtype, want", [
    ("current", "bfloat16", torch.bfloat16),
    ("classic", "bfloat16", torch.bfloat16),  # torch_dtype
    ("current", "float16", CPU_FLOAT16),
    ("current", "float32", torch.float32),
])
def test_auto_is_the_checkpoints_dtype_on_the_cpu(tmp_path, layout, dtype, want):
    d = make_tiny_model(tmp_path / "m", layout=layout, dtype=dtype)
    with LLM(d, device="cpu", **ENGINE) as llm:
        assert llm.config.dtype == want and llm.config.kv_cache_dtype == want
        out = llm.generate("the river", SamplingParams(max_tokens=4, temperature=0.0),
                           use_tqdm=False)[0]
        assert len(out.outputs[0].token_ids) == 4
    # an explicit dtype still wins
    with LLM(d, device="cpu", dtype="float32", **ENGINE) as llm:
        assert llm.config.dtype == torch.float32
    if dtype == "float16":  # float16 forced where the CPU has no float16 GEMM
        with LLM(d, device="cpu", dtype="float16", **ENGINE) as llm:
            assert llm.config.dtype == torch.float16


def test_a_config_without_a_dtype_computes_in_float32_on_the_cpu(tmp_path):
    d = make_tiny_model(tmp_path / "m")
    cfg = json.loads((d / "config.json").read_text())
    del cfg["dtype"]
    (d / "config.json").write_text(json.dumps(cfg))
    with LLM(d, device="cpu", **ENGINE) as llm:
        assert llm.config.dtype == torch.float32


@pytest.mark.parametrize("arch", ["llama", "qwen3"])  # a packed head; a tied one (bf16_rows)
def test_bfloat16_weights_predict_as_float32_does_on_the_same_weights(tmp_path, arch):
    """The bf16 checkpoint computed in bf16 against the same (bf16-rounded) weights in
    float32: the next-token choice agrees at nearly every prompt position, and greedy
    decoding (one row at a time: the decode kernels) starts the same."""
    d = make_tiny_model(tmp_path / "m", arch=arch, dtype="bfloat16")
    prompt = list(range(5, 125))
    params = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=1)

    def top1(llm):
        lps = llm.generate(prompt_token_ids=[prompt], sampling_params=params,
                           use_tqdm=False)[0].prompt_logprobs[1:]
        return [max(lp, key=lp.get) for lp in lps]

    greedy = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)
    with LLM(d, device="cpu", **ENGINE) as bf16, \
            LLM(d, device="cpu", dtype="float32", **ENGINE) as f32:
        a, b = top1(bf16), top1(f32)
        decoded = [llm.generate(prompt_token_ids=[prompt[:50]], sampling_params=greedy,
                                use_tqdm=False)[0].outputs[0].token_ids for llm in (bf16, f32)]
    assert decoded[0][0] == decoded[1][0]
    agree = sum(x == y for x, y in zip(a, b, strict=True)) / len(a)
    assert agree >= 0.9, agree


@pytest.mark.parametrize("arch", ["llama", "qwen3"])  # an untied head, a tied one
def test_the_weights_are_resident_once_unless_the_dual_layout_is_asked(tmp_path, arch):
    d = make_tiny_model(tmp_path / "m", arch=arch, dtype="bfloat16")
    size = checkpoint_bytes(d)
    with LLM(d, device="cpu", **ENGINE) as llm:
        assert 0.95 * size <= llm.runtime.weight_bytes <= 1.15 * size
    with LLM(d, device="cpu", cpu_weight_layout="dual", **ENGINE) as llm:
        if onednn_packs_bf16():
            assert llm.runtime.weight_bytes >= 1.5 * size  # the projections twice
        else:  # nothing to pack them into: the plain layout alone
            assert llm.runtime.weight_bytes <= 1.15 * size
    with pytest.raises(ConfigError, match="cpu_weight_layout"):
        LLM(d, device="cpu", cpu_weight_layout="twice", **ENGINE)


def test_a_loaded_bf16_model_holds_its_weights_bytes_plus_its_kv_budget(tmp_path):
    """Measured on the process: resident memory (anonymous and file-backed) grows by at most
    1.15x the checkpoint's bytes plus the KV budget when a 125 MB bf16 checkpoint loads
    (float32 on the CPU and a second layout made it ~4x; glibc's retained frees ~1.6x),
    besides the compiled one-token step."""
    d = make_tiny_model(tmp_path / "m", dtype="bfloat16", hidden_size=768,
                        intermediate_size=2048, num_hidden_layers=6, num_attention_heads=12,
                        num_key_value_heads=4, head_dim=64, vocab_size=32000,
                        tie_word_embeddings=True)
    script = textwrap.dedent(f"""
        import gc, json
        from kvsession import LLM
        from kvsession.testing import make_tiny_model

        def resident():
            fields = dict(line.split(":", 1) for line in open("/proc/self/status"))
            return sum(int(fields[k].split()[0]) * 1024 for k in ("RssAnon", "RssFile"))

        # the libraries' own first-use memory, before the measured load: the engine's, and
        # the compiler's that builds the one-token step (importing inductor and a first
        # compile: ~0.23 GB, whatever the model; docs/benchmarks.md reports it)
        LLM(make_tiny_model({str(tmp_path / "t")!r}), kv_cache_memory="4MiB",
            max_model_len=64).close()
        import torch
        torch.compile(lambda x: x + 1)(torch.zeros(1))
        gc.collect()
        before = resident()
        llm = LLM({str(d)!r}, device="cpu", kv_cache_memory="16MiB", max_model_len=512)
        gc.collect()
        print(json.dumps({{"grew": resident() - before, "weights": llm.runtime.weight_bytes}}))
    """)
    if not sys.platform.startswith("linux"):
        pytest.skip("reads /proc/self/status")
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    got = json.loads(out.stdout.strip().splitlines()[-1])
    size = checkpoint_bytes(d)
    assert got["weights"] <= 1.15 * size
    # 16 MiB of allocator slack, 32 MiB for the compiled one-token step's code and graphs
    # (~35 MB here, ~50 MB for Qwen3-0.6B's 28 layers: they do not grow with the weights)
    assert got["grew"] <= 1.15 * size + (48 << 20), (got, size)


@pytest.mark.parametrize("rows, out, inp", [
    (1, 96, 64), (1, 200, 416),  # one row: 128 inputs a step and a tail of 32s
    (2, 131, 128), (3, 131, 128), (5, 70, 64), (6, 90, 96), (8, 64, 96), (8, 257, 160),
    (9, 33, 32), (16, 7, 32),  # 2-8 rows: 3 or 4 channels a pass and the rest; 9+ tiles
    (8, 70, 1056), (3, 19, 1056)])  # the AVX2 path's input spans (512) and their tail
def test_the_bf16_rows_kernel_equals_f_linear(rows, out, inp):
    """kernels/bf16_rows (every decode product of a bf16 model) against F.linear on the same
    bf16 operands: float32 sums of bf16 products, so equal up to summation order; and its op
    (what compiled one-token steps call) gives the kernel's bits."""
    from kvsession.kernels import bf16_rows

    fn = bf16_rows.load()
    if fn is None:
        pytest.skip("no C++ compiler: F.linear serves")
    gen = torch.Generator().manual_seed(rows + out)
    w = torch.randn(out, inp, generator=gen).to(torch.bfloat16)
    x = torch.randn(rows, inp, generator=gen).to(torch.bfloat16)
    bias = torch.randn(out, generator=gen).to(torch.bfloat16)
    assert bf16_rows.applies(w)
    want = (x.float() @ w.float().t() + bias.float())
    got = bf16_rows.matmul(fn, x, w, bias)
    assert got.dtype == torch.bfloat16 and got.shape == (rows, out)
    assert torch.allclose(got.float(), want, rtol=1e-2, atol=1e-2 * want.abs().max().item())
    many = torch.randn(bf16_rows.KERNEL_MAX_ROWS + 1, inp, generator=gen).to(torch.bfloat16)
    assert torch.equal(bf16_rows.matmul(fn, many, w), bf16_rows.dense(many, w))
    bf16_rows.register_op()
    assert torch.equal(torch.ops.kvsession.bf16_rows_matmul(x, w), bf16_rows.matmul(fn, x, w))


@pytest.mark.parametrize("bf16_gemm", [True, False])
def test_a_bf16_prefill_product_converts_where_the_cpu_has_no_bf16_gemm(monkeypatch,
                                                                       bf16_gemm):
    """bf16_rows.dense (a bfloat16 model's products of more rows than the kernel takes):
    F.linear where oneDNN has a bfloat16 GEMM; elsewhere (AVX2 machines, where ATen's
    bfloat16 product is ~5x slower) the weight converted to float32 a chunk of output rows at
    a time, chunks cut mid-way here (a 3-row chunk over 10 rows): the same float32 sums of
    bf16 products up to their order, rounded to bfloat16 once."""
    from kvsession.kernels import bf16_rows

    monkeypatch.setattr(bf16_rows, "BF16_GEMM", bf16_gemm)
    monkeypatch.setattr(bf16_rows, "CONVERT_CHUNK_BYTES", 3 * 4 * 64)
    gen = torch.Generator().manual_seed(7)
    w = torch.randn(10, 64, generator=gen).to(torch.bfloat16)
    x = torch.randn(40, 64, generator=gen).to(torch.bfloat16)
    bias = torch.randn(10, generator=gen).to(torch.bfloat16)
    got = bf16_rows.dense(x, w, bias)
    want = x.float() @ w.float().t() + bias.float()
    assert got.dtype == torch.bfloat16 and got.shape == (40, 10)
    assert torch.allclose(got.float(), want, rtol=1e-2, atol=1e-2 * want.abs().max().item())
    if not bf16_gemm:  # one rounding to bfloat16: within one bf16 step of the float sums
        assert torch.allclose(got.float(), want, rtol=2 ** -8, atol=1e-4)


def test_a_bf16_model_keeps_every_projection_as_rows_where_the_cpu_multiplies_bf16(tmp_path):
    """With AVX512-BF16, or AVX2 and FMA, every projection of a bf16 model is one copy of
    the checkpoint's rows (the kernel for decode batches, bf16_rows.dense for prefill);
    elsewhere oneDNN's packed layout (the plain one on a CPU where oneDNN cannot pack bf16)
    and the tied head's rows.
    (What they predict: the test above.)"""
    from kvsession.kernels import bf16_rows

    d = make_tiny_model(tmp_path / "m", arch="qwen3", dtype="bfloat16")
    with LLM(d, device="cpu", **ENGINE) as llm:
        fmts = {lin.fmt for lin in Internals(llm).model.projections()}
    if bf16_rows.native():
        assert fmts == {"rows"}
    else:
        assert fmts == {"onednn" if onednn_packs_bf16() else "float", "rows"}
