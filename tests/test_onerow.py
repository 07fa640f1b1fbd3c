"""A one-token step through the compiled regions (model/onerow.py): greedy output equal to
transformers' for each architecture flag the regions handle (GQA, q/k/v bias, per-head
q/k norms, tied embeddings), at whatever thread count the engine picks."""

from __future__ import annotations

import pytest
import torch
from internals import Internals

from kvsession import LLM, SamplingParams
from kvsession.model.onerow import (
    OneRowKernels,
    compile_region,
    decode_layer,
    post_attention,
    pre_attention,
)
from oracle import hf_greedy, random_prompts

GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)


def count_calls(kernels: OneRowKernels, name: str) -> list:
    """Replace the compiled region `name` of `kernels` by one that records each call."""
    calls, region = [], getattr(kernels, name)
    setattr(kernels, name, lambda *a: calls.append(1) or region(*a))
    return calls


def kernels_model(model_dirs, arch: str, dtype: str, quantization: str | None) -> LLM:
    """A tiny bfloat16 or int8 model whose products are the kernels' ops (skipped where
    bfloat16 rows have no vector kernel: its projections stay oneDNN's)."""
    from kvsession.kernels import bf16_rows

    if quantization is None and not bf16_rows.native():
        pytest.skip("no vector bfloat16 products here: bfloat16 projections stay oneDNN's")
    return LLM(model_dirs(arch, dtype=dtype), max_model_len=128, kv_cache_memory="2MiB",
               quantization=quantization)


def compiled_and_eager(ins: Internals, kernels: OneRowKernels, step, blocks: int) -> tuple:
    """(step(kernels), step(None)) on the engine thread, the cache's first `blocks` blocks
    holding the same random context both times (zeroed after)."""
    kv = ins.kv_pool

    def both():
        g = torch.Generator().manual_seed(0)
        for t in kv.tensors().values():
            t[:blocks].copy_(torch.randn(t[:blocks].shape, generator=g).to(t.dtype))
        try:
            return step(kernels), step(None)
        finally:
            kv.reset_blocks(blocks)

    return ins.on_engine(both)


@pytest.mark.parametrize("arch,overrides,whole_step", [
    ("llama", {}, False), ("qwen2", {"tie_word_embeddings": True}, False),
    ("qwen3", {}, False), ("qwen2", {"tie_word_embeddings": True}, True),
    ("qwen3", {}, True)])
def test_compiled_one_row_steps_match_transformers(model_dirs, arch, overrides, whole_step):
    """A region per layer (the torch attention backend's decode step), or the whole step
    in one region from the token id to its logits (the kernel's attention; llama's in
    test_cpu_decode.py)."""
    d = model_dirs(arch, **overrides)
    prompts = random_prompts(4, [1, 40], 500)
    ref = hf_greedy(d, prompts, GREEDY.max_tokens)
    with LLM(d, max_model_len=256, kv_cache_memory="4MiB", cpu_weight_layout="dual") as llm:
        model = Internals(llm).model
        # tiny weights stay in the caches: not measured, the Linear kernels serve them
        assert model.one_row is None and OneRowKernels.build(model) is None
        kernels = model.one_row = OneRowKernels.for_model(model)
        kernels.select_attention(whole_step)
        heads, steps = count_calls(kernels, "head"), count_calls(kernels, "decode")
        got = [llm.generate(prompt_token_ids=[p], sampling_params=GREEDY,
                            use_tqdm=False)[0].token_ids for p in prompts]  # one row a step
    assert got == ref
    # every token's logits came from one row, and every one-token step (the decode steps,
    # the 1-token prompt) ran each layer as one region, or the whole step as one
    n, one_token_steps = GREEDY.max_tokens, (GREEDY.max_tokens - 1) * len(prompts) + 1
    if whole_step:
        assert len(steps) == one_token_steps and len(heads) == n * len(prompts) - len(steps)
    else:
        assert len(heads) == n * len(prompts)
        assert len(steps) == len(model.layers) * one_token_steps


