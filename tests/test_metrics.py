"""LatencyTracker.summary (what llm.stats() reports as latency, goodput and SLO attainment)
and the nearest-rank percentile, on hand-built records whose answers are worked out by hand
(the worked example of docs/cost-model.md, 'Goodput and SLO attainment')."""

from __future__ import annotations

import math
import random

import pytest

from kvsession import LLM, ConfigError, SamplingParams, costmodel
from kvsession.metrics import (
    LATENCY_BUCKETS_S,
    SLO,
    LatencyStats,
    LatencyTracker,
    RequestMetrics,
    percentile,
)


def record(tracker: LatencyTracker, arrival: float, finish: float, ttft: float, tpot: float,
           tokens: int) -> None:
    tracker.record(arrival, finish, RequestMetrics(ttft_s=ttft, tpot_s=tpot,
                                                   e2e_s=finish - arrival, queue_s=0.0), tokens)


def percentiles(lat: LatencyStats) -> tuple[float, float, float, float]:
    return lat.ttft_p50_s, lat.ttft_p99_s, lat.tpot_p50_s, lat.tpot_p99_s


# (arrival s, finish s, ttft s, tpot s, output tokens) against SLO(1.0, 0.1)
EXAMPLE = [
    (10.0, 12.0, 0.5, 0.05, 100),   # meets both
    (11.0, 15.0, 1.5, 0.05, 200),   # TTFT missed
    (12.0, 20.0, 0.2, 0.2, 300),    # TPOT missed; the latest finish
    (9.0, 14.0, 1.0, 0.1, 50),      # ties both targets: meets; the earliest arrival, last recorded
]


def test_summary_worked_example():
    t = LatencyTracker()
    for r in EXAMPLE:
        record(t, *r)
    lat, goodput, attainment = t.summary(SLO(ttft_s=1.0, tpot_s=0.1))
    # wall = latest finish (20) - earliest arrival (9), whatever the recording order
    assert goodput == pytest.approx((100 + 50) / 11.0)
    assert attainment == 0.5
    # sorted TTFTs 0.2 0.5 1.0 1.5: p50 is the 2nd, p99 the 4th; TPOTs 0.05 0.05 0.1 0.2
    assert percentiles(lat) == (0.5, 1.5, 0.05, 0.2)
    assert t.tpot_p50_s() == 0.05
    assert t.num_requests == 4


def test_summary_depends_on_the_slo():
    t = LatencyTracker()
    for r in EXAMPLE:
        record(t, *r)
    _, goodput, attainment = t.summary(SLO(ttft_s=2.0, tpot_s=0.2))  # everything meets it
    assert goodput == pytest.approx(650 / 11.0)
    assert attainment == 1.0
    _, goodput, attainment = t.summary(SLO(ttft_s=0.1, tpot_s=0.01))  # nothing does
    assert goodput == 0.0 and attainment == 0.0


def test_summary_covers_only_the_window():
    t = LatencyTracker(window=2)
    for r in EXAMPLE:
        record(t, *r)
    lat, goodput, attainment = t.summary(SLO(ttft_s=1.0, tpot_s=0.1))
    # the last two records: (12, 20, 0.2, 0.2, 300) misses, (9, 14, 1.0, 0.1, 50) meets
    assert goodput == pytest.approx(50 / 11.0)
    assert attainment == 0.5
    assert percentiles(lat) == (0.2, 1.0, 0.1, 0.2)
    assert t.num_requests == 4  # every request ever recorded, not only the window


def test_histograms_count_every_request_since_start():
    """The histograms (Prometheus' buckets: a value equal to a bound counts in its bucket)
    hold every finished request, not only the window's; one-token requests have no TPOT."""
    t = LatencyTracker(window=2)
    for r in EXAMPLE:
        record(t, *r)
    record(t, 30.0, 30.5, 0.5, 0.0, 1)
    lat, _, _ = t.summary(SLO())
    bounds = list(LATENCY_BUCKETS_S)
    ttft = {b: n for b, n in zip([*bounds, math.inf], lat.ttft_s.counts, strict=True) if n}
    assert ttft == {0.25: 1, 0.5: 2, 1.0: 1, 2.5: 1}  # 0.2 | 0.5 0.5 | 1.0 | 1.5
    assert lat.ttft_s.count == 5 and lat.ttft_s.sum_s == pytest.approx(3.7)
    tpot = {b: n for b, n in zip([*bounds, math.inf], lat.tpot_s.counts, strict=True) if n}
    assert tpot == {0.05: 2, 0.1: 1, 0.25: 1} and lat.tpot_s.count == 4
    assert lat.queue_s.count == 5 and lat.queue_s.counts[0] == 5  # all 0.0
    record(t, 31.0, 200.0, 100.0, 0.0, 1)  # beyond the last bound: the +Inf bucket
    assert t.summary(SLO())[0].ttft_s.counts[-1] == 1


