"""The cost-aware eviction policy on small pools: exact victims and why in each order
(recency, frequency), which order the pool follows (its shadows' hits), and properties
(referenced blocks are never victims, a prefix never goes before its cached descendants,
the pool stays consistent). The engine-level regression: a reused prefix survives rounds
of one-off prompts larger than the pool."""

from __future__ import annotations

import random

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvsession import LLM, SamplingParams
from kvsession.cache.block_pool import BlockPool
from kvsession.cache.eviction import POSITION_KNEE_TOKENS, EvictionPolicy, Order
from kvsession.cache.hashing import BlockHasher

BS = 4
HASHER = BlockHasher({"model": "eviction-test"}, BS)


def chain(pool: BlockPool, first_token: int, num_blocks: int, prefix=()):
    """Compute a chain of blocks after `prefix` (hit blocks) and publish it; returns the
    blocks (referenced) and their hashes."""
    prefix = list(prefix)
    tokens = [t for b in prefix for t in b.token_ids]
    tokens += [first_token + i for i in range(num_blocks * BS)]
    hashes = HASHER.extend([], tokens, len(tokens), None)
    pool.touch(prefix)
    fresh = pool.allocate(num_blocks)
    blocks = prefix + fresh
    for i in range(len(prefix), len(blocks)):
        pool.cache_full_block(blocks[i], hashes[i], tokens[i * BS:(i + 1) * BS],
                              hashes[i - 1] if i else None)
    return blocks, hashes


def victims(pool: BlockPool, n: int) -> list[int]:
    """Which cached blocks the next `n` allocations evict (block ids, in order)."""
    out = []
    for _ in range(n):
        (b,) = pool.allocate(1)
        out.append(b.block_id)
        pool.free([b])  # uncached now: reused first by the next allocation
        (again,) = pool.allocate(1)
        assert again is b
    return out


def cost_pool(n: int = 8) -> BlockPool:
    return BlockPool(n, BS, eviction=EvictionPolicy.COST)


def test_a_reused_block_outlives_one_off_blocks_freed_after_it():
    pool = cost_pool(6)
    prefix, _ = chain(pool, 0, 2)  # blocks 0, 1
    pool.free(prefix)
    again, _ = chain(pool, 0, 0, prefix)  # a prefix hit: hits = 2
    pool.free(again)
    scan, _ = chain(pool, 100, 4)  # blocks 2..5, one-off
    pool.free(scan)
    # the scan goes first, tail first, although it was freed last
    assert [b.block_id for b in pool.free_queue][:4] == [5, 4, 3, 2]
    held = pool.allocate(4)
    assert sorted(b.block_id for b in held) == [2, 3, 4, 5]
    assert pool.evictions_by_reason == {"recency": 4}
    assert pool.lookup(prefix[0].block_hash, list(range(4))) is prefix[0]  # still cached
    pool.free(held)
    pool.check_integrity()


def test_a_shared_prefix_outlives_a_private_history_freed_after_it():
    """Recency order: a prefix with two different continuations (a system prompt) counts its
    7 hits as log2(8) = 3; a private chain hit 3 times counts 2 (the cap), so although it
    was freed later it goes first. Without the shared-prefix rule the prefix (priced
    `clock + 2` when it was freed, earlier) would go before the private chain."""
    pool = BlockPool(8, BS, eviction=EvictionPolicy.COST, orders=(Order.RECENCY,))
    sys_prompt, _ = chain(pool, 0, 1)  # block 0
    pool.free(sys_prompt)
    first, _ = chain(pool, 10, 1, sys_prompt)  # block 1 extends the chain end: inherits 2
    pool.free(first)
    assert not sys_prompt[0].evict.shared
    other, _ = chain(pool, 20, 1, sys_prompt)  # block 2: a second continuation, hits 1
    pool.free(other)
    assert sys_prompt[0].evict.shared and sys_prompt[0].evict.branches == 2
    for _ in range(4):
        again, _ = chain(pool, 0, 0, sys_prompt)
        pool.free(again)
    private, _ = chain(pool, 100, 2)  # blocks 3, 4
    pool.free(private)
    for _ in range(2):
        again, _ = chain(pool, 100, 0, private)
        pool.free(again)
    assert [b.evict.hits for b in pool.blocks[:5]] == [7, 2, 1, 3, 3]
    q = pool.free_queue
    assert q.value(sys_prompt[0]) == pytest.approx(3.0) and q.value(private[1]) > 2.0
    rest = pool.allocate(3)  # blocks 5..7 have no content
    # the branch (1 hit), the inherited continuation (2, freed early), the private chain
    # tail first, and the shared prefix, parked until its children went, last
    assert victims(pool, 5) == [2, 1, 4, 3, 0]
    assert pool.evictions_by_reason == {"recency": 5}
    pool.free(rest)
    pool.check_integrity()