def test_a_cache_the_decode_layer_cannot_read_goes_through_the_regions(model_dirs):
    """A bfloat16 KV cache: the decode steps run pre/post regions around the model's paged
    attention op, and give the tokens the Linear kernels give on the same cache."""
    d = model_dirs("llama")
    prompt = random_prompts(5, [37], 500)
    with LLM(d, max_model_len=128, kv_cache_memory="2MiB", cpu_weight_layout="dual",
             kv_cache_dtype="bfloat16", enable_prefix_caching=False) as llm:
        model = Internals(llm).model
        want = llm.generate(prompt_token_ids=prompt, sampling_params=GREEDY,
                            use_tqdm=False)[0].token_ids
        kernels = model.one_row = OneRowKernels.for_model(model)
        pres, layers = count_calls(kernels, "pre"), count_calls(kernels, "decode")
        got = llm.generate(prompt_token_ids=prompt, sampling_params=GREEDY,
                           use_tqdm=False)[0].token_ids
    assert got == want
    assert len(pres) == len(model.layers) * (GREEDY.max_tokens - 1) and not layers


def test_decode_layer_attends_over_a_scattered_table_and_masks_the_last_blocks_tail():
    """decode_layer against the same layer written out in plain torch: blocks in random
    order, a context ending mid-block whose unused slots hold NaN (freed data), GQA; the
    new K/V lands in its slot."""
    g = torch.Generator().manual_seed(7)
    hidden, heads, kv_heads, hd, inter, bs, num_blocks = 64, 4, 2, 16, 96, 4, 32

    def r(*shape):
        return torch.randn(*shape, generator=g) * 0.2

    qkv = (heads + 2 * kv_heads) * hd
    pre = (1 + r(hidden), r(qkv, hidden), r(qkv), None, None)
    post = (r(hidden, heads * hd), None, 1 + r(hidden), r(2 * inter, hidden), None,
            r(hidden, inter), None, 1e-6)
    k_cache, v_cache = r(num_blocks, bs, kv_heads, hd), r(num_blocks, bs, kv_heads, hd)
    ids = torch.randperm(num_blocks, generator=g)[:5]
    n = 4 * bs + 2  # 4 full blocks, then slot 0 of ids[4] and the new token in its slot 1
    slot = ids[4] * bs + 1
    k_cache[ids[4], 2:] = float("nan")  # past the end: must not reach the output
    v_cache[ids[4], 2:] = float("nan")
    h = r(1, hidden)
    pos = torch.tensor([n - 1.0])
    inv = 1.0 / (10000 ** (torch.arange(0, hd, 2).float() / hd))
    f = torch.outer(pos, inv)
    cos = torch.cat((f, f), -1).cos()[:, None]
    sin = torch.cat((-f.sin(), f.sin()), -1)[:, None]
    scale = hd ** -0.5
    kc, vc = k_cache.clone(), v_cache.clone()
    region = compile_region(decode_layer, dynamic=None)
    with torch.inference_mode():
        got = region(h, *pre, cos, sin, 1e-6, heads, kv_heads, kc, vc, slot.view(1), ids,
                     torch.tensor(n), scale, *post)
        q, k, v = pre_attention(h, *pre, cos, sin, 1e-6, heads, kv_heads)
        keys = torch.cat([k_cache[ids[:4]].flatten(0, 1), k_cache[ids[4], :1], k[0][None]])
        values = torch.cat([v_cache[ids[:4]].flatten(0, 1), v_cache[ids[4], :1], v[0][None]])
        rep = heads // kv_heads
        att = torch.softmax(torch.einsum("hd,thd->ht", q[0], keys.repeat_interleave(rep, 1))
                            * scale, -1)
        o = torch.einsum("ht,thd->hd", att, values.repeat_interleave(rep, 1))
        want = post_attention(h, o.reshape(1, -1), *post)
    assert torch.isfinite(got).all()
    assert (got - want).abs().max().item() < 1e-4
    # (computed in the region: equal to the eager K/V up to float rounding)
    assert torch.allclose(kc.flatten(0, 1)[slot], k[0], atol=1e-5)
    assert torch.allclose(vc.flatten(0, 1)[slot], v[0], atol=1e-5)
    untouched = torch.ones(num_blocks * bs, dtype=torch.bool)
    untouched[slot] = False
    for after, before in ((kc, k_cache), (vc, v_cache)):
        assert torch.allclose(after.flatten(0, 1)[untouched], before.flatten(0, 1)[untouched],
                              rtol=0, atol=0, equal_nan=True)


