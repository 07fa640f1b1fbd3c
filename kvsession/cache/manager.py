"""KVCacheManager: the one owner of block tables.

`BlockPool` owns reference counts; this module owns *who holds them*. Every holder of
device blocks — a running `Sequence`, an idle session's `SessionKV`, a `Pin`, the
`Quarantine` of a failed remote prefill — carries a tuple of blocks (`holder.blocks`) that
only this module assigns: holders read their table, they never change it. The host tier is
a second `BlockPool` (`tiers/host.py`: content-indexed like the device pool): the host
blocks a spilled session holds (`SessionKV.host_blocks`), and those a `HostTransient` holds
while one engine-thread call fills them, are written here too.

Invariant (`check_integrity`): for every block of either pool, the number of times it
appears in the tables of all live holders equals its `ref_cnt`. A leaked reference (a holder dropped
without `release`) or a double reference shows up as a mismatch naming the block and its
holders.

All methods run on the engine thread.
"""

from __future__ import annotations

import enum
import time
import weakref
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import ClassVar, Protocol

from kvsession.cache.block_pool import Block, BlockPool, blocks_for
from kvsession.cache.kv_pool import KVPool
from kvsession.errors import CacheFullError


class HolderKind(enum.Enum):
    SEQUENCE = "sequence"
    SESSION = "session"
    PIN = "pin"
    QUARANTINE = "quarantine"
    TRANSIENT = "transient"  # blocks in flight inside one engine-thread call


class Holder(Protocol):
    holder_kind: ClassVar[HolderKind]
    blocks: tuple[Block, ...]


class Tier(enum.Enum):
    DEVICE = "device"
    HOST = "host"
    DISK = "disk"
    OBJECT = "object"  # an object store: cache blocks only (tiers/object_store.py)


@dataclass(eq=False)
class SessionKV:
    """A session's KV wherever it lives (`tier`):
    - DEVICE: `blocks` hold a reference on every block of `tokens`;
    - HOST:   `blocks` hold the leading pinned blocks (a pinned system prompt stays on the
              device), `host_blocks` (host-pool blocks, one reference each) the rest, in
              order;
    - DISK:   `blocks` as for HOST, the whole KV in `disk_path`.
    `busy` (a turn owns its blocks), `last_used`, `loaded_from` (the tier its KV was
    loaded from ahead of its next turn: a snapshot restore, a prefetch) and the return
    forecast (`turns`, `gap_s`: the learned gap between turns, `expected_idle_s`: the wait
    the session announced, `keep_until`: when a "keep" decision lapses), `priority` and
    `moving` (its blocks on their way between tiers on the copier, until settled: a
    tiers.mover.PendingLoad or PendingSpill) are the tier policy's; the rest is written by
    KVCacheManager only."""

    holder_kind: ClassVar[HolderKind] = HolderKind.SESSION
    session_id: str
    meta: Callable[[], dict]  # messages, sampling, system: for snapshot headers
    tokens: tuple[int, ...] = ()
    hashes: tuple[bytes, ...] = ()
    blocks: tuple[Block, ...] = ()
    host_blocks: tuple[Block, ...] = ()
    disk_path: Path | None = None
    tier: Tier = Tier.DEVICE
    busy: bool = False
    last_used: float = field(default_factory=time.monotonic)
    loaded_from: str | None = None
    turns: int = 0
    gap_s: float | None = None
    expected_idle_s: float | None = None
    keep_until: float | None = None
    moving: object | None = None
    priority: int = 0  # its turns' by default; reclaim takes less urgent (higher) ones first


class Quarantine:
    """Blocks of a failed remote prefill that a late remote write might still reach."""

    holder_kind: ClassVar[HolderKind] = HolderKind.QUARANTINE

    def __init__(self, seq_id: int):
        self.seq_id = seq_id
        self.blocks: tuple[Block, ...] = ()


class Transient:
    """Blocks that are being filled inside one engine-thread call before they are handed
    to their real holder (e.g. a restore's targets): owned, so integrity holds throughout."""

    holder_kind: ClassVar[HolderKind] = HolderKind.TRANSIENT

    def __init__(self):
        self.blocks: tuple[Block, ...] = ()


