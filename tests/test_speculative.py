"""Drafts verified in one forward pass (engine/drafts.py, Engine._verify): prompt lookup
(`speculative_config`), grammar-forced spans (jump-forward) and a replayed known output
(kvsession.testing.ReplayLookup, to control what the model keeps).

The contract: greedy output is token for token what it is without drafts, and a seeded
sampled request's too (each row is sampled as the step without drafts samples it); what the
model refuses leaves no trace (block tables, the prefix cache, a session's log);
`out.metrics` says how many passes it took and how many drafts were kept; drafting that does
not pay stops by itself."""

from __future__ import annotations

import json

import jsonschema
import numpy as np
import pytest
from internals import Internals
from llms import tiny_llm

from kvsession import SamplingParams, StructuredOutput
from kvsession.costmodel import StallRatio
from kvsession.engine.drafts import (
    FIRST_DRAFT_TOKENS,
    MIN_BACKOFF_STEPS,
    Drafter,
    lookup,
    pays,
)
from kvsession.engine.sequence import Sequence
from kvsession.errors import ConfigError
from kvsession.testing import ReplayLookup
from oracle import random_prompts

NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3}
G = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)


def looping_prompts(seed: int) -> list[list[int]]:
    """Prompts that repeat themselves (what prompt lookup drafts from) and one that does not."""
    a, b, c = random_prompts(seed, [9, 5, 40], 500)
    return [a * 5, b * 8, c]


def outputs(llm, prompts, params) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(
        prompt_token_ids=prompts, sampling_params=params, use_tqdm=False)]


def replay(llm, known: dict, accept: float, seed: int = 0) -> None:
    """Draft `known` outputs from now on, each token kept with probability `accept`."""
    Internals(llm).drafter.replace_lookup(ReplayLookup(
        known, 6, llm.runtime.spec.vocab_size, accept=accept, seed=seed))


def always_pays(llm) -> None:
    """Drafting judged by costs never measured: it always pays, so that passes are counted
    exactly whatever this machine's step times (the rule itself: the unit test below)."""
    Internals(llm).drafter.use_costs(StallRatio())


# ---- the drafts themselves ------------------------------------------------------------


def test_lookup_takes_the_longest_ngram_and_its_latest_full_continuation():
    t = np.array([7, 1, 2, 3, 4, 5, 9, 2, 3, 8, 8, 1, 2, 3], dtype=np.int64)
    # "1 2 3" occurs at 1..3 (then 4 5 9 2); "2 3" also at 7..8 (then 8 8 1), shorter n-gram
    assert lookup(t, 4, 3, 1) == [4, 5, 9, 2]
    assert lookup(t, 4, 2, 1) == [8, 8, 1, 2]  # n <= 2: the latest "2 3" with 4 after it
    assert lookup(t, 12, 2, 1) == [8, 8, 1, 2, 3]  # none has 12 after it: the latest
    assert lookup(t, 4, 3, 3) == [4, 5, 9, 2]
    assert lookup(np.array([5, 6, 7, 8]), 4, 3, 1) == []  # the last token never occurred
    assert lookup(np.array([1, 2, 9, 2]), 4, 3, 2) == []  # only a 1-gram occurs


def test_drafting_stops_when_it_does_not_pay_and_tries_again_later():
    """A decode step measured at 10 ms, a token adding 5 ms to it: keeping 1 of 4 drafts
    (1 x 10 < 4 x 5 ms) pauses drafting for MIN_BACKOFF_STEPS decode steps, then twice
    as long; keeping 3 of 4 pays. A first draft is 2 tokens; then one token longer than the
    last verification kept, or twice as long after one that kept all."""
    assert pays(1.0, 4.0, None, None) and not pays(0.0, 4.0, None, None)
    assert pays(3.0, 4.0, 0.010, 0.005)
    assert not pays(1.0, 4.0, 0.010, 0.005)
    # beside 3 other decodes (a 12 ms step) the drafts cost all four: 3 x 12 < 4 x 4 x 5
    assert pays(3.0, 4.0, 0.012, 0.005) and not pays(3.0, 4.0, 0.012, 0.005, 4)
    costs = StallRatio()
    costs.observe(1, 0, 0.010)
    costs.observe(1, 4, 0.030)
    drafter = Drafter(None, costs)
    drafter.replace_lookup(lambda seq, n: [1, 2, 3, 4, 5, 6][:n])
    seq = Sequence(token_ids=[5, 6, 7], params=G, max_model_len=512)
    seq.token_ids.append(8)  # one output token: it decodes
    assert drafter.propose(seq, 1) == [1, 2]  # FIRST_DRAFT_TOKENS before a verification
    drafter.observe(seq, 4, 3, 1)
    assert drafter.propose(seq, 1) == [1, 2, 3, 4]  # 3 kept: 4 next
    drafter.observe(seq, 4, 4, 1)
    assert drafter.propose(seq, 1) == [1, 2, 3, 4, 5, 6]  # all kept: up to 8
    drafter.observe(seq, 6, 0, 1)  # kept 2.31 of 4.6 on average: 23.1 > 23 ms, still pays
    assert drafter.propose(seq, 1) == [1]
    drafter.observe(seq, 1, 0, 1)  # 1.62 of 3.52: it does not
    assert [drafter.propose(seq, 1) for _ in range(MIN_BACKOFF_STEPS)] == \
        [[]] * MIN_BACKOFF_STEPS
    assert drafter.propose(seq, 1) == [1]  # tried again, with one token
    drafter.observe(seq, 1, 0, 1)
    assert [drafter.propose(seq, 1) for _ in range(2 * MIN_BACKOFF_STEPS)] == \
        [[]] * (2 * MIN_BACKOFF_STEPS)  # twice as long
    drafter.observe(seq, 1, 1, 1)
    assert drafter.propose(seq, 1) == [1, 2]


