"""One KV block as self-describing bytes: the record the disk cache's slots and the object
store's objects hold, so that neither trusts where the bytes came from.

    [ header: magic | identity digest | block hash | parent hash | depth | hits |
      payload crc32 | token ids (block_size x uint32) | header crc32 ][ payload ]

The payload is every KV tensor's block, all layers, tensors in name order (the bytes of
`tensor[:, block]`). A record is used only after every check passes: the header's own
checksum, the magic, the identity it was written under (model, tokenizer, template, KV
dtype, block size, geometry: `StorageIdentity.header_fields`), the block hash and the token
ids the reader expects, and the payload's checksum. Anything else (a torn write, another
model's block, a changed byte) is a miss, never wrong KV.
"""

from __future__ import annotations

import hashlib
import json
import struct
import zlib
from typing import NamedTuple

import torch

from kvsession.kernels.reference import raw_view

MAGIC = b"KVSBLK01"
MAX_HASH_BYTES = 64
# magic, identity digest, hash length + hash, parent flag + length + hash, depth, hits,
# payload crc; then the token ids and the header's own crc
_FIXED = struct.Struct(f"<8s16sB{MAX_HASH_BYTES}sBB{MAX_HASH_BYTES}sIII")


class RecordHeader(NamedTuple):
    block_hash: bytes
    parent_hash: bytes | None
    token_ids: tuple[int, ...]
    depth: int
    hits: int
    payload_crc: int


class BlockRecords:
    """The record layout of one engine's KV blocks (its tensors' geometry, its identity)."""

    def __init__(self, tensors: dict[str, torch.Tensor], block_size: int,
                 identity_fields: dict):
        """tensors: the device pool's KV tensors ([num_layers, num_blocks, *block] each),
        whose geometry every payload has. identity_fields: what stored KV is valid under
        (StorageIdentity.header_fields); a record written under another identity is never
        used."""
        self.block_size = block_size
        # (name, bytes of one block, all layers) in payload order
        self.parts = [(n, t[:, 0].numel() * t.element_size()) for n, t in sorted(tensors.items())]
        self.payload_bytes = sum(p[1] for p in self.parts)
        self.tokens = struct.Struct(f"<{block_size}I")
        self.header_bytes = _FIXED.size + self.tokens.size + 4
        self.record_bytes = self.header_bytes + self.payload_bytes
        self.identity = hashlib.blake2b(json.dumps(identity_fields, sort_keys=True).encode(),
                                        digest_size=16).digest()

    def header(self, block_hash: bytes, parent: bytes | None, tokens, depth: int,
               hits: int, payload_crc: int) -> bytes:
        fixed = _FIXED.pack(MAGIC, self.identity, len(block_hash), block_hash,
                            parent is not None, len(parent or b""), parent or b"", depth,
                            hits, payload_crc)
        head = fixed + self.tokens.pack(*tokens)
        return head + struct.pack("<I", zlib.crc32(head))

    def read_header(self, raw: bytes) -> RecordHeader | None:
        """The fields of an intact header written under this identity, else None."""
        if len(raw) != self.header_bytes:
            return None
        head, (crc,) = raw[:-4], struct.unpack("<I", raw[-4:])
        if zlib.crc32(head) != crc:
            return None
        magic, ident, hlen, h, has_parent, plen, p, depth, hits, payload_crc = \
            _FIXED.unpack(head[:_FIXED.size])
        if magic != MAGIC or ident != self.identity or not 0 < hlen <= MAX_HASH_BYTES \
                or plen > MAX_HASH_BYTES:
            return None
        tokens = self.tokens.unpack(head[_FIXED.size:])
        return RecordHeader(h[:hlen], (p[:plen] if has_parent else None), tokens, depth, hits,
                            payload_crc)

    def payload(self, src: dict[str, torch.Tensor], src_id: int) -> tuple[list[bytes], int]:
        """Block `src_id` of `src` (tensors laid out as the pool's) as payload parts, and
        their crc32."""
        parts = [src[name][:, src_id].contiguous().cpu().view(torch.uint8).numpy().tobytes()
                 for name, _ in self.parts]
        crc = 0
        for part in parts:
            crc = zlib.crc32(part, crc)
        return parts, crc

    def encode(self, src: dict[str, torch.Tensor], src_id: int, block_hash: bytes,
               tokens, parent: bytes | None, depth: int, hits: int) -> bytes:
        """A whole record of block `src_id` of `src`."""
        parts, crc = self.payload(src, src_id)
        return b"".join([self.header(block_hash, parent, tokens, depth, hits, crc), *parts])

    def check(self, raw, block_hash: bytes, tokens) -> memoryview | None:
        """The payload of record `raw` when it is intact and holds block `block_hash` over
        `tokens` under this identity, else None."""
        if len(raw) != self.record_bytes:
            return None
        meta = self.read_header(bytes(raw[:self.header_bytes]))
        payload = memoryview(raw)[self.header_bytes:]
        if meta is None or meta.block_hash != block_hash or \
                tuple(meta.token_ids) != tuple(tokens) or zlib.crc32(payload) != meta.payload_crc:
            return None
        return payload

    def copy_into(self, payload: memoryview, dst: dict[str, torch.Tensor], dst_id: int) -> None:
        """A checked payload into block `dst_id` of `dst`, synchronously (the caller may
        reuse the buffer at once)."""
        off = 0
        for name, nbytes in self.parts:
            block = raw_view(dst[name][:, dst_id])
            data = torch.frombuffer(payload[off:off + nbytes], dtype=torch.uint8)
            block.copy_(data.view(block.dtype).view(block.shape))
            off += nbytes
