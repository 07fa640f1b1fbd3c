"""The whole engine's integrity, checked: every device and host block reference accounted
to a holder, both pools' indexes and free queues consistent (`KVCacheManager.check_integrity`), the
disk cache's index consistent and unreferenced between calls (`DiskCache.check_integrity`), and,
at close with no request in flight, the pool back to its baseline (only sessions, pins
and blocks a remote worker may still write hold blocks). The test suite turns checking on
(KVSESSION_CHECK_INTEGRITY): after every step of small pools, at close, and close raises
the first failure seen."""

from __future__ import annotations

import os

from kvsession.cache.manager import HolderKind, KVCacheManager
from kvsession.engine.loop import Engine
from kvsession.engine.scheduler import Scheduler
from kvsession.tiers.disk_cache import DiskCache
from kvsession.tiers.policy import TierPolicy

# set (to anything) by the test suite: check holder-level integrity after every step of
# small pools and when the LLM closes, and raise from close() if it ever failed
CHECK_INTEGRITY_ENV = "KVSESSION_CHECK_INTEGRITY"
# the host tier's pool grows with what the device evicts (4 GiB of a tiny test model is
# ~500k blocks, iterating its free queue costs O(n log n)): after a step it is checked while
# it has at most this many blocks (the disk cache's pool too); always at close
STEP_CHECK_MAX_HOST_BLOCKS = 1024


class IntegrityCheck:
    """Engine thread only (or after it stopped). `failure`: the first failure seen."""

    def __init__(self, manager: KVCacheManager, scheduler: Scheduler, engine: Engine,
                 disk_cache: DiskCache | None = None, policy: TierPolicy | None = None):
        self.manager, self.scheduler, self.engine = manager, scheduler, engine
        self.disk_cache, self.policy = disk_cache, policy
        self.checking = bool(os.environ.get(CHECK_INTEGRITY_ENV))
        self.failure: AssertionError | None = None

    def now(self) -> None:
        """Both pools' invariants, every device and host reference accounted to a
        holder; the disk cache's index."""
        self.manager.check_integrity()
        if self.disk_cache is not None:
            self.disk_cache.check_integrity()

    def after_step(self) -> None:
        """A step observer: `now` (the host tier while it is small), its failure recorded
        (and raised: the step fails)."""
        try:
            self.manager.check_integrity(host_max_blocks=STEP_CHECK_MAX_HOST_BLOCKS)
            if self.disk_cache is not None:
                self.disk_cache.check_integrity(max_blocks=STEP_CHECK_MAX_HOST_BLOCKS)
        except AssertionError as e:
            self.failure = self.failure or e
            raise

    def at_rest(self) -> None:
        """At close: `now`, and when no request is in flight the pool is back to its
        baseline: only sessions and pins hold blocks (and quarantined blocks a worker may
        still write). A failure is recorded and raised."""
        try:
            self.now()
            if self.scheduler.has_work() or (
                    self.policy is not None and self.policy.moves_in_flight()):
                return
            held_for_proof = self.engine.quarantine_at_rest()
            for kind in (HolderKind.SEQUENCE, HolderKind.TRANSIENT,
                         *(() if held_for_proof else (HolderKind.QUARANTINE,))):
                if self.manager.num_held(kind):
                    raise AssertionError(
                        f"{self.manager.num_held(kind)} block references still held by "
                        f"{kind.value} holders with no request in flight: "
                        f"{self.manager.holders()}")
        except AssertionError as e:
            self.failure = self.failure or e
            raise
