"""TierMover: copies a session's KV between tiers; decides nothing.

The tier policy decides *whether* and *where* a session moves; the mover does the copy
(device <-> host blocks, device/host -> snapshot file, file -> device blocks), times it into
the bandwidth estimators the policy's cost model reads, and records the new placement
through the KVCacheManager (the one writer of block tables). Staging and settling run on the
engine thread; the bytes of a load or a spill move on the copier (tiers/copier.py) or, for a
caller that waits anyway, on the engine thread.

Content any request can find lives on the host (`HostPool`, by hash) and in the disk cache
(`DiskCache`, by hash, in one file under session_dir); a session's own files hold its KV
as data.
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path

import torch

from kvsession import costmodel
from kvsession.cache.block_pool import Block, Evicted, blocks_for
from kvsession.cache.hashing import BlockHasher, SaltArg
from kvsession.cache.identity import StorageIdentity
from kvsession.cache.manager import (
    Holder,
    HostTransient,
    KVCacheManager,
    SessionKV,
    Tier,
    Transient,
)
from kvsession.errors import SnapshotError
from kvsession.tiers.copier import Contention, Copier
from kvsession.tiers.disk import DiskTier
from kvsession.tiers.disk_cache import DiskCache
from kvsession.tiers.host import HostPool
from kvsession.tiers.object_store import LATENCY_PRIOR_S, ObjectCache
from kvsession.tiers.resume import DiskPlan
from kvsession.tiers.segments import compact
from kvsession.tiers.snapshot import write_snapshot
from kvsession.tiers.snapshot_format import SnapshotHeader
from kvsession.tiers.snapshot_read import read_blocks, read_header
from kvsession.tiers.writeback import SnapshotLocks

log = logging.getLogger("kvsession")
# a spill's blocks are copied (host) or gathered for the snapshot writer (disk) this many at
# a time: one pass over the bytes with bounded extra memory, the copier's pace between
# groups. Measured (bench/restore_overlap.py, a 6k-token session spilled to disk, 3 rounds):
# 8 at a time gave the same worst decode gap (2.6x the step) for a spill twice as long
SPILL_GROUP_BLOCKS = 32


@dataclass(eq=False)
class PendingLoad:
    """A spilled session's blocks on their way back to the device: staged on the engine
    thread (`TierMover.stage_load`), copied (`copy_load`, on the copier unless `inline`),
    settled on the engine thread (`settle_load`) by whoever first needs the session (the
    one that finds it in `SessionKV.moving`)."""

    session: SessionKV
    tier: Tier
    lead: int  # the session's blocks before these stay where they are (its pinned lead)
    staged: Transient  # every block of the session after its lead, fresh or re-referenced
    copy: list[tuple[int, Block]]  # (block index in the session, fresh device block)
    header: SnapshotHeader | None
    inline: bool  # copied on the engine thread (the host's staged path)
    plan: DiskPlan | None = None  # a resumed session's files (tiers/resume.py)
    future: Future | None = None  # the copy on the copier, once submitted
    why: str = ""  # the policy's reason to load (its decision log)


@dataclass(eq=False)
class LowerLoad:
    """A prompt's blocks found on the host, in the disk cache and in the object store, on
    their way into device blocks already in the holder's table: staged on the engine thread
    (`TierMover.stage_lower`), copied (`copy_lower`, on the copier unless `inline`),
    settled on the engine thread (`settle_lower`)."""

    on_host: list[Block]  # host blocks (referenced by `sources` until settled)
    on_disk: list[Block]  # disk cache slots after them (held until settled)
    on_object: list[bytes]  # the hashes of the object store's blocks after those
    sources: HostTransient
    blocks: list[Block]  # the device blocks they go to, in the holder's table
    token_ids: list[int]
    hashes: list[bytes]
    start: int  # the index of the first one in the prompt
    inline: bool
    future: Future | None = None  # the copy on the copier, once submitted


@dataclass
class LowerCopy:
    """What a `copy_lower` did: leading blocks loaded, bytes and seconds per tier."""

    loaded: int = 0
    damaged: bool = False  # the disk cache slot after the loaded ones failed its checks
    host_bytes: int = 0
    host_s: float = 0.0
    disk_bytes: int = 0
    disk_s: float = 0.0
    object_bytes: int = 0
    object_s: float = 0.0
    object_first_s: float = 0.0  # until its first object arrived: the store's latency


@dataclass(eq=False)
class PendingSpill:
    """A session's private blocks (after its pinned lead) on their way down to `tier`:
    staged on the engine thread (`TierMover.stage_spill`), copied (`copy_spill`, on the
    copier unless `inline`), settled on the engine thread (`settle_spill`) by whoever first
    needs the session (the one that finds it in `SessionKV.moving`). Until then the session
    keeps its device blocks (nothing writes them: it is idle) and is not idle to the
    policy."""

    session: SessionKV
    tier: Tier
    lead: int
    held: HostTransient = field(default_factory=HostTransient)  # HOST: the blocks to fill
    copy: list[tuple[int, int, int]] = field(default_factory=list)  # HOST: (index, dev, host)
    path: Path | None = None  # DISK: the session's snapshot
    fields: dict | None = None  # DISK: its header fields, as staged
    sources: list = field(default_factory=list)  # DISK: (tensors, block ids) per tier
    inline: bool = False  # copied on the engine thread (the host's staged path)
    future: Future | None = None  # the copy on the copier, once submitted
    why: str = ""  # the policy's reason (its decision log)


@dataclass(eq=False)
class PendingClean:
    """Free cached blocks of `tier`'s pool that its next allocations would evict, copied a
    tier down ahead of it (a buffer pool's background writer): device blocks to the host
    (`tier` DEVICE: fresh host blocks held by `held`), or host blocks to the disk cache
    (`tier` HOST: slots reserved there). Staged on the engine thread
    (`TierMover.stage_clean`), copied on the copier (`copy_clean`), settled on the engine
    thread (`settle_clean`), where each copy is published below only if its source block
    still holds that content. The eviction then finds the content there and copies
    nothing."""

    tier: Tier  # whose blocks are copied down
    victims: list[Evicted]
    held: HostTransient = field(default_factory=HostTransient)  # DEVICE: the host blocks
    slots: list[Block] = field(default_factory=list)  # HOST: the disk cache slots
    future: Future | None = None


class TierMover:
    def __init__(self, manager: KVCacheManager, host: HostPool | None, disk: DiskTier | None,
                 hasher: BlockHasher, identity: StorageIdentity,
                 prefill_tps: costmodel.RateEstimator | None = None,
                 snapshot_locks: SnapshotLocks | None = None,
                 disk_cache: DiskCache | None = None, contention: Contention | None = None,
                 objects: ObjectCache | None = None):
        """identity: this engine's storage identity (headers record it: model,
        tokenizer, template, kv dtype, block size, geometry, tensor names). prefill_tps
        (measured by the engine) prices a spilled block's reload for eviction.
        snapshot_locks: held while a session's snapshot is written (write-behind
        compaction writes them too)."""
        self.snapshot_locks = snapshot_locks or SnapshotLocks()
        self.prefill_tps = prefill_tps
        if host is not None and manager.host is not host.index:
            raise ValueError("the host tier's blocks are the manager's to hold: build the "
                             "KVCacheManager with HostPool.index")
        self.manager, self.kv_pool, self.host, self.disk = manager, manager.kv_pool, host, disk
        self.pool, self.hasher, self.identity = manager.pool, hasher, identity
        self.disk_cache, self.objects = disk_cache, objects
        # session loads, off the engine thread (paced while the engine has work: `pace`)
        self.copier = Copier(manager.kv_pool.k.device, contention)
        # session files' KV bytes: spilled snapshots written, snapshot / segment KV loaded
        self.disk_bytes_written = self.disk_bytes_read = self.disk_hit_tokens = 0
        # blocks copied a tier down as they were evicted (on the engine thread, the step
        # waiting) and ahead of their eviction (on the copier; those published), by the
        # tier they went to (HOST: from the device; DISK: the disk cache)
        self.evicted_copies: Counter[Tier] = Counter()
        self.cleaned_blocks: Counter[Tier] = Counter()
        self.header_fields = identity.header_fields()  # what every header it writes holds
        self.bs = manager.block_size
        # measured bandwidths (bytes/s); priors only until the first copy is timed
        self.host_bytes_per_s = costmodel.RateEstimator(prior=10e9)
        self.disk_read_bytes_per_s = costmodel.RateEstimator(prior=1e9)
        self.disk_write_bytes_per_s = costmodel.RateEstimator(prior=1e9)
        # the object store: bytes/s once its objects arrive, and seconds until the first
        # does (a request's round trip, which every load pays once: the store client's
        # estimate, which its listings' probes time too)
        self.object_read_bytes_per_s = costmodel.RateEstimator(prior=100e6)
        self.object_latency_s = objects.latency if objects is not None else \
            costmodel.RateEstimator(prior=LATENCY_PRIOR_S)
        # resumed sessions whose KV is on disk in several files (tiers/resume.py): the
        # session's tier is DISK and this says where each block is, until it is loaded
        self.plans: dict[SessionKV, DiskPlan] = {}

    def bandwidth(self, tier: Tier) -> float:
        """Measured bytes/s of loading from `tier`."""
        return {Tier.HOST: self.host_bytes_per_s, Tier.DISK: self.disk_read_bytes_per_s,
                Tier.OBJECT: self.object_read_bytes_per_s}[tier].value

    def latency_s(self, tier: Tier) -> float:
        """Measured seconds a load from `tier` waits before its bytes flow (the object
        store's round trip; nothing for the host and the disk)."""
        return self.object_latency_s.value if tier is Tier.OBJECT else 0.0

    def copy_cost(self, tier: Tier) -> float:
        """Reloading a block from `tier` as a fraction of recomputing it (at the measured
        rates; the device pool's eviction uses it to drop blocks with a copy first)."""
        if self.prefill_tps is None:
            return 1.0
        block_bytes = sum(t[:, :1].numel() * t.element_size()
                          for t in self.kv_pool.tensors().values())
        load = costmodel.load_ms(1, block_bytes, self.bandwidth(tier))
        return min(1.0, load / costmodel.recompute_ms(self.bs, self.prefill_tps.value))

    # ---- out of the device ---------------------------------------------------------------

    def to_host(self, s: SessionKV, lead: int) -> None:
        """Move the private blocks (after `lead`) down to the host tier, on this thread
        (the caller checked that it has room): `stage_spill`, `copy_spill`,
        `settle_spill`."""
        self._spill_now(self.stage_spill(s, lead, Tier.HOST))

    def stage_spill(self, s: SessionKV, lead: int, tier: Tier) -> PendingSpill:
        """Engine thread: what moving the session's private blocks (after `lead`) down to
        `tier` takes, the session unchanged until `settle_spill`.
        HOST (the caller checked that it has room): host blocks for them, held by the job:
        a full block whose content the host already holds (a prefix another session
        spilled, a block the device evicted earlier) is referenced, the others are fresh
        and copied. DISK: the session's snapshot fields and where each of its blocks is
        (device, host), taken now."""
        job = PendingSpill(s, tier, lead)
        if tier is Tier.HOST:
            bs, private = self.bs, s.blocks[lead:]
            targets = [self.host.index.lookup(s.hashes[i], s.tokens[i * bs:(i + 1) * bs])
                       if i < len(s.hashes) else None
                       for i in range(lead, lead + len(private))]
            fresh = self.manager.stage_host(job.held, targets)
            job.copy = [(lead + j, d.block_id, h.block_id) for j, (d, h) in
                        enumerate(zip(private, job.held.host_blocks, strict=True))
                        if h in fresh]
            job.inline = self.host.staged  # its buffers are the engine thread's
        else:
            job.path = self.disk.path_for(s.session_id)
            job.fields = self.snapshot_fields(s)
            job.sources = self._block_sources(s)
        return job

    def copy_spill(self, job: PendingSpill, pace: Callable[[], None] | None = None) -> int:
        """Any thread (the copier's, unless `job.inline`): the blocks' bytes into the host
        blocks, or the session's snapshot file written (atomically; under its snapshot
        lock). Returns bytes written. `pace`: called between groups of blocks (the
        copier's `pace`)."""
        if job.tier is Tier.HOST:
            moved = 0
            for g in range(0, len(job.copy), SPILL_GROUP_BLOCKS):
                if pace is not None:
                    pace()
                part = job.copy[g:g + SPILL_GROUP_BLOCKS]
                moved += self.host.store(self.kv_pool, [d for _, d, _ in part],
                                         [h for _, _, h in part])
            return moved
        with self.snapshot_locks.get(job.session.session_id):
            return write_snapshot(job.path, job.fields, self._gather(job.sources, pace))

    def timed_spill(self, job: PendingSpill,
                    pace: Callable[[], None] | None) -> tuple[int, float]:
        """`copy_spill`, with the seconds it took (observed when settled)."""
        t0 = time.perf_counter()
        if pace is not None:
            self.copier.start_pacing()
        moved = self.copy_spill(job, pace)
        return moved, time.perf_counter() - t0

    def settle_spill(self, job: PendingSpill, moved: int = 0, seconds: float = 0.0,
                     error: BaseException | None = None) -> bool:
        """Engine thread, once per job: on success the session lets go of its device
        blocks after the lead (their content stays cached) and is on `job.tier` (host
        copies published for any request, the copy timed into the tier's rate); True.
        A disk write that failed (disk full, unwritable) is logged and leaves the session
        where it is: False. Any other error is raised, the session as it was."""
        s = job.session
        if error is not None:
            self.manager.release_host(job.held)
            if job.tier is Tier.DISK and isinstance(error, (OSError, SnapshotError)):
                log.warning("could not spill session %s to %s: %s; it stays in %s",
                            s.session_id, job.path, error, s.tier.value)
                return False
            raise error
        if job.tier is Tier.DISK:
            if moved:
                self.disk_write_bytes_per_s.observe(moved, seconds)
            self.disk_bytes_written += moved
            self.manager.spill_to_disk(s, job.lead, job.path, self.copy_cost(Tier.DISK))
            return True
        if job.copy:
            self.host_bytes_per_s.observe(moved, seconds)
        bs, by_id = self.bs, {h.block_id: h for h in job.held.host_blocks}
        for i, _, h in job.copy:
            if i < len(s.hashes):
                self.host.index.cache_full_block(by_id[h], s.hashes[i],
                                                 s.tokens[i * bs:(i + 1) * bs],
                                                 s.hashes[i - 1] if i else None)
        self.manager.stage_host(s, job.held.host_blocks)  # the session's references now
        self.manager.release_host(job.held)
        self.manager.spill_to_host(s, job.lead, self.copy_cost(Tier.HOST))
        return True

    def _spill_now(self, job: PendingSpill) -> bool:
        """A spill staged, copied and settled on this thread."""
        try:
            moved, seconds = self.timed_spill(job, None)
        except BaseException as e:
            return self.settle_spill(job, error=e)
        return self.settle_spill(job, moved, seconds)

    def keep_evicted(self, victims: list[Evicted]) -> set[int]:
        """Copy evicted device content the host tier does not hold yet into host blocks
        (as many as it has unreferenced, its own coldest cached content making room),
        published there for any later request, on this thread (the blocks are about to be
        rewritten; what was copied ahead, `stage_clean`, is found there and not copied).
        Returns the victims now held on the host."""
        index = self.host.index
        new = [v for v in victims if index.lookup(v.block_hash, v.token_ids) is None]
        new = new[:index.num_free]
        if new:
            self.evicted_copies[Tier.HOST] += len(new)
            held = HostTransient()
            self.manager.stage_host(held, [None] * len(new))
            try:
                t0 = time.perf_counter()
                moved = self.host.store(self.kv_pool, [v.block_id for v in new],
                                        [h.block_id for h in held.host_blocks])
                self.host_bytes_per_s.observe(moved, time.perf_counter() - t0)
                for v, h in zip(new, held.host_blocks, strict=True):
                    index.cache_full_block(h, v.block_hash, v.token_ids, v.parent_hash,
                                           v.hits)
            finally:
                self.manager.release_host(held)
        return {v.block_id for v in victims if index.lookup(v.block_hash, v.token_ids)}

    def stage_clean(self, tier: Tier, victims: list[Evicted]) -> PendingClean:
        """Engine thread: where victims of `tier`'s pool go ahead of their eviction
        (`BlockPool.next_victims`; the policy chose them and checked the room below):
        fresh host blocks (DEVICE) or disk cache slots (HOST, as many as it has
        unreferenced: the victims after them are dropped from the job), held by the job
        until `settle_clean`. CacheFullError when the host is short."""
        job = PendingClean(tier, list(victims))
        if tier is Tier.DEVICE:
            self.manager.stage_host(job.held, [None] * len(job.victims))
        else:
            job.slots = self.disk_cache.reserve(len(job.victims))
            del job.victims[len(job.slots):]
        return job

    def copy_clean(self, job: PendingClean,
                   pace: Callable[[], None] | None = None) -> tuple[list[int] | int, float]:
        """The copier: the victims' bytes into the job's host blocks (bytes moved) or disk
        cache slots (their payload crcs, up to a failed write), SPILL_GROUP_BLOCKS at a
        time (`pace` between groups), and the seconds it took. The source blocks are free
        and may be evicted and rewritten meanwhile: such a copy is torn, and
        `settle_clean` drops it."""
        t0 = time.perf_counter()
        if pace is not None:
            self.copier.start_pacing()
        moved, crcs = 0, []
        for g in range(0, len(job.victims), SPILL_GROUP_BLOCKS):
            if pace is not None:
                pace()
            part = slice(g, g + SPILL_GROUP_BLOCKS)
            ids = [v.block_id for v in job.victims[part]]
            if job.tier is Tier.DEVICE:
                moved += self.host.store(self.kv_pool, ids,
                                         [h.block_id for h in job.held.host_blocks[part]])
                continue
            written = self.disk_cache.write(self.host.tensors, job.slots[part], ids)
            crcs += written
            if len(written) < len(ids):
                break  # a failed write (logged): the slots after it stay blank
        return (moved if job.tier is Tier.DEVICE else crcs), time.perf_counter() - t0

    def settle_clean(self, job: PendingClean, done: list[int] | int = 0,
                     seconds: float = 0.0, error: BaseException | None = None) -> int:
        """Engine thread: publish below each copy whose source block still holds the
        content it was copied from (not evicted since: its bytes did not change), unless
        the tier below found that content meanwhile; let the job's blocks go (the
        published ones stay cached there). Returns how many were published; a failed copy
        publishes none (logged: the eviction copies them as before)."""
        source = self.pool if job.tier is Tier.DEVICE else self.host.index
        published = 0
        try:
            if error is not None:
                log.warning("copying %d blocks ahead of their eviction failed: %s",
                            len(job.victims), error)
                return 0
            if job.tier is Tier.DEVICE:
                index = self.host.index
                for v, h in zip(job.victims, job.held.host_blocks, strict=True):
                    if source.still_holds(v) and index.lookup(v.block_hash, v.token_ids) is None:
                        index.cache_full_block(h, v.block_hash, v.token_ids, v.parent_hash,
                                               v.hits)
                        published += 1
                if done:
                    self.host_bytes_per_s.observe(done, seconds)
            else:
                index = self.disk_cache.index
                for v, slot, crc in zip(job.victims, job.slots, done, strict=False):
                    if source.still_holds(v) and index.lookup(v.block_hash, v.token_ids) is None:
                        published += self.disk_cache.commit(slot, v.block_hash, v.token_ids,
                                                            v.parent_hash, v.hits, crc)
            self.cleaned_blocks[Tier.HOST if job.tier is Tier.DEVICE else Tier.DISK] += published
            return published
        finally:
            if job.tier is Tier.DEVICE:
                self.manager.release_host(job.held)
            else:
                self.disk_cache.release(job.slots)

    def keep_on_disk(self, victims: list[Evicted], tier: Tier) -> set[int]:
        """Write evicted content of `tier`'s pool (the host's, or the device's when there
        is no host tier) that the disk cache lacks into it, published there for any later
        request (the policy chose the victims: its admission). Returns the victims now
        held there."""
        src = self.host.tensors if tier is Tier.HOST else self.kv_pool.tensors()
        self.evicted_copies[Tier.DISK] += self.disk_cache.store(
            src, [(v.block_id, v.block_hash, v.token_ids, v.parent_hash, v.hits)
                  for v in victims])
        index = self.disk_cache.index
        return {v.block_id for v in victims if index.lookup(v.block_hash, v.token_ids)}

    def offer_objects(self, victims: list[Evicted], tier: Tier) -> int:
        """Queue evicted content of `tier`'s pool (the host's, or the device's) for the
        object store (the policy chose the victims: its admission). Returns how many were
        queued (what the store has is skipped)."""
        src = self.host.tensors if tier is Tier.HOST else self.kv_pool.tensors()
        return self.objects.offer(src, [(v.block_id, v.block_hash, v.token_ids,
                                         v.parent_hash, v.hits) for v in victims])

    def load_lower_hits(self, holder: Holder, found: list[tuple[Tier, Block]], token_ids,
                        hashes: list[bytes], start: int) -> int:
        """`stage_lower`, `copy_lower` and `settle_lower` on this thread. Returns how many
        leading blocks were loaded."""
        job = self.stage_lower(holder, found, token_ids, hashes, start)
        return self.settle_lower(job, self.copy_lower(job))

    def stage_lower(self, holder: Holder, found: list[tuple[Tier, Block]], token_ids,
                    hashes: list[bytes], start: int) -> LowerLoad:
        """Engine thread: fresh device blocks for lower-tier blocks `found` (blocks start..
        of a prompt, as the policy's lookup found them: host blocks, then disk cache
        blocks, then the object store's hashes), appended to the holder's table now,
        unpublished until the copy is settled.
        The lower blocks are referenced until then, so neither the device allocation's own
        evictions (which push content down a tier) nor later ones can take them. All or
        nothing (CacheFullError)."""
        on_host = [b for tier, b in found if tier is Tier.HOST]
        on_disk = [b for tier, b in found if tier is Tier.DISK]
        on_object = [h for tier, h in found if tier is Tier.OBJECT]
        sources, staged = HostTransient(), Transient()
        if on_host:
            self.manager.stage_host(sources, on_host)
        if on_disk:
            self.disk_cache.hold(on_disk)
        try:
            self.manager.stage(staged, [None] * len(found))
        except BaseException:
            self._release_sources(sources, on_disk, None)
            raise
        blocks = list(staged.blocks)
        self.manager.transfer(staged, holder)
        inline = bool(on_host) and self.host.staged  # its buffers are the engine thread's
        return LowerLoad(on_host, on_disk, on_object, sources, blocks, list(token_ids),
                         list(hashes), start, inline)

    def copy_lower(self, job: LowerLoad) -> LowerCopy:
        """Any thread (the copier's, unless `job.inline`): the bytes into the job's device
        blocks. A disk cache slot that fails its checks ends the run there; any other error
        is logged and loads nothing (the blocks are computed instead)."""
        ids = [b.block_id for b in job.blocks]
        out = LowerCopy()
        try:
            if job.on_host:
                t0 = time.perf_counter()
                out.host_bytes = self.host.load(self.kv_pool, [h.block_id for h in job.on_host],
                                                ids[:len(job.on_host)])
                out.host_s = time.perf_counter() - t0
                out.loaded = len(job.on_host)
            if job.on_disk:
                t0 = time.perf_counter()
                after_host = ids[len(job.on_host):]
                got = self.disk_cache.load(job.on_disk, self.kv_pool.tensors(),
                                           after_host[:len(job.on_disk)])
                out.loaded += got
                out.damaged = got < len(job.on_disk)
                out.disk_bytes = got * (self.disk_cache.header_bytes
                                        + self.disk_cache.payload_bytes)
                out.disk_s = time.perf_counter() - t0
            if job.on_object and not out.damaged:
                self._copy_objects(job, ids[out.loaded:], out)
        except Exception as e:  # noqa: BLE001 - what was not loaded is computed
            log.warning("loading %d blocks from below the device failed: %s; computing "
                        "them", len(job.blocks), e)
            out.loaded = 0
        return out

    def _copy_objects(self, job: LowerLoad, ids: list[int], out: LowerCopy) -> None:
        """The object store's part of `copy_lower`, after the host's and the disk's."""
        bs, first = self.bs, job.start + len(job.on_host) + len(job.on_disk)
        tokens = [tuple(job.token_ids[i * bs:(i + 1) * bs])
                  for i in range(first, first + len(job.on_object))]
        t0 = time.perf_counter()
        got, out.object_first_s = self.objects.load(job.on_object, tokens,
                                                    self.kv_pool.tensors(), ids)
        out.object_s = time.perf_counter() - t0
        out.object_bytes = got * self.objects.records.record_bytes
        out.loaded += got

    def settle_lower(self, job: LowerLoad, copy: LowerCopy) -> int:
        """Engine thread: the loaded blocks are published under their hashes, the lower
        blocks let go (a damaged disk slot discarded), the copy timed into each tier's
        rate. Returns how many leading blocks were loaded (the holder computes the rest:
        their blocks are in its table)."""
        bs, loaded = self.bs, copy.loaded
        damaged = job.on_disk[loaded - len(job.on_host)] if copy.damaged else None
        self._release_sources(job.sources, job.on_disk, damaged)
        if copy.host_bytes:
            self.host_bytes_per_s.observe(copy.host_bytes, copy.host_s)
            self.host.hit_tokens += len(job.on_host) * bs
        if copy.disk_bytes:
            self.disk_read_bytes_per_s.observe(copy.disk_bytes, copy.disk_s)
        if copy.object_bytes:
            self.object_latency_s.observe(copy.object_first_s, 1.0)
            self.object_read_bytes_per_s.observe(
                copy.object_bytes, max(copy.object_s - copy.object_first_s, 1e-6))
        for j, b in enumerate(job.blocks[:loaded]):
            i = job.start + j
            self.pool.cache_full_block(b, job.hashes[i], job.token_ids[i * bs:(i + 1) * bs],
                                       job.hashes[i - 1] if i else None)
        return loaded

    def _release_sources(self, sources: HostTransient, on_disk: list[Block],
                         damaged: Block | None) -> None:
        if sources.host_blocks:
            self.manager.release_host(sources)
        if on_disk:
            self.disk_cache.release(on_disk, damaged)

    def to_disk(self, s: SessionKV, lead: int) -> bool:
        """Write the whole KV to the session's file, on this thread; then release all but
        the pinned lead (and any host blocks). False, nothing changed, when the write
        fails."""
        return self._spill_now(self.stage_spill(s, lead, Tier.DISK))

    def drop(self, s: SessionKV, lead: int) -> None:
        """Forget all but the first `lead` device blocks (the next turn recomputes)."""
        self.plans.pop(s, None)
        self.manager.drop(s, lead)

    def release(self, s: SessionKV, delete_file: bool) -> None:
        """Free the session's KV; delete_file: also its own file in session_dir (never the
        file it was restored from elsewhere, nor another session's)."""
        self.plans.pop(s, None)
        self.manager.forget(s)
        if delete_file and self.disk is not None:
            self.disk.path_for(s.session_id).unlink(missing_ok=True)

    # ---- snapshots -------------------------------------------------------------------------

    def block_hashes(self, tokens, cache_salt: SaltArg) -> list[bytes]:
        """The chained hashes of every full block of `tokens`, computed here: a restored
        session's blocks are published (and looked up) under these, never under hashes
        read from a file, which could name another prefix's blocks."""
        return self.hasher.extend([], tokens, len(tokens), cache_salt)

    def snapshot_fields(self, s: SessionKV) -> dict:
        meta = s.meta()
        # hashes of every full block (also when prefix caching is off and none were kept)
        hashes = self.hasher.extend(list(s.hashes), s.tokens, len(s.tokens),
                                    meta["sampling"].get("cache_salt"))
        return {**self.header_fields, **meta, "session_id": s.session_id,
                "token_ids": list(s.tokens), "block_hashes": [h.hex() for h in hashes]}

    def write_snapshot(self, s: SessionKV, path: Path) -> int:
        """The session's snapshot from wherever its KV is (device, host); bytes written."""
        with self.snapshot_locks.get(s.session_id):
            return write_snapshot(path, self.snapshot_fields(s), self.block_tensors(s))

    def block_tensors(self, s: SessionKV) -> Iterator[dict[str, torch.Tensor]]:
        """Every block's tensors, contiguous, from wherever they are (device, host)."""
        return self._gather(self._block_sources(s))

    def _block_sources(self, s: SessionKV) -> list[tuple[dict[str, torch.Tensor], list[int]]]:
        """Where the session's blocks are, in order: (tensors, block ids) per tier."""
        sources = [(self.kv_pool.tensors(), [b.block_id for b in s.blocks])]
        if s.host_blocks:
            sources.append((self.host.tensors, [h.block_id for h in s.host_blocks]))
        return sources

    @staticmethod
    def _gather(sources: list[tuple[dict[str, torch.Tensor], list[int]]],
                pace: Callable[[], None] | None = None,
                group: int = SPILL_GROUP_BLOCKS) -> Iterator[dict[str, torch.Tensor]]:
        """The blocks' tensors, contiguous, gathered `group` at a time (one pass over the
        bytes, bounded extra memory); `pace` is called before each group."""
        for tensors, ids in sources:
            for g in range(0, len(ids), group):
                if pace is not None:
                    pace()
                part = ids[g:g + group]
                stacked = {n: torch.stack([t[:, i] for i in part]) for n, t in tensors.items()}
                for j in range(len(part)):
                    yield {n: x[j] for n, x in stacked.items()}

    # ---- back to the device ----------------------------------------------------------------

    def load(self, s: SessionKV, lead: int, header: SnapshotHeader | None = None) -> None:
        """Copy blocks lead.. of a spilled session back to the device (the caller checked
        there is room), on this thread: `stage_load`, `copy_load`, `settle_load`. On any
        error nothing changes."""
        job = self.stage_load(s, lead, header)
        try:
            moved, seconds = self.timed_copy(job, None)
        except BaseException as e:
            self.settle_load(job, error=e)
            raise
        self.settle_load(job, moved, seconds)

    def stage_load(self, s: SessionKV, lead: int,
                   header: SnapshotHeader | None = None) -> PendingLoad:
        """Engine thread: the device blocks a spilled session's blocks lead.. come back
        into (the caller checked there is room). Full blocks still cached on the device
        (freed at spill time, not yet evicted) are re-referenced instead of copied; fresh
        ones are held by the job's `Transient` until it is settled."""
        targets: list[Block | None] = []
        for i in range(lead, blocks_for(len(s.tokens), self.bs)):
            hit = None
            if i < len(s.hashes):
                hit = self.pool.lookup(s.hashes[i], s.tokens[i * self.bs:(i + 1) * self.bs])
            targets.append(hit)
        staged = Transient()
        fresh = self.manager.stage(staged, targets)
        copy = [(lead + j, b) for j, b in enumerate(staged.blocks) if b in fresh]
        # (the host's staged path shares its buffers with the engine thread's moves)
        inline = s.tier is Tier.HOST and self.host.staged
        return PendingLoad(s, s.tier, lead, staged, copy, header, inline, self.plans.get(s))

    def copy_load(self, job: PendingLoad, pace: Callable[[], None] | None = None) -> int:
        """Any thread (the copier's, unless `job.inline`): the bytes into the job's fresh
        blocks, each validated when read from a file. Returns bytes moved; raises
        SnapshotError on a file that no longer holds the session's KV. `pace`: called
        between blocks read from files (the copier's `pace`)."""
        s, copy = job.session, job.copy
        if job.tier is Tier.HOST:
            return self.host.load(self.kv_pool, [s.host_blocks[i - job.lead].block_id
                                                 for i, _ in copy],
                                  [b.block_id for _, b in copy])
        if job.plan is not None:
            return self._load_plan(job.plan, copy, pace)
        header = job.header
        if header is None:  # the file may have changed since it was written
            header = read_header(s.disk_path, expect=self.identity)
        if tuple(header.token_ids) != s.tokens:
            raise SnapshotError(f"{s.disk_path}: no longer holds this session's "
                                f"tokens (replaced since it was written)")
        return self.load_file_blocks(s.disk_path, copy, header, pace)

    def timed_copy(self, job: PendingLoad,
                   pace: Callable[[], None] | None) -> tuple[int, float]:
        """`copy_load`, with the seconds it took (the tier's rate is observed when the job
        is settled, on the engine thread). `pace`: the copier's, on the copier."""
        t0 = time.perf_counter()
        if pace is not None:
            self.copier.start_pacing()
        moved = self.copy_load(job, pace)
        return moved, time.perf_counter() - t0

    def settle_load(self, job: PendingLoad, moved: int = 0, seconds: float = 0.0,
                    error: BaseException | None = None) -> None:
        """Engine thread, once per job: on success the session's blocks are the loaded ones
        (tier DEVICE), the copy timed into the tier's rate; on error the fresh blocks are
        released and the session is as it was."""
        s = job.session
        if error is not None:
            self.manager.release(job.staged)
            return
        if job.tier is Tier.HOST:
            self.host_bytes_per_s.observe(moved, seconds)
            self.host.hit_tokens += len(job.copy) * self.bs
        else:
            self.disk_read_bytes_per_s.observe(moved, seconds)
            self.disk_bytes_read += moved
            self.disk_hit_tokens += len(job.copy) * self.bs
        self.plans.pop(s, None)
        self.manager.loaded(s, job.staged)

    # ---- resumed sessions (durability="turn") ---------------------------------------------

    def attach_plan(self, s: SessionKV, plan: DiskPlan) -> None:
        """A resumed session's KV is on disk where `plan` says: its tier is DISK until its
        first turn loads (or recomputes) it."""
        self.manager.on_disk(s, plan.tokens, plan.hashes, plan.path)
        self.plans[s] = plan

    def has_plan(self, s: SessionKV) -> bool:
        return s in self.plans

    def rewrite_disk_snapshot(self, s: SessionKV, path: Path) -> int:
        """A session whose KV is only in its snapshot file, written (again) at `path` with
        the session's current fields, chunks copied: the file's messages may be older than
        its KV (a spill can land between a turn's KV going back to the session and the
        turn's messages), so a file is never taken as the session as it is."""
        h = read_header(s.disk_path, expect=self.identity)
        if tuple(h.token_ids) != s.tokens:
            raise SnapshotError(f"{s.disk_path}: no longer holds this session's tokens "
                                f"(replaced since it was written)")
        with self.snapshot_locks.get(s.session_id):
            return compact(path, [(s.disk_path, h, i) for i in range(h.num_blocks)],
                           self.snapshot_fields(s))

    def write_plan_snapshot(self, s: SessionKV, path: Path) -> int:
        """The snapshot of a resumed session whose KV is still on disk where its plan says:
        chunks copied from those files (each checksum verified), nothing loaded. Returns
        the blocks written (a bad chunk ends the snapshot's KV there)."""
        plan = self.plans[s]
        with self.snapshot_locks.get(s.session_id):
            return compact(path, plan.sources, self.snapshot_fields(s))

    def _load_plan(self, plan: DiskPlan, wanted: list[tuple[int, Block]],
                   pace: Callable[[], None] | None = None) -> int:
        """Read blocks (block index, device block) from wherever the plan has them, file
        by file, each validated as load_file_blocks validates snapshot blocks."""
        by_file: dict[Path, tuple[SnapshotHeader, list[tuple[int, Block]]]] = {}
        for i, block in wanted:
            path, header, chunk = plan.sources[i]
            by_file.setdefault(path, (header, []))[1].append((chunk, block))
        moved = 0
        for path, (header, blocks) in by_file.items():
            blocks.sort(key=lambda x: x[0])
            moved += self.load_file_blocks(path, blocks, header, pace)
        return moved

    def load_file_blocks(self, path: Path, wanted: list[tuple[int, Block]],
                         header: SnapshotHeader | None = None,
                         pace: Callable[[], None] | None = None) -> int:
        """Read blocks (index in file, device block) from a snapshot into the pool; each is
        validated (checksum, codec, names, shapes, dtypes) before it is copied, or, when it
        was read straight into its (fresh) CPU block, before this returns."""
        h = header or read_header(path, expect=self.identity)
        target = dict(wanted)
        pool = self.kv_pool.tensors()
        block_bytes = sum(t[:, 0].numel() * t.element_size() for t in pool.values())
        # streamed: a block is copied as soon as it is validated; if a later block is bad
        # the caller frees every target block (fresh, unpublished: nothing can see them),
        # which is also what lets a CPU pool take stored chunks straight from the file
        dest = self._file_destinations(pool, target) if self.kv_pool.k.device.type == "cpu" \
            else None
        for i, tensors in read_blocks(path, h, [i for i, _ in wanted], dest=dest):
            if pace is not None:
                pace()
            if tensors is not None:
                for name, t in pool.items():
                    t[:, target[i].block_id] = tensors[name].to(t.device)
        return block_bytes * len(wanted)

    @staticmethod
    def _file_destinations(pool: dict[str, torch.Tensor], target: dict[int, Block]):
        """i -> the CPU pool memory of block target[i] in snapshot order: for each tensor
        (sorted by name), each layer's slice of the block."""
        layers = {n: [memoryview(t[layer].view(torch.uint8).numpy()).cast("B")
                      for layer in range(t.shape[0])] for n, t in pool.items()}
        sizes = {n: t[0, 0].numel() * t.element_size() for n, t in pool.items()}

        def dest(i: int) -> list[memoryview]:
            b = target[i].block_id
            return [mv[b * sizes[n]:(b + 1) * sizes[n]] for n in sorted(layers)
                    for mv in layers[n]]
        return dest

    def validate_file(self, path: Path, header: SnapshotHeader) -> None:
        """Read and check every block of a snapshot without loading it."""
        for _ in read_blocks(path, header, list(range(header.num_blocks))):
            pass
