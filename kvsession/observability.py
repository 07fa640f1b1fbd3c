"""`llm.stats()`: the counters of every component of one engine gathered into a `Stats`
struct (kvsession/metrics.py). The counters are the engine thread's: `now` runs there,
between two steps; the disk tier's room is a file-system query, added on the caller's
thread (`add_disk_room`: a slow mount must not stall decoding)."""

from __future__ import annotations

from kvsession import costmodel
from kvsession.cache.block_pool import BlockPool, blocks_for
from kvsession.cache.manager import Tier
from kvsession.cache.prefix import PrefixCache
from kvsession.engine.loop import Engine
from kvsession.engine.scheduler import Scheduler
from kvsession.engine.slo_chunking import SloChunking
from kvsession.metrics import SLO, LatencyTracker, PrefixStats, Stats, TierStats
from kvsession.remote_offload import remote_stats
from kvsession.tiers.disk import DiskTier
from kvsession.tiers.disk_cache import DiskCache
from kvsession.tiers.host import HostPool
from kvsession.tiers.object_store import ObjectCache
from kvsession.tiers.policy import TierPolicy
from kvsession.tiers.writeback import WriteBehind


class StatsCollector:
    def __init__(self, pool: BlockPool, prefix: PrefixCache, host: HostPool | None,
                 disk: DiskTier | None, policy: TierPolicy, scheduler: Scheduler,
                 engine: Engine, latency: LatencyTracker, connector, block_size: int,
                 kv_bytes_per_token: int, slo_chunking: SloChunking,
                 disk_cache: DiskCache | None = None, writeback: WriteBehind | None = None,
                 objects: ObjectCache | None = None):
        self.pool, self.prefix, self.host, self.disk = pool, prefix, host, disk
        self.policy, self.scheduler, self.engine, self.latency = policy, scheduler, engine, latency
        self.connector = connector  # the prefill connector, or None
        self.block_size, self.kv_bytes_per_token = block_size, kv_bytes_per_token
        self.disk_cache, self.writeback, self.objects = disk_cache, writeback, objects
        self.slo_chunking = slo_chunking

    def now(self, slo: SLO) -> Stats:
        """Engine thread: every counter as it is between two steps."""
        pool, bs, bpt = self.pool, self.block_size, self.kv_bytes_per_token
        drafter = self.engine.drafter
        pins = self.prefix.pins
        device = TierStats(
            blocks_total=pool.num_blocks, blocks_used=pool.num_blocks - pool.num_free,
            blocks_free=pool.num_free, blocks_pinned=pins.num_pinned_blocks,
            bytes_per_token=bpt, tokens_capacity=pool.num_blocks * bs)
        host = TierStats(bytes_per_token=bpt)
        mover = self.policy.mover
        if self.host is not None:
            hp = self.host
            host = TierStats(blocks_total=hp.num_blocks, blocks_used=hp.num_blocks - hp.num_free,
                             blocks_free=hp.num_free, bytes_per_token=bpt,
                             tokens_capacity=hp.num_blocks * bs,
                             cached_blocks=len(hp.index.index), hit_tokens=hp.hit_tokens,
                             bytes_read=hp.bytes_read, bytes_written=hp.bytes_written,
                             blocks_copied_at_eviction=mover.evicted_copies[Tier.HOST],
                             blocks_copied_ahead=mover.cleaned_blocks[Tier.HOST])
        disk = TierStats(bytes_per_token=bpt)
        if self.disk is not None:  # sessions whose KV lives only there (free: see add_disk_room)
            disk.blocks_used = sum(blocks_for(len(s.tokens), bs) for s in self.policy.sessions
                                   if s.tier is Tier.DISK)
            # written: KV blocks of the cache, spilled sessions' snapshots, segments written
            # behind turns (the logs hold tokens, not KV); read: loads from any of them
            disk.bytes_written = self.policy.mover.disk_bytes_written + (
                self.writeback.bytes_written if self.writeback is not None else 0)
            disk.bytes_read = self.policy.mover.disk_bytes_read
            disk.hit_tokens = self.policy.mover.disk_hit_tokens
        if self.disk_cache is not None:
            dc = self.disk_cache
            disk.cached_blocks = len(dc.index.index)
            disk.hit_tokens += dc.hit_tokens
            disk.bytes_written += dc.bytes_written
            disk.cache_bytes_written = dc.bytes_written
            disk.bytes_read += dc.bytes_read
            disk.blocks_copied_at_eviction = mover.evicted_copies[Tier.DISK]
            disk.blocks_copied_ahead = mover.cleaned_blocks[Tier.DISK]
        host.read_bytes_per_s = _measured(mover.host_bytes_per_s)
        disk.read_bytes_per_s = _measured(mover.disk_read_bytes_per_s)
        tiers = {"device": device, "host": host, "disk": disk}
        if self.objects is not None:
            ob = self.objects  # (its counters are ints: read as they are)
            tiers["object"] = TierStats(
                bytes_per_token=bpt, cached_blocks=len(ob.known), hit_tokens=ob.hit_tokens,
                bytes_read=ob.bytes_read, bytes_written=ob.bytes_written,
                cache_bytes_written=ob.bytes_written,
                read_bytes_per_s=_measured(mover.object_read_bytes_per_s),
                latency_s=_measured(mover.object_latency_s))
        q, h = self.prefix.queried_tokens, self.prefix.hit_tokens
        lat, goodput, attainment = self.latency.summary(slo)
        return Stats(
            tiers=tiers,
            prefix=PrefixStats(queried_tokens=q, hit_tokens=h, hit_rate=h / q if q else 0.0,
                               evictions=pool.num_evictions, cached_blocks=len(pool.index),
                               pinned_blocks=pins.num_pinned_blocks,
                               pinned_bytes=pins.num_pinned_blocks * bs * bpt,
                               num_pins=len(pins.pins),
                               eviction_policy=pool.eviction.value,
                               evictions_by_copy=dict(pool.evictions_by_copy),
                               evictions_by_reason=dict(pool.evictions_by_reason)),
            spills=dict(self.policy.spills), restores=dict(self.policy.restores),
            recomputes=self.policy.recomputes, remote=remote_stats(self.connector), latency=lat,
            goodput_tokens_per_s=goodput, slo_attainment=attainment,
            num_requests=self.latency.num_requests,
            num_preemptions=self.scheduler.num_preemptions,
            prefill_tokens=self.engine.prefill_tokens,
            generated_tokens=self.engine.generated_tokens,
            slo_unmet_steps=self.slo_chunking.unmet_steps,
            slo_held_steps=self.slo_chunking.held_steps,
            spill_failures=self.policy.spill_failures,
            draft_tokens_proposed=drafter.proposed_tokens if drafter is not None else 0,
            draft_tokens_accepted=drafter.accepted_tokens if drafter is not None else 0)

    def add_disk_room(self, st: Stats) -> Stats:
        """Caller's thread: the disk tier's free blocks (what is left on session_dir's
        file system) and the cuts crash recovery made to session logs."""
        if self.disk is not None:
            d, bs = st.tiers["disk"], self.block_size
            d.blocks_free = self.disk.free_bytes() // (d.bytes_per_token * bs)
            d.blocks_total = d.blocks_used + d.blocks_free
            d.tokens_capacity = d.blocks_total * bs
            st.recovery = list(self.disk.recoveries)
        return st


def _measured(rate: costmodel.RateEstimator) -> float:
    """A rate the cost model uses, once measured (0.0 while it is the prior)."""
    return rate.value if rate.num_samples or rate.fixed else 0.0
