"""Goodput scheduling through the LLM (the scheduler's exact steps: test_scheduler_unit.py):
a more urgent request runs first, a session's priority orders its turns and which idle KV
is reclaimed first, long prompts share the step without changing any output, a TPOT
target shrinks a long prompt's chunks beside decodes (and says when it cannot be met),
and bad values are ConfigErrors."""

from __future__ import annotations

import pytest
from llms import tiny_llm

from kvsession import SamplingParams
from kvsession.costmodel import StallRatio, key_reads
from kvsession.engine.slo_chunking import SloChunking
from kvsession.errors import ConfigError
from kvsession.metrics import SLO
from oracle import random_prompts

G = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)


def test_the_more_urgent_request_runs_first(llama_dir):
    """One seat (max_num_seqs=1): the request that came second but is more urgent ends
    before the first one is admitted; with equal priorities, arrival order."""
    a, b = random_prompts(3, [20, 20], 256)
    with tiny_llm(llama_dir, max_num_seqs=1) as llm:
        first, urgent = llm.generate(prompt_token_ids=[a, b], sampling_params=G,
                                     priority=[1, 0], use_tqdm=False)
        assert urgent.metrics.e2e_s <= first.metrics.queue_s
        first, second = llm.generate(prompt_token_ids=[a, b], sampling_params=G,
                                     use_tqdm=False)
        assert first.metrics.e2e_s <= second.metrics.queue_s
        assert urgent.outputs[0].token_ids == second.outputs[0].token_ids  # same prompt


def test_a_session_turn_takes_its_sessions_priority_or_its_own(llama_dir):
    with tiny_llm(llama_dir, max_num_seqs=1) as llm:
        s = llm.session(sampling=G, priority=5)
        assert s.priority == 5
        s.send("hello")
        child = s.fork()
        assert child.priority == 5
        s.priority = -1
        assert s.send("again", priority=3).text  # the turn's own
        with pytest.raises(ConfigError, match="priority"):
            s.send("x", priority="high")
        with pytest.raises(ConfigError, match="priority"):
            s.priority = 1.5
        assert len(s.messages) == 4  # the refused turn added nothing
        child.close()
        s.close()


@pytest.mark.parametrize("bad", ["1", 1.0, True, [0], [0, 0, 0]])
def test_bad_priorities_are_config_errors(llama_dir, bad):
    with tiny_llm(llama_dir) as llm:
        with pytest.raises(ConfigError, match="priority"):
            llm.generate(["a", "b"], G, priority=bad, use_tqdm=False)
        with pytest.raises(ConfigError, match="priority"):
            llm.session(priority=bad)
        assert llm.stats().tiers["device"].blocks_used == 0


def test_long_prompts_share_the_step_without_changing_outputs(llama_dir):
    """A long prompt beside short ones: capped (the default, the threshold a quarter of
    the step's budget) and uncapped (long_prefill_token_threshold=0) give the same tokens,
    and with the caps the short ones finish while the long one is still in its prefill."""
    long, *short = random_prompts(7, [400, 12, 15, 9], 256)
    outs = {}
    for threshold in (None, 0):
        with tiny_llm(llama_dir, max_num_batched_tokens=64,
                      long_prefill_token_threshold=threshold) as llm:
            got = llm.generate(prompt_token_ids=[long, *short], sampling_params=G,
                               use_tqdm=False)
        outs[threshold] = got
    assert [o.outputs[0].token_ids for o in outs[None]] == \
        [o.outputs[0].token_ids for o in outs[0]]
    # capped: every short request ended (6 tokens) before the long one's first token
    # (uncapped, they are admitted in the step its prefill ends: tests/test_scheduler_unit)
    capped = outs[None]
    assert max(o.metrics.e2e_s for o in capped[1:]) < capped[0].metrics.ttft_s


@pytest.mark.parametrize(("kw", "match"), [
    ({"max_num_partial_prefills": 0}, "max_num_partial_prefills"),
    ({"max_num_partial_prefills": 2, "max_long_partial_prefills": 3},
     "max_long_partial_prefills"),
    ({"long_prefill_token_threshold": 4096}, "long_prefill_token_threshold"),
    ({"long_prefill_token_threshold": -1}, "long_prefill_token_threshold"),
    ({"long_prefill_token_threshold": "x"}, "long_prefill_token_threshold")])
def test_bad_caps_are_config_errors(llama_dir, kw, match):
    with pytest.raises(ConfigError, match=match):
        tiny_llm(llama_dir, **kw)


