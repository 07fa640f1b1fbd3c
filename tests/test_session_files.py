"""Session files in session_dir: a file's name is its session, a session writes and deletes
only its own file, persistence failures are reported without losing a conversation (real
file-system failures: a full tmpfs, RLIMIT_FSIZE, a directory replaced by a file), the
directory scan survives odd entries and removes crashed saves' temporary files, and a
closed session forks nothing."""

from __future__ import annotations

import fcntl
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from internals import Internals
from llms import tiny_llm

from kvsession import ConfigError, SamplingParams, SessionClosedError, SnapshotError
from kvsession.cli import main as cli_main
from kvsession.tiers import snapshot_read as snap_read
from oracle import expected_turn

G = SamplingParams(max_tokens=4, temperature=0.0)
SYSTEM = "You are a coding agent. Tools: list_files(path), read_file(path), run_tests()."
# the writer's temporary files (docs/snapshot-format.md, "Crash safety")
TEMP = re.compile(r"\.(.+\.kvs)\.[0-9]+\.[0-9a-f]{8}\.tmp")


def new_llm(model_dir, sd=None, **kw):
    """durability="close": these tests are about the files written at close and by spills
    (the write-ahead log of durability="turn" is tested in test_durability.py)."""
    return tiny_llm(model_dir, **{"session_dir": sd, "durability": "close", **kw})


def continues_exactly(llm, s, message="and then?"):
    """The session's next turn equals llm.chat over the same history, reusing its KV."""
    before = s.token_ids
    r = s.send(message)
    want = expected_turn(llm, s, before, r, G)
    return r.token_ids == want and r.cached_tokens > 0


# ---- item 6: the file name is the session ------------------------------------------------

def test_a_copied_file_resumes_under_its_own_name(llama_dir, tmp_path):
    sd = tmp_path / "sd"
    with new_llm(llama_dir, sd) as llm:
        llm.session(session_id="alice", sampling=G).send("first from alice")
    shutil.copy(sd / "alice.kvs", sd / "alice-backup.kvs")
    with new_llm(llama_dir, sd) as llm:
        alice = llm.session(session_id="alice")
        alice.send("second from alice")
        alice.send("third from alice")
    alice_file = snap_read.read_header(sd / "alice.kvs")
    with new_llm(llama_dir, sd) as llm:
        assert llm.sessions() == ["alice", "alice-backup"]
        backup = llm.session(session_id="alice-backup")
        assert backup.session_id == "alice-backup" and len(backup.messages) == 2
        backup.send("from the backup")
        alice = llm.session(session_id="alice")  # both at once: two sessions
        assert len(alice.messages) == 6
    # the backup's turns went to its own file; alice's newer turns are intact
    after = snap_read.read_header(sd / "alice.kvs")
    assert (after.messages, after.token_ids) == (alice_file.messages, alice_file.token_ids)
    assert snap_read.read_header(sd / "alice-backup.kvs").session_id == "alice-backup"
    assert len(snap_read.read_header(sd / "alice-backup.kvs").messages) == 4


def test_restoring_an_external_file_never_overwrites_another_session(llama_dir, tmp_path):
    sd, ext = tmp_path / "sd", tmp_path / "ext"
    ext.mkdir()
    with new_llm(llama_dir) as llm:
        s = llm.session(session_id="bob", sampling=G)
        s.send("an old turn")
        s.save(ext / "old-bob.kvs")
    with new_llm(llama_dir, sd) as llm:
        llm.session(session_id="bob", sampling=G).send("a newer conversation")
    newer = (sd / "bob.kvs").read_bytes()
    with new_llm(llama_dir, sd) as llm:
        with pytest.raises(ConfigError, match="'bob' is taken in session_dir"):
            llm.restore(ext / "old-bob.kvs")  # its header says "bob"
        with pytest.raises(ConfigError, match="taken in session_dir"):
            llm.session(session_id="x", sampling=G).fork(session_id="bob")
        copy = llm.restore(ext / "old-bob.kvs", session_id="bob-2")
        assert copy.session_id == "bob-2" and continues_exactly(llm, copy)
        assert llm.sessions() == ["bob"]
    assert (sd / "bob.kvs").read_bytes() == newer
    assert sorted(p.name for p in sd.iterdir()) == ["bob-2.kvs", "bob.kvs", "x.kvs"]
    with new_llm(llama_dir, tmp_path / "empty") as llm:  # no conflict: the header's id
        assert llm.restore(ext / "old-bob.kvs").session_id == "bob"


