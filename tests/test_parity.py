"""Greedy generation is token-identical to transformers on the same files (float32)."""

from __future__ import annotations

import pytest
from internals import Internals

from kvsession import LLM, SamplingParams
from kvsession.model import llama
from oracle import ARCHS, hf_greedy, random_prompts

LENGTHS = [1, 7, 16, 33, 130, 300]
GREEDY = SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True)


def run(model_dir, prompts, **kwargs):
    with LLM(model_dir, max_model_len=512, **kwargs) as llm:
        Internals(llm).check_every_step()
        outs = llm.generate(prompt_token_ids=prompts, sampling_params=GREEDY, use_tqdm=False)
        return [o.token_ids for o in outs], llm.stats().num_preemptions


@pytest.mark.parametrize("arch", ARCHS)
def test_greedy_matches_transformers(model_dirs, arch, monkeypatch):
    d = model_dirs(arch)
    prompts = random_prompts(1, LENGTHS, 500)
    ref = hf_greedy(d, prompts, 32)
    got, _ = run(d, prompts, kv_cache_memory="4MiB")
    assert got == ref
    # a layer's token-wise work in row chunks (forward's ROW_CHUNK) that cross the packed
    # prompts' boundaries, attention over all rows at once
    with monkeypatch.context() as m:
        m.setattr(llama, "ROW_CHUNK", 13)
        got, _ = run(d, prompts, kv_cache_memory="4MiB")
    assert got == ref
    # chunked prefill: every long prompt is split into 32-token chunks
    got, _ = run(d, prompts, kv_cache_memory="4MiB", max_num_batched_tokens=32)
    assert got == ref
    # a pool of 34 blocks (one 512-token sequence fits, the batch does not), prompts in
    # 64-token chunks: preemption (admission keeps headroom for the running sequences'
    # next blocks; a prompt growing chunk by chunk is what runs the pool out)
    got, preemptions = run(d, prompts, kv_cache_memory=34 * 16 * 512, block_size=16,
                           max_num_batched_tokens=64)
    assert preemptions > 0
    assert got == ref


@pytest.mark.parametrize("rope_scaling", [
    {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
     "original_max_position_embeddings": 64},
    {"rope_type": "linear", "factor": 2.0},
])
@pytest.mark.parametrize("layout", ["classic", "current"])
def test_rope_scaling_and_layouts(model_dirs, rope_scaling, layout):
    d = model_dirs("llama", layout=layout, rope_scaling=tuple(rope_scaling.items()))
    prompts = random_prompts(2, [5, 90, 200], 500)
    ref = hf_greedy(d, prompts, 32)
    got, _ = run(d, prompts, kv_cache_memory="4MiB", block_size=32)
    assert got == ref


def test_sharded_checkpoint_and_tied_embeddings(model_dirs):
    d = model_dirs("qwen2", num_shards=3, tie_word_embeddings=True)
    prompts = random_prompts(3, [3, 40], 500)
    got, _ = run(d, prompts, kv_cache_memory="4MiB")
    assert got == hf_greedy(d, prompts, 32)
