"""Aligned O_DIRECT appends (kvsession/tiers/direct_io.py) and the padded segment format
(version 2, kvsession/tiers/segments.py): real files, the bytes compared exactly.

- Random appends (1 byte to past the 8 MiB staging buffer, some starting mid-block as an
  unpadded version-1 segment ends) leave exactly the data then zero padding, every append
  starting and ending on a 4 KiB boundary.
- A file system that refuses O_DIRECT (at open, or at the first write) gets the same bytes.
- Power loss inside an append: a segment cut at every byte of its last append (and
  extended with zeros, as a torn direct write can leave it) scans as exactly the earlier
  appends' records; a version-1 segment (no padding) scans as before.
"""

from __future__ import annotations

import errno
import fcntl
import os
import random
import struct

import msgspec
import pytest
import torch

from kvsession.cache.identity import StorageIdentity
from kvsession.tiers import direct_io
from kvsession.tiers.checksum import crc32
from kvsession.tiers.direct_io import AlignedAppender, open_for_append
from kvsession.tiers.segments import (
    ALIGN_BYTES,
    SEG_MAGIC,
    BlockMeta,
    encode_record,
    identity_of,
    padding_after,
    scan_segment,
    start_bytes,
)
from kvsession.tiers.snapshot import encode_block

FIELDS = StorageIdentity("test", "float32", 4, tokenizer_digest="t", template_digest="t",
                         num_layers=2, num_kv_heads=1, head_dim=8, tensor_names=("k", "v"))


def _appends(path, sizes_per_append, seed=0, cut_every=0):
    """Append random buffers; returns (the bytes the file must hold, the ends)."""
    rng = random.Random(seed)
    fd = open_for_append(path)
    io = AlignedAppender()
    expect, end, ends = bytearray(), 0, []
    try:
        for k, sizes in enumerate(sizes_per_append):
            if cut_every and k % cut_every == cut_every - 1 and end > ALIGN_BYTES:
                end -= rng.randrange(1, 200)  # an unpadded (version-1) end: mid-block
                os.ftruncate(fd, end)
                del expect[end:]
            bufs = [rng.randbytes(n) for n in sizes]
            new = io.append(fd, bufs, end)
            data = b"".join(bufs)
            expect += data + bytes(padding_after(end + len(data)))
            assert new == len(expect) and new % ALIGN_BYTES == 0
            end = new
            ends.append(end)
    finally:
        os.close(fd)
    return bytes(expect), ends


def test_random_appends_are_the_data_then_padding_on_aligned_boundaries(tmp_path):
    rng = random.Random(1)
    sizes = [[rng.choice([1, 7, 8, 100, 4088, 4096, 5000, 1 << 20, (8 << 20) + 3])
              for _ in range(rng.randrange(1, 4))] for _ in range(24)]
    expect, _ = _appends(tmp_path / "a.bin", sizes, cut_every=5)
    assert (tmp_path / "a.bin").read_bytes() == expect


def test_aligned_buffers_are_written_in_place_where_they_fall_on_aligned_offsets(tmp_path):
    """Aligned (page-aligned memory, whole 4 KiB pages) pieces mixed with unaligned ones,
    from a generator: the file holds the same bytes as with copies; a piece is written in
    place exactly when the bytes before it end on an aligned offset, else copied."""
    from kvsession.host_memory import fresh_memory
    from kvsession.tiers.direct_io import Aligned

    rng = random.Random(7)
    path = tmp_path / "m.bin"
    fd = open_for_append(path)
    io = AlignedAppender()
    expect, end, in_place = bytearray(), 0, 0
    keep = []
    try:
        for _ in range(12):
            pieces, at = [], end
            for _ in range(rng.randrange(1, 6)):
                if rng.random() < 0.5:
                    n = ALIGN_BYTES * rng.choice([1, 3, 64, 2049])  # 2049 pages: > a stage
                    mem = fresh_memory(n)
                    mem.write(rng.randbytes(n))
                    keep.append(mem)
                    pieces.append(Aligned(memoryview(mem)))
                    in_place += n if at % ALIGN_BYTES == 0 else 0
                    expect += mem
                else:
                    b = rng.randbytes(rng.choice([8, 100, ALIGN_BYTES - 8, ALIGN_BYTES, 5000]))
                    pieces.append(b)
                    expect += b
                at += n if isinstance(pieces[-1], Aligned) else len(pieces[-1])
            end = io.append(fd, (p for p in pieces), end)
            expect += bytes(padding_after(len(expect)))
            assert end == len(expect)
    finally:
        os.close(fd)
    assert path.read_bytes() == bytes(expect)
    assert io.bytes_in_place == in_place > 0