# ---- item 7: close(delete=True) deletes only the session's own file ------------------------

def test_close_delete_removes_only_the_sessions_own_file(llama_dir, tmp_path):
    sd, ext = tmp_path / "sd", tmp_path / "ext"
    ext.mkdir()
    with new_llm(llama_dir) as llm:
        s = llm.session(session_id="ext", sampling=G)
        s.send("hello")
        s.save(ext / "ext.kvs")
    original = (ext / "ext.kvs").read_bytes()
    with new_llm(llama_dir, sd) as llm:
        llm.session(session_id="carol", sampling=G).send("carol's turn")
    with new_llm(llama_dir, sd) as llm:
        s = llm.restore(ext / "ext.kvs")
        assert s.session_id == "ext"
        s.close(delete=True)
        assert (ext / "ext.kvs").read_bytes() == original  # not ours to delete
        copy = llm.restore(sd / "carol.kvs", session_id="carol-copy")
        copy.close(delete=True)
        assert (sd / "carol.kvs").is_file()  # carol's file, not the copy's
        carol = llm.session(session_id="carol")
        carol.close(delete=True)
        assert not (sd / "carol.kvs").exists()  # its own file: deleted
        llm.check_integrity()


# ---- item 8: persistence failures are reported, nothing is lost before --------------------

def test_save_failures_are_snapshot_errors_and_change_nothing(llama_dir, tmp_path):
    not_a_dir = tmp_path / "file"
    not_a_dir.write_text("x")
    with new_llm(llama_dir) as llm:
        s = llm.session(session_id="s", sampling=G)
        s.send("hello")
        cached = s.num_cached_tokens
        with pytest.raises(SnapshotError, match="Not a directory"):
            s.save(not_a_dir / "s.kvs")
        with pytest.raises(SnapshotError, match="No such file"):
            s.save(tmp_path / "missing" / "s.kvs")
        assert s.state == "idle" and s.num_cached_tokens == cached
        assert continues_exactly(llm, s)
        s.close()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["file"]


def test_close_with_an_unwritable_session_dir_keeps_and_reports(llama_dir, tmp_path):
    """session_dir replaced by a regular file while the engine runs: close() raises a
    SnapshotError naming every session, which stay live with their KV; once the
    directory is back, close() persists them all and they continue exactly."""
    sd = tmp_path / "sd"
    llm = new_llm(llama_dir, sd)
    sessions = [llm.session(session_id=f"s{i}", sampling=G) for i in range(4)]
    for i, s in enumerate(sessions):
        s.send(f"task {i}: " + "do it " * i)
    cached = [s.num_cached_tokens for s in sessions]
    sd.rmdir()
    sd.write_text("not a directory any more")
    with pytest.raises(SnapshotError, match="4 of 4 sessions could not be persisted") as e:
        llm.close()
    assert e.value.sessions == sessions
    assert all(f"s{i} (" in str(e.value) for i in range(4))
    assert [s.state for s in sessions] == ["idle"] * 4
    assert [s.num_cached_tokens for s in sessions] == cached
    llm.check_integrity()
    sd.unlink()
    sd.mkdir()
    llm.close()  # now it persists everything and closes
    assert [s.state for s in sessions] == ["closed"] * 4
    with new_llm(llama_dir, sd) as again:
        assert again.sessions() == ["s0", "s1", "s2", "s3"]
        for i in range(4):
            assert continues_exactly(again, again.session(session_id=f"s{i}"))


# Runs in a subprocess: the session_dir fills up (a tmpfs of the size given) or files are
# capped (RLIMIT_FSIZE), close() must name the sessions it could not persist, keep them
# live with their KV and, once the limit is lifted, persist them on the next close().
FULL_DISK = r"""
import json, resource, subprocess, sys
from kvsession import LLM, SamplingParams, SnapshotError
model, sd, mode = sys.argv[1], sys.argv[2], sys.argv[3]
llm = LLM(model, kv_cache_memory="8MiB", max_model_len=512, session_dir=sd)
G = SamplingParams(max_tokens=4, temperature=0.0)
sessions = [llm.session(session_id=f"s{i:02d}", sampling=G) for i in range(24)]
for i, s in enumerate(sessions):  # 1 to 9 blocks of KV each
    s.send(f"task {i}: " + "read the file and run the tests " * (3 * (i % 6)))
cached = {s.session_id: s.num_cached_tokens for s in sessions}
if mode == "rlimit":  # files of up to 4 blocks fit
    limit = 4 * llm.config.block_size * llm.runtime.kv_bytes_per_token + 8192
    resource.setrlimit(resource.RLIMIT_FSIZE, (limit, resource.RLIM_INFINITY))
try:
    llm.close()
    failed = []
except SnapshotError as e:
    failed = [s.session_id for s in e.sessions]
    message = str(e)
kept = {s.session_id: [s.state, s.num_cached_tokens] for s in sessions if s.state != "closed"}
if mode == "rlimit":
    resource.setrlimit(resource.RLIMIT_FSIZE, (resource.RLIM_INFINITY,) * 2)
else:
    subprocess.run(["mount", "-o", "remount,size=64M", sd], check=True)
llm.close()
print(json.dumps({"failed": failed, "message": message if failed else "", "kept": kept,
                  "cached": cached, "closed": all(s.state == "closed" for s in sessions)}))
"""


