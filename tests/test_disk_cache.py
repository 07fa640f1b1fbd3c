"""The disk tier's cache: content the host tier (or, without one, the device pool) evicts
after it was used more than once is written to one file under session_dir, found again by
hash (verified token by token, its bytes by checksum) by any later request, within its
budget, and found by the next process on the same directory. Every output is the one an
engine without caching gives."""

from __future__ import annotations

import os

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from internals import Internals
from test_prefix_cache import gen
from test_shared_tiers import BPT, DEVICE, G, fixed_rates, flood

from kvsession import LLM, ConfigError
from oracle import random_prompts

SLOT = 8192  # a slot of the tiny llama's 8-token block: 4 KiB of KV, its header, padding
HOST = dict(host_cache_memory=8 * 8 * BPT)  # 8 host blocks: the document cannot stay there


def used_twice_then_evicted(llm, doc, seed):
    """The document is computed, found once more (its blocks are reused), then pushed
    off the device and off the host by other work."""
    out = [gen(llm, [doc + [7, 8, 9]], G)[0], gen(llm, [doc + [10, 11]], G)[0]]
    assert out[1].num_cached_tokens == len(doc) // 8 * 8
    flood(llm, seed)
    flood(llm, seed + 1)
    return out


def test_reused_content_goes_down_to_disk_and_comes_back(llama_dir, tmp_path):
    (doc,) = random_prompts(3, [120], 500)
    q = doc + [1, 2, 3, 4]
    with fixed_rates(LLM(llama_dir, session_dir=tmp_path, disk_cache_memory=64 * SLOT,
                         **HOST, **DEVICE)) as llm, \
            LLM(llama_dir, enable_prefix_caching=False, **DEVICE) as plain:
        first = used_twice_then_evicted(llm, doc, 200)
        st = llm.stats()
        assert st.tiers["disk"].cached_blocks >= 15
        assert st.tiers["disk"].bytes_written >= 15 * 8 * BPT
        assert (tmp_path / ".blocks.kvc").stat().st_size <= 64 * SLOT
        before = st
        out = gen(llm, [q], G)[0]
        st = llm.stats()
        assert out.num_cached_tokens == 120  # all 15 blocks from below: only q's tail computed
        assert st.prefill_tokens - before.prefill_tokens == len(q) - 120
        disk_hits = st.tiers["disk"].hit_tokens - before.tiers["disk"].hit_tokens
        host_hits = st.tiers["host"].hit_tokens - before.tiers["host"].hit_tokens
        device_hits = st.prefix.hit_tokens - before.prefix.hit_tokens
        assert disk_hits >= 64 and disk_hits + host_hits + device_hits == 120
        assert st.tiers["disk"].bytes_read >= disk_hits * BPT
        assert out.token_ids == gen(plain, [q], G)[0].token_ids
        assert [o.token_ids for o in first] == [
            gen(plain, [p], G)[0].token_ids for p in (doc + [7, 8, 9], doc + [10, 11])]
        llm.check_integrity()


def test_content_used_once_never_reaches_disk(llama_dir, tmp_path):
    (doc,) = random_prompts(4, [120], 500)
    with fixed_rates(LLM(llama_dir, session_dir=tmp_path, disk_cache_memory=64 * SLOT,
                         **HOST, **DEVICE)) as llm:
        gen(llm, [doc + [7]], G)
        flood(llm, 210)
        flood(llm, 211)
        st = llm.stats()
        assert st.tiers["disk"].cached_blocks == 0
        assert st.tiers["disk"].bytes_written == 0
        assert gen(llm, [doc + [8]], G)[0].num_cached_tokens == 0


def test_without_a_host_tier_the_device_evicts_to_disk(llama_dir, tmp_path):
    (doc,) = random_prompts(5, [120], 500)
    q = doc + [9, 9]
    with fixed_rates(LLM(llama_dir, session_dir=tmp_path, disk_cache_memory=64 * SLOT,
                         host_cache_memory=0, **DEVICE)) as llm, \
            LLM(llama_dir, enable_prefix_caching=False, **DEVICE) as plain:
        used_twice_then_evicted(llm, doc, 220)
        st = llm.stats()
        assert st.prefix.evictions_by_copy.get("disk", 0) >= 15
        out = gen(llm, [q], G)[0]
        assert out.num_cached_tokens == 120
        assert llm.stats().tiers["disk"].hit_tokens - st.tiers["disk"].hit_tokens >= 64
        assert out.token_ids == gen(plain, [q], G)[0].token_ids


