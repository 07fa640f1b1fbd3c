"""Tiered session memory: every path a session's KV can take gives the same tokens as a
session that never left the device; spills under pressure; policy decisions; disk failure."""

from __future__ import annotations

import json
import logging
import shutil
import subprocess
import sys

import pytest
from internals import Internals
from llms import tiny_llm

from kvsession import SamplingParams
from kvsession.cache.manager import Tier
from oracle import expected_turn

SYSTEM = "You are a coding agent. Tools: list_files(path), read_file(path), run_tests()."
G = SamplingParams(max_tokens=8, temperature=0.0)
TURNS = ["List the files.", "Read a.py please", "Run the tests", "What failed?"]


def make_llm(model_dir, **kw):
    """The cost model's inputs are fixed, not measured: loading from host or disk beats
    recomputing by orders of magnitude, whatever the load on the machine (tests that want
    a recompute set a rate explicitly)."""
    llm = tiny_llm(model_dir, **{"host_cache_memory": "2MiB", **kw})
    ins = Internals(llm)
    ins.check_every_step()
    ins.fix_rate("host", 1e12)
    ins.fix_rate("disk_read", 1e11)
    ins.fix_rate("prefill", 1e3)
    return llm


def reference(model_dir, kv_dtype, n=4, **kw):
    with make_llm(model_dir, kv_cache_dtype=kv_dtype, **kw) as llm:
        with llm.session(system=SYSTEM, sampling=G) as s:
            return [s.send(t).token_ids for t in TURNS[:n]]


@pytest.mark.parametrize("kv_dtype, backend", [("float32", "torch"), ("fp8", "torch"),
                                               ("fp8", "triton")])
def test_every_path_continues_exactly(llama_dir, tmp_path, kv_dtype, backend):
    """With the Triton backend the host moves are staged through the block-copy kernel (the
    CUDA path; here under the interpreter)."""
    want = reference(llama_dir, kv_dtype, attention_backend=backend)
    with make_llm(llama_dir, kv_cache_dtype=kv_dtype, session_dir=tmp_path / "sd",
                  attention_backend=backend) as llm:
        ins = Internals(llm)
        assert (ins.host_staged, ins.kv_pool.use_kernels) == ((backend == "triton"),) * 2
        s = llm.session(system=SYSTEM, sampling=G, session_id="agent-1")
        got = [s.send(TURNS[0]).token_ids]
        # device -> host -> device
        assert ins.spill(s, Tier.HOST) is Tier.HOST
        assert s.state == "host"
        r = s.send(TURNS[1])
        got.append(r.token_ids)
        assert r.restored_from == "host" and r.cached_tokens > 32
        # device -> host -> disk -> device
        ins.spill(s, Tier.HOST)
        assert ins.spill(s, Tier.DISK) is Tier.DISK
        assert s.state == "disk"
        r = s.send(TURNS[2])
        got.append(r.token_ids)
        assert r.restored_from == "disk"
        # recompute instead of load: a host tier measured slower than recomputing
        ins.spill(s, Tier.HOST)
        ins.fix_rate("host", 1.0)
        before = llm.stats().recomputes
        r = s.send(TURNS[3])
        got.append(r.token_ids)
        st = llm.stats()
        assert st.recomputes == before + 1 and r.restored_from != "host"
        assert st.spills["host"] == 3 and st.spills["disk"] == 1
        assert st.restores["host"] == 1 and st.restores["disk"] == 1
        s.close()
        dev = llm.stats().tiers["device"]
        assert dev.blocks_used == dev.blocks_pinned == 0
        assert llm.stats().tiers["host"].blocks_used == 0
    assert got == want


