"""KVCacheManager alone: exact block tables, ref counts, free-queue order and holders after
every operation, and check_integrity catching references nobody accounts for."""

from __future__ import annotations

import gc
import re

import pytest
import torch

from kvsession.cache.block_pool import BlockPool
from kvsession.cache.hashing import BlockHasher
from kvsession.cache.identity import StorageIdentity
from kvsession.cache.kv_pool import KVPool
from kvsession.cache.manager import KVCacheManager, Quarantine, SessionKV, Tier, Transient
from kvsession.cache.prefix import Pin, PrefixCache
from kvsession.engine.sequence import Sequence
from kvsession.errors import CacheFullError
from kvsession.params import SamplingParams
from kvsession.tiers.host import HostPool

BS = 4
HASHER = StorageIdentity("m", "float32", BS).hasher()
SEQ, SESS, PIN, QUAR, TRANS = (c.holder_kind for c in (Sequence, SessionKV, Pin, Quarantine,
                                                        Transient))


def manager(num_blocks: int = 8, host_blocks: int = 0) -> KVCacheManager:
    kv = KVPool(2, num_blocks, BS, 1, 4, torch.float32, torch.device("cpu"))
    host = HostPool(kv, host_blocks).index if host_blocks else None
    return KVCacheManager(BlockPool(num_blocks, BS), kv, host)


def seq(tokens=None) -> Sequence:
    return Sequence(token_ids=list(range(12)) if tokens is None else list(tokens),
                    params=SamplingParams(max_tokens=4, temperature=0.0), max_model_len=64)


def session(sid: str = "s1") -> SessionKV:
    return SessionKV(sid, meta=lambda: {"messages": [], "system": None, "sampling": {}})


def fifo(m):
    return [b.block_id for b in m.pool.free_queue]


def ids(holder):
    return [b.block_id for b in holder.blocks]


def refs(m):
    return [b.ref_cnt for b in m.pool.blocks]


def held(m):
    return sorted((k.value, i) for k, i in m.holders())


def publish(m, holder, tokens, hasher=HASHER):
    hashes = hasher.extend([], tokens, len(tokens), None)
    for i, h in enumerate(hashes):
        m.pool.cache_full_block(holder.blocks[i], h, tokens[i * BS:(i + 1) * BS])
    return hashes


def test_allocate_slots_appends_from_the_head():
    m, a = manager(), seq()
    m.allocate_slots(a, 2)
    m.allocate_slots(a, 0)
    m.allocate_slots(a, 1)
    assert ids(a) == [0, 1, 2] and fifo(m) == [3, 4, 5, 6, 7]
    assert refs(m) == [1, 1, 1, 0, 0, 0, 0, 0]
    with pytest.raises(CacheFullError):
        m.allocate_slots(a, 6)  # 5 free: nothing changes
    assert ids(a) == [0, 1, 2] and fifo(m) == [3, 4, 5, 6, 7]
    assert m.holders() == [(SEQ, [0, 1, 2])]
    assert m.num_held(SEQ) == 3 and m.num_held(SESS) == 0
    m.check_integrity()


def test_release_and_truncate_are_tail_first():
    m, a, b = manager(), seq(), seq()
    m.allocate_slots(a, 3)
    m.allocate_slots(b, 2)
    m.release(a)
    assert a.blocks == () and fifo(m) == [5, 6, 7, 2, 1, 0]
    assert m.holders() == [(SEQ, [3, 4])]
    m.truncate(b, 1)
    assert ids(b) == [3] and fifo(m) == [5, 6, 7, 2, 1, 0, 4]
    m.truncate(b, 1)  # nothing past the first block left
    m.release(b)
    assert fifo(m) == [5, 6, 7, 2, 1, 0, 4, 3] and m.holders() == []
    assert refs(m) == [0] * 8
    m.check_integrity()


