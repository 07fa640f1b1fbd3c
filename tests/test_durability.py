"""Durable sessions (durability="turn"): the session log is a write-ahead log. Real files and
real processes: a torn record and power loss at every byte of the last record recover
exactly the records before it; concurrent sessions share fsyncs; a resumed session replays
every acknowledged turn and continues exactly; one process owns a session (flock), a dead
owner's lock is taken over, two processes work on different sessions of one directory."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import signal
import struct
import subprocess
import sys
import threading
import tracemalloc
import zlib
from pathlib import Path

import msgspec
import pytest
import torch
from internals import CHILD_PRELUDE, Internals
from llms import tiny_llm
from log_files import IDENTITY, write_log

from kvsession import LLM, ConfigError, SamplingParams, SnapshotError
from kvsession.cache.hashing import tail_key
from kvsession.errors import EngineClosedError, SessionClosedError, SessionLockedError
from kvsession.tiers import wal
from kvsession.tiers.commit import GroupCommit, Op, SessionLog
from kvsession.tiers.disk import DiskTier
from kvsession.tiers.snapshot import messages_to_text
from kvsession.tiers.snapshot_read import read_blocks
from kvsession.tiers.writeback import WriteOp
from oracle import expected_turn, sends_racing_a_close

G = SamplingParams(max_tokens=4, temperature=0.0)
SYSTEM = "You are a coding agent. Tools: list_files(path), read_file(path), run_tests()."
LONG_SYSTEM = SYSTEM + " Always explain the plan first, then act, then check the result."


def new_llm(model_dir, sd, **kw):
    return tiny_llm(model_dir, session_dir=sd, **kw)


def continues_exactly(llm, s, message="and then?"):
    before = s.token_ids
    r = s.send(message)
    want = expected_turn(llm, s, before, r, G)
    return r.token_ids == want


# ---- the log: format, torn records, power loss --------------------------------------------

def test_log_replays_every_record(tmp_path):
    path, ends = write_log(tmp_path, 5)
    scan = wal.read_log(path, expect=IDENTITY)
    st = scan.state
    assert (st.seq, st.num_records, len(st.messages), scan.end, scan.torn) == (
        5, 5, 11, ends[-1], False)
    assert st.messages[-1] == {"role": "assistant", "content": "answer 4 " * 4}
    tokens = []
    for t in range(5):  # as write_log builds them: a few tokens re-rendered each turn
        tokens = tokens[: max(0, len(tokens) - 3)] + list(range(t, t + 20))
    assert st.tokens == tokens and st.sampling == {"max_tokens": 4}
    assert st.sampling_per_turn[-1]["stop"] == ["x"]
    other = msgspec.structs.replace(IDENTITY, kv_dtype="fp8_e4m3")
    with pytest.raises(SnapshotError, match="another kv dtype"):
        wal.read_log(path, expect=other)


def test_a_record_that_cannot_be_encoded_leaves_the_log_whole(tmp_path):
    """A turn whose record fails to build (a value msgpack cannot hold) takes no sequence
    number: the records after it follow on (a gap reads as corruption, which would lose
    every turn), the first of them a whole rewrite holding the state; and the commit
    thread outlives a record Future its waiter cancelled."""
    gc = GroupCommit(tmp_path)
    slog = SessionLog(tmp_path / "s.log", "s", IDENTITY)
    messages = [{"role": "user", "content": "one"}, {"role": "assistant", "content": "1"}]
    try:
        op, data = slog.record(messages, [1, 2], {"max_tokens": 4}, None, {"max_tokens": 4})
        gc.submit(slog, op, data).result(timeout=30)
        messages += [{"role": "user", "content": "two"}, {"role": "assistant", "content": "2"}]
        with pytest.raises(SnapshotError, match="could not be encoded"):
            slog.record(messages, [1, 2, 3], {"stop_token_ids": [2**70]}, None,
                        {"max_tokens": 4})
        messages += [{"role": "user", "content": "three"}, {"role": "assistant", "content": "3"}]
        op, data = slog.record(messages, [1, 2, 3, 4], {"max_tokens": 4}, None,
                               {"max_tokens": 4})
        assert op is Op.REWRITE
        fut = gc.submit(slog, op, data)
        fut.cancel()  # an asend cancelled while it waits for durability
        messages += [{"role": "user", "content": "four"}, {"role": "assistant", "content": "4"}]
        op, data = slog.record(messages, [1, 2, 3, 4, 5], {"max_tokens": 4}, None,
                               {"max_tokens": 4})
        # (a whole rewrite if the cancelled one is still unresolved: see the next test)
        assert op in (Op.APPEND, Op.REWRITE)
        gc.submit(slog, op, data).result(timeout=30)  # the commit thread is alive
        gc.submit(slog, Op.CLOSE).result(timeout=30)
    finally:
        gc.close()
    st = wal.read_log(slog.path, expect=IDENTITY).state
    assert st.seq == 3 and [m["content"] for m in st.messages] == [
        "one", "1", "two", "2", "three", "3", "four", "4"]
    assert st.tokens == [1, 2, 3, 4, 5]


def test_close_while_another_thread_sends_loses_no_acknowledged_turn(llama_dir, tmp_path):
    """llm.close() persists a session while another thread keeps sending on it: every turn
    whose send() returned is in what a new LLM resumes, and the sends after the snapshot
    raise (SessionClosedError, or EngineClosedError once the engine stopped) instead of
    being acknowledged and lost."""
    llm = new_llm(llama_dir, tmp_path)
    s = llm.session(system="sys", session_id="a")
    acked, errors = sends_racing_a_close(s, llm.close, max_tokens=2, ignore_eos=True)
    assert len(errors) == 1
    assert isinstance(errors[0], (SessionClosedError, EngineClosedError)), errors
    with new_llm(llama_dir, tmp_path) as again:
        resumed = [m["content"] for m in again.session(session_id="a").messages
                   if m["role"] == "user"]
    assert resumed == acked


def test_a_record_after_an_unresolved_one_rewrites_the_state(tmp_path, monkeypatch):
    """A turn's record built while the previous one is still being written (an asend
    cancelled during its durability wait lets the next turn in) is a whole rewrite: that
    previous write may yet fail, and a delta on top of it then left a gap in the sequence
    ("record 3 follows record 1": every turn of the session unrecoverable)."""
    import errno

    import kvsession.tiers.commit as commit

    gc = GroupCommit(tmp_path)
    slog = SessionLog(tmp_path / "s.log", "s", IDENTITY)
    messages = [{"role": "user", "content": "one"}, {"role": "assistant", "content": "1"}]
    gate, write, second = threading.Event(), commit._write_all, {}

    def stalled_then_full(fd, data, offset):  # the second record's: a stalled disk that
        if data is second.get("data"):  # then reports it full
            gate.wait(30)
            raise OSError(errno.ENOSPC, "No space left on device")
        return write(fd, data, offset)

    monkeypatch.setattr(commit, "_write_all", stalled_then_full)
    try:
        op, data = slog.record(messages, [1, 2], {"max_tokens": 4}, None, {"max_tokens": 4})
        gc.submit(slog, op, data).result(timeout=30)
        messages += [{"role": "user", "content": "two"}, {"role": "assistant", "content": "2"}]
        op, second["data"] = slog.record(messages, [1, 2, 3], {"max_tokens": 4}, None,
                                         {"max_tokens": 4})
        assert op is Op.APPEND
        failing = gc.submit(slog, op, second["data"])
        messages += [{"role": "user", "content": "three"}, {"role": "assistant", "content": "3"}]
        op, data = slog.record(messages, [1, 2, 3, 4], {"max_tokens": 4}, None,
                               {"max_tokens": 4})
        third = gc.submit(slog, op, data)  # (a rewrite: the second is unresolved)
        gate.set()
        with pytest.raises(SnapshotError, match="could not be made durable"):
            failing.result(timeout=30)
        third.result(timeout=30)
        gc.submit(slog, Op.CLOSE).result(timeout=30)
    finally:
        gate.set()
        gc.close()
    st = wal.read_log(slog.path, expect=IDENTITY).state  # every turn of the state
    assert [m["content"] for m in st.messages] == ["one", "1", "two", "2", "three", "3"]
    assert st.tokens == [1, 2, 3, 4]


def test_power_loss_at_every_byte_of_the_last_record(tmp_path):
    """The log cut at every byte boundary of its last record (what a power loss can leave
    of an unacknowledged append): recovery yields exactly the records before it, cuts the
    torn bytes off, and the next append continues a valid log."""
    (tmp_path / "src").mkdir()
    path, ends = write_log(tmp_path / "src", 4)
    before = wal.read_log(path)
    prev_end, full = ends[-2], ends[-1]
    data = path.read_bytes()
    want = _state_after(tmp_path, data[:prev_end])
    for cut in range(prev_end, full):
        d = tmp_path / f"cut{cut}"
        d.mkdir()
        (d / "s.log").write_bytes(data[:cut])
        scan = wal.read_log(d / "s.log")
        assert scan.end == prev_end and scan.torn == (cut > prev_end)
        assert _summary(scan.state) == want, cut
        recovered = DiskTier(d).recovered  # start-up recovery: the tail is cut off
        assert [p.name for p in recovered["truncated_logs"]] == (["s.log"] if cut > prev_end
                                                                 else [])
        assert os.path.getsize(d / "s.log") == prev_end
        shutil.rmtree(d)
    assert _summary(wal.read_log(path).state) == _summary(before.state)


def _state_after(tmp_path: Path, data: bytes):
    p = tmp_path / "ref.log"
    p.write_bytes(data)
    return _summary(wal.read_log(p).state)


def _summary(st):
    return (st.seq, st.messages, st.tokens, st.system)


def test_a_torn_first_record_means_no_session(tmp_path):
    path, ends = write_log(tmp_path, 1)
    data = path.read_bytes()
    for cut in (0, 5, len(wal.LOG_PREFIX), ends[0] - 1):
        path.write_bytes(data[:cut])
        assert wal.read_log(path).state is None
        DiskTier(tmp_path)
        assert not path.exists()  # nothing of it was acknowledged: removed at start-up
        path.write_bytes(data)


def test_torn_and_corrupted_records(tmp_path):
    path, ends = write_log(tmp_path, 3)
    good = path.read_bytes()
    # a checksum mismatch in the last record: torn, the log ends before it
    bad = bytearray(good)
    bad[ends[1] + 10] ^= 0xFF
    path.write_bytes(bytes(bad))
    assert wal.read_log(path).end == ends[1]
    # a length field past the end of the file (a torn frame header)
    path.write_bytes(good + struct.pack("<II", 1 << 20, 0) + b"xx")
    assert wal.read_log(path).end == len(good)
    # an intact frame whose payload is not a record: corruption, refused (not shortened)
    junk = msgspec.msgpack.encode({"type": "turn", "seq": "four"})
    path.write_bytes(good + struct.pack("<II", len(junk), zlib.crc32(junk)) + junk)
    with pytest.raises(SnapshotError, match="malformed record"):
        wal.read_log(path)


def test_a_corrupted_record_before_intact_ones_is_refused_not_cut(tmp_path):
    """Only the last record can be torn: a bad frame with intact records after it is
    corruption (a flipped bit). Cutting the log there, or removing it when the bad frame
    is the first, destroyed acknowledged turns at the next start-up; the log is refused
    with SnapshotError and left as it is (the session is listed, resuming it says why)."""
    path, ends = write_log(tmp_path, 3)
    good = path.read_bytes()
    for at in (len(wal.LOG_PREFIX) + 12, ends[0] + 12):  # in the first, then the second
        bad = bytearray(good)
        bad[at] ^= 0x01
        path.write_bytes(bytes(bad))
        with pytest.raises(SnapshotError, match="corrupted, and an intact one follows"):
            wal.read_log(path)
        recovered = DiskTier(tmp_path).recovered  # start-up recovery leaves it alone
        assert not recovered["truncated_logs"] and not recovered["removed_logs"]
        assert path.read_bytes() == bytes(bad)
        assert DiskTier(tmp_path).has_session("s")


@pytest.mark.parametrize("record, match", [
    (wal.TurnRecord(seq=9, identity_digest=IDENTITY.digest(), unix_s=0.0, messages=[],
                    keep=0, tokens=[], sampling=msgspec.convert({}, wal.SamplingFields)),
     "record 9 follows record 3"),
    (wal.TurnRecord(seq=4, identity_digest="0" * 32, unix_s=0.0, messages=[], keep=0,
                    tokens=[], sampling=msgspec.convert({}, wal.SamplingFields)),
     "written by another engine"),
    (wal.TurnRecord(seq=4, identity_digest=IDENTITY.digest(), unix_s=0.0, messages=[],
                    keep=10_000, tokens=[], sampling=msgspec.convert({}, wal.SamplingFields)),
     "keeps 10000 of"),
])
def test_records_that_break_the_sequence_are_refused(tmp_path, record, match):
    path, _ = write_log(tmp_path, 3)
    with open(path, "ab") as f:
        f.write(wal.encode(record))
    with pytest.raises(SnapshotError, match=match):
        wal.read_log(path)


def test_crafted_lengths_are_bounded_before_anything_is_built(tmp_path):
    path, _ = write_log(tmp_path, 1)
    good = path.read_bytes()
    # a frame declaring a million-token list in a few bytes: refused at the array header
    payload = b"\x82\xa4type\xa4turn\xa6tokens\xdd" + struct.pack(">I", 1 << 30)
    path.write_bytes(good + struct.pack("<II", len(payload), zlib.crc32(payload)) + payload)
    tracemalloc.start()
    try:
        with pytest.raises(SnapshotError):
            wal.read_log(path)
        assert tracemalloc.get_traced_memory()[1] < 8 << 20
    finally:
        tracemalloc.stop()


# ---- group commit ------------------------------------------------------------------------

def test_concurrent_records_share_one_batch(tmp_path):
    gc = GroupCommit(tmp_path)
    logs = [SessionLog(tmp_path / f"s{i}.log", f"s{i}", IDENTITY) for i in range(8)]
    try:
        futures = []
        with gc._cv:  # the commit thread is held back: all eight queue up together
            for slog in logs:
                op, data = slog.record([{"role": "user", "content": "hi"}], [1, 2, 3], {}, None,
                                       {})
                futures.append(gc.submit(slog, op, data))
        for f in futures:
            f.result(timeout=30)
        assert (gc.batches, gc.records, gc.dir_fsyncs) == (1, 8, 1)
        futures = []
        with gc._cv:  # appends after the creating rewrite, again in one batch
            for slog in logs:
                op, data = slog.record([{"role": "user", "content": "hi"}] * 3, [1, 2, 3, 4],
                                       {}, None, {})
                assert op is Op.APPEND
                futures.append(gc.submit(slog, op, data))
        for f in futures:
            f.result(timeout=30)
        assert gc.batches == 2 and gc.dir_fsyncs == 1
    finally:
        gc.close()
    for slog in logs:
        assert wal.read_log(slog.path).state.seq == 2


def test_a_batch_waits_for_the_records_of_turns_that_ended_with_it(tmp_path):
    """Records announced when their turns end (GroupCommit.expect) join one batch however
    their callers submit them, one after another; an announcement whose record never
    comes is forgotten after expect_ttl_s, so no batch waits for it for long."""
    gc = GroupCommit(tmp_path)
    gc.gather_s = 600.0  # the batch waits for every announced record, not for a timer
    logs = [SessionLog(tmp_path / f"s{i}.log", f"s{i}", IDENTITY) for i in range(8)]
    try:
        for slog in logs:
            gc.expect(slog)
        futures = []
        for slog in logs:  # one at a time, the commit thread free to run between them
            op, data = slog.record([{"role": "user", "content": "hi"}], [1, 2], {}, None, {})
            futures.append(gc.submit(slog, op, data))
            assert slog is logs[-1] or not futures[0].done()
        for f in futures:
            f.result(timeout=30)
        assert (gc.batches, gc.records) == (1, 8)
        # announced, never submitted (its caller failed after the turn): forgotten
        gc.expect_ttl_s = 0.2
        gc.expect(logs[0])
        op, data = logs[1].record([{"role": "user", "content": "hi"}] * 3, [1, 2, 3], {},
                                  None, {})
        gc.submit(logs[1], op, data).result(timeout=30)
        assert (gc.batches, gc.records) == (2, 9)
    finally:
        gc.close()


def test_sessions_finishing_together_share_fsyncs(llama_dir, tmp_path):
    with new_llm(llama_dir, tmp_path / "sd") as llm:
        sessions = [llm.session(session_id=f"a{i}", sampling=G) for i in range(8)]
        barrier = threading.Barrier(8)

        def agent(s):
            for t in range(3):
                barrier.wait(timeout=60)
                s.send(f"turn {t} of {s.session_id}")

        threads = [threading.Thread(target=agent, args=(s,)) for s in sessions]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=120)
        journal = Internals(llm).journal
        assert journal.records == 24
        # records of turns that ended in one engine step are batched (a turn's 8 sessions
        # may start, and so end, in a few steps)
        assert journal.batches <= 3 * 3, journal.batches
        for s in sessions:
            assert len(wal.read_log(tmp_path / "sd" / f"{s.session_id}.log").state.messages) \
                == 6


def test_a_failed_append_is_cut_off_and_the_next_record_rewrites(tmp_path, monkeypatch):
    import kvsession.tiers.commit as commit

    path, ends = write_log(tmp_path, 2)
    state = wal.read_log(path).state
    gc = GroupCommit(tmp_path)
    slog = SessionLog(path, "s", IDENTITY, state, ends[-1])
    real = commit._write_all

    def half_then_fail(fd, data, offset):
        real(fd, data[: len(data) // 2], offset)
        raise OSError(28, "No space left on device")

    try:
        monkeypatch.setattr(commit, "_write_all", half_then_fail)
        msgs = state.messages + [{"role": "user", "content": "lost"}]
        op, data = slog.record(msgs, state.tokens, {}, "sys", {})
        with pytest.raises(SnapshotError, match="No space left"):
            gc.submit(slog, op, data).result(timeout=30)
        assert os.path.getsize(path) == ends[-1]  # the partial record was cut off
        monkeypatch.setattr(commit, "_write_all", real)
        msgs.append({"role": "assistant", "content": "kept"})
        op, data = slog.record(msgs, state.tokens + [7], {}, "sys", {"max_tokens": 4})
        assert op is Op.REWRITE
        gc.submit(slog, op, data).result(timeout=30)
        gc.submit(slog, Op.CLOSE).result(timeout=30)
    finally:
        gc.close()
    st = wal.read_log(path).state
    assert st.messages == msgs and st.tokens[-1] == 7 and st.num_records == 1


# ---- sessions ----------------------------------------------------------------------------

def test_durability_argument(llama_dir, tmp_path):
    # the default, "turn", is valid without a session_dir too: nothing persists there
    with LLM(llama_dir, durability="turn", kv_cache_memory="4MiB", max_model_len=128) as llm:
        assert Internals(llm).journal is None and llm.sessions() == []
        assert llm.session(sampling=G).send("hi").token_ids
    with new_llm(llama_dir, tmp_path / "n", durability=None) as llm:  # None: the default
        assert llm.config.durability.value == "turn" and Internals(llm).journal is not None
    with pytest.raises(ConfigError, match="durability='sometimes' is not supported"):
        LLM(llama_dir, durability="sometimes", session_dir=tmp_path)
    with new_llm(llama_dir, tmp_path / "c", durability="close") as llm:
        assert Internals(llm).journal is None
        s = llm.session(session_id="c", sampling=G)
        s.send("hello")
        assert os.listdir(tmp_path / "c") == []  # nothing written yet (no log, no lock)
    assert sorted(os.listdir(tmp_path / "c")) == ["c.kvs"]  # written at close, as before


def test_every_kind_of_turn_is_durable_before_it_returns(llama_dir, tmp_path):
    sd = tmp_path / "sd"
    with new_llm(llama_dir, sd) as llm:
        s = llm.session(session_id="d", system=SYSTEM, sampling=G)

        def logged():
            return wal.read_log(sd / "d.log").state.messages

        s.send("first")
        assert logged() == s.messages
        assert asyncio.run(s.asend("second")).text == s.messages[-1]["content"]
        assert logged() == s.messages
        chunks = list(s.stream("third"))
        assert chunks[-1].reply is not None and logged() == s.messages
        s.add("tool", '{"files": ["a.py"]}')
        assert logged() == s.messages and logged()[-1]["role"] == "tool"
        st = wal.read_log(sd / "d.log").state
        assert st.tokens == s.token_ids and st.seq == 4  # append history: the token log
        fork = s.fork(session_id="d-fork")
        fork.send("fork's own turn")
        assert wal.read_log(sd / "d-fork.log").state.messages == fork.messages
    assert sorted(os.listdir(sd)) == ["d-fork.kvs", "d.kvs"]  # compacted at close


CHILD = CHILD_PRELUDE + r"""
import json, os, sys
from internals import Internals
from kvsession import LLM, SamplingParams
model, sd, mode = sys.argv[1], sys.argv[2], sys.argv[3]
G = SamplingParams(max_tokens=4, temperature=0.0)
llm = LLM(model, kv_cache_memory="8MiB", max_model_len=512, session_dir=sd)
if mode == "hold":
    s = llm.session(session_id="a", sampling=G, system="You are a helpful agent.")
    for t in range(3):
        r = s.send(f"turn {t}")
        print(json.dumps({"ack": t, "ids": r.token_ids}), flush=True)
    # the blocks queued behind the turns are on disk before the parent kills this process
    # (how far write-behind got by then would otherwise depend on the machine's load)
    Internals(llm).flush_writes(60)
    print("ready", flush=True)
    sys.stdin.readline()
    os.kill(os.getpid(), 9)
