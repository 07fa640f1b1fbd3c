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


def key_reads(num_tokens: int, context_tokens: int) -> int:
    """The (query, key) pairs causal attention scores for `num_tokens` new tokens after
    `context_tokens` cached ones: new token j (from 0) sees context_tokens + j + 1 keys.

        keys:        | context (c)            | new tokens (n)          |
        new token j: |<------- c + j + 1 ------->|
        sum over j < n: n * c + n * (n + 1) / 2
    """
    return num_tokens * context_tokens + num_tokens * (num_tokens + 1) // 2


class PromptCost:
    """What prompt tokens add to a step, measured: seconds = a * tokens + b * key reads (the
    attention pairs, `key_reads`), fitted by exponentially weighted least squares over the
    steps that computed prompt tokens (their time less the step's fixed cost: its decodes'
    pure step, or a one-decode step's weights read for a step of prompts alone).

    Why two terms: per token, a prompt's chunk costs its projections and MLP (`a`, the same
    at any position) plus attention over everything before it (`b` times the context). On
    the 2-core bench CPU (bench/goodput.py's model) a 16-token chunk over a 15k-token
    context costs ~8x what 16 tokens of a short turn do, so one rate per token, fitted on a
    mix of both, sized a document's chunks several times too large after a run of short
    turns. Engine thread only."""

    DECAY = 0.9  # a memory of ~10 steps: a document's context grows step by step
    RIDGE = 1e-6  # of each feature's own weight: a fit of steps all alike stays defined

    def __init__(self) -> None:
        self._tt = self._tk = self._kk = self._ty = self._ky = 0.0
        self.a_s: float | None = None  # seconds per prompt token; None: nothing measured
        self.b_s = 0.0  # seconds per key read

    def observe(self, tokens: int, reads: int, seconds: float) -> None:
        """One step's prompt `tokens`, their `key_reads`, and the `seconds` they added."""
        if tokens <= 0:
            return
        d, t, k, y = self.DECAY, float(tokens), float(reads), max(seconds, 0.0)
        self._tt = d * self._tt + t * t
        self._tk = d * self._tk + t * k
        self._kk = d * self._kk + k * k
        self._ty = d * self._ty + t * y
        self._ky = d * self._ky + k * y
        tt, kk = self._tt * (1 + self.RIDGE), self._kk * (1 + self.RIDGE)
        det = tt * kk - self._tk * self._tk
        a = (self._ty * kk - self._tk * self._ky) / det if det > 0 else -1.0
        b = (tt * self._ky - self._tk * self._ty) / det if det > 0 else -1.0
        if a < 0 or b < 0:  # one term explains the steps better: fit it alone
            a, b = (self._ty / tt, 0.0) if b < 0 or kk == 0 else (0.0, self._ky / kk)
        self.a_s, self.b_s = max(a, 0.0), max(b, 0.0)

    def seconds(self, tokens: int, context_tokens: int) -> float | None:
        """What `tokens` prompt tokens after `context_tokens` add to a step; None before any
        step was measured."""
        if self.a_s is None:
            return None
        return self.a_s * tokens + self.b_s * key_reads(tokens, context_tokens)

    def tokens_within(self, seconds: float, context_tokens: int) -> int | None:
        """The most prompt tokens after `context_tokens` that add at most `seconds` (0 when
        not even one does); None before any step was measured, or where they cost nothing.

        The largest n with a n + b (n c + n (n + 1) / 2) <= s: the positive root of
        (b / 2) n^2 + (a + b (c + 1/2)) n - s = 0, floored."""
        if self.a_s is None:
            return None
        if seconds <= 0:
            return 0
        a, b = self.a_s, self.b_s
        lin = a + b * (context_tokens + 0.5)
        if b <= 0:
            return None if lin <= 0 else int(seconds / lin)
        return max(0, int((-lin + math.sqrt(lin * lin + 2.0 * b * seconds)) / b))