def test_the_writer_places_block_data_on_aligned_offsets(tmp_path):
    """Version 3 records: a stored block whose tensors are whole aligned pages gets the gap
    that puts its data (past the safetensors prefix) on a 4 KiB boundary; the scan finds
    the chunk past the gap and its bytes check out."""
    from kvsession.tiers.segments import aligning_gap

    g = torch.Generator().manual_seed(3)
    t = {n: torch.randn(2, 4, 2, 64, generator=g) for n in ("k", "v")}  # 4 KiB each
    pieces = encode_block(t)
    raw = b"".join(bytes(p) for p in pieces)
    fields = msgspec.structs.replace(FIELDS, num_kv_heads=2, head_dim=64)
    path = tmp_path / "v3.seg"
    fd = open_for_append(path)
    io = AlignedAppender()
    end = io.append(fd, [start_bytes(identity_of(fields))], 0)
    chunks, starts = [], []
    for batch in range(2):
        bufs, at = [], end
        for i in range(batch * 3, batch * 3 + 3):
            meta = BlockMeta(index=i, hash=bytes([i]) * 32, tokens=[i] * 4, length=len(raw),
                             raw_length=len(raw), crc32=crc32(raw), codec="none")
            meta = aligning_gap(meta, at, len(pieces[0]))
            assert 0 <= meta.gap < ALIGN_BYTES
            record = encode_record(meta, [raw])
            starts.append(at)
            chunks.append(at + sum(len(b) for b in record[:-1]))  # past frame, meta, gap
            assert (chunks[-1] + len(pieces[0])) % ALIGN_BYTES == 0
            bufs += record
            at = chunks[-1] + len(raw)
        end = io.append(fd, bufs, end)
    os.close(fd)
    hinted = []
    real = getattr(os, "posix_fadvise", None)
    with pytest.MonkeyPatch.context() as mp:
        if real is not None:
            mp.setattr(os, "posix_fadvise", lambda fd, off, n, advice: (
                hinted.append(off), real(fd, off, n, advice)))
        scan = scan_segment(path, fields, "v3")
    assert [m.index for m in scan.metas] == list(range(6)) and scan.end == end
    assert [c.offset for c in scan.header.chunks] == chunks
    data = path.read_bytes()
    assert all(data[c: c + len(raw)] == raw for c in chunks)
    # the scan asked for the records after the first where they are (one stride apart:
    # no padding between appends that end aligned), read ahead all at once
    assert hinted == (starts[1:] if real is not None else [])


def test_padding_leaves_room_for_its_frame():
    assert [padding_after(ALIGN_BYTES * 3 - g) for g in (0, 1, 7, 8, 9, 4095)] == [
        0, 1 + ALIGN_BYTES, 7 + ALIGN_BYTES, 8, 9, 4095]


def test_o_direct_refused_at_open_gives_the_same_bytes(tmp_path, monkeypatch):
    real_open = os.open

    def no_direct(path, flags, mode=0o777):
        if flags & direct_io.O_DIRECT:
            raise OSError(errno.EINVAL, "O_DIRECT not supported")
        return real_open(path, flags, mode)

    monkeypatch.setattr(direct_io.os, "open", no_direct)
    fd = open_for_append(tmp_path / "b.bin")
    assert not fcntl.fcntl(fd, fcntl.F_GETFL) & direct_io.O_DIRECT
    os.close(fd)
    expect, _ = _appends(tmp_path / "c.bin", [[10, 5000], [3]])
    assert (tmp_path / "c.bin").read_bytes() == expect


@pytest.mark.skipif(not direct_io.O_DIRECT, reason="no O_DIRECT on this platform")
def test_o_direct_refused_at_the_first_write_is_retried_buffered(tmp_path, monkeypatch):
    fd = open_for_append(tmp_path / "d.bin")
    if not fcntl.fcntl(fd, fcntl.F_GETFL) & direct_io.O_DIRECT:
        os.close(fd)
        pytest.skip("this file system refused O_DIRECT at open")
    real = os.pwritev
    refused = []

    def pwritev(f, bufs, off):
        if fcntl.fcntl(f, fcntl.F_GETFL) & direct_io.O_DIRECT:
            refused.append(off)
            raise OSError(errno.EINVAL, "refused")
        return real(f, bufs, off)

    monkeypatch.setattr(direct_io.os, "pwritev", pwritev)
    try:
        end = AlignedAppender().append(fd, [b"x" * 5000], 0)
    finally:
        os.close(fd)
    assert refused == [0] and end == 2 * ALIGN_BYTES
    assert (tmp_path / "d.bin").read_bytes() == b"x" * 5000 + bytes(end - 5000)


def _records(first: int, n: int) -> list[tuple[BlockMeta, list]]:
    out = []
    for i in range(first, first + n):
        g = torch.Generator().manual_seed(i)
        t = {name: torch.randn(2, 4, 1, 8, generator=g) for name in ("k", "v")}
        raw = b"".join(bytes(p) for p in encode_block(t))
        meta = BlockMeta(index=i, hash=bytes([i]) * 32, tokens=[i] * 4, length=len(raw),
                         raw_length=len(raw), crc32=crc32(raw), codec="none")
        out.append((meta, encode_record(meta, [raw])))
    return out


