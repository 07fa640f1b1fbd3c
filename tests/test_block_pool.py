"""Exact BlockPool states: ids handed out, ref counts, free-queue order, hash index."""

from __future__ import annotations

import pytest

from kvsession.cache.block_pool import BlockPool
from kvsession.cache.eviction import EvictionPolicy
from kvsession.cache.hashing import BlockHasher
from kvsession.errors import CacheFullError

BS = 4


def order(pool):
    return [b.block_id for b in pool.free_queue]


def refs(pool):
    return [b.ref_cnt for b in pool.blocks]


def publish(pool, hasher, blocks, tokens, salt=None):
    hashes = hasher.extend([], tokens, len(tokens), salt)
    for b, h, i in zip(blocks, hashes, range(0, len(tokens), BS), strict=False):
        pool.cache_full_block(b, h, tokens[i:i + BS])
    return hashes


@pytest.fixture
def pool():
    p = BlockPool(10, BS)
    yield p
    p.check_integrity()


@pytest.fixture
def hasher():
    return BlockHasher({"model": "test"}, BS)


def test_allocate_takes_from_head_in_id_order(pool):
    a = pool.allocate(3)
    assert [b.block_id for b in a] == [0, 1, 2]
    assert refs(pool) == [1, 1, 1, 0, 0, 0, 0, 0, 0, 0]
    assert order(pool) == [3, 4, 5, 6, 7, 8, 9]
    pool.check_integrity()


def test_free_is_tail_first(pool):
    a = pool.allocate(3)
    pool.free(a)
    # the sequence's last block is queued first, so it is evicted first
    assert order(pool) == [3, 4, 5, 6, 7, 8, 9, 2, 1, 0]
    assert refs(pool) == [0] * 10


def test_allocate_is_all_or_nothing(pool):
    pool.allocate(8)
    with pytest.raises(CacheFullError):
        pool.allocate(3)
    assert pool.num_free == 2
    pool.check_integrity()


@pytest.fixture
def freed(pool, hasher):
    """A 12-token sequence in blocks 0-2, published, then freed: (blocks, hashes, tokens)."""
    tokens = list(range(12))
    a = pool.allocate(3)
    hashes = publish(pool, hasher, a, tokens)
    pool.free(a)
    return a, hashes, tokens


def test_hit_revives_block_from_middle_of_free_queue(pool, freed):
    a, hashes, tokens = freed
    assert order(pool) == [3, 4, 5, 6, 7, 8, 9, 2, 1, 0]
    hit = pool.lookup(hashes[1], tokens[4:8])
    assert hit is a[1]
    pool.touch([hit])
    assert order(pool) == [3, 4, 5, 6, 7, 8, 9, 2, 0]
    assert hit.ref_cnt == 1 and hit.block_hash == hashes[1]
    pool.check_integrity()


def test_eviction_takes_lru_and_clears_hash(pool, freed):
    a, hashes, tokens = freed
    b = pool.allocate(8)  # 3..9 then 2: block 2 (the tail of the freed sequence) evicted
    assert [x.block_id for x in b] == [3, 4, 5, 6, 7, 8, 9, 2]
    assert pool.num_evictions == 1
    assert pool.lookup(hashes[2], tokens[8:12]) is None
    assert pool.lookup(hashes[0], tokens[0:4]) is a[0]
    assert order(pool) == [1, 0]
    pool.check_integrity()


def test_shared_block_counted_once_and_freed_when_last_ref_drops(pool, hasher):
    a = pool.allocate(2)
    publish(pool, hasher, a, list(range(8)))
    pool.touch([a[0]])  # a second sequence shares the first block
    assert refs(pool)[:2] == [2, 1]
    pool.free(a)
    assert refs(pool)[:2] == [1, 0]
    assert order(pool)[-1] == 1
    pool.free([a[0]])
    assert order(pool)[-2:] == [1, 0]
    with pytest.raises(RuntimeError, match="double free"):
        pool.free([a[0]])


def test_verification_rejects_hash_collisions(hasher):
    pool = BlockPool(10, BS)
    colliding = BlockHasher({"model": "test"}, BS, hash_fn=lambda data: b"same")
    a = pool.allocate(1)
    (h,) = publish(pool, colliding, a, [1, 2, 3, 4])
    assert pool.lookup(h, [1, 2, 3, 4]) is a[0]
    assert colliding.extend([], [9, 9, 9, 9], 4, None) == [h]  # same hash, other tokens
    assert pool.lookup(h, [9, 9, 9, 9]) is None
    pool.check_integrity()


def test_hashes_are_chained_and_scoped(hasher):
    x = hasher.extend([], [1, 2, 3, 4, 5, 6, 7, 8], 8, None)
    y = hasher.extend([], [0, 0, 0, 0, 5, 6, 7, 8], 8, None)
    assert x[1] != y[1]  # same second block, other history
    assert hasher.extend([], [1, 2, 3, 4], 4, "tenant-a") != x[:1]
    other_scope = BlockHasher({"model": "other"}, BS)
    assert other_scope.extend([], [1, 2, 3, 4], 4, None) != x[:1]
    # process-stable: a fixed function of scope and tokens
    assert BlockHasher({"model": "test"}, BS).extend([], [1, 2, 3, 4], 4, None) == x[:1]


def test_duplicate_content_stays_unpublished(pool, hasher):
    a, b = pool.allocate(1), pool.allocate(1)
    (h,) = publish(pool, hasher, a, [1, 2, 3, 4])
    publish(pool, hasher, b, [1, 2, 3, 4])
    assert b[0].block_hash is None and pool.index[h] is a[0]


def test_caching_disabled_publishes_nothing(hasher):
    pool = BlockPool(4, BS, enable_caching=False)
    a = pool.allocate(1)
    (h,) = publish(pool, hasher, a, [1, 2, 3, 4])
    assert pool.index == {} and pool.lookup(h, [1, 2, 3, 4]) is None
    pool.check_integrity()


def test_a_growing_pool_creates_blocks_as_needed_before_evicting_content():
    """The host tier's pool: sized in bytes, it may count 10^5 small blocks of which a run
    uses few; a block never used is taken before any cached content."""
    pool = BlockPool(4, 4, True, EvictionPolicy.COST, grow=True)
    assert pool.blocks == [] and pool.num_free == 4
    a = pool.allocate(2)
    assert [b.block_id for b in a] == [0, 1] and len(pool.blocks) == 2 and pool.num_free == 2
    pool.cache_full_block(a[0], b"h0", [1, 2, 3, 4])
    pool.free(a)  # block 1 has no content: reused first; then block 2, never used; then 0
    assert [b.block_id for b in pool.allocate(1)] == [1]
    assert [b.block_id for b in pool.allocate(1)] == [2]
    assert pool.lookup(b"h0", [1, 2, 3, 4]) is a[0]
    assert [b.block_id for b in pool.allocate(2)] == [3, 0]  # the last new one, then content
    assert pool.lookup(b"h0", [1, 2, 3, 4]) is None and pool.num_free == 0
    pool.check_integrity()
    with pytest.raises(ValueError, match="COST"):
        BlockPool(4, 4, grow=True)
