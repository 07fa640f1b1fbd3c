"""TierPolicy: the only place that decides keep, spill (to host or disk), load or recompute.

A session's KV is a `SessionKV`. Where it lives (`tier`):
- DEVICE: `blocks` hold references on every block of `tokens`;
- HOST:   `blocks` hold the leading pinned blocks (a pinned system prompt stays on the
          device), `host_ids` the rest, in order;
- DISK:   `blocks` as for HOST, the whole KV in `disk_path`.
Everything here runs on the engine thread. A session is `busy` while a turn owns its blocks;
busy sessions are never moved.

Decisions use kvsession.costmodel with inputs measured at run time (EWMA of every copy's
bandwidth and of prefill throughput), never constants: on restore, a tier is loaded from only
if `load_ms < recompute_ms` at the current prefill queue depth.
"""

from __future__ import annotations

import enum
import logging
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import torch

from kvsession import costmodel
from kvsession.cache.block_pool import Block, BlockPool, blocks_for
from kvsession.cache.kv_pool import KVPool
from kvsession.cache.prefix import PrefixCache
from kvsession.errors import SnapshotError
from kvsession.tiers.disk import DiskTier
from kvsession.tiers.host import HostPool
from kvsession.tiers.snapshot import SnapshotHeader, read_blocks, read_header, write_snapshot

log = logging.getLogger("kvsession")


class Tier(enum.Enum):
    DEVICE = "device"
    HOST = "host"
    DISK = "disk"


@dataclass(eq=False)
class SessionKV:
    session_id: str
    meta: Callable[[], dict]  # messages, sampling, system: for snapshot headers
    tokens: list[int] = field(default_factory=list)
    hashes: list[bytes] = field(default_factory=list)
    blocks: list[Block] = field(default_factory=list)
    host_ids: list[int] = field(default_factory=list)
    disk_path: Path | None = None
    tier: Tier = Tier.DEVICE
    busy: bool = False
    last_used: float = 0.0


