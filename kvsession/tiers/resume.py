"""Which KV blocks on disk a resumed session can reuse (its `DiskPlan`).

The session's log says which tokens it holds. KV blocks on disk (the session's snapshot,
its write-behind segment, the directory's shared prefix store) are matched to those
tokens block by block, from the first block on: block i is reusable from a file only when
the file's tokens of blocks 0..i equal the log's (the KV of a position depends on every
token before it), so the plan covers a prefix of the log's tokens and the first turn
recomputes only the rest. The partial last block (the tokens after the last full one) is
reused from the snapshot that holds it, or from a tail record of the segment (keyed by the
chained hash before it and its tokens: segments.segment_tail), so a resumed session
computes only its new message. Hashes are recomputed from the log's tokens by the caller, never
read from a file. Nothing of the session's own KV is loaded here: the tier policy decides
at the first turn whether loading beats recomputing (costmodel.should_load), and the mover
copies.

The one exception is a pinned system prompt (`warm_prefix`): a resumed session pins it
again before its plan exists, and the pin would prefill it. Its blocks are loaded from the
shared prefix store into the device's prefix cache first (when loading beats recomputing),
so the pin finds them there and computes at most its last, partial block.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path

from kvsession import costmodel
from kvsession.cache.identity import StorageIdentity
from kvsession.cache.manager import Tier, Transient
from kvsession.errors import CacheFullError, SnapshotError
from kvsession.tiers.segments import SegmentScan, scan_segment, segment_blocks, segment_tail
from kvsession.tiers.snapshot_format import SnapshotHeader, snapshot_prefix
from kvsession.tiers.snapshot_read import read_header
from kvsession.tiers.wal import truncate

log = logging.getLogger("kvsession")


@dataclass
class DiskPlan:
    """tokens: the prefix of the log's tokens whose KV is on disk; hashes: their full
    blocks' chained hashes (recomputed); sources[i]: (file, its header, chunk index) of
    block i; path: the session's log (the disk tier's record of where the session is)."""

    tokens: tuple[int, ...]
    hashes: tuple[bytes, ...]
    sources: list[tuple[Path, SnapshotHeader, int]]
    path: Path
    from_files: dict[str, int] = field(default_factory=dict)  # blocks per kind of file


def open_segment(disk, session_id: str, identity: StorageIdentity) -> SegmentScan | None:
    """The session's segment, its torn tail cut off (the caller owns the session); None
    when there is none or it is not usable (another engine's, damaged: a warning; the
    write-behind replaces it)."""
    path = disk.segment_path(session_id)
    if not path.is_file():
        return None
    try:
        scan = scan_segment(path, identity, session_id)
        if scan.torn:
            truncate(path, scan.end)
        return scan
    except SnapshotError as e:
        log.warning("%s; its blocks will be recomputed", e)
        return None


def open_shared(disk, identity: StorageIdentity) -> SegmentScan | None:
    """The directory's shared prefix store as it is now (another process may be appending
    under the directory lock: a record it has not finished reads as a torn tail and is
    simply not used; only the lock holder ever cuts it)."""
    path = disk.shared_path()
    if not path.is_file():
        return None
    try:
        return scan_segment(path, identity, "shared")
    except SnapshotError as e:
        log.warning("%s; shared prefix blocks will be recomputed", e)
        return None


def build_plan(disk, session_id: str, tokens, hashes, identity: StorageIdentity,
               segment: SegmentScan | None = None, shared: SegmentScan | None = None
               ) -> DiskPlan | None:
    """The blocks of `tokens` (the log's) found on disk, as a prefix: the session's
    snapshot first, then its segment or the shared prefix store, block by block, then the
    partial last block (the snapshot's, or a tail record of the segment); None when
    there are none. A file that is damaged or written by another engine contributes
    nothing (a warning): its blocks are recomputed."""
    bs = identity.block_size
    tokens = list(tokens)
    sources: list[tuple[Path, SnapshotHeader, int]] = []
    covered = 0
    kinds: dict[str, int] = {}
    kvs = disk.path_for(session_id)
    if kvs.is_file():
        try:
            h = read_header(kvs, expect=identity)
        except SnapshotError as e:
            log.warning("%s; its KV will be recomputed", e)
        else:
            covered = snapshot_prefix(h, tokens, bs)
            n = -(-covered // bs)
            sources = [(kvs, h, i) for i in range(n)]
            kinds["snapshot"] = n
    stores = [(segment, disk.segment_path(session_id))] if segment is not None else []
    if shared is not None:
        stores.append((shared, disk.shared_path()))
    if stores and covered % bs == 0:
        more = segment_blocks(stores, covered // bs, tokens, hashes, bs)
        for path, _, _ in more:
            kind = "shared" if path == disk.shared_path() else "segment"
            kinds[kind] = kinds.get(kind, 0) + 1
        sources += more
        covered += len(more) * bs
    if segment is not None and covered and covered == len(hashes) * bs < len(tokens):
        # every full block found: the partial last block, when the segment holds it
        tail = segment_tail(segment, disk.segment_path(session_id), covered // bs, tokens,
                            hashes[-1], bs)
        if tail is not None:
            sources.append(tail[0])
            kinds["segment"] = kinds.get("segment", 0) + 1
            covered += tail[1]
    if not covered:
        return None
    return DiskPlan(tuple(tokens[:covered]), tuple(hashes[: covered // bs]), sources,
                    disk.log_path(session_id), kinds)


def warm_prefix(mover, shared: SegmentScan, path: Path, tokens, hashes) -> int:
    """Engine thread: the full blocks of `tokens` (a system prompt about to be pinned; its
    chained `hashes`, recomputed by the caller) that the shared prefix store `shared` at
    `path` holds, as a prefix, loaded into free device blocks and published in the prefix
    cache, unreferenced (cached, like blocks a finished request leaves): the pin that
    follows finds them instead of computing them. Blocks already cached are left as they
    are; nothing is loaded when recomputing is cheaper (the cost model) or the device has
    no free block for them. Returns the blocks read from the file. A damaged chunk is a
    SnapshotError and leaves nothing behind (the pin then computes)."""
    bs = mover.bs
    tokens = list(tokens)
    sources = segment_blocks([(shared, path)], 0, tokens, hashes, bs)
    if not sources:
        return 0
    pool, manager = mover.pool, mover.manager
    n = len(sources)
    targets = [pool.lookup(hashes[i], tokens[i * bs:(i + 1) * bs]) for i in range(n)]
    missing = sum(1 for t in targets if t is None)
    if not missing:
        return 0
    if mover.prefill_tps is not None:
        block_bytes = sum(t[:, :1].numel() * t.element_size()
                          for t in mover.kv_pool.tensors().values())
        if not costmodel.should_load(missing * bs, block_bytes / bs,
                                     mover.bandwidth(Tier.DISK), mover.prefill_tps.value):
            return 0
    staged = Transient()
    try:
        fresh = manager.stage(staged, targets)
    except CacheFullError:
        return 0
    try:
        wanted = [(sources[i][2], b) for i, b in enumerate(staged.blocks) if b in fresh]
        mover.load_file_blocks(path, wanted, shared.header)
        manager.retarget_to_indexed(staged, hashes[:n], tokens)
    finally:
        manager.release(staged)
    return len(wanted)