elif mode == "other":
    b = llm.session(session_id="b", sampling=G)
    b.send("from the other process")
    print(json.dumps(llm.sessions()), flush=True)
    sys.stdin.readline()
    llm.close()
"""


def _spawn(llama_dir, sd, mode):
    return subprocess.Popen([sys.executable, "-c", CHILD, str(llama_dir), str(sd), mode],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)


def _read_line(proc, timeout=120):
    out = []
    t = threading.Thread(target=lambda: out.append(proc.stdout.readline()), daemon=True)
    t.start()
    t.join(timeout)
    assert out and out[0], "the child did not answer"
    return out[0].strip()


def test_one_process_owns_a_session_and_a_dead_owners_lock_is_taken_over(llama_dir,
                                                                          tmp_path):
    sd = tmp_path / "sd"
    holder = _spawn(llama_dir, sd, "hold")
    try:
        for _ in range(3):
            json.loads(_read_line(holder))
        assert _read_line(holder) == "ready"
        with new_llm(llama_dir, sd) as llm:
            with pytest.raises(SessionLockedError, match="'a' is in use by another process"):
                llm.session(session_id="a")
            assert llm.sessions() == ["a"]  # listed, not touched
            assert wal.read_log(sd / "a.log").state is not None
            other = _spawn(llama_dir, sd, "other")  # a third process, another session
            try:
                assert json.loads(_read_line(other)) == ["a", "b"]
                mine = llm.session(session_id="c", sampling=G)
                mine.send("at the same time")
                with pytest.raises(SessionLockedError):
                    llm.session(session_id="b")
                other.stdin.write("\n")
                other.stdin.flush()
                assert other.wait(60) == 0
            finally:
                other.kill()
            holder.stdin.write("\n")  # the holder dies (SIGKILL): its lock goes with it
            holder.stdin.flush()
            assert holder.wait(60) == -signal.SIGKILL
            a = llm.session(session_id="a")  # taken over
            assert [m["content"] for m in a.messages if m["role"] == "user"] == [
                "turn 0", "turn 1", "turn 2"]
            assert continues_exactly(llm, a)
            b = llm.session(session_id="b")  # its process closed it: a snapshot
            assert b.messages[-2]["content"] == "from the other process"
    finally:
        holder.kill()
    assert sorted(os.listdir(sd)) == ["a.kvs", "b.kvs", "c.kvs"]


def test_start_up_removes_a_directory_lock_nobody_holds(tmp_path):
    """A process killed inside a shared-file write leaves `.kvsession.lock`; start-up
    recovery removes it like a session's stale lock, and never one a live process holds."""
    from kvsession.tiers.locks import DIR_LOCK_NAME, directory_lock

    sd = tmp_path / "sd"
    sd.mkdir()
    (sd / DIR_LOCK_NAME).write_text("12345\n")  # its owner died: nobody holds it
    assert DiskTier(sd).recovered["locks"] == [sd / DIR_LOCK_NAME]
    assert not (sd / DIR_LOCK_NAME).exists()
    with directory_lock(sd):
        assert DiskTier(sd).recovered["locks"] == []
        assert (sd / DIR_LOCK_NAME).exists()
    assert not (sd / DIR_LOCK_NAME).exists()