def test_zero_wall_time_gives_no_goodput_but_attainment():
    t = LatencyTracker()
    record(t, 5.0, 5.0, 0.0, 0.0, 1)
    lat, goodput, attainment = t.summary(SLO())
    assert goodput == 0.0
    assert attainment == 1.0
    assert percentiles(lat) == (0.0, 0.0, 0.0, 0.0)


def test_empty_tracker():
    t = LatencyTracker()
    assert t.summary(SLO()) == (LatencyStats(), 0.0, 0.0)
    assert t.tpot_p50_s() == 0.0
    assert t.num_requests == 0


def test_summary_uses_the_cost_model_definition(monkeypatch):
    """One definition of goodput: summary delegates to costmodel, it does not re-derive it."""
    calls = []

    def fake(requests, ttft_slo_s, tpot_slo_s, wall_s):
        calls.append((requests, ttft_slo_s, tpot_slo_s, wall_s))
        return 42.0

    monkeypatch.setattr(costmodel, "goodput_tokens_per_s", fake)
    t = LatencyTracker()
    for r in EXAMPLE:
        record(t, *r)
    assert t.summary(SLO(ttft_s=1.0, tpot_s=0.1))[1] == 42.0
    assert calls == [([(r[2], r[3], r[4]) for r in EXAMPLE], 1.0, 0.1, 11.0)]


def test_percentile_nearest_rank():
    v = [40.0, 10.0, 30.0, 20.0]
    # k = ceil(q / 100 * 4), the k-th smallest
    assert percentile(v, 0) == 10.0       # k = 0, clamped to the first
    assert percentile(v, 25) == 10.0      # k = 1
    assert percentile(v, 26) == 20.0      # k = ceil(1.04) = 2
    assert percentile(v, 50) == 20.0      # k = 2: no interpolation
    assert percentile(v, 75) == 30.0
    assert percentile(v, 76) == 40.0
    assert percentile(v, 99) == 40.0
    assert percentile(v, 100) == 40.0
    assert v == [40.0, 10.0, 30.0, 20.0]  # the input is not sorted in place


def test_percentile_edge_cases():
    assert percentile([], 50) == 0.0
    assert percentile([], 99) == 0.0
    for q in (0, 1, 50, 99, 100):
        assert percentile([7.0], q) == 7.0
    assert percentile([1.0, 2.0], 50) == 1.0   # k = 1
    assert percentile([1.0, 2.0], 51) == 2.0   # k = ceil(1.02) = 2
    hundred = list(range(1, 101))
    random.Random(0).shuffle(hundred)
    assert percentile(hundred, 50) == 50
    assert percentile(hundred, 99) == 99
    assert percentile(hundred, 100) == 100
    assert percentile([3.0, 3.0, 3.0, 9.0], 75) == 3.0  # duplicates keep their ranks


@pytest.mark.parametrize("bad", [{"ttft_s": "2"}, {"ttft_s": None}, {"tpot_s": [1]},
                                 {"ttft_s": True}, {"tpot_s": 0}, {"ttft_s": math.nan}])
def test_slo_targets_are_positive_numbers(bad):
    with pytest.raises(ConfigError, match=f"^{next(iter(bad))} must be"):
        SLO(**bad)
    assert SLO(ttft_s=math.inf, tpot_s=math.inf).ttft_s == math.inf  # no target


def test_a_prompt_logprobs_request_waiting_for_blocks_queries_nothing(llama_dir):
    """A request with prompt_logprobs never looks the prefix cache up: waiting for blocks,
    step after step, it must not take back queries it never made (the counter went
    negative, and the hit rate with it)."""
    a, b = list(range(10, 110)), list(range(200, 260))  # b waits for a's blocks
    with LLM(llama_dir, kv_cache_memory=80 * 1024, max_model_len=160) as llm:
        llm.generate(prompt_token_ids=[a, b], sampling_params=[
            SamplingParams(max_tokens=40, temperature=0, ignore_eos=True),
            SamplingParams(max_tokens=2, temperature=0, ignore_eos=True, prompt_logprobs=1)],
            use_tqdm=False)
        st = llm.stats()
        assert st.num_preemptions == 0 and st.prefix.queried_tokens == len(a) - 1
        assert 0 <= st.prefix.hit_rate <= 1


def test_pins_are_not_requests(llama_dir):
    """A pin computes its prefix with an engine-internal one-token prefill: stats() counts
    its prompt tokens as prefill work, never as a request, a latency sample or output."""
    with LLM(llama_dir, device="cpu", kv_cache_memory="8MiB", max_model_len=256) as llm:
        pin = llm.pin(list(range(5, 5 + 64)))
        s = llm.stats()
        assert (s.num_requests, s.generated_tokens) == (0, 0)
        assert s.prefill_tokens == 64
        assert s.latency == LatencyStats()
        llm.generate(prompt_token_ids=[list(range(5, 75))], sampling_params=SamplingParams(
            max_tokens=3, temperature=0.0, ignore_eos=True), use_tqdm=False)
        s = llm.stats()
        assert (s.num_requests, s.generated_tokens) == (1, 3)
        pin.unpin()
