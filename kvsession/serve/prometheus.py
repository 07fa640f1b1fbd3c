"""`GET /metrics`: `llm.stats()` and the server's own counters, exposed by
`prometheus_client` (the `server` extra) in its text format.

The values live in the engine (`llm.stats()`) and in the server's counters, so `/metrics`
builds metric families per scrape (`Exposition`: a custom collector, as prometheus_client
documents for proxying another system's numbers) rather than keeping prometheus_client
metric objects in step with them. prometheus_client writes the exposition format: `# HELP`
/ `# TYPE` headers, label escaping, `_total` on counters, a histogram's cumulative `le`
buckets with `_sum` and `_count`.

From `Stats`, read off the struct (a field added to it is exported without touching this
file, as a gauge unless named in `COUNTERS`):
- a number is named after its path (`kvsession_tiers_blocks_used{tier="device"}`,
  `kvsession_prefix_hit_rate`); a dict keyed by name becomes a label (`LABELS`); a string
  field becomes an `_info` gauge whose label holds it;
- counts that only grow (`COUNTERS`) are counters: `kvsession_prefix_hit_tokens_total`;
- the latency histograms (`Stats.latency`: every finished request's TTFT, TPOT and queue
  time since start) are histograms in seconds, `kvsession_request_ttft_seconds`, which
  add up across replicas; the window percentiles beside them in `Stats` are not exported
  (a p99 of p99s means nothing).
"""

from __future__ import annotations

import enum
from collections import OrderedDict

import msgspec
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)

CONTENT_TYPE = CONTENT_TYPE_LATEST
# Stats fields that are dicts keyed by a name (not structs): the label their keys become
LABELS = {"tiers": "tier", "spills": "tier", "restores": "tier", "fallbacks": "reason",
          "workers": "worker", "deaths": "reason", "evictions_by_copy": "copy",
          "evictions_by_reason": "reason"}
# Stats paths (after "kvsession_") that count events since the LLM started: counters
COUNTERS = frozenset({
    "prefix_queried_tokens", "prefix_hit_tokens", "prefix_evictions",
    "prefix_evictions_by_copy", "prefix_evictions_by_reason", "spills", "restores",
    "recomputes", "remote_prefills", "remote_fallbacks", "remote_bytes",
    "remote_foreign_notifications", "remote_workers_attempts", "remote_workers_connects",
    "remote_workers_reconnects", "remote_workers_deaths", "remote_workers_heartbeats",
    "remote_workers_rejected", "remote_workers_requests", "remote_workers_prefills",
    "remote_workers_bytes", "remote_workers_routed", "remote_workers_spilled",
    "remote_workers_cached_tokens", "num_requests", "num_preemptions", "prefill_tokens",
    "generated_tokens"})
# Stats.latency's histograms: the metric each becomes
HISTOGRAMS = {"ttft_s": "kvsession_request_ttft_seconds",
              "tpot_s": "kvsession_request_tpot_seconds",
              "queue_s": "kvsession_request_queue_seconds"}
HISTOGRAM_HELP = {"ttft_s": "time to first token of finished requests",
                  "tpot_s": "time per output token of finished requests (two tokens or more)",
                  "queue_s": "time finished requests waited before their first step"}


class MetricKind(enum.Enum):
    GAUGE = "gauge"
    COUNTER = "counter"


class Exposition:
    """Metric families built for one scrape, in the order added; `render()` has
    prometheus_client write them. A metric's samples must share its label names."""

    def __init__(self):
        self._families: OrderedDict[str, Metric] = OrderedDict()

    def add(self, name: str, value: float, labels: dict | None = None,
            kind: MetricKind = MetricKind.GAUGE, help: str = "") -> None:
        """One sample of metric `name` (a counter's name with or without `_total`)."""
        labels = labels or {}
        family = self._families.get(name)
        if family is None:
            cls = CounterMetricFamily if kind is MetricKind.COUNTER else GaugeMetricFamily
            family = self._families[name] = cls(name, help or name, labels=list(labels))
        family.add_metric([str(v) for v in labels.values()], value)

    def add_histogram(self, name: str, histogram: dict, help: str) -> None:
        """A `metrics.Histogram` (as msgspec.to_builtins gives it) as cumulative buckets."""
        family = HistogramMetricFamily(name, help)
        buckets, total = [], 0
        for bound, n in zip([*histogram["bounds_s"], float("inf")], histogram["counts"],
                            strict=True):
            total += n
            buckets.append(("+Inf" if bound == float("inf") else repr(float(bound)), total))
        family.add_metric([], buckets, sum_value=histogram["sum_s"])
        self._families[name] = family

    def add_stats(self, stats) -> None:
        """Every field of `Stats` (the module's docstring says how each is exported)."""
        self._walk("kvsession", msgspec.to_builtins(stats), {}, None)

    def _walk(self, name: str, value, labels: dict, field: str | None) -> None:
        path = name[len("kvsession_"):]
        kind = MetricKind.COUNTER if path in COUNTERS else MetricKind.GAUGE
        if isinstance(value, bool):
            self.add(name, int(value), labels, kind, help=f"llm.stats() {path}")
        elif isinstance(value, (int, float)):
            if path.startswith("latency_"):
                return  # a window percentile: see the module's docstring
            self.add(name, value, labels, kind, help=f"llm.stats() {path}")
        elif isinstance(value, str):
            self.add(f"{name}_info", 1, {**labels, "value": value},
                     help=f"llm.stats() {path} (in the label)")
        elif isinstance(value, dict):
            if field in HISTOGRAMS and path.startswith("latency_"):
                self.add_histogram(HISTOGRAMS[field], value, HISTOGRAM_HELP[field])
                return
            label = LABELS.get(field or "")
            for k, v in value.items():
                if label:
                    self._walk(name, v, {**labels, label: str(k)}, None)
                else:
                    self._walk(f"{name}_{k}", v, labels, k)

    def collect(self):
        """prometheus_client's collector interface: the families."""
        yield from self._families.values()

    def render(self) -> bytes:
        registry = CollectorRegistry(auto_describe=False)
        registry.register(self)
        return generate_latest(registry)
