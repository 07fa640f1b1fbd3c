"""The cost model's formulas reproduce the worked examples of docs/cost-model.md exactly."""

from __future__ import annotations

import pytest

from kvsession import costmodel as cm

KIB128 = 128 * 1024
GBIT = 1e9 / 8


def test_sizes():
    assert cm.kv_bytes_per_token(32, 8, 128, 2) == KIB128
    assert cm.kv_bytes_per_token(32, 8, 128, 2) * 32 * 1024 == 4 * 2**30  # 32k ctx = 4 GiB
    assert 64 * 4 * 2**30 == 256 * 2**30  # 64 such sessions


def test_decode_bandwidth_bound_worked_examples():
    assert cm.decode_tps_bound(4.8e12, 16e9, 0) == pytest.approx(300.0)
    kv = 32 * 4096 * KIB128  # 32 sequences of 4,096 tokens: 16 GiB read per step
    assert kv == 16 * 2**30
    per_seq = cm.decode_tps_bound(4.8e12, 16e9, kv)
    assert per_seq == pytest.approx(144.7, abs=0.05)
    assert 32 * per_seq == pytest.approx(4629, abs=0.5)


@pytest.mark.parametrize("prompt, output, gbit, transfer, gain", [
    (512, 1024, 80, 6.7, 7673.3),
    (32768, 128, 80, 429.5, 530.5),
    (32768, 128, 25, 1374.4, -414.4),
])
def test_pd_split_worked_examples(prompt, output, gbit, transfer, gain):
    assert cm.transfer_ms(KIB128, prompt, gbit * GBIT) == pytest.approx(transfer, abs=0.05)
    g = cm.pd_split_gain_ms(prompt, output, KIB128, gbit * GBIT, 25.0, 0.30)
    assert g == pytest.approx(gain, abs=0.05)
    assert (g > 0) == (gain > 0)


def test_pd_split_break_evens_and_stall_ratio_range():
    long_prompt = 32768
    # 25 Gbit/s: the 32k prompt pays from 184 output tokens on
    assert cm.pd_split_gain_ms(long_prompt, 183, KIB128, 25 * GBIT, 25.0, 0.30) < 0
    assert cm.pd_split_gain_ms(long_prompt, 184, KIB128, 25 * GBIT, 25.0, 0.30) > 0
    # with 128 output tokens it needs more than 35.8 Gbit/s
    assert cm.pd_split_gain_ms(long_prompt, 128, KIB128, 35.7 * GBIT, 25.0, 0.30) < 0
    assert cm.pd_split_gain_ms(long_prompt, 128, KIB128, 35.9 * GBIT, 25.0, 0.30) > 0
    # the typical stall ratio range 0.15-0.45
    for gbit, ratio, gain in [(80, 0.15, 50.5), (80, 0.45, 1010.5),
                              (25, 0.15, -894.4), (25, 0.45, 65.6)]:
        g = cm.pd_split_gain_ms(long_prompt, 128, KIB128, gbit * GBIT, 25.0, ratio)
        assert g == pytest.approx(gain, abs=0.05)


def test_load_vs_recompute_worked_examples():
    n = 8192  # 1 GiB at 128 KiB/token
    assert cm.load_ms(n, KIB128, 56 * GBIT) == pytest.approx(153.4, abs=0.05)
    assert cm.recompute_ms(n, 8000) == pytest.approx(1024.0)
    assert cm.should_load(n, KIB128, 56 * GBIT, 8000, queue_depth=1)
    assert cm.load_ms(n, KIB128, 8 * GBIT) == pytest.approx(1073.7, abs=0.05)
    assert not cm.should_load(n, KIB128, 8 * GBIT, 8000, queue_depth=1)
    assert cm.recompute_ms(n, 8000, queue_depth=2) == pytest.approx(2048.0)
    assert cm.should_load(n, KIB128, 8 * GBIT, 8000, queue_depth=2)
    assert cm.break_even_bytes_per_s(KIB128, 8000) == pytest.approx(1.048576e9)
    assert cm.break_even_bytes_per_s(KIB128, 8000) / GBIT == pytest.approx(8.39, abs=0.005)
    assert cm.load_ms(n, KIB128, 7e9) == cm.load_ms(n, KIB128, 56 * GBIT)  # 56 Gbit/s = 7 GB/s


def test_load_wins_more_as_queue_depth_grows():
    slow = 0.5 * cm.break_even_bytes_per_s(KIB128, 8000)  # below break-even
    assert cm.load_ms(4096, KIB128, slow) == pytest.approx(1024.0)
    recomputes = [cm.recompute_ms(4096, 8000, q) for q in range(0, 5)]
    assert recomputes == pytest.approx([512.0, 512.0, 1024.0, 1536.0, 2048.0])
    decisions = [cm.should_load(4096, KIB128, slow, 8000, q) for q in range(0, 5)]
    assert decisions == [False, False, False, True, True]  # a tie (depth 2) recomputes


def test_quadratic_term_past_32k():
    assert cm.recompute_ms(32768, 8000) == pytest.approx(4096.0)
    assert cm.recompute_ms(4 * 32768, 8000) == pytest.approx(4 * 4096.0 * 2)


def test_rate_estimator_is_an_ewma():
    r = cm.RateEstimator(prior=100.0, alpha=0.5)
    assert r.value == 100.0
    r.observe(1000, 1.0)
    assert r.value == 1000.0
    r.observe(2000, 1.0)
    assert r.value == 1500.0
    r.observe(0, 1.0)
    assert r.value == 1500.0