def _mount_tmpfs(where: Path, size: str) -> bool:
    if os.geteuid() != 0 or not shutil.which("mount"):
        return False
    where.mkdir()
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(where)],
                       capture_output=True)
    return r.returncode == 0


@pytest.mark.parametrize("mode", ["tmpfs", "rlimit"])
def test_close_on_a_full_disk_loses_no_session(llama_dir, tmp_path, mode):
    sd = tmp_path / "sd"
    # tmpfs: about half of the 24 snapshots fit
    if mode == "tmpfs" and not _mount_tmpfs(sd, "512k"):
        pytest.skip("mounting a tmpfs needs root (the rlimit case covers this)")
    try:
        out = subprocess.run([sys.executable, "-c", FULL_DISK, str(llama_dir), str(sd), mode],
                             capture_output=True, text=True, timeout=120)
        assert out.returncode == 0, out.stderr
        res = json.loads(out.stdout.strip().splitlines()[-1])
        failed = res["failed"]
        assert 0 < len(failed) < 24, res  # some fit, some did not
        print(f"\n{mode}: {len(failed)} of 24 sessions not persisted at the first close()")
        reason = "No space left" if mode == "tmpfs" else "File too large"
        assert f"{len(failed)} of 24 sessions could not be persisted" in res["message"]
        assert reason in res["message"] and all(f"{f} (" in res["message"] for f in failed)
        # until the failure was reported, each of them kept its KV (and only they stayed)
        assert res["kept"] == {f: ["idle", res["cached"][f]] for f in failed}
        assert res["closed"]
        assert not [p for p in sd.iterdir() if TEMP.fullmatch(p.name)]
        with new_llm(llama_dir, sd) as llm:
            assert llm.sessions() == [f"s{i:02d}" for i in range(24)]
            for sid in failed[:3] + ["s00"]:
                s = llm.session(session_id=sid)
                assert s.num_cached_tokens == res["cached"][sid]
                assert continues_exactly(llm, s)
    finally:
        if mode == "tmpfs":
            subprocess.run(["umount", str(sd)], check=False)


# ---- item 9: the directory scan survives odd entries ------------------------------------