def test_the_next_process_finds_the_cache(llama_dir, tmp_path):
    """The file is self-describing: a new LLM on the directory publishes its intact slots
    again and loads the document from them (its host tier is empty)."""
    (doc,) = random_prompts(6, [120], 500)
    q = doc + [4, 4, 4]
    kw = dict(session_dir=tmp_path, disk_cache_memory=64 * SLOT, **HOST, **DEVICE)
    with fixed_rates(LLM(llama_dir, **kw)) as llm:
        used_twice_then_evicted(llm, doc, 230)
        on_disk = llm.stats().tiers["disk"].cached_blocks
        assert on_disk >= 15
    with fixed_rates(LLM(llama_dir, **kw)) as llm, \
            LLM(llama_dir, enable_prefix_caching=False, **DEVICE) as plain:
        assert Internals(llm).disk_cache.recovered_blocks == on_disk
        out = gen(llm, [q], G)[0]
        assert out.num_cached_tokens == 120
        assert llm.stats().tiers["disk"].hit_tokens == 120
        assert out.token_ids == gen(plain, [q], G)[0].token_ids
        llm.check_integrity()


def test_a_prefix_whose_head_stays_on_the_device_is_found_by_the_next_process(llama_dir,
                                                                           tmp_path):
    """The document's first blocks, used most, stay on the device while its tail is evicted:
    the tail goes to disk with its cached ancestors, so the next process finds all of it
    (without them it would find nothing: a lookup starts at the first block it misses)."""
    (doc,) = random_prompts(9, [120], 500)
    kw = dict(session_dir=tmp_path, disk_cache_memory=64 * SLOT, host_cache_memory=0,
              **DEVICE)
    with fixed_rates(LLM(llama_dir, **kw)) as llm:
        for i in range(6):  # the head (6 blocks): used eight times; the tail twice
            gen(llm, [doc[:48] + [i]], G)
        gen(llm, [doc + [7]], G)
        gen(llm, [doc + [8]], G)
        flood(llm, 230, length=180)
        before = llm.stats()
        assert gen(llm, [doc[:48] + [9]], G)[0].num_cached_tokens == 48
        assert llm.stats().prefix.hit_tokens - before.prefix.hit_tokens == 48  # on device
        assert llm.stats().tiers["disk"].cached_blocks >= 15
    with fixed_rates(LLM(llama_dir, **kw)) as llm, \
            LLM(llama_dir, enable_prefix_caching=False, **DEVICE) as plain:
        out = gen(llm, [doc + [5]], G)[0]
        assert out.num_cached_tokens == 120
        assert llm.stats().tiers["disk"].hit_tokens == 120
        assert out.token_ids == gen(plain, [doc + [5]], G)[0].token_ids


def test_a_damaged_slot_is_recomputed_from_there(llama_dir, tmp_path):
    (doc,) = random_prompts(7, [120], 500)
    q = doc + [3, 1]
    kw = dict(session_dir=tmp_path, disk_cache_memory=64 * SLOT, **HOST, **DEVICE)
    with fixed_rates(LLM(llama_dir, **kw)) as llm:
        used_twice_then_evicted(llm, doc, 240)
    with fixed_rates(LLM(llama_dir, **kw)) as llm, \
            LLM(llama_dir, enable_prefix_caching=False, **DEVICE) as plain:
        ins = Internals(llm)
        cache = ins.disk_cache
        slot = ins.on_engine(lambda: cache.index.index[ins.hasher.extend([], doc, 80, None)[9]]
                             .block_id)
        # one byte of block 9's KV flipped behind the cache's back
        with open(tmp_path / ".blocks.kvc", "r+b") as f:
            f.seek(slot * cache.slot_bytes + cache.header_bytes + 100)
            byte = f.read(1)
            f.seek(-1, os.SEEK_CUR)
            f.write(bytes([byte[0] ^ 0xFF]))
        cached = llm.stats().tiers["disk"].cached_blocks
        out = gen(llm, [q], G)[0]
        assert out.num_cached_tokens == 72  # blocks 0..8 loaded, 9.. computed
        assert llm.stats().tiers["disk"].hit_tokens == 72
        assert out.token_ids == gen(plain, [q], G)[0].token_ids
        # the damaged slot is found by nobody again (the recomputed block replaced it)
        again = gen(llm, [q], G)[0]
        assert again.token_ids == out.token_ids
        assert llm.stats().tiers["disk"].cached_blocks <= cached
        llm.check_integrity()


