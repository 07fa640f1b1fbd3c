"""The cost model (docs/cost-model.md: derivations and worked examples) as plain functions,
plus the online estimators that feed them measured inputs.

Units are in every name: *_ms milliseconds, *_bytes_per_s bytes per second, *_tps tokens per
second. No function here hard-codes a bandwidth or a speed: the engine measures them
(`RateEstimator`) and passes them in.
"""

from __future__ import annotations

import math
import threading

QUADRATIC_KNEE_TOKENS = 32768


def kv_bytes_per_token(num_layers: int, num_kv_heads: int, head_dim: int,
                       bytes_per_element: float) -> float:
    """2 (K and V) * layers * KV heads * head_dim * bytes per element: the nominal size the
    worked examples of docs/cost-model.md use (any float bytes per element, no fp8 scales).
    The engine's exact value, fp8 scales included, is
    `kvsession.cache.kv_pool.kv_bytes_per_token`."""
    return 2 * num_layers * num_kv_heads * head_dim * bytes_per_element


def decode_tps_bound(hbm_bytes_per_s: float, weight_bytes: float,
                     kv_bytes_read_in_batch: float) -> float:
    """Upper bound on decode tokens/s per sequence: one step reads every weight and the
    batch's KV once."""
    return hbm_bytes_per_s / (weight_bytes + kv_bytes_read_in_batch)


def meets_slo(ttft_s: float, tpot_s: float, ttft_slo_s: float, tpot_slo_s: float) -> bool:
    """A request meets its SLO iff it meets both targets (a tie meets it)."""
    return ttft_s <= ttft_slo_s and tpot_s <= tpot_slo_s


def goodput_tokens_per_s(requests: list[tuple[float, float, int]], ttft_slo_s: float,
                         tpot_slo_s: float, wall_s: float) -> float:
    """Tokens of requests (ttft_s, tpot_s, output_tokens) that met both SLOs, per second of
    `wall_s`; 0.0 when `wall_s <= 0`."""
    if wall_s <= 0:
        return 0.0
    good = sum(n for ttft, tpot, n in requests if meets_slo(ttft, tpot, ttft_slo_s, tpot_slo_s))
    return good / wall_s


def slo_attainment(requests: list[tuple[float, float, int]], ttft_slo_s: float,
                   tpot_slo_s: float) -> float:
    """Fraction of requests (ttft_s, tpot_s, output_tokens) that met both SLOs; 0.0 for none."""
    if not requests:
        return 0.0
    met = sum(1 for ttft, tpot, _ in requests if meets_slo(ttft, tpot, ttft_slo_s, tpot_slo_s))
    return met / len(requests)


# ---- prefill / decode split (remote prefill) ------------------------------------------

def transfer_ms(kv_bytes_per_token: float, num_tokens: int, net_bytes_per_s: float) -> float:
    return kv_bytes_per_token * num_tokens / net_bytes_per_s * 1000.0


def pd_split_gain_ms(prompt_tokens: int, output_tokens: int, kv_bytes_per_token: float,
                     net_bytes_per_s: float, tpot_ms: float,
                     colocated_stall_ratio: float) -> float:
    """Decode time no longer stalled by co-located prefill, minus the KV transfer. Offload
    only when positive."""
    saved_ms = output_tokens * tpot_ms * colocated_stall_ratio
    return saved_ms - transfer_ms(kv_bytes_per_token, prompt_tokens, net_bytes_per_s)


def remote_prefill_gain_ms(new_tokens: int, context_tokens: int, worker_cached_tokens: int,
                           output_tokens: int, kv_bytes_per_token: float,
                           net_bytes_per_s: float, tpot_ms: float,
                           colocated_stall_ratio: float, prefill_tps: float) -> float:
    """The gain of offloading the prefill of `new_tokens` that follow `context_tokens` the
    caller already holds (a session's earlier turns, prefix hits): `pd_split_gain_ms` with
    only the new tokens' KV moving, minus the time the worker spends recomputing the part
    of the context its own prefix cache lacks (`context_tokens - worker_cached_tokens`; the
    new tokens it computes as the caller would have). `prefill_tps`: the worker's speed
    (the caller's measured one: same model)."""
    missing = max(0, context_tokens - worker_cached_tokens)
    gain = pd_split_gain_ms(new_tokens, output_tokens, kv_bytes_per_token, net_bytes_per_s,
                            tpot_ms, colocated_stall_ratio)
    return gain - (recompute_ms(missing, prefill_tps) if missing else 0.0)


# ---- load from a tier, or recompute? ----------------------------------------------------

def recompute_ms(num_tokens: int, prefill_tps: float, queue_depth: int = 0) -> float:
    """Prefill time of `num_tokens` at the effective speed under load
    (`prefill_tps / max(1, queue_depth)`), inflated by sqrt(n / 32768) past 32k tokens for
    attention's quadratic term."""
    effective_tps = prefill_tps / max(1, queue_depth)
    ms = num_tokens / effective_tps * 1000.0
    if num_tokens > QUADRATIC_KNEE_TOKENS:
        ms *= math.sqrt(num_tokens / QUADRATIC_KNEE_TOKENS)
    return ms


def load_ms(num_tokens: int, kv_bytes_per_token: float, tier_bytes_per_s: float,
            latency_s: float = 0.0) -> float:
    """A load's time: the tier's latency (an object store's round trip, paid once per load:
    its reads run concurrently) and then its bytes at its bandwidth."""
    return (latency_s + num_tokens * kv_bytes_per_token / tier_bytes_per_s) * 1000.0


