"""The host tier is indexed by content and shared by every request: what the device pool
evicts is kept there and loaded back by hash (verified token by token) for any later
prompt, a session's spill stores blocks another spill already holds once, and every output
is the one an engine without caching gives."""

from __future__ import annotations

import random

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from internals import Internals
from test_prefix_cache import gen

from kvsession import LLM, SamplingParams
from kvsession.cache.manager import Tier
from oracle import random_prompts

BPT = 512  # the tiny llama's KV bytes per token
# 32 blocks of 8 tokens on the device: two 120-token documents and their questions cannot
# stay there together with the other traffic
DEVICE = dict(kv_cache_memory=32 * 8 * BPT, max_model_len=256, block_size=8)
G = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)


def flood(llm, seed, length=200):
    """Two prompts one after the other: nothing else stays on the device."""
    for p in random_prompts(seed, [length, length], 500):
        gen(llm, [p], G)


def fixed_rates(llm):
    """Loading from the host (or the disk cache) always beats recomputing here, whatever
    the machine's load."""
    ins = Internals(llm)
    ins.check_every_step()
    ins.fix_rate("host", 1e12)
    ins.fix_rate("disk_read", 1e12)
    ins.fix_rate("prefill", 1e3)
    return llm


def test_an_evicted_prefix_comes_back_from_the_host(llama_dir):
    (doc,) = random_prompts(1, [120], 500)
    q1, q2 = doc + [7, 8, 9], doc + [10, 11, 12, 13]
    with fixed_rates(LLM(llama_dir, host_cache_memory=64 * 8 * BPT, **DEVICE)) as llm, \
            LLM(llama_dir, enable_prefix_caching=False, **DEVICE) as plain:
        first = gen(llm, [q1], G)[0]
        flood(llm, 100)  # evicts the document's blocks from the device
        st = llm.stats()
        assert st.prefix.evictions_by_copy.get("host", 0) >= 15
        assert st.tiers["host"].bytes_written >= 15 * 8 * BPT
        assert st.tiers["host"].cached_blocks >= 15
        prefill_before = st.prefill_tokens
        again = gen(llm, [q2], G)[0]
        st = llm.stats()
        # the document's 15 full blocks came from the host: only the question is computed
        assert again.num_cached_tokens == 120
        assert st.prefill_tokens - prefill_before == len(q2) - 120
        assert st.tiers["host"].hit_tokens == 120
        assert st.tiers["host"].bytes_read == 15 * 8 * BPT
        assert first.token_ids == gen(plain, [q1], G)[0].token_ids
        assert again.token_ids == gen(plain, [q2], G)[0].token_ids
        llm.check_integrity()


def test_without_a_host_tier_an_evicted_prefix_is_recomputed(llama_dir):
    (doc,) = random_prompts(1, [120], 500)
    with fixed_rates(LLM(llama_dir, host_cache_memory=0, **DEVICE)) as llm:
        gen(llm, [doc + [7]], G)
        flood(llm, 100)
        assert gen(llm, [doc + [8]], G)[0].num_cached_tokens == 0
        st = llm.stats()
        assert st.prefix.evictions_by_copy.get("host", 0) == 0
        assert st.tiers["host"].hit_tokens == 0


def test_a_host_collision_is_a_miss(llama_dir):
    """A host block found under a prompt's hash but holding other tokens is never loaded."""
    (doc,) = random_prompts(2, [120], 500)
    with fixed_rates(LLM(llama_dir, host_cache_memory=64 * 8 * BPT, **DEVICE)) as llm:
        gen(llm, [doc + [7]], G)
        flood(llm, 101)

        ins = Internals(llm)

        def corrupt():  # the first host block of the document now claims other tokens
            b = ins.host_index.index[ins.hasher.extend([], doc, 8, None)[0]]
            b.token_ids = tuple(t + 1 for t in b.token_ids)
        ins.on_engine(corrupt)
        out = gen(llm, [doc + [8]], G)[0]
        assert out.num_cached_tokens == 0  # a miss from the first block on
        assert llm.stats().tiers["host"].hit_tokens == 0


