"""The files of an `LLM`'s sessions in `session_dir`: who owns them (a lock per live
session with durability="turn"), what a persisted session is (its log replayed, or a
snapshot's header: untrusted input, validated before anything is built), how its KV on
disk comes back (a `DiskPlan` for a resumed log, a snapshot load), and what closing and
persisting do to them. The `SessionStore` keeps the registry of live sessions and builds
them from what this reads; nothing here holds a Session.

A file in session_dir is the session its name says; a session writes and deletes only its
own files there (`check_own_files`), and an id whose file holds another session is
refused rather than overwritten. Block hashes are recomputed from the tokens, never taken
from a file.
"""

from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass
from pathlib import Path

from kvsession.cache.manager import SessionKV
from kvsession.errors import ConfigError, SnapshotError
from kvsession.history import ChatRenderer, HistoryMode, check_template_kwargs
from kvsession.model.tokenizer import Tokenizer
from kvsession.params import SamplingParams
from kvsession.runtime import Runtime
from kvsession.sampling_record import sampling_from_record
from kvsession.tiers import recovery, wal
from kvsession.tiers.commit import Op, SessionLog
from kvsession.tiers.disk import check_session_id
from kvsession.tiers.files import fsync_dir
from kvsession.tiers.locks import FileLock, NoLock, lock_session
from kvsession.tiers.resume import build_plan, open_segment, open_shared
from kvsession.tiers.segments import SegmentScan
from kvsession.tiers.snapshot import messages_from_text
from kvsession.tiers.snapshot_format import SnapshotHeader
from kvsession.tiers.snapshot_read import read_header
from kvsession.tiers.writeback import WriteOp
from kvsession.tools import ToolSpec
from kvsession.turns import SessionOptions, TurnExecutor

log = logging.getLogger("kvsession")
# restore tokenizes a snapshot's system prompt (to share its pinned blocks); longer than this
# many characters per token of max_model_len it could not fit a turn with any real
# tokenizer, and is refused before it costs the tokenizer's time and memory
SYSTEM_CHARS_PER_TOKEN = 64
# bound on waiting for the commit thread to close or delete a session's log
LOG_OP_TIMEOUT_S = 60.0


def session_renderer(tokenizer: Tokenizer, tools, chat_template_kwargs) -> ChatRenderer:
    """A session's rendering: validated tools (the template must know them) and template
    variables (ConfigError naming a bad one)."""
    spec = ToolSpec.from_args(tools, None, tokenizer)
    return ChatRenderer(tokenizer, spec.template_tools if spec is not None else None,
                        check_template_kwargs(chat_template_kwargs))


@dataclass
class StoredSession:
    """A persisted session as its files say, validated: what a live Session is built from.
    `log`: the session's log when it was resumed from one (its writer, positioned after
    the last intact record); `header` / `source`: the snapshot it is restored from;
    `shared`: the directory's shared prefix store as it was read."""

    system: str | None
    sampling: SamplingParams
    messages: list[dict]
    options: SessionOptions
    tokens: list[int]
    log: SessionLog | None = None
    header: SnapshotHeader | None = None
    source: Path | None = None
    hashes: list[bytes] | None = None  # the snapshot's blocks', recomputed from its tokens
    shared: SegmentScan | None = None


