"""Writing `.kvs` session snapshots: one self-describing file per session (the format
itself, layout, schema and bounds, is kvsession/tiers/snapshot_format.py).

Layout (little endian):

    MAGIC (8) | u32 format version
    block chunks: for each KV block, safetensors({name: [num_layers, block_size, ...]}) --
        K, V and, for fp8, their scales -- lz4-frame compressed (codec "lz4"), or stored as
        is (codec "none") when the first block shows lz4 saves < 10% (KV of real models is
        near-incompressible; skipping it keeps spills at disk speed). Streamed: a writer
        thread puts each chunk on disk while the next one is encoded.
    header: msgspec JSON of SnapshotHeader (geometry, fingerprints, tokens, messages,
        sampling defaults, per-block hashes, and each chunk's offset, length, raw length,
        crc32)
    footer: u64 header length | u32 crc32(header) | END_MAGIC (8)

The header is written last (a footer, like zip) so chunks stream to disk without a second
copy in memory; a file cut short loses its footer and is rejected as truncated. The reader
(kvsession/tiers/snapshot_read.py) bounds every size before it allocates and validates
magic, version, footer, header checksum and typed schema, then each chunk's bounds,
checksum, bounded decompression and exact safetensors prefix before it touches the KV
pool. Nothing is unpickled and no code from the file runs: JSON, lz4 and raw bytes only.
Every failure is a SnapshotError naming the cause.

Writes are atomic (tiers/files.py): a temporary file in the same directory (TEMP_NAME,
locked while it is written), fsync, rename over the target, fsync of the directory. A
crash leaves the old file or the new one, never a torn one; its temporary file is removed
by the next start-up scan of the directory (DiskTier). A failed write raises SnapshotError
and leaves the old file as it was.
"""

from __future__ import annotations

import json
import os
import queue
import shutil
import struct
import threading
import time
from collections.abc import Iterable
from pathlib import Path

import lz4.frame
import msgspec
import torch

from kvsession.errors import SnapshotError
from kvsession.tiers.checksum import crc32
from kvsession.tiers.files import atomic_write, open_regular
from kvsession.tiers.snapshot_format import (
    END_MAGIC,
    FOOTER,
    FORMAT_VERSION,
    MAGIC,
    MAX_HEADER_BYTES,
    PREFIX_LEN,
    Chunk,
    SnapshotHeader,
    block_prefix,
)

MIN_LZ4_SAVING = 0.10


def encode_block(tensors: dict[str, torch.Tensor]) -> list:
    """One block's tensors in the safetensors layout (u64 header length, JSON header padded
    to 8 bytes, raw little-endian data), as buffers that reference the tensors' memory."""
    cpu = {n: t.detach().to("cpu").contiguous() for n, t in tensors.items()}
    prefix = block_prefix({n: (tuple(t.shape), t.dtype) for n, t in cpu.items()})
    return [prefix, *(memoryview(cpu[n].view(torch.uint8).numpy()).cast("B")
                      for n in sorted(cpu))]


class _Writer(threading.Thread):
    """Writes queued buffers to a file in order, so encoding overlaps disk I/O.

    Left to itself the kernel starts writeback only at the final fsync, after all the
    encoding: the disk would sit idle while the CPU works, then the CPU while the disk
    does. So a second thread flushes to the device (fdatasync) every SYNC_BYTES written,
    while this one goes on writing the next buffers into the page cache; the final fsync has
    little left to wait for. An error in either thread is raised by put() or finish()."""

    SYNC_BYTES = 8 << 20

    def __init__(self, f):
        super().__init__(daemon=True)
        self.f, self.q, self.error = f, queue.Queue(maxsize=8), None
        self._written = self._synced = 0
        self._done = False
        self._cv = threading.Condition()
        self._syncer = threading.Thread(target=self._sync_loop, daemon=True)
        self._syncer.start()
        self.start()

    def run(self) -> None:
        while (item := self.q.get()) is not None:
            if self.error is None:
                try:
                    for buf in item:
                        self.f.write(buf)
                    with self._cv:
                        self._written += sum(len(b) for b in item)
                        self._cv.notify_all()
                except BaseException as e:
                    self.error = e

    def _sync_loop(self) -> None:
        while True:
            with self._cv:
                while not self._done and self._written - self._synced < self.SYNC_BYTES:
                    self._cv.wait()
                if self._done:
                    return
                target = self._written
            try:
                os.fdatasync(self.f.fileno())  # everything the kernel has, >= target
            except OSError as e:
                with self._cv:
                    self.error = self.error or e
                    self._synced = float("inf")  # no more rounds: finish() must not wait
                    self._cv.notify_all()
                return
            with self._cv:
                self._synced = target
                self._cv.notify_all()

    def put(self, buffers: list) -> None:
        if self.error is not None:
            raise self.error
        self.q.put(buffers)

    def finish(self) -> None:
        """Drain the queue, let a due sync round finish (so its outcome is known), stop."""
        self.q.put(None)
        self.join()
        with self._cv:
            while self._written - self._synced >= self.SYNC_BYTES:
                self._cv.wait()
            self._done = True
            self._cv.notify_all()
        self._syncer.join()
        if self.error is not None:
            raise self.error