def test_save_then_restore_in_a_new_process(llama_dir, tmp_path):
    want = reference(llama_dir, "float32")
    path = tmp_path / "agent-7.kvs"
    with make_llm(llama_dir) as llm:
        s = llm.session(system=SYSTEM, sampling=G, session_id="agent-7")
        first = [s.send(t).token_ids for t in TURNS[:2]]
        s.save(path)
    script = f"""
import json
from kvsession import LLM
llm = LLM({str(llama_dir)!r}, kv_cache_memory="8MiB", max_model_len=512)
s = llm.restore({str(path)!r})
r = s.send({TURNS[2]!r})
print(json.dumps({{"ids": r.token_ids, "cached": r.cached_tokens, "id": s.session_id,
                  "messages": len(s.messages), "source": r.restored_from}}))
llm.close()
"""
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    res = json.loads(out.stdout.strip().splitlines()[-1])
    assert first + [res["ids"]] == want[:3]
    assert res["id"] == "agent-7" and res["messages"] == 1 + 2 * 3
    # loaded from the file at restore: the first turn reports where its KV came from
    assert res["cached"] > 32 and res["source"] == "disk"


def test_session_dir_resume_after_restart(llama_dir, tmp_path):
    want = reference(llama_dir, "float32")
    sd = tmp_path / "sessions"
    with make_llm(llama_dir, session_dir=sd) as llm:
        a = llm.session(system=SYSTEM, sampling=G, session_id="a")
        got = [a.send(t).token_ids for t in TURNS[:2]]
        llm.session(system=SYSTEM, sampling=G, session_id="b").send("hello")
    # llm.close() persisted both sessions
    with make_llm(llama_dir, session_dir=sd) as llm:
        assert llm.sessions() == ["a", "b"]
        a = llm.session(session_id="a")
        assert a.messages[0]["content"] == SYSTEM and len(a.messages) == 5
        r = a.send(TURNS[2])
        got.append(r.token_ids)
        assert r.cached_tokens > 32
        a.close(delete=True)
        assert llm.sessions() == ["b"]
    assert got == want[:3]


def test_pressure_64_sessions(llama_dir, tmp_path):
    # device: 80 blocks of 16 (~8 sessions of 3 turns), host: 128 blocks (~16 sessions)
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    kw = dict(kv_cache_memory=80 * 16 * 512, host_cache_memory=128 * 16 * 512,
              max_model_len=256, session_dir=tmp_path / "sd", max_num_seqs=8)
    msgs = [[f"agent {i} turn {t}: do step {t}" for t in range(3)] for i in range(64)]
    with make_llm(llama_dir, kv_cache_memory="16MiB", max_model_len=256) as big:
        want = []
        for m in msgs:
            with big.session(sampling=params) as s:
                want.append([s.send(x).token_ids for x in m])
    with make_llm(llama_dir, **kw) as llm:
        sessions = [llm.session(sampling=params) for _ in range(64)]
        got = [[] for _ in sessions]
        resumed = 0
        for t in range(3):
            for i, s in enumerate(sessions):
                resumed += s.state in ("host", "disk")
                got[i].append(s.send(msgs[i][t]).token_ids)
        st = llm.stats()
        assert got == want
        assert st.spills["host"] > 0 and st.spills["disk"] > 0
        assert st.restores["host"] > 0 and st.restores["disk"] > 0
        assert st.restores["host"] + st.restores["disk"] + st.recomputes == resumed
        assert st.recomputes == 0  # loading beats recomputing at the fixed rates
        assert st.tiers["host"].blocks_used <= 128
        for s in sessions:
            s.close()
        assert llm.stats().tiers["device"].blocks_used == 0


