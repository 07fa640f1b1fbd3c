"""Sampling breadth (vLLM / OpenAI semantics): penalties, logit_bias, min_p and min_tokens
against transformers' logits processors on the same logits; n > 1 completions forked from
one prefill; prompt_logprobs against transformers; RequestOutput.outputs."""

from __future__ import annotations

import random

import pytest
import torch

from kvsession import LLM, CompletionOutput, ConfigError, SamplingParams
from kvsession.engine.sampler import Sampler, distribution
from kvsession.engine.sequence import Sequence
from oracle import random_prompts

VOCAB = 512


@pytest.fixture(scope="module")
def llm(llama_dir):
    with LLM(llama_dir, kv_cache_memory="4MiB", max_model_len=512) as llm:
        yield llm


@pytest.fixture(scope="module")
def hf_model(llama_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(llama_dir, dtype=torch.float32).eval()


def gen(llm, prompts, params):
    return llm.generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False)


def make_seq(prompt, output, params, eos=frozenset()) -> Sequence:
    seq = Sequence(token_ids=list(prompt), params=params, max_model_len=4096,
                   eos_token_ids=eos)
    seq.token_ids += output
    return seq


# ---- the processing chain against transformers' processors ----------------------------------

def hf_chain(p: SamplingParams, prompt_len: int, eos: list[int], warp: bool):
    from transformers.generation import logits_process as lp

    procs = []
    if p.logit_bias:
        procs.append(lp.SequenceBiasLogitsProcessor([[[t], b] for t, b in p.logit_bias]))
    if p.repetition_penalty != 1.0:
        procs.append(lp.RepetitionPenaltyLogitsProcessor(p.repetition_penalty))
    if p.min_tokens:
        procs.append(lp.MinNewTokensLengthLogitsProcessor(prompt_len, p.min_tokens, eos))
    if warp:
        procs.append(lp.TemperatureLogitsWarper(p.temperature))
        if p.top_k > 0:
            procs.append(lp.TopKLogitsWarper(p.top_k))
        if p.top_p < 1.0:
            procs.append(lp.TopPLogitsWarper(p.top_p))
        if p.min_p > 0:
            procs.append(lp.MinPLogitsWarper(p.min_p))
    return lp.LogitsProcessorList(procs)


def random_case(rng: random.Random):
    prompt = [rng.randrange(VOCAB) for _ in range(rng.randint(1, 40))]
    output = [rng.randrange(VOCAB) for _ in range(rng.randint(0, 12))]
    # repeat some tokens so penalties meet repeats (and both signs of logit)
    output += rng.sample(prompt, min(len(prompt), rng.randint(0, 3)))
    bias = {rng.randrange(VOCAB): rng.uniform(-100, 100) for _ in range(rng.randint(0, 4))}
    params = SamplingParams(
        temperature=rng.choice([0.3, 0.7, 1.0, 1.6]), top_k=rng.choice([-1, 1, 5, 50, 300]),
        top_p=rng.choice([1.0, 0.95, 0.6, 0.2]), min_p=rng.choice([0.0, 0.05, 0.3]),
        repetition_penalty=rng.choice([1.0, 0.7, 1.3, 2.0]), logit_bias=bias or None,
        min_tokens=rng.choice([0, 0, len(output) + 2]), max_tokens=64,
        stop_token_ids=rng.choice([None, [rng.randrange(VOCAB)]]))
    return prompt, output, params


@pytest.mark.parametrize("case", range(60))
def test_processing_equals_transformers_processors(case):
    rng = random.Random(1000 + case)
    prompt, output, p = random_case(rng)
    eos = frozenset({2, 1})
    seq = make_seq(prompt, output, p, eos)
    gen_ = torch.Generator().manual_seed(case)
    logits = torch.randn(1, VOCAB, generator=gen_) * 4
    x, errors = Sampler(0).process(logits.clone(), [seq])
    assert not errors
    ids = torch.tensor([prompt + output])
    banned = sorted(eos | p.stop_ids)
    want = hf_chain(p, len(prompt), banned, warp=False)(ids, logits.clone())
    torch.testing.assert_close(x, want, rtol=0, atol=1e-5)
    assert int(x.argmax()) == int(want.argmax())  # greedy picks the same token
    ours = distribution(x[0], seq)
    hf = torch.softmax(hf_chain(p, len(prompt), banned, warp=True)(ids, logits.clone()), -1)[0]
    assert torch.equal(ours > 0, hf > 0), "the kept token sets differ"
    torch.testing.assert_close(ours, hf, rtol=0, atol=1e-6)


