"""The engine's side of remote prefill: connecting the workers (`connect_workers`), the
per-request decision to offload (`RemoteOffload`, the scheduler's OffloadDecider) and
the connector's counters as `stats().remote` (`remote_stats`). The connector (the
`RemotePrefills` protocol of engine/loop.py, kvsession/connector/) moves the KV; the
engine polls it and quarantines what a worker may still write."""

from __future__ import annotations

import collections
import time
from collections.abc import Callable

from kvsession import costmodel
from kvsession.config import EngineConfig, RemotePrefillMode
from kvsession.engine.sequence import Sequence
from kvsession.errors import ConfigError
from kvsession.metrics import LatencyTracker, RemoteStats, WorkerStats


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

    def __init__(self, connector, mode: RemotePrefillMode, latency: LatencyTracker,
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


def remote_client_class():
    """The NIXL client class (ConfigError naming the extra without it)."""
    try:
        from kvsession.connector.nixl import NixlPrefillClient
    except ImportError as e:
        raise ConfigError(f"prefill_worker needs the remote extra (nixl, pyzmq): "
                          f"pip install 'kvsession[remote]' ({e})") from None
    return NixlPrefillClient


def connect_workers(cfg: EngineConfig, client_class, tensors, compat: str,
                    schedule: Callable[[Callable[[], None]], None]):
    """Connect the prefill workers (with the caller's CURVE keys when configured);
    handshakes finish here, before the engine thread starts. Later the client asks the
    engine thread for a poll whenever it idles (heartbeats, reconnects): `schedule` runs
    a function there."""
    from kvsession.connector.base import load_keys

    auth = None if cfg.prefill_auth_key_file is None else load_keys(
        cfg.prefill_auth_key_file, "caller")
    conn = client_class(list(cfg.prefill_workers), tensors, compat,
                        cfg.remote_prefill_timeout_s, auth=auth, schedule=schedule)
    deadline = time.monotonic() + min(cfg.remote_prefill_timeout_s, 5.0)
    while time.monotonic() < deadline and any(
            w.state == "connecting" for w in conn.workers):
        conn.poll(0.05)
    return conn


def remote_stats(conn) -> RemoteStats:
    """`stats().remote`: the connector's counters and each worker's state."""
    if conn is None:
        return RemoteStats()
    workers = {w.address: WorkerStats(
        state=w.state, reason=w.reason, attempts=w.attempts, connects=w.connects,
        reconnects=w.reconnects, deaths=dict(w.deaths), heartbeats=w.heartbeats,
        rejected=w.rejected, requests=w.num_requests, prefills=w.prefills, bytes=w.bytes,
        routed=w.routed, spilled=w.spilled, cached_tokens=w.cached_tokens)
        for w in conn.workers}
    return RemoteStats(prefills=conn.num_prefills, fallbacks=dict(conn.fallbacks),
                       bytes=conn.bytes, bandwidth_gbps=conn.bandwidth_bytes_per_s * 8 / 1e9,
                       workers=workers, foreign_notifications=conn.foreign_notifications)
