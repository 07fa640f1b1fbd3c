"""Goodput scheduling through the LLM (the scheduler's exact steps: test_scheduler_unit.py):
a more urgent request runs first, a session's priority orders its turns and which idle KV
is reclaimed first, long prompts share the step without changing any output, a TPOT
target shrinks a long prompt's chunks beside decodes (and says when it cannot be met),
and bad values are ConfigErrors."""

from __future__ import annotations

import pytest
from llms import tiny_llm

from kvsession import SamplingParams
from kvsession.costmodel import StallRatio
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


def test_slo_chunking_leaves_the_decodes_their_target():
    """A pure step of 4 decodes measured at 20 ms, then one with 20 prompt tokens at 40 ms:
    a token adds 1 ms, so a 50 ms target leaves 30 ms, 30 tokens; a target the decodes
    alone is out of reach: no limit, the step counted; no target, no decode, or nothing
    measured yet: no limit."""
    stall = StallRatio()
    chunking = SloChunking(stall)
    chunking.set_target(0.050)
    assert chunking.prefill_tokens(4, 16) is None  # nothing measured yet
    stall.observe(4, 0, 0.020)
    assert chunking.prefill_tokens(4, 16) is None  # no step with prompt tokens yet
    stall.observe(4, 20, 0.040)
    assert stall.token_s == pytest.approx(0.001)
    chunking.set_target(None)
    assert chunking.prefill_tokens(4, 16) is None  # no target
    chunking.set_target(0.050)
    assert chunking.prefill_tokens(4, 16) == 30
    assert chunking.prefill_tokens(0, 16) is None
    assert chunking.prefill_tokens(8, 16) == 30  # not measured: the nearest size's step
    chunking.set_target(0.010)
    assert chunking.prefill_tokens(4, 16) is None and chunking.unmet_steps == 1
    chunking.set_target(float("inf"))
    assert chunking.prefill_tokens(4, 16) is None


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
