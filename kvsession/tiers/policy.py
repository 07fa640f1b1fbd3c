"""TierPolicy: the only place that decides keep, spill (to host or disk), load or recompute.

A session's KV is a `SessionKV` (kvsession.cache.manager: where it lives, its block tables).
The policy decides; the `TierMover` copies and records the new placement through the
KVCacheManager. Everything here runs on the engine thread. A session is `busy` while a turn
owns its blocks, and `moving` while its blocks go down or come back on the copier: such
sessions are never moved (`_idle`).

Decisions use kvsession.costmodel with inputs measured at run time (EWMA of every copy's
bandwidth, of prefill throughput, the scheduler's queue depth), never constants: on restore,
a tier is loaded from only if `costmodel.should_load` says loading beats recomputing.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Generator
from concurrent.futures import Future, wait
from typing import Protocol

from kvsession import costmodel
from kvsession.cache.block_pool import Block, Evicted, blocks_for
from kvsession.cache.manager import Holder, SessionKV, Tier
from kvsession.cache.prefix import PrefixCache
from kvsession.errors import CacheFullError, SnapshotError
from kvsession.tiers.mover import (
    LowerLoad,
    PendingClean,
    PendingLoad,
    PendingSpill,
    TierMover,
)
from kvsession.tiers.snapshot_format import SnapshotHeader

log = logging.getLogger("kvsession")

# suspend() drops a session's KV (its next turn recomputes) only when recomputing is clearly
# cheaper than reloading it from disk: below this fraction of the reload estimate. A drop
# cannot be undone, while a spilled copy leaves the choice to restore(), which decides again
# with the estimates of that moment. Near a tie the two estimates are within their noise
# (one small load moved the disk rate from 1 to 0.02 GB/s), and the choice flipped between
# identical runs of the demo.
DROP_BELOW_FRACTION = 0.5
# a session's learned gap between turns is a moving average of the gaps it showed, the
# newest weighted this much: tool latencies are heavy-tailed, so one long wait moves the
# forecast without setting it
GAP_WEIGHT = 0.3
# a "keep" lasts this many expected idle times: a session that said it would be back soon
# and is not by then is decided again (housekeeping spills it), instead of holding device
# blocks for a return that the wait's tail has pushed out
KEEP_TTL_FACTOR = 2.0
# and never less than this: a wait announced as ~0 is a session about to send again, and
# spilling it the moment the keep is decided (the engine's timer fires at once) would cost a
# reload for nothing (tests/test_tiers.py's suspend(expected_idle_s=0.0) saw it spilled)
KEEP_TTL_MIN_S = 5.0
# the disk cache admits evicted content used at least this often (computed once and found by
# hash once more; `EvictionState.hits`): a block of a one-off request is not worth a disk
# write. Dynamo's KVBM writes to SSD only blocks used twice; without such a filter a single
# agent session wrote 40+ GB to an SSD (mlx-engine#341). Sessions' own files are not cache
# and are written regardless.
DISK_ADMIT_HITS = 2
# the longest a caller on the engine thread waits for a tier copy (a fork of a session being
# prefetched, a release): a disk read that takes longer is a stuck file system, reported as
# a SnapshotError instead of a hang
COPY_WAIT_S = 120.0
# copies ahead of eviction look at most this share of the device pool's and of the host's
# blocks ahead (`_clean_ahead`): such a copy duplicates content the device still holds, so
# the host holds less else. Measured (tests/test_shared_tiers.py's document-then-flood
# trace, 32 device blocks, 64 host blocks): copying every free device block ahead pushed
# the document off the host, where evictions alone had kept it
CLEAN_AHEAD_SHARE = 4
# while spills started by housekeeping are in flight, the engine loop calls housekeeping
# again this often to settle them (the loop's wait when it has nothing else to do; a step
# calls it anyway)
MOVE_POLL_S = 0.002


class LoadProbe(Protocol):
    """How loaded the engine is (the scheduler)."""

    def queue_depth(self) -> int: ...


class HostEvictions:
    """The host pool's `EvictionSink`: what the host tier overwrites goes down to the disk
    cache and the object store when the policy admits it."""

    def __init__(self, policy: TierPolicy):
        self.policy = policy

    def evicting(self, victims: list[Evicted]) -> dict[int, str]:
        return self.policy.evicting_host(victims)


class TierPolicy:
    def __init__(self, mover: TierMover, prefix: PrefixCache, load: LoadProbe,
                 prefill_tps: costmodel.RateEstimator, bytes_per_token: int,
                 spill_after_s: float | None = None, step_blocks: int = 0,
                 device_ahead: bool = False):
        """step_blocks: the most device blocks one step may allocate; that many of a
        pool's next allocations (at most a CLEAN_AHEAD_SHARE of either pool) are looked at
        to copy what they would evict a tier down ahead of time (`_clean_ahead`; 0: never,
        evictions copy as they happen). device_ahead: the device pool's victims too, not
        only the host's (where the copier has its own engine: `Copier.own_engine`)."""
        self.mover, self.prefix, self.load = mover, prefix, load
        self.clean_ahead_blocks = min(step_blocks, mover.pool.num_blocks // CLEAN_AHEAD_SHARE,
                                      mover.host.num_blocks // CLEAN_AHEAD_SHARE) \
            if mover.host is not None else 0
        self.cleaning: PendingClean | None = None  # the one copy ahead in flight
        self._clean_seen: tuple = ()  # the pools' state at the last look for copies ahead
        self.device_ahead = device_ahead
        self.pool, self.host, self.disk = mover.pool, mover.host, mover.disk
        self.disk_cache, self.objects = mover.disk_cache, mover.objects
        self.prefill_tps, self.bytes_per_token = prefill_tps, bytes_per_token
        self.spill_after_s = spill_after_s
        self.clock = time.monotonic  # last use, gaps and keep TTLs (replaceable in tests)
        self.bs = self.pool.block_size
        self.sessions: list[SessionKV] = []
        self.spills = {"host": 0, "disk": 0}
        self.restores = {"host": 0, "disk": 0}
        self.recomputes = 0
        self.spill_failures = 0
        self.decisions: list[tuple[str, str, str]] = []  # (session, decision, reason)
        # spills housekeeping started, each a steps generator and the Future it waits on:
        # resumed by housekeeping once it is done (`_advance_background`)
        self.background: list[tuple[Generator[Future, None, object], Future]] = []

    # ---- registry ----------------------------------------------------------------------

    def register(self, s: SessionKV) -> None:
        s.last_used = self.clock()
        self.sessions.append(s)

    def release(self, s: SessionKV, delete_file: bool = False) -> None:
        """Free everything the session holds (device refs, host blocks; the file if asked),
        after any copy in flight for it."""
        try:
            self.settle_pending(s)
        except SnapshotError as e:  # released anyway: what it held is freed below
            log.warning("session %s: %s", s.session_id, e)
        self.mover.release(s, delete_file)
        if s in self.sessions:
            self.sessions.remove(s)

    def _note(self, s: SessionKV, decision: str, reason: str) -> None:
        self.decisions.append((s.session_id, decision, reason))
        del self.decisions[:-256]
        log.debug("session %s: %s (%s)", s.session_id, decision, reason)

    def num_lead(self, s: SessionKV) -> int:
        """Leading pinned blocks (shared by sessions: the write-behind stores them once per
        directory)."""
        return self._num_lead(s)

    def _num_lead(self, s: SessionKV) -> int:
        """Leading blocks that are pinned: they stay on the device when the session moves."""
        n = 0
        for b in s.blocks:
            if b.block_id not in self.prefix.pins.block_pins:
                break
            n += 1
        return n

    # ---- when a session comes back ---------------------------------------------------------

    def expected_return_s(self, s: SessionKV, now: float) -> float:
        """Seconds until the session's next turn is expected: the wait it announced
        (`suspend`), else the gaps it showed, less the time it has been idle. Once overdue,
        or with nothing known, as long as it has been idle already: a heavy-tailed wait
        that has lasted t is expected to last about t more."""
        idle = max(now - s.last_used, 0.0)
        expected = s.expected_idle_s if s.expected_idle_s is not None else s.gap_s
        if expected is None or idle >= expected:
            return idle
        return expected - idle

    def _spill_order(self, sessions: list[SessionKV], tier: Tier) -> list[SessionKV]:
        """Idle sessions, the one to move first first: the least urgent (highest priority
        value) first; among equals, the furthest expected return per millisecond its KV
        would take to come back from `tier` (or be recomputed, if that is cheaper), per
        block it holds there. Keeping a session costs its blocks for the time until it
        returns; moving it costs the reload when it does."""
        now = self.clock()

        def key(s: SessionKV) -> tuple[int, float]:
            n = max(len(s.tokens), 1)
            reload = min(costmodel.load_ms(n, self.bytes_per_token, self.mover.bandwidth(tier)),
                         costmodel.recompute_ms(n, self.prefill_tps.value))
            return s.priority, \
                self.expected_return_s(s, now) * blocks_for(n, self.bs) / max(reload, 1e-6)
        return sorted(sessions, key=key, reverse=True)

    # ---- spilling ------------------------------------------------------------------------

    def reclaim(self, num_blocks: int, exclude: SessionKV | None = None) -> int:
        """Free at least `num_blocks` device blocks by spilling idle sessions, the one
        expected back last (per reload cost) first, on this thread (the caller needs the
        blocks now). Returns how many were freed (may be fewer)."""
        freed = 0
        for s in self._spill_order(self.sessions, Tier.HOST if self.host else Tier.DISK):
            if freed >= num_blocks:
                break
            if s is exclude or not _idle(s) or s.tier is not Tier.DEVICE:
                continue
            before = self.pool.num_free
            self.spill(s, reason=f"device pool short of {num_blocks} blocks")
            freed += self.pool.num_free - before
        return freed

    def spill(self, s: SessionKV, to: Tier | None = None, reason: str = "") -> Tier:
        """`spill_steps` on this thread (its copy too)."""
        return self._run(self.spill_steps(s, to, reason, in_place=True))

    def spill_steps(self, s: SessionKV, to: Tier | None = None, reason: str = "",
                    in_place: bool = False) -> Generator[Future, None, Tier]:
        """Move an idle session's private blocks off the device: to host when it has room
        (making room by moving older host sessions to disk), else to disk, else drop them
        (the next turn recomputes). The bytes move on the copier (its Future yielded; the
        session keeps its device blocks and is `moving` until settled), or on this thread
        when `in_place`. A session that is not idle stays. Returns where the KV went."""
        if not _idle(s) or not s.tokens:
            return s.tier
        lead = self._num_lead(s)
        private = s.blocks[lead:]
        if not private and not s.host_blocks:
            return s.tier
        want_host = to in (None, Tier.HOST) and self.host is not None
        if want_host and s.tier is Tier.DEVICE:
            if self.host.num_free < len(private):
                self._make_host_room(len(private))
            if self.host.num_free >= len(private):
                job = self.mover.stage_spill(s, lead, Tier.HOST)
                job.why = reason
                if (yield from self._move(job, in_place)):
                    return Tier.HOST
        if to in (None, Tier.DISK) and self.disk is not None:
            job = self.mover.stage_spill(s, lead, Tier.DISK)
            job.why = reason
            if (yield from self._move(job, in_place)):
                return Tier.DISK
        if (to is None or to is Tier.DEVICE) and _idle(s):
            self.drop(s, reason=reason or "no room in any tier")
        return s.tier

    def _move(self, job: PendingSpill,
              in_place: bool) -> Generator[Future, None, bool]:
        """A staged spill copied (on this thread when `in_place` or `job.inline`, else on the
        copier, paced) and waited for (its Future yielded); settled here unless whoever
        needed the session first settled it. Returns whether the session went down."""
        s = job.session
        yield self._start_copy(job, self.mover.timed_spill, in_place)
        if s.moving is job:
            return self._settle_spill(job)
        return s.tier is job.tier

    def _start_copy(self, job: PendingLoad | PendingSpill,
                    copy: Callable[[PendingLoad | PendingSpill, Callable | None], object],
                    in_place: bool) -> Future:
        """The job's copy run here when `in_place` or `job.inline` (unpaced: nothing else
        runs while this thread waits), else submitted to the copier (paced); the session
        is `moving` until it is settled. Returns the copy's Future."""
        if job.inline or in_place:
            job.future = Future()
            _run_into(job.future, copy, job, None)
        else:
            job.future = self.mover.copier.submit(copy, job, self.mover.copier.pace)
        job.session.moving = job
        return job.future

    def _make_host_room(self, num_blocks: int) -> None:
        """Move the oldest idle host-tier sessions to disk (or drop them) until `num_blocks`
        host blocks are free; none when all of them together would not free enough (the
        session being spilled goes to disk or is dropped anyway: evicting them would only
        cost them their place)."""
        idle = self._spill_order([o for o in self.sessions if o.tier is Tier.HOST
                                  and _idle(o)], Tier.DISK)
        if self.host.num_free + sum(len(o.host_blocks) for o in idle) < num_blocks:
            return
        for other in idle:
            if self.host.num_free >= num_blocks:
                return
            if not (self.disk is not None and self._to_disk(other, len(other.blocks),
                                                            "host tier full")):
                self.drop(other, reason="host tier full, no disk tier")

    def _to_disk(self, s: SessionKV, lead: int, reason: str) -> bool:
        job = self.mover.stage_spill(s, lead, Tier.DISK)
        job.why = reason
        return self._run(self._move(job, in_place=True))

    def drop(self, s: SessionKV, reason: str) -> None:
        """Forget the private KV (keep the pinned lead): the next turn recomputes it."""
        lead = self._num_lead(s) if s.tier is Tier.DEVICE else len(s.blocks)
        self.mover.drop(s, lead)
        s.loaded_from = None  # what was loaded ahead of the next turn is gone
        self._note(s, "drop (recompute later)", reason)

    # ---- restoring -----------------------------------------------------------------------

    def checkout(self, s: SessionKV) -> str | None:
        """`checkout_steps` on this thread (its copy too)."""
        return self._run(self.checkout_steps(s, in_place=True))

    def checkout_steps(self, s: SessionKV,
                       in_place: bool = False) -> Generator[Future, None, str | None]:
        """Before a turn: bring the session's KV to the device, or drop it when recomputing
        is cheaper (or there is no room). Marks the session busy. A generator: it yields
        the Future of the copy it waits for (the copier moves the bytes while the engine
        keeps stepping; `EngineLoop.call_steps`). Returns where the reused KV came from
        ("device", "host", "disk") or None when nothing is reused: the tier it is loaded
        from now, else the one it was loaded from ahead of this turn (a restored snapshot,
        a prefetch), else "device"."""
        s.busy = True
        now = self.clock()
        if s.turns:  # the gap since its last turn ended: what its forecast learns from
            gap = max(now - s.last_used, 0.0)
            s.gap_s = gap if s.gap_s is None else GAP_WEIGHT * gap + (1 - GAP_WEIGHT) * s.gap_s
        s.expected_idle_s = s.keep_until = None
        source = (yield from self.restore_steps(s, in_place)) or s.loaded_from
        s.loaded_from = None
        if source is None and s.tokens:
            source = "device"
        return source if s.tokens else None

    def prefetch(self, s: SessionKV) -> None:
        """`prefetch_steps` on this thread (its copy too)."""
        self._run(self.prefetch_steps(s, in_place=True))

    def prefetch_steps(self, s: SessionKV,
                       in_place: bool = False) -> Generator[Future, None, None]:
        """Load a spilled session back ahead of its next turn (which reports the tier), on
        the copier: nothing moves the session until the copy is settled (`moving`), and a
        turn that arrives meanwhile waits for it."""
        if s.tier is Tier.DEVICE and s.moving is None:
            return
        source = yield from self.restore_steps(s, in_place)
        if source is not None:
            s.loaded_from = source

    def forked(self, parent: SessionKV, child: SessionKV) -> None:
        """`child` now shares `parent`'s blocks: its first turn reports where they came
        from, as the parent's does."""
        child.loaded_from = parent.loaded_from

    def checkin(self, s: SessionKV) -> None:
        """After a turn (the KV went back to the session through the manager)."""
        s.busy = False
        s.turns += 1
        s.last_used = self.clock()

    def restore(self, s: SessionKV) -> str | None:
        """`restore_steps` on this thread (its copy too)."""
        return self._run(self.restore_steps(s, in_place=True))

    def restore_steps(self, s: SessionKV,
                      in_place: bool = False) -> Generator[Future, None, str | None]:
        """Load a spilled session back (or drop it if recompute is cheaper), the bytes moved
        by the copier (yielding its Future), or on this thread when `in_place` (a caller
        that waits for it: the engine thread runs nothing meanwhile, so the copy is not
        paced). A load already in flight (a prefetch) is waited for and settled first.
        Returns the tier it was loaded from, or None if it was not spilled or was
        dropped."""
        while True:
            yield from self._await_moving(s)
            if s.tier is Tier.DEVICE:
                return None
            job = yield from self._start_load(s, in_place)
            if job is None:
                return None
            if s.moving is job:
                return self._settle(job)
            # settled meanwhile by a release or a fork (nothing moved it since: it is
            # moving or busy): decided again

    def _await_moving(self, s: SessionKV) -> Generator[Future, None, None]:
        """A copy already in flight for the session (a prefetch, a spill) waited for and
        settled."""
        while s.moving is not None:
            job = s.moving
            yield job.future
            if s.moving is not job:
                continue
            if isinstance(job, PendingSpill):
                self._settle_spill(job)
                continue
            loaded = self._settle(job)
            if loaded is not None:
                s.loaded_from = loaded

    def _start_load(self, s: SessionKV,
                    in_place: bool) -> Generator[Future, None, PendingLoad | None]:
        """The load-or-recompute decision for a spilled session; when it loads, the copy is
        started (on this thread when `in_place`) and waited for (its Future yielded).
        Returns the job (not yet settled), or None when the session was dropped instead."""
        tier = s.tier
        lead = len(s.blocks)
        num_tokens = len(s.tokens) - lead * self.bs
        bandwidth, depth = self.mover.bandwidth(tier), self.load.queue_depth()
        load = costmodel.load_ms(num_tokens, self.bytes_per_token, bandwidth)
        recompute = costmodel.recompute_ms(num_tokens, self.prefill_tps.value, depth)
        why = (f"{num_tokens} tokens: load {load:.2f} ms at {bandwidth / 1e9:.2f} GB/s vs "
               f"recompute {recompute:.2f} ms at {self.prefill_tps.value:.0f} tok/s, "
               f"queue depth {depth}")
        if not costmodel.should_load(num_tokens, self.bytes_per_token, bandwidth,
                                     self.prefill_tps.value, depth):
            self.recomputes += 1
            self.drop(s, reason="recompute is cheaper: " + why)
            return None
        need = blocks_for(len(s.tokens), self.bs) - lead
        if self.pool.num_free < need:
            self.reclaim(need - self.pool.num_free, exclude=s)
        if self.pool.num_free < need:
            self.recomputes += 1
            self.drop(s, reason="no device room to load into")
            return None
        job = self.mover.stage_load(s, lead)
        job.why = why
        yield self._start_copy(job, self.mover.timed_copy, in_place)
        return job

    def _settle(self, job: PendingLoad) -> str | None:
        """Engine thread: a copy that is done becomes the session's placement (`mover`),
        counted; a file that no longer holds the session's KV makes it recompute. Returns
        the tier loaded from, or None."""
        s = job.session
        s.moving = None
        error = job.future.exception()
        if error is None:
            moved, seconds = job.future.result()
            self.mover.settle_load(job, moved, seconds)
            self.restores[job.tier.value] += 1
            self._note(s, f"load from {job.tier.value}", job.why)
            return job.tier.value
        self.mover.settle_load(job, error=error)
        if not isinstance(error, SnapshotError):
            raise error
        log.warning("%s; recomputing session %s", error, s.session_id)
        self.recomputes += 1
        self.drop(s, reason=f"unreadable snapshot: {error}")
        return None

    def _settle_spill(self, job: PendingSpill) -> bool:
        """Engine thread: a spill whose copy is done becomes the session's placement
        (`mover`), counted; a failed disk write leaves it where it is. Returns whether it
        went down."""
        s = job.session
        s.moving = None
        error = job.future.exception()
        if error is None:
            went = self.mover.settle_spill(job, *job.future.result())
        else:
            went = self.mover.settle_spill(job, error=error)
        if went:
            self.spills[job.tier.value] += 1
            self._note(s, f"spill to {job.tier.value}", job.why)
        else:
            self.spill_failures += 1
        return went

    def _run(self, steps: Generator[Future, None, object]) -> object:
        """Drive a steps generator on this thread: each Future it yields is waited for
        (a copy on the copier; bounded by COPY_WAIT_S)."""
        try:
            fut = next(steps)
            while True:
                done, _ = wait([fut], timeout=COPY_WAIT_S)
                if not done:
                    raise SnapshotError(f"a tier copy did not finish within {COPY_WAIT_S:.0f} s")
                fut = next(steps)
        except StopIteration as stop:
            return stop.value

    def moves_in_flight(self) -> int:
        """Sessions whose blocks are on their way between tiers (a load's fresh device
        blocks are held by its Transient, a spill's host blocks by its HostTransient, until
        it is settled)."""
        return sum(1 for s in self.sessions if s.moving is not None)

    def settle_pending(self, s: SessionKV) -> None:
        """Engine thread: a copy in flight for the session (a prefetch, a spill) is waited
        for (bounded by COPY_WAIT_S) and settled now: before the session is released."""
        self._run(self._await_moving(s))

    def settle_moves(self) -> None:
        """Engine thread: every spill housekeeping started is waited for (each bounded by
        COPY_WAIT_S) and settled (at close; tests that drive housekeeping by hand)."""
        while self.background:
            done, _ = wait([f for _, f in self.background], timeout=COPY_WAIT_S)
            if not done:
                raise SnapshotError(f"a tier copy did not finish within {COPY_WAIT_S:.0f} s")
            self._advance_background()

    def _advance_background(self) -> None:
        """Resume the background steps whose Future is done (to their next wait or end)."""
        waiting = []
        for steps, fut in self.background:
            if fut.done():
                try:
                    fut = steps.send(None)
                except StopIteration:
                    continue
            waiting.append((steps, fut))
        self.background = waiting

    def _start_background(self, steps: Generator[Future, None, object]) -> None:
        try:
            self.background.append((steps, next(steps)))
        except StopIteration:
            pass

    def restore_snapshot(self, s: SessionKV, header: SnapshotHeader) -> None:
        """A session just restored from a snapshot (its KV only in the file): load it now
        when the device has room, after spilling idle sessions; otherwise only validate the
        file, which stays the session's disk tier (its next turn loads or recomputes). A
        damaged file raises SnapshotError and the session holds nothing."""
        need = header.num_blocks
        if self.pool.num_free < need:
            self.reclaim(need - self.pool.num_free, exclude=s)
        try:
            if self.pool.num_free < need:
                self.mover.validate_file(s.disk_path, header)
                self._note(s, "restored, left on disk", "no device room")
                return
            self.mover.load(s, 0, header)
        except BaseException:
            self.mover.release(s, delete_file=False)
            raise
        self.restores["disk"] += 1
        s.loaded_from = "disk"
        self._note(s, "load from disk", "restored from a snapshot")

    # ---- any request: the host tier and the disk cache by content -----------------------

    def evicting(self, victims: list[Evicted]) -> dict[int, str]:
        """The device pool is about to overwrite cached content (`EvictionSink`): keep it on
        the host, where any later request finds it by hash. Everything evicted is kept
        while the host has unreferenced blocks (its own coldest cached content goes first):
        a DRAM copy costs a memory copy, a miss costs a prefill. What the host has no room
        for (or all of it, without a host tier) goes to the disk cache if it admits it.
        Returns the victims kept, each with where."""
        kept: dict[int, str] = {}
        if self.objects is not None and self.host is not None:
            # the object store is shared with other processes: content reused here goes
            # there as soon as the device lets it go, not only once the host does
            self._offer_objects(victims, Tier.DEVICE)
        if self.host is not None and victims:
            try:
                kept = dict.fromkeys(self.mover.keep_evicted(victims), Tier.HOST.value)
            except (CacheFullError, RuntimeError) as e:  # not kept: a later miss recomputes
                log.warning("could not keep %d evicted blocks on the host: %s",
                            len(victims), e)
        rest = [v for v in victims if v.block_id not in kept]
        return kept | self._keep_on_disk(rest, Tier.DEVICE)

    def evicting_host(self, victims: list[Evicted]) -> dict[int, str]:
        """The host tier is about to overwrite cached content (`HostEvictions`): what was
        used at least DISK_ADMIT_HITS times goes to the disk cache and the object store."""
        return self._keep_on_disk(victims, Tier.HOST)

    def _keep_on_disk(self, victims: list[Evicted], tier: Tier) -> dict[int, str]:
        """The victims (of `tier`'s pool) the tiers below admit: written to the disk cache,
        with their cached ancestors it lacks (`_with_ancestors`), and queued for the object
        store (stored there by its uploader, so not counted as kept). Returns the victims
        the disk cache holds."""
        admitted = [v for v in victims if v.hits >= DISK_ADMIT_HITS]
        self._offer_objects(admitted, tier)
        if self.disk_cache is None or not admitted:
            return {}
        kept: set[int] = set()
        try:
            for where, records in self._with_ancestors(admitted, tier,
                                                       self.disk_cache.has).items():
                written = self.mover.keep_on_disk(records, where)
                if where is tier:
                    kept = written & {v.block_id for v in admitted}
        except (CacheFullError, RuntimeError) as e:
            log.warning("could not keep %d evicted blocks on disk: %s", len(admitted), e)
        return dict.fromkeys(kept, Tier.DISK.value)

    def _offer_objects(self, victims: list[Evicted], tier: Tier) -> None:
        """Queue the victims (of `tier`'s pool) that the object store admits (used at
        least DISK_ADMIT_HITS times) for it, with their cached ancestors it lacks."""
        admitted = [v for v in victims if v.hits >= DISK_ADMIT_HITS]
        if self.objects is None or not admitted:
            return
        for where, records in self._with_ancestors(admitted, tier, self.objects.has).items():
            self.mover.offer_objects(records, where)

    def _with_ancestors(self, records: list[Evicted], tier: Tier,
                        holds: Callable[[bytes], bool]) -> dict[Tier, list[Evicted]]:
        """`records` (of `tier`'s pool) and the cached chains above them (on the device,
        else on the host) up to the first block the tier below `holds`, by the pool each
        is in, ancestors first. A tier below the host is searched from a prompt's first
        block it misses on, and the hot head of a prefix (a chat template's header, a
        shared document's first blocks) may never be evicted here: without its head, the
        rest is found by nobody (another process, or this one after a restart)."""
        pools = [(Tier.DEVICE, self.pool)] + \
            ([(Tier.HOST, self.host.index)] if self.host is not None else [])
        chains: dict[Tier, dict[bytes, Evicted]] = {}
        seen = {v.block_hash for v in records}  # a chain walked once is not walked again
        for v in records:
            h, chain = v.parent_hash, []
            while h is not None and h not in seen and not holds(h) and \
                    len(chain) < self.pool.num_blocks:
                found = next(((t, r) for t, pool in pools
                              if (r := pool.cached_record(h)) is not None), None)
                if found is None:
                    break
                chain.append(found)
                seen.add(h)
                h = found[1].parent_hash
            for where, r in reversed(chain):  # root first: parents before children
                chains.setdefault(where, {})[r.block_hash] = r
        for v in records:
            chains.setdefault(tier, {}).setdefault(v.block_hash, v)
        # the device's first: a chain's hot head is there, and parents go first
        return {where: list(chains[where].values()) for where in (Tier.DEVICE, Tier.HOST)
                if where in chains}

    def _clean_ahead(self) -> None:
        """A buffer pool's background writer, for the device pool and the host's: the
        cached content that a pool's next `clean_ahead_blocks` allocations would evict,
        and that the tier below would keep (`evicting`: the host keeps everything; the
        disk cache what it admits), is copied there now, on the copier (`clean_steps`), so
        the eviction finds it there instead of copying on the engine thread while a step
        waits. The same copies, earlier; a block revived before its eviction costs one
        copy that was not needed. One job in flight (its whole lookahead, copied
        SPILL_GROUP_BLOCKS at a time, paced like a spill), the host's first (its
        victims are the room a device copy needs), into room whose taking writes nothing
        below on this thread (`_host_room`). Looked at again only once the pools changed.
        Device to host only with `device_ahead`: on a CPU the copier's copy takes the
        cores and the memory bus the step uses, and the copies that turn out unneeded
        (blocks revived before their eviction; duplicates that crowd the host) cost more
        than the stall they save. Measured (bench/shared_tiers.py --workload ahead, 2
        vCPUs, 3 rounds): with them on a CPU, 55% of the device -> host copies left the
        engine thread, but the host wrote 1.49x the bytes, held fewer distinct blocks (host
        hits 23.1k tokens against 31.6k) and TTFT p50 was 1.18x (2.47 s against 2.10 s)."""
        if self.host is None or self.cleaning is not None or not self.clean_ahead_blocks:
            return
        pools = [self.pool, self.host.index] + \
            ([self.disk_cache.index] if self.disk_cache is not None else [])
        seen = tuple((p.num_evictions, p.num_free, len(p.index)) for p in pools)
        if seen == self._clean_seen:
            return  # nothing was allocated, freed or published since the last look
        self._clean_seen = seen
        if self.disk_cache is not None:
            victims = [v for v in self.host.index.next_victims(self.clean_ahead_blocks)
                       if self._disk_would_keep(v)]
            victims = victims[:self.disk_cache.index.num_free]
            if victims:
                self._start_background(self.clean_steps(Tier.HOST, victims))
                return
        if not self.device_ahead:
            return
        index = self.host.index
        victims = [v for v in self.pool.next_victims(self.clean_ahead_blocks)
                   if index.lookup(v.block_hash, v.token_ids) is None]
        victims = victims[:self._host_room()]
        if victims:
            self._start_background(self.clean_steps(Tier.DEVICE, victims))

    def _disk_would_keep(self, v: Evicted) -> bool:
        """Whether evicting `v` from the host would write it to the disk cache: admitted
        (used at least DISK_ADMIT_HITS times) and not there yet."""
        return v.hits >= DISK_ADMIT_HITS and \
            self.disk_cache.index.lookup(v.block_hash, v.token_ids) is None

    def _host_room(self) -> int:
        """Host blocks a copy ahead can take without the host's eviction writing to disk on
        this thread: all its unreferenced ones without a disk cache; else the empty ones,
        then the leading victims the disk cache would not keep or already holds."""
        index = self.host.index
        if self.disk_cache is None:
            return index.num_free
        room = index.num_empty_free
        for v in index.next_victims(self.clean_ahead_blocks):
            if self._disk_would_keep(v):
                break
            room += 1
        return room

    def clean_steps(self, tier: Tier, victims: list[Evicted]) -> Generator[Future, None, int]:
        """Copy victims of `tier`'s pool a tier down ahead of their eviction: staged and
        settled here, copied on the copier (its Future yielded). Returns how many were
        published below (those whose source block still held the content at settling)."""
        try:
            job = self.cleaning = self.mover.stage_clean(tier, victims)
        except CacheFullError:  # the room was checked: nothing to copy into
            return 0
        try:
            job.future = self.mover.copier.submit(self.mover.copy_clean, job,
                                                  self.mover.copier.pace)
            yield job.future
            try:
                done, seconds = job.future.result()
            except Exception as e:  # noqa: BLE001 - a copy ahead is an optimisation
                return self.mover.settle_clean(job, error=e)
            return self.mover.settle_clean(job, done, seconds)
        finally:
            self.cleaning = None

    def lower_hits(self, token_ids: list[int], hashes: list[bytes], start: int,
                   num_blocks: int) -> list[tuple[Tier, Block]]:
        """`LowerTiers`: the blocks holding a prompt's blocks start.. up to the first miss,
        walking down: the host tier, then the disk cache after the host's run, then the
        object store (its hashes: what it holds is read, and verified, by the load). Each
        tier's run is taken when loading it beats recomputing it (`costmodel.should_load`
        at that tier's measured rate and latency; the device pool takes them by the
        scheduler's own admission check)."""
        found: list[tuple[Tier, Block | bytes]] = []
        for tier in (Tier.HOST, Tier.DISK, Tier.OBJECT):
            at = start + len(found)
            if at >= num_blocks:
                break
            if tier is Tier.OBJECT:
                run = self.objects.lookup_run(hashes, at, num_blocks) \
                    if self.objects is not None else []
            else:
                index = self.host.index if tier is Tier.HOST and self.host is not None else \
                    self.disk_cache.index if tier is Tier.DISK and self.disk_cache else None
                run = index.lookup_run(token_ids, hashes, at, num_blocks) \
                    if index is not None else []
            if not run:
                continue  # the next tier down may hold it
            if not costmodel.should_load(
                    len(run) * self.bs, self.bytes_per_token, self.mover.bandwidth(tier),
                    self.prefill_tps.value, self.load.queue_depth(),
                    self.mover.latency_s(tier)):
                break
            found += [(tier, b) for b in run]
        return found

    def reused(self, hits: list[Block]) -> None:
        """`LowerTiers`: a prompt's device hits, just referenced. Content used at least
        DISK_ADMIT_HITS times goes to the object store now, not at its eviction: another
        process finds it while this one still holds it (a chain is put whole, so a run
        whose last block is there or queued is skipped at once)."""
        if self.objects is None or self.objects.has(hits[-1].block_hash):
            return
        records = [r for b in hits if not self.objects.has(b.block_hash)
                   and (r := self.pool.cached_record(b.block_hash)) is not None]
        self._offer_objects(records, Tier.DEVICE)

    def load_lower(self, holder: Holder, found: list[tuple[Tier, Block]],
                   token_ids: list[int], hashes: list[bytes], start: int) -> int:
        """`LowerTiers`: copy what `lower_hits` found into the holder's next blocks; returns
        how many were loaded (fewer when a disk cache slot is damaged)."""
        return self.mover.load_lower_hits(holder, found, token_ids, hashes, start)

    def start_lower(self, holder: Holder, found: list[tuple[Tier, Block]],
                    token_ids: list[int], hashes: list[bytes], start: int) -> LowerLoad:
        """`LowerTiers`: `load_lower` with the copy on the copier: the holder's next blocks
        are in its table at once, filled when `job.future` is done (`finish_lower`)."""
        job = self.mover.stage_lower(holder, found, token_ids, hashes, start)
        if job.inline:
            job.future = Future()
            _run_into(job.future, self.mover.copy_lower, job)
        else:
            job.future = self.mover.copier.submit(self.mover.copy_lower, job)
        return job

    def finish_lower(self, job: LowerLoad) -> int:
        """`LowerTiers`, engine thread, once `job.future` is done: the copy settled; returns
        how many blocks were loaded (the holder computes the rest)."""
        return self.mover.settle_lower(job, job.future.result())

    # ---- hints -----------------------------------------------------------------------------

    def suspend(self, s: SessionKV, expected_idle_s: float | None) -> str:
        """`suspend_steps` on this thread (its copy too)."""
        return self._run(self.suspend_steps(s, expected_idle_s, in_place=True))

    def suspend_steps(self, s: SessionKV, expected_idle_s: float | None,
                      in_place: bool = False) -> Generator[Future, None, str]:
        """The session waits (tool call, human). Keep / host / disk / drop by expected waste:
        keep when the wait is short next to a reload, or memory is plentiful; else the
        cheapest tier to come back from that has room. `expected_idle_s` (None: the gap the
        session has shown between turns, if any) is kept for reclaim's order; a keep lapses
        after KEEP_TTL_FACTOR times it (`housekeeping`). A spill's bytes move on the copier
        (`spill_steps`): the engine keeps stepping meanwhile. A spill already in flight
        (housekeeping's) is waited for first; a session on its way back stays where it is."""
        if isinstance(s.moving, PendingSpill):
            yield from self._await_moving(s)
        if expected_idle_s is None:
            expected_idle_s = s.gap_s
        s.expected_idle_s = expected_idle_s
        if not _idle(s) or s.tier is not Tier.DEVICE or not s.tokens:
            # nothing to decide: where it is ("keep" on the device, as documented)
            return "keep" if s.tier is Tier.DEVICE else s.tier.value
        n = len(s.tokens)
        reload_host = costmodel.load_ms(n, self.bytes_per_token,
                                        self.mover.bandwidth(Tier.HOST))
        reload_disk = costmodel.load_ms(n, self.bytes_per_token,
                                        self.mover.bandwidth(Tier.DISK))
        recompute = costmodel.recompute_ms(n, self.prefill_tps.value, self.load.queue_depth())
        free_fraction = self.pool.num_free / self.pool.num_blocks
        idle_ms = float("inf") if expected_idle_s is None else expected_idle_s * 1000
        why = (f"expected idle {idle_ms:.0f} ms, free {free_fraction:.0%}, reload host "
               f"{reload_host:.1f} / disk {reload_disk:.1f} / recompute {recompute:.1f} ms")
        if idle_ms <= 10 * min(reload_host, recompute) or (
                free_fraction > 0.5 and idle_ms <= 60_000):
            if expected_idle_s is not None:
                s.keep_until = self.clock() + max(KEEP_TTL_FACTOR * expected_idle_s,
                                                  KEEP_TTL_MIN_S)
            self._note(s, "keep", why)
            return "keep"
        if self.host is not None and idle_ms <= 300_000:
            got = yield from self.spill_steps(s, Tier.HOST, "suspend: " + why, in_place)
            if got is Tier.HOST:
                return "host"
        if self.disk is not None and recompute >= DROP_BELOW_FRACTION * reload_disk:
            got = yield from self.spill_steps(s, Tier.DISK, "suspend: " + why, in_place)
            if got is Tier.DISK:
                return "disk"
        self.recomputes += 1  # decided now: the next turn recomputes instead of loading
        self.drop(s, reason="suspend: " + why)
        return "drop"

    def housekeeping(self, now: float) -> float | None:
        """Spill sessions idle longer than spill_after_s, and those kept past their keep's
        TTL, and copy what the next allocations will evict to the host ahead of them (on
        the copier: settled by a later call, `background`); seconds to the next deadline
        (MOVE_POLL_S while a copy is in flight)."""
        self._advance_background()
        self._clean_ahead()
        nxt = None
        for s in list(self.sessions):
            if not _idle(s) or s.tier is not Tier.DEVICE or len(s.blocks) == self._num_lead(s):
                continue
            deadlines = [(s.keep_until, "kept past its expected return")] \
                if s.keep_until is not None else []
            if self.spill_after_s is not None:
                deadlines.append((s.last_used + self.spill_after_s,
                                  f"idle > spill_after_s={self.spill_after_s}"))
            if not deadlines:
                continue
            due, reason = min(deadlines, key=lambda d: d[0])
            if now >= due:
                s.keep_until = None
                self._start_background(self.spill_steps(s, reason=reason))
            else:
                nxt = due - now if nxt is None else min(nxt, due - now)
        if self.background:
            nxt = MOVE_POLL_S if nxt is None else min(nxt, MOVE_POLL_S)
        return nxt


def _idle(s: SessionKV) -> bool:
    """Whether the policy may move the session: no turn owns its blocks and none are on
    their way between tiers."""
    return not s.busy and s.moving is None


def _run_into(fut: Future, fn: Callable, *args) -> None:
    """Run fn here, its result or exception into `fut` (a copy done inline)."""
    try:
        fut.set_result(fn(*args))
    except Exception as e:  # noqa: BLE001 - settled by whoever reads the Future
        fut.set_exception(e)