@pytest.mark.parametrize("order, expected", [(Order.RECENCY, ["often", "twice"]),
                                             (Order.FREQUENCY, ["twice", "often"])])
def test_recency_forgets_old_hits_frequency_keeps_them(order, expected):
    """Recency caps both hit counts at 2: the content freed earlier goes first. Frequency
    counts all 5 (and ages by one unit per pool turnover, far from here): the content hit
    twice goes first."""
    pool = BlockPool(3, BS, eviction=EvictionPolicy.COST, orders=(order,))
    assert not pool.shadows  # one order: nothing to choose
    assert often_then_twice(pool) == expected
    assert pool.evictions_by_reason == {order.value: 2}
    pool.check_integrity()


NAMES: dict[str, int] = {}


def block_hashes(names: list[str]) -> list[bytes]:
    """A prompt as a chain of named blocks (equal prefixes, equal hashes)."""
    tokens = [NAMES.setdefault(name, 1000 + len(NAMES)) for name in names for _ in range(BS)]
    return HASHER.extend([], tokens, len(tokens), None)


def often_then_twice(pool: BlockPool) -> list[int]:
    """Block content hit 5 times, then other content hit twice (freed after it); the rest
    of the pool held without content. The next two victims."""
    often, _ = chain(pool, 0, 1)
    pool.free(often)
    for _ in range(4):
        again, _ = chain(pool, 0, 0, often)
        pool.free(again)
    twice, _ = chain(pool, 10, 1)
    pool.free(twice)
    again, _ = chain(pool, 10, 0, twice)
    pool.free(again)
    assert (often[0].evict.hits, twice[0].evict.hits) == (5, 2)
    rest = pool.allocate(pool.num_blocks - 2)
    out = [{often[0].block_id: "often", twice[0].block_id: "twice"}[i]
           for i in victims(pool, 2)]
    pool.free(rest)
    return out


def test_the_pool_follows_the_order_whose_shadow_hits_more():
    """A 3-block prompt A comes back every 4th prompt; between, three 2-block prompts from
    a set of four that are reused too (hits 2 each, like A's under the cap). In the recency
    order everything counts 2 and A, least recently freed, loses its tail to them; the
    frequency order keeps A (its hits keep growing). Its shadow hits more, the pool follows
    it. An agent-like stream (sessions of four turns on one system prompt, one-off scans
    between) keeps the recency order."""
    pool = cost_pool(8)
    assert pool.free_queue.leader is Order.RECENCY and len(pool.shadows) == 2
    hot = block_hashes(["A0", "A1", "A2"])
    for i in range(30):
        pool.observe(hot)
        for k in range(3 * i, 3 * i + 3):
            pool.observe(block_hashes([f"c{k % 4}x", f"c{k % 4}y"]))
    recency, frequency = pool.shadows
    assert all(h in frequency.index for h in hot)
    assert hot[2] not in recency.index
    assert pool.duel_scores[1] > pool.duel_scores[0]
    assert pool.free_queue.leader is Order.FREQUENCY
    assert often_then_twice(pool) == ["twice", "often"]  # the real pool follows it
    assert pool.evictions_by_reason == {"frequency": 2}
    pool.check_integrity()

    pool = cost_pool(12)
    for s in range(10):
        history = ["sys0", "sys1"]
        for t in range(4):
            history = history + [f"s{s}t{t}"]
            pool.observe(block_hashes(history))
            if t % 2:
                pool.observe(block_hashes([f"scan{s}.{t}.{j}" for j in range(6)]))
    assert pool.duel_scores[0] > pool.duel_scores[1]
    assert pool.free_queue.leader is Order.RECENCY
    pool.check_integrity()