def test_goodput_counts_only_requests_meeting_both_slos():
    reqs = [(0.1, 0.01, 100), (0.5, 0.01, 100), (0.1, 0.2, 100)]
    assert cm.goodput_tokens_per_s(reqs, 0.2, 0.05, 10.0) == 10.0
    assert cm.goodput_tokens_per_s(reqs, 0.2, 0.05, 0.0) == 0.0
    assert cm.slo_attainment(reqs, 0.2, 0.05) == pytest.approx(1 / 3)
    assert cm.slo_attainment([], 0.2, 0.05) == 0.0
    # a tie meets the SLO
    assert cm.meets_slo(0.2, 0.05, 0.2, 0.05)
    assert not cm.meets_slo(0.2, 0.0501, 0.2, 0.05)


def test_a_fixed_estimate_ignores_measurements():
    r = cm.RateEstimator(prior=5.0)
    r.observe(10.0, 1.0)
    assert r.value == 10.0 and r.num_samples == 1
    r.fix(2.0)
    r.observe(1000.0, 1.0)
    assert r.value == 2.0 and r.num_samples == 1


@pytest.mark.parametrize("new, context, worker_has, gain", [
    (1024, 32768, 32256, 1813.1),  # affine worker: 512 context tokens to recompute
    (1024, 32768, 0, -2218.9),  # cold worker: the whole context to recompute
    (1024, 0, 0, 1877.1),  # a fresh 1,024-token prompt
])
def test_follow_up_offload_worked_examples(new, context, worker_has, gain):
    g = cm.remote_prefill_gain_ms(new, context, worker_has, 256, KIB128, 25 * GBIT, 25.0, 0.30,
                                  8000.0)
    assert g == pytest.approx(gain, abs=0.05)
    # shipping the whole context instead (what a turn 2+ would cost without the delta)
    assert cm.pd_split_gain_ms(new + context, 256, KIB128, 25 * GBIT, 25.0, 0.30) == \
        pytest.approx(502.7 if context else gain, abs=0.05)
    assert cm.transfer_ms(KIB128, new, 25 * GBIT) == pytest.approx(42.9, abs=0.05)


def test_stall_ratio_is_measured_from_mixed_steps():
    s = cm.StallRatio()
    assert s.value == 0.3  # the prior
    s.observe(4, 100, 0.02)  # mixed, but no pure 4-decode step yet: nothing to attribute
    s.observe(0, 500, 0.05)  # prefill alone: no decode stalled
    assert s.value == 0.3 and s.decode_s == 0.0
    for _ in range(10):
        s.observe(4, 0, 0.010)  # pure decode steps of 4 (bucket 3) take 10 ms
    for _ in range(cm.StallRatio.MIN_STEPS - 1):
        s.observe(5, 200, 0.030)  # 5 decodes: the same bucket; 20 ms added by prefill
    assert s.value == 0.3  # not enough mixed steps yet
    s.observe(5, 200, 0.030)
    # decayed sums: 8 mixed steps of 20 ms added out of 30 ms, after 10 pure ones of 10 ms
    d = cm.StallRatio.DECAY
    stalled = sum(0.020 * d ** k for k in range(8))
    total = stalled * 1.5 + sum(0.010 * d ** (8 + k) for k in range(10))
    assert s.value == pytest.approx(stalled / total)
    s.observe(1, 0, 0.005)  # another size's pure step only counts as decode time
    assert s.value < stalled / total
    s.fix(0.15)
    assert s.value == 0.15


def test_key_reads_counts_each_new_tokens_keys():
    # 3 new tokens after 5: they see 6, 7 and 8 keys
    assert cm.key_reads(3, 5) == 6 + 7 + 8
    assert cm.key_reads(1, 0) == 1 and cm.key_reads(0, 100) == 0


def test_prompt_cost_recovers_per_token_and_per_pair_costs():
    """Steps whose prompt tokens add exactly a per token and b per attention pair, at
    various chunk sizes and contexts: both recovered; `tokens_within` inverts `seconds`;
    nothing measured: None; a fit that would make one term negative keeps the other."""
    pc = cm.PromptCost()
    assert pc.seconds(16, 0) is None and pc.tokens_within(1.0, 0) is None
    a, b = 1e-3, 2e-7
    for n, c in [(16, 0), (48, 300), (16, 8000), (64, 12000), (32, 2000), (16, 15000)]:
        pc.observe(n, cm.key_reads(n, c), a * n + b * cm.key_reads(n, c))
    assert pc.a_s == pytest.approx(a, rel=1e-3) and pc.b_s == pytest.approx(b, rel=1e-3)
    for n, c in [(1, 0), (16, 15000), (100, 4000), (700, 0)]:
        s = pc.seconds(n, c)
        assert pc.tokens_within(s * (1 + 1e-6), c) == n  # exactly n fit, n + 1 do not
        assert pc.tokens_within(s * (1 - 1e-6), c) == n - 1
    assert pc.tokens_within(0.0, 100) == 0
    # a 16-token chunk 15k tokens in costs ~3x what it does at the start of a prompt
    assert pc.seconds(16, 15000) > 3 * pc.seconds(16, 0)
    odd = cm.PromptCost()  # cheaper further in (noise, another step's work): b would be < 0
    odd.observe(16, cm.key_reads(16, 0), 0.032)
    odd.observe(16, cm.key_reads(16, 9000), 0.016)
    assert odd.b_s == 0.0 and 1e-3 < odd.a_s < 2e-3  # the per-token rate of both steps
    assert odd.tokens_within(20.5 * odd.a_s, 5000) == 20
