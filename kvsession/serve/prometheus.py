"""`GET /metrics`: `llm.stats()` and the server's own counters in the Prometheus text
exposition format (version 0.0.4).

Every numeric field of `Stats` becomes a gauge named after its path
(`kvsession_tiers_blocks_used{tier="device"}`, `kvsession_prefix_hit_tokens`,
`kvsession_latency_ttft_p99_s`, `kvsession_goodput_tokens_per_s`); a dict keyed by name
becomes a label (`LABELS`); a string field becomes an `_info` metric whose label holds it.
Read off the struct, so a field added to Stats is exported without touching this file.
"""

from __future__ import annotations

import math
from collections import OrderedDict

import msgspec

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
# Stats fields that are dicts keyed by a name (not structs): the label their keys become
LABELS = {"tiers": "tier", "spills": "tier", "restores": "tier", "fallbacks": "reason",
          "workers": "worker", "deaths": "reason", "evictions_by_copy": "copy",
          "evictions_by_reason": "reason"}

def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace("\"", "\\\"").replace("\n", "\\n")


def _number(v: float) -> str:
    if isinstance(v, float):
        if math.isnan(v):
            return "NaN"
        if math.isinf(v):
            return "+Inf" if v > 0 else "-Inf"
        return repr(v)
    return str(int(v))


class Exposition:
    """Samples grouped by metric (one HELP / TYPE header each), rendered in order."""

    def __init__(self):
        self._metrics: OrderedDict = OrderedDict()

    def add(self, name: str, value, labels: dict | None = None, kind: str = "gauge",
            help: str = "") -> None:
        entry = self._metrics.setdefault(name, (kind, help, []))
        entry[2].append((labels or {}, value))

    def add_stats(self, stats) -> None:
        self._walk("kvsession", msgspec.to_builtins(stats), {}, None)

    def _walk(self, name: str, value, labels: dict, field: str | None) -> None:
        if isinstance(value, bool):
            self.add(name, int(value), labels, help=f"llm.stats() {name[10:]}")
        elif isinstance(value, (int, float)):
            self.add(name, value, labels, help=f"llm.stats() {name[10:]}")
        elif isinstance(value, str):
            self.add(f"{name}_info", 1, {**labels, "value": value},
                     help=f"llm.stats() {name[10:]} (in the label)")
        elif isinstance(value, dict):
            label = LABELS.get(field or "")
            for k, v in value.items():
                if label:
                    self._walk(name, v, {**labels, label: str(k)}, None)
                else:
                    self._walk(f"{name}_{k}", v, labels, k)

    def render(self) -> str:
        lines = []
        for name, (kind, help, samples) in self._metrics.items():
            lines.append(f"# HELP {name} {help or name}")
            lines.append(f"# TYPE {name} {kind}")
            for labels, value in samples:
                lab = ",".join(f'{k}="{_escape(str(v))}"' for k, v in labels.items())
                lines.append(f"{name}{{{lab}}} {_number(value)}" if lab
                             else f"{name} {_number(value)}")
        return "\n".join(lines) + "\n"
