"""The `.kvs` session snapshot format: one self-describing file per session.

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
copy in memory; a file cut short loses its footer and is rejected as truncated. Reading
validates magic, version, footer, header checksum and schema, then each chunk's bounds,
checksum, decompression and tensor names/shapes/dtypes before it touches the KV pool.
Nothing is unpickled and no code from the file runs: JSON, lz4 and safetensors only.
Every failure is a SnapshotError naming the cause.

Writes are atomic: a temporary file in the same directory, fsync, rename over the target,
fsync of the directory. A crash leaves the old file or the new one, never a torn one.
"""

from __future__ import annotations

import functools
import json
import os
import queue
import struct
import threading
import time
import uuid
import zlib
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path

import lz4.frame
import msgspec
import torch

from kvsession.cache.block_pool import blocks_for
from kvsession.errors import SnapshotError

MAGIC = b"KVSNAP\x00\x01"
END_MAGIC = b"KVSEND\x00\x01"
FORMAT_VERSION = 1
_FOOTER = struct.Struct("<QI")
_PREFIX_LEN = len(MAGIC) + 4
_FOOTER_LEN = _FOOTER.size + len(END_MAGIC)
MAX_HEADER_BYTES = 1 << 30


class Chunk(msgspec.Struct, frozen=True):
    offset: int
    length: int
    raw_length: int
    crc32: int
    codec: str = "lz4"  # "lz4" | "none"


class SnapshotHeader(msgspec.Struct, frozen=True):
    format_version: int
    session_id: str
    created_unix_s: float
    model_fingerprint: str
    tokenizer_digest: str
    template_digest: str
    kv_dtype: str
    block_size: int
    num_layers: int
    num_kv_heads: int
    head_dim: int
    tensor_names: list[str]
    token_ids: list[int]          # tokens whose KV the chunks hold, in order
    messages: list[dict]
    sampling: dict
    system: str | None
    block_hashes: list[str]       # hex, one per full block
    chunks: list[Chunk]           # one per block (the last may be partial)

    @property
    def num_blocks(self) -> int:
        return len(self.chunks)


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


_ST_DTYPES = {torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16",
              torch.float8_e4m3fn: "F8_E4M3"}
_ST_NAMES = {v: k for k, v in _ST_DTYPES.items()}
MIN_LZ4_SAVING = 0.10


def block_prefix(shapes: dict[str, tuple[tuple[int, ...], torch.dtype]]) -> bytes:
    """The bytes before the data of a block chunk holding tensors of these shapes (sorted by
    name): u64 header length and the JSON header, padded to 8 bytes."""
    return _block_prefix(tuple(sorted((n, tuple(s), d) for n, (s, d) in shapes.items())))


@functools.lru_cache(maxsize=64)  # every block of a pool has the same layout
def _block_prefix(shapes: tuple) -> bytes:
    header, offset = {}, 0
    for name, shape, dtype in shapes:
        n = torch.empty((), dtype=dtype).element_size()
        for x in shape:
            n *= x
        header[name] = {"dtype": _ST_DTYPES[dtype], "shape": list(shape),
                        "data_offsets": [offset, offset + n]}
        offset += n
    hb = json.dumps(header, separators=(",", ":")).encode()
    hb += b" " * (-len(hb) % 8)
    return struct.pack("<Q", len(hb)) + hb


def encode_block(tensors: dict[str, torch.Tensor]) -> list:
    """One block's tensors in the safetensors layout (u64 header length, JSON header padded
    to 8 bytes, raw little-endian data), as buffers that reference the tensors' memory."""
    cpu = {n: t.detach().to("cpu").contiguous() for n, t in tensors.items()}
    prefix = block_prefix({n: (tuple(t.shape), t.dtype) for n, t in cpu.items()})
    return [prefix, *(memoryview(cpu[n].view(torch.uint8).numpy()).cast("B")
                      for n in sorted(cpu))]