def test_regions_follow_the_thread_count_they_run_at(model_dirs):
    """Compiled at one thread count, run at another: the generated loops ask OpenMP at each
    call (cpp.dynamic_threads), so the ThreadGovernor's choice holds and results agree."""
    d = model_dirs("llama")
    with LLM(d, max_model_len=64, kv_cache_memory="1MiB", cpu_weight_layout="dual") as llm:
        kernels = OneRowKernels.for_model(Internals(llm).model)
        w, b = kernels.head_args
        x = torch.randn(1, w.shape[1], generator=torch.Generator().manual_seed(0))
        before = torch.get_num_threads()
        try:
            outs = []
            for n in (2, 1, 2):
                torch.set_num_threads(n)
                with torch.inference_mode():
                    outs.append(kernels.head(x, w, b))
        finally:
            torch.set_num_threads(before)
    want = x @ w.t()
    for o in outs:
        assert (o - want).abs().max().item() < 1e-4


@pytest.mark.parametrize("attention_kernel", [False, True])
def test_nothing_compiles_while_serving_after_the_warm_up(model_dirs, attention_kernel):
    """Start-up compiles every variant a step can need (dynamo guards on the thread count,
    on dispatch keys and aliasing, and specialises lengths 0/1): then prompts of any length,
    a one-token prompt and the ThreadGovernor's one-thread probes compile nothing more.
    Both decode steps: a region per layer, and every layer in one (the kernel's attention)."""
    from torch._dynamo.utils import counters

    d = model_dirs("llama")
    with LLM(d, max_model_len=256, kv_cache_memory="4MiB", cpu_weight_layout="dual") as llm:
        ins = Internals(llm)
        model = ins.model
        kernels = model.one_row = OneRowKernels.for_model(model)
        # what start-up compiles (and keeps, for a model that measured faster)
        kernels.select_attention(attention_kernel)
        assert kernels.warm_up(model.spec, ins.kv_pool, model.softmax_scale,
                               model.token_tables())
        compiled = counters["stats"]["unique_graphs"]
        for n in (1, 17, 150):
            llm.generate(prompt_token_ids=random_prompts(n, [n], 500), use_tqdm=False,
                         sampling_params=SamplingParams(max_tokens=40, ignore_eos=True))
        governor = ins.runner.governor
        if governor is not None:  # several cores: it has probed one thread by now
            assert governor.used[1] > 0
    assert counters["stats"]["unique_graphs"] == compiled


