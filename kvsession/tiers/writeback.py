"""Write-behind of session KV (durability="turn"): full blocks go to disk off the engine's
critical path.

After a turn the engine thread hands over the session's new full blocks (`after_turn`):
one gather per KV tensor into CPU memory (the blocks stay the session's; the copy is what
is written), counted against a byte bound. Past the bound nothing more is queued (counted
in `dropped`): the blocks are offered again after the session's next turn, and a crash
meanwhile only costs their recompute. A writer thread appends them to the session's segment
(tiers/segments.py) and compacts a segment that fragments. Nothing here is ever waited for
by a decode step; the session log (tiers/commit.py), not this, is what makes a turn
durable.

Syncing: a segment is fdatasynced once SYNC_BYTES are written to it since its last sync,
once the writer has had nothing to do for IDLE_SYNC_S, and when a request asks (flush,
close, compaction). Not after every job: on ext4 each fdatasync commits the journal, and
the session logs' fdatasyncs (which a turn waits for) queue behind those commits. Blocks
not yet synced survive a process crash (they are in the page cache); after a power loss
they are a torn or missing tail, cut off at resume and recomputed.

A block is identified by (position, chained hash): one already on disk (queued, in the
segment, or in the session's snapshot) is never written again. A session's leading pinned
blocks (a shared system prompt) go to the directory's shared prefix store instead
(`.shared.seg`, the same format), once per directory whichever session or process meets
them first: appends to it are made under the directory lock, after reading what other
processes appended since.

Requests that must follow a session's queued blocks (flush, close, delete, seed) go through
the same queue, so they see every block handed over before them. Snapshot files of a
session are written by the engine thread (spill, save) and by compaction here; a
per-session lock (`SnapshotLocks`) orders the two.
"""

from __future__ import annotations

import contextlib
import enum
import logging
import os
import queue
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path

import lz4.frame
import torch

from kvsession.cache.hashing import tail_key
from kvsession.cache.identity import StorageIdentity
from kvsession.cache.manager import SessionKV
from kvsession.cache.prefix import common_prefix_len
from kvsession.errors import SnapshotError
from kvsession.tiers.checksum import crc32
from kvsession.tiers.direct_io import Aligned, AlignedAppender, open_for_append
from kvsession.tiers.locks import directory_lock
from kvsession.tiers.segments import (
    ALIGN_BYTES,
    BlockMeta,
    SegmentScan,
    aligning_gap,
    compact,
    compaction_sources,
    encode_record,
    identity_of,
    pseudo_header,
    scan_segment,
    start_bytes,
)
from kvsession.tiers.snapshot import MIN_LZ4_SAVING, encode_block
from kvsession.tiers.snapshot_format import Chunk
from kvsession.tiers.staging import StagingBuffers
from kvsession.tiers.wal import Identity, read_log

log = logging.getLogger("kvsession")
# how long close() waits for the writer to drain (every wait is bounded)
CLOSE_TIMEOUT_S = 120.0


class SnapshotLocks:
    """One lock per session id, held while that session's snapshot file is written (spill
    and save on the engine thread, compaction on the writer thread)."""

    def __init__(self):
        self._locks: dict[str, threading.Lock] = {}
        self._guard = threading.Lock()

    def get(self, session_id: str) -> threading.Lock:
        with self._guard:
            return self._locks.setdefault(session_id, threading.Lock())


@dataclass
class _Blocks:
    session_id: str
    indices: list[int]  # the session's segment
    shared: list[int]  # the shared prefix store
    tokens: tuple[int, ...]
    hashes: tuple[bytes, ...]
    data: dict[str, torch.Tensor]  # name -> [blocks, num_layers, ...] on the CPU
    nbytes: int
    buffers: list[torch.Tensor] = field(default_factory=list)  # behind data (staging)
    tail: bytes | None = None  # key of the partial last block (index len(hashes))

    def key(self, i: int) -> bytes:
        return self.hashes[i] if i < len(self.hashes) else self.tail


