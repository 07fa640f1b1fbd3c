"""KV segments: a session's full KV blocks, appended as they are computed (`<id>.seg`).

With durability="turn" the write-behind thread (tiers/writeback.py) appends every new full
block of a session here after its turn, encoded with the `.kvs` chunk codec (a safetensors
block, lz4-frame or stored: docs/snapshot-format.md). A block already on disk (in the
segment or the session's snapshot) is never written again. Segments are caches of the
session log's tokens, never the truth: each block record names its position and chained
hash and holds its tokens, and a resumed session takes a block only where all of that
matches what the log says (tiers/resume.py).

Layout (little endian):

    SEG_MAGIC (8) | u32 version
    identity frame: u32 length | u32 crc32 | msgpack SegmentIdentity (engine identity and
        KV geometry, as a snapshot header records them)
    block records, back to back: u32 meta length | u32 crc32(meta) | msgpack BlockMeta |
        BlockMeta.gap zero bytes (version 3) | the chunk (BlockMeta.length bytes; its
        crc32 is in the meta)
    after the identity and after each append's records, zero bytes up to the next multiple
        of ALIGN_BYTES (version 2): a frame of length 0 and crc32 0 is padding, and the
        next record starts at the first multiple of ALIGN_BYTES past that frame

Version 2 pads so that every append starts and ends on a 4 KiB boundary: the writer appends
with O_DIRECT (tiers/writeback.py), which takes only aligned offsets and lengths. Version 3
adds the gap: the writer sizes it so that a stored chunk's tensor data (after its
safetensors prefix) starts on an ALIGN_BYTES boundary, and then writes that data straight
from the gathered blocks (no copy into a staging buffer: tiers/direct_io.py). A meta
without a gap (version 1 and 2 records, and blocks whose data is not a whole number of
aligned pages) encodes as before. Versions 1 (no padding) and 2 are read the same way
(their metas are never empty and have no gap).

Like every file in session_dir a segment is untrusted: the identity must equal this
engine's, a meta is at most MAX_META_BYTES and typed, a chunk declares exactly one block's
raw size of the identity's geometry and at most that many bytes, and its bytes are checked
(crc32, bounded decompression, exact safetensors prefix) by the snapshot reader when
loaded. The valid segment is the longest prefix of intact records: a record cut short or
failing its meta checksum is a torn write (the writer never acknowledged it to anyone) and
is cut off by the owner.

Compaction (`compact`): when a segment fragments (blocks of histories the conversation
left behind, or many small appends), the blocks of the session's current tokens, from its
snapshot and its segment, are copied chunk by chunk (no decoding) into a new snapshot,
written atomically, with the session's conversation as its log says it is (the writer
reads it: the snapshot is a whole session by itself); then the segment is removed.
"""

from __future__ import annotations

import os
import struct
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Literal

import msgspec

from kvsession.cache.hashing import tail_key
from kvsession.cache.identity import StorageIdentity
from kvsession.errors import SnapshotError
from kvsession.tiers.checksum import crc32
from kvsession.tiers.files import open_regular
from kvsession.tiers.snapshot import write_snapshot_chunks
from kvsession.tiers.snapshot_format import (
    KV_TENSOR_SETS,
    MAX_BLOCK_SIZE,
    MAX_TOKEN_ID,
    Chunk,
    SnapshotHeader,
    StoredGeometry,
    snapshot_prefix,
)
from kvsession.tiers.snapshot_read import block_raw_length, check_compatible, read_header

SEG_MAGIC = b"KVSSEG\x00\x01"
# 4: a record may hold a partial last block; 3: a gap before a chunk aligns its data;
# 2: appends padded to ALIGN_BYTES; 1: unpadded
SEG_VERSION = 4
READ_VERSIONS = (1, 2, 3, 4)
SEG_PREFIX = SEG_MAGIC + struct.pack("<I", SEG_VERSION)
FRAME = struct.Struct("<II")
MAX_META_BYTES = 1 << 16
META_READ_BYTES = 504  # a block's meta is ~150-300 bytes (its tokens)
# appends start and end on multiples of this (O_DIRECT: the logical block size of every
# common device, 512 or 4096, divides it; so does the page size)
ALIGN_BYTES = 4096


