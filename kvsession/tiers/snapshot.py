"""The `.kvs` session snapshot format: one self-describing file per session.

Layout (little endian):

    MAGIC (8) | u32 format version
    block chunks: for each KV block, lz4-frame(safetensors({name: [num_layers, block_size,
        ...]})) -- K, V and, for fp8, their scales -- written as produced (streaming)
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

import os
import struct
import time
import uuid
import zlib
from collections.abc import Iterable
from pathlib import Path

import lz4.frame
import msgspec
import torch
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save

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


def write_snapshot(path: Path, fields: dict, blocks: Iterable[dict[str, torch.Tensor]]) -> int:
    """Write atomically. `fields` are SnapshotHeader fields except format_version, chunks
    and created_unix_s; `blocks` yields each block's tensors (moved to CPU here). Returns the
    file size. On any error the previous file at `path` is untouched."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{uuid.uuid4().hex[:8]}.tmp")
    try:
        with open(tmp, "wb") as f:
            f.write(MAGIC + struct.pack("<I", FORMAT_VERSION))
            chunks = []
            for tensors in blocks:
                raw = st_save({k: v.detach().to("cpu").contiguous() for k, v in tensors.items()})
                comp = lz4.frame.compress(raw)
                chunks.append(Chunk(f.tell(), len(comp), len(raw), zlib.crc32(comp)))
                f.write(comp)
            header = msgspec.json.encode(SnapshotHeader(
                format_version=FORMAT_VERSION, created_unix_s=time.time(), chunks=chunks,
                **fields))
            f.write(header)
            f.write(_FOOTER.pack(len(header), zlib.crc32(header)) + END_MAGIC)
            f.flush()
            os.fsync(f.fileno())
            size = f.tell()
        os.replace(tmp, path)
        fsync_dir(path.parent)
        return size
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


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
    if h.num_blocks != -(-len(h.token_ids) // bs):
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


def read_block(f, path: Path, h: SnapshotHeader, i: int) -> dict[str, torch.Tensor]:
    """Block `i`'s tensors from an open snapshot, validated."""
    c = h.chunks[i]
    f.seek(c.offset)
    comp = f.read(c.length)
    if len(comp) != c.length:
        raise SnapshotError(f"{path}: truncated in block {i}")
    if zlib.crc32(comp) != c.crc32:
        raise SnapshotError(f"{path}: checksum mismatch in block {i} (corrupted)")
    try:
        raw = lz4.frame.decompress(comp)
        tensors = st_load(raw)
    except Exception as e:  # lz4 and safetensors raise their own types on bad input
        raise SnapshotError(f"{path}: block {i} does not decode: {e}") from None
    want = block_shapes(h)
    if len(raw) != c.raw_length or set(tensors) != set(want):
        raise SnapshotError(f"{path}: block {i} does not match the header")
    for name, (shape, dtype) in want.items():
        t = tensors[name]
        if tuple(t.shape) != shape or t.dtype != dtype:
            raise SnapshotError(f"{path}: block {i} tensor {name!r} is {tuple(t.shape)} "
                                f"{t.dtype}, the header says {shape} {dtype}")
    return tensors


def describe(h: SnapshotHeader, path: Path) -> str:
    """The header in human form (`python -m kvsession inspect`)."""
    size = Path(path).stat().st_size
    raw = sum(c.raw_length for c in h.chunks)
    roles = {}
    for m in h.messages:
        roles[m.get("role")] = roles.get(m.get("role"), 0) + 1
    created = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(h.created_unix_s))
    return "\n".join([
        f"file:            {path} ({size} bytes, payload {raw} bytes before lz4)",
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
