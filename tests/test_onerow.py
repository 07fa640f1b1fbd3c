"""A one-token step through the compiled regions (model/onerow.py): greedy output equal to
transformers' for each architecture flag the regions handle (GQA, q/k/v bias, per-head
q/k norms, tied embeddings), at whatever thread count the engine picks."""

from __future__ import annotations

import pytest
import torch

from kvsession import LLM, SamplingParams
from kvsession.model.onerow import OneRowKernels
from oracle import hf_greedy, random_prompts

GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)


@pytest.mark.parametrize("arch,overrides", [
    ("llama", {}), ("qwen2", {"tie_word_embeddings": True}), ("qwen3", {})])
def test_compiled_one_row_steps_match_transformers(model_dirs, arch, overrides):
    d = model_dirs(arch, **overrides)
    prompts = random_prompts(4, [1, 40], 500)
    ref = hf_greedy(d, prompts, GREEDY.max_tokens)
    with LLM(d, max_model_len=256, kv_cache_memory="4MiB") as llm:
        model = llm._rt.model
        # tiny weights stay in the caches: not measured, the Linear kernels serve them
        assert model.one_row is None and OneRowKernels.build(model) is None
        kernels = model.one_row = OneRowKernels.for_model(model)
        heads, pres = [], []
        compiled_head, compiled_pre = kernels.head, kernels.pre
        kernels.head = lambda *a: heads.append(1) or compiled_head(*a)
        kernels.pre = lambda *a: pres.append(1) or compiled_pre(*a)
        got = [llm.generate(prompt_token_ids=[p], sampling_params=GREEDY,
                            use_tqdm=False)[0].token_ids for p in prompts]  # one row a step
    assert got == ref
    # every token's logits came from one row, and every one-token forward (the decode
    # steps, the 1-token prompt) went through the regions, layer by layer
    n = GREEDY.max_tokens
    assert len(heads) == n * len(prompts)
    assert len(pres) == len(model.layers) * ((n - 1) * len(prompts) + 1)


def test_regions_follow_the_thread_count_they_run_at(model_dirs):
    """Compiled at one thread count, run at another: the generated loops ask OpenMP at each
    call (cpp.dynamic_threads), so the ThreadGovernor's choice holds and results agree."""
    d = model_dirs("llama")
    with LLM(d, max_model_len=64, kv_cache_memory="1MiB") as llm:
        kernels = OneRowKernels.for_model(llm._rt.model)
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
