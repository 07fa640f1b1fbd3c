"""Chained, process-stable block hashes.

hash(block i) = sha256(hash(block i-1) || token ids of block i as int64 little-endian).
The chain starts from a root digest of the cache's identity scope (model fingerprint, kv
dtype, block size, layout version) and the request's optional `cache_salt`, so blocks of
different models, dtypes or tenants never share a hash. Layered isolation: a salt may start
after a pinned public prefix (`Salt.after_blocks`): those blocks hash unsalted (every tenant
shares them) and the chain is re-rooted with the salt at the first block after them, so
every later block is the tenant's own. sha256 is fixed and seedless: the
same tokens hash the same in every process, which snapshots and remote workers rely on.
(Python's `hash()` is randomised per process and is never used here.)

A hash is only a lookup key: a hit is reused only after its stored tokens are compared
with the request's (BlockPool.lookup), so a collision is a miss, never wrong output.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

LAYOUT_VERSION = 1
HashFn = Callable[[bytes], bytes]


@dataclass(frozen=True)
class Salt:
    """A request's cache_salt and the number of leading full blocks (a pinned public prefix
    the request starts with) that stay unsalted."""

    value: str
    after_blocks: int = 0


SaltArg = Salt | str | None


def as_salt(cache_salt: SaltArg) -> Salt | None:
    return Salt(cache_salt) if isinstance(cache_salt, str) else cache_salt


def sha256(data: bytes) -> bytes:
    return hashlib.sha256(data).digest()


def tail_key(parent: bytes, token_ids: Sequence[int]) -> bytes:
    """The key of a session's partial last block (fewer than block_size tokens) written
    to disk behind its turn: sha256(parent || b"tail" || token ids as int64 LE), where
    `parent` is the chained hash of the full block before it. The tag keeps it apart from
    every full block's hash: it is never a prefix-cache key (a partial block is not shared;
    its owner is still filling it), only how a resumed session finds its own tail."""
    return sha256(parent + b"tail" + np.asarray(token_ids, dtype="<i8").tobytes())


class BlockHasher:
    """Computes the hash chain of token blocks. `hash_fn` is replaceable (tests inject a
    colliding one); everything else is fixed by the scope."""

    def __init__(self, scope: dict, block_size: int, hash_fn: HashFn = sha256):
        self.block_size = block_size
        self.hash_fn = hash_fn
        items = sorted({**scope, "block_size": block_size, "layout": LAYOUT_VERSION}.items())
        self.scope_digest = sha256(repr(items).encode())

    def root(self, cache_salt: SaltArg) -> bytes:
        salt = as_salt(cache_salt)
        if salt is None or salt.after_blocks:
            return self.scope_digest
        return sha256(self.scope_digest + b"salt:" + salt.value.encode())

    @staticmethod
    def _salted_parent(parent: bytes, salt: Salt) -> bytes:
        """The chain re-rooted with the salt after a public prefix."""
        return sha256(parent + b"salt:" + salt.value.encode())

    def block_hash(self, parent: bytes, token_ids: Sequence[int]) -> bytes:
        return self.hash_fn(parent + np.asarray(token_ids, dtype="<i8").tobytes())

    def extend(self, hashes: list[bytes], token_ids: Sequence[int], num_tokens: int,
               cache_salt: SaltArg) -> list[bytes]:
        """Append to `hashes` the hashes of every full block among the first `num_tokens`
        tokens that `hashes` does not cover yet; returns `hashes` (mutated)."""
        bs = self.block_size
        salt = as_salt(cache_salt)
        for i in range(len(hashes), num_tokens // bs):
            parent = hashes[i - 1] if i else self.root(salt)
            if salt is not None and i and i == salt.after_blocks:
                parent = self._salted_parent(parent, salt)
            hashes.append(self.block_hash(parent, token_ids[i * bs:(i + 1) * bs]))
        return hashes
