"""SessionStore: the live sessions of one `LLM` and their lifecycle: creating, resuming
and restoring them (their files in session_dir, their locks), forking and closing them,
persisting them at `llm.close()`. A session's turns do not pass through here: they go one
way, through the `TurnExecutor` (kvsession/turns.py) the store hands each Session.

Persistence: with `session_dir`, every session alive at `llm.close()` is written to
`session_dir/<session_id>.kvs`; spilled-to-disk sessions live there already. At start-up
the directory is scanned; `llm.session(session_id=...)` resumes one, `llm.sessions()` lists
them. Snapshots are checked against this engine (model, tokenizer, template, kv dtype,
block size, geometry) before anything is loaded; a mismatch is a SnapshotError and leaves
the engine and every other session untouched.

A file in session_dir is the session its name says (`alice-backup.kvs` resumes as
"alice-backup", whatever id its header records); a session writes and deletes only its own
file there, and an id whose file holds another session is refused rather than overwritten.
Restored block hashes are recomputed from the tokens, never taken from the file.

Session ids are validated once, here, where they enter (`session`, `restore`, `fork`).

Ownership (durability="turn"): a live session holds its lock (`<id>.lock`, flock): a second
process asking for it gets SessionLockedError; a dead owner's lock is free by construction.

Durability (`durability="turn"`, the default with a session_dir): each turn's record goes to
the session's log (tiers/wal.py) and `commit` returns the Future that resolves once it is
fsynced (group commit, tiers/commit.py); the Session waits on it before it hands the reply
back. Resuming a session with a log replays the log (it is the truth; a snapshot next to it
is only a store of KV blocks) and attaches the KV blocks on disk that match the log's tokens
(tiers/resume.py); the first turn loads them or recomputes, by the cost model. At close a
live session is written as a snapshot as before, and its log, now redundant, is removed.
"""

from __future__ import annotations

import json
import logging
import os
import uuid
from pathlib import Path

from kvsession.cache.manager import SessionKV
from kvsession.errors import (
    ConfigError,
    EngineClosedError,
    SessionClosedError,
    SnapshotError,
)
from kvsession.history import ChatRenderer, HistoryMode, check_template_kwargs
from kvsession.model.tokenizer import Tokenizer
from kvsession.params import SamplingParams
from kvsession.runtime import Runtime
from kvsession.sampling_record import sampling_from_record
from kvsession.session import Session
from kvsession.system_pins import SystemPins
from kvsession.tiers import recovery, wal
from kvsession.tiers.commit import Op, SessionLog
from kvsession.tiers.disk import check_session_id
from kvsession.tiers.files import fsync_dir
from kvsession.tiers.locks import FileLock, NoLock, lock_session
from kvsession.tiers.resume import build_plan, open_segment, open_shared
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