def test_attach_revives_hits_from_the_middle_of_the_free_queue():
    m, a, b, c = manager(), seq(), seq(), Transient()
    m.allocate_slots(a, 3)
    hashes = publish(m, a, list(range(12)))
    m.release(a)
    assert fifo(m) == [3, 4, 5, 6, 7, 2, 1, 0]
    hits = [m.pool.lookup(hashes[i], range(i * BS, (i + 1) * BS)) for i in (0, 1)]
    m.attach(b, hits)
    assert ids(b) == [0, 1] and fifo(m) == [3, 4, 5, 6, 7, 2]
    m.allocate_slots(b, 1)  # fresh blocks still come from the head
    assert ids(b) == [0, 1, 3] and fifo(m) == [4, 5, 6, 7, 2]
    assert m.pool.blocks[2].block_hash == hashes[2]  # still cached, not yet evicted
    m.attach(c, hits[:1])
    assert refs(m) == [2, 1, 0, 1, 0, 0, 0, 0]
    m.release(b)  # 3 (unpublished: evicted), then 1; 0 is still held by c
    assert fifo(m) == [4, 5, 6, 7, 2, 3, 1] and held(m) == [("transient", [0])]
    m.check_integrity()


def test_transfer_moves_references_and_releases_the_rest():
    m, a, c, d, q = manager(), seq(), Transient(), seq(), Quarantine(1)
    m.allocate_slots(a, 3)
    m.attach(c, a.blocks[:1])
    m.transfer(a, q, 2)
    assert ids(q) == [0, 1] and a.blocks == ()
    assert refs(m) == [2, 1, 0, 0, 0, 0, 0, 0]  # no count changed hands; 2 was released
    assert fifo(m) == [3, 4, 5, 6, 7, 2]
    m.allocate_slots(d, 1)
    m.transfer(d, q)  # appended to what q holds
    assert ids(q) == [0, 1, 3] and d.blocks == ()
    assert held(m) == [("quarantine", [0, 1, 3]), ("transient", [0])]
    assert m.num_held(QUAR) == 3 and m.num_held(TRANS) == 1 and m.num_held(SEQ) == 0
    m.check_integrity()


@pytest.fixture
def head_hit():
    """4 blocks; block 0 (published) at the head of the free queue: (manager, block 0)."""
    m, x, y = manager(4), Transient(), Transient()
    m.allocate_slots(x, 1)
    publish(m, x, [0, 1, 2, 3])
    m.allocate_slots(y, 3)
    m.release(x)
    m.release(y)
    assert fifo(m) == [0, 3, 2, 1]
    return m, m.pool.blocks[0]


def test_stage_touches_hits_before_allocating(head_hit):
    m, b0 = head_hit
    t = Transient()
    fresh = m.stage(t, [b0, None, None])
    assert ids(t) == [0, 3, 2] and fresh == {m.pool.blocks[3], m.pool.blocks[2]}
    assert fifo(m) == [1] and refs(m) == [1, 0, 1, 1]
    assert m.pool.num_evictions == 0 and b0.block_hash is not None
    assert m.holders() == [(TRANS, [0, 3, 2])]
    m.check_integrity()


def test_stage_is_all_or_nothing(head_hit):
    m, b0 = head_hit
    t = Transient()
    with pytest.raises(CacheFullError):
        m.stage(t, [b0, None, None, None, None])
    assert t.blocks == () and m.holders() == [] and refs(m) == [0, 0, 0, 0]
    # refused before anything moved: the hit keeps its place at the head, content kept
    assert fifo(m) == [0, 3, 2, 1] and m.pool.lookup(b0.block_hash, [0, 1, 2, 3]) is b0
    m.check_integrity()


def test_retarget_to_indexed_replaces_a_recomputed_duplicate():
    m, a, b = manager(), Transient(), seq()
    m.allocate_slots(a, 2)
    hashes = publish(m, a, list(range(8)))
    m.allocate_slots(b, 3)  # recomputed: block 2 duplicates block 0, block 3 is new
    tokens = [0, 1, 2, 3, 100, 101, 102, 103, 9]
    new = HASHER.extend([], tokens, 8, None)
    assert new[0] == hashes[0]
    m.retarget_to_indexed(b, new, tokens)
    assert ids(b) == [0, 3]  # the indexed copy of block 0, block 3 published in place
    assert m.pool.blocks[2].block_hash is None and m.pool.blocks[3].block_hash == new[1]
    assert refs(m) == [2, 1, 0, 1, 0, 0, 0, 0]
    assert fifo(m) == [5, 6, 7, 4, 2]  # the partial tail and the duplicate, tail first
    m.check_integrity()