class WriteOp(enum.Enum):
    """Requests that follow a session's queued blocks through the writer's queue."""

    FLUSH = "flush"    # fdatasync (session_id None: every segment)
    CLOSE = "close"    # finish its blocks, release the file
    DELETE = "delete"  # remove its segment (its queued blocks are written first, then gone)
    SEED = "seed"      # a resumed session's existing segment: appended to, blocks known


@dataclass
class _Request:
    kind: WriteOp
    session_id: str | None
    future: Future
    scan: SegmentScan | None = None


@dataclass
class _Segment:
    """The writer's view of one session's segment."""

    path: Path
    fd: int | None = None
    end: int = 0
    chunks: list[Chunk] = field(default_factory=list)
    metas: list[BlockMeta] = field(default_factory=list)
    codec: str = "lz4"
    unsynced: int = 0
    tokens: tuple[int, ...] = ()
    hashes: tuple[bytes, ...] = ()
    tail: bytes | None = None

    def scan(self, identity: StorageIdentity, session_id: str) -> SegmentScan:
        ident = identity_of(identity)
        return SegmentScan(pseudo_header(ident, session_id, list(self.chunks)),
                           list(self.metas), self.end, self.end)

    def stale(self) -> int:
        """Records no longer on the session's chain (blocks of a history it left)."""
        live = {(i, h) for i, h in enumerate(self.hashes)} | {(len(self.hashes), self.tail)}
        return sum(1 for m in self.metas if (m.index, m.hash) not in live)


