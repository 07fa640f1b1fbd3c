"""A spilled session's KV comes back on the copier thread: while its bytes move, the engine
keeps stepping the batch (other requests finish), the turn waits for its own blocks, and
the output is the one a session that never left the device gives. `prefetch()` runs ahead
the same way; a turn sent meanwhile waits for it, and a session closed meanwhile frees
everything."""

from __future__ import annotations

import threading

import pytest
from internals import Internals
from test_server import wait_until
from test_tiers import SYSTEM, TURNS, G, make_llm, reference

from kvsession import LLM, SamplingParams
from kvsession.cache.manager import Tier
from oracle import random_prompts

OTHER = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)


def spilled(llm, tier: Tier, want_first=None):
    """A session after one turn, its KV spilled to `tier`, and the copier held."""
    ins = Internals(llm)
    s = llm.session(system=SYSTEM, sampling=G)
    first = s.send(TURNS[0]).token_ids
    assert want_first is None or first == want_first
    if tier is Tier.DISK:
        ins.spill(s, Tier.HOST)
    assert ins.spill(s, tier) is tier
    return s, ins.hold_copier()


def send_in_thread(s, text):
    box = {}
    t = threading.Thread(target=lambda: box.setdefault("r", s.send(text)))
    t.start()
    return t, box


@pytest.mark.parametrize("tier", [Tier.HOST, Tier.DISK])
def test_the_batch_runs_while_a_session_loads(llama_dir, tmp_path, tier):
    want = reference(llama_dir, "float32", n=2)
    with make_llm(llama_dir, session_dir=tmp_path) as llm:
        s, release = spilled(llm, tier, want[0])
        t, box = send_in_thread(s, TURNS[1])
        wait_until(release.loads_in_flight, what="the turn's load to start")
        # the session's load is queued behind the held copier; other work completes
        out = llm.generate(["an unrelated request"], OTHER, use_tqdm=False)[0]
        assert len(out.outputs[0].token_ids) == 4
        assert release.loads_in_flight() == 1 and "r" not in box  # still waiting for its blocks
        release.set()
        t.join(60)
        r = box["r"]
        assert r.token_ids == want[1] and r.restored_from == tier.value
        assert llm.stats().restores[tier.value] == 1
        llm.check_integrity()


def test_prefetch_runs_ahead_and_a_turn_waits_for_it(llama_dir, tmp_path):
    want = reference(llama_dir, "float32", n=2)
    """(The turn either waits for the prefetch's copy or, sent after it settled, finds its
    KV on the device: both report the prefetch's tier and load once.)"""
    with make_llm(llama_dir, session_dir=tmp_path) as llm:
        s, release = spilled(llm, Tier.HOST)
        pre = s.prefetch()
        out = llm.generate(["while it loads"], OTHER, use_tqdm=False)[0]
        assert len(out.outputs[0].token_ids) == 4
        assert not pre.done() and release.loads_in_flight() == 1
        t, box = send_in_thread(s, TURNS[1])
        release.set()
        pre.result(60)
        t.join(60)
        r = box["r"]
        assert r.token_ids == want[1] and r.restored_from == "host"
        st = llm.stats()
        assert st.restores["host"] == 1  # loaded once, by the prefetch
        llm.check_integrity()


def test_a_session_closed_while_it_loads_frees_everything(llama_dir, tmp_path):
    with make_llm(llama_dir, session_dir=tmp_path) as llm:
        s, release = spilled(llm, Tier.HOST)
        pre = s.prefetch()
        closer = threading.Thread(target=s.close)
        closer.start()  # waits (bounded) on the engine thread for the copy in flight
        release.set()
        closer.join(60)
        pre.result(60)
        st = llm.stats()
        assert st.tiers["device"].blocks_used == 0 and st.tiers["host"].blocks_used == 0
        llm.check_integrity()


def test_a_session_being_loaded_is_never_moved(llama_dir, tmp_path):
    """While its host blocks are read on the copier, a prefetched session is neither spilled
    to disk nor dropped by the pressure other requests put on the pools (its host blocks
    freed under the copy would be read after another owner wrote them)."""
    want = reference(llama_dir, "float32", n=2)
    with make_llm(llama_dir, session_dir=tmp_path) as llm:
        ins = Internals(llm)
        s, release = spilled(llm, Tier.HOST, want[0])
        pre = s.prefetch()
        for text in ("a long unrelated request " * 12, "another one " * 20):
            llm.generate([text], OTHER, use_tqdm=False)
        assert ins.spill(s, Tier.DISK) is Tier.HOST  # refused: it is loading
        assert s.suspend(expected_idle_s=3600.0) == "host"
        release.set()
        pre.result(60)
        r = s.send(TURNS[1])
        assert r.token_ids == want[1] and r.restored_from == "host"
        llm.check_integrity()


def lower_llm(llama_dir):
    """A small device pool over a host tier: a document pushed off the device is found on
    the host by the next prompt that starts with it."""
    from test_shared_tiers import BPT, DEVICE, fixed_rates

    return fixed_rates(LLM(llama_dir, host_cache_memory=64 * 8 * BPT, **DEVICE))


