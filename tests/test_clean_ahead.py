"""Copies ahead of eviction: a pool's next victims are copied a tier down on the copier
before an allocation evicts them (the device's to the host where the copier has its own
engine, the host's to the disk cache everywhere), so the eviction finds them there and the
step does not wait for the copy. `BlockPool.next_victims` names them exactly; a copy whose
source block was evicted meanwhile (its bytes possibly rewritten) is never published, and a
disk cache slot never committed is not found by the next process either; every output is
the one an engine without caching gives."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from test_disk_cache import HOST, SLOT, used_twice_then_evicted
from test_policy_unit import BPT, HASHER, HEADER, add_session, build, content
from test_prefix_cache import gen
from test_shared_tiers import DEVICE, G, fixed_rates

from kvsession import LLM, costmodel
from kvsession.cache.block_pool import BlockPool, Evicted
from kvsession.cache.eviction import EvictionPolicy
from kvsession.cache.hashing import BlockHasher
from kvsession.cache.kv_pool import KVPool
from kvsession.cache.manager import HostTransient, KVCacheManager, Tier
from kvsession.tiers.disk import DiskTier
from kvsession.tiers.disk_cache import DiskCache
from kvsession.tiers.host import HostPool
from kvsession.tiers.mover import TierMover
from kvsession.tiers.policy import TierPolicy
from oracle import random_prompts

BS = 4


class Recorder:
    """An EvictionSink that keeps nothing and records what `allocate` evicts."""

    def __init__(self):
        self.victims: list[Evicted] = []

    def evicting(self, victims):
        self.victims += victims
        return {}


def cached_chains(eviction, chains):
    """A pool of 12 blocks holding `chains` (lists of block counts) as cached, freed
    content, tail first as a finished sequence frees it; the rest empty."""
    pool, hasher = BlockPool(12, BS, True, eviction), BlockHasher({"model": "t"}, BS)
    for c, n in enumerate(chains):
        tokens = [100 * c + t for t in range(n * BS)]
        hashes = hasher.extend([], tokens, len(tokens), None)
        blocks = pool.allocate(n)
        for i, b in enumerate(blocks):
            pool.cache_full_block(b, hashes[i], tokens[i * BS:(i + 1) * BS],
                                  hashes[i - 1] if i else None)
        pool.free(blocks)
    sink = Recorder()
    pool.attach_sink(sink)
    return pool, sink


@pytest.mark.parametrize("eviction", [EvictionPolicy.COST, EvictionPolicy.LRU])
@pytest.mark.parametrize("take", [1, 3, 6, 12])
def test_next_victims_are_what_the_next_allocation_evicts(eviction, take):
    """Three chains (3, 2 and 4 blocks) and three empty blocks: whatever the lookahead,
    the victims named ahead are the ones `allocate` then hands its sink, in order, with
    their parents and hits."""
    pool, sink = cached_chains(eviction, [3, 2, 4])
    ahead = pool.next_victims(take)
    assert all(pool.still_holds(v) for v in ahead)
    pool.allocate(take)
    assert [(v.block_id, v.block_hash, v.parent_hash, v.hits) for v in ahead] == \
        [(v.block_id, v.block_hash, v.parent_hash, v.hits) for v in sink.victims]
    assert not any(pool.still_holds(v) for v in ahead)  # evicted: their generation moved on
    pool.check_integrity()


def test_next_victims_changes_nothing_and_skips_blocks_in_use():
    pool, sink = cached_chains(EvictionPolicy.COST, [3, 2, 4])
    free_order = [b.block_id for b in pool.free_queue]
    assert [v.block_id for v in pool.next_victims(12)] == free_order[3:]
    assert [b.block_id for b in pool.free_queue] == free_order
    # the 4-block chain is in use again (a prefix hit): nothing of it is a victim
    chain = [b for b in pool.blocks if b.block_hash is not None and b.token_ids[0] >= 200]
    pool.touch(chain)
    ahead = [v.block_id for v in pool.next_victims(12)]
    assert len(ahead) == 5 and not set(ahead) & {b.block_id for b in chain}
    assert sink.victims == []
    pool.check_integrity()


def unit(tmp_path, step_blocks=8):
    """test_policy_unit's engine (8 device blocks, 8 host blocks, no disk) with copies
    ahead looking `step_blocks` ahead (at most a quarter of each pool: 2), the policy as
    the device pool's eviction sink, and one released session's 16 tokens (4 blocks,
    content(i) in block i) cached and free on the device."""
    e = build(tmp_path, num_blocks=8, host_blocks=8, disk=False)
    e.policy = TierPolicy(e.mover, e.prefix, load=e.probe,
                          prefill_tps=costmodel.RateEstimator(prior=2000.0),
                          bytes_per_token=BPT, step_blocks=step_blocks, device_ahead=True)
    e.m.pool.attach_sink(e.policy)
    e.policy.release(add_session(e, "a", 16, last_used=0.0))
    return e


def test_a_copy_ahead_is_published_and_the_eviction_copies_nothing(tmp_path):
    e = unit(tmp_path)
    victims = e.m.pool.next_victims(8)  # 4 empty blocks first, then the session's 4
    assert len(victims) == 4
    job = e.mover.stage_clean(Tier.DEVICE, victims)
    moved, seconds = e.mover.copy_clean(job)
    assert e.mover.settle_clean(job, moved, seconds) == 4
    host = e.host.index
    for v in victims:  # the exact bytes, now found by hash on the host
        h = host.lookup(v.block_hash, v.token_ids)
        assert torch.equal(e.host.tensors["k"][:, h.block_id], content(v.block_id))
        assert torch.equal(e.host.tensors["v"][:, h.block_id], -content(v.block_id))
    assert sum(b.ref_cnt for b in host.blocks) == 0  # the job let its host blocks go
    e.m.pool.allocate(8)  # evicts all four
    assert e.m.pool.evictions_by_copy == {"host": 4}
    assert e.mover.evicted_copies[Tier.HOST] == 0 and e.mover.cleaned_blocks[Tier.HOST] == 4
    e.m.pool.check_integrity()
    host.check_integrity()


def test_a_copy_whose_block_was_evicted_meanwhile_is_not_published(tmp_path):
    """The copier reads free device blocks that the engine may evict and rewrite before
    the copy is settled: such a copy may be torn, and is never published."""
    e = unit(tmp_path)
    e.m.pool.attach_sink(Recorder())  # (the eviction keeps nothing: only the copy ahead)
    victims = e.m.pool.next_victims(8)
    job = e.mover.stage_clean(Tier.DEVICE, victims)
    moved, seconds = e.mover.copy_clean(job)
    taken = e.m.pool.allocate(6)  # the 4 empty blocks and 2 of the victims, rewritten
    for b in taken:
        e.kv.k[:, b.block_id] = -1.0
    assert e.mover.settle_clean(job, moved, seconds) == 2  # the 2 still intact
    host = e.host.index
    evicted = [v for v in victims if not e.m.pool.still_holds(v)]
    assert len(evicted) == 2
    assert all(host.lookup(v.block_hash, v.token_ids) is None for v in evicted)
    assert sum(b.ref_cnt for b in host.blocks) == 0
    host.check_integrity()


def test_housekeeping_copies_ahead_one_group_at_a_time(tmp_path):
    """The policy looks a quarter of the pools ahead (2 blocks here): with the 4 empty
    blocks ahead of the cached ones nothing is copied; once they are taken, housekeeping
    copies the next two victims on the copier and settles them on a later call."""
    e = unit(tmp_path, step_blocks=64)
    assert e.policy.clean_ahead_blocks == 2
    e.policy.housekeeping(0.0)
    assert e.policy.cleaning is None and e.mover.cleaned_blocks[Tier.HOST] == 0
    held = e.m.pool.allocate(4)  # the empty blocks: the cached ones are next
    e.policy.housekeeping(0.0)
    assert e.policy.cleaning is not None
    e.policy.settle_moves()
    assert e.policy.cleaning is None and e.mover.cleaned_blocks[Tier.HOST] == 2
    e.policy.housekeeping(0.0)  # the next two are already on the host
    assert e.policy.cleaning is None
    e.m.pool.free(held)
    e.m.pool.check_integrity()


def test_on_a_cpu_the_devices_victims_are_copied_as_they_are_evicted(llama_dir, tmp_path):
    """Without a copier engine of its own (a CPU), the device's victims are copied as they
    are evicted (a copy ahead would take the step's cores and memory bus); the host's
    reach the disk cache, ahead or as evicted, and come back exact."""
    (doc,) = random_prompts(6, [120], 500)
    q = doc + [1, 2, 3, 4]
    with fixed_rates(LLM(llama_dir, session_dir=tmp_path, disk_cache_memory=64 * SLOT,
                         **HOST, **DEVICE)) as llm, \
            LLM(llama_dir, enable_prefix_caching=False, **DEVICE) as plain:
        used_twice_then_evicted(llm, doc, 300)
        st = llm.stats()
        assert st.tiers["host"].blocks_copied_ahead == 0
        assert st.tiers["host"].blocks_copied_at_eviction >= 15
        disk = st.tiers["disk"]
        assert disk.blocks_copied_ahead + disk.blocks_copied_at_eviction >= 15
        out = gen(llm, [q], G)[0]
        assert out.num_cached_tokens == 120
        assert out.token_ids == gen(plain, [q], G)[0].token_ids
        llm.check_integrity()


def host_over_disk(tmp_path):
    """A device pool of 8 blocks, a host tier of 4, a disk cache below: two host blocks
    hold known content (K = content(10 + i), V its negation), used twice (what the disk
    cache admits), cached and free; two host blocks never made."""
    kv = KVPool(2, 8, BS, 1, 4, torch.float32, torch.device("cpu"))
    host = HostPool(kv, 4)
    m = KVCacheManager(BlockPool(8, BS), kv, host.index)
    cache = DiskCache(tmp_path, kv.tensors(), BS, HEADER.header_fields(), 1 << 20)
    mover = TierMover(m, host, DiskTier(tmp_path), HASHER, HEADER, disk_cache=cache)
    tokens = list(range(2 * BS))
    hashes = HASHER.extend([], tokens, len(tokens), None)
    held = HostTransient()
    m.stage_host(held, [None, None])
    for i, h in enumerate(held.host_blocks):
        host.tensors["k"][:, h.block_id], host.tensors["v"][:, h.block_id] = \
            content(10 + i), -content(10 + i)
        host.index.cache_full_block(h, hashes[i], tokens[i * BS:(i + 1) * BS],
                                    hashes[i - 1] if i else None, earned_hits=2)
    m.release_host(held)
    return SimpleNamespace(kv=kv, host=host, m=m, cache=cache, mover=mover, tokens=tokens,
                           hashes=hashes)


def reopened(tmp_path, e):
    """The disk cache as the next process finds it: (blocks recovered, K of each)."""
    e.cache.close()
    again = DiskCache(tmp_path, e.kv.tensors(), BS, HEADER.header_fields(), 1 << 20)
    slots = again.index.lookup_run(e.tokens, e.hashes, 0, 2)
    again.hold(slots)
    dst = {n: torch.zeros_like(t) for n, t in e.kv.tensors().items()}
    assert again.load(slots, dst, list(range(len(slots)))) == len(slots)
    again.release(slots)
    again.close()
    return again.recovered_blocks, [dst["k"][:, i] for i in range(len(slots))]


def test_host_victims_are_written_to_the_disk_cache_ahead(tmp_path):
    """Their slots are written on the copier, headers committed at settling: found by
    hash here and by the next process, the exact bytes; the host's eviction then writes
    nothing."""
    e = host_over_disk(tmp_path)
    victims = e.host.index.next_victims(4)  # 2 never-made blocks first, then the two
    assert [v.hits for v in victims] == [2, 2]
    job = e.mover.stage_clean(Tier.HOST, victims)
    done, seconds = e.mover.copy_clean(job)
    assert e.mover.settle_clean(job, done, seconds) == 2
    assert e.cache.index.lookup_run(e.tokens, e.hashes, 0, 2) != []
    e.cache.check_integrity()
    written = e.cache.bytes_written
    assert e.mover.keep_on_disk(victims, Tier.HOST) == {v.block_id for v in victims}
    assert e.cache.bytes_written == written  # already there: nothing written again
    recovered, ks = reopened(tmp_path, e)
    assert recovered == 2
    assert all(torch.equal(k, content(10 + i)) for i, k in enumerate(ks))


def test_a_slot_whose_host_block_was_evicted_meanwhile_is_never_found(tmp_path):
    """Its payload was written, but its host block lost the content before the settle:
    the header stays blank, so neither this process nor the next finds the slot."""
    e = host_over_disk(tmp_path)
    victims = e.host.index.next_victims(4)
    job = e.mover.stage_clean(Tier.HOST, victims)
    done, seconds = e.mover.copy_clean(job)
    taken = e.host.index.allocate(4)  # the host evicts both (its sink keeps nothing here)
    assert e.mover.settle_clean(job, done, seconds) == 0
    e.host.index.free(taken)
    assert e.cache.index.lookup_run(e.tokens, e.hashes, 0, 2) == []
    e.cache.check_integrity()
    recovered, ks = reopened(tmp_path, e)
    assert recovered == 0 and ks == []