def test_a_spilled_session_serves_a_stateless_request_from_the_host(llama_dir):
    """The session's blocks on the host are found by a request that starts with the same
    tokens (the session's own rendering), after the device has evicted its copies."""
    with fixed_rates(LLM(llama_dir, host_cache_memory=64 * 8 * BPT, **DEVICE)) as llm:
        ins = Internals(llm)
        s = llm.session(system="You are terse.", sampling=G)
        s.send("Summarise the design document in two lines, please, with care.")
        assert ins.spill(s, Tier.HOST) is Tier.HOST
        tokens = list(s.kv.tokens)
        num_full = len(tokens) // 8 * 8
        flood(llm, 102)  # evicts (most of) the session's device copies
        device_hits = llm.stats().prefix.hit_tokens
        out = gen(llm, [tokens[:num_full] + [5, 6]], G)[0]
        assert out.num_cached_tokens == num_full
        st = llm.stats()
        host_hits = st.tiers["host"].hit_tokens
        assert host_hits >= num_full // 2
        assert st.prefix.hit_tokens - device_hits + host_hits == num_full
        # the session still holds its host blocks and continues from them
        assert s.state == "host"
        s.send("And the risks?")
        llm.check_integrity()


def test_sessions_with_a_common_history_store_it_once_on_the_host(llama_dir):
    with fixed_rates(LLM(llama_dir, host_cache_memory=64 * 8 * BPT, **DEVICE)) as llm:
        ins = Internals(llm)
        a = llm.session(system="You are a careful reviewer of long design documents.",
                        sampling=G)
        a.send("Here is the document: " + "the cache is state; " * 6)
        b = a.fork()
        assert ins.spill(a, Tier.HOST) is Tier.HOST
        used = llm.stats().tiers["host"].blocks_used
        assert ins.spill(b, Tier.HOST) is Tier.HOST
        st = llm.stats().tiers["host"]
        # the fork's full blocks are the parent's: referenced, not copied again; only its
        # partial last block is its own
        assert st.blocks_used == used + 1
        ra, rb = a.send("Next?"), b.send("Next?")
        assert ra.token_ids == rb.token_ids
        llm.check_integrity()


def test_random_traces_through_the_host_match_an_engine_without_caching(llama_dir):
    """Seeded traces of stateless prompts over shared stems with a device pool far smaller
    than their working set: prefixes go to the host and come back, interleaved with each
    other's evictions; every output equals the uncached engine's."""
    for seed in range(3):
        rng = random.Random(seed)
        stems = random_prompts(seed, [96, 64, 120], 500)
        prompts = [rng.choice(stems)[:rng.randint(40, 120)]
                   + random_prompts(rng.randint(0, 999), [rng.randint(1, 30)], 500)[0]
                   for _ in range(12)]
        small = dict(DEVICE, kv_cache_memory=24 * 8 * BPT, max_model_len=160)
        with fixed_rates(LLM(llama_dir, host_cache_memory=20 * 8 * BPT, **small)) as llm, \
                LLM(llama_dir, enable_prefix_caching=False, **small) as plain:
            got = [o.token_ids for o in gen(llm, prompts, G)]
            got += [o.token_ids for o in gen(llm, prompts[::-1], G)]
            assert llm.stats().tiers["host"].hit_tokens > 0
            want = [o.token_ids for o in gen(plain, prompts, G)]
            want += [o.token_ids for o in gen(plain, prompts[::-1], G)]
            llm.check_integrity()
        assert got == want, seed


def test_a_dropped_session_turn_loads_its_blocks_back_from_the_host(llama_dir):
    """A session's turn continues after its attached blocks (its pinned system prompt):
    what its earlier spill left on the host is loaded, not recomputed, and the reply is
    the one of a session that never left the device."""
    system = "You are a careful reviewer of long design documents and their risks."
    first, second = "Here is the document: " + "the cache is state; " * 5, "Risks?"
    with fixed_rates(LLM(llama_dir, host_cache_memory=64 * 8 * BPT, **DEVICE)) as llm:
        with llm.session(system=system, sampling=G) as s:
            want = [s.send(first).token_ids, s.send(second).token_ids]
    with fixed_rates(LLM(llama_dir, host_cache_memory=64 * 8 * BPT, **DEVICE)) as llm:
        ins = Internals(llm)
        with llm.session(system=system, sampling=G) as s:
            got = [s.send(first).token_ids]
            lead, num_full = ins.num_lead(s), len(s.kv.tokens) // 8
            assert lead > 0  # the pinned system prompt stays attached
            assert ins.spill(s, Tier.HOST) is Tier.HOST
            ins.drop(s)  # its host blocks let go: their content stays cached there
            flood(llm, 103)  # and the device's copies are evicted
            before = llm.stats().tiers["host"].hit_tokens
            r = s.send(second)
            got.append(r.token_ids)
            assert llm.stats().tiers["host"].hit_tokens - before >= (num_full - lead - 2) * 8
            assert r.cached_tokens >= num_full * 8 - 16
        llm.check_integrity()
    assert got == want


