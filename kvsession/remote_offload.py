"""Wiring remote prefill: the connector's class (the `remote` extra), connecting the
workers before the engine thread starts (`connect_workers`), and the connector's counters
as `stats().remote` (`remote_stats`). The engine's side of it (the offload decision,
polling, quarantine accounting) is kvsession/engine/remote.py, behind its
`RemotePrefills` protocol; the connector (kvsession/connector/) moves the KV."""

from __future__ import annotations

import time
from collections.abc import Callable

from kvsession.config import EngineConfig
from kvsession.errors import ConfigError
from kvsession.metrics import RemoteStats, WorkerStats


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