def test_retarget_to_indexed_survives_a_hash_collision():
    m, a, b = manager(), Transient(), Transient()
    colliding = BlockHasher({"model": "m"}, BS, hash_fn=lambda data: b"same")
    m.allocate_slots(a, 1)
    publish(m, a, [1, 2, 3, 4], colliding)
    m.allocate_slots(b, 1)
    m.retarget_to_indexed(b, colliding.extend([], [9, 9, 9, 9], 4, None), [9, 9, 9, 9])
    assert ids(b) == [1]  # no indexed copy of these tokens: b keeps its own block
    m.check_integrity()


@pytest.fixture
def checked_in():
    """A turn of 9 computed tokens checked into a session from a 4-block sequence."""
    m, q, s = manager(host_blocks=4), seq(), session()
    m.allocate_slots(q, 4)
    tokens = list(range(9))
    hashes = publish(m, q, tokens)
    m.checkin(s, q, tokens, hashes)
    return m, s, tokens, hashes


def test_checkin_then_checkout_writes_a_private_partial_tail_in_place(checked_in):
    m, s, tokens, hashes = checked_in
    assert ids(s) == [0, 1, 2] and fifo(m) == [4, 5, 6, 7, 3]
    assert s.tokens == tuple(tokens) and s.hashes == tuple(hashes) and len(hashes) == 2
    assert s.tier is Tier.DEVICE and s.host_blocks == () and m.holders() == [(SESS, [0, 1, 2])]
    m.check_integrity()
    q = seq()
    assert m.checkout(s, q, 9) == 9  # no copy: nothing else can see block 2
    assert ids(q) == [0, 1, 2] and s.blocks == () and s.tokens == () and s.hashes == ()
    assert fifo(m) == [4, 5, 6, 7, 3] and refs(m) == [1, 1, 1, 0, 0, 0, 0, 0]
    assert m.holders() == [(SEQ, [0, 1, 2])]
    m.check_integrity()


def test_checkout_copies_a_published_block_used_partially(checked_in):
    m, s, _, hashes = checked_in
    m.kv_pool.k[:, 1], m.kv_pool.v[:, 1] = 7.0, -7.0
    q = seq()
    assert m.checkout(s, q, 6) == 6
    assert ids(q) == [0, 4]  # block 2 released, block 1 copied into block 4
    kv = m.kv_pool
    assert torch.equal(kv.k[:, 4], kv.k[:, 1]) and torch.equal(kv.v[:, 4], kv.v[:, 1])
    assert m.pool.blocks[1].block_hash == hashes[1]  # the original stays cached
    assert fifo(m) == [5, 6, 7, 3, 2, 1] and refs(m) == [1, 0, 0, 0, 1, 0, 0, 0]
    m.check_integrity()


def test_share_then_checkout_copies_or_drops_the_shared_partial_tail(checked_in):
    m, s, _, _ = checked_in
    child = session("s2")
    m.share(s, child)
    assert ids(child) == [0, 1, 2] and child.tokens == s.tokens and child.hashes == s.hashes
    assert refs(m) == [2, 2, 2, 0, 0, 0, 0, 0] and m.num_held(SESS) == 6
    m.kv_pool.k[:, 2] = torch.arange(32.0).view(2, 4, 1, 4)
    m.kv_pool.v[:, 2] = -torch.arange(32.0).view(2, 4, 1, 4)
    q = seq()
    assert m.checkout(child, q, 9) == 9
    assert ids(q) == [0, 1, 4] and ids(s) == [0, 1, 2] and child.blocks == ()
    kv = m.kv_pool
    assert torch.equal(kv.k[:, 4], kv.k[:, 2]) and torch.equal(kv.v[:, 4], kv.v[:, 2])
    assert refs(m) == [2, 2, 1, 0, 1, 0, 0, 0] and fifo(m) == [5, 6, 7, 3]
    assert held(m) == [("sequence", [0, 1, 4]), ("session", [0, 1, 2])]
    m.check_integrity()
    child2, filler, q2 = session("s3"), Transient(), seq()
    m.share(s, child2)
    m.allocate_slots(filler, 4)
    assert m.checkout(child2, q2, 9) == 8  # no free block to copy into: the tail recomputes
    assert ids(q2) == [0, 1] and child2.blocks == () and fifo(m) == []
    assert refs(m) == [3, 3, 1, 1, 1, 1, 1, 1]
    m.check_integrity()