@pytest.mark.parametrize("bad, match", [
    ({"method": "eagle", "num_speculative_tokens": 2}, "speculative_config.method"),
    ({"method": "ngram"}, "num_speculative_tokens"),
    ({"method": "ngram", "num_speculative_tokens": 0}, "num_speculative_tokens"),
    ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_max": 2,
      "prompt_lookup_min": 3}, "prompt_lookup_min"),
    ({"method": "ngram", "num_speculative_tokens": 2, "promt_lookup_max": 2},
     "prompt_lookup_max"),
    ("ngram", "must be a dict"),
])
def test_bad_speculative_configs_are_config_errors(llama_dir, bad, match):
    with pytest.raises(ConfigError, match=match):
        tiny_llm(llama_dir, speculative_config=bad)


# ---- exact outputs ----------------------------------------------------------------------


@pytest.mark.parametrize("backend", ["torch", "cpu", "triton"])
def test_greedy_output_is_the_same_with_prompt_lookup(llama_dir, backend):
    """Every attention backend takes several query tokens per sequence in a decode step
    (the Triton kernels interpreted on CPU: fewer tokens, it is slow)."""
    prompts = looping_prompts(1)
    g = G if backend != "triton" else SamplingParams(max_tokens=28, temperature=0.0,
                                                      ignore_eos=True)
    with tiny_llm(llama_dir, attention_backend=backend) as llm:
        want = outputs(llm, prompts, g)
    with tiny_llm(llama_dir, attention_backend=backend, speculative_config=NGRAM) as llm:
        always_pays(llm)
        Internals(llm).check_every_step()
        outs = llm.generate(prompt_token_ids=prompts, sampling_params=g, use_tqdm=False)
        assert [o.outputs[0].token_ids for o in outs] == want
        kept = sum(o.metrics.accepted_draft_tokens for o in outs)
        st = llm.stats()
        assert 0 < kept == st.draft_tokens_accepted <= st.draft_tokens_proposed
        for o in outs:  # a prefill, then a pass per token made beyond the drafts kept
            m = o.metrics
            assert m.forward_passes == len(o.outputs[0].token_ids) - m.accepted_draft_tokens
        llm.check_integrity()


@pytest.mark.parametrize("accept", [1.0, 0.6, 0.0])
def test_replayed_drafts_keep_greedy_and_seeded_outputs(llama_dir, accept):
    """Drafts the model takes (accept=1: all but where a draft runs out), half of them, or
    none: the same tokens, greedy and seeded sampling alike, batched with a request that
    has no drafts; the passes fall with what is kept."""
    prompts = random_prompts(2, [12, 30, 7], 500)
    seeded = [SamplingParams(max_tokens=40, temperature=0.9, top_p=0.95, seed=s,
                             ignore_eos=True) for s in (1, 2, 3)]
    with tiny_llm(llama_dir) as llm:
        want = {"g": outputs(llm, prompts, G), "s": outputs(llm, prompts, seeded)}
        known = dict(zip(map(tuple, prompts[:2]), want["g"][:2], strict=True))
        replay(llm, known, accept)
        always_pays(llm)
        Internals(llm).check_every_step()
        outs = llm.generate(prompt_token_ids=prompts, sampling_params=G, use_tqdm=False)
        assert [o.outputs[0].token_ids for o in outs] == want["g"]
        assert outputs(llm, prompts, seeded) == want["s"]
        passes = [o.metrics.forward_passes for o in outs]
        assert outs[2].metrics.accepted_draft_tokens == 0 and passes[2] == 40
        if accept == 1.0:  # the prefill's token, then drafts of 2, 4, 6 (replay's most)...
            want_passes, made, longest = 1, 1, FIRST_DRAFT_TOKENS
            while made < 40:
                k = min(longest, 6, 40 - made - 1)
                made, want_passes, longest = made + k + 1, want_passes + 1, 2 * k
            assert passes[:2] == [want_passes] * 2 == [8, 8]
        elif accept == 0.0:
            assert passes[:2] == [40, 40]
        llm.check_integrity()


