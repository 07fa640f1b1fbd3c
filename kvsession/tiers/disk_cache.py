"""The disk tier's cache: KV blocks of any request in one file under session_dir, found by
their chained hash and verified token by token, as on the device and the host.

What it holds: content the host tier overwrites (or the device pool, without a host tier)
that had been used more than once (`TierPolicy` admits it: a block computed for one
request and never reused is not worth a disk write). Sessions' own files (their log,
segments, snapshots) are data, not cache: they are never in here and never evicted to
meet the budget, `disk_cache_memory`.

The file, `.blocks.kvc`, is a row of fixed-size slots; slot i holds block i of `index`, a
growing `BlockPool` (ref counts, the hash index, a free queue that evicts the coldest
leaves first by the cost rule), so the cache's bookkeeping is the device pool's. A slot is
one block's record (tiers/block_record.py: a header naming the block, its tokens and
checksums, then the payload), padded:

    [ header ][ payload ][ pad ]
    |<-- slot_bytes (a multiple of 4 KiB) -->|

The file is self-describing, so the cache outlives the process: at
start-up the headers are read back and every intact one is published again (a torn write
leaves a header whose checksum fails, or a payload whose checksum fails when it is read:
either is a miss, never wrong KV). A crash loses cache blocks at most.

Bookkeeping runs on the engine thread; a load's reads (`load`) may run on the copier, into
slots the engine thread holds for it (`hold`), and so may the payload writes of slots it
reserved (`reserve`, `write`), whose headers it writes once the source is known to have
been intact (`commit`): a slot is found only after its commit. One process owns the file
at a time (an flock on `.blocks.lock`); another process on the same directory runs without
a disk cache.
"""

from __future__ import annotations

import logging
import os
import threading
from collections import Counter
from pathlib import Path

import torch

from kvsession.cache.block_pool import Block, BlockPool
from kvsession.cache.eviction import EvictionPolicy, Order
from kvsession.tiers.block_record import BlockRecords, RecordHeader
from kvsession.tiers.locks import FileLock

log = logging.getLogger("kvsession")
CACHE_NAME = ".blocks.kvc"
CACHE_LOCK_NAME = ".blocks.lock"
SLOT_ALIGN_BYTES = 4096


class DiskCacheBusy(Exception):
    """Another process owns the directory's disk cache."""