def test_a_killed_process_leaves_every_acknowledged_turn(llama_dir, tmp_path):
    sd = tmp_path / "sd"
    holder = _spawn(llama_dir, sd, "hold")
    try:
        acked = [json.loads(_read_line(holder)) for _ in range(3)]
        assert _read_line(holder) == "ready"
        holder.send_signal(signal.SIGKILL)
        holder.wait(60)
    finally:
        holder.kill()
    # the dead process's lock file, its log, its KV written behind (the pinned system
    # prompt's blocks once per directory)
    assert sorted(os.listdir(sd)) == [".shared.seg", "a.lock", "a.log", "a.seg"]
    with new_llm(llama_dir, sd) as llm:
        # the stale lock removed at start-up
        assert sorted(os.listdir(sd)) == [".shared.seg", "a.log", "a.seg"]
        a = llm.session(session_id="a")
        assert len(a.messages) == 1 + 2 * len(acked) and a.state == "disk"
        assert [m["content"] for m in a.messages[2::2]] == [
            llm.tokenizer.decode(r["ids"]) for r in acked]
        held = len(wal.read_log(sd / "a.log").state.tokens)
        before = a.token_ids
        r = a.send("and then?")
        assert r.restored_from == "disk" and r.cached_tokens >= held // 16 * 16
        want = expected_turn(llm, a, before, r, G)
        assert r.token_ids == want


