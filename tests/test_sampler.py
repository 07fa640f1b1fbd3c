"""Sampling: seeds, batch independence, top-k/top-p, stops, logprobs against transformers."""

from __future__ import annotations

import pytest
import torch

from kvsession import LLM, SamplingParams
from oracle import random_prompts


@pytest.fixture(scope="module")
def llm(llama_dir):
    with LLM(llama_dir, kv_cache_memory="4MiB", max_model_len=512) as llm:
        yield llm


def gen(llm, prompts, params):
    return [o for o in llm.generate(prompt_token_ids=prompts, sampling_params=params,
                                    use_tqdm=False)]


def test_seeded_sampling_is_reproducible_and_batch_independent(llm):
    prompts = random_prompts(5, [12, 40, 3, 77], 500)
    seeded = SamplingParams(max_tokens=24, temperature=1.0, top_p=0.9, seed=1234,
                            ignore_eos=True)
    alone = gen(llm, [prompts[0]], seeded)[0].token_ids
    again = gen(llm, [prompts[0]], seeded)[0].token_ids
    others = [SamplingParams(max_tokens=30, temperature=0.8, ignore_eos=True)] * 3
    batched = gen(llm, prompts, [seeded, *others])[0].token_ids
    assert alone == again == batched
    other_seed = gen(llm, [prompts[0]], SamplingParams(
        max_tokens=24, temperature=1.0, top_p=0.9, seed=99, ignore_eos=True))[0].token_ids
    assert other_seed != alone


def test_top_k_1_equals_greedy(llm):
    prompts = random_prompts(6, [9, 50], 500)
    greedy = gen(llm, prompts, SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True))
    topk1 = gen(llm, prompts, SamplingParams(max_tokens=16, temperature=1.3, top_k=1,
                                             ignore_eos=True))
    assert [o.token_ids for o in greedy] == [o.token_ids for o in topk1]


def test_sampling_respects_top_k(llm):
    prompt = random_prompts(7, [20], 500)
    outs = gen(llm, prompt, SamplingParams(max_tokens=12, temperature=1.0, top_k=3, seed=5,
                                           logprobs=3, ignore_eos=True))[0]
    for token, lp in zip(outs.token_ids, outs.logprobs, strict=True):
        top3 = sorted(lp, key=lp.get, reverse=True)[:3]
        assert token in top3


def test_stop_token_ids_and_stop_strings(llm):
    prompt = random_prompts(8, [25], 500)
    free = gen(llm, prompt, SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True))[0]
    stop_id = free.token_ids[5]
    first = free.token_ids.index(stop_id)
    out = gen(llm, prompt, SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True,
                                          stop_token_ids=[stop_id]))[0]
    assert out.token_ids == free.token_ids[: first + 1]
    assert out.finish_reason == "stop"
    # a stop string taken from the middle of the free-running text
    text = free.text
    stop = text[len(text) // 2: len(text) // 2 + 3]
    assert stop.strip()
    out = gen(llm, prompt, SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True,
                                          stop=[stop]))[0]
    assert out.finish_reason == "stop"
    assert stop not in out.text
    assert text.startswith(out.text)
    assert out.text == text[: text.index(stop)]


def test_eos_from_generation_config_ends_generation_unless_ignored(llm, llama_dir, tmp_path):
    import json
    import shutil

    prompt = random_prompts(9, [10], 500)
    free = gen(llm, prompt, SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True))[0]
    eos = free.token_ids[4]
    d = shutil.copytree(llama_dir, tmp_path / "m")
    (d / "generation_config.json").write_text(json.dumps({"eos_token_id": [eos]}))
    with LLM(d, kv_cache_memory="4MiB", max_model_len=512) as other:
        out = gen(other, prompt, SamplingParams(max_tokens=10, temperature=0.0))[0]
        kept = gen(other, prompt, SamplingParams(max_tokens=10, temperature=0.0,
                                                 ignore_eos=True))[0]
    assert out.finish_reason == "stop"
    assert out.token_ids == free.token_ids[: free.token_ids.index(eos) + 1]
    assert kept.token_ids == free.token_ids and kept.finish_reason == "length"


def test_logprobs_match_transformers(llm, llama_dir):
    from transformers import AutoModelForCausalLM

    prompt = random_prompts(10, [37], 500)[0]
    out = gen(llm, [prompt], SamplingParams(max_tokens=6, temperature=0.0, logprobs=5,
                                            ignore_eos=True))[0]
    model = AutoModelForCausalLM.from_pretrained(llama_dir, dtype=torch.float32).eval()
    ids = torch.tensor([prompt + out.token_ids])
    with torch.inference_mode():
        lp = torch.log_softmax(model(ids).logits[0].float(), dim=-1)
    for i, (token, got) in enumerate(zip(out.token_ids, out.logprobs, strict=True)):
        row = lp[len(prompt) - 1 + i]
        assert len(got) == 5 and token in got
        want = dict(zip(*[t.tolist() for t in reversed(torch.topk(row, 5))], strict=True))
        assert set(got) == set(want)
        for t, v in got.items():
            assert abs(v - float(row[t])) < 1e-4
