"""Reading `.kvs` snapshots: the format (layout, schema, bounds) is defined in
kvsession/tiers/snapshot_format.py (and docs/snapshot-format.md); this module is its reader.

A snapshot may come from anywhere (a copied file, a crafted one), so nothing read from it
is trusted before it is bounded. The reader never allocates in proportion to a number the
file states; every allocation is bounded by what was already checked:

- the header is at most MAX_HEADER_BYTES; it is decoded in stages: first its scalars
  (geometry, identity) with every variable-length field left raw (msgspec.Raw: a view, no
  objects), so an incompatible or odd file is refused before anything large is built;
- then the chunk table, whose entries must tile the payload exactly and each declare the
  exact raw size of one block of the declared geometry; the token list may then be at most
  block_size tokens per chunk (checked on its byte length before decoding), the hash list
  one per full block, messages a count bounded by the tokens plus a constant;
- every field has an exact type (no free-form dicts or lists), so deep nesting or objects
  where strings belong are refused at the first wrong byte;
- a chunk is decompressed with a limit of its declared raw size (an lz4 bomb stops there)
  and its safetensors prefix is compared byte for byte with the one the geometry implies:
  no JSON from a chunk is parsed.

Every failure is a SnapshotError naming the file and the cause. Files are opened without
blocking and must be regular files (a FIFO named *.kvs is refused, never waited on).
"""

from __future__ import annotations

import math
import os
import queue
import struct
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import lz4.frame
import msgspec
import numpy as np
import torch

from kvsession.cache.block_pool import blocks_for
from kvsession.cache.identity import StorageIdentity
from kvsession.errors import SnapshotError
from kvsession.tiers.checksum import crc32
from kvsession.tiers.files import open_regular
from kvsession.tiers.snapshot_format import (
    END_MAGIC,
    FOOTER,
    FOOTER_LEN,
    FORMAT_VERSION,
    HASH_BYTES,
    KV_TENSOR_SETS,
    MAGIC,
    MAX_EXTRA_MESSAGES,
    MAX_HEADER_BYTES,
    MAX_LOG_TOKENS,
    MAX_SAMPLING_BYTES,
    PREFIX_LEN,
    TOKEN_ID_BYTES,
    Chunk,
    HexHash,
    HistoryState,
    SamplingFields,
    SnapshotFrame,
    SnapshotHeader,
    TokenId,
    block_prefix,
)


def _pread(f, n: int, offset: int) -> bytes:
    out = os.pread(f.fileno(), n, offset)
    while len(out) < n:  # pread may return short; a file that shrank ends the loop
        more = os.pread(f.fileno(), n - len(out), offset + len(out))
        if not more:
            break
        out += more
    return out


# ---- the header ------------------------------------------------------------------------

def read_frame(path: Path) -> tuple[SnapshotFrame, int]:
    """Magic, version, footer, header size bound and checksum, then the header's scalars.
    Returns the frame and where the payload ends. Reads no payload and builds no
    variable-length field: cheap, and what a directory scan checks."""
    path = Path(path)
    with open_regular(path) as f:
        try:
            size = os.fstat(f.fileno()).st_size
            prefix = _pread(f, PREFIX_LEN, 0)
            if len(prefix) < PREFIX_LEN or prefix[: len(MAGIC)] != MAGIC:
                raise SnapshotError(f"{path}: not a kvsession snapshot (bad magic)")
            (version,) = struct.unpack("<I", prefix[len(MAGIC):])
            if version != FORMAT_VERSION:
                raise SnapshotError(f"{path}: unknown snapshot format version {version} "
                                    f"(this build reads version {FORMAT_VERSION})")
            if size < PREFIX_LEN + FOOTER_LEN:
                raise SnapshotError(f"{path}: truncated (no footer)")
            footer = _pread(f, FOOTER_LEN, size - FOOTER_LEN)
            if footer[FOOTER.size:] != END_MAGIC:
                raise SnapshotError(f"{path}: truncated or corrupted (bad footer)")
            header_len, crc = FOOTER.unpack(footer[: FOOTER.size])
            start = size - FOOTER_LEN - header_len
            if start < PREFIX_LEN:
                raise SnapshotError(f"{path}: corrupted footer (header length {header_len})")
            if header_len > MAX_HEADER_BYTES:  # before reading it: the bound on all below
                raise SnapshotError(f"{path}: header of {header_len} bytes is over the "
                                    f"{MAX_HEADER_BYTES}-byte limit (corrupted or crafted)")
            raw = _pread(f, header_len, start)
        except OSError as e:
            raise SnapshotError(f"{path}: cannot read: {e}") from None
    if len(raw) != header_len:
        raise SnapshotError(f"{path}: truncated while reading the header")
    if crc32(raw) != crc:
        raise SnapshotError(f"{path}: header checksum mismatch (corrupted)")
    frame = _decode(path, "header", raw, SnapshotFrame)
    if frame.format_version != FORMAT_VERSION:
        raise SnapshotError(f"{path}: header says format version {frame.format_version}, "
                            f"the file {FORMAT_VERSION}")
    from kvsession.config import KV_DTYPES

    if frame.kv_dtype not in KV_DTYPES:
        raise SnapshotError(f"{path}: unknown kv dtype {frame.kv_dtype!r}")
    return frame, start


