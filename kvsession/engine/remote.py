"""The engine's side of remote prefill, in one place behind the `RemotePrefills` protocol
(what the engine needs of a prefill connector, kvsession/connector/):

- the decision (`RemoteOffload`, the scheduler's OffloadDecider): offload a prompt or
  prefill it here, by the cost model;
- the driving (`RemotePrefillDriver.poll`): newly offloaded prompts submitted, the workers'
  completions applied (done: the KV is in the sequence's blocks; failed: prefilled here,
  or failed with remote_prefill="required"; fenced: quarantined blocks released);
- the accounting of what a worker may still write (`at_rest`): a failed request whose
  worker might still write its blocks keeps them quarantined (the scheduler holds them)
  until proof that no write can land; none may be left unaccounted for.

The connector is the one writer of its counters (`count_fallback`). Engine thread only.
"""

from __future__ import annotations

import collections
from typing import Protocol

from kvsession import costmodel
from kvsession.config import RemotePrefillMode
from kvsession.engine.scheduler import Scheduler
from kvsession.engine.sequence import Sequence
from kvsession.errors import RemotePrefillError
from kvsession.metrics import LatencyTracker


class RemotePrefills(Protocol):
    """What the engine needs of a prefill connector (kvsession.connector.base)."""

    fallbacks: dict[str, int]
    pending: dict
    quarantine: dict

    def submit(self, seq_id: int, token_ids: list[int], first_token: int,
               block_ids: list[int], keys: list[bytes], cache_salt: str | None) -> bool: ...

    def poll(self, timeout_s: float) -> list: ...

    def refusal(self, num_tokens: int) -> str: ...

    def count_fallback(self, reason: str) -> None: ...

    def expected_cached_tokens(self, keys: list[bytes], num_tokens: int) -> int: ...


class RemoteOffload:
    """remote_prefill: "always" when a worker is healthy; "required": always (the engine
    fails a prompt no worker takes: RemotePrefillMode); "auto": when the cost model's gain
    (decode time no longer stalled, minus the transfer of the KV the caller lacks, minus
    the worker's recompute of the context its cache probably lacks; docs/cost-model.md) is
    positive, with the transfer bandwidth measured on past transfers and the worker-side
    hit predicted by the connector's router. A session's follow-up turn is decided like a
    fresh prompt: only its new tokens would move. A request that should go remote but that
    no worker can take is counted once in the connector's fallbacks (so a dead worker shows
    in stats().remote even while nothing is sent to it)."""

    def __init__(self, connector: RemotePrefills, mode: RemotePrefillMode, latency: LatencyTracker,
                 kv_bytes_per_token: int, prefill_tps: costmodel.RateEstimator,
                 stall_ratio: costmodel.StallRatio):
        self.connector, self.mode, self.latency = connector, mode, latency
        self.kv_bytes_per_token = kv_bytes_per_token
        self.prefill_tps, self.stall_ratio = prefill_tps, stall_ratio
        # admission may ask again for a sequence it could not place: count each once
        self._counted: collections.deque[int] = collections.deque(maxlen=4096)

    def gain_ms(self, seq: Sequence, num_cached: int) -> float:
        """The cost model's gain of offloading `seq`, whose first `num_cached` tokens the
        caller holds (its block hashes cover the tokens the worker would compute)."""
        num_tokens = seq.num_tokens - 1  # the worker computes all but the last
        tpot_ms = (self.latency.tpot_p50_s() or 0.025) * 1000
        worker_hit = self.connector.expected_cached_tokens(seq.block_hashes, num_tokens)
        return costmodel.remote_prefill_gain_ms(
            num_tokens - num_cached, num_cached, worker_hit, seq.params.max_tokens,
            self.kv_bytes_per_token, self.connector.bandwidth_bytes_per_s or 5e9, tpot_ms,
            self.stall_ratio.value, self.prefill_tps.value)

    def should_offload(self, seq: Sequence, num_cached: int = 0) -> bool:
        if self.mode is RemotePrefillMode.REQUIRED:
            return True  # no local fallback: a prompt no worker can take fails at submit
        if self.mode is not RemotePrefillMode.ALWAYS and self.gain_ms(seq, num_cached) <= 0:
            return False
        conn = self.connector
        reason = conn.refusal(seq.num_tokens - 1)
        if reason and seq.seq_id not in self._counted:
            self._counted.append(seq.seq_id)
            conn.count_fallback(reason)
        return not reason


class RemotePrefillDriver:
    """Drives one connector for the engine. Methods return the requests to fail (with
    their error): failing a request is the engine's (it owns the futures)."""

    def __init__(self, scheduler: Scheduler, connector: RemotePrefills,
                 remote_required: bool):
        self.scheduler, self.connector = scheduler, connector
        # remote_prefill="required": a prompt the workers did not prefill fails with
        # RemotePrefillError rather than being prefilled here
        self.remote_required = remote_required

    def poll(self, timeout_s: float = 0.0) -> list[tuple[Sequence, Exception]]:
        """Submit newly offloaded prefills; apply what the workers finished or failed."""
        sched, conn = self.scheduler, self.connector
        failed = []
        for seq in sched.new_remote:
            # only the KV after what it holds (prefix hits, a session's earlier turns)
            first = seq.num_computed_tokens
            blocks = seq.blocks[first // sched.pool.block_size:]
            if not conn.submit(seq.seq_id, seq.token_ids[: seq.num_tokens - 1], first,
                               [b.block_id for b in blocks], seq.block_hashes,
                               seq.params.cache_salt):
                reason = conn.refusal(seq.num_tokens - 1) or "the worker's queue refused it"
                conn.count_fallback(reason)
                failed += self._failed(seq, True, reason)
        sched.new_remote = []
        for c in conn.poll(timeout_s):
            seq = sched.remote.get(c.seq_id)
            if c.kind == "fenced":
                sched.release_quarantine(c.seq_id)
            elif seq is not None and c.kind == "done":
                sched.remote_done(seq)
            elif seq is not None:
                failed += self._failed(seq, c.fenced, c.reason)
        return failed

    def idle_poll(self) -> tuple[float | None, list[tuple[Sequence, Exception]]]:
        """While no step runs: fences and heartbeats. (seconds to the next poll, or None;
        requests to fail)."""
        conn = self.connector
        if conn.pending or conn.quarantine or self.scheduler.quarantine:
            # only blocks held for a worker gone quiet (perhaps for good): a slower pace
            return (0.02 if conn.pending else 0.1), self.poll()
        return None, []

    def at_rest(self) -> bool:
        """At close, after a last poll: whether quarantined blocks are held legitimately
        (each for a request the connector still awaits proof on, that no write can land);
        AssertionError for one no request accounts for (never released)."""
        if not self.scheduler.quarantine:
            return False
        waiting = {r.seq_id for r in self.connector.quarantine.values()}
        orphans = sorted(set(self.scheduler.quarantine) - waiting)
        if orphans:
            raise AssertionError(f"quarantined blocks of requests {orphans[:8]} no worker "
                                 f"accounts for: never released")
        return True

    def _failed(self, seq: Sequence, fenced: bool, reason: str
                ) -> list[tuple[Sequence, Exception]]:
        """A remote prefill did not happen: prefilled here, or with `remote_required` the
        request fails (its blocks released, or quarantined until fenced, either way)."""
        self.scheduler.remote_failed(seq, fenced, locally=not self.remote_required)
        if not self.remote_required:
            return []
        return [(seq, RemotePrefillError(
            f"remote prefill of request {seq.seq_id} failed ({reason or 'unknown'}), and "
            f"remote_prefill='required' does not prefill it locally"))]
