"""SessionStore: the registry of one `LLM`'s live sessions and their lifecycle: creating,
resuming and restoring them, forking and closing them, persisting them at `llm.close()`.
What their files in session_dir say, who owns them and what closing does to them is
`SessionFiles` (kvsession/session_files.py); a session's turns do not pass through here:
they go one way, through the `TurnExecutor` (kvsession/turns.py) each Session is given.

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
the session's log (tiers/wal.py) through `TurnExecutor.commit`, whose Future resolves once
it is fsynced (group commit, tiers/commit.py); the Session waits on it before it hands the reply
back. Resuming a session with a log replays the log (it is the truth; a snapshot next to it
is only a store of KV blocks) and attaches the KV blocks on disk that match the log's tokens
(tiers/resume.py); the first turn loads them or recomputes, by the cost model. At close a
live session is written as a snapshot as before, and its log, now redundant, is removed.
"""

from __future__ import annotations

import logging
import uuid
from pathlib import Path

from kvsession.cache.manager import SessionKV
from kvsession.errors import (
    ConfigError,
    EngineClosedError,
    SessionClosedError,
    SnapshotError,
)
from kvsession.history import ChatRenderer, HistoryMode
from kvsession.model.tokenizer import Tokenizer
from kvsession.params import SamplingParams
from kvsession.runtime import Runtime
from kvsession.session import Session
from kvsession.session_files import SessionFiles, StoredSession, session_renderer
from kvsession.system_pins import SystemPins
from kvsession.tiers import recovery
from kvsession.tiers.commit import SessionLog
from kvsession.tiers.disk import check_session_id
from kvsession.tiers.locks import FileLock
from kvsession.turns import ForkPoint, SessionOptions, TurnExecutor

log = logging.getLogger("kvsession")


