"""The engine thread's CPU thread count: which steps share a measurement (`step_kind`) and
how the ThreadGovernor chooses, probes and follows the measured times."""

from __future__ import annotations

from kvsession import SamplingParams
from kvsession.engine.runner import StepKind, ThreadGovernor, step_kind
from kvsession.engine.scheduler import ScheduledSeq
from kvsession.engine.sequence import Sequence


def scheduled(context: int, new_tokens: int = 1) -> ScheduledSeq:
    """A sequence with `context` tokens cached, scheduled for `new_tokens` more."""
    seq = Sequence(token_ids=list(range(context + new_tokens)),
                   params=SamplingParams(max_tokens=4, temperature=0.0), max_model_len=8192)
    seq.num_computed_tokens = context
    return ScheduledSeq(seq, new_tokens)


def test_decode_steps_are_kinds_by_batch_size_and_context_length():
    short, long_ = step_kind([scheduled(128)]), step_kind([scheduled(2048)])
    assert short[0] is StepKind.DECODE and long_[0] is StepKind.DECODE
    assert short != long_  # measured apart: a long step is slower and scales differently
    # the same power of two of cached tokens: one kind
    assert step_kind([scheduled(1100)]) == step_kind([scheduled(2000)])
    assert step_kind([scheduled(128)] * 2) != short  # another batch size
    # the context of a batch is what its attention reads: all its sequences' tokens
    assert step_kind([scheduled(1024), scheduled(1024)]) == (StepKind.DECODE, 2, 12)


def test_prefill_steps_are_kinds_by_token_count():
    kind = step_kind([scheduled(0, new_tokens=300)])
    assert kind == (StepKind.PREFILL, 9)
    assert step_kind([scheduled(50, new_tokens=200), scheduled(0, new_tokens=100)]) == kind


def run(governor: ThreadGovernor, key: tuple, seconds, steps: int) -> list:
    """`steps` steps of kind `key` taking seconds[threads] each (or seconds(i, threads) for
    the i-th): the counts chosen."""
    chosen = []
    for i in range(steps):
        threads = governor.choose(key)
        governor.record(key, threads, seconds(i, threads) if callable(seconds)
                        else seconds[threads])
        chosen.append(threads)
    return chosen


def test_all_cores_until_one_thread_is_probed_then_the_faster_count():
    g = ThreadGovernor(2)
    first = ThreadGovernor.PROBE_EVERY[0]
    chosen = run(g, ("k",), {2: 0.005, 1: 0.004}, first + 4)
    # all cores for the first steps, then a probe of PROBE_STEPS steps on one thread,
    # which measured faster here: it stays
    assert chosen[:first] == [2] * first
    assert chosen[first:] == [1] * 4


def test_a_clearly_slower_probe_makes_probes_rarer():
    g = ThreadGovernor(2)
    chosen = run(g, ("k",), {2: 0.005, 1: 0.010}, 200)
    probes = [i for i in range(1, len(chosen)) if chosen[i] == 1 and chosen[i - 1] == 2]
    gaps = [b - a for a, b in zip(probes, probes[1:], strict=False)]
    assert len(probes) >= 3
    assert all(b > a for a, b in zip(gaps, gaps[1:], strict=False))  # each gap longer
    assert chosen.count(1) == ThreadGovernor.PROBE_STEPS * len(probes)


def test_a_probe_of_one_kind_does_not_move_another_kind():
    """One thread measured faster for short steps leaves long steps on all cores."""
    g = ThreadGovernor(2)
    short, long_ = (StepKind.DECODE, 1, 8), (StepKind.DECODE, 1, 12)
    run(g, short, {2: 0.005, 1: 0.004}, 30)
    assert g.choose(short) == 1
    assert run(g, long_, {2: 0.008, 1: 0.012}, 10) == [2] * 10


def test_one_slow_step_does_not_move_the_choice():
    """A noisy machine's one slow two-thread step (here 10x) leaves the engine on all cores
    (an average took it for a change and ran one thread until the next probe)."""
    g = ThreadGovernor(2)
    run(g, ("k",), {2: 0.005, 1: 0.008}, 100)  # all cores, probes already rarer
    spike = run(g, ("k",), lambda i, t: 0.05 if i == 0 and t == 2 else {2: 0.005, 1: 0.008}[t],
                30)
    assert spike[0] == 2
    assert spike.count(1) <= ThreadGovernor.PROBE_STEPS  # at most a probe that was due


def test_lasting_slower_steps_move_the_choice_and_the_old_count_is_probed_soon():
    """Two-thread steps that stay slow (another process wants a core) move the kind to one
    thread within a majority of the window; all cores are tried again soon after."""
    g = ThreadGovernor(2)
    run(g, ("k",), {2: 0.005, 1: 0.008}, 100)
    loaded = {2: 0.030, 1: 0.010}
    chosen = run(g, ("k",), loaded, 60)
    assert chosen.index(1) <= ThreadGovernor.WINDOW // 2 + 1
    first = chosen.index(1)
    after = chosen[first:]
    back = after.index(2)  # the probe of all cores, counted from the change
    assert back <= ThreadGovernor.PROBE_EVERY[0] + 1
    # the load is still there: the probe confirms one thread
    assert after[back + ThreadGovernor.PROBE_STEPS:].count(2) <= ThreadGovernor.PROBE_STEPS
