"""Group commit of session log records (kvsession/tiers/wal.py has the format).

One commit thread serves every session of an `LLM`. Callers hand it framed records and
wait on a Future; the thread takes everything queued at once (a batch), writes each record
to its session's log, then makes the batch durable with the fdatasyncs of all the files it
touched issued *together* (a small pool of sync workers), so the file system commits them
in one journal transaction: 8 sessions finishing a turn together pay about one fsync, not
eight (measured on ext4: one fdatasync 1.9 ms, eight in a row 10 ms, eight at once 1.2 ms).
"Together" is made exact: when a turn ends, the engine thread announces its record
(`expect`), and a batch waits, briefly (GATHER_S), for every announced record, so the
records of turns that ended in one engine step share a batch however their callers'
threads are scheduled.
Only then are the futures resolved: a caller's record is durable when its future is.

Ordering: the records of one session are submitted in its turn order and written in
submission order. A new log is created (and its directory entry made durable with a
directory fsync, once per batch); a log that grew past a bound is rewritten as one base
record (temporary file, fsync, rename over the log, directory fsync), which is also how a
log recovers from a failed write: a write or sync that fails cuts the file back to its last
durable length and marks the log so that its next record is a full rewrite.
"""

from __future__ import annotations

import contextlib
import enum
import logging
import os
import threading
import time
import uuid
from concurrent.futures import Future, InvalidStateError, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from kvsession.cache.identity import StorageIdentity
from kvsession.cache.prefix import common_prefix_len
from kvsession.errors import SnapshotError
from kvsession.tiers.files import fcntl, fsync_dir
from kvsession.tiers.snapshot import check_text_messages
from kvsession.tiers.wal import (
    LOG_PREFIX,
    Identity,
    LogState,
    base_record,
    encode,
    history_struct,
    remove_quietly,
    sampling_struct,
    turn_record,
)

log = logging.getLogger("kvsession")
# a log holding more than this many records, or bytes, is rewritten as one base record
REWRITE_RECORDS = 256
REWRITE_BYTES = 4 << 20
SYNC_WORKERS = 8
# a batch waits at most this long for records announced (GroupCommit.expect) but not yet
# submitted: sessions whose turns end in one engine step then share one fsync, though
# their callers' threads submit one after another (in the agent benchmark they arrived
# far enough apart that 48 records took 39-44 batches)
GATHER_S = 0.005
# an announcement whose record never came (the caller failed after its turn) is forgotten
EXPECT_TTL_S = 1.0
# how long the commit thread's close waits for queued work (every wait is bounded)
CLOSE_TIMEOUT_S = 60.0


class Op(enum.Enum):
    APPEND = "append"      # a turn record after the durable end
    REWRITE = "rewrite"    # the whole state as one base record, atomically
    DELETE = "delete"      # the session is gone (close(delete=True), or persisted as a snapshot)
    CLOSE = "close"        # release the file descriptor


class SessionLog:
    """The writing side of one session's log. The session's owner (its lock holder) builds
    records in the caller's thread, in turn order; the commit thread does the I/O (`fd`,
    `end`, `durable` are its)."""

    def __init__(self, path: Path, session_id: str, identity: StorageIdentity | Identity,
                 state: LogState | None = None, end: int = 0):
        self.path, self.session_id = Path(path), session_id
        self.identity = Identity.of(identity)
        self.fd: int | None = None
        # caller side: what the records submitted so far say
        self.seq = state.seq if state is not None else 0
        self.tokens: tuple[int, ...] = tuple(state.tokens) if state is not None else ()
        self.num_messages = len(state.messages) if state is not None else 0
        self.records = state.num_records if state is not None else 0
        self.size = end
        # the next record must be a whole rewrite: no log yet, or a write failed
        self.needs_base = state is None
        # records handed to the commit thread, and those it finished (each counter has one
        # writer): while one is unresolved, the next record is a whole rewrite, since a
        # delta on top of it would follow a record that may yet fail (an asend cancelled
        # while it waits for durability lets the next turn in)
        self.submitted = 0
        self.finished = 0
        # commit thread side
        self.end = end  # bytes known durable

    def record(self, messages: list[dict], tokens, sampling: dict, system: str | None,
               defaults: dict, history: dict | None = None) -> tuple[Op, bytes]:
        """The next record: the session's state after a turn (`messages`: all of them,
        `tokens`: its token log in append history, else the token ids whose KV it holds;
        `sampling`: the turn's parameters, `defaults`: the session's; `history`:
        HistoryState's fields but the log, which `tokens` is). Caller's thread, in turn
        order."""
        seq = self.seq + 1  # taken only once the record is built: a gap in the sequence
        # numbers reads as a corrupt log, which would lose every turn of the session
        base = self.needs_base or self.records >= REWRITE_RECORDS or \
            self.size >= REWRITE_BYTES or self.submitted != self.finished
        try:
            check_text_messages(self.path, messages)
            hist = history_struct(self.path, {**(history or {"mode": "template"}), "log": []})
            if base:
                data = LOG_PREFIX + encode(base_record(
                    self.session_id, seq, self.identity, system,
                    sampling_struct(self.path, defaults), messages, tokens, hist))
            else:
                keep = common_prefix_len(self.tokens, tokens)
                data = encode(turn_record(seq, self.identity, messages[self.num_messages:],
                                          keep, tokens[keep:],
                                          sampling_struct(self.path, sampling), hist.pending))
        except Exception as e:  # nothing written: the next record rewrites the whole state
            self.needs_base = True
            if isinstance(e, SnapshotError):
                raise
            raise SnapshotError(f"{self.path}: the turn's record could not be encoded "
                                f"({type(e).__name__}: {e})") from e
        self.seq = seq
        if base:
            op = Op.REWRITE
            self.records, self.size, self.needs_base = 1, len(data), False
        else:
            op = Op.APPEND
            self.records += 1
            self.size += len(data)
        self.tokens, self.num_messages = tuple(tokens), len(messages)
        return op, data


