"""Prefix lookup: the longest run of a token sequence's leading full blocks already cached.

Every hit is verified token by token (BlockPool.lookup); the walk stops at the first miss,
because a chained hash after a missing block can never match.
"""

from __future__ import annotations

from collections.abc import Sequence

from kvsession.cache.block_pool import Block, BlockPool
from kvsession.cache.hashing import BlockHasher


class PrefixCache:
    def __init__(self, pool: BlockPool, hasher: BlockHasher):
        self.pool, self.hasher = pool, hasher
        self.queried_tokens = 0
        self.hit_tokens = 0

    def match(self, token_ids: Sequence[int], hashes: list[bytes], max_tokens: int,
              cache_salt: str | None) -> list[Block]:
        """Cached blocks covering the longest prefix of `token_ids[:max_tokens]` (whole
        blocks only). `hashes` is the sequence's hash list, extended in place as far as it is
        computed. Takes no references: the caller touches the blocks it keeps. Counts the
        query in the hit-rate statistics."""
        bs = self.pool.block_size
        self.hasher.extend(hashes, token_ids, max_tokens - max_tokens % bs, cache_salt)
        hits: list[Block] = []
        if self.pool.enable_caching:
            for i in range(max_tokens // bs):
                b = self.pool.lookup(hashes[i], token_ids[i * bs:(i + 1) * bs])
                if b is None:
                    break
                hits.append(b)
        self.queried_tokens += max_tokens
        self.hit_tokens += len(hits) * bs
        return hits