def test_start_up_times_a_decode_step_both_ways_and_keeps_the_faster(model_dirs, monkeypatch,
                                                                     caplog):
    """LlamaModel.warm_up times whole decode steps (forward and logits) through the regions
    and through the Linear kernels, interleaved, and keeps the regions only if faster; the
    steps it timed leave the pool's blocks as they were built."""
    import logging
    import re

    from kvsession.attention import attention
    from kvsession.config import AttentionBackend
    from kvsession.model import llama, onerow

    d = model_dirs("llama")
    monkeypatch.setattr(onerow, "MEASURE_MIN_BYTES", 0)  # measured although tiny
    with caplog.at_level(logging.INFO, logger="kvsession"), \
            LLM(d, max_model_len=128, kv_cache_memory="2MiB", cpu_weight_layout="dual") as llm:
        ins = Internals(llm)
        model, kv = ins.model, ins.kv_pool
        said = [r.getMessage() for r in caplog.records
                if r.getMessage().startswith("one-token step:")]
        assert len(said) == 1
        t_regions, t_linear = (float(t) for t in re.findall(r"([\d.e+-]+) ms", said[0]))
        if t_regions != t_linear:  # not a tie in the log's 4 digits
            assert (model.one_row is not None) == (t_regions < t_linear)
        # both ways timed on the model's own forward: the regions' one region a step, the
        # Linear kernels' step through the paged attention op at every layer
        kernels = OneRowKernels.for_model(model)
        kernels.select_attention(True)
        assert kernels.warm_up(model.spec, kv, model.softmax_scale, model.token_tables())
        model.one_row, ops = kernels, []
        decodes = count_calls(kernels, "decode")
        model.attention_fn = lambda *a: ops.append(1) or attention(*a)
        model._one_token_times(kv, AttentionBackend.CPU)
        assert model.one_row is kernels
        assert len(decodes) == llama.MEASURE_ROUNDS + 1
        assert len(ops) == len(model.layers) * (llama.MEASURE_ROUNDS + 1)
        assert all(not t[:, :2].any() for t in kv.tensors().values())


@pytest.mark.parametrize("quantization", [None, "int8"])
def test_a_bf16_or_int8_model_keeps_its_regions_without_timing_them(model_dirs, monkeypatch,
                                                                     caplog, quantization):
    """A bfloat16 model (rows) or an int8 one: its Linear kernels are the same C++ products
    as the regions' ops, so start-up keeps the regions without timing a step both ways (a
    load's ~0.7 s on a real checkpoint), and says so."""
    import logging

    from kvsession.kernels import bf16_rows
    from kvsession.model import llama, onerow

    if quantization is None and not bf16_rows.native():
        pytest.skip("no AVX512-BF16 here: bfloat16 projections stay oneDNN's")
    d = model_dirs("qwen3", dtype="bfloat16")
    monkeypatch.setattr(onerow, "MEASURE_MIN_BYTES", 0)  # built although tiny

    def timed(*args):
        raise AssertionError("timed a bfloat16 or int8 model's step both ways")

    monkeypatch.setattr(llama.LlamaModel, "_one_token_times", timed)
    with caplog.at_level(logging.INFO, logger="kvsession"), \
            LLM(d, max_model_len=128, kv_cache_memory="2MiB", quantization=quantization) as llm:
        model = Internals(llm).model
        assert model.weight_format == ("int8" if quantization else "rows")
        assert model.one_row is not None
        said = [r.getMessage() for r in caplog.records
                if r.getMessage().startswith("one-token step:")]
        assert len(said) == 1 and said[0].startswith(
            f"one-token step: compiled regions around the {model.weight_format} kernels")
        out = llm.generate(prompt_token_ids=[[5, 6, 7]], use_tqdm=False,
                           sampling_params=SamplingParams(max_tokens=4, ignore_eos=True))
        assert len(out[0].outputs[0].token_ids) == 4


def test_without_a_working_compiler_the_linear_kernels_serve(model_dirs, monkeypatch,
                                                             tmp_path, caplog):
    """Compiling fails (here: the C++ compiler inductor calls does not exist): the model
    is built anyway, says why in the log, and serves one row through the Linear kernels
    with transformers' tokens."""
    import logging

    from kvsession.model import onerow

    d = model_dirs("llama", intermediate_size=160)  # shapes no other test compiled
    monkeypatch.setattr(onerow, "MEASURE_MIN_BYTES", 0)  # measured although tiny
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))
    prompt = random_prompts(6, [21], 500)
    # inductor's own patching API: monkeypatch's undo left `cpp.cxx` deleted from the
    # config, and every later compile in the process failed
    no_compiler = {"cpp.cxx": (None, str(tmp_path / "no-c++"))}
    with caplog.at_level(logging.WARNING, logger="kvsession"):
        with torch._inductor.config.patch(no_compiler), \
                LLM(d, max_model_len=128, kv_cache_memory="2MiB", cpu_weight_layout="dual") as llm:
            assert Internals(llm).model.one_row is None
            got = llm.generate(prompt_token_ids=prompt, sampling_params=GREEDY,
                               use_tqdm=False)[0].token_ids
    assert "compiling its regions failed" in caplog.text
    assert got == hf_greedy(d, prompt, GREEDY.max_tokens)[0]