def test_a_live_session_is_refused_within_the_process_and_ids_are_not_reused(llama_dir,
                                                                               tmp_path):
    sd = tmp_path / "sd"
    with new_llm(llama_dir, sd) as llm:
        s = llm.session(session_id="x", sampling=G)
        s.send("hi")
        with pytest.raises(ConfigError, match="already in use by a live session"):
            llm.session(session_id="x")
        s.close()  # closed, not deleted: its log keeps it
        again = llm.session(session_id="x")
        assert again.messages == s.messages
        again.close(delete=True)
        assert not (sd / "x.log").exists() and not (sd / "x.lock").exists()
        y = llm.session(session_id="y", sampling=G)
        y.send("y's turn")
        y.close()
        z = llm.session(session_id="z", sampling=G)
        with pytest.raises(ConfigError, match="'y' is taken in session_dir"):
            z.fork(session_id="y")  # y's log is another session's file
        with pytest.raises(ConfigError, match="'y' is taken in session_dir"):
            llm.restore(_snapshot_of(llm, z, tmp_path), session_id="y")


def _snapshot_of(llm, s, tmp_path):
    path = tmp_path / "ext.kvs"
    s.save(path)
    return path


# ---- KV written behind -------------------------------------------------------------------

def test_blocks_are_written_behind_once_and_reused_after_a_restart(llama_dir, tmp_path):
    sd = tmp_path / "sd"
    llm = new_llm(llama_dir, sd, max_model_len=1024)
    try:
        s = llm.session(session_id="w", sampling=G)
        for t in range(4):
            s.send(f"turn {t}: " + "read the file and run the tests " * 4)
        ins = Internals(llm)
        ins.flush_writes()
        wb = ins.writeback
        # one record per distinct block, however many turns saw it (a block the
        # re-rendered history changed is a new block); every current block is there, the
        # partial last one as a tail record keyed by the hash before it and its tokens
        scan = _scan(llm, sd / "w.seg")
        records = {(m.index, m.hash) for m in scan.metas}
        assert len(records) == len(scan.metas) == wb.blocks_written
        assert set(enumerate(s.kv.hashes)) <= records
        held, n_full = len(s.kv.tokens), len(s.kv.hashes)
        assert held % 16, "the test wants a partial last block"
        tail = tail_key(s.kv.hashes[-1], s.kv.tokens[n_full * 16:])
        assert (n_full, tail) in records
        # its slots past the tokens it holds are zeros, not what the block held before
        k = scan.index[(n_full, tail)]
        kv = next(read_blocks(sd / "w.seg", scan.header, [k]))[1]
        for name, x in kv.items():
            assert not x[:, held % 16:].any(), name
            assert torch.equal(x[:, :held % 16], ins.kv_pool.tensors()[name][
                :, s.kv.blocks[-1].block_id, :held % 16])
        # the process "dies" here: a copy of the directory as it is
        shutil.copytree(sd, tmp_path / "copy")
    finally:
        llm.close()
    (tmp_path / "copy" / "w.lock").unlink()
    with new_llm(llama_dir, tmp_path / "copy", max_model_len=1024) as llm:
        s = llm.session(session_id="w")
        assert s.state == "disk" and s.num_cached_tokens == held  # the tail too
        before = s.token_ids
        r = s.send("and then?")
        assert r.restored_from == "disk" and r.cached_tokens == held
        assert r.token_ids == expected_turn(llm, s, before, r, G)
        ins = Internals(llm)
        ins.flush_writes()
        wb = ins.writeback
        # only the blocks the new turn completed (the old tail's block among them) and its
        # new tail were written: nothing already on disk
        now = len(s.kv.tokens)
        assert wb.blocks_written == now // 16 - held // 16 + (now % 16 > 0)