def padding_after(end: int) -> int:
    """Zero bytes written after records ending at `end`: up to the next multiple of
    ALIGN_BYTES, one more ALIGN_BYTES when the gap is too short for the padding frame (the
    scanner reads a whole frame)."""
    gap = -end % ALIGN_BYTES
    return gap if gap == 0 or gap >= FRAME.size else gap + ALIGN_BYTES


def _after_padding(pos: int) -> int:
    """Where the next record starts after a padding frame at `pos`."""
    return -(-(pos + FRAME.size) // ALIGN_BYTES) * ALIGN_BYTES



class SegmentIdentity(StoredGeometry, frozen=True, forbid_unknown_fields=True):
    tensor_names: Annotated[list[Annotated[str, msgspec.Meta(max_length=16)]],
                            msgspec.Meta(max_length=4)]


class BlockMeta(msgspec.Struct, frozen=True, forbid_unknown_fields=True, omit_defaults=True):
    index: Annotated[int, msgspec.Meta(ge=0, lt=1 << 40)]
    hash: Annotated[bytes, msgspec.Meta(min_length=32, max_length=32)]
    tokens: Annotated[list[Annotated[int, msgspec.Meta(ge=0, lt=MAX_TOKEN_ID)]],
                      msgspec.Meta(max_length=MAX_BLOCK_SIZE)]
    length: Annotated[int, msgspec.Meta(ge=1)]
    raw_length: Annotated[int, msgspec.Meta(ge=1)]
    crc32: Annotated[int, msgspec.Meta(ge=0, lt=1 << 32)]
    codec: Literal["lz4", "none"]
    gap: Annotated[int, msgspec.Meta(ge=0, lt=ALIGN_BYTES)] = 0  # zero bytes before the chunk


def identity_of(identity: StorageIdentity) -> SegmentIdentity:
    """The engine's identity as a segment's identity frame records it."""
    fields = identity.header_fields()
    return msgspec.convert({k: fields[k] for k in SegmentIdentity.__struct_fields__},
                           SegmentIdentity)


def pseudo_header(ident: SegmentIdentity, session_id: str, chunks: list[Chunk]
                  ) -> SnapshotHeader:
    """A header holding the segment's geometry and chunk table: what the snapshot block
    reader needs to read and check its chunks (tiers/snapshot_read.read_blocks)."""
    return SnapshotHeader(
        format_version=1, session_id=session_id, created_unix_s=0.0,
        model_fingerprint=ident.model_fingerprint, tokenizer_digest=ident.tokenizer_digest,
        template_digest=ident.template_digest, kv_dtype=ident.kv_dtype,
        block_size=ident.block_size, num_layers=ident.num_layers,
        num_kv_heads=ident.num_kv_heads, head_dim=ident.head_dim,
        tensor_names=list(ident.tensor_names), token_ids=[], messages=[], sampling={},
        system=None, block_hashes=[], chunks=chunks)


def encode_record(meta: BlockMeta, data: list) -> list:
    raw = msgspec.msgpack.encode(meta)
    return [FRAME.pack(len(raw), crc32(raw)), raw, *([bytes(meta.gap)] if meta.gap else []),
            *data]


def aligning_gap(meta: BlockMeta, at: int, lead: int) -> BlockMeta:
    """`meta` with the gap that puts the chunk's byte `lead` (where its tensor data starts)
    of a record written at file offset `at` on an ALIGN_BYTES boundary. The gap's own
    encoding lengthens the meta by a few bytes: iterated to the fixed point (two or three
    encodings)."""
    gap = 0
    for _ in range(4):
        with_gap = msgspec.structs.replace(meta, gap=gap)
        want = -(at + FRAME.size + len(msgspec.msgpack.encode(with_gap)) + lead) % ALIGN_BYTES
        if want == gap:
            return with_gap
        gap = want
    return meta  # no fixed point: unaligned, copied like any record


def start_bytes(ident: SegmentIdentity) -> bytes:
    raw = msgspec.msgpack.encode(ident)
    return SEG_PREFIX + FRAME.pack(len(raw), crc32(raw)) + raw


@dataclass
class SegmentScan:
    """The intact records of a segment: metas[k] and header.chunks[k] describe record k;
    end: where they end (size > end: a torn tail)."""

    header: SnapshotHeader
    metas: list[BlockMeta]
    end: int
    size: int
    index: dict[tuple[int, bytes], int] = field(default_factory=dict)

    def __post_init__(self):
        for k, m in enumerate(self.metas):
            self.index[(m.index, m.hash)] = k  # a later copy of a block wins

    @property
    def torn(self) -> bool:
        return self.size > self.end


def scan_segment(path: Path, identity: StorageIdentity, session_id: str) -> SegmentScan:
    """Read a segment's record table (no chunk data). SnapshotError when it is not a
    segment of this engine (then it contributes nothing)."""
    path = Path(path)
    with open_regular(path) as f:
        fd = f.fileno()
        try:
            size = os.fstat(fd).st_size
            head = os.pread(fd, len(SEG_PREFIX) + FRAME.size, 0)
            if len(head) < len(SEG_PREFIX) + FRAME.size or \
                    head[:len(SEG_MAGIC)] != SEG_MAGIC or struct.unpack_from(
                        "<I", head, len(SEG_MAGIC))[0] not in READ_VERSIONS:
                raise SnapshotError(f"{path}: not a kvsession segment (bad magic or version)")
            n, crc = FRAME.unpack(head[len(SEG_PREFIX):])
            if n > MAX_META_BYTES:
                raise SnapshotError(f"{path}: identity of {n} bytes (corrupted or crafted)")
            raw = os.pread(fd, n, len(head))
            if len(raw) != n or crc32(raw) != crc:
                raise SnapshotError(f"{path}: identity checksum mismatch (torn or corrupted)")
            try:
                ident = msgspec.msgpack.decode(raw, type=SegmentIdentity)
            except msgspec.MsgspecError as e:
                raise SnapshotError(f"{path}: malformed identity: {e}") from None
            check_compatible(path, ident, {k: v for k, v in identity.header_fields().items()
                                           if k != "tensor_names"})
            if set(ident.tensor_names) not in KV_TENSOR_SETS or \
                    set(ident.tensor_names) != set(identity.tensor_names):
                raise SnapshotError(f"{path}: tensors {ident.tensor_names} do not match "
                                    f"this engine's cache")
            header = pseudo_header(ident, session_id, [])
            block_len = block_raw_length(header)
            metas: list[BlockMeta] = []
            pos = len(head) + n
            while pos + FRAME.size <= size:
                # the frame and (usually all of) the meta in one read
                window = os.pread(fd, FRAME.size + META_READ_BYTES, pos)
                if len(window) < FRAME.size:
                    break
                n, crc = FRAME.unpack_from(window)
                if n == 0 and crc == 0:  # padding (a meta is never empty)
                    if _after_padding(pos) > size:
                        break  # cut short: the records end before it
                    pos = _after_padding(pos)
                    continue
                if n > MAX_META_BYTES or pos + FRAME.size + n > size:
                    break
                raw = window[FRAME.size: FRAME.size + n] if n <= META_READ_BYTES else \
                    os.pread(fd, n, pos + FRAME.size)
                if len(raw) != n or crc32(raw) != crc:
                    break
                try:
                    meta = msgspec.msgpack.decode(raw, type=BlockMeta)
                except msgspec.MsgspecError as e:
                    raise SnapshotError(f"{path}: malformed block record at {pos}: {e}") \
                        from None
                data_at = pos + FRAME.size + n + meta.gap
                if meta.raw_length != block_len or meta.length > block_len or (
                        meta.codec == "none" and meta.length != block_len) or \
                        not 0 < len(meta.tokens) <= ident.block_size:
                    raise SnapshotError(f"{path}: block record at {pos} does not match the "
                                        f"segment's geometry (corrupted or crafted)")
                if data_at + meta.length > size:
                    break  # its chunk was cut short
                header.chunks.append(Chunk(data_at, meta.length, meta.raw_length, meta.crc32,
                                           meta.codec))
                if not metas:
                    _read_ahead_records(fd, pos, data_at + meta.length - pos, size)
                metas.append(meta)
                pos = data_at + meta.length
        except OSError as e:
            raise SnapshotError(f"{path}: cannot read: {e}") from None
    return SegmentScan(header, metas, pos, size)


def _read_ahead_records(fd: int, first: int, stride: int, size: int) -> None:
    """Ask the kernel to read, all at once, the pages where the records after the first
    would start if every one took `stride` bytes, as stored blocks of one geometry do when
    their data is aligned (version 3: a 4 KiB head page, then the data). The scan reads
    one record's meta after another, each read waiting for the one before: on a segment
    written with O_DIRECT (not in the page cache) 130 records took ~12 ms of disk
    latency, most of a resumed session's attach. A hint only: where a record is not where
    it is predicted, the scan reads it as before."""
    if stride % ALIGN_BYTES or not hasattr(os, "posix_fadvise"):
        return  # no constant stride to predict (lz4 chunks, unaligned records)
    for at in range(first + stride, size, stride):
        os.posix_fadvise(fd, at, FRAME.size + META_READ_BYTES, os.POSIX_FADV_WILLNEED)


def segment_blocks(stores: list[tuple[SegmentScan, Path]], start: int, tokens, hashes,
                   bs: int) -> list[tuple[Path, SnapshotHeader, int]]:
    """Blocks start, start+1, ... of `tokens` found in the given segments (the first that
    has it: chained hash and tokens equal), up to the first one found in none."""
    out = []
    for i in range(start, len(hashes)):
        want = list(tokens[i * bs:(i + 1) * bs])
        for scan, path in stores:
            k = scan.index.get((i, hashes[i]))
            if k is not None and list(scan.metas[k].tokens) == want:
                out.append((path, scan.header, k))
                break
        else:
            break
    return out


def segment_tail(scan: SegmentScan, path: Path, i: int, tokens, parent: bytes, bs: int
                 ) -> tuple[tuple[Path, SnapshotHeader, int], int] | None:
    """The session's partial last block as its segment holds it: the longest tail record
    of block i (the tokens after i full blocks, fewer than bs) whose key (tail_key of
    `parent`, block i-1's chained hash, and its tokens) and tokens equal `tokens` there.
    Returns (source, tokens it holds), or None."""
    for m in range(min(bs - 1, len(tokens) - i * bs), 0, -1):
        want = list(tokens[i * bs:i * bs + m])
        k = scan.index.get((i, tail_key(parent, want)))
        if k is not None and list(scan.metas[k].tokens) == want:
            return (path, scan.header, k), m
    return None


def compact(out: Path, sources: list[tuple[Path, SnapshotHeader, int]], fields: dict) -> int:
    """Write a snapshot `out` holding the given blocks (file, header, chunk index), chunk
    bytes copied as they are; each chunk's checksum is verified on the way (a bad one ends
    the snapshot there: it holds a prefix). fields: the header's fields (tokens covering
    exactly the blocks copied are cut to the prefix written). Returns the blocks written."""
    bs = fields["block_size"]
    files: dict[Path, object] = {}

    def chunks():
        for path, header, k in sources:
            c = header.chunks[k]
            f = files.get(path)
            if f is None:
                f = files[path] = open_regular(path)
            data = os.pread(f.fileno(), c.length, c.offset)
            if len(data) != c.length or crc32(data) != c.crc32:
                return
            yield data, c.raw_length, c.crc32, c.codec

    try:
        written = write_snapshot_chunks(out, fields, chunks(),
                                        lambda n: fields["token_ids"][: n * bs])
    finally:
        for f in files.values():
            f.close()
    return written


def compaction_sources(kvs: Path, stores: list[tuple[SegmentScan, Path]],
                       identity: StorageIdentity, tokens, hashes
                       ) -> list[tuple[Path, SnapshotHeader, int]]:
    """The blocks of the session's current full-block `tokens`, snapshot first, then the
    segments (its own, the shared prefix store), as a prefix (what a resume attaches)."""
    bs = identity.block_size
    sources: list[tuple[Path, SnapshotHeader, int]] = []
    if kvs.is_file():
        try:
            h = read_header(kvs, expect=identity)
            n = snapshot_prefix(h, tokens, bs) // bs
            sources = [(kvs, h, i) for i in range(n)]
        except SnapshotError:
            pass
    return sources + segment_blocks(stores, len(sources), tokens, hashes, bs)