def decode_block(raw, where: str) -> dict[str, torch.Tensor]:
    """Parse one chunk's safetensors bytes into tensors viewing `raw` (a bytearray)."""
    try:
        (hl,) = struct.unpack_from("<Q", raw, 0)
        if hl > len(raw) - 8:
            raise ValueError("header length past the end")
        header = json.loads(bytes(raw[8:8 + hl]))
        raw = raw if isinstance(raw, memoryview) else memoryview(raw)
        out, data = {}, 8 + hl
        for name, meta in header.items():
            if name == "__metadata__":
                continue
            dtype = _ST_NAMES[meta["dtype"]]
            shape = [int(x) for x in meta["shape"]]
            start, end = (int(x) for x in meta["data_offsets"])
            numel = 1
            for x in shape:
                numel *= x
            if not 0 <= start <= end <= len(raw) - data or \
                    end - start != numel * torch.empty((), dtype=dtype).element_size():
                raise ValueError(f"tensor {name!r} has bad offsets")
            if end > start:
                t = torch.frombuffer(raw, dtype=torch.uint8, count=end - start,
                                     offset=data + start)
            else:
                t = torch.empty(0, dtype=torch.uint8)
            out[name] = t.view(dtype).reshape(shape)
        return out
    except SnapshotError:
        raise
    except Exception as e:  # malformed JSON, unknown dtype, bad shapes: all corruption
        raise SnapshotError(f"{where} does not decode: {e!r}") from None


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
    error the previous file at `path` is untouched."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{uuid.uuid4().hex[:8]}.tmp")
    try:
        with open(tmp, "wb") as f:
            f.write(MAGIC + struct.pack("<I", FORMAT_VERSION))
            writer = _Writer(f)
            try:
                chunks, offset, codec = [], _PREFIX_LEN, "lz4"
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
                        crc = zlib.crc32(d, crc)
                    writer.put(data)
                    chunks.append(Chunk(offset, length, raw_len, crc, this))
                    offset += length
            finally:
                writer.finish()
            header = msgspec.json.encode(SnapshotHeader(
                format_version=FORMAT_VERSION, created_unix_s=time.time(), chunks=chunks,
                **fields))
            f.write(header)
            f.write(_FOOTER.pack(len(header), zlib.crc32(header)) + END_MAGIC)
            f.flush()
            os.fsync(f.fileno())
            size = f.tell()
        _replace_releasing_later(tmp, path)
        fsync_dir(path.parent)
        return size
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def _replace_releasing_later(tmp: Path, path: Path) -> None:
    """os.replace(tmp, path), but the replaced file's storage is released by a background
    thread: renaming over a large file frees its blocks inside rename() (30 ms for 128 MiB
    here), on the spill's critical path. Holding an fd across the rename moves that work to
    the fd's close."""
    try:
        old = os.open(path, os.O_RDONLY)
    except OSError:
        old = None
    try:
        os.replace(tmp, path)
    finally:
        if old is not None:
            threading.Thread(target=os.close, args=(old,), daemon=True).start()


def read_header(path: Path) -> SnapshotHeader:
    """Parse and validate a snapshot's header (no payload is read)."""
    path = Path(path)
    try:
        with open(path, "rb") as f:
            prefix = f.read(_PREFIX_LEN)
            size = os.fstat(f.fileno()).st_size
            if len(prefix) < _PREFIX_LEN or prefix[: len(MAGIC)] != MAGIC:
                raise SnapshotError(f"{path}: not a kvsession snapshot (bad magic)")
            (version,) = struct.unpack("<I", prefix[len(MAGIC):])
            if version != FORMAT_VERSION:
                raise SnapshotError(f"{path}: unknown snapshot format version {version} "
                                    f"(this build reads version {FORMAT_VERSION})")
            if size < _PREFIX_LEN + _FOOTER_LEN:
                raise SnapshotError(f"{path}: truncated (no footer)")
            f.seek(size - _FOOTER_LEN)
            footer = f.read(_FOOTER_LEN)
            if footer[_FOOTER.size:] != END_MAGIC:
                raise SnapshotError(f"{path}: truncated or corrupted (bad footer)")
            header_len, crc = _FOOTER.unpack(footer[: _FOOTER.size])
            start = size - _FOOTER_LEN - header_len
            if header_len > MAX_HEADER_BYTES or start < _PREFIX_LEN:
                raise SnapshotError(f"{path}: corrupted footer (header length {header_len})")
            f.seek(start)
            raw = f.read(header_len)
    except OSError as e:
        raise SnapshotError(f"{path}: cannot read: {e}") from None
    if zlib.crc32(raw) != crc:
        raise SnapshotError(f"{path}: header checksum mismatch (corrupted)")
    try:
        header = msgspec.json.decode(raw, type=SnapshotHeader)
    except (msgspec.DecodeError, msgspec.ValidationError) as e:
        raise SnapshotError(f"{path}: malformed header: {e}") from None
    _check_layout(path, header, start)
    return header