def hids(s):
    return [h.block_id for h in s.host_blocks]


def host_free(m):
    """The host blocks no one holds, in the order they would be taken: without content,
    then never used (the host pool creates its blocks as they are first needed), then
    cached content in eviction order."""
    q = m.host.free_queue
    empty = [b.block_id for b in q.uncached]
    return empty + list(range(len(m.host.blocks), m.host.num_blocks)) + \
        [b.block_id for b in q][len(empty):]


def host_refs(m):
    return [b.ref_cnt for b in m.host.blocks] + [0] * (m.host.num_blocks - len(m.host.blocks))


@pytest.fixture
def spilled(checked_in):
    """The session (9 tokens in [0, 1, 2]) with block 0 kept as lead, 1 and 2 on host 0, 1
    (host 0 published under block 1's hash, as the mover does)."""
    m, s, tokens, hashes = checked_in
    assert m.stage_host(s, [None, None]) == {m.host.blocks[0], m.host.blocks[1]}
    m.host.cache_full_block(m.host.blocks[0], hashes[1], tokens[4:8], hashes[0])
    m.spill_to_host(s, 1)
    return m, s, tokens, hashes


def test_spill_to_host_then_loaded(spilled):
    m, s, tokens, hashes = spilled
    assert ids(s) == [0] and hids(s) == [0, 1] and s.tier is Tier.HOST
    assert fifo(m) == [4, 5, 6, 7, 3, 2, 1] and host_free(m) == [2, 3]
    assert m.holders() == [(SESS, [0])]
    assert host_refs(m) == [1, 1, 0, 0]
    m.check_integrity()
    t = Transient()
    fresh = m.stage(t, [m.pool.blocks[1], None])  # 1 still cached; 2 was partial
    assert ids(t) == [1, 4] and fresh == {m.pool.blocks[4]}
    m.loaded(s, t)
    assert ids(s) == [0, 1, 4] and t.blocks == () and hids(s) == []
    assert s.tier is Tier.DEVICE and fifo(m) == [5, 6, 7, 3, 2]
    # the host blocks were let go: the published one keeps its content (found by hash),
    # the partial one is empty again, reused first
    assert host_refs(m) == [0, 0, 0, 0]
    assert host_free(m) == [1, 2, 3, 0]
    assert m.host.lookup(hashes[1], tokens[4:8]) is m.host.blocks[0]
    m.check_integrity()


def test_a_second_session_references_host_content_the_first_spilled(spilled):
    m, s, tokens, hashes = spilled
    other = session("s2")
    m.stage_host(other, [m.host.lookup(hashes[1], tokens[4:8]), None])
    assert hids(other) == [0, 2] and host_refs(m) == [2, 1, 1, 0]
    m.check_integrity()
    m.forget(s)
    assert host_refs(m) == [1, 0, 1, 0]
    m.release_host(other)
    assert host_refs(m) == [0, 0, 0, 0] and m.holders() == []
    m.check_integrity()


def test_stage_host_is_all_or_nothing(spilled):
    m, s, tokens, hashes = spilled
    other = session("s2")
    with pytest.raises(CacheFullError, match="host tier"):
        m.stage_host(other, [None, None, None])  # 2 unreferenced host blocks
    assert other.host_blocks == () and host_free(m) == [2, 3]
    m.check_integrity()


def test_integrity_counts_host_references(spilled):
    m, s, tokens, hashes = spilled
    m.host.touch([m.host.blocks[1]])  # a reference no holder accounts for
    with pytest.raises(AssertionError, match=re.escape("host Block(1, ref=2")):
        m.check_integrity()


