"""Prefix reuse end to end: chaining, verification, equivalence, pins, salts, sharing."""

from __future__ import annotations

import random
import threading

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from internals import Internals

from kvsession import LLM, CacheFullError, ConfigError, SamplingParams
from kvsession.engine.loop import MAX_IDLE_WAIT_S
from oracle import random_prompts

GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
BS = 16


def gen(llm, prompts, params=GREEDY):
    return llm.generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False)


@pytest.fixture(scope="module")
def cached(llama_dir):
    with LLM(llama_dir, kv_cache_memory="4MiB", max_model_len=512, block_size=BS) as llm:
        Internals(llm).check_every_step()
        yield llm


@pytest.fixture(scope="module")
def uncached(llama_dir):
    with LLM(llama_dir, kv_cache_memory="4MiB", max_model_len=512, block_size=BS,
             enable_prefix_caching=False) as llm:
        yield llm


def test_repeated_prompt_hits_whole_blocks(cached, uncached):
    (p,) = random_prompts(20, [70], 500)
    first, again = gen(cached, [p])[0], gen(cached, [p])[0]
    assert first.num_cached_tokens == 0
    assert again.num_cached_tokens == 64  # 4 whole blocks; the 70th token is recomputed
    assert first.token_ids == again.token_ids == gen(uncached, [p])[0].token_ids
    assert gen(uncached, [p])[0].num_cached_tokens == 0
    assert uncached.stats().prefix.cached_blocks == 0


def test_hashes_are_chained(cached, uncached):
    a, b = random_prompts(21, [BS, BS], 500)
    shared_second = random_prompts(22, [BS + 5], 500)[0]
    p1, p2 = a + shared_second, b + shared_second  # same 2nd block, different 1st block
    out1 = gen(cached, [p1])[0]
    out2 = gen(cached, [p2])[0]
    assert out2.num_cached_tokens == 0  # the identical second block is not reused
    assert [out1.token_ids, out2.token_ids] == [o.token_ids for o in gen(uncached, [p1, p2])]


def test_collisions_are_rejected_by_token_verification(llama_dir, uncached):
    prompts = random_prompts(23, [40, 40, 40], 500)
    with LLM(llama_dir, kv_cache_memory="4MiB", max_model_len=512, block_size=BS) as llm:
        Internals(llm).hasher.hash_fn = lambda data: b"\0" * 32  # every block collides
        outs = [gen(llm, [p])[0] for p in prompts]
        again = gen(llm, [prompts[0]])[0]
        llm.check_integrity()
    assert [o.num_cached_tokens for o in outs] == [0, 0, 0]
    assert [o.token_ids for o in outs] == [o.token_ids for o in gen(uncached, prompts)]
    # the block that owns the colliding hash is still found for its own tokens only
    assert again.num_cached_tokens == BS and again.token_ids == outs[0].token_ids


def test_salts_isolate_tenants(cached):
    (p,) = random_prompts(24, [50], 500)
    a = SamplingParams(max_tokens=4, temperature=0.0, cache_salt="tenant-a")
    b = SamplingParams(max_tokens=4, temperature=0.0, cache_salt="tenant-b")
    assert gen(cached, [p], a)[0].num_cached_tokens == 0
    assert gen(cached, [p], b)[0].num_cached_tokens == 0
    assert gen(cached, [p], a)[0].num_cached_tokens == 48
    assert gen(cached, [p], GREEDY)[0].num_cached_tokens == 0  # unsalted is its own tenant


def test_concurrent_requests_share_a_prefix_being_computed(cached, uncached):
    shared = random_prompts(25, [96], 500)[0]
    prompts = [shared + own for own in random_prompts(26, [5, 9, 14, 20], 500)]
    outs = gen(cached, prompts)
    cached_tokens = sorted(o.num_cached_tokens for o in outs)
    assert cached_tokens == [0, 96, 96, 96]
    assert [o.token_ids for o in outs] == [o.token_ids for o in gen(uncached, prompts)]


@settings(max_examples=12, deadline=None, suppress_health_check=list(HealthCheck))
@given(st.data())
def test_outputs_with_cache_equal_outputs_without(llama_dir, data):
    seed = data.draw(st.integers(0, 10**6))
    rng = random.Random(seed)
    stems = random_prompts(seed, [rng.randint(0, 80) for _ in range(3)], 500)
    prompts = []
    for _ in range(data.draw(st.integers(2, 6))):
        stem = rng.choice(stems)[: rng.randint(0, 80)]
        prompts.append(stem + random_prompts(rng.randint(0, 999), [rng.randint(1, 40)], 500)[0])
    # 24 blocks of 8 tokens: shared blocks are evicted and re-hit all the time
    kwargs = dict(kv_cache_memory=24 * 8 * 512, max_model_len=128, block_size=8)
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    with LLM(llama_dir, **kwargs) as on, LLM(llama_dir, enable_prefix_caching=False,
                                             **kwargs) as off:
        Internals(on).check_every_step()
        got = [o.token_ids for o in gen(on, prompts, params)]
        got += [o.token_ids for o in gen(on, prompts[::-1], params)]
        want = [o.token_ids for o in gen(off, prompts, params)]
        want += [o.token_ids for o in gen(off, prompts[::-1], params)]
    assert got == want