@pytest.mark.parametrize("case", range(20))
def test_presence_and_frequency_penalties_are_openais(case):
    rng = random.Random(case)
    prompt = [rng.randrange(VOCAB) for _ in range(20)]
    output = [rng.randrange(40) for _ in range(rng.randint(0, 30))]  # many repeats
    p = SamplingParams(presence_penalty=rng.uniform(-2, 2), frequency_penalty=rng.uniform(-2, 2))
    logits = torch.randn(1, VOCAB, generator=torch.Generator().manual_seed(case))
    x, _ = Sampler(0).process(logits.clone(), [make_seq(prompt, output, p)])
    # OpenAI: mu[j] - c[j] * alpha_frequency - (c[j] > 0) * alpha_presence, over the output
    want = logits[0].clone()
    for t in set(output):
        c = output.count(t)
        want[t] -= c * p.frequency_penalty + p.presence_penalty
    torch.testing.assert_close(x[0], want, rtol=0, atol=1e-5)
    prompt_only = [t for t in set(prompt) if t not in output]
    assert torch.equal(x[0, prompt_only], logits[0, prompt_only])  # prompt tokens untouched


def test_min_tokens_does_not_strand_a_finished_format():
    """min_tokens masks EOS, but when a structured format allows only its stop token the
    format wins (its output stays valid) instead of failing the request."""

    class Done:  # a grammar whose mask is already applied: only EOS is left
        terminated = False

    p = SamplingParams(min_tokens=5, max_tokens=8)
    seq = make_seq([5, 6], [], p, frozenset({2}))
    seq.grammar = Done()
    x = torch.full((VOCAB,), float("-inf"))
    x[2] = 1.0
    from kvsession.engine.sampler import apply_min_tokens

    apply_min_tokens(x, seq)
    assert x[2] == 1.0
    seq.grammar = None
    apply_min_tokens(x, seq)
    assert x[2] == float("-inf")


# ---- end to end against transformers' generate ----------------------------------------------

@pytest.mark.parametrize("kw, hf_kw", [
    ({"repetition_penalty": 1.8}, {"repetition_penalty": 1.8}),
    ({"repetition_penalty": 0.6}, {"repetition_penalty": 0.6}),
    ({"logit_bias": {7: 6.0, 300: 4.5, 11: -100.0}},
     {"sequence_bias": [[[7], 6.0], [[300], 4.5], [[11], -100.0]]}),
])
def test_greedy_with_processors_equals_transformers_generate(llm, hf_model, kw, hf_kw):
    prompts = random_prompts(31, [9, 33], VOCAB)
    outs = gen(llm, prompts, SamplingParams(max_tokens=14, temperature=0.0, ignore_eos=True,
                                            **kw))
    plain = gen(llm, prompts, SamplingParams(max_tokens=14, temperature=0.0, ignore_eos=True))
    hf_model.generation_config.eos_token_id = None
    for prompt, out, base in zip(prompts, outs, plain, strict=True):
        x = torch.tensor([prompt])
        with torch.inference_mode():
            y = hf_model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=14,
                                  do_sample=False, pad_token_id=0, **hf_kw)
        assert out.token_ids == y[0, len(prompt):].tolist()
        assert out.token_ids != base.token_ids  # the processor changed something


def test_logit_bias_forces_and_bans(llm):
    prompt = random_prompts(32, [12], VOCAB)
    forced = gen(llm, prompt, SamplingParams(max_tokens=6, seed=3, logit_bias={77: 100.0},
                                             ignore_eos=True))[0]
    assert forced.token_ids == [77] * 6
    free = gen(llm, prompt, SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))[0]
    banned = gen(llm, prompt, SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True,
                                             logit_bias={free.token_ids[0]: -100.0}))[0]
    assert banned.token_ids[0] != free.token_ids[0]


