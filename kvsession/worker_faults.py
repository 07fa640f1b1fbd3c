"""Fault injection for the prefill worker (tests): `KVSESSION_WORKER_FAULTS` parsed into a
validated `Faults`; kvsession/worker.py applies it."""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, fields

FAULTS_ENV = "KVSESSION_WORKER_FAULTS"


@dataclass(frozen=True)
class Faults:
    """Injected faults, for tests: `KVSESSION_WORKER_FAULTS="delay_rate=0.5,delay_s=2.0,
    drop_rate=0.1,seed=0"` (every key optional; unset or empty: no faults).

    delay_rate: the probability that a prefill request first sleeps `delay_s` seconds
    (slower than the caller's timeout; SIGUSR1 ends such sleeps from then on); drop_rate:
    the probability that a prefill's answer is never sent (the NIXL writes still happen);
    stuck_rate: the probability that a prefill's transfer handles refuse every release (as
    if NIXL could not cancel them: the worker exits, see kvsession/worker.py); seed: the
    random generator's seed."""

    delay_rate: float = 0.0
    delay_s: float = 0.0
    drop_rate: float = 0.0
    stuck_rate: float = 0.0
    seed: int = 0

    def __post_init__(self) -> None:
        for name in ("delay_rate", "drop_rate", "stuck_rate"):
            v = getattr(self, name)
            if not 0.0 <= v <= 1.0:
                raise ValueError(f"{name} must be in [0, 1], got {v}")
        if not (math.isfinite(self.delay_s) and self.delay_s >= 0.0):
            raise ValueError(f"delay_s must be a finite number >= 0, got {self.delay_s}")

    @property
    def active(self) -> bool:
        return (bool(self.delay_s and self.delay_rate) or bool(self.drop_rate)
                or bool(self.stuck_rate))

    @classmethod
    def parse(cls, text: str) -> Faults:
        """`key=value` pairs separated by commas; raises ValueError (one line) on anything
        else: unknown or repeated keys, values that are not numbers, values out of range."""
        kinds = {f.name: type(f.default) for f in fields(cls)}  # float or int
        values: dict[str, float | int] = {}
        for item in (i.strip() for i in text.split(",")):
            if not item:
                continue
            key, sep, raw = (x.strip() for x in item.partition("="))
            if not sep or not key or not raw:
                raise ValueError(f"expected key=value, got {item!r}")
            if key not in kinds:
                raise ValueError(f"unknown key {key!r} (known: {', '.join(kinds)})")
            if key in values:
                raise ValueError(f"{key} given twice")
            try:
                values[key] = kinds[key](raw)
            except ValueError:
                what = "an integer" if kinds[key] is int else "a number"
                raise ValueError(f"{key}={raw!r} is not {what}") from None
        return cls(**values)

    @classmethod
    def from_env(cls, environ=os.environ) -> Faults:
        return cls.parse(environ.get(FAULTS_ENV, ""))