def test_pinned_prefix_survives_a_flood(llama_dir):
    # 64 blocks of 16 tokens; pin 6 blocks, then flood with 40 unrelated prompts
    with LLM(llama_dir, kv_cache_memory=64 * 16 * 512, max_model_len=256) as llm:
        system = random_prompts(30, [100], 500)[0]
        pin = llm.pin(system)
        assert (pin.num_tokens, pin.num_blocks) == (96, 6)
        assert llm.stats().tiers["device"].blocks_pinned == 6
        evictions_before = llm.stats().prefix.evictions
        gen(llm, random_prompts(31, [200] * 40, 500))
        st = llm.stats()
        assert st.prefix.evictions > evictions_before + 6  # everything else was evicted
        out = gen(llm, [system + [1, 2, 3]])[0]
        assert out.num_cached_tokens == 96
        llm.check_integrity()
        pin.unpin()
        pin.unpin()
        assert not pin.active and llm.stats().tiers["device"].blocks_pinned == 0


def test_pin_budget_overflow_keeps_existing_pins(llama_dir):
    # 32 blocks, max_pinned_fraction 0.5 -> 16 blocks may be pinned
    with LLM(llama_dir, kv_cache_memory=32 * 16 * 512, max_model_len=256) as llm:
        first = llm.pin(random_prompts(32, [160], 500)[0])  # 10 blocks
        with pytest.raises(CacheFullError, match=r"asked 8, pinned 10, limit 16"):
            llm.pin(random_prompts(33, [128], 500)[0])
        assert first.active and llm.stats().prefix.pinned_blocks == 10
        again = llm.pin(first.token_ids)  # the same blocks: no new budget needed
        assert llm.stats().prefix.pinned_blocks == 10 and llm.stats().prefix.num_pins == 2
        first.unpin()
        assert llm.stats().prefix.pinned_blocks == 10  # still held by the second pin
        again.unpin()
        assert llm.stats().prefix.pinned_blocks == 0
        llm.check_integrity()
        with pytest.raises(ConfigError, match="block_size"):
            llm.pin([1, 2, 3])


def test_pin_ttl_expires_after_idle_time(llama_dir):
    with LLM(llama_dir, kv_cache_memory="4MiB", max_model_len=256) as llm:
        now = [1000.0]
        ins = Internals(llm)
        ins.set_prefix_clock(lambda: now[0])
        system = random_prompts(34, [48], 500)[0]
        pin = llm.pin(system, ttl_s=10.0)
        now[0] += 8.0
        assert gen(llm, [system + [7]])[0].num_cached_tokens == 48  # a hit refreshes the TTL
        now[0] += 8.0
        ins.housekeeping()
        assert pin.active
        now[0] += 2.5
        ins.housekeeping()
        assert not pin.active and llm.stats().prefix.num_pins == 0
        llm.check_integrity()


def test_a_salted_pin_stays_its_tenants_when_public_pins_change(llama_dir):
    """A tenant's requests hash as its pin was hashed (the public pins of pin time),
    whatever public pins come or go afterwards: they keep hitting it (they missed it when
    a public pin of its start appeared, or went), and other tenants still only share the
    public part."""
    rng = random.Random(7)
    p, x, y = ([rng.randrange(3, 500) for _ in range(n)] for n in (32, 32, 10))
    g = SamplingParams(max_tokens=1, temperature=0.0)

    def cached(llm, ids, salt):
        return llm.generate(prompt_token_ids=[ids], sampling_params=g.with_overrides(
            cache_salt=salt), use_tqdm=False)[0].num_cached_tokens

    for public_first in (False, True):
        with LLM(llama_dir, kv_cache_memory=320 * 1024, max_model_len=256) as llm:
            public = llm.pin(p) if public_first else None
            llm.pin(p + x, cache_salt="a")
            assert cached(llm, p + x + y, "a") == 64
            if public_first:
                public.unpin()
            else:
                llm.pin(p)
            assert cached(llm, p + x + y, "a") == 64
            assert cached(llm, p + x + y, None) <= len(p)
            assert cached(llm, p + x + y, "b") <= len(p)
            llm.check_integrity()


def test_far_deadlines_do_not_stop_the_engine(llama_dir):
    """A pin's or an idle session's deadline centuries away: the idle engine waits at most
    MAX_IDLE_WAIT_S at a time (Condition.wait raises OverflowError past
    threading.TIMEOUT_MAX, which killed the engine thread), and keeps serving."""
    with LLM(llama_dir, kv_cache_memory="4MiB", max_model_len=256,
             spill_after_s=1e10) as llm:
        s = llm.session(system="far")
        s.send("hello", max_tokens=2)
        pin = llm.pin(random_prompts(35, [32], 500)[0], ttl_s=1e10)
        wait_s = Internals(llm).housekeeping()
        assert wait_s is not None and 0 < wait_s <= MAX_IDLE_WAIT_S < threading.TIMEOUT_MAX
        assert gen(llm, [[5, 6, 7]])[0].token_ids and pin.active
        s.send("again", max_tokens=2)
        llm.check_integrity()