def _decode(path: Path, what: str, raw, typ, max_bytes: int | None = None):
    if max_bytes is not None and len(raw) > max_bytes:
        raise SnapshotError(f"{path}: header field {what} is {len(raw)} bytes, over its "
                            f"bound of {max_bytes} (corrupted or crafted)")
    try:
        return msgspec.json.decode(raw, type=typ)
    except (msgspec.MsgspecError, RecursionError, ValueError) as e:
        where = "header" if what == "header" else f"header field {what}"
        raise SnapshotError(f"{path}: malformed {where}: {e}") from None


def read_header(path: Path, expect: StorageIdentity | None = None) -> SnapshotHeader:
    """Parse and validate a snapshot's header (no payload is read). With `expect` (an
    engine's identity, as its header fields: check_compatible's, tensor_names included) a
    file for another engine is refused right after the scalars, before its variable-length
    fields are decoded."""
    path = Path(path)
    frame, payload_end = read_frame(path)
    expect = None if expect is None else expect.header_fields()
    if expect is not None:
        check_compatible(path, frame, {k: v for k, v in expect.items() if k != "tensor_names"})
    names = _decode(path, "tensor_names", frame.tensor_names, list[str], 256)
    if len(set(names)) != len(names) or set(names) not in KV_TENSOR_SETS:
        raise SnapshotError(f"{path}: header names unknown KV tensors {names}")
    if expect is not None and set(names) != set(expect["tensor_names"]):
        raise SnapshotError(f"{path}: tensors {names} do not match this engine's cache "
                            f"{expect['tensor_names']}")
    chunks = _decode(path, "chunks", frame.chunks, list[Chunk])
    _check_chunks(path, frame, names, chunks, payload_end)
    bs, num_blocks = frame.block_size, len(chunks)
    tokens = _decode(path, "token_ids", frame.token_ids, list[TokenId],
                     num_blocks * bs * TOKEN_ID_BYTES + 2)
    if blocks_for(len(tokens), bs) != num_blocks:
        raise SnapshotError(f"{path}: header does not match the payload: "
                            f"{len(tokens)} tokens but {num_blocks} blocks")
    hashes = _decode(path, "block_hashes", frame.block_hashes, list[HexHash],
                     len(tokens) // bs * HASH_BYTES + 2)
    if len(hashes) != len(tokens) // bs:
        raise SnapshotError(f"{path}: header does not match the payload: {len(hashes)} "
                            f"block hashes for {len(tokens) // bs} full blocks")
    sampling = _decode(path, "sampling", frame.sampling, SamplingFields, MAX_SAMPLING_BYTES)
    system = _decode(path, "system", frame.system, str | None)
    max_messages = MAX_EXTRA_MESSAGES + len(tokens)
    if _more_objects_than(frame.messages, max_messages):
        raise SnapshotError(f"{path}: more than {max_messages} messages for "
                            f"{len(tokens)} tokens (corrupted or crafted)")
    messages = _decode(path, "messages", frame.messages, list[dict[str, str]])
    for i, m in enumerate(messages):
        if "role" not in m or "content" not in m:
            raise SnapshotError(f"{path}: malformed header field messages: message {i} "
                                f"has no role or no content")
    return SnapshotHeader(
        format_version=frame.format_version, session_id=frame.session_id,
        created_unix_s=frame.created_unix_s, model_fingerprint=frame.model_fingerprint,
        tokenizer_digest=frame.tokenizer_digest, template_digest=frame.template_digest,
        kv_dtype=frame.kv_dtype, block_size=bs, num_layers=frame.num_layers,
        num_kv_heads=frame.num_kv_heads, head_dim=frame.head_dim, tensor_names=names,
        token_ids=tokens, messages=messages,
        sampling={k: v for k, v in msgspec.structs.asdict(sampling).items()
                  if v is not msgspec.UNSET},
        system=system, block_hashes=hashes, chunks=chunks,
        history=_decode_history(path, frame.history))


def _decode_history(path: Path, raw) -> dict | None:
    state = _decode(path, "history", raw, HistoryState | None,
                    MAX_LOG_TOKENS * TOKEN_ID_BYTES + (1 << 21))
    return None if state is None else msgspec.structs.asdict(state)


def _more_objects_than(raw, limit: int) -> bool:
    """Whether the JSON text `raw` holds more than `limit` objects (its '{' outside
    strings), found without building anything per object: a header's messages are counted
    before their dicts exist. The plain count of '{' is an upper bound and usually settles
    it; past the limit, escapes are removed and quote parity is computed a MiB at a time,
    so braces inside strings (code in a conversation) do not count."""
    data = bytes(raw)
    if data.count(b"{") <= limit:
        return False
    data = np.frombuffer(data.replace(b"\\\\", b"").replace(b'\\"', b""), np.uint8)
    count, inside, step = 0, 0, 1 << 20
    for at in range(0, len(data), step):
        part = data[at:at + step]
        parity = np.bitwise_xor.accumulate((part == ord('"')).view(np.uint8)) ^ inside
        count += int(np.count_nonzero((part == ord("{")) & (parity == 0)))
        inside = int(parity[-1])
    return count > limit


def _check_chunks(path: Path, frame: SnapshotFrame, names: list[str], chunks: list[Chunk],
                  payload_end: int) -> None:
    """Chunks tile the payload exactly; each declares the raw size of one block of the
    declared geometry (so nothing decompresses past it) and is no larger than that (the
    writer stores a block as is when lz4 does not shrink it)."""
    raw_len = block_raw_length(frame, names)
    pos = PREFIX_LEN
    for i, c in enumerate(chunks):
        if c.offset != pos or c.offset + c.length > payload_end:
            raise SnapshotError(f"{path}: header does not match the payload: chunk at "
                                f"{c.offset} (+{c.length}) outside the payload")
        if c.raw_length != raw_len or c.length > raw_len or (
                c.codec == "none" and c.length != raw_len):
            raise SnapshotError(f"{path}: header does not match the payload: block {i} "
                                f"declares {c.length} bytes ({c.raw_length} raw, "
                                f"{c.codec}), a block of this geometry is {raw_len} raw")
        pos += c.length
    if pos != payload_end:
        raise SnapshotError(f"{path}: header does not match the payload: "
                            f"{payload_end - pos} unaccounted bytes")


def check_compatible(path: Path, h, expected: dict) -> None:
    """Raise SnapshotError naming the first field where the file (a header or its frame)
    differs from `expected` (model_fingerprint, tokenizer_digest, template_digest,
    kv_dtype, block_size, ...)."""
    for name, want in expected.items():
        got = getattr(h, name)
        if got != want:
            what = name.replace("_", " ")
            raise SnapshotError(f"{path}: written for another {what} ({got!r}, this engine "
                                f"has {want!r})")


def block_shapes(h, names: list[str] | None = None
                 ) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """Expected name -> (shape, dtype) of one block's tensors (h: a header or frame)."""
    from kvsession.config import KV_DTYPES

    kv = KV_DTYPES[h.kv_dtype]
    names = h.tensor_names if names is None else names
    shape = (h.num_layers, h.block_size, h.num_kv_heads)
    out = {"k": (shape + (h.head_dim,), kv), "v": (shape + (h.head_dim,), kv)}
    if "k_scale" in names:
        out |= {"k_scale": (shape, torch.float16), "v_scale": (shape, torch.float16)}
    return out


def _nbytes(shape: tuple[int, ...], dtype: torch.dtype) -> int:
    return math.prod(shape) * torch.empty((), dtype=dtype).element_size()


def block_raw_length(h, names: list[str] | None = None) -> int:
    """Bytes of one block's chunk before compression: safetensors prefix and data."""
    want = block_shapes(h, names)
    return len(block_prefix(want)) + sum(_nbytes(s, d) for s, d in want.values())


# ---- the payload -----------------------------------------------------------------------

def _decompress(path: Path, i: int, comp, raw_length: int) -> bytearray:
    """lz4-frame decode of exactly raw_length bytes: output beyond it is never produced."""
    d = lz4.frame.LZ4FrameDecompressor(return_bytearray=True)
    try:
        raw = d.decompress(comp, max_length=raw_length)
    except Exception as e:  # lz4 raises its own types on bad input
        raise SnapshotError(f"{path}: block {i} does not decompress: {e!r}") from None
    if len(raw) != raw_length or not d.eof or d.unused_data:
        raise SnapshotError(f"{path}: block {i} does not decompress to its declared "
                            f"{raw_length} bytes (corrupted or crafted)")
    return raw


def _tensors(path: Path, i: int, raw, want: dict, prefix: bytes) -> dict[str, torch.Tensor]:
    """The block's tensors viewing `raw`, whose safetensors prefix must be the one the
    geometry implies, byte for byte (the writer's canonical encoding)."""
    if len(raw) != len(prefix) + sum(_nbytes(s, d) for s, d in want.values()) or \
            bytes(raw[: len(prefix)]) != prefix:
        raise SnapshotError(f"{path}: block {i} does not match the header")
    raw = raw if isinstance(raw, memoryview) else memoryview(raw)
    out, at = {}, len(prefix)
    for name in sorted(want):
        shape, dtype = want[name]
        n = _nbytes(shape, dtype)
        out[name] = torch.frombuffer(raw, dtype=torch.uint8, count=n, offset=at) \
            .view(dtype).reshape(shape)
        at += n
    return out


def _decode_chunk(path: Path, h: SnapshotHeader, i: int, comp: memoryview, want: dict,
                  prefix: bytes) -> dict[str, torch.Tensor]:
    c = h.chunks[i]
    if len(comp) != c.length:
        raise SnapshotError(f"{path}: truncated in block {i}")
    if crc32(comp) != c.crc32:
        raise SnapshotError(f"{path}: checksum mismatch in block {i} (corrupted)")
    raw = _decompress(path, i, comp, c.raw_length) if c.codec == "lz4" else comp
    return _tensors(path, i, raw, want, prefix)


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
    before it is verified: it must be memory nobody reads until the load succeeds. When
    every wanted chunk is stored, the reads run on the caller's thread: the caller has
    nothing left to do per block, and a hand-over per block to a reader thread cost more
    than the reads (a resumed session's 2k tokens: ~12 ms instead of ~5).

    `h` comes from read_header: every chunk is at most one block's raw size, which bounds
    the ring."""
    if not indices:
        return
    if not hasattr(os, "preadv"):  # not on every platform (Windows): decode and copy
        dest = None
    want = block_shapes(h)
    prefix = block_prefix(want)
    raw_len = len(prefix) + sum(_nbytes(s, d) for s, d in want.values())
    if any(h.chunks[i].length > raw_len for i in indices):
        raise SnapshotError(f"{path}: a chunk is larger than a block (corrupted or crafted)")
    if dest is not None and all(h.chunks[i].codec == "none" for i in indices):
        yield from _read_in_place(path, h, indices, dest, want, prefix)
        return
    q: queue.Queue = queue.Queue(maxsize=depth)
    stop = threading.Event()
    size = max(h.chunks[i].length for i in indices)
    ring = [bytearray(size) for _ in range(min(depth + 2, len(indices)))]

    def reader():
        try:
            with open_regular(path) as f:
                _will_need(f, h, indices)
                for k, i in enumerate(indices):
                    if stop.is_set():
                        break
                    c = h.chunks[i]
                    got = _preadv_verified(f, c, dest, i, prefix) if dest is not None \
                        and c.codec == "none" else None
                    if got is not None:
                        q.put((i, got))
                        continue
                    f.seek(c.offset)
                    buf = memoryview(ring[k % len(ring)])[: c.length]
                    n = f.readinto(buf) or 0
                    q.put((i, buf[:n]))
        except SnapshotError as e:
            q.put(e)
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
                yield i, _decode_chunk(path, h, i, got, want, prefix)
    finally:
        stop.set()
        while thread.is_alive():  # unblock a reader waiting on a full queue
            try:
                q.get_nowait()
            except queue.Empty:
                thread.join(0.01)


def _read_in_place(path: Path, h: SnapshotHeader, indices: list[int],
                   dest: Callable[[int], list[memoryview]], want: dict, prefix: bytes
                   ) -> Iterator[tuple[int, dict[str, torch.Tensor] | None]]:
    """read_blocks of stored chunks into `dest`, on this thread."""
    try:
        with open_regular(path) as f:
            _will_need(f, h, indices)
            for i in indices:
                c = h.chunks[i]
                got = _preadv_verified(f, c, dest, i, prefix)
                if got is None:  # not the layout dest expects: decoding names the cause
                    f.seek(c.offset)
                    yield i, _decode_chunk(path, h, i, f.read(c.length), want, prefix)
                    continue
                _verify_in_place(path, h, i, *got, prefix)
                yield i, None
    except OSError as e:
        raise SnapshotError(f"{path}: cannot read: {e}") from None


def _will_need(f, h: SnapshotHeader, indices: list[int]) -> None:
    """Ask the kernel to read ahead the span of the wanted chunks, all of it."""
    if hasattr(os, "posix_fadvise"):
        first, last = h.chunks[indices[0]], h.chunks[indices[-1]]
        os.posix_fadvise(f.fileno(), first.offset, last.offset + last.length - first.offset,
                         os.POSIX_FADV_WILLNEED)


def _preadv_verified(f, c: Chunk, dest: Callable[[int], list[memoryview]], i: int,
                     prefix: bytes) -> tuple[int, bytearray, int] | None:
    """A stored chunk read with one preadv into dest(i): (bytes read, its prefix, the
    checksum), for _verify_in_place; None when the chunk's length does not fit dest."""
    pieces = dest(i)
    if not (c.length == c.raw_length == len(prefix) + sum(len(p) for p in pieces)):
        return None
    head = bytearray(len(prefix))
    n = os.preadv(f.fileno(), [head, *pieces], c.offset)
    crc = crc32(head)  # here: the bytes are hot in this core's cache
    for p in pieces:
        crc = crc32(p, crc)
    return n, head, crc


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
    """The header in human form (`python -m kvsession inspect`). Every value was bounded
    and typed by read_header, so formatting it cannot fail on odd values."""
    try:
        size = os.stat(path).st_size
    except OSError as e:
        raise SnapshotError(f"{path}: cannot read: {e}") from None
    raw = sum(c.raw_length for c in h.chunks)
    codecs = sorted({c.codec for c in h.chunks})
    roles: dict[str, int] = {}
    for m in h.messages:
        roles[m.get("role", "?")] = roles.get(m.get("role", "?"), 0) + 1
    created = time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(h.created_unix_s))
    return "\n".join([
        f"file:            {path} ({size} bytes, payload {raw} bytes raw, codecs {codecs})",
        f"format:          kvsession snapshot v{h.format_version}, written {created} UTC",
        f"session:         {h.session_id}",
        f"model:           {h.model_fingerprint[:16]}... ({h.num_layers} layers, "
        f"{h.num_kv_heads} KV heads x {h.head_dim})",
        f"tokenizer:       {h.tokenizer_digest[:16]}...  template {h.template_digest[:16]}...",
        f"kv cache:        {h.kv_dtype}, block size {h.block_size}, {h.num_blocks} blocks, "
        f"{len(h.token_ids)} tokens",
        f"messages:        {len(h.messages)} "
        + ", ".join(f"{k!r}: {v}" for k, v in roles.items()),
        f"sampling:        {h.sampling}",
    ])
