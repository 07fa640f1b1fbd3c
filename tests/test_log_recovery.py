"""Damage to a session log never loses an acknowledged turn silently, nor resumes someone
else's history (tiers/wal.py's recovery rules, tiers/recovery.py's reports).

A table of damage kinds x record positions over logs written by the real commit thread:
each case ends with the acknowledged turns before the damage recovered and the cut
reported (a warning, the session's recovery file, `llm.stats().recovery`, the resumed
session's `stats.recovery`), or with a typed error naming the session and the file left as
it is. A log removed by recovery leaves a tombstone: the id raises SessionLostError until a
fresh session is asked for."""

from __future__ import annotations

import logging
import pickle
import shutil
import struct

import pytest
from llms import tiny_llm
from log_files import write_log

from kvsession import ConfigError, SamplingParams, SessionLostError, SnapshotError
from kvsession.tiers import recovery, wal
from kvsession.tiers.disk import DiskTier
from oracle import expected_turn

RECORDS = 3
G = SamplingParams(max_tokens=4, temperature=0.0)


def damaged(data: bytes, ends: list[int], kind: str, at: int) -> bytes:
    """`data` (a log of RECORDS records ending at `ends`) with record `at` damaged."""
    start = len(wal.LOG_PREFIX) if at == 0 else ends[at - 1]
    end = ends[at]
    buf = bytearray(data)
    if kind == "zeros after":  # the size of an append reached the disk, its data did not
        return data + bytes(4096)
    if kind == "cut":  # a power loss inside the record
        return data[: (start + end) // 2]
    if kind == "bit flip":
        buf[(start + end) // 2] ^= 0x10
    elif kind == "bad length":
        struct.pack_into("<I", buf, start, wal.MAX_RECORD_BYTES - 1)
    elif kind == "zeroed":  # the record's blocks lost, the file size kept
        buf[start:end] = bytes(end - start)
    elif kind == "zero file":
        buf[:] = bytes(len(buf))
    return bytes(buf)


KINDS = ["zeros after", "cut", "bit flip", "bad length", "zeroed", "zero file"]


def expected(kind: str, at: int) -> tuple[str, int | None, int]:
    """(outcome, records recovered, records the report says were dropped): outcome is
    "whole" (nothing cut), "truncated", "removed" or "refused"."""
    if kind == "zeros after":
        return "truncated", RECORDS, 0
    if kind == "zero file":
        return "removed", None, 0
    if kind == "cut":
        return ("removed", None, 1) if at == 0 else ("truncated", at, 1)
    if at < RECORDS - 1:  # intact records follow the damage: not a torn append
        return "refused", None, 0
    return "truncated", at, 0 if kind == "zeroed" else 1


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """The original log, and the state each prefix of its records replays to."""
    root = tmp_path_factory.mktemp("ref")
    path, ends = write_log(root, RECORDS)
    data = path.read_bytes()
    states = []
    for n in range(1, RECORDS + 1):
        p = root / f"p{n}.log"
        p.write_bytes(data[: ends[n - 1]])
        states.append(wal.read_log(p).state)
    return data, ends, states


# (the damage to the whole file, or after it, has no position)
CASES = [(kind, at) for kind in KINDS for at in range(RECORDS)
         if at == 0 or kind not in ("zeros after", "zero file")]


@pytest.mark.parametrize("kind, at", CASES)
def test_damage_recovers_acknowledged_turns_or_is_refused(tmp_path, reference, kind, at,
                                                          caplog):
    data, ends, states = reference
    bad = damaged(data, ends, kind, at)
    path = tmp_path / "s.log"
    path.write_bytes(bad)
    outcome, kept, dropped = expected(kind, at)
    with caplog.at_level(logging.WARNING, logger="kvsession"):
        disk = DiskTier(tmp_path)  # start-up recovery
    if outcome == "refused":
        with pytest.raises(SnapshotError, match=r"s\.log.*corrupted, and an intact one"):
            wal.read_log(path, session_id="s")
        assert path.read_bytes() == bad and not disk.recoveries
        assert recovery.read_events(tmp_path, "s") == []
        return
    (event,) = disk.recoveries
    assert recovery.read_events(tmp_path, "s") == [event]
    assert (event.session_id, event.records_dropped, event.turns_dropped) == (
        "s", dropped, dropped)
    assert "session s:" in caplog.text and "crash recovery" in caplog.text
    if outcome == "removed":
        assert event.action is recovery.RecoveryAction.REMOVED
        assert event.bytes_cut == len(bad) and not path.exists()
        assert recovery.tombstone(tmp_path, "s") == event
        with pytest.raises(SessionLostError, match="session 's'.*fresh=True"):
            recovery.refuse_lost(tmp_path, "s")
        return
    assert event.action is recovery.RecoveryAction.TRUNCATED
    scan = wal.read_log(path, session_id="s")
    assert not scan.torn and scan.end == ends[kept - 1]
    assert event.bytes_cut == len(bad) - ends[kept - 1]
    want = states[kept - 1]
    assert (scan.state.messages, scan.state.tokens, scan.state.seq) == (
        want.messages, want.tokens, want.seq)
    assert recovery.tombstone(tmp_path, "s") is None


def test_a_tail_of_zeros_is_a_torn_tail_not_corruption(tmp_path, reference):
    """A length-0 frame "checks" (crc32 of nothing is 0) but is no record: every
    acknowledged turn is kept (it was a SnapshotError, the whole session out of reach)."""
    data, ends, states = reference
    for zeros in (8, 9, 4096, 1 << 16):
        path = tmp_path / "s.log"
        path.write_bytes(data + bytes(zeros))
        scan = wal.read_log(path, session_id="s")
        assert (scan.end, scan.size, scan.dropped_records) == (len(data), len(data) + zeros,
                                                               0)
        assert scan.state.messages == states[-1].messages


def test_another_sessions_log_is_refused_naming_both(tmp_path):
    a, _ = write_log(tmp_path, RECORDS, "a")
    b, _ = write_log(tmp_path, RECORDS, "b")
    shutil.copyfile(b, a)
    with pytest.raises(SnapshotError, match=r"a\.log: the log of session 'b', not of 'a'"):
        wal.read_log(a, session_id="a")
    before = a.read_bytes()
    disk = DiskTier(tmp_path)  # start-up recovery leaves it as it is
    assert a.read_bytes() == before and not disk.recoveries


def test_a_damaged_recovery_file_is_treated_as_absent(tmp_path, caplog):
    for content in (b"{", b"[" * 100_000, b"x" * (recovery.MAX_FILE_BYTES + 10),
                    b'[{"session_id": "other", "action": "removed", "bytes_cut": 1, '
                    b'"records_dropped": 0, "turns_dropped": 0, "unix_s": 1, "cause": ""}]'):
        recovery.recovery_path(tmp_path, "s").write_bytes(content)
        assert recovery.read_events(tmp_path, "s") == []
        assert recovery.tombstone(tmp_path, "s") is None


# ---- through the API -----------------------------------------------------------------------

def new_llm(model_dir, sd, **kw):
    return tiny_llm(model_dir, session_dir=sd, **kw)


def two_turns(llm, sid):
    s = llm.session(system="sys", session_id=sid, sampling=G)
    s.send("hello")
    s.send("and then?")
    messages = s.messages
    s.close()  # the log stays: the session is resumable
    return messages


def test_a_zero_tail_resumes_every_turn_and_says_what_was_cut(llama_dir, tmp_path):
    with new_llm(llama_dir, tmp_path) as llm:
        messages = two_turns(llm, "a")
    log = tmp_path / "a.log"
    size = log.stat().st_size
    with open(log, "ab") as f:
        f.write(bytes(512))
    with new_llm(llama_dir, tmp_path) as llm:
        (event,) = llm.stats().recovery
        assert (event.session_id, event.action.value, event.bytes_cut) == ("a", "truncated",
                                                                          512)
        s = llm.session(session_id="a")
        assert s.messages == messages and s.stats.recovery == [event]
        before = s.token_ids
        r = s.send("next")
        assert r.token_ids == expected_turn(llm, s, before, r, G)
        assert log.stat().st_size > size  # the next turn appended to the cut log


def test_a_removed_log_is_a_tombstone_until_fresh(llama_dir, tmp_path):
    with new_llm(llama_dir, tmp_path) as llm:
        two_turns(llm, "a")
        two_turns(llm, "b")
    assert not (tmp_path / "a.kvs").exists()
    log = tmp_path / "a.log"
    log.write_bytes(bytes(log.stat().st_size))  # the rename reached the disk, the data not
    with new_llm(llama_dir, tmp_path) as llm:
        assert [e.action.value for e in llm.stats().recovery] == ["removed"]
        with pytest.raises(SessionLostError, match="session 'a'.*removed") as e:
            llm.session(session_id="a")
        assert e.value.session_id == "a"
        again = pickle.loads(pickle.dumps(e.value))  # crosses processes whole
        assert (type(again), again.session_id, str(again)) == (
            SessionLostError, "a", str(e.value))
        assert "a" not in llm.sessions() and "b" in llm.sessions()
        b = llm.session(session_id="b")
        assert b.messages  # the other session is untouched
        b.close()
        with pytest.raises(ConfigError, match="fresh=True.*'b'"):
            llm.session(session_id="b", fresh=True)
        s = llm.session(system="sys", session_id="a", fresh=True, sampling=G)
        assert s.messages[1:] == [] and s.stats.recovery == []
        s.send("hello")
        s.close()
    with new_llm(llama_dir, tmp_path) as llm:  # the new session is what "a" is now
        assert [m["content"] for m in llm.session(session_id="a").messages
                if m["role"] == "user"] == ["hello"]


def test_damage_found_at_resume_is_reported_on_the_session(llama_dir, tmp_path):
    """A log damaged while the LLM runs (after its start-up scan) is repaired by the resume
    itself, with the same report."""
    with new_llm(llama_dir, tmp_path) as llm:
        messages = two_turns(llm, "a")
        with open(tmp_path / "a.log", "ab") as f:
            f.write(struct.pack("<II", 100, 0) + b"torn")
        s = llm.session(session_id="a")
        assert s.messages == messages
        (event,) = s.stats.recovery
        assert (event.records_dropped, event.bytes_cut) == (1, 12)
        assert llm.stats().recovery == [event]
        s.close(delete=True)
    assert not recovery.recovery_path(tmp_path, "a").exists()


def test_another_sessions_log_does_not_resume_as_this_one(llama_dir, tmp_path):
    with new_llm(llama_dir, tmp_path) as llm:
        two_turns(llm, "a")
        b_messages = two_turns(llm, "b")
    shutil.copyfile(tmp_path / "b.log", tmp_path / "a.log")
    with new_llm(llama_dir, tmp_path) as llm:
        with pytest.raises(SnapshotError, match="session 'b', not of 'a'"):
            llm.session(session_id="a")
        assert llm.session(session_id="b").messages == b_messages


@pytest.mark.parametrize("sid", ["con", "CON", "nul", "aux.txt", "Com1", "lpt9.log", "prn.a.b",
                                 "trailing."])
def test_windows_reserved_session_ids_are_refused(llama_dir, tmp_path, sid):
    with new_llm(llama_dir, tmp_path) as llm:
        with pytest.raises(ConfigError, match="session_id"):
            llm.session(session_id=sid)
        llm.session(session_id="console").close()  # a reserved name's prefix is fine
        llm.session(session_id="com10").close()