def _check_layout(path: Path, h: SnapshotHeader, payload_end: int) -> None:
    bs = h.block_size
    if bs < 1 or h.num_layers < 1 or h.num_kv_heads < 1 or h.head_dim < 1:
        raise SnapshotError(f"{path}: header has an invalid geometry")
    if h.num_blocks != blocks_for(len(h.token_ids), bs):
        raise SnapshotError(f"{path}: header does not match the payload: "
                            f"{len(h.token_ids)} tokens but {h.num_blocks} blocks")
    if len(h.block_hashes) != len(h.token_ids) // bs:
        raise SnapshotError(f"{path}: header does not match the payload: block hashes")
    pos = _PREFIX_LEN
    for c in h.chunks:
        if c.offset != pos or c.length <= 0 or c.offset + c.length > payload_end:
            raise SnapshotError(f"{path}: header does not match the payload: chunk at "
                                f"{c.offset} (+{c.length}) outside the payload")
        pos += c.length
    if pos != payload_end:
        raise SnapshotError(f"{path}: header does not match the payload: "
                            f"{payload_end - pos} unaccounted bytes")


def check_compatible(path: Path, h: SnapshotHeader, expected: dict) -> None:
    """Raise SnapshotError naming the first field where the file differs from `expected`
    (model_fingerprint, tokenizer_digest, template_digest, kv_dtype, block_size, ...)."""
    for name, want in expected.items():
        got = getattr(h, name)
        if got != want:
            what = name.replace("_", " ")
            raise SnapshotError(f"{path}: written for another {what} ({got!r}, this engine "
                                f"has {want!r})")


def block_shapes(h: SnapshotHeader) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """Expected name -> (shape, dtype) of one block's tensors."""
    from kvsession.config import KV_DTYPES

    kv = KV_DTYPES[h.kv_dtype]
    shape = (h.num_layers, h.block_size, h.num_kv_heads)
    out = {"k": (shape + (h.head_dim,), kv), "v": (shape + (h.head_dim,), kv)}
    if "k_scale" in h.tensor_names:
        out |= {"k_scale": (shape, torch.float16), "v_scale": (shape, torch.float16)}
    return out


def _decode_chunk(path: Path, h: SnapshotHeader, i: int, comp: memoryview,
                  want: dict) -> dict[str, torch.Tensor]:
    c = h.chunks[i]
    if len(comp) != c.length:
        raise SnapshotError(f"{path}: truncated in block {i}")
    if zlib.crc32(comp) != c.crc32:
        raise SnapshotError(f"{path}: checksum mismatch in block {i} (corrupted)")
    if c.codec == "lz4":
        try:
            raw = memoryview(lz4.frame.decompress(comp, return_bytearray=True))
        except Exception as e:  # lz4 raises its own types on bad input
            raise SnapshotError(f"{path}: block {i} does not decompress: {e!r}") from None
    elif c.codec == "none":
        raw = comp
    else:
        raise SnapshotError(f"{path}: block {i} has unknown codec {c.codec!r}")
    tensors = decode_block(raw, f"{path}: block {i}")
    if len(raw) != c.raw_length or set(tensors) != set(want):
        raise SnapshotError(f"{path}: block {i} does not match the header")
    for name, (shape, dtype) in want.items():
        t = tensors[name]
        if tuple(t.shape) != shape or t.dtype != dtype:
            raise SnapshotError(f"{path}: block {i} tensor {name!r} is {tuple(t.shape)} "
                                f"{t.dtype}, the header says {shape} {dtype}")
    return tensors