class SessionStore:
    def __init__(self, runtime: Runtime):
        self.rt = runtime
        self.tokenizer: Tokenizer = runtime.tokenizer
        self.live: dict[str, Session] = {}
        self.pins = SystemPins(runtime)  # the shared system prompts
        self.turns = TurnExecutor(runtime)  # every session's turns go through it
        self.files = SessionFiles(runtime, self.turns)  # their files in session_dir

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
        lock = self.files.lock(session_id)  # first: the files are only ours to read once held
        try:
            self.files.fetch_newer(session_id)  # from the store session_dir names, if one
            has_log = disk.log_path(session_id).is_file()
            has_snapshot = disk.path_for(session_id).is_file()
            if fresh and (has_log or has_snapshot):
                raise ConfigError(f"fresh=True: session_id {session_id!r} names a session "
                                  f"persisted in session_dir; resume it, or close it with "
                                  f"delete=True first")
            if has_log:
                return self._resume(session_id, lock)
            if has_snapshot:
                return self.restore(disk.path_for(session_id), session_id, lock)
            if fresh:
                recovery.clear(disk.root, session_id)
            else:
                recovery.refuse_lost(disk.root, session_id)
            return self._new_session(session_id, system, sampling,
                                     self.pins.key(system, options.renderer)
                                     if pin_system else None, lock=lock, options=options)
        finally:
            if not self.files.owns(session_id, lock):  # not handed to a live session
                lock.release()

    def options(self, history, tools, chat_template_kwargs) -> SessionOptions:
        """A new session's rendering and history mode (ConfigError naming a bad one)."""
        return SessionOptions(session_renderer(self.tokenizer, tools, chat_template_kwargs),
                              HistoryMode.parse(history))

    def sessions(self) -> list[str]:
        if self.rt.disk is None:
            return []
        return sorted(set(self.rt.disk.scan()) | self.files.stored_elsewhere())

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
                lock = self.files.lock(session_id)
            try:
                self.files.check_own_files(session_id, given, source, slog is not None)
            except BaseException:
                lock.release()
                raise
        slog = self.files.log_writer(session_id, slog) if disk is not None else None
        # what recovery cut from its log, whoever did
        cut = recovery.read_events(disk.root, session_id) if disk is not None and given else []
        try:
            sess = self._make_session(session_id, system, sampling, system_key, messages,
                                      options or SessionOptions(ChatRenderer(self.tokenizer)),
                                      slog, cut)
        except BaseException:
            if lock is not None:
                lock.release()
            raise
        self.files.adopt(session_id, lock, slog)
        self.live[sess.session_id] = sess
        return sess

    def _make_session(self, session_id: str, system: str | None,
                      sampling: SamplingParams | None, system_key,
                      messages: list[dict] | None, options: SessionOptions,
                      slog: SessionLog | None, cut: list) -> Session:
        if system_key is not None:  # stored by another process of this directory? read it
            self.pins.warm_from_directory(system_key)
        computed = None if system_key is None else self.pins.acquire(system_key)
        if computed is None:
            system_key = None  # (not pinned: the session runs without it)
        sess = Session(self, self.turns, session_id, system, sampling, messages,
                       options.history, options.renderer, options.log, options.pending, slog,
                       system_key, cut)
        sess.stats.system_computed_tokens = computed or 0
        try:
            self.rt.call(lambda: self.rt.policy.register(sess.kv)).result()
        except BaseException:
            self.pins.release(system_key)
            raise
        return sess

    def _system_key(self, path: Path, stored: StoredSession):
        """The shared pin of a stored session's system prompt (refused as the file's fault:
        the prompt came from it)."""
        try:
            return self.pins.key(stored.system, stored.options.renderer)
        except ConfigError as e:
            raise SnapshotError(f"{path}: {e}") from None

    def _resume(self, session_id: str, lock: FileLock) -> Session:
        """A session with a log (the truth): replayed, then the KV blocks on disk that match
        its tokens attached for the first turn to load (or recompute, by the cost model)."""
        disk = self.rt.disk
        stored = self.files.read_log(session_id)
        if stored is None:  # no intact record: the snapshot is what is left, or nothing
            if disk.path_for(session_id).is_file():
                return self.restore(disk.path_for(session_id), session_id, lock)
            recovery.refuse_lost(disk.root, session_id)
        system_key = self._system_key(disk.log_path(session_id), stored)
        sess = self._new_session(session_id, stored.system, stored.sampling, system_key,
                                 stored.messages, lock=lock, slog=stored.log,
                                 options=stored.options)
        try:
            self.files.attach_from_disk(sess.kv, session_id, stored)
        except BaseException:
            sess.close()
            raise
        return sess

    def restore(self, path, session_id: str | None, lock: FileLock | None = None) -> Session:
        """The session's id: `session_id` when given; else, for a file directly in
        session_dir, the file's name (that file is the session's); else the header's id.
        Anything wrong with the file is a SnapshotError; an id in use (live, or naming
        another session's file in session_dir) a ConfigError. Either way nothing changes."""
        path = Path(path)
        if session_id is not None:
            check_session_id(session_id)
        stored = self.files.read_snapshot(path)
        disk = self.rt.disk
        sid = session_id or (disk.id_of(path) if disk is not None else None) \
            or stored.header.session_id
        if sid in self.live:
            raise ConfigError(f"session {sid!r} is live; pass restore(path, session_id=...)")
        system_key = self._system_key(path, stored)
        sess = self._new_session(sid, stored.system, stored.sampling, system_key,
                                 stored.messages, source=path, lock=lock,
                                 options=stored.options)
        try:
            self.files.load_snapshot(sess.kv, stored)
        except BaseException:
            sess.close()
            raise
        return sess

    # ---- a session's lifecycle: forks and closes ------------------------------------------------

    def fork(self, point: ForkPoint, session_id: str | None) -> Session:
        """A new live session starting where `point` says (its parent shares its blocks
        with it next: Session.fork)."""
        if session_id is not None:
            check_session_id(session_id)
        return self._new_session(session_id, point.system, point.sampling, point.system_key,
                                 point.messages, options=point.options)

    def close_session(self, session_id: str, kv: SessionKV, system_key, delete: bool) -> None:
        """A session closed: its KV released in every tier, its shared system pin
        (`system_key`) given back, its files closed; delete: also the session's own file in
        session_dir, never another file (the one it was restored from elsewhere, or another
        session's)."""
        self.live.pop(session_id, None)
        stale = None
        if not self.rt.closed:
            if not delete:
                stale = self.files.refresh_own_file(session_id, kv)
            self.rt.call(lambda: self.rt.policy.release(kv)).result()
        try:
            self.pins.release(system_key)
        finally:
            self.files.close(session_id, delete)
        if stale is not None:
            raise stale

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
        """Write a live session's snapshot at close (its last act: sealed); its log and
        segment, redundant then, are removed."""
        self.files.before_persist(sess.session_id)
        sess.save_sealed(self.rt.disk.path_for(sess.session_id))
        self.files.mirror_snapshot(sess.session_id)  # in the store before the log leaves it
        self.files.after_persist(sess.session_id)

    def close_all(self) -> None:
        for sess in list(self.live.values()):
            sess.mark_closed()
        for e in self.files.close_all(list(self.live)):
            log.warning("%s", e)