def test_kv_loaded_ahead_of_a_turn_reports_its_tier(llama_dir, tmp_path):
    """A restored snapshot, a session resumed after a clean restart and a prefetched one
    have their KV on the device before their next turn; that turn still reports the tier
    it came from (once: the turn after it reuses device KV), and the tokens are exact."""
    want = reference(llama_dir, "float32", n=3)
    sd = tmp_path / "sd"
    with make_llm(llama_dir, session_dir=sd) as llm:
        s = llm.session(system=SYSTEM, sampling=G, session_id="a")
        assert s.send(TURNS[0]).token_ids == want[0]
        s.save(tmp_path / "a.kvs")
        s.close()
        restored = llm.restore(tmp_path / "a.kvs", session_id="b")
        assert restored.state == "idle"  # loaded at restore, ahead of the turn
        r = restored.send(TURNS[1])
        assert (r.token_ids, r.restored_from) == (want[1], "disk") and r.cached_tokens > 32
        assert restored.send(TURNS[2]).restored_from == "device"
        restored.close()
        p = llm.session(system=SYSTEM, sampling=G, session_id="c")
        p.send(TURNS[0])
        assert p.suspend(expected_idle_s=120.0) == "host"
        p.prefetch().result()
        assert p.state == "idle"
        r = p.send(TURNS[1])
        assert (r.token_ids, r.restored_from) == (want[1], "host")
        # loaded ahead, then dropped before the turn: only the pinned prompt is reused
        assert p.suspend(expected_idle_s=120.0) == "host"
        p.prefetch().result()
        Internals(llm).drop(p)
        r = p.send(TURNS[2])
        assert (r.token_ids, r.restored_from) == (want[2], "device")
        p.close()
        # a fork of a spilled session loads it: both report where the shared blocks were
        f = llm.session(system=SYSTEM, sampling=G, session_id="f")
        f.send(TURNS[0])
        assert f.suspend(expected_idle_s=120.0) == "host"
        child = f.fork()
        assert child.send(TURNS[1]).restored_from == "host"
        assert (f.send(TURNS[1]).token_ids, f.send(TURNS[2]).restored_from) == \
            (want[1], "device")
    with make_llm(llama_dir, session_dir=sd) as llm:  # a clean restart
        s = llm.session(session_id="a")
        r = s.send(TURNS[1])
        assert (r.token_ids, r.restored_from) == (want[1], "disk") and r.cached_tokens > 32
        st = llm.stats()
        assert st.restores["disk"] == 1 and st.recomputes == 0