def test_the_priority_hint_is_kept_with_the_conversation(llama_dir):
    """The agent hint `priority` (serve/agent_hints.py) becomes the conversation's Session
    priority: its later turns and the order its idle KV is reclaimed in."""
    from internals import Internals

    from kvsession.openai_compat import Client

    with tiny_llm(llama_dir) as llm:
        c, inside = Client(llm), Internals(llm)
        seen: set[int] = set()  # the priorities the scheduler ran requests at
        inside.after_each_step(lambda: seen.update(inside.running_priorities()))
        c.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}],
                                  max_tokens=2, extra_headers={"x-session-id": "conv"},
                                  extra_body={"kvsession": {"priority": 4}})
        assert inside.sessions[0]["conv"].priority == 4 and seen == {4}
        c.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}],
                                  max_tokens=2, extra_body={"kvsession": {"priority": -2}})
        assert seen == {4, -2}  # a stateless request's own
        # /v1/completions has no conversation: the priority is the one hint it acts on,
        # from the body or a header, streamed or not, one prompt or several
        c.openai.completions.create(model="m", prompt="hi", max_tokens=2,
                                    extra_body={"kvsession": {"priority": 7}})
        c.openai.completions.create(model="m", prompt=["hi", "ho"], max_tokens=2,
                                    extra_headers={"x-kvsession-priority": "8"})
        list(c.openai.completions.create(model="m", prompt="hi", max_tokens=2, stream=True,
                                         extra_body={"kvsession": {"priority": 9}}))
        assert seen == {4, -2, 7, 8, 9}


A = 1 / 1024  # seconds a prompt token adds (attention pairs free in these tests)


def measured(pure_s: float = 0.020) -> SloChunking:
    """Chunking whose steps were measured: 4 decodes alone `pure_s` (1 decode too), a
    prompt token adds A."""
    stall = StallRatio()
    stall.observe(4, 0, pure_s)
    stall.observe(1, 0, pure_s)
    chunking = SloChunking(stall)
    for n, c in [(16, 0), (48, 300), (16, 900)]:
        chunking.observe(4, n, key_reads(n, c), pure_s + A * n)
    return chunking


def test_slo_chunking_leaves_the_decodes_their_target():
    """A 20 ms pure step and a target 32.5 tokens above it: 32 tokens; no target, nothing
    measured, or decodes alone past the target: no limit (the last counted)."""
    stall = StallRatio()
    chunking = SloChunking(stall)
    chunking.set_target(None, 0.020 + 32.5 * A)
    assert chunking.prefill_tokens(4, 16, 0) is None  # nothing measured yet
    chunking = measured()
    assert chunking.cost.a_s == pytest.approx(A, rel=1e-4) and chunking.cost.b_s < 1e-10
    assert chunking.prefill_tokens(4, 16, 0) is None  # no target
    chunking.set_target(None, 0.020 + 32.5 * A)
    assert chunking.prefill_tokens(4, 16, 5000) == 32
    assert chunking.prefill_tokens(8, 16, 0) == 32  # not measured: the nearest size's step
    assert chunking.prefill_tokens(0, 16, 0) is None  # alone, no TTFT target
    chunking.set_target(None, 0.010)  # the decodes alone take 20 ms
    assert chunking.prefill_tokens(4, 16, 0) is None and chunking.unmet_steps == 1
    chunking.set_target(None, 0.020 + 1.9 * A)  # 16 tokens: more than 8 steps' room
    assert chunking.prefill_tokens(4, 16, 0) is None and chunking.unmet_steps == 2
    chunking.set_target(float("inf"), float("inf"))
    assert chunking.prefill_tokens(4, 16, 0) is None and chunking.held_steps == 0