def test_a_prompt_found_on_the_host_loads_while_the_batch_runs(llama_dir):
    from test_shared_tiers import DEVICE, flood

    (doc,) = random_prompts(11, [120], 500)
    q = doc + [3, 4, 5]
    with lower_llm(llama_dir) as llm, \
            LLM(llama_dir, enable_prefix_caching=False, **DEVICE) as plain:
        llm.generate(prompt_token_ids=[doc + [1]], sampling_params=OTHER, use_tqdm=False)
        flood(llm, 300)  # the document's blocks go to the host
        release = Internals(llm).hold_copier()
        box = {}
        t = threading.Thread(target=lambda: box.setdefault("out", llm.generate(
            prompt_token_ids=[q], sampling_params=OTHER, use_tqdm=False)[0]))
        t.start()
        wait_until(release.loads_in_flight, what="the prompt's load to start")
        other = llm.generate(["meanwhile"], OTHER, use_tqdm=False)[0]
        assert len(other.outputs[0].token_ids) == 4
        assert release.loads_in_flight() == 1 and "out" not in box
        release.set()
        t.join(60)
        out = box["out"]
        assert out.num_cached_tokens == 120
        assert out.token_ids == plain.generate(prompt_token_ids=[q], sampling_params=OTHER,
                                               use_tqdm=False)[0].token_ids
        llm.check_integrity()


def test_a_request_cancelled_while_its_blocks_load_frees_them_after(llama_dir):
    from test_shared_tiers import flood

    (doc,) = random_prompts(12, [120], 500)
    with lower_llm(llama_dir) as llm:
        llm.generate(prompt_token_ids=[doc + [1]], sampling_params=OTHER, use_tqdm=False)
        flood(llm, 301)
        before = llm.stats()
        release = Internals(llm).hold_copier()
        stream = llm.stream(prompt_token_ids=doc + [2], sampling_params=OTHER)  # submitted
        wait_until(release.loads_in_flight, what="the stream's load to start")
        stream.close()  # the caller goes away while the copier fills its blocks
        release.set()
        wait_until(lambda: release.loads_in_flight() == 0, what="the load to settle")
        wait_until(lambda: llm.stats().tiers["device"].blocks_used == 0,
                   what="its blocks to be freed")
        after = llm.stats()  # the cancelled one never ran
        assert (after.num_requests, after.generated_tokens) == (before.num_requests,
                                                                before.generated_tokens)
        llm.check_integrity()


@pytest.mark.parametrize(("idle_s", "tier"), [(120.0, Tier.HOST), (1e6, Tier.DISK)])
def test_the_batch_runs_while_a_session_spills(llama_dir, tmp_path, idle_s, tier):
    """suspend's copy down (host blocks, or the session's snapshot file) runs on the copier:
    while the copier is held other requests complete and the session keeps its device
    blocks; it then settles on the tier the policy chose, and its next turn is exact."""
    want = reference(llama_dir, "float32", n=2)
    with make_llm(llama_dir, session_dir=tmp_path) as llm:
        s = llm.session(system=SYSTEM, sampling=G)
        assert s.send(TURNS[0]).token_ids == want[0]
        release = Internals(llm).hold_copier()
        box = {}
        t = threading.Thread(target=lambda: box.setdefault("d", s.suspend(idle_s)))
        t.start()
        wait_until(release.loads_in_flight, what="the spill to start")
        out = llm.generate(["an unrelated request"], OTHER, use_tqdm=False)[0]
        assert len(out.outputs[0].token_ids) == 4
        assert "d" not in box and s.state == "active"  # its blocks are still being copied
        assert s.kv.tier is Tier.DEVICE
        assert not (tmp_path / f"{s.session_id}.kvs").exists()
        release.set()
        t.join(60)
        assert box["d"] == tier.value and s.state == tier.value
        assert llm.stats().spills[tier.value] == 1
        r = s.send(TURNS[1])
        assert r.token_ids == want[1] and r.restored_from == tier.value
        llm.check_integrity()


def test_a_turn_waits_for_its_sessions_spill(llama_dir):
    """A turn sent while housekeeping's spill of its session is on the copier waits for the
    copy, settles it, and loads the KV back: exact, and reported as restored from host."""
    want = reference(llama_dir, "float32", n=2)
    with make_llm(llama_dir, spill_after_s=1e9) as llm:
        ins = Internals(llm)
        s = llm.session(system=SYSTEM, sampling=G)
        assert s.send(TURNS[0]).token_ids == want[0]
        release = ins.hold_copier()
        ins.tier_housekeeping(s.kv.last_used + 2e9, settle=False)
        assert release.loads_in_flight() == 1 and s.state == "idle"
        t, box = send_in_thread(s, TURNS[1])
        out = llm.generate(["an unrelated request"], OTHER, use_tqdm=False)[0]
        assert len(out.outputs[0].token_ids) == 4 and "r" not in box
        release.set()
        t.join(60)
        r = box["r"]
        assert r.token_ids == want[1] and r.restored_from == "host"
        assert llm.stats().spills["host"] == 1
        llm.check_integrity()


def test_a_session_closed_while_it_spills_frees_everything(llama_dir, tmp_path):
    with make_llm(llama_dir, session_dir=tmp_path, spill_after_s=1e9) as llm:
        ins = Internals(llm)
        s = llm.session(system=SYSTEM, sampling=G)
        s.send(TURNS[0])
        release = ins.hold_copier()
        ins.tier_housekeeping(s.kv.last_used + 2e9, settle=False)
        closer = threading.Thread(target=s.close)
        closer.start()  # waits (bounded) on the engine thread for the copy in flight
        release.set()
        closer.join(60)
        assert not closer.is_alive()
        st = llm.stats()
        assert st.tiers["device"].blocks_used == 0 and st.tiers["host"].blocks_used == 0
        llm.check_integrity()