def test_rejected_drafts_leave_nothing_in_the_prefix_cache(llama_dir):
    """A prompt whose drafts were mostly refused, continued by a request that hits every
    block its generation filled: its output equals an engine's without any cache (a block
    hashed with a refused draft's KV would change it)."""
    prompt = random_prompts(3, [21], 500)[0]
    with tiny_llm(llama_dir) as llm:
        want = outputs(llm, [prompt], G)[0]
        replay(llm, {tuple(prompt): want}, 0.4, seed=5)
        first = outputs(llm, [prompt], G)[0]
        follow = prompt + first
        hit = llm.generate(prompt_token_ids=[follow], sampling_params=G, use_tqdm=False)[0]
        assert hit.num_cached_tokens >= len(follow) - 16
        llm.check_integrity()
    with tiny_llm(llama_dir, enable_prefix_caching=False) as llm:
        assert hit.outputs[0].token_ids == outputs(llm, [follow], G)[0]


def test_session_turns_draft_from_the_conversation(llama_dir):
    """A session's later turns draft from its whole log (earlier replies included): same
    replies as without speculation, the log holds only kept tokens."""
    g = SamplingParams(max_tokens=24, temperature=0.0)
    turns = ["write the list again: alpha beta gamma", "and once more please",
             "alpha beta gamma alpha beta gamma"]
    logs = {}
    for spec in (None, NGRAM):
        with tiny_llm(llama_dir, speculative_config=spec) as llm:
            s = llm.session(sampling=g)
            replies = [s.send(t).token_ids for t in turns]
            logs[spec is None] = (replies, list(s.token_ids))
            llm.check_integrity()
    assert logs[True] == logs[False]


# ---- grammar-forced spans (jump-forward) -----------------------------------------------

LONG_KEYS = {"type": "object", "properties": {
    "description_of_the_result": {"type": "integer", "minimum": 0, "maximum": 99},
    "status_of_the_request": {"enum": ["completed_successfully", "failed_permanently"]}},
    "required": ["description_of_the_result", "status_of_the_request"]}


@pytest.mark.parametrize("spec", [None, NGRAM])
def test_forced_spans_take_fewer_passes_and_change_no_token(llama_dir, spec):
    """A schema's keys and an enum's tail come as drafts: greedy and seeded outputs equal
    token-by-token constrained decoding (the drafter's forced spans off), in fewer passes;
    prompt lookup's drafts beside them pass the grammar first. A random model picks any
    piece the grammar allows where a trained one writes its tokenizer's pieces: a logit bias
    on each token's length makes it prefer the longest, as xgrammar's spans do (without it
    the spans are refused at once and drafting pauses, which the outputs must survive too)."""
    fmt = StructuredOutput(json_schema=LONG_KEYS)
    prompts = random_prompts(4, [5, 11, 17], 500)
    with tiny_llm(llama_dir, speculative_config=spec) as llm:
        always_pays(llm)
        tok = llm.tokenizer
        bias = {i: 8.0 * len(tok.decode([i])) for i in range(tok.vocab_size)}
        params = [SamplingParams(max_tokens=96, temperature=t, seed=i, structured=fmt,
                                 logit_bias=bias if i < 2 else None)
                  for i, t in enumerate((0.0, 0.7, 1.0))]
        drafter = Internals(llm).drafter
        drafter.forced_spans = False
        base = llm.generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False)
        drafter.forced_spans = True
        outs = llm.generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False)
        for b, o in zip(base, outs, strict=True):
            assert o.outputs[0].token_ids == b.outputs[0].token_ids
            jsonschema.validate(json.loads(o.outputs[0].text), LONG_KEYS)
        assert sum(o.metrics.forward_passes for o in outs) < \
            0.7 * sum(b.metrics.forward_passes for b in base)
        llm.check_integrity()