def test_a_segment_cut_at_every_byte_of_its_last_append_keeps_whole_records(tmp_path):
    path = tmp_path / "s.seg"
    batches = [_records(0, 3), _records(3, 2)]
    fd = open_for_append(path)
    io = AlignedAppender()
    ends = [io.append(fd, [start_bytes(identity_of(FIELDS))], 0)]
    for batch in batches:
        ends.append(io.append(fd, [b for _, rec in batch for b in rec], ends[-1]))
    os.close(fd)
    whole = path.read_bytes()
    full = scan_segment(path, FIELDS, "s")
    assert [m.index for m in full.metas] == [0, 1, 2, 3, 4] and full.end == ends[-1]
    # where each record of the last append ends
    record_ends, at = [], ends[1]
    for _, rec in batches[1]:
        at += sum(len(b) for b in rec)
        record_ends.append(at)
    for cut in range(ends[1], ends[2] + 1):
        path.write_bytes(whole[:cut])
        scan = scan_segment(path, FIELDS, "s")
        whole_records = [e for e in record_ends if e <= cut]
        assert [m.index for m in scan.metas] == [0, 1, 2, 3, 4][: 3 + len(whole_records)]
        # the valid prefix ends after the last whole record, or after its padding
        assert scan.end == (ends[2] if cut == ends[2] else max([ends[1], *whole_records]))
    # a torn direct write can leave the file extended with zeros: padding, not records
    path.write_bytes(whole[: ends[1]] + bytes(3 * ALIGN_BYTES))
    scan = scan_segment(path, FIELDS, "s")
    assert [m.index for m in scan.metas] == [0, 1, 2] and scan.end == ends[1] + 3 * ALIGN_BYTES


def test_a_version_1_segment_without_padding_still_scans(tmp_path):
    path = tmp_path / "v1.seg"
    start = start_bytes(identity_of(FIELDS))
    v1 = SEG_MAGIC + struct.pack("<I", 1) + start[len(SEG_MAGIC) + 4:]
    path.write_bytes(v1 + b"".join(b for _, rec in _records(0, 3) for b in rec))
    scan = scan_segment(path, FIELDS, "v1")
    assert [m.index for m in scan.metas] == [0, 1, 2] and scan.end == path.stat().st_size


def test_staging_buffers_are_reused_within_their_bound():
    """The write-behind's gather buffers (tiers/staging.py): a returned buffer serves the
    next gather that fits (no fresh memory, so no page faults), sized in powers of two rows;
    past the bound a returned buffer is freed."""
    from kvsession.tiers.staging import StagingBuffers

    st = StagingBuffers(max_bytes=64 * 1024)
    out, buf = st.take((3, 2, 16), torch.float32)  # 384 B, rows rounded up to 4: 512 B
    assert out.shape == (3, 2, 16) and buf.numel() == 512
    st.give_back(buf)
    again, buf2 = st.take((4, 2, 16), torch.float32)  # fits the kept 512 B
    assert buf2.data_ptr() == buf.data_ptr() and again.data_ptr() == buf.data_ptr()
    assert (st.reused, st.allocated, st.kept_bytes) == (1, 1, 0)
    _, big = st.take((128, 2, 64), torch.float32)  # 64 KiB: kept, up to the bound
    st.give_back(big)
    st.give_back(buf2)  # would pass the bound: freed, not kept
    assert st.kept_bytes == 64 * 1024
    _, b = st.take((1, 8), torch.uint8)  # the smallest kept buffer that fits
    assert b.data_ptr() == big.data_ptr() and st.kept_bytes == 0


def test_fresh_staging_memory_is_zeroed_aligned_and_freed_with_its_tensor():
    """Fresh gather buffers (host_memory.fresh_memory): private mappings, page aligned (the
    O_DIRECT stages use them too, and blocks are written from them in place), zeroed; the
    tensor keeps its mapping alive and unmaps it when it goes."""
    import gc
    import weakref

    from kvsession.host_memory import fresh_memory
    from kvsession.tiers.staging import StagingBuffers

    for nbytes in (1, 4096 + 7, (2 << 20), 3 * (2 << 20) + 4096):
        mem = fresh_memory(nbytes)
        t = torch.frombuffer(mem, dtype=torch.uint8)
        assert t.numel() == nbytes and t.data_ptr() % 4096 == 0
        assert not t.any()
        t.fill_(7)  # writable
        assert mem[nbytes - 1] == 7
    st = StagingBuffers(max_bytes=0)
    out, buf = st.take((2, (2 << 20) // 4), torch.float32)
    out.normal_()
    ref = weakref.ref(buf.untyped_storage())
    assert buf.data_ptr() % 4096 == 0
    st.give_back(buf)  # over the bound (0): not kept
    del out, buf
    gc.collect()
    assert ref() is None and st.kept_bytes == 0