def test_sessions_skip_fifos_directories_and_bad_files_without_blocking(llama_dir, tmp_path):
    sd = tmp_path / "sd"
    with new_llm(llama_dir, sd) as llm:
        llm.session(session_id="good", sampling=G).send("hello")
    os.mkfifo(sd / "fifo.kvs")
    (sd / "dir.kvs").mkdir()
    (sd / "garbage.kvs").write_bytes(b"\x00" * 100)
    (sd / "bad name!.kvs").write_bytes((sd / "good.kvs").read_bytes())
    raw = (sd / "good.kvs").read_bytes()
    (sd / "cut.kvs").write_bytes(raw[: len(raw) // 2])
    result: dict = {}

    def work():
        try:
            check(result)
        except BaseException as e:  # reported by the assertion below
            result["error"] = repr(e)

    def check(result):
        with new_llm(llama_dir, sd) as llm:
            result["sessions"] = llm.sessions()
            with pytest.raises(SnapshotError, match="not a regular file"):
                llm.restore(sd / "fifo.kvs", session_id="f")
            with pytest.raises(ConfigError, match="taken in session_dir"):
                llm.session(session_id="fifo")
            with pytest.raises(SnapshotError, match="truncated"):
                llm.session(session_id="cut")
            result["continues"] = continues_exactly(llm, llm.session(session_id="good"))

    t = threading.Thread(target=work, daemon=True)
    t.start()
    t.join(timeout=60)  # a bound, not synchronisation: before the fix this blocked forever
    if t.is_alive():  # unblock an open() waiting for a writer, so the thread can end
        os.close(os.open(sd / "fifo.kvs", os.O_WRONLY | os.O_NONBLOCK))
        pytest.fail("the scan blocked on a FIFO")
    assert result == {"sessions": ["good"], "continues": True}
    assert stat_is_fifo(sd / "fifo.kvs")  # skipped, never replaced or deleted


def stat_is_fifo(path: Path) -> bool:
    import stat

    return stat.S_ISFIFO(os.lstat(path).st_mode)


# ---- item 11: crashed saves' temporary files are removed at start-up ----------------------

CRASHING_SAVE = r"""
import os, signal, sys
from pathlib import Path
from kvsession.tiers import snapshot as snap
from kvsession.tiers import snapshot_read as snap_read
src, dst = Path(sys.argv[1]), Path(sys.argv[2])
h = snap_read.read_header(src)
blocks = [{n: t.clone() for n, t in ts.items()}
          for _, ts in snap_read.read_blocks(src, h, list(range(h.num_blocks)))]
fields = {f: getattr(h, f) for f in h.__struct_fields__
          if f not in ("format_version", "chunks", "created_unix_s")}

def crash_midway():
    yield blocks[0]
    yield blocks[1]
    os.kill(os.getpid(), signal.SIGKILL)  # a real crash, half way through the save

snap.write_snapshot(dst, fields, crash_midway())
"""


def test_crashed_saves_temporaries_are_removed_at_start_up(llama_dir, tmp_path):
    sd = tmp_path / "sd"
    with new_llm(llama_dir, sd) as llm:
        s = llm.session(session_id="victim", sampling=G, system=SYSTEM)
        s.send("a long enough conversation to span several blocks " * 3)
    before = (sd / "victim.kvs").read_bytes()
    out = subprocess.run([sys.executable, "-c", CRASHING_SAVE, str(sd / "victim.kvs"),
                          str(sd / "victim.kvs")], capture_output=True, timeout=120)
    assert out.returncode == -signal.SIGKILL
    (crashed,) = [p for p in sd.iterdir() if TEMP.fullmatch(p.name)]
    old = time.time() - 120
    os.utime(crashed, (old, old))
    recent = sd / f".victim.kvs.{os.getpid()}.0123abcd.tmp"  # a save that may be running
    recent.write_bytes(b"partial")
    live = sd / f".other.kvs.{os.getpid()}.89abcdef.tmp"  # old, but its writer holds it
    live.write_bytes(b"partial")
    os.utime(live, (old, old))
    foreign = sd / ".notes.tmp"  # not ours
    foreign.write_bytes(b"keep")
    os.utime(foreign, (old, old))
    with open(live, "rb") as held:
        fcntl.flock(held.fileno(), fcntl.LOCK_EX)
        with new_llm(llama_dir, sd) as llm:
            assert not crashed.exists()
            assert recent.exists() and live.exists() and foreign.exists()
            assert llm.sessions() == ["victim"]
            assert (sd / "victim.kvs").read_bytes() == before
            assert continues_exactly(llm, llm.session(session_id="victim"))


# ---- item 12: a closed session forks nothing ---------------------------------------------

def test_fork_of_a_closed_session_creates_nothing(llama_dir, tmp_path):
    sd = tmp_path / "sd"
    with new_llm(llama_dir, sd) as llm:
        parent = llm.session(system=SYSTEM, session_id="parent", sampling=G)
        parent.send("hello")
        parent.close(delete=True)
        before = llm.stats()
        with pytest.raises(SessionClosedError, match="'parent' is closed"):
            parent.fork(session_id="child")
        with pytest.raises(SessionClosedError):
            parent.fork()
        after = llm.stats()
        assert after.num_requests == before.num_requests  # no system prompt prefill ran
        assert after.prefix.num_pins == before.prefix.num_pins == 0
        assert Internals(llm).sessions == ({}, [])
        llm.check_integrity()
    assert list(sd.iterdir()) == []  # nothing was persisted at close


# ---- cli: make-tiny-model into an invalid path -------------------------------------------

def test_make_tiny_model_into_an_invalid_path_is_one_line(tmp_path, capsys):
    not_a_dir = tmp_path / "file"
    not_a_dir.write_text("x")
    assert cli_main(["make-tiny-model", str(not_a_dir / "model")]) == 1
    err = capsys.readouterr().err
    assert err.startswith("error: ConfigError: cannot write a checkpoint") and \
        err.count("\n") == 1 and "Traceback" not in err