def write_snapshot(path: Path, fields: dict, blocks: Iterable[dict[str, torch.Tensor]]) -> int:
    """Write atomically. `fields` are SnapshotHeader fields except format_version, chunks
    and created_unix_s; `blocks` yields each block's tensors. Returns the file size. On any
    error (SnapshotError; an OSError such as a full disk is one, naming its cause) the
    previous file at `path` is untouched."""
    path = Path(path)
    check_text_messages(path, fields["messages"])

    def fill(f) -> None:
        f.write(MAGIC + struct.pack("<I", FORMAT_VERSION))
        writer = _Writer(f)
        try:
            chunks, offset, codec = [], PREFIX_LEN, "lz4"
            for tensors in blocks:
                pieces = encode_block(tensors)
                raw_len = sum(len(p) for p in pieces)
                data, this = pieces, "none"
                if codec == "lz4":
                    comp = lz4.frame.compress(b"".join(pieces))
                    if len(comp) <= (1 - MIN_LZ4_SAVING) * raw_len:
                        data, this = [comp], "lz4"
                    else:
                        codec = "none"  # incompressible KV: store the rest as is
                length, crc = sum(len(d) for d in data), 0
                for d in data:
                    crc = crc32(d, crc)
                writer.put(data)
                chunks.append(Chunk(offset, length, raw_len, crc, this))
                offset += length
        finally:
            writer.finish()
        header = msgspec.json.encode(SnapshotHeader(
            format_version=FORMAT_VERSION, created_unix_s=time.time(), chunks=chunks,
            **fields))
        if len(header) > MAX_HEADER_BYTES:  # never write what no reader would accept
            raise SnapshotError(f"{path}: the session's header would be {len(header)} "
                                f"bytes, over the {MAX_HEADER_BYTES}-byte limit")
        f.write(header)
        f.write(FOOTER.pack(len(header), crc32(header)) + END_MAGIC)

    return atomic_write(path, fill)


def write_snapshot_chunks(path: Path, fields: dict, chunks: Iterable[tuple], tokens_for
                          ) -> int:
    """Write atomically a snapshot of already encoded chunks (data, raw length, crc32,
    codec), e.g. copied from other files by compaction; `tokens_for(n)` gives the token ids
    that n blocks hold (the iterator may end early). Returns the number of blocks."""
    path = Path(path)
    written = [0]

    def fill(f) -> None:
        f.write(MAGIC + struct.pack("<I", FORMAT_VERSION))
        table, offset = [], PREFIX_LEN
        for data, raw_len, crc, codec in chunks:
            f.write(data)
            table.append(Chunk(offset, len(data), raw_len, crc, codec))
            offset += len(data)
        tokens = list(tokens_for(len(table)))
        bs = fields["block_size"]
        header = msgspec.json.encode(SnapshotHeader(
            format_version=FORMAT_VERSION, created_unix_s=time.time(), chunks=table,
            **{**fields, "token_ids": tokens,
               "block_hashes": fields["block_hashes"][: len(tokens) // bs]}))
        if len(header) > MAX_HEADER_BYTES:
            raise SnapshotError(f"{path}: the session's header would be {len(header)} "
                                f"bytes, over the {MAX_HEADER_BYTES}-byte limit")
        f.write(header)
        f.write(FOOTER.pack(len(header), crc32(header)) + END_MAGIC)
        written[0] = len(table)

    atomic_write(path, fill)
    return written[0]


def copy_snapshot(src: Path, dst: Path) -> int:
    """Copy the snapshot `src` to `dst` as atomically as write_snapshot writes one."""
    def fill(f) -> None:
        with open_regular(Path(src)) as s:
            shutil.copyfileobj(s, f, 1 << 20)

    return atomic_write(Path(dst), fill)


# a message field whose value is not a string (tool_calls, a None content) is stored as
# JSON text under this prefix, so a header's messages stay dicts of strings (what the
# bounded reader decodes); a key that starts with it is escaped the same way
JSON_FIELD_PREFIX = "json:"


def messages_to_text(messages: list[dict]) -> list[dict[str, str]]:
    """Messages as snapshots and logs store them (see JSON_FIELD_PREFIX)."""
    out = []
    for m in messages:
        text: dict[str, str] = {}
        for key, value in m.items():
            if isinstance(value, str) and not key.startswith(JSON_FIELD_PREFIX):
                text[key] = value
            else:
                text[JSON_FIELD_PREFIX + key] = json.dumps(value, ensure_ascii=False)
        if not isinstance(text.get("content"), str):
            text["content"] = ""  # the reader requires a text content; the JSON field rules
        out.append(text)
    return out


def messages_from_text(path: Path, messages: list[dict[str, str]]) -> list[dict]:
    """The inverse of messages_to_text; a field that is not valid JSON is a SnapshotError."""
    out = []
    for i, m in enumerate(messages):
        msg = {k: v for k, v in m.items() if not k.startswith(JSON_FIELD_PREFIX)}
        for key, value in m.items():  # after the plain fields: a JSON field rules
            if key.startswith(JSON_FIELD_PREFIX):
                try:
                    msg[key[len(JSON_FIELD_PREFIX):]] = json.loads(value)
                except (ValueError, RecursionError) as e:
                    raise SnapshotError(f"{path}: message {i} field {key!r} is not valid "
                                        f"JSON: {e}") from None
        out.append(msg)
    return out


def check_text_messages(path: Path, messages) -> None:
    """Snapshots hold text conversations: each message a dict of strings with a role and a
    content (what the reader accepts, so that every file written can be read back)."""
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not isinstance(
                m.get("content"), str) or not all(
                isinstance(k, str) and isinstance(v, str) for k, v in m.items()):
            raise SnapshotError(f"{path}: message {i} is not text ({m!r:.80}): a snapshot "
                                f"holds messages whose role, content and other fields are "
                                f"strings")