def test_disk_tier_stats(llama_dir, tmp_path):
    with make_llm(llama_dir) as llm:  # no session_dir: no disk tier
        d = llm.stats().tiers["disk"]
        assert (d.blocks_total, d.blocks_used, d.blocks_free, d.tokens_capacity) == (0,) * 4
    with make_llm(llama_dir, session_dir=tmp_path / "sd") as llm:
        s = llm.session(system=SYSTEM, sampling=G)
        s.send(TURNS[0])
        d = llm.stats().tiers["disk"]
        block_bytes = d.bytes_per_token * 16
        room = shutil.disk_usage(tmp_path).free // block_bytes
        assert d.blocks_used == 0 and abs(d.blocks_free - room) <= room // 100 + 64
        Internals(llm).spill(s, Tier.HOST)
        Internals(llm).spill(s, Tier.DISK)
        d = llm.stats().tiers["disk"]
        assert d.blocks_used == -(-len(s.token_ids) // 16) and d.blocks_free > 0
        assert d.blocks_total == d.blocks_used + d.blocks_free
        assert d.tokens_capacity == d.blocks_total * 16
        s.close()


def test_suspend_decisions(llama_dir, tmp_path):
    with make_llm(llama_dir, session_dir=tmp_path / "sd") as llm:
        s = llm.session(sampling=G)
        s.send("hello")
        assert s.suspend(expected_idle_s=0.0) == "keep" and s.state == "idle"
        assert s.suspend(expected_idle_s=120.0) == "host" and s.state == "host"
        s.prefetch().result()
        assert s.state == "idle"
        Internals(llm).fix_rate("disk_read", 1e12)  # a fast disk: long waits go there
        assert s.suspend(expected_idle_s=3600.0) == "disk" and s.state == "disk"
        s.send("again")
        Internals(llm).fix_rate("disk_read", 1.0)  # a disk slower than recomputing
        assert s.suspend(expected_idle_s=3600.0) == "drop"
        assert s.num_cached_tokens == 0
        before = s.token_ids
        r = s.send("third")
        # dropped KV is recomputed, except blocks the device LRU still happens to hold
        assert r.token_ids == expected_turn(llm, s, before, r, G)
        assert r.prefill_tokens > 0
        s.close()


def test_a_session_larger_than_the_host_tier_evicts_nobody_from_it(llama_dir):
    """Making host room for a session that could never fit there (more blocks than the
    whole host tier) does not evict the idle sessions already on the host: it is dropped
    (no disk tier), and they keep their KV there."""
    bytes_per_block = 16 * 512  # the tiny model: 512 bytes a token
    with make_llm(llama_dir, host_cache_memory=5 * bytes_per_block) as llm:
        small = llm.session(sampling=G)
        small.send("hi")
        assert small.suspend(expected_idle_s=120.0) == "host"
        big = llm.session(sampling=G)
        big.send("x " * 150)
        assert len(big.kv.blocks) > 5
        assert big.suspend(expected_idle_s=120.0) == "drop"
        assert small.state == "host" and small.num_cached_tokens > 0
        before = small.token_ids
        r = small.send("again")
        assert r.token_ids == expected_turn(llm, small, before, r, G)
        assert r.cached_tokens >= len(before) - 1


def test_spill_after_idle(llama_dir):
    with make_llm(llama_dir, spill_after_s=1e-3) as llm:
        s = llm.session(sampling=G)
        s.send("hello")
        Internals(llm).tier_housekeeping(s.kv.last_used + 1.0)
        assert s.state == "host"
        assert s.send("more").restored_from == "host"
        s.close()


def test_the_engine_loop_runs_housekeeping_by_itself(llama_dir):
    """Nobody calls housekeeping here: the engine thread wakes up at the policy's deadline
    while idle and spills the session (waited for with a bounded deadline, not a sleep)."""
    import time

    with make_llm(llama_dir, spill_after_s=0.05) as llm:
        s = llm.session(sampling=G)
        s.send("hello")
        deadline = time.monotonic() + 30
        while s.state != "host" and time.monotonic() < deadline:
            time.sleep(0.01)  # polling an observable state, bounded by the deadline
        assert s.state == "host"
        assert llm.stats().spills["host"] == 1
        assert s.send("more").restored_from == "host"
        s.close()


def test_disk_full_keeps_the_session(llama_dir, tmp_path, monkeypatch, caplog):
    import kvsession.tiers.mover as mover_mod

    def full(*args, **kwargs):
        raise OSError(28, "No space left on device")

    want = reference(llama_dir, "float32", 2)
    # durability="close": only spills write files here (no session log beside them)
    with make_llm(llama_dir, session_dir=tmp_path / "sd", durability="close") as llm:
        ins = Internals(llm)
        s = llm.session(system=SYSTEM, sampling=G)
        got = [s.send(TURNS[0]).token_ids]
        monkeypatch.setattr(mover_mod, "write_snapshot", full)
        with caplog.at_level(logging.WARNING, logger="kvsession"):
            assert ins.spill(s, Tier.DISK) is Tier.DEVICE
        assert "No space left" in caplog.text and s.state == "idle"
        ins.spill(s, Tier.HOST)
        assert ins.spill(s, Tier.DISK) is Tier.HOST
        assert llm.stats().spill_failures == 2 and s.state == "host"
        got.append(s.send(TURNS[1]).token_ids)
        assert list((tmp_path / "sd").iterdir()) == []  # no torn or temporary file left
        s.close()
        monkeypatch.undo()  # the disk has room again when the LLM closes
    assert got == want


def test_llm_left_open_at_exit_still_persists_and_exits(llama_dir, tmp_path):
    sd = tmp_path / "sd"
    script = f"""
from kvsession import LLM, SamplingParams
llm = LLM({str(llama_dir)!r}, kv_cache_memory="8MiB", max_model_len=512,
          session_dir={str(sd)!r})
s = llm.session(session_id="left-open", sampling=SamplingParams(max_tokens=4))
s.send("hello")
# no close(): the process just ends
"""
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    assert (sd / "left-open.kvs").is_file()


def test_suspending_a_session_with_nothing_computed_keeps_it(llama_dir):
    """suspend() answers one of its documented decisions even before the first turn."""
    from kvsession import LLM

    with LLM(llama_dir, device="cpu", kv_cache_memory="4MiB", max_model_len=256) as llm:
        s = llm.session(system="You are terse.")
        assert s.suspend() == "keep"
        assert s.send("hi", max_tokens=2).text is not None