def test_spill_to_disk_drop_on_disk_and_forget(spilled, tmp_path):
    m, s, tokens, hashes = spilled
    m.spill_to_disk(s, 1, tmp_path / "s1.kvs")
    assert hids(s) == [] and ids(s) == [0]
    assert s.tier is Tier.DISK and s.disk_path == tmp_path / "s1.kvs"
    assert sorted(host_free(m)) == [0, 1, 2, 3]
    m.check_integrity()
    m.drop(s, 1)
    assert ids(s) == [0] and s.tier is Tier.DEVICE
    assert s.tokens == (0, 1, 2, 3) and s.hashes == (HASHER.extend([], range(4), 4, None)[0],)
    m.stage_host(s, [None])
    m.spill_to_host(s, 1)
    other = session("s2")
    m.on_disk(other, [1, 2, 3], [], tmp_path / "s2.kvs")
    assert other.tier is Tier.DISK and other.tokens == (1, 2, 3) and other.blocks == ()
    assert m.holders() == [(SESS, [0])]  # other holds nothing on the device or host
    m.check_integrity()
    m.forget(s)
    assert s.blocks == () and s.tokens == () and s.tier is Tier.DEVICE and hids(s) == []
    assert s.disk_path is None and m.holders() == [] and fifo(m)[-1] == 0
    m.check_integrity()


def test_pins_take_references_within_their_budget():
    m = manager()
    pins = PrefixCache(m, HASHER, max_pinned_blocks=3).pins
    a, b, c = seq(), seq(), seq()
    m.allocate_slots(a, 2)
    publish(m, a, list(range(8)))
    pin = pins.add(list(range(8)), a, None, now=0.0)
    assert ids(pin) == [0, 1] and a.blocks == () and pins.block_pins == {0: 1, 1: 1}
    m.allocate_slots(b, 2)
    with pytest.raises(CacheFullError, match="pin budget"):
        pins.add(list(range(8, 16)), b, None, now=0.0)
    assert ids(b) == [2, 3] and list(pins.pins) == [0]  # b keeps its references
    m.attach(c, pin.blocks)
    pin2 = pins.add(list(range(8)), c, ttl_s=5.0, now=0.0)  # no new block: within budget
    assert pins.block_pins == {0: 2, 1: 2} and refs(m) == [2, 2, 1, 1, 0, 0, 0, 0]
    assert held(m) == [("pin", [0, 1]), ("pin", [0, 1]), ("sequence", [2, 3])]
    assert m.num_held(PIN) == 4
    pins.remove(pin)
    pins.remove(pin)  # idempotent
    assert pins.block_pins == {0: 1, 1: 1} and refs(m) == [1, 1, 1, 1, 0, 0, 0, 0]
    assert pins.expire(10.0) == [pin2]
    assert pins.block_pins == {} and fifo(m) == [4, 5, 6, 7, 1, 0]
    m.release(b)
    m.check_integrity()


def test_integrity_names_a_reference_taken_behind_the_managers_back():
    m, a = manager(), seq()
    m.allocate_slots(a, 2)
    b1, b5 = m.pool.blocks[1], m.pool.blocks[5]
    m.pool.touch([b1])
    with pytest.raises(AssertionError, match=re.escape(
            "Block(1, ref=2, hash=None): ref_cnt 2 but holders hold 1 reference(s) "
            "(['sequence'])")):
        m.check_integrity()
    m.pool.free([b1])
    m.pool.touch([b5])
    with pytest.raises(AssertionError, match=re.escape(
            "Block(5, ref=1, hash=None): ref_cnt 1 but holders hold 0 reference(s) ([])")):
        m.check_integrity()
    m.pool.free([b5])
    m.check_integrity()


def test_integrity_catches_a_holder_dropped_without_release():
    m, a = manager(), seq()
    m.allocate_slots(a, 2)
    del a
    gc.collect()
    with pytest.raises(AssertionError, match=re.escape("Block(0")):
        m.check_integrity()


def test_reset_blocks_restores_the_first_blocks_as_built_and_leaves_the_rest():
    """K/V back to zero and fp8 scales back to one in the first blocks of every layer (what
    start-up's warm-up steps wrote); later blocks keep their data."""
    kv = KVPool(2, 4, BS, 1, 4, torch.float8_e4m3fn, torch.device("cpu"))
    for t in kv.tensors().values():
        t.fill_(3.0)
    kv.reset_blocks(2)
    for name, t in kv.tensors().items():
        built = 1.0 if name.endswith("scale") else 0.0
        assert (t[:, :2].float() == built).all(), name
        assert (t[:, 2:].float() == 3.0).all(), name
