"""Observability: the `Stats` struct of `llm.stats()`, per-request metrics and the SLO
tracker (latency percentiles, goodput and SLO attainment, DistServe's definitions).

Structs are msgspec Structs so `msgspec.json.encode(llm.stats())` works.
"""

from __future__ import annotations

import bisect
import threading
from collections import deque
from dataclasses import dataclass

import msgspec

from kvsession import costmodel, display
from kvsession.tiers.recovery import LogRecovery
from kvsession.validation import check_float


@dataclass(frozen=True)
class SLO:
    """Per-request latency targets: time to first token and time per output token."""

    ttft_s: float = 2.0
    tpot_s: float = 0.2

    def __post_init__(self) -> None:
        for name in ("ttft_s", "tpot_s"):  # a number > 0, not a bool (inf: no target)
            object.__setattr__(self, name, check_float(
                name, getattr(self, name), min_value=0.0, min_inclusive=False))


class RequestMetrics(msgspec.Struct):
    ttft_s: float
    tpot_s: float
    e2e_s: float
    queue_s: float
    # engine steps that computed some of its tokens (prompt chunks, decodes, verifications;
    # n > 1: the completion that ended last), and the drafted tokens (jump-forward spans,
    # speculation) its verifications kept: tokens beyond one per decode step
    forward_passes: int = 0
    accepted_draft_tokens: int = 0


class TierStats(msgspec.Struct):
    blocks_total: int = 0
    blocks_used: int = 0  # held (device: referenced; host: held by spilled sessions)
    blocks_free: int = 0
    blocks_pinned: int = 0
    bytes_per_token: int = 0
    tokens_capacity: int = 0
    # the tiers below the device: cached blocks found there by content (any request),
    # tokens loaded from there (lookups and session restores), bytes copied each way
    cached_blocks: int = 0
    hit_tokens: int = 0
    bytes_read: int = 0
    bytes_written: int = 0
    cache_bytes_written: int = 0  # of bytes_written, the disk cache's (not sessions' files)
    # host (disk): device (host) blocks copied here as they were evicted (on the engine
    # thread, the step waiting), and those copied ahead of their eviction (on the copier)
    blocks_copied_at_eviction: int = 0
    blocks_copied_ahead: int = 0
    # what the cost model has measured of loading from here (0.0 until a load is timed):
    # bytes/s once the bytes flow, and the seconds before they do (an object store's round
    # trip)
    read_bytes_per_s: float = 0.0
    latency_s: float = 0.0


class PrefixStats(msgspec.Struct):
    queried_tokens: int = 0
    hit_tokens: int = 0
    hit_rate: float = 0.0
    evictions: int = 0
    cached_blocks: int = 0
    pinned_blocks: int = 0
    pinned_bytes: int = 0
    num_pins: int = 0
    eviction_policy: str = "cost"
    # evicted cached blocks by where a copy survives ("none", "host", "disk") and by why
    # they were the victim ("lru", "score", "non_leaf")
    evictions_by_copy: dict[str, int] = msgspec.field(default_factory=dict)
    evictions_by_reason: dict[str, int] = msgspec.field(default_factory=dict)


class WorkerStats(msgspec.Struct):
    """One prefill worker's connection (docs/remote-prefill.md, "Connections")."""

    state: str = "connecting"  # connecting | ready | dead (reconnect pending) | refused
    reason: str = ""  # why it is not ready
    attempts: int = 0  # connection attempts, the first included
    connects: int = 0  # handshakes completed
    reconnects: int = 0  # handshakes completed after a death
    deaths: dict[str, int] = msgspec.field(default_factory=dict)  # by reason
    heartbeats: int = 0  # heartbeats answered
    rejected: int = 0  # messages the worker rejected
    requests: int = 0  # prefills sent to it
    prefills: int = 0  # prefills it completed
    # KV bytes it wrote into this engine's cache, as it reports them (its answers, which may
    # trail the completion; `RemoteStats.bytes` counts completed prefills on this side)
    bytes: int = 0
    # routing (prefix affinity with bounded load): requests it got as their preferred
    # worker, and requests it got because the preferred one was at the load bound
    routed: int = 0
    spilled: int = 0
    cached_tokens: int = 0  # context tokens it served from its own prefix cache