def test_stale_entries_stay_bounded_without_prefix_hits():
    """Victims leave only the leading order's heap; the other order's entries go stale and
    must be dropped even when nothing is ever revived (no prefix hits, only scans)."""
    pool = cost_pool(16)
    for i in range(200):
        blocks, _ = chain(pool, 100 * i, 4)
        pool.free(blocks)
    assert pool.free_queue.num_entries <= 2 * (2 * 16 + 64)
    pool.check_integrity()


def test_lru_evicts_the_reused_prefix_first():
    pool = BlockPool(6, BS, eviction=EvictionPolicy.LRU)
    prefix, _ = chain(pool, 0, 2)
    pool.free(prefix)
    again, _ = chain(pool, 0, 0, prefix)
    pool.free(again)
    scan, _ = chain(pool, 100, 4)
    pool.free(scan)
    held = pool.allocate(4)
    # least recently freed first: the prefix (1, 0), then the scan's tail (5, 4)
    assert [b.block_id for b in held] == [1, 0, 5, 4]
    assert pool.evictions_by_reason == {"lru": 4}
    pool.free(held)
    pool.check_integrity()


def test_leaf_first_a_prefix_waits_for_its_descendants():
    pool = cost_pool(8)
    root, _ = chain(pool, 0, 2)  # 0, 1
    pool.free(root)
    for _ in range(3):  # the root is reused a lot: hits 4
        hit, _ = chain(pool, 0, 0, root)
        pool.free(hit)
    branch, _ = chain(pool, 50, 2, root[:2])  # 2, 3 extend it (inherit its hits)
    pool.free(branch)
    assert branch[2].evict.parent[0] is root[1] and root[1].evict.num_children == 1
    assert [b.block_id for b in pool.free_queue][-2:] == [1, 0]  # parked: not candidates
    # everything is evicted tail first: 3, 2 (the leaf chain), then the root 1, 0
    uncached = pool.allocate(4)  # 4..7 have no content: reused before any eviction
    assert pool.num_evictions == 0
    assert victims(pool, 4) == [3, 2, 1, 0]
    pool.free(uncached)
    pool.check_integrity()


def test_a_block_with_a_host_copy_is_dropped_first():
    pool = cost_pool(4)
    a, _ = chain(pool, 0, 1)
    b, _ = chain(pool, 10, 1)
    c, _ = chain(pool, 20, 1)
    pool.note_copy(b, "host", 0.1)  # b was spilled: reloading it costs a tenth
    pool.free(a)
    pool.free(b)
    pool.free(c)
    rest = pool.allocate(1)  # block 3: no content
    assert victims(pool, 2) == [b[0].block_id, a[0].block_id]
    assert pool.evictions_by_copy == {"host": 1, "none": 1}
    pool.free(rest)
    pool.check_integrity()


def test_reload_cost_grows_with_position_and_falls_with_a_copy():
    pool = cost_pool(8)
    short, _ = chain(pool, 0, 1)  # a leaf at position 0
    long, _ = chain(pool, 100, 3)  # its leaf at position 2
    q = pool.free_queue
    assert long[2].evict.depth == 2 and short[0].evict.depth == 0
    assert q.cost(short[0]) == 1.0
    assert q.cost(long[2]) == pytest.approx(1 + 2 * BS / POSITION_KNEE_TOKENS)
    pool.note_copy(long, "disk", 0.25)
    assert q.cost(long[2]) == pytest.approx(0.25 * (1 + 2 * BS / POSITION_KNEE_TOKENS))
    pool.touch(long)  # referenced again: the copy is no longer what would be reloaded
    assert long[2].evict.copy_tier is None and q.cost(long[2]) > 1.0
    pool.free(long)
    pool.free(long)
    pool.free(short)
    pool.check_integrity()