class HostTransient:
    """Host blocks being filled inside one engine-thread call (device blocks copied down
    as the device pool evicts them) before they are published and let go."""

    holder_kind: ClassVar[HolderKind] = HolderKind.TRANSIENT

    def __init__(self):
        self.blocks: tuple[Block, ...] = ()
        self.host_blocks: tuple[Block, ...] = ()


class KVCacheManager:
    def __init__(self, pool: BlockPool, kv: KVPool, host: BlockPool | None = None):
        """host: the host tier's block pool (tiers.host.HostPool.index), if there is one."""
        self.pool, self.kv_pool, self.host = pool, kv, host
        self.block_size = pool.block_size
        # every holder with a non-empty table, weakly: a holder dropped without `release`
        # vanishes from here, and its references then show up as unaccounted
        self._holders: weakref.WeakValueDictionary[int, Holder] = \
            weakref.WeakValueDictionary()

    # ---- the only writer of holder tables ----------------------------------------------

    def _set(self, holder: Holder, blocks: Sequence[Block]) -> None:
        holder.blocks = tuple(blocks)
        self._track(holder)

    def _set_host(self, s: SessionKV | HostTransient, host_blocks: Sequence[Block]) -> None:
        """Replace the host table; the references of the old one are dropped."""
        old, s.host_blocks = s.host_blocks, tuple(host_blocks)
        if old:
            self.host.free(old)
        self._track(s)

    def _track(self, holder: Holder) -> None:
        """Registered while it holds anything (device blocks, or host blocks)."""
        if holder.blocks or getattr(holder, "host_blocks", ()):
            self._holders[id(holder)] = holder
        else:
            self._holders.pop(id(holder), None)

    # ---- any holder ----------------------------------------------------------------------

    def allocate_slots(self, holder: Holder, num_blocks: int) -> None:
        """Append `num_blocks` fresh blocks (CacheFullError, nothing changed, if short)."""
        if num_blocks > 0:
            self._set(holder, holder.blocks + tuple(self.pool.allocate(num_blocks)))

    def attach(self, holder: Holder, blocks: Sequence[Block]) -> None:
        """Take a new reference on each of `blocks` (prefix hits, a fork's shared KV) and
        append them to the holder's table."""
        self.pool.touch(blocks)
        self._set(holder, holder.blocks + tuple(blocks))

    def stage(self, holder: Holder, targets: Sequence[Block | None]) -> set[Block]:
        """Fill an empty holder's table in the order of `targets`: a block is re-referenced
        where one is given (touched first, so the allocation cannot evict it), a fresh block
        is allocated where None. All or nothing. Returns the fresh blocks."""
        table, fresh = _fill(self.pool, targets, "KV blocks")
        self._set(holder, table)
        return fresh

    def release(self, holder: Holder) -> None:
        """Drop every reference the holder has (tail first)."""
        self.pool.free(holder.blocks)
        self._set(holder, ())

    def truncate(self, holder: Holder, num_blocks: int) -> None:
        """Keep the first `num_blocks` blocks, release the rest."""
        self.pool.free(holder.blocks[num_blocks:])
        self._set(holder, holder.blocks[:num_blocks])

    def transfer(self, src: Holder, dst: Holder, num_blocks: int | None = None) -> None:
        """Move the first `num_blocks` (default all) of src's references onto the end of
        dst's table; src's other blocks are released. No reference count changes hands."""
        n = len(src.blocks) if num_blocks is None else num_blocks
        moved, rest = src.blocks[:n], src.blocks[n:]
        self.pool.free(rest)
        self._set(src, ())
        self._set(dst, dst.blocks + moved)

    def fork(self, src: Holder, dst: Holder, num_tokens: int) -> bool:
        """n > 1 completions: `dst` (holding nothing) continues from the KV of `src`'s first
        `num_tokens` tokens. It takes a reference on each full block and gets its own copy
        of a partial last block (both will write their next token into it). False, nothing
        changed, when no block is free for that copy."""
        bs = self.block_size
        num_full, partial = divmod(num_tokens, bs)
        if partial and not self.pool.num_free:
            return False
        self.attach(dst, src.blocks[:num_full])
        if partial:
            (fresh,) = self.pool.allocate(1)
            self.kv_pool.copy_block(src.blocks[num_full].block_id, fresh.block_id)
            self._set(dst, dst.blocks + (fresh,))
        return True

    def retarget_to_indexed(self, holder: Holder, hashes: Sequence[bytes],
                            token_ids: Sequence[int]) -> None:
        """Replace the holder's table by the indexed copy of each of its first
        len(hashes) full blocks (publishing the ones not indexed yet). A recomputed
        duplicate of cached content is not what lookups find, so a pin must hold the
        indexed copy. A block whose hash indexes other tokens (a collision) stays as is."""
        bs = self.block_size
        indexed = []
        for i, h in enumerate(hashes):
            tokens = token_ids[i * bs:(i + 1) * bs]
            self.pool.cache_full_block(holder.blocks[i], h, tokens, hashes[i - 1] if i else None)
            indexed.append(self.pool.lookup(h, tokens) or holder.blocks[i])
        self.pool.touch(indexed)
        self.pool.free(holder.blocks)
        self._set(holder, indexed)

    # ---- sessions ------------------------------------------------------------------------

    def checkin(self, s: SessionKV, seq: Holder, tokens: Sequence[int],
                hashes: Sequence[bytes]) -> None:
        """After a turn: the session keeps the blocks of `tokens` (the turn's computed
        tokens) from the sequence's table; the sequence's other blocks are released."""
        self.transfer(seq, s, blocks_for(len(tokens), self.block_size))
        s.tokens, s.hashes = tuple(tokens), tuple(hashes)
        self._set_host(s, ())
        s.tier = Tier.DEVICE

    def checkout(self, s: SessionKV, seq: Holder, num_tokens: int) -> int:
        """Before a turn: hand the session's references on the KV of its first
        `num_tokens` tokens to `seq` (which holds nothing yet) and release the rest. A
        partial last block is written in place only if nothing else can see it (one
        reference, not published); otherwise it is copied first (copy-on-write), or
        dropped and recomputed when no block is free. The session is left empty. Returns
        the number of tokens whose KV `seq` now holds."""
        bs = self.block_size
        num_full = num_tokens // bs
        valid = num_full * bs
        self.truncate(s, blocks_for(num_tokens, bs))
        if num_tokens % bs and len(s.blocks) > num_full:
            tail = s.blocks[num_full]
            if tail.ref_cnt == 1 and tail.block_hash is None:
                valid = num_tokens
            elif self.pool.num_free:
                (fresh,) = self.pool.allocate(1)
                self.kv_pool.copy_block(tail.block_id, fresh.block_id)
                self.pool.free([tail])  # the session's reference on the shared tail
                self._set(s, s.blocks[:num_full] + (fresh,))
                valid = num_tokens
            else:
                self.truncate(s, num_full)
        self.transfer(s, seq, blocks_for(valid, bs))
        s.tokens, s.hashes = (), ()
        return valid

    def share(self, parent: SessionKV, child: SessionKV) -> None:
        """Fork: the child takes its own reference on every block of the parent."""
        self.attach(child, parent.blocks)
        child.tokens, child.hashes = parent.tokens, parent.hashes
        child.tier = Tier.DEVICE

    # ---- the host tier ---------------------------------------------------------------------

    def stage_host(self, holder: SessionKV | HostTransient,
                   targets: Sequence[Block | None]) -> set[Block]:
        """Fill an empty host table in the order of `targets`: a host block is referenced
        where one is given (content already on the host: a prefix another session spilled,
        a block the device evicted), a fresh one allocated where None (its cached content,
        if any, evicted). All or nothing (CacheFullError when the host tier is short).
        Returns the fresh blocks (the caller copies into them, then publishes them)."""
        if holder.host_blocks:
            raise RuntimeError("stage_host: the holder already holds host blocks")
        table, fresh = _fill(self.host, targets, "host tier blocks")
        self._set_host(holder, table)
        return fresh

    def release_host(self, holder: SessionKV | HostTransient) -> None:
        """Drop every host reference the holder has (their content stays cached)."""
        self._set_host(holder, ())

    def spill_to_host(self, s: SessionKV, num_lead: int, copy_cost: float = 1.0) -> None:
        """The private blocks (after the pinned lead) were copied to the host blocks the
        session staged (`stage_host`); reloading them costs `copy_cost` of a recompute
        (the eviction order uses it)."""
        self.pool.note_copy(s.blocks[num_lead:], Tier.HOST.value, copy_cost)
        self.truncate(s, num_lead)
        s.tier = Tier.HOST

    def spill_to_disk(self, s: SessionKV, num_lead: int, path: Path,
                      copy_cost: float = 1.0) -> None:
        """The whole KV is in `path`: the session lets go of its device blocks after the
        pinned lead and of its host blocks (their content stays cached there)."""
        self.pool.note_copy(s.blocks[num_lead:], Tier.DISK.value, copy_cost)
        self.truncate(s, num_lead)
        s.disk_path, s.tier = path, Tier.DISK
        self._set_host(s, ())

    def drop(self, s: SessionKV, num_lead: int) -> None:
        """Forget everything after the first `num_lead` device blocks (the next turn
        recomputes it)."""
        self.truncate(s, num_lead)
        s.tier = Tier.DEVICE
        s.tokens, s.hashes = s.tokens[: num_lead * self.block_size], s.hashes[:num_lead]
        self._set_host(s, ())

    def loaded(self, s: SessionKV, staged: Transient) -> None:
        """The blocks in `staged` now hold the spilled part of the session: append them
        (its host blocks are let go: their content stays cached there)."""
        self.transfer(staged, s)
        s.tier = Tier.DEVICE
        self._set_host(s, ())

    def on_disk(self, s: SessionKV, tokens: Sequence[int], hashes: Sequence[bytes],
                path: Path) -> None:
        """A session restored from a snapshot whose KV is (still) only in `path`."""
        s.tokens, s.hashes, s.disk_path, s.tier = tuple(tokens), tuple(hashes), path, Tier.DISK

    def forget(self, s: SessionKV) -> None:
        """Release everything (device and host references)."""
        self.release(s)
        s.tokens, s.hashes, s.tier, s.disk_path = (), (), Tier.DEVICE, None
        self._set_host(s, ())

    # ---- integrity -----------------------------------------------------------------------

    def holders(self) -> list[tuple[HolderKind, list[int]]]:
        """(kind, block ids) of every holder with a non-empty table (tests, debugging)."""
        return [(h.holder_kind, [b.block_id for b in h.blocks])
                for h in self._holders.values()]

    def num_held(self, kind: HolderKind) -> int:
        """References held by holders of `kind`."""
        return sum(len(h.blocks) for h in self._holders.values() if h.holder_kind is kind)

    def check_integrity(self, host_max_blocks: int | None = None) -> None:
        """Raise AssertionError unless both pools are consistent and every reference, on
        the device and on the host, is accounted to a holder. O(blocks). `host_max_blocks`:
        the host pool only while it has created at most that many blocks."""
        self.pool.check_integrity()
        holders = list(self._holders.values())
        _check_refs(self.pool, [(h, h.blocks) for h in holders], "")
        if self.host is not None and (host_max_blocks is None
                                      or len(self.host.blocks) <= host_max_blocks):
            self.host.check_integrity()
            _check_refs(self.host, [(h, getattr(h, "host_blocks", ())) for h in holders],
                        "host ")