def test_a_resumed_session_takes_the_longest_tail_record_of_its_own_history():
    """segment_tail: a tail record is used only where its key (the chained hash before it
    and its tokens) and its tokens equal the log's, and holds no token the log lacks."""
    from kvsession.tiers.segments import BlockMeta, SegmentScan, segment_tail

    bs, parent, other = 16, bytes(range(32)), bytes(32)

    def meta(i, key, tokens):
        return BlockMeta(index=i, hash=key, tokens=list(tokens), length=1, raw_length=1,
                         crc32=0, codec="none")

    log = list(range(100, 140))  # 2 full blocks, then 8 tokens
    metas = [
        meta(2, tail_key(parent, log[32:35]), log[32:35]),  # an older turn's tail
        meta(2, tail_key(parent, log[32:37]), log[32:37]),  # the last turn's
        meta(2, tail_key(other, log[32:40]), log[32:40]),  # another history's
        meta(2, tail_key(parent, log[32:38]), [7] * 6),  # tokens not what its key says
        meta(1, tail_key(parent, log[16:20]), log[16:20]),  # a tail of block 1
    ]
    scan = SegmentScan(None, metas, 0, 0)
    path = Path("s.seg")
    assert segment_tail(scan, path, 2, log, parent, bs) == ((path, None, 1), 5)
    # the log holds fewer tokens (the turn that wrote the longer tail was not acknowledged)
    assert segment_tail(scan, path, 2, log[:36], parent, bs) == ((path, None, 0), 3)
    assert segment_tail(scan, path, 2, log[:34], parent, bs) is None
    assert segment_tail(scan, path, 2, log, other, bs) == ((path, None, 2), 8)
    assert segment_tail(scan, path, 2, log, bytes([1]) * 32, bs) is None  # another chain
    assert segment_tail(scan, path, 2, [0] + log[1:], parent, bs) == ((path, None, 1), 5)