class RemoteStats(msgspec.Struct):
    prefills: int = 0
    fallbacks: dict[str, int] = msgspec.field(default_factory=dict)
    bytes: int = 0
    bandwidth_gbps: float = 0.0
    workers: dict[str, WorkerStats] = msgspec.field(default_factory=dict)  # by address
    foreign_notifications: int = 0  # NIXL notifications not from the request's worker


# A latency histogram's bucket upper bounds, seconds (the last bucket, +Inf, is implicit):
# from a millisecond (a decode step's time per token on a GPU) to a minute (a queued long
# prefill on a CPU), roughly x2.5 apart, as Prometheus' default buckets are
LATENCY_BUCKETS_S = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0,
                     10.0, 30.0, 60.0)


class Histogram(msgspec.Struct):
    """Every finished request's value, counted since the LLM started: `counts[i]` values
    in (bounds_s[i - 1], bounds_s[i]] (`counts[-1]`: above the last bound), their `sum_s`
    and `count`. Monotonic, so that histograms of several replicas add up (Prometheus'
    histogram; the percentiles beside it cover only a recent window)."""

    bounds_s: list[float] = msgspec.field(default_factory=lambda: list(LATENCY_BUCKETS_S))
    counts: list[int] = msgspec.field(
        default_factory=lambda: [0] * (len(LATENCY_BUCKETS_S) + 1))
    sum_s: float = 0.0
    count: int = 0

    def observe(self, value_s: float) -> None:
        self.counts[bisect.bisect_left(self.bounds_s, value_s)] += 1
        self.sum_s += value_s
        self.count += 1

    def copy(self) -> Histogram:
        return Histogram(list(self.bounds_s), list(self.counts), self.sum_s, self.count)


class LatencyStats(msgspec.Struct):
    ttft_p50_s: float = 0.0
    ttft_p99_s: float = 0.0
    tpot_p50_s: float = 0.0
    tpot_p99_s: float = 0.0
    # since start: time to first token, time per output token, time queued before the
    # first step
    ttft_s: Histogram = msgspec.field(default_factory=Histogram)
    tpot_s: Histogram = msgspec.field(default_factory=Histogram)
    queue_s: Histogram = msgspec.field(default_factory=Histogram)


class Stats(msgspec.Struct):
    tiers: dict[str, TierStats]
    prefix: PrefixStats
    spills: dict[str, int]
    restores: dict[str, int]
    recomputes: int
    remote: RemoteStats
    latency: LatencyStats
    goodput_tokens_per_s: float
    slo_attainment: float
    num_requests: int
    num_preemptions: int
    # prompt tokens computed locally (not served by the prefix cache, a session's KV, a
    # fork of n > 1 completions or a remote worker)
    prefill_tokens: int = 0
    # tokens sampled (every completion's, cancelled and failed requests' included)
    generated_tokens: int = 0
    # the cuts crash recovery made to session logs in session_dir: the start-up scan's and
    # those of sessions this LLM resumed (tiers/recovery.py)
    recovery: list[LogRecovery] = msgspec.field(default_factory=list)
    # steps where the TPOT target of `llm.slo` was out of reach beside the decodes (the
    # decodes alone took it, or a block of a long prompt would take more than 8 steps'
    # room): long prompts kept the prefill caps' chunk; the target is beyond this hardware
    # at that load
    slo_unmet_steps: int = 0
    # steps in which a long prompt sat out so that the decodes kept the TPOT target (less
    # than a block fitted; the room banked pays for its next block)
    slo_held_steps: int = 0
    # spills to disk that failed (a full or failing disk): each session kept its KV where
    # it was, and the failure was logged
    spill_failures: int = 0
    # drafts (grammar-forced spans, speculation: engine/drafts.py) computed for
    # verification, and of them those kept
    draft_tokens_proposed: int = 0
    draft_tokens_accepted: int = 0

    def _repr_html_(self) -> str:
        """Every tier's occupancy, then the cache's and tiers' counters and latency."""
        tiers = "".join(
            f"<tr><td>{name}</td><td>{t.blocks_used}/{t.blocks_total}</td>"
            f"<td>{t.blocks_pinned}</td><td>{t.tokens_capacity}</td></tr>"
            for name, t in self.tiers.items())
        counters = display.table("", [
            ("requests", f"{self.num_requests} ({self.num_preemptions} preempted)"),
            ("prefix cache", f"hit rate {self.prefix.hit_rate:.0%} of "
                             f"{self.prefix.queried_tokens} tokens, "
                             f"{self.prefix.num_pins} pins"),
            ("prompt tokens computed", self.prefill_tokens),
            ("spills / restores", f"{self.spills} / {self.restores}"),
            ("recomputed instead of loaded", self.recomputes),
            ("TTFT p50 / p99", f"{display.ms(self.latency.ttft_p50_s)} / "
                               f"{display.ms(self.latency.ttft_p99_s)}"),
            ("time per output token p50", display.ms(self.latency.tpot_p50_s))])
        return ("<b>kvsession stats</b><table><tr><th>tier</th><th>blocks used</th>"
                f"<th>pinned</th><th>token capacity</th></tr>{tiers}</table>{counters}")