class SessionFiles:
    def __init__(self, runtime: Runtime, turns: TurnExecutor):
        self.rt, self.turns = runtime, turns
        self.tokenizer: Tokenizer = runtime.tokenizer
        self._locks: dict[str, FileLock] = {}  # live sessions' ownership of their files
        self._logs: dict[str, SessionLog] = {}  # durability="turn": live sessions' logs

    # ---- ownership -------------------------------------------------------------------------

    def lock(self, session_id: str) -> FileLock | NoLock:
        """The session's ownership: its lock file with durability="turn"; nothing with
        "close", which keeps today's directory (snapshot files only)."""
        if self.rt.journal is None:
            return NoLock()
        return lock_session(self.rt.disk.lock_path(session_id), session_id)

    def owns(self, session_id: str, lock) -> bool:
        """Whether `lock` is the one a live session holds (else its taker releases it)."""
        return self._locks.get(session_id) is lock

    def check_own_files(self, session_id: str, given: bool, source: Path | None,
                        resumed: bool) -> None:
        """The session would write (spill, persist, log) and may delete its files: they
        must be its own, never another session's."""
        disk = self.rt.disk
        own, own_log = disk.path_for(session_id), disk.log_path(session_id)
        taken = None
        if os.path.lexists(own) and not resumed and not (
                source is not None and _same_file(source, own)):
            taken = own
        elif os.path.lexists(own_log) and not resumed:
            taken = own_log
        if taken is not None:
            what = "session_id" if given else "a fresh session id"
            raise ConfigError(
                f"{what} {session_id!r} is taken in session_dir: {taken} is another "
                f"session's file (resume it with llm.session(session_id="
                f"{session_id!r})); choose another session_id")

    def log_writer(self, session_id: str, resumed: SessionLog | None) -> SessionLog | None:
        """The log a new live session writes its turns to: the one it was resumed from, or
        a new one (no file until its first record); None with durability="close" (a log
        an earlier process left is read once, then replaced by the snapshot at close)."""
        if self.rt.journal is None:
            return None
        return resumed or SessionLog(self.rt.disk.log_path(session_id), session_id,
                                     self.rt.identity)

    def adopt(self, session_id: str, lock, slog: SessionLog | None) -> None:
        """A live session's lock and log, held from now until it closes."""
        if lock is not None:
            self._locks[session_id] = lock
        if slog is not None:
            self._logs[session_id] = slog

    # ---- reading a persisted session (untrusted) ---------------------------------------------

    def read_log(self, session_id: str) -> StoredSession | None:
        """A session with a log: the log is the truth (replayed, a torn tail cut off and
        reported, which the held lock makes ours to do). None when no intact record is
        left (the snapshot is then what is left of it, or SessionLostError)."""
        rt, disk = self.rt, self.rt.disk
        path = disk.log_path(session_id)
        scan = wal.read_log(path, expect=rt.identity, session_id=session_id)
        event = recovery.repair_log(path, session_id, scan)  # reported, and kept
        if event is not None:
            disk.recoveries.append(event)
        state = scan.state
        if state is None:
            return None
        self.check_untrusted(path, state.tokens, state.system)
        try:  # values from the file: refused as the file's fault
            params = sampling_from_record(state.sampling)
            opts = self.stored_options(path, {
                "mode": state.history, "log": state.tokens, "pending": state.pending,
                "tools": state.tools, "template_kwargs": state.template_kwargs})
            messages = messages_from_text(path, state.messages)
        except ConfigError as e:
            raise SnapshotError(f"{path}: {e}") from None
        return StoredSession(state.system, params, messages, opts, state.tokens,
                             log=SessionLog(path, session_id, rt.identity, state, scan.end),
                             shared=open_shared(disk, rt.identity))

    def read_snapshot(self, path: Path) -> StoredSession:
        """A snapshot file's session (its header read and validated, no KV yet). Its block
        hashes are recomputed from the tokens: the file's could name other prefixes'
        blocks and poison the shared prefix cache."""
        rt = self.rt
        header = read_header(path, expect=rt.identity)
        self.check_untrusted(path, header.token_ids, header.system)
        try:  # values from the file: refused as the file's fault
            sampling = sampling_from_record(header.sampling)
            opts = self.stored_options(path, header.history)
            messages = messages_from_text(path, header.messages)
        except ConfigError as e:
            raise SnapshotError(f"{path}: {e}") from None
        hashes = rt.mover.block_hashes(
            header.token_ids, rt.sequences.salt_for(header.token_ids, sampling.cache_salt))
        return StoredSession(header.system, sampling, messages, opts, header.token_ids,
                             header=header, source=path, hashes=hashes)

    def stored_options(self, path: Path, history: dict | None) -> SessionOptions:
        """A snapshot's or log's history (None: written before it existed, template mode);
        ConfigError for values this engine refuses (the caller makes it the file's
        SnapshotError)."""
        if history is None:
            return SessionOptions(ChatRenderer(self.tokenizer), HistoryMode.TEMPLATE)
        try:
            tools = json.loads(history["tools"]) if history["tools"] else None
            kwargs = json.loads(history["template_kwargs"]) if history["template_kwargs"] \
                else None
        except ValueError as e:
            raise ConfigError(f"malformed tools or chat_template_kwargs: {e}") from None
        mode = HistoryMode.parse(history["mode"])
        log = tuple(history["log"]) if mode is HistoryMode.APPEND else ()
        self.check_untrusted(path, log, None)
        return SessionOptions(session_renderer(self.tokenizer, tools, kwargs), mode, log,
                              history["pending"])

    def check_untrusted(self, path: Path, token_ids, system: str | None) -> None:
        vocab, max_len = self.rt.info.spec.vocab_size, self.rt.info.max_model_len
        if any(t >= vocab for t in token_ids):
            raise SnapshotError(f"{path}: token ids outside this model's vocabulary ({vocab})")
        if len(token_ids) > max_len:  # it could never take another turn here
            raise SnapshotError(f"{path}: a session of {len(token_ids)} tokens is longer than "
                                f"this engine's max_model_len={max_len}")
        if system is not None and len(system) > SYSTEM_CHARS_PER_TOKEN * max_len:
            raise SnapshotError(f"{path}: a system prompt of {len(system)} characters "
                                f"cannot fit this engine's max_model_len={max_len}")

    # ---- bringing its KV back ----------------------------------------------------------------

    def attach_from_disk(self, kv: SessionKV, session_id: str, stored: StoredSession) -> None:
        """A resumed session's KV blocks on disk that match its log's tokens are attached
        for its first turn to load (or recompute, by the cost model); the write-behind is
        told what is on disk already (never written again)."""
        rt, disk = self.rt, self.rt.disk
        hashes = rt.mover.block_hashes(
            stored.tokens, rt.sequences.salt_for(stored.tokens, stored.sampling.cache_salt))
        segment = open_segment(disk, session_id, rt.identity)
        plan = build_plan(disk, session_id, stored.tokens, hashes, rt.identity, segment,
                          stored.shared)
        if rt.writeback is not None:
            if segment is not None:
                rt.writeback.request(WriteOp.SEED, session_id, segment)
            rt.writeback.know(session_id, enumerate(plan.hashes) if plan else (),
                              stored.shared)
        if plan is not None:
            rt.call(lambda: rt.mover.attach_plan(kv, plan)).result()

    def load_snapshot(self, kv: SessionKV, stored: StoredSession) -> None:
        """A restored session's KV into device blocks (blocks already resident are
        re-referenced, not re-read). If the device is full even after spilling idle
        sessions, the file is only validated and stays the session's disk tier: its next
        turn loads or recomputes."""
        rt, h = self.rt, stored.header

        def load() -> None:  # engine thread
            rt.manager.on_disk(kv, h.token_ids, stored.hashes, stored.source)
            rt.policy.restore_snapshot(kv, h)

        rt.call(load).result()

    # ---- closing and persisting ---------------------------------------------------------------

    def refresh_own_file(self, session_id: str, kv: SessionKV) -> SnapshotError | None:
        """durability="close": a session closed without delete that has a file in
        session_dir (a spill wrote it, or it was resumed from it) has it rewritten with its
        current state, so that the session `llm.sessions()` lists resumes where it was
        closed, never at an older turn (with "turn" its log is always current). Returns the
        error of a write that failed (raised once the session is closed)."""
        disk = self.rt.disk
        if disk is None or self.rt.journal is not None:
            return None
        own = disk.path_for(session_id)
        if not own.is_file():  # never written: nothing listed can be stale
            return None
        try:
            self.turns.call(lambda: self.turns.save(kv, own)).result()
        except SnapshotError as e:
            return SnapshotError(f"{own} still holds an older state of session "
                                 f"{session_id!r}: {e}")
        return None

    def close(self, session_id: str, delete: bool) -> None:
        """A session closed: its files closed, or (delete) removed, the snapshot first and
        durably, the log (the truth) last: a crash in between leaves the whole session,
        never an older snapshot resurrected as it; its lock released in any case."""
        disk = self.rt.disk
        try:
            if delete and disk is not None:
                own = disk.path_for(session_id)
                try:
                    own.unlink(missing_ok=True)
                    fsync_dir(own.parent)
                    recovery.clear(own.parent, session_id)
                except OSError as e:
                    raise SnapshotError(f"{own}: cannot delete: {e}") from None
            self.writeback_op(WriteOp.DELETE if delete else WriteOp.CLOSE, session_id)
            slog = self._logs.pop(session_id, None)
            if slog is not None:
                self.log_op(slog, Op.DELETE if delete else Op.CLOSE)
            if delete and disk is not None and self.rt.writeback is not None:
                disk.collect_shared()
            if self.rt.mirror is not None and disk is not None:
                self.rt.mirror.sync(disk.root, session_id)  # the store as the files are
        finally:
            lock = self._locks.pop(session_id, None)
            if lock is not None:
                lock.release()

    # ---- session_dir in an object store (tiers/session_mirror.py) --------------------------

    def fetch_newer(self, session_id: str) -> None:
        """A session about to be resumed or created: its files fetched from the store where
        they differ from the ones here (another machine had it since; the caller holds its
        lock)."""
        disk, mirror = self.rt.disk, self.rt.mirror
        if mirror is None:
            return
        if mirror.fetch(disk.root, session_id):
            log.info("session %s: fetched from %s", session_id, mirror.url)

    def stored_elsewhere(self) -> set[str]:
        """The sessions the store holds (none without one)."""
        if self.rt.mirror is None:
            return set()
        ids = set()
        for sid in self.rt.mirror.session_ids():
            try:
                ids.add(check_session_id(sid))
            except ConfigError:
                continue  # not a session's name
        return ids

    def mirror_snapshot(self, session_id: str) -> None:
        """The session's snapshot, just written here, put in the store."""
        if self.rt.mirror is not None:
            self.rt.mirror.put(self.rt.disk.path_for(session_id))

    def before_persist(self, session_id: str) -> None:
        """Before a live session's snapshot is written at close: with a log, the
        write-behind is drained first (a compaction it has queued must not replace the
        snapshot)."""
        if session_id in self._logs:
            self.writeback_op(WriteOp.CLOSE, session_id)

    def after_persist(self, session_id: str) -> None:
        """The session's snapshot is durable: it holds everything its log does, so segment
        and log are removed. durability="close" may have resumed it from a log an earlier
        process left: removed too (read first, as the truth, it would hide this process's
        turns)."""
        slog = self._logs.pop(session_id, None)
        if slog is not None:
            self.writeback_op(WriteOp.DELETE, session_id)
            self.log_op(slog, Op.DELETE)
        elif (old := self.rt.disk.log_path(session_id)).exists():
            try:
                old.unlink()
                fsync_dir(old.parent)
            except OSError as e:
                raise SnapshotError(f"{old}: cannot remove: {e}") from None

    def close_all(self, session_ids: list[str]) -> list[SnapshotError]:
        """The LLM is closing: every live session's segment and log closed (errors
        returned, to be logged), every lock released, the shared prefix store removed once
        no session uses it."""
        errors = []
        for sid in session_ids:
            try:
                self.writeback_op(WriteOp.CLOSE, sid)
            except SnapshotError as e:
                errors.append(e)
        for slog in list(self._logs.values()):
            try:
                self.log_op(slog, Op.CLOSE)
            except SnapshotError as e:
                errors.append(e)
        self._logs.clear()
        for lock in self._locks.values():
            lock.release()
        self._locks.clear()
        if self.rt.writeback is not None:  # no session left to use it: removed
            self.rt.disk.collect_shared()
        return errors

    def log_op(self, slog: SessionLog, op: Op) -> None:
        """Close or delete a log through the commit thread (after its queued records)."""
        try:
            self.rt.journal.submit(slog, op).result(timeout=LOG_OP_TIMEOUT_S)
        except TimeoutError:  # concurrent.futures raises the builtin (3.11+)
            raise SnapshotError(f"{slog.path}: the log was not {op.value}d within "
                                f"{LOG_OP_TIMEOUT_S:.0f} s") from None

    def writeback_op(self, kind: WriteOp, session_id: str) -> None:
        """Close (its queued blocks written first) or delete a session's segment."""
        wb = self.rt.writeback
        if wb is None or self.rt.closed:
            return
        try:
            wb.request(kind, session_id).result(timeout=LOG_OP_TIMEOUT_S)
        except TimeoutError:
            raise SnapshotError(f"session {session_id!r}: its KV segment was not {kind.value}d "
                                f"within {LOG_OP_TIMEOUT_S:.0f} s") from None


def _same_file(a: Path, b: Path) -> bool:
    try:
        return os.path.samefile(a, b)
    except OSError:  # one of them does not exist (or cannot be looked at)
        return False