def test_min_tokens_masks_stop_ids_and_ignores_early_stop_strings(llm):
    prompt = random_prompts(33, [15], VOCAB)
    free = gen(llm, prompt, SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True))[0]
    stop_id = free.token_ids[1]
    out = gen(llm, prompt, SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True,
                                          stop_token_ids=[stop_id], min_tokens=6))[0]
    assert len(out.token_ids) >= 6 and stop_id not in out.token_ids[:6]
    # a stop string complete within the first tokens does not end the request
    stop = free.text[:2]
    assert stop.strip()
    early = gen(llm, prompt, SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True,
                                            stop=[stop]))[0]
    assert early.text == "" and early.finish_reason == "stop"
    late = gen(llm, prompt, SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True,
                                           stop=[stop], min_tokens=4))[0]
    assert late.text.startswith(stop) and len(late.token_ids) >= 4


def test_seeded_penalised_sampling_is_batch_independent(llm):
    prompts = random_prompts(34, [20, 7, 50], VOCAB)
    seeded = SamplingParams(max_tokens=16, seed=99, repetition_penalty=1.4, min_p=0.02,
                            presence_penalty=0.7, frequency_penalty=0.4, ignore_eos=True)
    alone = gen(llm, prompts[:1], seeded)[0].token_ids
    others = [SamplingParams(max_tokens=12, temperature=0.8, ignore_eos=True),
              SamplingParams(max_tokens=9, temperature=0.0, repetition_penalty=1.2,
                             ignore_eos=True)]
    batched = gen(llm, prompts, [seeded, *others])[0].token_ids
    assert alone == batched


# ---- n > 1 -----------------------------------------------------------------------------------

def test_n_completions_equal_seeded_singles_and_prefill_once(llm):
    prompt = random_prompts(35, [45], VOCAB)  # 2 full blocks and a partial one
    before = llm.stats().prefill_tokens
    out = gen(llm, prompt, SamplingParams(n=8, max_tokens=7, seed=11, ignore_eos=True,
                                          logprobs=1))[0]
    assert llm.stats().prefill_tokens - before == 45  # one prefill for eight completions
    assert [c.index for c in out.outputs] == list(range(8))
    assert all(isinstance(c, CompletionOutput) for c in out.outputs)
    assert (out.text, out.token_ids) == (out.outputs[0].text, out.outputs[0].token_ids)
    for i, c in enumerate(out.outputs):
        single = gen(llm, prompt, SamplingParams(max_tokens=7, seed=11 + i, ignore_eos=True,
                                                 logprobs=1))[0]
        assert c.token_ids == single.token_ids and c.text == single.text
        # the same distributions, not just the same draws: each completion attended to
        # its own KV (a shared partial block would mix them)
        for got, want in zip(c.logprobs, single.logprobs, strict=True):
            assert got.keys() == want.keys()
            assert all(abs(got[t] - want[t]) < 1e-5 for t in got)
    assert len({tuple(c.token_ids) for c in out.outputs}) > 1
    greedy = gen(llm, prompt, SamplingParams(n=3, max_tokens=5, temperature=0.0,
                                             ignore_eos=True))[0]
    assert len({tuple(c.token_ids) for c in greedy.outputs}) == 1


def test_n_completions_fork_without_prefix_caching_and_when_blocks_run_short(llama_dir):
    prompt = random_prompts(36, [40], VOCAB)
    singles = None
    for kw in ({"enable_prefix_caching": False}, {"kv_cache_memory": "160KiB"}):
        with LLM(llama_dir, max_model_len=64, block_size=16, **({"kv_cache_memory": "4MiB"} | kw)
                 ) as small:
            out = gen(small, prompt, SamplingParams(n=4, max_tokens=9, seed=5,
                                                    ignore_eos=True))[0]
            if singles is None:
                singles = [gen(small, prompt, SamplingParams(max_tokens=9, seed=5 + i,
                                                             ignore_eos=True))[0].token_ids
                           for i in range(4)]
                assert small.stats().prefill_tokens == 40 + 4 * 40  # no cache: all recompute
            assert [c.token_ids for c in out.outputs] == singles
            small.check_integrity()


def test_n_with_stop_and_one_token(llm):
    prompt = random_prompts(37, [10], VOCAB)
    one = gen(llm, prompt, SamplingParams(n=5, max_tokens=1, seed=1))[0]
    assert [len(c.token_ids) for c in one.outputs] == [1] * 5
    assert all(c.finish_reason in ("stop", "length") for c in one.outputs)