def percentile(values: list[float], q: float) -> float:
    """Nearest-rank percentile (q in [0, 100]); 0.0 for no values."""
    if not values:
        return 0.0
    s = sorted(values)
    k = max(0, min(len(s) - 1, int(-(-q * len(s) // 100)) - 1))
    return s[k]


class LatencyTracker:
    """The last `window` finished requests: (arrival, finish, ttft, tpot, output tokens),
    and histograms of every finished request's TTFT, TPOT and queue time.
    Thread-safe: the engine thread records, any thread summarises."""

    def __init__(self, window: int = 1024):
        self._records: deque[tuple[float, float, float, float, int]] = deque(maxlen=window)
        self._lock = threading.Lock()
        self.num_requests = 0
        self._histograms = (Histogram(), Histogram(), Histogram())  # ttft, tpot, queue

    def record(self, arrival: float, finish: float, m: RequestMetrics, num_tokens: int) -> None:
        with self._lock:
            self._records.append((arrival, finish, m.ttft_s, m.tpot_s, num_tokens))
            self.num_requests += 1
            ttft, tpot, queue = self._histograms
            ttft.observe(m.ttft_s)
            queue.observe(m.queue_s)
            if num_tokens > 1:  # one token has no time per output token
                tpot.observe(m.tpot_s)

    def tpot_p50_s(self) -> float:
        """Median time per output token over the window (0.0 before any request): what
        the remote-prefill decision needs per admission, without a whole summary."""
        with self._lock:
            return percentile([r[3] for r in self._records], 50)

    def summary(self, slo: SLO) -> tuple[LatencyStats, float, float]:
        """(latency percentiles, goodput tokens/s, SLO attainment) over the window. Wall time
        runs from the earliest arrival to the latest finish among the window's requests."""
        with self._lock:
            recs = list(self._records)
            ttft_h, tpot_h, queue_h = (h.copy() for h in self._histograms)
        if not recs:
            return LatencyStats(ttft_s=ttft_h, tpot_s=tpot_h, queue_s=queue_h), 0.0, 0.0
        requests = [(ttft, tpot, n) for _, _, ttft, tpot, n in recs]
        wall = max(r[1] for r in recs) - min(r[0] for r in recs)
        goodput = costmodel.goodput_tokens_per_s(requests, slo.ttft_s, slo.tpot_s, wall)
        attainment = costmodel.slo_attainment(requests, slo.ttft_s, slo.tpot_s)
        ttfts, tpots = [r[0] for r in requests], [r[1] for r in requests]
        lat = LatencyStats(percentile(ttfts, 50), percentile(ttfts, 99),
                           percentile(tpots, 50), percentile(tpots, 99), ttft_h, tpot_h,
                           queue_h)
        return lat, goodput, attainment
