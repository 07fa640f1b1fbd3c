"""SessionStore: the live sessions of one `LLM`, and everything a `Session` needs from the
engine side (a typed interface; Session never touches the runtime directly).

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
"""

from __future__ import annotations

import logging
import os
from concurrent.futures import Future
from pathlib import Path

from kvsession.cache.manager import SessionKV, Tier
from kvsession.engine.loop import OnUpdate
from kvsession.engine.sequence import Sequence
from kvsession.errors import CacheFullError, ConfigError, SessionClosedError, SnapshotError
from kvsession.model.tokenizer import Tokenizer
from kvsession.outputs import RequestOutput
from kvsession.params import SamplingParams
from kvsession.runtime import PinHandle, Runtime
from kvsession.session import SAMPLING_FIELDS, Session, TurnInfo, common_prefix_len
from kvsession.tiers.disk import check_session_id
from kvsession.tiers.snapshot import SnapshotHeader, copy_snapshot
from kvsession.tiers.snapshot_read import read_header

log = logging.getLogger("kvsession")
# restore tokenizes a snapshot's system prompt (to share its pinned blocks); longer than this
# many characters per token of max_model_len it could not fit a turn with any real
# tokenizer, and is refused before it costs the tokenizer's time and memory
SYSTEM_CHARS_PER_TOKEN = 64