class SessionStore:
    def __init__(self, runtime: Runtime):
        self.rt = runtime
        self.tokenizer: Tokenizer = runtime.tokenizer
        self.live: dict[str, Session] = {}
        self.pins = SystemPins(runtime)  # the shared system prompts
        self.turns = TurnExecutor(runtime)  # every session's turns go through it
        self._locks: dict[str, FileLock] = {}  # live sessions' ownership of their files
        self._logs: dict[str, SessionLog] = {}  # durability="turn": live sessions' logs

    # ---- creating and resuming (the API edge) ------------------------------------------------

    def session(self, system: str | None, session_id: str | None, pin_system: bool,
                sampling: SamplingParams | None, options: SessionOptions,
                fresh: bool = False) -> Session:
        """fresh: a new session under `session_id` even where crash recovery removed its
        log (the tombstone is dropped); an id with a persisted session is refused."""
        disk = self.rt.disk
        if session_id is None or disk is None or session_id in self.live:
            if session_id is not None:
                check_session_id(session_id)
            return self._new_session(session_id, system, sampling,
                                     self.pins.key(system, options.renderer)
                                     if pin_system else None, options=options)
        check_session_id(session_id)
        lock = self._lock(session_id)  # first: the files are only ours to read once held
        try:
            persisted = disk.log_path(session_id).is_file() or \
                disk.path_for(session_id).is_file()
            if fresh and persisted:
                raise ConfigError(f"fresh=True: session_id {session_id!r} names a session "
                                  f"persisted in session_dir; resume it, or close it with "
                                  f"delete=True first")
            if disk.log_path(session_id).is_file():
                return self._resume(session_id, lock, system, sampling, pin_system, options)
            if disk.path_for(session_id).is_file():
                return self.restore(disk.path_for(session_id), session_id, lock)
            if fresh:
                recovery.clear(disk.root, session_id)
            else:
                recovery.refuse_lost(disk.root, session_id)
            return self._new_session(session_id, system, sampling,
                                     self.pins.key(system, options.renderer)
                                     if pin_system else None, lock=lock, options=options)
        finally:
            if self._locks.get(session_id) is not lock:  # not handed to a live session
                lock.release()

    def options(self, history, tools, chat_template_kwargs) -> SessionOptions:
        """A new session's rendering and history mode (ConfigError naming a bad one)."""
        return SessionOptions(self._renderer(tools, chat_template_kwargs),
                              HistoryMode.parse(history))

    def _renderer(self, tools, chat_template_kwargs) -> ChatRenderer:
        """Validated tools (the template must know them) and template variables."""
        spec = ToolSpec.from_args(tools, None, self.tokenizer)
        return ChatRenderer(self.tokenizer, spec.template_tools if spec is not None else None,
                            check_template_kwargs(chat_template_kwargs))

    def _lock(self, session_id: str) -> FileLock | NoLock:
        """The session's ownership: its lock file with durability="turn"; nothing with
        "close", which keeps today's directory (snapshot files only)."""
        if self.rt.journal is None:
            return NoLock()
        return lock_session(self.rt.disk.lock_path(session_id), session_id)

    def sessions(self) -> list[str]:
        return sorted(self.rt.disk.scan()) if self.rt.disk is not None else []

    def _new_session(self, session_id: str | None, system: str | None,
                     sampling: SamplingParams | None, system_key,
                     messages: list[dict] | None = None, source: Path | None = None,
                     lock: FileLock | None = None, slog: SessionLog | None = None,
                     options: SessionOptions | None = None) -> Session:
        """session_id was validated by the caller; source: the file it is restored from;
        lock: the session's lock when the caller took it; slog: its log when resumed."""
        self.rt.check_open()
        if session_id is not None and session_id in self.live:
            raise ConfigError(f"session_id {session_id!r} is already in use by a live session")
        disk = self.rt.disk
        given = session_id is not None
        session_id = session_id if given else uuid.uuid4().hex
        if disk is not None:
            if lock is None:
                lock = self._lock(session_id)
            try:
                self._check_own_files(session_id, given, source, slog)
            except BaseException:
                lock.release()
                raise
        if self.rt.journal is None:  # durability="close": no log written (a resumed one is
            slog = None              # read once, then replaced by the snapshot at close)
        elif slog is None:  # (no file until its first record)
            slog = SessionLog(disk.log_path(session_id), session_id, self.rt.identity)
        try:
            sess = self._make_session(session_id, system, sampling, system_key, messages,
                                      options or SessionOptions(ChatRenderer(self.tokenizer)),
                                      slog)
        except BaseException:
            if lock is not None:
                lock.release()
            raise
        if lock is not None:
            self._locks[session_id] = lock
        if slog is not None:
            self._logs[session_id] = slog
        if disk is not None and given:  # what recovery cut from it, whoever did
            sess.stats.recovery = recovery.read_events(disk.root, session_id)
        self.live[sess.session_id] = sess
        return sess

    def _check_own_files(self, session_id: str, given: bool, source: Path | None,
                         slog: SessionLog | None) -> None:
        """The session would write (spill, persist, log) and may delete its files: they
        must be its own, never another session's."""
        disk = self.rt.disk
        own, own_log = disk.path_for(session_id), disk.log_path(session_id)
        resumed = slog is not None
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

    def _make_session(self, session_id: str, system: str | None,
                      sampling: SamplingParams | None, system_key,
                      messages: list[dict] | None, options: SessionOptions,
                      slog: SessionLog | None) -> Session:
        sess = Session(self, self.turns, session_id, system, sampling, messages,
                       options.history, options.renderer, options.log, options.pending, slog)
        if system_key is not None:  # stored by another process of this directory? read it
            self.pins.warm_from_directory(system_key)
        if system_key is not None and self.pins.acquire(system_key):
            sess.system_key = system_key
        try:
            self.rt.call(lambda: self.rt.policy.register(sess.kv)).result()
        except BaseException:
            self._unpin_system(sess)
            raise
        return sess

    def _resume(self, session_id: str, lock: FileLock, system: str | None,
                sampling: SamplingParams | None, pin_system: bool,
                options: SessionOptions) -> Session:
        """A session with a log: the log is the truth (replayed, a torn tail cut off, which
        the held lock makes ours to do); KV blocks on disk that match its tokens are
        attached for the first turn to load (or recompute, by the cost model)."""
        rt, disk = self.rt, self.rt.disk
        path = disk.log_path(session_id)
        scan = wal.read_log(path, expect=rt.identity, session_id=session_id)
        event = recovery.repair_log(path, session_id, scan)  # reported, and kept
        if event is not None:
            disk.recoveries.append(event)
        state = scan.state
        if state is None:  # no intact record: the snapshot is what is left, or nothing
            if disk.path_for(session_id).is_file():
                return self.restore(disk.path_for(session_id), session_id, lock)
            recovery.refuse_lost(disk.root, session_id)
        self._check_untrusted(path, state.tokens, state.system)
        try:  # values from the file: refused as the file's fault
            params = sampling_from_record(state.sampling)
            opts = self._stored_options(path, {
                "mode": state.history, "log": state.tokens, "pending": state.pending,
                "tools": state.tools, "template_kwargs": state.template_kwargs})
            system_key = self.pins.key(state.system, opts.renderer)
            messages = messages_from_text(path, state.messages)
        except ConfigError as e:
            raise SnapshotError(f"{path}: {e}") from None
        slog = SessionLog(path, session_id, rt.identity, state, scan.end)
        shared = open_shared(disk, rt.identity)
        sess = self._new_session(session_id, state.system, params, system_key, messages,
                                 lock=lock, slog=slog, options=opts)
        try:
            hashes = rt.mover.block_hashes(
                state.tokens, rt.sequences.salt_for(state.tokens, params.cache_salt))
            segment = open_segment(disk, session_id, rt.identity)
            plan = build_plan(disk, session_id, state.tokens, hashes, rt.identity,
                              segment, shared)
            if rt.writeback is not None:  # what is on disk is never written again
                if segment is not None:
                    rt.writeback.request(WriteOp.SEED, session_id, segment)
                rt.writeback.know(session_id, enumerate(plan.hashes) if plan else (), shared)
            if plan is not None:
                rt.call(lambda: rt.mover.attach_plan(sess.kv, plan)).result()
        except BaseException:
            sess.close()
            raise
        return sess

    def _stored_options(self, path: Path, history: dict | None) -> SessionOptions:
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
        self._check_untrusted(path, log, None)
        return SessionOptions(self._renderer(tools, kwargs), mode, log, history["pending"])

    def _check_untrusted(self, path: Path, token_ids, system: str | None) -> None:
        vocab, max_len = self.rt.info.spec.vocab_size, self.rt.info.max_model_len
        if any(t >= vocab for t in token_ids):
            raise SnapshotError(f"{path}: token ids outside this model's vocabulary ({vocab})")
        if len(token_ids) > max_len:  # it could never take another turn here
            raise SnapshotError(f"{path}: a session of {len(token_ids)} tokens is longer than "
                                f"this engine's max_model_len={max_len}")
        if system is not None and len(system) > SYSTEM_CHARS_PER_TOKEN * max_len:
            raise SnapshotError(f"{path}: a system prompt of {len(system)} characters "
                                f"cannot fit this engine's max_model_len={max_len}")

    def restore(self, path, session_id: str | None, lock: FileLock | None = None) -> Session:
        """The session's id: `session_id` when given; else, for a file directly in
        session_dir, the file's name (that file is the session's); else the header's id.
        Anything wrong with the file is a SnapshotError; an id in use (live, or naming
        another session's file in session_dir) a ConfigError. Either way nothing changes."""
        path = Path(path)
        if session_id is not None:
            check_session_id(session_id)
        header = read_header(path, expect=self.rt.identity)
        self._check_untrusted(path, header.token_ids, header.system)
        disk = self.rt.disk
        sid = session_id or (disk.id_of(path) if disk is not None else None) \
            or header.session_id
        if sid in self.live:
            raise ConfigError(f"session {sid!r} is live; pass restore(path, session_id=...)")
        try:  # values from the file: refused as the file's fault
            sampling = sampling_from_record(header.sampling)
            opts = self._stored_options(path, header.history)
            system_key = self.pins.key(header.system, opts.renderer)
            messages = messages_from_text(path, header.messages)
        except ConfigError as e:
            raise SnapshotError(f"{path}: {e}") from None
        # hashes are recomputed from the tokens: the file's could name other prefixes'
        # blocks and poison the shared prefix cache
        hashes = self.rt.mover.block_hashes(
            header.token_ids, self.rt.sequences.salt_for(header.token_ids, sampling.cache_salt))
        sess = self._new_session(sid, header.system, sampling, system_key, messages,
                                 source=path, lock=lock, options=opts)
        try:
            self.rt.call(lambda: self._load_snapshot(sess.kv, path, header, hashes)).result()
        except BaseException:
            sess.close()
            raise
        return sess

    def _load_snapshot(self, kv: SessionKV, path: Path, h: SnapshotHeader,
                       hashes: list[bytes]) -> None:
        """Engine thread: the snapshot's KV into device blocks (blocks already resident are
        re-referenced, not re-read). If the device is full even after spilling idle
        sessions, the file is only validated and stays the session's disk tier: its next
        turn loads or recomputes."""
        self.rt.manager.on_disk(kv, h.token_ids, hashes, path)
        self.rt.policy.restore_snapshot(kv, h)

    # ---- a session's lifecycle: forks and closes ------------------------------------------------

    def fork(self, parent: Session, session_id: str | None) -> Session:
        if session_id is not None:
            check_session_id(session_id)
        if parent.state == "closed":  # before anything is created (a child, a system pin)
            raise SessionClosedError(f"session {parent.session_id!r} is closed")
        child = self._new_session(session_id, parent.system, parent.sampling,
                                  parent.system_key, parent.messages,
                                  options=parent.options())

        def share() -> None:
            self.rt.policy.prefetch(parent.kv)  # a spilled parent comes back first
            self.rt.manager.share(parent.kv, child.kv)
            self.rt.policy.forked(parent.kv, child.kv)

        try:
            parent.exclusive(share)
        except BaseException:
            child.close()
            raise
        return child

    def close_session(self, sess: Session, delete: bool) -> None:
        """delete: also the session's own file in session_dir; never another file (the one
        it was restored from elsewhere, or another session's)."""
        self.live.pop(sess.session_id, None)
        kv = sess.kv
        stale = None
        if not self.rt.closed:
            if not delete:
                stale = self._refresh_own_file(sess)
            self.rt.call(lambda: self.rt.policy.release(kv)).result()
        try:
            self._unpin_system(sess)
            if delete and self.rt.disk is not None:
                # the snapshot first, durably, the log (the truth) last: a crash in between
                # leaves the whole session, never an older snapshot resurrected as it
                own = self.rt.disk.path_for(sess.session_id)
                try:
                    own.unlink(missing_ok=True)
                    fsync_dir(own.parent)
                    recovery.clear(own.parent, sess.session_id)
                except OSError as e:
                    raise SnapshotError(f"{own}: cannot delete: {e}") from None
            self._writeback_op(WriteOp.DELETE if delete else WriteOp.CLOSE, sess.session_id)
            slog = self._logs.pop(sess.session_id, None)
            if slog is not None:
                self._log_op(slog, Op.DELETE if delete else Op.CLOSE)
            if delete and self.rt.disk is not None and self.rt.writeback is not None:
                self.rt.disk.collect_shared()
        finally:
            lock = self._locks.pop(sess.session_id, None)
            if lock is not None:
                lock.release()
        if stale is not None:
            raise stale

    def _refresh_own_file(self, sess: Session) -> SnapshotError | None:
        """durability="close": a session closed without delete that has a file in
        session_dir (a spill wrote it, or it was resumed from it) has it rewritten with its
        current state, so that the session `llm.sessions()` lists resumes where it was
        closed, never at an older turn (with "turn" its log is always current). Returns the
        error of a write that failed (raised once the session is closed)."""
        disk = self.rt.disk
        if disk is None or self.rt.journal is not None:
            return None
        own = disk.path_for(sess.session_id)
        if not own.is_file():  # never written: nothing listed can be stale
            return None
        try:
            self.turns.call(lambda: self.turns.save(sess.kv, own)).result()
        except SnapshotError as e:
            return SnapshotError(f"{own} still holds an older state of session "
                                 f"{sess.session_id!r}: {e}")
        return None

    def _log_op(self, slog: SessionLog, op: Op) -> None:
        """Close or delete a log through the commit thread (after its queued records)."""
        try:
            self.rt.journal.submit(slog, op).result(timeout=LOG_OP_TIMEOUT_S)
        except TimeoutError:  # concurrent.futures raises the builtin (3.11+)
            raise SnapshotError(f"{slog.path}: the log was not {op.value}d within "
                                f"{LOG_OP_TIMEOUT_S:.0f} s") from None

    def _writeback_op(self, kind: WriteOp, session_id: str) -> None:
        """Close (its queued blocks written first) or delete a session's segment."""
        wb = self.rt.writeback
        if wb is None or self.rt.closed:
            return
        try:
            wb.request(kind, session_id).result(timeout=LOG_OP_TIMEOUT_S)
        except TimeoutError:
            raise SnapshotError(f"session {session_id!r}: its KV segment was not {kind.value}d "
                                f"within {LOG_OP_TIMEOUT_S:.0f} s") from None

    def _unpin_system(self, sess: Session) -> None:
        self.pins.release(sess.system_key)
        sess.system_key = None  # released once

    # ---- shutdown --------------------------------------------------------------------------

    def persist_all(self) -> None:
        """Write every live session to session_dir (the engine still runs). If some cannot
        be written, the others (safe on disk) are closed and a SnapshotError naming the
        rest is raised (`.sessions`: them); they stay live with their KV untouched, so a
        failure never loses a conversation before it is reported."""
        if self.rt.disk is None:
            return
        live = list(self.live.values())
        persisted, failed = [], []
        for sess in live:
            try:
                self._persist(sess)
                persisted.append(sess)
            except EngineClosedError as e:  # the engine died: it cannot write them
                failed.append((sess, e))
            except SessionClosedError:  # closed meanwhile: nothing left to persist
                continue
            except Exception as e:  # the session is kept, and named below
                failed.append((sess, e))
        if not failed:
            return
        for sess in persisted:
            sess.close()
        err = SnapshotError(
            f"{len(failed)} of {len(live)} sessions could not be persisted to "
            f"{self.rt.disk.root} and are still open with their KV: "
            + "; ".join(f"{s.session_id} ({e})" for s, e in failed)
            + ". Free space (or fix the directory) and close() again, save them elsewhere "
              "(session.save(path)), or close them (session.close()) to give them up")
        err.sessions = [s for s, _ in failed]
        raise err

    def _persist(self, sess: Session) -> None:
        """Write a live session's snapshot at close. With a log, the snapshot then holds
        everything the log does, and segment and log are removed: the write-behind is
        drained first (a compaction it has queued must not replace the snapshot)."""
        slog = self._logs.get(sess.session_id)
        if slog is not None:
            self._writeback_op(WriteOp.CLOSE, sess.session_id)
        sess.save_sealed(self.rt.disk.path_for(sess.session_id))
        if slog is not None:  # the snapshot is durable: segment and log are redundant
            self._writeback_op(WriteOp.DELETE, sess.session_id)
            self._log_op(slog, Op.DELETE)
            self._logs.pop(sess.session_id, None)
        elif (old := self.rt.disk.log_path(sess.session_id)).exists():
            # durability="close" resumed it from a log an earlier process left: the
            # snapshot holds it all now, and the log (read first, as the truth) would
            # hide this process's turns
            try:
                old.unlink()
                fsync_dir(old.parent)
            except OSError as e:
                raise SnapshotError(f"{old}: cannot remove: {e}") from None

    def close_all(self) -> None:
        for sess in list(self.live.values()):
            sess.mark_closed()
            try:
                self._writeback_op(WriteOp.CLOSE, sess.session_id)
            except SnapshotError as e:
                log.warning("%s", e)
        for slog in list(self._logs.values()):
            try:
                self._log_op(slog, Op.CLOSE)
            except SnapshotError as e:
                log.warning("%s", e)
        self._logs.clear()
        for lock in self._locks.values():
            lock.release()
        self._locks.clear()
        if self.rt.writeback is not None:  # no session left to use it: removed
            self.rt.disk.collect_shared()


def _same_file(a: Path, b: Path) -> bool:
    try:
        return os.path.samefile(a, b)
    except OSError:  # one of them does not exist (or cannot be looked at)
        return False