class TierPolicy:
    def __init__(self, pool: BlockPool, kv: KVPool, prefix: PrefixCache, host: HostPool | None,
                 disk: DiskTier | None, header_fields: Callable[[], dict],
                 bytes_per_token: int, prefill_tps: costmodel.RateEstimator,
                 queue_depth: Callable[[], int], spill_after_s: float | None = None):
        self.pool, self.kv, self.prefix, self.host, self.disk = pool, kv, prefix, host, disk
        self.header_fields, self.bytes_per_token = header_fields, bytes_per_token
        self.prefill_tps, self.queue_depth = prefill_tps, queue_depth
        self.spill_after_s = spill_after_s
        self.bs = pool.block_size
        self.sessions: list[SessionKV] = []
        # measured bandwidths (bytes/s); priors only until the first copy is timed
        self.host_bytes_per_s = costmodel.RateEstimator(prior=10e9)
        self.disk_read_bytes_per_s = costmodel.RateEstimator(prior=1e9)
        self.disk_write_bytes_per_s = costmodel.RateEstimator(prior=1e9)
        self.spills = {"host": 0, "disk": 0}
        self.restores = {"host": 0, "disk": 0}
        self.recomputes = 0
        self.spill_failures = 0
        self.decisions: list[tuple[str, str, str]] = []  # (session, decision, reason)

    # ---- registry ----------------------------------------------------------------------

    def register(self, s: SessionKV) -> None:
        s.last_used = time.monotonic()
        self.sessions.append(s)

    def release(self, s: SessionKV, delete_file: bool = False) -> None:
        """Free everything the session holds (device refs, host blocks; the file if asked)."""
        self.pool.free(s.blocks)
        if self.host is not None and s.host_ids:
            self.host.free(s.host_ids)
        if delete_file and s.disk_path is not None:
            s.disk_path.unlink(missing_ok=True)
        s.blocks, s.host_ids, s.tokens, s.hashes = [], [], [], []
        s.tier, s.disk_path = Tier.DEVICE, None
        if s in self.sessions:
            self.sessions.remove(s)

    def _note(self, s: SessionKV, decision: str, reason: str) -> None:
        self.decisions.append((s.session_id, decision, reason))
        del self.decisions[:-256]
        log.debug("session %s: %s (%s)", s.session_id, decision, reason)

    # ---- shapes of a session's KV --------------------------------------------------------

    def _num_lead(self, s: SessionKV) -> int:
        """Leading blocks that are pinned: they stay on the device when the session moves."""
        n = 0
        for b in s.blocks:
            if b.block_id not in self.prefix.pins.block_pins:
                break
            n += 1
        return n

    def _num_blocks(self, s: SessionKV) -> int:
        return blocks_for(len(s.tokens), self.bs)

    def _block_tensors(self, s: SessionKV, group: int = 32
                       ) -> Iterator[dict[str, torch.Tensor]]:
        """Every block's tensors, contiguous, from wherever they are (device, host); blocks
        are gathered `group` at a time (one pass over the bytes, bounded extra memory)."""
        sources = [(self.kv.tensors(), [b.block_id for b in s.blocks])]
        if s.host_ids:
            sources.append((self.host.tensors, s.host_ids))
        for tensors, ids in sources:
            for g in range(0, len(ids), group):
                part = ids[g:g + group]
                stacked = {n: torch.stack([t[:, i] for i in part]) for n, t in tensors.items()}
                for j in range(len(part)):
                    yield {n: x[j] for n, x in stacked.items()}

    # ---- spilling ------------------------------------------------------------------------

    def reclaim(self, num_blocks: int, exclude: SessionKV | None = None) -> int:
        """Free at least `num_blocks` device blocks by spilling idle sessions, least
        recently used first. Returns how many were freed (may be fewer)."""
        freed = 0
        for s in sorted(self.sessions, key=lambda x: x.last_used):
            if freed >= num_blocks:
                break
            if s is exclude or s.busy or s.tier is not Tier.DEVICE:
                continue
            before = self.pool.num_free
            self.spill(s, reason=f"device pool short of {num_blocks} blocks")
            freed += self.pool.num_free - before
        return freed

    def spill(self, s: SessionKV, to: Tier | None = None, reason: str = "") -> Tier:
        """Move an idle session's private blocks off the device: to host when it has room
        (making room by moving older host sessions to disk), else to disk, else drop them
        (the next turn recomputes). Returns where the KV went."""
        if s.busy or not s.tokens:
            return s.tier
        lead = self._num_lead(s)
        private = s.blocks[lead:]
        if not private and not s.host_ids:
            return s.tier
        want_host = to in (None, Tier.HOST) and self.host is not None
        if want_host and s.tier is Tier.DEVICE:
            if self.host.num_free < len(private):
                self._make_host_room(len(private))
            if self.host.num_free >= len(private):
                return self._to_host(s, lead, reason)
        if self.disk is not None and self._to_disk(s, lead, reason):
            return Tier.DISK
        if to is None or to is Tier.DEVICE:
            self.drop(s, reason=reason or "no room in any tier")
        return s.tier

    def _to_host(self, s: SessionKV, lead: int, reason: str) -> Tier:
        private = s.blocks[lead:]
        ids = self.host.allocate(len(private))
        t0 = time.perf_counter()
        moved = self.host.store(self.kv, [b.block_id for b in private], ids)
        self.host_bytes_per_s.observe(moved, time.perf_counter() - t0)
        self.pool.free(private)  # content stays cached on the device until evicted
        s.blocks, s.host_ids, s.tier = s.blocks[:lead], ids, Tier.HOST
        self.spills["host"] += 1
        self._note(s, "spill to host", reason)
        return Tier.HOST

    def _make_host_room(self, num_blocks: int) -> None:
        for other in sorted(self.sessions, key=lambda x: x.last_used):
            if self.host.num_free >= num_blocks:
                return
            if other.tier is Tier.HOST and not other.busy:
                if not (self.disk is not None and self._to_disk(other, len(other.blocks),
                                                                "host tier full")):
                    self.drop(other, reason="host tier full, no disk tier")

    def _to_disk(self, s: SessionKV, lead: int, reason: str) -> bool:
        path = self.disk.path_for(s.session_id)
        try:
            t0 = time.perf_counter()
            size = write_snapshot(path, self.snapshot_fields(s), self._block_tensors(s))
            self.disk_write_bytes_per_s.observe(size, time.perf_counter() - t0)
        except OSError as e:  # disk full, unwritable: the session stays where it is
            self.spill_failures += 1
            log.warning("could not spill session %s to %s: %s; it stays in %s",
                        s.session_id, path, e, s.tier.value)
            return False
        self.pool.free(s.blocks[lead:])
        if s.host_ids:
            self.host.free(s.host_ids)
        s.blocks, s.host_ids, s.disk_path, s.tier = s.blocks[:lead], [], path, Tier.DISK
        self.spills["disk"] += 1
        self._note(s, "spill to disk", reason)
        return True

    def drop(self, s: SessionKV, reason: str) -> None:
        """Forget the private KV (keep the pinned lead): the next turn recomputes it."""
        lead = self._num_lead(s) if s.tier is Tier.DEVICE else len(s.blocks)
        self.pool.free(s.blocks[lead:])
        if s.host_ids:
            self.host.free(s.host_ids)
        s.blocks, s.host_ids, s.tier = s.blocks[:lead], [], Tier.DEVICE
        s.tokens, s.hashes = s.tokens[: lead * self.bs], s.hashes[:lead]
        self._note(s, "drop (recompute later)", reason)

    def snapshot_fields(self, s: SessionKV) -> dict:
        meta = s.meta()
        # hashes of every full block (also when prefix caching is off and none were kept)
        hashes = self.prefix.hasher.extend(list(s.hashes), s.tokens, len(s.tokens),
                                           meta["sampling"].get("cache_salt"))
        return {**self.header_fields(), **meta, "session_id": s.session_id,
                "token_ids": list(s.tokens), "block_hashes": [h.hex() for h in hashes]}

    # ---- restoring -----------------------------------------------------------------------

    def checkout(self, s: SessionKV) -> str | None:
        """Before a turn: bring the session's KV to the device, or drop it when recomputing
        is cheaper (or there is no room). Marks the session busy. Returns where the reused
        KV came from ("device", "host", "disk") or None when nothing is reused."""
        s.busy = True
        source = self.restore(s)
        if source is None and s.tokens:
            source = "device"
        return source if s.tokens else None

    def restore(self, s: SessionKV) -> str | None:
        """Load a spilled session back (or drop it if recompute is cheaper). Returns the tier
        it was loaded from, or None if it was not spilled or was dropped."""
        if s.tier is Tier.DEVICE:
            return None
        tier = s.tier
        lead = len(s.blocks)
        num_tokens = len(s.tokens) - lead * self.bs
        bandwidth = (self.host_bytes_per_s if tier is Tier.HOST
                     else self.disk_read_bytes_per_s).value
        depth = self.queue_depth()
        load = costmodel.load_ms(num_tokens, self.bytes_per_token, bandwidth)
        recompute = costmodel.recompute_ms(num_tokens, self.prefill_tps.value, depth)
        why = (f"{num_tokens} tokens: load {load:.2f} ms at {bandwidth / 1e9:.2f} GB/s vs "
               f"recompute {recompute:.2f} ms at {self.prefill_tps.value:.0f} tok/s, "
               f"queue depth {depth}")
        if load >= recompute:
            self.recomputes += 1
            self.drop(s, reason="recompute is cheaper: " + why)
            return None
        need = self._num_blocks(s) - lead
        if self.pool.num_free < need:
            self.reclaim(need - self.pool.num_free, exclude=s)
        if self.pool.num_free < need:
            self.recomputes += 1
            self.drop(s, reason="no device room to load into")
            return None
        try:
            self.load_blocks(s, tier, lead)
        except SnapshotError as e:
            log.warning("%s; recomputing session %s", e, s.session_id)
            self.recomputes += 1
            self.drop(s, reason=f"unreadable snapshot: {e}")
            return None
        self.restores[tier.value] += 1
        self._note(s, f"load from {tier.value}", why)
        return tier.value

    def load_blocks(self, s: SessionKV, tier: Tier, lead: int) -> None:
        """Copy blocks lead.. back to the device. Full blocks still cached on the device
        (freed at spill time, not yet evicted) are re-referenced instead of copied."""
        targets: list[Block | None] = []
        for i in range(lead, self._num_blocks(s)):
            hit = None
            if i < len(s.hashes):
                hit = self.pool.lookup(s.hashes[i], s.tokens[i * self.bs:(i + 1) * self.bs])
            targets.append(hit)
        hits = [b for b in targets if b is not None]
        self.pool.touch(hits)
        fresh = iter(self.pool.allocate(sum(1 for b in targets if b is None)))
        blocks = [b if b is not None else next(fresh) for b in targets]
        copy = [(j, b) for j, (b, t) in enumerate(zip(blocks, targets, strict=True)) if t is None]
        t0 = time.perf_counter()
        try:
            if tier is Tier.HOST:
                moved = self.host.load(self.kv, [s.host_ids[j] for j, _ in copy],
                                       [b.block_id for _, b in copy])
                self.host_bytes_per_s.observe(moved, time.perf_counter() - t0)
                self.host.free(s.host_ids)
            else:
                moved = self.load_file_blocks(s.disk_path, [(lead + j, b) for j, b in copy])
                self.disk_read_bytes_per_s.observe(moved, time.perf_counter() - t0)
        except BaseException:
            self.pool.free(blocks)
            raise
        s.blocks, s.host_ids, s.tier = s.blocks + blocks, [], Tier.DEVICE

    def load_file_blocks(self, path: Path, wanted: list[tuple[int, Block]],
                         header: SnapshotHeader | None = None) -> int:
        """Read blocks (index in file, device block) from a snapshot into the pool; each is
        validated (checksum, codec, names, shapes, dtypes) before it is copied, or, when it
        was read straight into its (fresh) CPU block, before this returns."""
        h = header or read_header(path)
        target = dict(wanted)
        pool = self.kv.tensors()
        block_bytes = sum(t[:, 0].numel() * t.element_size() for t in pool.values())
        # streamed: a block is copied as soon as it is validated; if a later block is bad
        # the caller frees every target block (fresh, unpublished: nothing can see them),
        # which is also what lets a CPU pool take stored chunks straight from the file
        dest = self._file_destinations(pool, target) if self.kv.k.device.type == "cpu" \
            else None
        for i, tensors in read_blocks(path, h, [i for i, _ in wanted], dest=dest):
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

    def checkin(self, s: SessionKV, tokens: list[int], blocks: list[Block],
                hashes: list[bytes]) -> None:
        """After a turn: the session owns these device blocks again."""
        s.tokens, s.blocks, s.hashes = tokens, blocks, hashes
        s.host_ids, s.tier, s.busy = [], Tier.DEVICE, False
        s.last_used = time.monotonic()

    # ---- hints -----------------------------------------------------------------------------

    def suspend(self, s: SessionKV, expected_idle_s: float | None) -> str:
        """The session waits (tool call, human). Keep / host / disk / drop by expected waste:
        keep when the wait is short next to a reload, or memory is plentiful; else the
        cheapest tier to come back from that has room."""
        if s.busy or s.tier is not Tier.DEVICE or not s.tokens:
            return s.tier.value
        n = len(s.tokens)
        reload_host = costmodel.load_ms(n, self.bytes_per_token, self.host_bytes_per_s.value)
        reload_disk = costmodel.load_ms(n, self.bytes_per_token,
                                        self.disk_read_bytes_per_s.value)
        recompute = costmodel.recompute_ms(n, self.prefill_tps.value, self.queue_depth())
        free_fraction = self.pool.num_free / self.pool.num_blocks
        idle_ms = float("inf") if expected_idle_s is None else expected_idle_s * 1000
        why = (f"expected idle {idle_ms:.0f} ms, free {free_fraction:.0%}, reload host "
               f"{reload_host:.1f} / disk {reload_disk:.1f} / recompute {recompute:.1f} ms")
        if idle_ms <= 10 * min(reload_host, recompute) or (
                free_fraction > 0.5 and idle_ms <= 60_000):
            self._note(s, "keep", why)
            return "keep"
        if self.host is not None and idle_ms <= 300_000:
            got = self.spill(s, Tier.HOST, reason="suspend: " + why)
            if got is Tier.HOST:
                return "host"
        if self.disk is not None and reload_disk < recompute:
            if self.spill(s, Tier.DISK, reason="suspend: " + why) is Tier.DISK:
                return "disk"
        self.recomputes += 1  # decided now: the next turn recomputes instead of loading
        self.drop(s, reason="suspend: " + why)
        return "drop"

    def housekeeping(self, now: float) -> float | None:
        """Spill sessions idle longer than spill_after_s; seconds to the next deadline."""
        if self.spill_after_s is None:
            return None
        nxt = None
        for s in list(self.sessions):
            if s.busy or s.tier is not Tier.DEVICE or len(s.blocks) == self._num_lead(s):
                continue
            due = s.last_used + self.spill_after_s
            if now >= due:
                self.spill(s, reason=f"idle > spill_after_s={self.spill_after_s}")
            else:
                nxt = due - now if nxt is None else min(nxt, due - now)
        return nxt