@pytest.mark.parametrize("arch, dtype, quantization", [
    ("llama", "bfloat16", None), ("qwen3", "bfloat16", None),  # untied; q/k norms, tied
    ("llama", "float32", "int8"), ("qwen3", "bfloat16", "int8")])  # an int8 table; tied
def test_a_bf16_or_int8_step_in_one_region_calls_the_kernels_ops_and_matches_eager(
        model_dirs, arch, dtype, quantization):
    """A bfloat16 model (every projection bf16 rows, a bfloat16 cache) or an int8 one: the
    whole decode step compiles into one region whose products are the rows kernel's or the
    int8 kernel's op (the embedding row dequantized in it) and whose attention is the
    decode kernel's op over the cache; its logits equal those of the same step through the
    eager ops (the same kernels) up to bfloat16 rounding, and the step writes the same
    K/V."""
    from kvsession.attention import AttentionMetadata
    from kvsession.config import AttentionBackend

    with kernels_model(model_dirs, arch, dtype, quantization) as llm:
        ins = Internals(llm)
        model, kv = ins.model, ins.kv_pool
        assert kv.layer(0).k.dtype == getattr(torch, dtype)
        kernels = OneRowKernels.for_model(model)  # tiny weights: built by hand
        kernels.select_attention(True)
        assert kernels.reads_cache(kv.layer(0))
        assert kernels.warm_up(model.spec, kv, model.softmax_scale, model.token_tables())
        steps = count_calls(kernels, "decode")
        bs = kv.block_size

        def step(one_row):
            model.one_row = one_row
            meta = AttentionMetadata(
                slot_mapping=torch.tensor([bs + 3]), block_tables=torch.tensor([[0, 1]]),
                query_start_loc=[0, 1], seq_lens=[bs + 4],
                seq_lens_tensor=torch.tensor([bs + 4]), decode_only=True,
                softmax_scale=model.softmax_scale, backend=AttentionBackend.CPU,
                query_start_loc_tensor=torch.tensor([0, 1]), max_query_len=1,
                all_slots_valid=True)
            logits = model.step_logits(torch.tensor([7]), torch.tensor([bs + 3]), kv, meta, [0])
            stored = kv.layer(len(model.layers) - 1).k[1, 3].clone()
            return logits, stored

        (compiled, k_compiled), (eager, k_eager) = compiled_and_eager(ins, kernels, step, 2)
    assert len(steps) == 1 and compiled.dtype == eager.dtype == torch.float32
    scale = eager.abs().max().item()
    assert (compiled - eager).abs().max().item() <= 0.05 * scale
    # (the K a step stores: bfloat16 rounding, and int8's rounding of activations, differ
    # a step or two between fused and eager code)
    k_scale = k_eager.float().abs().max().item()
    assert (k_compiled.float() - k_eager.float()).abs().max().item() <= 0.05 * k_scale


@pytest.mark.parametrize("arch, dtype, quantization", [
    ("qwen3", "bfloat16", None), ("llama", "float32", "int8")])