class DiskCache:
    def __init__(self, root: Path, tensors: dict[str, torch.Tensor], block_size: int,
                 identity_fields: dict, budget_bytes: int):
        """tensors: the device pool's KV tensors ([num_layers, num_blocks, *block] each),
        whose geometry every slot's payload has. identity_fields: what stored KV is valid
        under (StorageIdentity.header_fields); a slot written under another identity is
        never published. budget_bytes: the file's largest size (`disk_cache_memory`),
        headers and padding included. Raises DiskCacheBusy when another process holds the
        cache."""
        self.root, self.block_size = Path(root), block_size
        self.lock = FileLock(self.root / CACHE_LOCK_NAME)
        if not self.lock.try_acquire():
            raise DiskCacheBusy(f"{self.root / CACHE_NAME} is in use by another process")
        self.path = self.root / CACHE_NAME
        self.records = BlockRecords(tensors, block_size, identity_fields)
        self.payload_bytes = self.records.payload_bytes
        self.header_bytes = self.records.header_bytes
        used = self.records.record_bytes
        self.slot_bytes = -(-used // SLOT_ALIGN_BYTES) * SLOT_ALIGN_BYTES
        self.num_blocks = num_blocks = budget_bytes // self.slot_bytes
        self.index = BlockPool(num_blocks, block_size, True, EvictionPolicy.COST,
                               (Order.RECENCY,), grow=True)
        # counters (llm.stats().tiers["disk"]): tokens found here, bytes moved (loads run on
        # the copier and on the engine thread)
        self._count = threading.Lock()
        self.hit_tokens = self.bytes_read = self.bytes_written = 0
        # references taken by loads and writes in flight (`hold` / `reserve`, `release`):
        # check_integrity's accounting; nothing else references a slot
        self._held: Counter[int] = Counter()
        try:
            self.fd = os.open(self.path, os.O_RDWR | os.O_CREAT | getattr(os, "O_CLOEXEC", 0),
                              0o644)
        except OSError:
            self.lock.release()
            raise
        self.recovered_blocks = self._recover()

    def close(self) -> None:
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None
            self.lock.release()

    # ---- start-up ------------------------------------------------------------------------

    def _recover(self) -> int:
        """Publish every intact slot of the file left by an earlier process (up to this
        budget: the file is cut there); returns how many. Parents are published before
        their children, so the chains (and leaf-first eviction) are rebuilt."""
        size = os.fstat(self.fd).st_size
        # (the last slot may end at its payload: the padding after it is never written)
        n = min(-(-size // self.slot_bytes), self.num_blocks)
        if size > n * self.slot_bytes:
            os.ftruncate(self.fd, n * self.slot_bytes)
        if n == 0:
            return 0
        found = []
        for i in range(n):
            meta = self.records.read_header(os.pread(self.fd, self.header_bytes,
                                                     i * self.slot_bytes))
            if meta is not None:
                found.append((meta.depth, i, meta))
        slots = self.index.allocate(n)  # a fresh growing pool hands out ids 0..n-1 in order
        for _, i, meta in sorted(found, key=_by_depth):
            self.index.cache_full_block(slots[i], meta.block_hash, meta.token_ids,
                                        meta.parent_hash, meta.hits)
        self.index.free(slots)
        if found:
            log.info("disk cache %s: %d blocks from an earlier run", self.path, len(found))
        return len(found)

    # ---- slots ---------------------------------------------------------------------------

    def has(self, block_hash: bytes) -> bool:
        """Whether the cache holds content under `block_hash`."""
        return block_hash in self.index.index

    def store(self, src: dict[str, torch.Tensor], entries: list[tuple[int, bytes, tuple,
                                                                       bytes | None, int]]) -> int:
        """Write blocks into cache slots and publish them, on this thread: entries are
        (block id in `src`, hash, token ids, parent hash, hits), `src` tensors laid out as
        the pool's. Content already here is skipped; the cache's own coldest blocks make
        room, and at most its unreferenced blocks are used. Returns the number of blocks
        written. A failed write (disk full) leaves that slot, and the ones after it,
        unpublished."""
        new = [e for e in entries if self.index.lookup(e[1], e[2]) is None]
        slots = self.reserve(len(new))
        new = new[:len(slots)]  # (no room for the rest: the first ones go)
        written = 0
        try:
            crcs = self.write(src, slots, [e[0] for e in new])
            for slot, (_, block_hash, tokens, parent, hits), crc in zip(slots, new, crcs,
                                                                        strict=False):
                written += self.commit(slot, block_hash, tokens, parent, hits, crc)
        finally:
            self.release(slots)  # published ones stay cached, the rest are reused first
        return written

    def reserve(self, num_blocks: int) -> list[Block]:
        """Engine thread: up to `num_blocks` slots to write (at most the unreferenced ones;
        the cache's own coldest content makes room), held until `release`."""
        slots = self.index.allocate(min(num_blocks, self.index.num_free)) if num_blocks else []
        self._held.update(b.block_id for b in slots)
        return slots

    def write(self, src: dict[str, torch.Tensor], slots: list[Block],
              src_ids: list[int]) -> list[int]:
        """Any thread (the copier's, for copies ahead of eviction): block src_ids[i] of
        `src` (tensors laid out as the pool's) into reserved slot i, its header left
        invalid until `commit` (so a slot whose source changed while it was read, or whose
        commit a crash prevented, is never found, not even by the next process). Returns
        each slot's payload crc32, up to the first failed write (disk full: logged)."""
        crcs = []
        blank = bytes(self.header_bytes)
        for slot, src_id in zip(slots, src_ids, strict=True):
            payload, crc = self.records.payload(src, src_id)
            try:
                n = os.pwritev(self.fd, [blank, *payload], slot.block_id * self.slot_bytes)
                if n != self.header_bytes + self.payload_bytes:
                    raise OSError(f"short write to {self.path}: {n} bytes")
            except OSError as e:
                log.warning("disk cache %s: %s; %d of %d blocks kept", self.path, e,
                            len(crcs), len(slots))
                break
            with self._count:
                self.bytes_written += n
            crcs.append(crc)
        return crcs

    def commit(self, slot: Block, block_hash: bytes, tokens, parent: bytes | None,
               hits: int, payload_crc: int) -> bool:
        """Engine thread: a written slot's header (valid from now on, to the next process
        too) and the block published. False when the header cannot be written (the slot
        stays unpublished)."""
        depth = 0 if parent is None else self._depth_after(parent)
        header = self.records.header(block_hash, parent, tokens, depth, hits, payload_crc)
        try:
            os.pwrite(self.fd, header, slot.block_id * self.slot_bytes)
        except OSError as e:
            log.warning("disk cache %s: %s", self.path, e)
            return False
        self.index.cache_full_block(slot, block_hash, tokens, parent, hits)
        return True

    def _depth_after(self, parent: bytes) -> int:
        b = self.index.index.get(parent)
        return b.evict.depth + 1 if b is not None else 0

    def load(self, slots: list[Block], dst: dict[str, torch.Tensor],
             dst_ids: list[int]) -> int:
        """Read cache blocks `slots` (referenced by the caller) into blocks `dst_ids` of
        `dst`, each checked (header, hash, tokens, payload checksum) before its bytes are
        used. Returns how many leading blocks were loaded: a damaged slot (a torn write, a
        changed file) stops the load there; the caller discards it (`index.discard`) once
        it has dropped its reference."""
        used = self.records.record_bytes
        buf = bytearray(used)
        for j, (slot, dst_id) in enumerate(zip(slots, dst_ids, strict=True)):
            try:
                n = os.preadv(self.fd, [buf], slot.block_id * self.slot_bytes)
            except OSError as e:
                log.warning("disk cache %s: %s", self.path, e)
                return j
            payload = self.records.check(buf, slot.block_hash, slot.token_ids) \
                if n == used else None
            if payload is None:
                log.warning("disk cache %s: slot %d is damaged; recomputing from there",
                            self.path, slot.block_id)
                return j
            # (the buffer is reused by the next block: copied synchronously)
            self.records.copy_into(payload, dst, dst_id)
            with self._count:
                self.bytes_read += used
                self.hit_tokens += self.block_size
        return len(slots)

    def hold(self, slots: list[Block]) -> None:
        """Engine thread: reference `slots` while a load reads them (the cache's own
        evictions cannot take them)."""
        self.index.touch(slots)
        self._held.update(b.block_id for b in slots)

    def release(self, slots: list[Block], damaged: Block | None = None) -> None:
        """Engine thread: the load (or the write) is done with `slots` (held or reserved);
        `damaged` (one of them) is discarded: found by nobody again. A reserved slot never
        committed holds no content: it is reused first."""
        self.index.free(slots)
        self._held.subtract(b.block_id for b in slots)
        self._held += Counter()  # drop the zero counts
        if damaged is not None:
            self.index.discard(damaged)

    def check_integrity(self, max_blocks: int | None = None) -> None:
        """The index's invariants, and every reference is a load's or a write's (`hold`,
        `reserve`). `max_blocks`:
        only while it has created at most that many blocks."""
        if max_blocks is not None and len(self.index.blocks) > max_blocks:
            return
        self.index.check_integrity()
        for b in self.index.blocks:
            if b.ref_cnt != self._held[b.block_id]:
                raise AssertionError(f"disk cache {b}: ref_cnt {b.ref_cnt}, held by copies "
                                     f"{self._held[b.block_id]}")



def _by_depth(found: tuple[int, int, RecordHeader]) -> tuple[int, int]:
    """Parents (shallower) first, then by slot."""
    return found[0], found[1]