# ---- prompt_logprobs --------------------------------------------------------------------------

@pytest.mark.parametrize("budget", [2048, 16])  # one prefill step, and chunked over several
def test_prompt_logprobs_match_transformers(llama_dir, hf_model, budget):
    prompt = random_prompts(38, [70], VOCAB)[0]
    with LLM(llama_dir, kv_cache_memory="4MiB", max_model_len=256,
             max_num_batched_tokens=budget) as llm:
        gen(llm, [prompt[:48]], SamplingParams(max_tokens=1))  # cache a prefix: not used
        out = gen(llm, [prompt], SamplingParams(max_tokens=2, prompt_logprobs=3))[0]
    with torch.inference_mode():
        lp = torch.log_softmax(hf_model(torch.tensor([prompt])).logits[0].float(), dim=-1)
    assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == len(prompt)
    for i in range(1, len(prompt)):
        got, row = out.prompt_logprobs[i], lp[i - 1]
        top = set(torch.topk(row, 3).indices.tolist())
        assert top <= set(got) and prompt[i] in got and len(got) <= 4
        for t, v in got.items():
            assert abs(v - float(row[t])) < 1e-4


# ---- validation -------------------------------------------------------------------------------

@pytest.mark.parametrize("kw, name", [
    ({"n": 0}, "n"), ({"n": 257}, "n"), ({"n": True}, "n"),
    ({"min_p": 1.5}, "min_p"), ({"min_p": -0.1}, "min_p"),
    ({"repetition_penalty": 0.0}, "repetition_penalty"),
    ({"presence_penalty": 2.5}, "presence_penalty"),
    ({"frequency_penalty": -3}, "frequency_penalty"),
    ({"logit_bias": {1: 101}}, r"logit_bias\[1\]"), ({"logit_bias": {"1": 1}}, "logit_bias"),
    ({"logit_bias": [1, 2]}, "logit_bias"), ({"logit_bias": {-1: 1.0}}, "logit_bias"),
    ({"min_tokens": 17}, "min_tokens"), ({"min_tokens": -1}, "min_tokens"),
    ({"prompt_logprobs": 21}, "prompt_logprobs"), ({"structured": {"regex": "a"}}, "structured"),
])
def test_bad_sampling_values_name_the_argument(kw, name):
    with pytest.raises(ConfigError, match=rf"^{name} must be"):
        SamplingParams(**kw)


def test_params_are_frozen_hashable_and_round_trip():
    import dataclasses

    p = SamplingParams(logit_bias={9: 1.5, 3: -2}, n=3, min_p=0.1, prompt_logprobs=0)
    assert p.logit_bias == ((3, -2.0), (9, 1.5))
    assert hash(p) == hash(dataclasses.replace(p)) and p == p.with_overrides()
    with pytest.raises(dataclasses.FrozenInstanceError):
        p.n = 2


def test_submission_checks_vocab_and_session_limits(llm):
    with pytest.raises(ConfigError, match="logit_bias token ids"):
        llm.generate("hi", SamplingParams(logit_bias={VOCAB: 1.0}), use_tqdm=False)
    s = llm.session(sampling=SamplingParams(max_tokens=2, n=2))
    with pytest.raises(ConfigError, match="n must be 1 for a session turn"):
        s.send("hi")
    s = llm.session(sampling=SamplingParams(max_tokens=2, prompt_logprobs=1))
    with pytest.raises(ConfigError, match="prompt_logprobs must be None for a session turn"):
        s.send("hi")
    llm.check_integrity()


def test_n_completions_with_penalties_equal_singles(llm):
    """The sampler processes its own copy of the logits: the fork samples the other
    completions' first tokens from the parent's unprocessed row (penalised once, not twice)."""
    prompt = random_prompts(39, [12], VOCAB)  # one row: the runner's logits are contiguous
    p = dict(max_tokens=4, temperature=0.0, repetition_penalty=3.0, logit_bias={9: 8.0},
             ignore_eos=True)
    out = gen(llm, prompt, SamplingParams(n=3, **p))[0]
    single = gen(llm, prompt, SamplingParams(**p))[0]
    assert [c.token_ids for c in out.outputs] == [single.token_ids] * 3