def test_segments_are_synced_in_bulk_and_when_idle_not_after_every_turn(llama_dir, tmp_path,
                                                                       monkeypatch):
    """An fdatasync commits the file system's journal, which the logs' fdatasyncs (what a
    turn waits for) queue behind: the writer syncs a segment after SYNC_BYTES, when idle,
    and on request (flush, close), never per turn."""
    import time

    from kvsession.tiers.writeback import WriteBehind

    monkeypatch.setattr(WriteBehind, "IDLE_SYNC_S", 3600.0)
    with new_llm(llama_dir, tmp_path / "a") as llm:
        sessions = [llm.session(session_id=f"s{i}", sampling=G) for i in range(3)]
        for t in range(2):
            for s in sessions:
                s.send(f"turn {t}: " + "read the file and run the tests " * 3)
        wb = Internals(llm).writeback
        wb.request(WriteOp.CLOSE, "s0").result(timeout=60)  # s0's segment: synced, closed
        assert wb.blocks_written >= 6 and wb.syncs == 1
        wb.request(WriteOp.FLUSH, None).result(timeout=60)
        assert wb.syncs == 3
    monkeypatch.setattr(WriteBehind, "IDLE_SYNC_S", 0.05)
    with new_llm(llama_dir, tmp_path / "b") as llm:
        llm.session(session_id="s", sampling=G).send("read the file and run the tests " * 3)
        wb, deadline = Internals(llm).writeback, time.monotonic() + 30
        while wb.syncs == 0 and time.monotonic() < deadline:
            time.sleep(0.01)  # polling an observable counter, bounded by the deadline
        assert wb.syncs == 1


def _scan(llm, path):
    from kvsession.tiers.segments import scan_segment

    return scan_segment(path, Internals(llm).identity, path.stem)


def test_a_fragmented_segment_is_compacted_into_one_snapshot(llama_dir, tmp_path,
                                                             monkeypatch):
    from kvsession.tiers.writeback import WriteBehind

    monkeypatch.setattr(WriteBehind, "COMPACT_RECORDS", 4)
    sd = tmp_path / "sd"
    with new_llm(llama_dir, sd, max_model_len=1024) as llm:
        s = llm.session(session_id="c", sampling=G)
        for t in range(3):
            s.send(f"turn {t}: " + "read the file and run the tests " * 4)
        ins = Internals(llm)
        ins.flush_writes()
        wb = ins.writeback
        assert wb.compactions >= 1
        from kvsession.tiers.snapshot_format import snapshot_prefix
        from kvsession.tiers.snapshot_read import read_header

        h = read_header(sd / "c.kvs")  # the blocks of the history when it was compacted
        assert snapshot_prefix(h, s.kv.tokens, 16) >= 16
        assert len(h.token_ids) % 16 == 0
        # a whole session by itself: the conversation as the log had it when compacted
        # (the turn whose blocks triggered it may not have been acknowledged yet)
        text = messages_to_text(s.messages)
        assert h.messages == text[:len(h.messages)] and len(h.messages) >= 2
        assert h.history["mode"] == "append" and h.sampling["max_tokens"] == 4
        assert list(s.token_ids[:len(h.history["log"])]) == h.history["log"]
        assert h.token_ids == h.history["log"][:len(h.token_ids)]
        shutil.copytree(sd, tmp_path / "copy")
        shutil.copy(sd / "c.kvs", tmp_path / "alone.kvs")
        # the partial last block is reused when the segment holds its tail record (a
        # compaction copies full blocks only and removes the segment)
        n_full = len(s.kv.tokens) // 16
        tail = (n_full, tail_key(s.kv.hashes[-1], s.kv.tokens[n_full * 16:]))
        has_tail = (sd / "c.seg").exists() and tail in _scan(llm, sd / "c.seg").index
        held = len(s.kv.tokens) if has_tail else n_full * 16
    (tmp_path / "copy" / "c.lock").unlink()
    with new_llm(llama_dir, tmp_path / "copy", max_model_len=1024) as llm:
        s = llm.session(session_id="c")
        assert len(s.messages) == 6
        plan = Internals(llm).disk_plan(s)
        assert plan.from_files.get("snapshot", 0) >= 1 and len(plan.tokens) == held
        before = s.token_ids
        r = s.send("and then?")
        assert r.restored_from == "disk" and r.cached_tokens == held
        assert r.token_ids == expected_turn(llm, s, before, r, G)
    with new_llm(llama_dir, None, max_model_len=1024) as llm:  # the snapshot alone
        s = llm.restore(tmp_path / "alone.kvs")
        assert messages_to_text(s.messages) == h.messages
        assert s.history_state()["mode"] == "append"
        assert s.num_cached_tokens == len(h.token_ids)
        assert continues_exactly(llm, s)