def _fill(pool: BlockPool, targets: Sequence[Block | None],
          what: str) -> tuple[list[Block], set[Block]]:
    """A table in the order of `targets`: each given block referenced (touched first, so
    the allocation cannot evict it), a fresh one allocated for each None. All or nothing
    (CacheFullError naming `what`). Returns (the table, its fresh blocks)."""
    hits = [b for b in targets if b is not None]
    num_fresh = len(targets) - len(hits)
    revived = sum(1 for b in hits if b.ref_cnt == 0)  # they leave the free queue
    if num_fresh + revived > pool.num_free:
        raise CacheFullError(f"asked for {num_fresh} {what} (+{revived} cached ones "
                             f"revived), {pool.num_free} free")
    pool.touch(hits)
    fresh = iter(pool.allocate(num_fresh))
    table = [b if b is not None else next(fresh) for b in targets]
    return table, {b for b, t in zip(table, targets, strict=True) if t is None}


def _check_refs(pool: BlockPool, tables: list[tuple[Holder, tuple[Block, ...]]],
                tier: str) -> None:
    """Every block's ref_cnt equals the references in all holders' tables."""
    counts: Counter[int] = Counter()
    for _, t in tables:
        counts.update(b.block_id for b in t)
    for b in pool.blocks:
        if counts[b.block_id] != b.ref_cnt:
            held_by = [h.holder_kind.value for h, t in tables if b in t]
            raise AssertionError(f"{tier}{b}: ref_cnt {b.ref_cnt} but holders hold "
                                 f"{counts[b.block_id]} reference(s) ({held_by})")