class WriteBehind:
    MAX_QUEUED_BYTES = 256 << 20
    SYNC_BYTES = 64 << 20
    IDLE_SYNC_S = 1.0
    # compaction: a segment with at least this many stale records, and more stale than
    # live ones, or with more than COMPACT_RECORDS records
    COMPACT_STALE = 32
    COMPACT_RECORDS = 4096
    # free space left alone: KV on disk is a cache, the session logs are not, and a disk
    # filled by write-behind would refuse the next turn's log record
    RESERVE_BYTES = 64 << 20

    def __init__(self, disk, identity: StorageIdentity, snapshot_locks: SnapshotLocks):
        self.disk, self.identity = disk, identity
        self.header_fields = identity.header_fields()  # what a compacted snapshot holds
        self.bs = identity.block_size
        self.locks = snapshot_locks
        self._start = start_bytes(identity_of(identity))
        self._identity = Identity(**identity.log_fields())
        self._io = AlignedAppender()  # the writer thread's (segments go out with O_DIRECT)
        self._q: queue.Queue = queue.Queue()
        self._guard = threading.Lock()
        self._queued_bytes = 0
        self.staging = StagingBuffers(self.MAX_QUEUED_BYTES)
        self._known: dict[str, set[tuple[int, bytes]]] = {}
        self._segs: dict[str, _Segment] = {}  # writer thread only
        self._shared_known: set[tuple[int, bytes]] = set()
        self.shared: SegmentScan | None = None  # the shared store as last read (writer)
        self.shared_blocks_written = 0
        # counters (stats, benchmark)
        self.blocks_written = self.bytes_written = self.dropped = self.compactions = 0
        self.syncs = 0  # fdatasyncs of segments
        self.busy_s = 0.0
        self.cpu_s = 0.0  # the writer thread's CPU time (busy_s also counts waits on I/O)
        self.gather_s = 0.0  # on the engine thread: the only part of write-behind there
        self._thread = threading.Thread(target=self._run, name="kvsession-writeback",
                                        daemon=True)
        self._thread.start()

    # ---- engine thread ---------------------------------------------------------------

    def after_turn(self, s: SessionKV, tensors: dict[str, torch.Tensor], shared: int = 0
                   ) -> None:
        """Queue the session's blocks that are not on disk yet (gathered now: the session
        keeps its blocks): its full blocks, and its partial last block as a tail record
        (so that a resumed session computes only its new message); its first `shared`
        blocks (pinned, shared by sessions) belong to the shared prefix store."""
        bs = self.bs
        n_full = min(len(s.tokens) // bs, len(s.hashes), len(s.blocks))
        shared = min(shared, n_full)
        n_tail = len(s.tokens) - n_full * bs
        tail = tail_key(s.hashes[n_full - 1], s.tokens[n_full * bs:]) \
            if 0 < n_tail < bs and n_full and len(s.blocks) == n_full + 1 else None
        with self._guard:
            known = self._known.setdefault(s.session_id, set())
            lead = [i for i in range(shared) if (i, s.hashes[i]) not in self._shared_known]
            new = [i for i in range(shared, n_full) if (i, s.hashes[i]) not in known]
            if tail is not None and (n_full, tail) not in known:
                new.append(n_full)
            block_bytes = sum(t[:, :1].numel() * t.element_size() for t in tensors.values())
            nbytes = (len(lead) + len(new)) * block_bytes
            if self._queued_bytes + nbytes > self.MAX_QUEUED_BYTES:
                self.dropped += len(lead) + len(new)
                lead, new, nbytes = [], [], 0
            self._queued_bytes += nbytes
            known.update((i, s.hashes[i] if i < n_full else tail) for i in new)
            self._shared_known.update((i, s.hashes[i]) for i in lead)
        data, buffers = {}, []
        t0 = time.perf_counter()
        if lead or new:
            ids = [s.blocks[i].block_id for i in lead + new]
            for name, t in tensors.items():
                # [n, num_layers, ...]: each block one contiguous tensor, gathered in one
                # pass (index_select over the block dimension of a transposed view) into a
                # reused CPU buffer (staging.py)
                raw = (t.view(torch.uint8) if t.element_size() == 1 else t).transpose(0, 1)
                out, buf = self.staging.take((len(ids), *raw.shape[1:]), raw.dtype)
                index = torch.tensor(ids, device=raw.device)
                if raw.device.type == "cpu":
                    torch.index_select(raw, 0, index, out=out)
                else:  # gathered on the device, then one copy to the host
                    out.copy_(raw.index_select(0, index))
                if new and new[-1] == n_full:  # the tail: its unused slots as zeros,
                    out[-1, :, n_tail:] = 0  # not what the block's last owner left there
                data[name] = out.view(t.dtype)
                buffers.append(buf)
        self.gather_s += time.perf_counter() - t0
        self._q.put(_Blocks(s.session_id, new, lead, s.tokens, s.hashes[:n_full], data,
                            nbytes, buffers, tail))

    # ---- any thread --------------------------------------------------------------------

    def request(self, kind: WriteOp, session_id: str | None,
                scan: SegmentScan | None = None) -> Future:
        """Queue a request (WriteOp); the Future resolves when the writer has served it."""
        fut: Future = Future()
        if kind is WriteOp.SEED and scan is not None:
            with self._guard:
                self._known.setdefault(session_id, set()).update(
                    (m.index, m.hash) for m in scan.metas)
        self._q.put(_Request(kind, session_id, fut, scan))
        return fut

    def know(self, session_id: str, blocks, shared: SegmentScan | None = None) -> None:
        """Blocks (position, hash) the session has on disk elsewhere (its snapshot), and
        what the shared prefix store holds."""
        with self._guard:
            self._known.setdefault(session_id, set()).update(blocks)
            if shared is not None:
                self._shared_known.update(shared.index)

    def close(self) -> None:
        fut = self.request(WriteOp.FLUSH, None)
        with contextlib.suppress(Exception):
            fut.result(timeout=CLOSE_TIMEOUT_S)
        self._q.put(None)
        self._thread.join(CLOSE_TIMEOUT_S)
        if not self._thread.is_alive():  # else it may still append: its pool stays
            self._io.close()

    # ---- the writer thread ---------------------------------------------------------------

    def _run(self) -> None:
        while True:
            try:
                job = self._q.get(timeout=self.IDLE_SYNC_S)
            except queue.Empty:  # idle: make what was written durable
                self._sync_all()
                continue
            if job is None:
                return
            cpu = time.thread_time()
            try:
                if isinstance(job, _Blocks):
                    self._write(job)
                else:
                    self._serve(job)
            except BaseException as e:  # never let the thread die: report, go on
                log.exception("write-behind: %s", e)
                if isinstance(job, _Request) and not job.future.done():
                    job.future.set_exception(e)
            self.cpu_s += time.thread_time() - cpu

    def _seg(self, sid: str) -> _Segment:
        seg = self._segs.get(sid)
        if seg is None:
            seg = self._segs[sid] = _Segment(self.disk.segment_path(sid))
        return self._open(seg)

    def _open(self, seg: _Segment) -> _Segment:
        if seg.fd is None:
            fd = open_for_append(seg.path)
            try:
                if not seg.end:  # a new segment (an old one of this name is replaced)
                    os.ftruncate(fd, 0)
                    seg.end = self._io.append(fd, [self._start], 0)
                    seg.chunks, seg.metas = [], []
                else:  # cut anything past what is known intact (a torn append)
                    os.ftruncate(fd, seg.end)
            except OSError:
                os.close(fd)
                raise
            seg.fd = fd
        return seg

    def _write(self, job: _Blocks) -> None:
        sid = job.session_id
        try:
            if (job.indices or job.shared) and not self._room_for(job):
                self.dropped += len(job.indices) + len(job.shared)
                with self._guard:
                    self._known.get(sid, set()).difference_update(
                        (i, job.key(i)) for i in job.indices)
                    self._shared_known.difference_update(
                        (i, job.hashes[i]) for i in job.shared)
            else:
                t0 = time.perf_counter()
                if job.shared:
                    self._write_shared(job)
                if job.indices:
                    self._append(self._seg(sid), [(i, j) for j, i in enumerate(
                        job.indices, start=len(job.shared))], job)
                self.busy_s += time.perf_counter() - t0
            seg = self._segs.get(sid)
            if seg is not None:
                seg.tokens, seg.hashes, seg.tail = job.tokens, job.hashes, job.tail
                stale = seg.stale()
                if (stale >= self.COMPACT_STALE and stale >= len(seg.metas) - stale) or \
                        len(seg.metas) > self.COMPACT_RECORDS:
                    self._compact(sid, seg)
        except OSError as e:
            log.warning("write-behind of session %s failed (%s); its blocks will be "
                        "recomputed after a crash", sid, e)
            self._drop_segment(sid)
        finally:
            with self._guard:
                self._queued_bytes -= job.nbytes
            job.data = {}  # written (or given up): its buffers serve the next gathers
            for buf in job.buffers:
                self.staging.give_back(buf)

    def _write_shared(self, job: _Blocks) -> None:
        """Append the job's shared prefix blocks to the directory's store, under the
        directory lock, skipping those another process (or session) already put there."""
        path = self.disk.shared_path()
        try:
            with directory_lock(self.disk.root):
                size = path.stat().st_size if path.exists() else 0
                if size and (self.shared is None or self.shared.size != size):
                    self.shared = scan_segment(path, self.identity, "shared")
                seg = _Segment(path)
                if size and self.shared is not None:
                    seg.end, seg.chunks, seg.metas = (
                        self.shared.end, list(self.shared.header.chunks),
                        list(self.shared.metas))
                seg = self._open(seg)
                try:
                    new = [(i, j) for j, i in enumerate(job.shared) if self.shared is None
                           or (i, job.hashes[i]) not in self.shared.index]
                    self._append(seg, new, job)
                    self.shared_blocks_written += len(new)
                    self._sync(seg)
                    self.shared = seg.scan(self.identity, "shared")
                    self.shared.size = seg.end
                finally:
                    self._close_fd(seg)
        except SnapshotError as e:  # not ours to fix (another engine's store): skip it
            log.warning("shared prefix store: %s", e)

    def _read_shared(self) -> SegmentScan | None:
        """The shared prefix store as it is now (read again when it grew): a compaction
        copies the session's leading blocks from it. A process that resumed its sessions
        has never written to it, and without it a compaction found no block 0 and dropped
        the whole segment. Read without the directory lock: a record another process has
        not finished reads as a torn tail and is not used."""
        path = self.disk.shared_path()
        try:
            size = path.stat().st_size
        except FileNotFoundError:
            return None
        if self.shared is None or self.shared.size != size:
            try:
                self.shared = scan_segment(path, self.identity, "shared")
            except SnapshotError as e:
                log.warning("shared prefix store: %s", e)
                return None
        return self.shared

    def _room_for(self, job: _Blocks) -> bool:
        try:
            st = os.statvfs(self.disk.root)
        except OSError:
            return True  # let the write itself report what is wrong
        return st.f_bavail * st.f_frsize >= self.RESERVE_BYTES + 2 * job.nbytes

    def _append(self, seg: _Segment, blocks: list[tuple[int, int]], job: _Blocks) -> None:
        """Append blocks (index in the session, position in job.data): large aligned
        writes (direct_io.py), each block encoded while the ones before it are written."""
        if not blocks:
            return
        staged = []

        def records():
            at = seg.end
            for i, j in blocks:
                meta, record, head = self._encode(seg, i, job, j, at)
                staged.append((meta, Chunk(at + head, meta.length, meta.raw_length,
                                           meta.crc32, meta.codec)))
                yield from record
                at += head + meta.length

        end = self._io.append(seg.fd, records(), seg.end)  # the records, then the padding
        for meta, chunk in staged:
            seg.chunks.append(chunk)
            seg.metas.append(meta)
        size = end - seg.end
        seg.end = end
        seg.unsynced += size
        self.blocks_written += len(staged)
        self.bytes_written += size
        if seg.unsynced >= self.SYNC_BYTES:
            self._sync(seg)

    def _encode(self, seg: _Segment, i: int, job: _Blocks, j: int, at: int):
        """Block i's record, written at file offset `at`: (meta, buffers, bytes before the
        chunk). Stored data of whole aligned pages (gathered into page-aligned staging) is
        placed on an aligned offset by the record's gap and written in place."""
        tensors = {n: x[j] for n, x in job.data.items()}
        pieces = encode_block(tensors)
        raw_len = sum(len(p) for p in pieces)
        data, codec = pieces, "none"
        if seg.codec == "lz4":  # as the snapshot writer decides: incompressible KV is stored
            comp = lz4.frame.compress(b"".join(pieces))
            if len(comp) <= (1 - MIN_LZ4_SAVING) * raw_len:
                data, codec = [comp], "lz4"
            else:
                seg.codec = "none"
        length, crc = sum(len(d) for d in data), 0
        for d in data:
            crc = crc32(d, crc)
        meta = BlockMeta(index=i, hash=job.key(i),
                         tokens=list(job.tokens[i * self.bs:(i + 1) * self.bs]),
                         length=length, raw_length=raw_len, crc32=crc, codec=codec)
        if codec == "none" and all(t.data_ptr() % ALIGN_BYTES == 0
                                   and t.nbytes % ALIGN_BYTES == 0 for t in tensors.values()):
            meta = aligning_gap(meta, at, len(pieces[0]))
            data = [pieces[0], *(Aligned(p) for p in pieces[1:])]
        record = encode_record(meta, data)
        return meta, record, sum(len(b) for b in record[: len(record) - len(data)])

    def _sync(self, seg: _Segment) -> None:
        if seg.fd is not None and seg.unsynced:
            os.fdatasync(seg.fd)
            seg.unsynced = 0
            self.syncs += 1

    def _sync_all(self) -> None:
        t0 = time.perf_counter()
        try:
            self._sync_segments()
        finally:
            self.busy_s += time.perf_counter() - t0

    def _sync_segments(self) -> None:
        for sid, seg in list(self._segs.items()):
            try:
                self._sync(seg)
            except OSError as e:
                log.warning("write-behind of session %s: %s", sid, e)
                self._drop_segment(sid)

    def _compact(self, sid: str, seg: _Segment) -> None:
        """The session's current blocks (snapshot + segment + shared prefix store) into one
        snapshot, then the segment goes. No snapshot is written when the existing one
        already holds them all (a spill wrote it); nothing happens while a current block
        of the segment follows one that is on disk nowhere."""
        kvs = self.disk.path_for(sid)
        self._sync(seg)
        with self.locks.get(sid):
            stores = [(seg.scan(self.identity, sid), seg.path)]
            shared = self._read_shared()
            if shared is not None:
                stores.append((shared, self.disk.shared_path()))
            sources = compaction_sources(kvs, stores, self.identity, seg.tokens,
                                         seg.hashes)
            n = len(sources)
            if any(m.index >= n and m.index < len(seg.hashes) and seg.hashes[m.index] == m.hash
                   for m in seg.metas):
                # a block before some of the segment's current blocks is on disk nowhere
                # (not written yet): compacting now would lose those; the next turn offers
                # the missing block again
                return
            if any(p == seg.path for p, _, _ in sources):
                got = self._session_fields(sid)
                if got is None:  # no acknowledged turn yet: the segment waits
                    return
                session, acked = got
                # blocks of a turn whose log record is not written yet (its KV comes
                # behind at the turn's end, before the record): not in this snapshot,
                # which must be a whole session as its log says; the segment keeps them
                on_disk = n  # the session's current blocks, in the snapshot or the stores
                n = common_prefix_len(seg.tokens[: n * self.bs], acked) // self.bs
                if n == 0:
                    return
                sources = sources[:n]
                fields = {**self.header_fields, **session, "session_id": sid,
                          "token_ids": list(seg.tokens[: n * self.bs]),
                          "block_hashes": [h.hex() for h in seg.hashes[:n]]}
                try:
                    n = compact(kvs, sources, fields)
                except SnapshotError as e:
                    log.warning("compaction of session %s failed: %s", sid, e)
                    return
                if n < on_disk:  # the segment still holds blocks nothing else does
                    self.compactions += 1
                    return
        # on disk now: exactly the snapshot's blocks (every current block of the segment
        # is among them)
        with self._guard:
            self._known[sid] = {(i, seg.hashes[i]) for i in range(n)}
        self.compactions += 1
        self._close_fd(seg)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(seg.path)
        self._segs.pop(sid, None)

    def _session_fields(self, sid: str) -> tuple[dict, list[int]] | None:
        """The session as its log says it is now (messages, system prompt, sampling
        defaults, history): what makes a compacted snapshot a whole session by itself, like
        any other. The log is read as it stands (the commit thread only appends whole
        records or renames a rewrite over it: a record it has not finished reads as a torn
        tail and is left out), and the tokens it acknowledges. None when it has no
        acknowledged record or cannot be read."""
        try:
            state = read_log(self.disk.log_path(sid), expect=self._identity,
                             session_id=sid).state
        except (OSError, SnapshotError) as e:
            log.warning("compaction of session %s: its log: %s", sid, e)
            return None
        if state is None:
            return None
        append = state.history == "append"
        return {"messages": state.messages, "system": state.system,
                "sampling": state.sampling,
                "history": {"mode": state.history, "log": state.tokens if append else [],
                            "pending": state.pending, "tools": state.tools,
                            "template_kwargs": state.template_kwargs}}, state.tokens

    def _serve(self, req: _Request) -> None:
        sid = req.session_id
        if req.kind is WriteOp.FLUSH:
            for s, seg in list(self._segs.items()):
                if sid is None or s == sid:
                    self._sync(seg)
        elif req.kind is WriteOp.SEED:
            scan = req.scan
            self._segs[sid] = _Segment(self.disk.segment_path(sid), end=scan.end,
                                       chunks=list(scan.header.chunks),
                                       metas=list(scan.metas), codec="lz4")
        elif req.kind is WriteOp.CLOSE:
            seg = self._segs.pop(sid, None)
            if seg is not None:
                self._sync(seg)
                self._close_fd(seg)
            with self._guard:
                self._known.pop(sid, None)
        elif req.kind is WriteOp.DELETE:
            self._drop_segment(sid)
            with self._guard:
                self._known.pop(sid, None)
        req.future.set_result(None)

    def _drop_segment(self, sid: str) -> None:
        """Forget the segment (an I/O error, or the session is gone): its blocks are no
        longer known to be on disk."""
        seg = self._segs.pop(sid, None)
        if seg is not None:
            self._close_fd(seg)
        with contextlib.suppress(OSError):
            os.unlink(self.disk.segment_path(sid))
        with self._guard:
            self._known.pop(sid, None)

    @staticmethod
    def _close_fd(seg: _Segment) -> None:
        fd, seg.fd = seg.fd, None
        if fd is not None:
            with contextlib.suppress(OSError):
                os.close(fd)