def should_load(num_tokens: int, kv_bytes_per_token: float, tier_bytes_per_s: float,
                prefill_tps: float, queue_depth: int = 0, latency_s: float = 0.0) -> bool:
    """Load iff loading is faster than recomputing right now."""
    return load_ms(num_tokens, kv_bytes_per_token, tier_bytes_per_s, latency_s) < \
        recompute_ms(num_tokens, prefill_tps, queue_depth)


def break_even_bytes_per_s(kv_bytes_per_token: float, prefill_tps: float) -> float:
    """A tier is worth loading from (at queue depth <= 1, below the knee) iff its bandwidth
    exceeds this; sequence length cancels out."""
    return kv_bytes_per_token * prefill_tps


class RateEstimator:
    """An exponentially weighted moving average of a measured rate (amount / seconds),
    thread-safe. `value` is the prior until the first measurement."""

    def __init__(self, prior: float, alpha: float = 0.3):
        self.value, self.alpha, self.num_samples = prior, alpha, 0
        self.fixed = False
        self._lock = threading.Lock()

    def fix(self, value: float) -> None:
        """Hold the estimate at `value` from now on, ignoring measurements: for tests that
        control a cost-based decision instead of depending on the machine's speed, and for
        operators who know their hardware."""
        with self._lock:
            self.value, self.fixed = float(value), True

    def observe(self, amount: float, seconds: float) -> None:
        if seconds <= 0 or amount <= 0 or self.fixed:
            return
        rate = amount / seconds
        with self._lock:
            self.value = rate if self.num_samples == 0 else (
                self.alpha * rate + (1 - self.alpha) * self.value)
            self.num_samples += 1


class StallRatio:
    """The co-located stall ratio, measured: of the time of the steps that decode, the
    share that prefill work batched with the decodes added. A step with prompt tokens and
    decodes adds its time beyond a pure decode step of as many decodes (an exponential
    average per power-of-two decode count); the ratio is the decayed sum of those additions
    over the decayed sum of decode steps' times (a memory of ~1 / (1 - DECAY) steps).
    `value` is the prior (0.3, mid the typical 0.15-0.45) until MIN_STEPS mixed steps with
    a known pure time were seen. Engine thread only (it observes and it decides)."""

    MIN_STEPS = 8
    DECAY = 0.99
    ALPHA = 0.3  # of the pure decode step time

    def __init__(self, prior: float = 0.3):
        self.prior, self.fixed = prior, None
        self.pure_s: dict[int, float] = {}  # decode count's bit_length -> step seconds
        self.stalled_s = self.decode_s = 0.0
        self.num_mixed = 0
        # what a prompt token adds to a step that decodes (seconds beyond the pure step, per
        # prompt token; an exponential average, ALPHA): SLO-aware chunking sizes a long
        # prompt's share with it. Not the prefill rate: a small chunk over a long context
        # costs more per token than a whole short prompt, and a step's fixed cost is the
        # decodes', already in the pure time
        self.token_s: float | None = None

    def fix(self, value: float) -> None:
        """Hold the ratio at `value` (tests, operators who know their workload)."""
        self.fixed = float(value)

    def observe(self, num_decodes: int, prompt_tokens: int, seconds: float) -> None:
        if num_decodes <= 0 or seconds <= 0:
            return  # no decode was stalled (or nothing was timed)
        kind = num_decodes.bit_length()
        pure = self.pure_s.get(kind)
        if prompt_tokens == 0:
            self.pure_s[kind] = seconds if pure is None else (
                self.ALPHA * seconds + (1 - self.ALPHA) * pure)
            stalled = 0.0
        elif pure is None:
            return  # no pure step of this size yet: nothing to attribute the time against
        else:
            stalled = max(0.0, seconds - pure)
            self.num_mixed += 1
            per_token = stalled / prompt_tokens
            self.token_s = per_token if self.token_s is None else (
                self.ALPHA * per_token + (1 - self.ALPHA) * self.token_s)
        self.stalled_s = self.stalled_s * self.DECAY + stalled
        self.decode_s = self.decode_s * self.DECAY + seconds

    @property
    def value(self) -> float:
        if self.fixed is not None:
            return self.fixed
        if self.num_mixed < self.MIN_STEPS or self.decode_s <= 0:
            return self.prior
        return min(1.0, self.stalled_s / self.decode_s)

    def pure_step_s(self, num_decodes: int) -> float | None:
        """A step of `num_decodes` decodes and no prompt tokens, as measured: its power-of-two
        bucket's average, else the nearest bucket measured (a decode step reads every
        weight once whatever the batch, so neighbouring sizes differ little; under a
        steady stream of prompts the exact size may never run alone); None before any
        pure step was seen."""
        if num_decodes <= 0 or not self.pure_s:
            return None
        kind = num_decodes.bit_length()
        return self.pure_s[min(self.pure_s, key=lambda k: (abs(k - kind), k))]


def slo_prefill_tokens(tpot_slo_s: float, pure_step_s: float, token_s: float) -> int:
    """Prompt tokens a step with decodes may add and still end within the TPOT target: the
    time the decodes leave (`tpot_slo_s - pure_step_s`) over what a prompt token adds to
    such a step (`StallRatio.token_s`); 0 when the decodes alone take the target."""
    return max(0, int((tpot_slo_s - pure_step_s) / max(token_s, 1e-9)))