def test_a_resumed_session_with_a_shared_prefix_is_compacted_without_losing_its_kv(
        llama_dir, tmp_path, monkeypatch):
    """A process that resumed a session has never written the shared prefix store: its
    compaction must still copy the session's leading blocks from it (it found no block 0,
    wrote nothing and removed the segment: every block of the session was lost)."""
    from kvsession.tiers.snapshot_format import snapshot_prefix
    from kvsession.tiers.snapshot_read import read_header
    from kvsession.tiers.writeback import WriteBehind

    lead = one_turn_copied(llama_dir, tmp_path, "c")  # the process "dies" after the copy
    monkeypatch.setattr(WriteBehind, "COMPACT_RECORDS", 4)
    with new_llm(llama_dir, tmp_path / "copy", max_model_len=1024) as llm:
        s = llm.session(session_id="c")
        for t in range(2):
            s.send(f"turn {t}: " + "read the file and run the tests " * 4)
        ins = Internals(llm)
        ins.flush_writes()
        wb = ins.writeback
        assert wb.compactions >= 1 and lead >= 2
        h = read_header(tmp_path / "copy" / "c.kvs")
        assert snapshot_prefix(h, s.kv.tokens, 16) >= (lead + 4) * 16


def test_a_pinned_system_prompt_is_stored_once_per_directory(llama_dir, tmp_path):
    system = LONG_SYSTEM
    sd = tmp_path / "sd"
    llm = new_llm(llama_dir, sd, max_model_len=1024)
    try:
        sessions = [llm.session(session_id=f"p{i}", system=system, sampling=G)
                    for i in range(4)]
        for s in sessions:
            s.send(f"{s.session_id}: read the file and run the tests " * 3)
        Internals(llm).flush_writes()
        lead = Internals(llm).num_lead(sessions[0])
        assert lead >= 2
        shared = _scan(llm, sd / ".shared.seg")
        assert sorted(m.index for m in shared.metas) == list(range(lead))  # once
        for s in sessions:
            assert min(m.index for m in _scan(llm, sd / f"{s.session_id}.seg").metas) == lead
        shutil.copytree(sd, tmp_path / "copy")
    finally:
        llm.close()
    assert sorted(os.listdir(sd)) == [f"p{i}.kvs" for i in range(4)]  # collected at close
    for f in (tmp_path / "copy").glob("*.lock"):
        f.unlink()
    with new_llm(llama_dir, tmp_path / "copy", max_model_len=1024,
                 enable_prefix_caching=True) as llm:
        Internals(llm).fix_rate("disk_read", 1e12)  # loading beats recomputing
        s = llm.session(session_id="p2")
        plan = Internals(llm).disk_plan(s)
        assert plan.from_files["shared"] == lead and plan.from_files["segment"] >= 1
        # the system prompt was pinned again from the shared store: its pin found every
        # full block in the prefix cache (read from .shared.seg), none prefilled
        assert llm.stats().prefix.hit_tokens == lead * 16
        assert llm.stats().prefix.pinned_blocks == lead
        before = s.token_ids
        r = s.send("and then?")
        assert r.restored_from == "disk"
        assert r.token_ids == expected_turn(llm, s, before, r, G)


def test_a_new_session_pins_its_system_prompt_from_the_directorys_shared_store(
        llama_dir, tmp_path):
    """A replica sharing the session_dir (here: a copy of it, as another process sees it)
    opening a *new* session with a system prompt another one stored reads the pin's blocks
    from .shared.seg instead of prefilling them; the turn is the same either way."""
    lead = one_turn_copied(llama_dir, tmp_path, "a")  # what another process sees meanwhile
    assert lead >= 2
    with new_llm(llama_dir, tmp_path / "copy", max_model_len=1024) as llm:
        Internals(llm).fix_rate("disk_read", 1e12)  # loading beats recomputing
        before = llm.stats().prefill_tokens
        b = llm.session(session_id="b", system=LONG_SYSTEM, sampling=G)
        assert llm.stats().prefix.pinned_blocks == lead
        assert llm.stats().prefix.hit_tokens == lead * 16  # every pinned block read
        assert llm.stats().prefill_tokens - before < 16  # at most the partial last block
        log_before = b.token_ids
        r = b.send("and then?")
        assert r.token_ids == expected_turn(llm, b, log_before, r, G)
    with new_llm(llama_dir, tmp_path / "plain", max_model_len=1024) as llm:  # no store
        before = llm.stats().prefill_tokens
        llm.session(session_id="b", system=LONG_SYSTEM, sampling=G)
        assert llm.stats().prefill_tokens - before >= lead * 16


def one_turn_copied(model_dir, tmp_path: Path, session_id: str) -> int:
    """One turn of a session with LONG_SYSTEM in tmp_path/"sd", its KV written behind, the
    directory copied to tmp_path/"copy" while it is open (what a crash, or another process,
    leaves), the copy's locks removed; returns the session's pinned lead blocks."""
    sd = tmp_path / "sd"
    llm = new_llm(model_dir, sd, max_model_len=1024)
    try:
        s = llm.session(session_id=session_id, system=LONG_SYSTEM, sampling=G)
        s.send("read the file and run the tests " * 3)
        Internals(llm).flush_writes()
        lead = Internals(llm).num_lead(s)
        shutil.copytree(sd, tmp_path / "copy")
    finally:
        llm.close()
    for f in (tmp_path / "copy").glob("*.lock"):
        f.unlink()
    return lead