@dataclass
class _Request:
    log: SessionLog
    op: Op
    data: bytes
    future: Future
    tmp: Path | None = None
    fd: int | None = None  # the descriptor to sync (the log's, or a rewrite's temporary)
    error: BaseException | None = None


class LogMirror(Protocol):
    """Where logs are copied once durable here (tiers/session_mirror.py: an object store),
    before their turns are acknowledged."""

    def logs_changed(self, written: list[Path], deleted: list[Path]) -> None: ...


class GroupCommit:
    """The commit thread (see the module docstring)."""

    def __init__(self, root: Path, mirror: LogMirror | None = None):
        """mirror: told of every batch's logs written and deleted, after the batch is
        durable and before its futures resolve (bounded by the mirror)."""
        self.root, self.mirror = Path(root), mirror
        self._cv = threading.Condition()
        self._pending: list[_Request] = []
        self._expected: dict[SessionLog, float] = {}  # announced records -> when forgotten
        self.gather_s, self.expect_ttl_s = GATHER_S, EXPECT_TTL_S
        self._closing = False
        self._sync = ThreadPoolExecutor(SYNC_WORKERS, thread_name_prefix="kvsession-fsync")
        # counters (read by stats and the benchmark)
        self.batches = self.records = self.fsyncs = self.dir_fsyncs = 0
        self.commit_s = 0.0  # time spent in batches: what waiting turns wait for
        self.cpu_s = 0.0  # the commit thread's CPU time in them (the rest is I/O waits)
        self._thread = threading.Thread(target=self._run, name="kvsession-commit",
                                        daemon=True)
        self._thread.start()

    def expect(self, slog: SessionLog) -> None:
        """A turn of `slog`'s session has ended (engine thread): its record follows from
        the caller's thread. The batch being gathered waits for it (at most gather_s)."""
        with self._cv:
            self._expected[slog] = time.monotonic() + self.expect_ttl_s

    def submit(self, slog: SessionLog, op: Op, data: bytes = b"") -> Future:
        fut: Future = Future()
        with self._cv:
            self._expected.pop(slog, None)
            if self._closing:
                fut.set_exception(SnapshotError("the session log is closed"))
                return fut
            self._pending.append(_Request(slog, op, data, fut))
            if op in (Op.APPEND, Op.REWRITE):
                slog.submitted += 1
            self._cv.notify()
        return fut

    def close(self) -> None:
        """Finish what is queued (bounded), then stop the thread."""
        with self._cv:
            self._closing = True
            self._cv.notify()
        self._thread.join(CLOSE_TIMEOUT_S)
        self._sync.shutdown(wait=False)

    # ---- the commit thread -------------------------------------------------------------

    def _run(self) -> None:
        while True:
            with self._cv:
                while not self._pending and not self._closing:
                    self._cv.wait()
                deadline = time.monotonic() + self.gather_s
                while self._awaited() and not self._closing:  # turns that ended with these
                    now = time.monotonic()
                    if now >= deadline:
                        break
                    self._cv.wait(min(deadline, *self._expected.values()) - now)
                batch, self._pending = _one_per_log(self._pending)
                if not batch and self._closing:
                    return
            self._commit(batch)

    def _awaited(self) -> bool:
        """Records announced and not submitted yet (the lock held); expired ones dropped."""
        now = time.monotonic()
        for slog in [x for x, until in self._expected.items() if until <= now]:
            del self._expected[slog]
        return bool(self._expected)

    def _commit(self, batch: list[_Request]) -> None:
        t0, cpu = time.perf_counter(), time.thread_time()
        try:
            self._commit_batch(batch)
        finally:
            self.commit_s += time.perf_counter() - t0
            self.cpu_s += time.thread_time() - cpu

    def _commit_batch(self, batch: list[_Request]) -> None:
        self.batches += 1
        dir_sync = False
        for r in batch:  # writes, in submission order
            try:
                dir_sync |= self._write(r)
            except BaseException as e:
                r.error = e
        syncs = [r for r in batch if r.error is None and r.fd is not None]
        fds = [r.fd for r in syncs]
        results = [_sync_one(fds[0])] if len(fds) == 1 else list(self._sync.map(_sync_one, fds))
        self.fsyncs += len(syncs)
        for r, err in zip(syncs, results, strict=True):
            r.error = err
        for r in batch:  # renames of rewrites, once their content is durable
            if r.op is Op.REWRITE and r.error is None:
                try:
                    self._install(r)
                except BaseException as e:
                    r.error = e
        if dir_sync and any(r.error is None for r in batch):
            try:
                fsync_dir(self.root)
                self.dir_fsyncs += 1
            except OSError as e:
                for r in batch:
                    if r.op in (Op.REWRITE, Op.DELETE) and r.error is None:
                        r.error = e
        if self.mirror is not None:
            done = [r for r in batch if r.error is None]
            self.mirror.logs_changed(
                [r.log.path for r in done if r.op in (Op.APPEND, Op.REWRITE)],
                [r.log.path for r in done if r.op is Op.DELETE])
        for r in batch:
            self._finish(r)

    def _write(self, r: _Request) -> bool:
        """The write part of a request; True when the directory must be synced."""
        slog = r.log
        if r.op is Op.APPEND:
            if slog.fd is None:  # resumed log: opened for appending on first use
                slog.fd = os.open(slog.path, os.O_WRONLY | getattr(os, "O_CLOEXEC", 0))
            _write_all(slog.fd, r.data, slog.end)
            r.fd = slog.fd
            return False
        if r.op is Op.REWRITE:
            r.tmp = slog.path.with_name(
                f".{slog.path.name}.{os.getpid()}.{uuid.uuid4().hex[:8]}.tmp")
            r.fd = os.open(r.tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL
                           | getattr(os, "O_CLOEXEC", 0), 0o644)
            if fcntl is not None:  # live: the start-up scan leaves a locked temporary alone
                fcntl.flock(r.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            _write_all(r.fd, r.data, 0)
            return True
        if r.op is Op.DELETE:
            self._close_fd(slog)
            remove_quietly(slog.path)
            return True
        self._close_fd(slog)  # Op.CLOSE
        return False

    def _install(self, r: _Request) -> None:
        slog = r.log
        os.replace(r.tmp, slog.path)
        r.tmp = None
        self._close_fd(slog)
        slog.fd, r.fd = r.fd, None  # the new file, positioned for appends at its end
        slog.end = len(r.data)

    def _finish(self, r: _Request) -> None:
        slog = r.log
        if r.op in (Op.APPEND, Op.REWRITE):
            slog.finished += 1
        if r.error is None:
            if r.op is Op.APPEND:
                slog.end += len(r.data)
            self.records += r.op in (Op.APPEND, Op.REWRITE)
            _resolve(r.future)
            return
        if r.op in (Op.APPEND, Op.REWRITE):
            slog.needs_base = True  # whatever reached the file, the next record rewrites it
            if r.op is Op.APPEND and slog.fd is not None:
                with contextlib.suppress(OSError):
                    os.ftruncate(slog.fd, slog.end)
        if r.tmp is not None:
            with contextlib.suppress(OSError):
                os.close(r.fd)
            remove_quietly(r.tmp)
        _resolve(r.future, SnapshotError(f"{slog.path}: the turn could not be made durable: "
                                         f"{r.error}"))

    @staticmethod
    def _close_fd(slog: SessionLog) -> None:
        fd, slog.fd = slog.fd, None
        if fd is not None:
            with contextlib.suppress(OSError):
                os.close(fd)


def _sync_one(fd: int) -> BaseException | None:
    try:
        os.fdatasync(fd)
        return None
    except OSError as e:
        return e


def _write_all(fd: int, data: bytes, offset: int) -> None:
    """pwrite everything at `offset` (a short write is continued, an error raised)."""
    view = memoryview(data)
    while view:
        n = os.pwrite(fd, view, offset)
        if n <= 0:
            raise OSError("short write")
        view, offset = view[n:], offset + n


def _one_per_log(pending: list[_Request]) -> tuple[list[_Request], list[_Request]]:
    """(a batch, what waits for the next): at most one request per session log in a batch,
    in submission order. A batch appends at the offset known durable before it and
    installs rewrites after its fsyncs, so a second record of one log in it would be
    written over the first, or into the file a rewrite then replaces. (A session's turn
    waits for its record before the next turn; a waiter that stopped waiting does not.)"""
    batch, later, seen = [], [], set()
    for r in pending:
        (later if r.log in seen else batch).append(r)
        seen.add(r.log)
    return batch, later


def _resolve(fut: Future, exc: BaseException | None = None) -> None:
    """Settle a record's Future unless its waiter cancelled it (an `asend` task cancelled
    during its durability wait): setting a cancelled Future raises, which would end the
    commit thread and leave every later turn of every session undurable."""
    with contextlib.suppress(InvalidStateError):
        if exc is None:
            fut.set_result(None)
        else:
            fut.set_exception(exc)