def test_a_referenced_block_is_never_a_victim_and_all_or_nothing():
    pool = cost_pool(4)
    held, _ = chain(pool, 0, 2)
    other, _ = chain(pool, 10, 2)
    pool.free(other)
    with pytest.raises(Exception, match="KV blocks"):
        pool.allocate(3)
    got = pool.allocate(2)
    assert {b.block_id for b in got} == {b.block_id for b in other}
    assert all(b.block_hash is not None for b in held)
    pool.free(got)
    pool.free(held)
    pool.check_integrity()


@pytest.mark.parametrize("leader", list(Order))
@settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck),
          derandomize=True)
@given(st.lists(st.tuples(st.integers(0, 3), st.integers(0, 5), st.integers(1, 4)),
                min_size=1, max_size=40))
def test_properties_hold_under_random_workloads(leader, ops):
    """Random requests on a 10-block pool, starting in either order (the shadows replay
    every request and may switch it): victims are free, leaves unless only prefixes of
    blocks in use are free, and the pool and its shadows stay consistent."""
    pool = cost_pool(10)
    pool.free_queue.leader = leader
    live: list[list] = []
    roots: dict[int, list] = {}
    for kind, key, n in ops:
        if kind == 0 and live:  # finish a request
            pool.free(live.pop(key % len(live)))
        elif kind == 3 and key in roots:  # note a copy of a root chain
            pool.note_copy([b for b in roots[key] if b.block_hash], "disk", 0.5)
        else:  # a request: hit what is cached of a root's chain, compute n more blocks
            prefix = []
            for b in roots.get(key, []):
                if b.block_hash is None or pool.lookup(b.block_hash, b.token_ids) is not b:
                    break
                prefix.append(b)
            if pool.num_free < n + sum(1 for b in prefix if b.ref_cnt == 0):
                continue
            before = {b.block_id: (b.ref_cnt, b.evict.num_children, b.block_hash)
                      for b in pool.blocks}
            links = {b: b.evict.parent for b in pool.blocks}
            parent_of = {b.block_id: link[0].block_id for b, link in links.items()
                         if link is not None and link[0].evict.generation == link[1]}
            blocks, hashes = chain(pool, 1000 * key + 100 * len(prefix), n, prefix)
            pool.observe(hashes)
            fresh = [b.block_id for b in blocks[len(prefix):]]
            for i, b in enumerate(blocks[len(prefix):]):
                ref, children, h = before[b.block_id]
                assert ref == 0  # never a referenced block
                # a prefix goes only after every cached child of it (earlier victims of
                # this allocation), unless only prefixes of blocks in use were free
                kids = [c for c, p in parent_of.items() if p == b.block_id]
                assert h is None or set(kids) <= set(fresh[:i]) or \
                    pool.free_queue.last_reason == "non_leaf"
            roots[key] = blocks
            live.append(blocks)
        pool.check_integrity()
    for blocks in live:
        pool.free(blocks)
    pool.check_integrity()


def test_a_reused_prefix_survives_rounds_of_one_off_prompts(llama_dir):
    """The issue's case: a 6-block prefix reused between rounds of one-off prompts larger
    than the pool. LRU evicts it every round; the cost-aware policy recognises the prefix
    when it is computed again (its ghost) and keeps it from then on."""
    rng = random.Random(0)
    bs, pool_blocks = 16, 48
    prefix = [rng.randrange(1, 400) for _ in range(6 * bs)]
    one = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    cached = {}
    for policy in ("lru", "cost"):
        with LLM(llama_dir, kv_cache_memory=pool_blocks * bs * 512, block_size=bs,
                 max_model_len=512, eviction_policy=policy, host_cache_memory=0) as llm:
            got = []
            for _ in range(4):
                out = llm.generate(prompt_token_ids=[prefix + [7, 8, 9]], sampling_params=one,
                                   use_tqdm=False)[0]
                got.append(out.num_cached_tokens)
                for _ in range(4):  # 4 x 16 = 64 blocks of one-off prompts per round
                    ids = [rng.randrange(1, 400) for _ in range(16 * bs)]
                    llm.generate(prompt_token_ids=[ids], sampling_params=one, use_tqdm=False)
            cached[policy] = got
            assert llm.stats().prefix.eviction_policy == policy
    assert cached["lru"] == [0, 0, 0, 0]
    assert cached["cost"] == [0, 0, 96, 96]