def read_blocks(path: Path, h: SnapshotHeader, indices: list[int], depth: int = 8,
                dest: Callable[[int], list[memoryview]] | None = None
                ) -> Iterator[tuple[int, dict[str, torch.Tensor] | None]]:
    """Validated tensors of the given blocks, in order. A reader thread keeps the disk busy
    while the caller checks, decodes and copies the previous block. The yielded tensors
    view a ring of `depth + 2` reused buffers (fresh multi-MiB buffers cost a page fault per
    4 KiB): each block's tensors are valid until the caller asks for the next one.

    `dest(i)`, when given, names the caller's memory for block i's data in file order
    (sorted tensor names, each tensor's bytes in order). A stored (codec "none") chunk is
    then read straight into it with one preadv, so the bytes cross memory once, and
    verified there (prefix, checksum); such blocks yield None. dest's memory is written
    before it is verified: it must be memory nobody reads until the load succeeds."""
    if not indices:
        return
    if not hasattr(os, "preadv"):  # not on every platform (Windows): decode and copy
        dest = None
    q: queue.Queue = queue.Queue(maxsize=depth)
    stop = threading.Event()
    size = max(h.chunks[i].length for i in indices)
    ring = [bytearray(size) for _ in range(min(depth + 2, len(indices)))]
    want = block_shapes(h)
    prefix = block_prefix(want)

    def reader():
        try:
            with open(path, "rb", buffering=0) as f:
                if hasattr(os, "posix_fadvise"):  # ask the kernel to read ahead, all of it
                    first, last = h.chunks[indices[0]], h.chunks[indices[-1]]
                    os.posix_fadvise(f.fileno(), first.offset,
                                     last.offset + last.length - first.offset,
                                     os.POSIX_FADV_WILLNEED)
                for k, i in enumerate(indices):
                    if stop.is_set():
                        break
                    c = h.chunks[i]
                    pieces = dest(i) if dest is not None and c.codec == "none" else None
                    if pieces is not None and c.length == c.raw_length == len(prefix) + sum(
                            len(p) for p in pieces):
                        head = bytearray(len(prefix))
                        n = os.preadv(f.fileno(), [head, *pieces], c.offset)
                        crc = zlib.crc32(head)  # here: the bytes are hot in this core's cache
                        for p in pieces:
                            crc = zlib.crc32(p, crc)
                        q.put((i, (n, head, crc)))
                        continue
                    f.seek(c.offset)
                    buf = memoryview(ring[k % len(ring)])[: c.length]
                    n = f.readinto(buf)
                    q.put((i, buf[:n]))
        except OSError as e:
            q.put(SnapshotError(f"{path}: cannot read: {e}"))
        q.put(None)

    thread = threading.Thread(target=reader, daemon=True)
    thread.start()
    try:
        while (item := q.get()) is not None:
            if isinstance(item, SnapshotError):
                raise item
            i, got = item
            if isinstance(got, tuple):
                _verify_in_place(path, h, i, *got, prefix)
                yield i, None
            else:
                yield i, _decode_chunk(path, h, i, got, want)
    finally:
        stop.set()
        while thread.is_alive():  # unblock a reader waiting on a full queue
            try:
                q.get_nowait()
            except queue.Empty:
                thread.join(0.01)


def _verify_in_place(path: Path, h: SnapshotHeader, i: int, n: int, head: bytearray,
                     crc: int, prefix: bytes) -> None:
    """The checks _decode_chunk makes, for a stored chunk read into the caller's memory:
    length, checksum (computed by the reader), and a prefix (safetensors header) equal to
    the expected layout's."""
    c = h.chunks[i]
    if n != c.length:
        raise SnapshotError(f"{path}: truncated in block {i}")
    if crc != c.crc32:
        raise SnapshotError(f"{path}: checksum mismatch in block {i} (corrupted)")
    if bytes(head) != prefix:
        raise SnapshotError(f"{path}: block {i} does not match the header")


def describe(h: SnapshotHeader, path: Path) -> str:
    """The header in human form (`python -m kvsession inspect`)."""
    size = Path(path).stat().st_size
    raw = sum(c.raw_length for c in h.chunks)
    codecs = sorted({c.codec for c in h.chunks})
    roles = {}
    for m in h.messages:
        roles[m.get("role")] = roles.get(m.get("role"), 0) + 1
    created = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(h.created_unix_s))
    return "\n".join([
        f"file:            {path} ({size} bytes, payload {raw} bytes raw, codecs {codecs})",
        f"format:          kvsession snapshot v{h.format_version}, written {created}",
        f"session:         {h.session_id}",
        f"model:           {h.model_fingerprint[:16]}... ({h.num_layers} layers, "
        f"{h.num_kv_heads} KV heads x {h.head_dim})",
        f"tokenizer:       {h.tokenizer_digest[:16]}...  template {h.template_digest[:16]}...",
        f"kv cache:        {h.kv_dtype}, block size {h.block_size}, {h.num_blocks} blocks, "
        f"{len(h.token_ids)} tokens",
        f"messages:        {len(h.messages)} "
        + ", ".join(f"{k}: {v}" for k, v in roles.items()),
        f"sampling:        {h.sampling}",
    ])
