"""SessionStore: the live sessions of one `LLM`, and everything a `Session` needs from the
engine side (a typed interface; Session never touches the runtime directly).

Persistence: with `session_dir`, every session alive at `llm.close()` is written to
`session_dir/<session_id>.kvs`; spilled-to-disk sessions live there already. At start-up
the directory is scanned; `llm.session(session_id=...)` resumes one, `llm.sessions()` lists
them. Snapshots are checked against this engine (model, tokenizer, template, kv dtype,
block size, geometry) before anything is loaded; a mismatch is a SnapshotError and leaves
the engine and every other session untouched.

Session ids are validated once, here, where they enter (`session`, `restore`, `fork`).
"""

from __future__ import annotations

import logging
import shutil
from concurrent.futures import Future
from pathlib import Path

from kvsession.cache.manager import SessionKV, Tier
from kvsession.engine.loop import OnUpdate
from kvsession.engine.sequence import Sequence
from kvsession.errors import CacheFullError, ConfigError, SnapshotError
from kvsession.model.tokenizer import Tokenizer
from kvsession.outputs import RequestOutput
from kvsession.params import SamplingParams
from kvsession.runtime import PinHandle, Runtime
from kvsession.session import SAMPLING_FIELDS, Session, TurnInfo, common_prefix_len
from kvsession.tiers.disk import check_session_id
from kvsession.tiers.snapshot import SnapshotHeader, check_compatible, read_header

log = logging.getLogger("kvsession")


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
                return self.restore(disk.path_for(session_id), None)
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
                     messages: list[dict] | None = None) -> Session:
        """session_id was validated by the caller."""
        self.rt.check_open()
        if session_id is not None and session_id in self.live:
            raise ConfigError(f"session_id {session_id!r} is already in use by a live session")
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
        path = Path(path)
        if session_id is not None:
            check_session_id(session_id)
        header = read_header(path)
        fields = self.rt.header_fields
        check_compatible(path, header, {k: v for k, v in fields.items() if k != "tensor_names"})
        if set(header.tensor_names) != set(fields["tensor_names"]):
            raise SnapshotError(f"{path}: tensors {header.tensor_names} do not match this "
                                f"engine's cache {fields['tensor_names']}")
        sid = session_id or header.session_id
        if sid in self.live:
            raise ConfigError(f"session {sid!r} is live; pass restore(path, session_id=...)")
        sampling = SamplingParams(**{k: v for k, v in header.sampling.items()
                                     if k in SAMPLING_FIELDS})
        sess = self._new_session(sid, header.system, sampling, self._system_key(header.system),
                                 list(header.messages))
        try:
            self.rt.call(lambda: self._load_snapshot(sess.kv, path, header)).result()
        except BaseException:
            sess.close()
            raise
        return sess

    def _load_snapshot(self, kv: SessionKV, path: Path, h: SnapshotHeader) -> None:
        """Engine thread: the snapshot's KV into device blocks (blocks already resident are
        re-referenced, not re-read). If the device is full even after spilling idle
        sessions, the file is only validated and stays the session's disk tier: its next
        turn loads or recomputes."""
        self.rt.manager.on_disk(kv, h.token_ids, [bytes.fromhex(x) for x in h.block_hashes],
                                path)
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
        """Engine thread: write the session's snapshot from wherever its KV is."""
        path = Path(path)
        if kv.tier is Tier.DISK and kv.disk_path is not None:
            if kv.disk_path.resolve() != path.resolve():
                shutil.copyfile(kv.disk_path, path)
            return
        self.rt.mover.write_snapshot(kv, path)

    def suspend(self, kv: SessionKV, expected_idle_s: float | None) -> str:
        return self.rt.policy.suspend(kv, expected_idle_s)

    def prefetch(self, kv: SessionKV) -> Future:
        return self.rt.call(lambda: self.rt.policy.restore(kv))

    def close_session(self, sess: Session, delete: bool) -> None:
        self.live.pop(sess.session_id, None)
        kv = sess.kv
        if not self.rt.closed:
            self.rt.call(lambda: self.rt.policy.release(kv, delete_file=delete)).result()
        if delete and self.rt.disk is not None:
            self.rt.disk.path_for(sess.session_id).unlink(missing_ok=True)
        entry = self._system_pins.get(sess.system_key)
        if entry is not None:
            entry[1] -= 1
            if entry[1] == 0:
                del self._system_pins[sess.system_key]
                pin: PinHandle = entry[0]
                self.rt.unpin(pin)

    # ---- shutdown --------------------------------------------------------------------------

    def persist_all(self) -> None:
        if self.rt.disk is None:
            return
        for sess in list(self.live.values()):
            try:
                sess.save(self.rt.disk.path_for(sess.session_id))
            except Exception as e:  # persistence is best effort at shutdown; never lose more
                log.warning("could not persist session %s: %s", sess.session_id, e)

    def close_all(self) -> None:
        for sess in list(self.live.values()):
            sess.mark_closed()