def test_a_batch_of_decodes_runs_a_region_per_layer_and_matches_eager(model_dirs, arch, dtype,
                                                                  quantization):
    """A decode step of three sequences of a bfloat16 or int8 model: the batch region once
    a layer, and the step's logits and stored K/V equal those of the same step through the
    eager ops (the same kernels) up to bfloat16 rounding. Two steps: the three tables share
    their first block (read once for all by the op: reference.shared_prefix_blocks says 1),
    then the third has blocks of its own in another order (nothing shared); every context
    ends mid-block."""
    from kvsession.attention import AttentionMetadata
    from kvsession.config import AttentionBackend
    from kvsession.kernels import reference

    with kernels_model(model_dirs, arch, dtype, quantization) as llm:
        ins = Internals(llm)
        model, kv = ins.model, ins.kv_pool
        kernels = OneRowKernels.for_model(model)  # tiny weights: built by hand
        kernels.select_attention(True)
        assert kernels.batch_rows == 16 and kernels.serves_batch(3, kv.layer(0))
        assert kernels.warm_up(model.spec, kv, model.softmax_scale, model.token_tables())
        batches, ones = count_calls(kernels, "batch"), count_calls(kernels, "decode")
        bs = kv.block_size
        lens = torch.tensor([bs + 4, bs + 2, 2 * bs - 1])
        for tables, shared in ((torch.tensor([[0, 1], [0, 2], [0, 4]]), 1),
                               (torch.tensor([[0, 1], [0, 2], [4, 3]]), 0)):
            assert reference.shared_prefix_blocks(tables, lens, bs) == shared
            slots = tables[:, 1] * bs + lens % bs - 1  # each context's last slot

            def step(one_row, tables=tables, slots=slots):
                model.one_row = one_row
                meta = AttentionMetadata(
                    slot_mapping=slots, block_tables=tables, query_start_loc=[0, 1, 2, 3],
                    seq_lens=lens.tolist(), seq_lens_tensor=lens, decode_only=True,
                    softmax_scale=model.softmax_scale, backend=AttentionBackend.CPU,
                    query_start_loc_tensor=torch.tensor([0, 1, 2, 3]), max_query_len=1,
                    all_slots_valid=True)
                logits = model.step_logits(torch.tensor([7, 9, 11]), lens - 1, kv, meta,
                                           [0, 1, 2])
                last = kv.layer(len(model.layers) - 1).k.flatten(0, 1)
                return logits, last[slots].clone()

            (compiled, k_compiled), (eager, k_eager) = compiled_and_eager(ins, kernels, step,
                                                                          5)
            assert compiled.shape == eager.shape and compiled.shape[0] == 3
            for row in range(3):  # each sequence against its own scale
                scale = eager[row].abs().max().item()
                assert (compiled[row] - eager[row]).abs().max().item() <= 0.05 * scale
            k_scale = k_eager.float().abs().max().item()
            assert (k_compiled.float() - k_eager.float()).abs().max().item() <= 0.05 * k_scale
    assert len(batches) == 2 * len(model.layers) and not ones


def test_batches_of_any_size_compile_nothing_after_the_warm_up_and_match_eager(model_dirs):
    """An int8 model of a float32 checkpoint generating batches of 2, 3 and 5 sequences
    (and one alone): the warm-up compiled the batch region once for every batch size and
    table width (both unbacked), the decode steps of batches ran through it, and the
    tokens are those of the same batches through the eager ops."""
    from torch._dynamo.utils import counters

    d = model_dirs("llama")
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    batches = [random_prompts(n, [3, 40], 500) for n in (2, 3, 5, 1)]
    # no prefix cache: the second run would find the first's prompts, and an int8 prefill
    # of up to 16 rows rounds its activations where a longer one does not (q8_matmul)
    with LLM(d, max_model_len=256, kv_cache_memory="4MiB", quantization="int8",
             enable_prefix_caching=False) as llm:
        ins = Internals(llm)
        model = ins.model
        kernels = OneRowKernels.for_model(model)
        kernels.select_attention(True)
        assert kernels.warm_up(model.spec, ins.kv_pool, model.softmax_scale,
                               model.token_tables())
        compiled = counters["stats"]["unique_graphs"]

        def run(one_row):
            model.one_row = one_row
            return [[o.token_ids for o in llm.generate(prompt_token_ids=b, use_tqdm=False,
                                                       sampling_params=params)]
                    for b in batches]

        calls = count_calls(kernels, "batch")
        got = run(kernels)
        assert counters["stats"]["unique_graphs"] == compiled
        want = run(None)
    assert got == want and len(calls) >= (params.max_tokens - 1) * len(model.layers)
