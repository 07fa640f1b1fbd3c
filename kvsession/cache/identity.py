"""The storage identity: what stored KV bytes are valid under, assembled once (by the
Runtime) and used by everything that stores, moves or reuses them.

- block hashes (`hasher`): the model fingerprint, KV dtype, block size and layout version
  root the chain;
- a remote worker's handshake (`digest`, connector/base.compat_hash): the same, with the
  compute dtype and the protocol version;
- snapshots and segments (`header_fields`, tiers/snapshot*.py, tiers/segments.py): all of
  it, the tokenizer and template digests and the block geometry too;
- the session log (`log_fields`, tiers/wal.py): model, tokenizer, template, KV dtype,
  block size.

Files keep one typed, bounded schema for these fields (they are untrusted input:
tiers/snapshot_format.StoredIdentity, and StoredGeometry with the block geometry), which
the log's Identity, the segments' SegmentIdentity and a snapshot header's frame extend;
this is the engine's side they are compared with.
"""

from __future__ import annotations

import hashlib

import msgspec

from kvsession.cache.hashing import LAYOUT_VERSION, BlockHasher, HashFn, sha256

# what a session log records of the identity (its on-disk Identity)
LOG_FIELDS = ("model_fingerprint", "tokenizer_digest", "template_digest", "kv_dtype",
              "block_size")


class StorageIdentity(msgspec.Struct, frozen=True):
    """What makes KV bytes interchangeable: the same model weights (the fingerprint of the
    config and the weight files), KV dtype, block size and block layout; for stored
    sessions also the same tokenizer and chat template (their token ids must mean the same)
    and block geometry (layers, KV heads, head dim, tensor names)."""

    model_fingerprint: str
    kv_dtype: str
    block_size: int
    tokenizer_digest: str = ""
    template_digest: str = ""
    num_layers: int = 0
    num_kv_heads: int = 0
    head_dim: int = 0
    tensor_names: tuple[str, ...] = ()
    layout_version: int = LAYOUT_VERSION

    def hasher(self, hash_fn: HashFn | None = None) -> BlockHasher:
        """Chained block hashes rooted in the model and KV dtype (the tokenizer is not part
        of a block's identity: its token ids are)."""
        scope = {"model": self.model_fingerprint, "kv_dtype": self.kv_dtype}
        return BlockHasher(scope, self.block_size, hash_fn or sha256)

    def digest(self, *extra: object) -> str:
        """A hex digest of the identity's KV part (plus e.g. a protocol version): equal iff
        both sides may exchange KV."""
        blob = repr((self.model_fingerprint, self.kv_dtype, self.block_size,
                     self.layout_version, *extra))
        return hashlib.sha256(blob.encode()).hexdigest()

    def header_fields(self) -> dict:
        """The identity as a snapshot's (and a segment's) header records it."""
        return {"model_fingerprint": self.model_fingerprint,
                "tokenizer_digest": self.tokenizer_digest,
                "template_digest": self.template_digest, "kv_dtype": self.kv_dtype,
                "block_size": self.block_size, "num_layers": self.num_layers,
                "num_kv_heads": self.num_kv_heads, "head_dim": self.head_dim,
                "tensor_names": list(self.tensor_names)}

    def log_fields(self) -> dict:
        """The identity as a session log records it."""
        return {k: getattr(self, k) for k in LOG_FIELDS}