def test_the_budget_bounds_the_file(llama_dir, tmp_path):
    docs = random_prompts(8, [120, 120], 500)
    with fixed_rates(LLM(llama_dir, session_dir=tmp_path, disk_cache_memory=10 * SLOT,
                         **HOST, **DEVICE)) as llm:
        for i, doc in enumerate(docs):
            used_twice_then_evicted(llm, doc, 250 + 2 * i)
        assert llm.stats().tiers["disk"].cached_blocks == 10
        assert (tmp_path / ".blocks.kvc").stat().st_size <= 10 * SLOT
        llm.check_integrity()


def test_one_process_owns_the_cache(llama_dir, tmp_path):
    kw = dict(session_dir=tmp_path, disk_cache_memory=64 * SLOT, **DEVICE)
    with LLM(llama_dir, **kw) as first, LLM(llama_dir, **kw) as second:
        assert Internals(first).disk_cache is not None
        assert Internals(second).disk_cache is None  # runs without one (logged)


def test_a_disk_cache_needs_a_session_dir(llama_dir):
    with pytest.raises(ConfigError, match="session_dir"):
        LLM(llama_dir, disk_cache_memory="1GiB", **DEVICE)


@pytest.fixture(scope="module")
def cache_dir(llama_dir, tmp_path_factory):
    """A directory whose disk cache holds a document's 15 blocks, the reference output of a
    question about it, and the document."""
    root = tmp_path_factory.mktemp("disk_cache")
    (doc,) = random_prompts(9, [120], 500)
    kw = dict(session_dir=root, disk_cache_memory=64 * SLOT, **HOST, **DEVICE)
    with fixed_rates(LLM(llama_dir, **kw)) as llm:
        used_twice_then_evicted(llm, doc, 260)
    with LLM(llama_dir, enable_prefix_caching=False, **DEVICE) as plain:
        expected = gen(plain, [doc + [2, 7]], G)[0].token_ids
    return root, doc, expected


@settings(max_examples=12, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(cut=st.one_of(st.none(), st.floats(0.0, 1.0)),
       flips=st.lists(st.floats(0.0, 1.0), max_size=4))
def test_a_crash_loses_cache_blocks_never_output(llama_dir, cache_dir, tmp_path_factory, cut,
                                                 flips):
    """What a crash can leave of the file (a torn tail: cut anywhere; bytes a torn write
    left behind: flipped anywhere, headers or KV) costs cache hits, never a wrong token: the
    next process publishes only intact headers, and a load checks each slot's bytes."""
    root, doc, expected = cache_dir
    d = tmp_path_factory.mktemp("crashed")
    data = bytearray((root / ".blocks.kvc").read_bytes())
    if cut is not None:
        del data[int(cut * len(data)):]
    for f in flips:
        if data:
            data[min(int(f * len(data)), len(data) - 1)] ^= 0x5A
    (d / ".blocks.kvc").write_bytes(bytes(data))
    kw = dict(session_dir=d, disk_cache_memory=64 * SLOT, **HOST, **DEVICE)
    with fixed_rates(LLM(llama_dir, **kw)) as llm:
        out = gen(llm, [doc + [2, 7]], G)[0]
        assert out.token_ids == expected
        assert out.num_cached_tokens == llm.stats().tiers["disk"].hit_tokens
        if cut is None and not flips:
            assert out.num_cached_tokens == 120
        llm.check_integrity()