def test_a_block_the_target_cannot_hold_is_paid_for_by_held_steps():
    """Room for 6.5 tokens a step, a block is 16: the long prompt sits out steps banking
    their room, then takes what the bank and the step's room pay for (19: the step runs
    over the target by what was banked), and sits out again; a step longer than predicted
    is a debt the next holds repay (3.5 tokens' time: then exactly a block); room banked
    while nothing was held back is not kept."""
    chunking = measured()
    tpot = 0.020 + 6.5 * A
    chunking.set_target(None, tpot)
    answers = []
    for _ in range(9):
        n = chunking.prefill_tokens(4, 16, 0)
        answers.append(n)
        chunking.observe(4, n, key_reads(n, 0), 0.020 + A * n)
    assert answers == [0, 0, 19, 0, 0, 19, 0, 0, 19] and chunking.held_steps == 6
    # a held step 10 token-times long: 3.5 more than the target
    assert chunking.prefill_tokens(4, 16, 0) == 0
    chunking.observe(4, 0, 0, 0.020 + 10 * A)
    answers = []
    for _ in range(4):
        n = chunking.prefill_tokens(4, 16, 0)
        answers.append(n)
        chunking.observe(4, n, key_reads(n, 0), 0.020 + A * n)
    assert answers == [0, 0, 16, 0]
    for _ in range(5):  # no long prompt: fast steps bank nothing
        chunking.observe(4, 0, 0, 0.020)
    assert chunking.prefill_tokens(4, 16, 0) == 0


def test_alone_a_long_prompt_takes_a_quarter_of_the_ttft_target():
    """No decode: a step of prompts alone lasts at most a quarter of the TTFT target past a
    one-decode step's time (20 ms), at least a block; so does a step whose decodes leave
    their TPOT target out of reach."""
    chunking = measured()
    chunking.set_target(0.080 + 4 * 100.5 * A, None)
    assert chunking.prefill_tokens(0, 16, 0) == 100
    chunking.set_target(0.080, None)  # a quarter is the fixed cost alone: a block
    assert chunking.prefill_tokens(0, 16, 0) == 16
    assert chunking.prefill_tokens(4, 16, 0) is None  # no TPOT target
    # a TPOT target out of reach beside 4 decodes (20 ms): their step is bounded as one
    # alone, its decodes' time included
    chunking.set_target(4 * (0.020 + 50.5 * A), 0.010)
    assert chunking.prefill_tokens(4, 16, 0) == 50 and chunking.unmet_steps == 1


def test_a_tpot_target_shrinks_a_long_prompts_chunks_beside_decodes(llama_dir):
    """A request decodes while a long prompt arrives. With a target no step can meet
    (1 us), the long prompt keeps the caps' chunk, its tokens unchanged, and stats()
    counts the steps the target was missed; without llm.slo set, none."""
    long, short = random_prompts(11, [300, 10], 256)
    decode = SamplingParams(max_tokens=120, temperature=0.0, ignore_eos=True)
    outs, unmet = {}, {}
    for target in (None, SLO(ttft_s=60.0, tpot_s=1e-6)):
        with tiny_llm(llama_dir, max_num_batched_tokens=64) as llm:
            if target is not None:
                llm.slo = target
            with llm.stream(prompt_token_ids=short, sampling_params=decode) as stream:
                it = iter(stream)
                for _ in range(8):  # pure decode steps measured before the long prompt
                    next(it)
                got = llm.generate(prompt_token_ids=[long], sampling_params=G,
                                   use_tqdm=False)[0]
                rest = list(it)
            outs[target is None] = (got.outputs[0].token_ids, stream.output.outputs[0].token_ids)
            unmet[target is None] = llm.stats().slo_unmet_steps
            assert rest
    assert outs[True] == outs[False]
    assert unmet[True] == 0 and unmet[False] >= 2


def test_a_ttft_target_bounds_a_long_prompts_steps_alone(llama_dir):
    """Nothing decodes: with a TTFT target no step can meet (1 us) a long prompt alone
    takes a block a step (what a request arriving meanwhile waits for), where without one
    the top-up gives it the whole budget; its tokens unchanged."""
    long, short, other = random_prompts(12, [300, 10, 12], 256)
    runs = {}
    for target in (None, SLO(ttft_s=1e-6, tpot_s=60.0)):
        with tiny_llm(llama_dir, max_num_batched_tokens=64, block_size=16) as llm:
            if target is not None:
                llm.slo = target
            # steps measured first: decodes (a step's fixed cost), then a prompt (its cost)
            for warm in (short, other):
                llm.generate(prompt_token_ids=[warm], sampling_params=G, use_tqdm=False)
            got = llm.generate(prompt_token_ids=[long], sampling_params=G, use_tqdm=False)[0]
            runs[target is None] = (got.outputs[0].token_ids, got.metrics.forward_passes)
    assert runs[True][0] == runs[False][0]
    assert runs[True][1] == -(-300 // 64) + G.max_tokens - 1
    assert runs[False][1] == -(-300 // 16) + G.max_tokens - 1