class SessionStore:
    def __init__(self, runtime: Runtime):
        self.rt = runtime
        self.tokenizer: Tokenizer = runtime.tokenizer
        self.live: dict[str, Session] = {}
        self._system_pins: dict[tuple[int, ...], list] = {}  # ids -> [PinHandle, users]

    # ---- creating and resuming (the API edge) ------------------------------------------------

    def session(self, system: str | None, session_id: str | None, pin_system: bool,
                sampling: SamplingParams | None) -> Session:
        if session_id is not None:
            check_session_id(session_id)
            disk = self.rt.disk
            if session_id not in self.live and disk is not None \
                    and disk.path_for(session_id).is_file():
                return self.restore(disk.path_for(session_id), session_id)
        return self._new_session(session_id, system, sampling,
                                 self._system_key(system) if pin_system else None)

    def sessions(self) -> list[str]:
        return sorted(self.rt.disk.scan()) if self.rt.disk is not None else []

    def _system_key(self, system: str | None) -> tuple[int, ...] | None:
        if system is None or not self.rt.config.enable_prefix_caching:
            return None
        ids = self.tokenizer.encode_chat([{"role": "system", "content": system}],
                                         add_generation_prompt=False)
        return tuple(ids) if len(ids) >= self.rt.config.block_size else None

    def _new_session(self, session_id: str | None, system: str | None,
                     sampling: SamplingParams | None, system_key,
                     messages: list[dict] | None = None, source: Path | None = None
                     ) -> Session:
        """session_id was validated by the caller; source: the file it is restored from."""
        self.rt.check_open()
        if session_id is not None and session_id in self.live:
            raise ConfigError(f"session_id {session_id!r} is already in use by a live session")
        disk = self.rt.disk
        if session_id is not None and disk is not None:
            own = disk.path_for(session_id)
            # the session would write (spill, persist) and may delete this file: it must be
            # its own, never another session's
            if os.path.lexists(own) and not (source is not None and _same_file(source, own)):
                raise ConfigError(
                    f"session_id {session_id!r} is taken in session_dir: {own} is another "
                    f"session's file (resume it with llm.session(session_id="
                    f"{session_id!r})); choose another session_id")
        sess = Session(self, session_id, system, sampling, messages)
        if system_key is not None:
            entry = self._system_pins.get(system_key)
            if entry is None:
                try:
                    entry = self._system_pins[system_key] = [
                        self.rt.pin(list(system_key), None), 0]
                except CacheFullError as e:
                    log.warning("system prompt not pinned: %s", e)
            if entry is not None:
                entry[1] += 1
                sess.system_key = system_key
        self.rt.call(lambda: self.rt.policy.register(sess.kv)).result()
        self.live[sess.session_id] = sess
        return sess

    def restore(self, path, session_id: str | None) -> Session:
        """The session's id: `session_id` when given; else, for a file directly in
        session_dir, the file's name (that file is the session's); else the header's id.
        Anything wrong with the file is a SnapshotError; an id in use (live, or naming
        another session's file in session_dir) a ConfigError. Either way nothing changes."""
        path = Path(path)
        if session_id is not None:
            check_session_id(session_id)
        header = read_header(path, expect=self.rt.header_fields)
        vocab, max_len = self.rt.info.spec.vocab_size, self.rt.info.max_model_len
        if any(t >= vocab for t in header.token_ids):
            raise SnapshotError(f"{path}: token ids outside this model's vocabulary ({vocab})")
        if header.system is not None and len(header.system) > SYSTEM_CHARS_PER_TOKEN * max_len:
            raise SnapshotError(f"{path}: a system prompt of {len(header.system)} characters "
                                f"cannot fit this engine's max_model_len={max_len}")
        disk = self.rt.disk
        sid = session_id or (disk.id_of(path) if disk is not None else None) \
            or header.session_id
        if sid in self.live:
            raise ConfigError(f"session {sid!r} is live; pass restore(path, session_id=...)")
        try:  # values from the file: refused as the file's fault
            sampling = SamplingParams(**{k: v for k, v in header.sampling.items()
                                         if k in SAMPLING_FIELDS})
            system_key = self._system_key(header.system)
        except ConfigError as e:
            raise SnapshotError(f"{path}: {e}") from None
        # hashes are recomputed from the tokens: the file's could name other prefixes'
        # blocks and poison the shared prefix cache
        hashes = self.rt.mover.block_hashes(header.token_ids, sampling.cache_salt)
        sess = self._new_session(sid, header.system, sampling, system_key,
                                 list(header.messages), source=path)
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

    # ---- what a Session asks of the engine ----------------------------------------------------

    def call(self, fn) -> Future:
        """Run fn on the engine thread."""
        return self.rt.call(fn)

    def encode_turn(self, messages: list[dict]) -> list[int]:
        return self.rt.validate_prompt(self.tokenizer.encode_chat(messages))

    def output(self, seq: Sequence) -> RequestOutput:
        return self.rt.output(seq, prompt=None)

    def submit_turn(self, kv: SessionKV, ids: list[int], params: SamplingParams,
                    on_update: OnUpdate | None) -> tuple[Sequence, TurnInfo, Future]:
        """Submit one turn whose KV starts from the session's: on the engine thread the
        session's blocks are handed to the turn's sequence (after restoring them from a
        spilled tier, or dropping them when recomputing is cheaper) and taken back when it
        ends. Exactly one of the two holds them at any moment."""
        rt = self.rt
        seq = rt.new_sequence(ids, params, retain_blocks=True)
        info = TurnInfo()
        bs = rt.config.block_size

        def finished(seq: Sequence, ok: bool) -> None:  # engine thread: the session takes it back
            n = seq.num_computed_tokens if ok else 0  # failed: the engine released the blocks
            rt.manager.checkin(kv, seq, seq.token_ids[:n], seq.block_hashes[: n // bs])
            rt.policy.checkin(kv)

        def prepare() -> None:  # engine thread: bring the KV back, hand it to the sequence
            history = common_prefix_len(kv.tokens, ids)
            info.diverged_at = history if history < len(kv.tokens) else None
            source = rt.policy.checkout(kv)
            common = min(common_prefix_len(kv.tokens, ids), len(ids) - 1)
            hashes = kv.hashes
            seq.num_computed_tokens = rt.manager.checkout(kv, seq, common)
            seq.block_hashes = list(hashes[: seq.num_computed_tokens // bs])
            info.restored_from = source if seq.num_computed_tokens else None
            seq.on_finish = finished

        return seq, info, rt.submit(seq, on_update=on_update, prepare=prepare)

    def fork(self, parent: Session, session_id: str | None) -> Session:
        if session_id is not None:
            check_session_id(session_id)
        if parent.state == "closed":  # before anything is created (a child, a system pin)
            raise SessionClosedError(f"session {parent.session_id!r} is closed")
        child = self._new_session(session_id, parent.system, parent.sampling,
                                  parent.system_key, parent.messages)

        def share() -> None:
            self.rt.policy.restore(parent.kv)  # a spilled parent comes back first
            self.rt.manager.share(parent.kv, child.kv)

        try:
            parent.exclusive(share)
        except BaseException:
            child.close()
            raise
        return child

    def save(self, kv: SessionKV, path) -> None:
        """Engine thread: write the session's snapshot from wherever its KV is, atomically.
        Any failure (disk full, unwritable directory) is a SnapshotError naming the cause;
        the session and the file it replaced are unchanged."""
        path = Path(path)
        if kv.tier is Tier.DISK and kv.disk_path is not None:
            if not _same_file(kv.disk_path, path):
                copy_snapshot(kv.disk_path, path)
            return
        self.rt.mover.write_snapshot(kv, path)

    def suspend(self, kv: SessionKV, expected_idle_s: float | None) -> str:
        return self.rt.policy.suspend(kv, expected_idle_s)

    def prefetch(self, kv: SessionKV) -> Future:
        return self.rt.call(lambda: self.rt.policy.restore(kv))

    def close_session(self, sess: Session, delete: bool) -> None:
        """delete: also the session's own file in session_dir; never another file (the one
        it was restored from elsewhere, or another session's)."""
        self.live.pop(sess.session_id, None)
        kv = sess.kv
        if not self.rt.closed:
            self.rt.call(lambda: self.rt.policy.release(kv)).result()
        entry = self._system_pins.get(sess.system_key)
        if entry is not None:
            entry[1] -= 1
            if entry[1] == 0:
                del self._system_pins[sess.system_key]
                pin: PinHandle = entry[0]
                self.rt.unpin(pin)
        if delete and self.rt.disk is not None:
            own = self.rt.disk.path_for(sess.session_id)
            try:
                own.unlink(missing_ok=True)
            except OSError as e:
                raise SnapshotError(f"{own}: cannot delete: {e}") from None

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
                sess.save(self.rt.disk.path_for(sess.session_id))
                persisted.append(sess)
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

    def close_all(self) -> None:
        for sess in list(self.live.values()):
            sess.mark_closed()


def _same_file(a: Path, b: Path) -> bool:
    try:
        return os.path.samefile(a, b)
    except OSError:  # one of them does not exist (or cannot be looked at)
        return False