@pytest.mark.parametrize("durability", ["turn", "close"])
def test_a_spill_between_a_turns_kv_and_its_messages_loses_nothing_at_close(
        llama_dir, tmp_path, monkeypatch, durability):
    """A spill to disk can land after a turn's KV went back to the session and before the
    caller recorded the turn's messages: the file then holds the new KV with the old
    messages. close() must not take that file as the session (with a log, the log is
    removed once the snapshot is written: the turn would be lost)."""
    from kvsession.cache.manager import Tier
    from kvsession.session import Session
    from kvsession.tiers.snapshot_read import read_header

    sd = tmp_path / "sd"
    llm = new_llm(llama_dir, sd, durability=durability)
    real_finish = Session._finish

    def spill_first(self, seq, *args):
        Internals(llm).spill(self, Tier.DISK)
        return real_finish(self, seq, *args)

    with llm:
        s = llm.session(session_id="r", sampling=G)
        s.send("first")
        monkeypatch.setattr(Session, "_finish", spill_first)
        s.send("second")
        assert s.state == "disk"
        messages = s.messages
        assert len(read_header(sd / "r.kvs").messages) == 2  # the spill saw one turn
    assert sorted(os.listdir(sd)) == ["r.kvs"]
    h = read_header(sd / "r.kvs")
    assert h.messages == messages and len(messages) == 4
    with new_llm(llama_dir, sd, durability=durability) as llm:
        again = llm.session(session_id="r")
        assert again.messages == messages and continues_exactly(llm, again)


@pytest.mark.parametrize("durability", ["turn", "close"])
def test_a_closed_session_stays_listed_and_resumes_where_it_was_closed(llama_dir, tmp_path,
                                                                       durability):
    """close() frees the KV and keeps the session in session_dir at the state it was closed
    in: with "turn" its log (always the latest acknowledged turn); with "close" the file a
    spill wrote is rewritten first (it held an older turn: resuming it lost the turns after
    the spill), and a session that never had a file is not written (that mode writes at
    llm.close() and on spills). close(delete=True) removes every file of the session: log,
    segment, snapshot, lock, and the shared prefix store once no session uses it."""
    from kvsession.cache.manager import Tier

    sd = tmp_path / "sd"
    with new_llm(llama_dir, sd, durability=durability) as llm:
        s = llm.session(session_id="a", system=SYSTEM, sampling=G)
        s.send("one")
        Internals(llm).spill(s, Tier.DISK)
        s.send("two")
        messages = s.messages
        s.close()
        assert llm.sessions() == ["a"]
        t = llm.session(session_id="t", sampling=G)
        t.send("never spilled")
        t.close()
        assert llm.sessions() == (["a", "t"] if durability == "turn" else ["a"])
        again = llm.session(session_id="a")  # in the same process
        assert again.messages == messages and continues_exactly(llm, again)
        messages = again.messages
        again.close()
    with new_llm(llama_dir, sd, durability=durability) as llm:  # and in the next one
        again = llm.session(session_id="a")
        assert again.messages == messages and len(messages) == 7
        assert continues_exactly(llm, again)
        again.close(delete=True)
        if durability == "turn":
            llm.session(session_id="t").close(delete=True)
        assert llm.sessions() == []
        assert sorted(os.listdir(sd)) == []


DELETE_CHILD = r"""
import os, signal, sys
import kvsession.tiers.commit as commit
from kvsession import LLM
llm = LLM(sys.argv[1], kv_cache_memory="8MiB", max_model_len=512, session_dir=sys.argv[2])
s = llm.session(session_id="a")
s.send("turn 2")
remove = commit.remove_quietly
def remove_then_die(path):  # the crash lands right after the log is gone
    remove(path)
    if str(path).endswith(".log"):
        os.kill(os.getpid(), signal.SIGKILL)
commit.remove_quietly = remove_then_die
s.close(delete=True)
"""


def test_a_crash_inside_close_delete_never_resurrects_an_older_snapshot(llama_dir, tmp_path):
    """close(delete=True) removes the snapshot (durably) before the log, the truth: a crash
    in between leaves the whole session or none of it. It removed the log first, and a
    crash then brought back the older snapshot as the session, without the turns logged
    since it was written."""
    with new_llm(llama_dir, tmp_path) as llm:
        llm.session(session_id="a").send("turn 0")
    assert (tmp_path / "a.kvs").exists()  # closed: persisted as a snapshot of turn 0
    p = subprocess.run([sys.executable, "-c", DELETE_CHILD, str(llama_dir), str(tmp_path)],
                       capture_output=True, text=True, timeout=180)
    assert p.returncode == -signal.SIGKILL, p.stderr[-2000:]
    with new_llm(llama_dir, tmp_path) as llm:
        assert "a" not in llm.sessions()  # deleted (not turn 0's state back)


def test_a_log_left_by_turn_durability_does_not_hide_turns_taken_with_close(llama_dir,
                                                                            tmp_path):
    """A session resumed from a log in durability="close" is persisted as a snapshot at
    close, and the log goes (read first, as the truth, it hid this process's turns)."""
    with new_llm(llama_dir, tmp_path) as llm:
        s = llm.session(session_id="a")
        s.send("t0")
        s.close()  # closed without delete: resumable from its log
    assert (tmp_path / "a.log").exists()
    with new_llm(llama_dir, tmp_path, durability="close") as llm:
        llm.session(session_id="a").send("c1")
    with new_llm(llama_dir, tmp_path) as llm:
        resumed = llm.session(session_id="a")
        assert [m["content"] for m in resumed.messages if m["role"] == "user"] == ["t0", "c1"]