WORDS = "the cache is state agents call tools and wait then read write test fix".split()


@settings(max_examples=8, deadline=None, suppress_health_check=list(HealthCheck))
@given(st.data())
def test_random_traces_of_requests_and_sessions_match_an_engine_without_caching(
        llama_dir, tmp_path_factory, data):
    """Stateless prompts over shared stems and session turns, interleaved with suspends,
    prefetches, spills to the host, drops and floods that evict the device, on a device
    pool far smaller than the working set and a host tier that holds about two floods (or a
    third of that, with the disk cache below it): every output equals the one of an engine
    that caches nothing and never moves a session."""
    seed = data.draw(st.integers(0, 10_000))
    # half the traces run over a smaller host tier with the disk cache below it
    disk = data.draw(st.booleans())
    rng = random.Random(seed)
    stems = random_prompts(seed, [64, 96], 500)
    small = dict(DEVICE, kv_cache_memory=24 * 8 * BPT, max_model_len=192)
    tiers = dict(host_cache_memory=48 * 8 * BPT)
    if disk:
        tiers = dict(host_cache_memory=16 * 8 * BPT, disk_cache_memory=64 * 8192,
                     session_dir=tmp_path_factory.mktemp("trace"))
    with fixed_rates(LLM(llama_dir, **tiers, **small)) as llm, \
            LLM(llama_dir, enable_prefix_caching=False, host_cache_memory=0,
                **small) as plain:
        ins = Internals(llm)
        system = " ".join(rng.choice(WORDS) for _ in range(12))
        sessions = [(llm.session(system=system, sampling=G),
                     plain.session(system=system, sampling=G)) for _ in range(2)]
        sent = [0, 0]
        for op in data.draw(st.lists(st.sampled_from(
                ["gen", "gen", "gen", "send", "send", "suspend", "prefetch", "spill",
                 "drop", "flood", "flood"]), min_size=6, max_size=16)):
            i = rng.randrange(2)
            s, ref = sessions[i]
            if op == "gen":
                p = rng.choice(stems)[:rng.randint(20, 64)] + [rng.randrange(500)
                                                              for _ in range(4)]
                assert gen(llm, [p], G)[0].token_ids == gen(plain, [p], G)[0].token_ids
            elif op == "send" and sent[i] < 2:
                msg = " ".join(rng.choice(WORDS) for _ in range(rng.randint(3, 8)))
                assert s.send(msg).token_ids == ref.send(msg).token_ids, (seed, op)
                sent[i] += 1
            elif op == "suspend":
                s.suspend(expected_idle_s=rng.choice([0.01, 5.0, 600.0]))
            elif op == "prefetch":
                s.prefetch().result(timeout=60)
            elif op == "spill":
                ins.spill(s, Tier.HOST)
            elif op == "drop":
                ins.drop(s)
            elif op == "flood":
                flood(llm, rng.randrange(1000), 120)
        for s, ref in sessions:  # every session continues exactly after all of it
            assert s.send("and now?").token_ids == ref.send("and now?").token_ids, seed
        llm.check_integrity()


def test_a_server_conversation_finds_an_evicted_document_on_the_host(llama_dir):
    """Through the OpenAI routes (in process, the `openai` package): a new conversation
    over a document an earlier one read loads the document's blocks from the host after
    other conversations evicted them from the device."""
    pytest.importorskip("starlette")  # the `inprocess` extra
    pytest.importorskip("openai")
    from kvsession.openai_compat import Client

    rng = random.Random(5)
    doc = "Design notes: " + " ".join(rng.choice(WORDS) for _ in range(60))
    with fixed_rates(LLM(llama_dir, host_cache_memory=128 * 8 * BPT, **DEVICE)) as llm, \
            Client(llm) as client:
        def ask(text):
            return client.chat.completions.create(
                model="m", max_tokens=4, temperature=0.0,
                messages=[{"role": "system", "content": "Answer briefly."},
                          {"role": "user", "content": text}])
        ask(doc + " What is the cache?")
        for i in range(3):  # other conversations push the document off the device
            ask(f"Other {i}: " + " ".join(rng.choice(WORDS) for _ in range(60)))
        before = llm.stats().tiers["host"].hit_tokens
        r = ask(doc + " Who calls tools?")
        host_hits = llm.stats().tiers["host"].hit_tokens - before
        assert host_hits >= 32
        assert r.usage.prompt_tokens_details.cached_tokens >= host_hits
        llm.check_integrity()
