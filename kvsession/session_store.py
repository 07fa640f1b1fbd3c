"""The session side of `LLM` (a mixin): creating, resuming, saving, restoring and closing
sessions, and the engine-thread block hand-offs they need.

Persistence: with `session_dir`, every session alive at `llm.close()` is written to
`session_dir/<session_id>.kvs`; spilled-to-disk sessions live there already. At start-up
the directory is scanned; `llm.session(session_id=...)` resumes one, `llm.sessions()` lists
them. Snapshots are checked against this engine (model, tokenizer, template, kv dtype,
block size, geometry) before anything is loaded; a mismatch is a SnapshotError and leaves
the engine and every other session untouched.
"""

from __future__ import annotations

import logging
import shutil
from pathlib import Path

from kvsession.errors import CacheFullError, ConfigError, SnapshotError
from kvsession.params import SamplingParams
from kvsession.session import SAMPLING_FIELDS, Session
from kvsession.tiers.disk import check_session_id
from kvsession.tiers.policy import Tier
from kvsession.tiers.snapshot import (
    SnapshotHeader,
    check_compatible,
    read_blocks,
    read_header,
    write_snapshot,
)

log = logging.getLogger("kvsession")


class SessionStore:
    """Mixed into LLM; relies on its config, runtime, tokenizer, pool, kv, policy, disk,
    pin() and _engine_loop()."""

    def _init_sessions(self) -> None:
        self._sessions: dict[str, Session] = {}
        self._system_pins: dict[tuple[int, ...], list] = {}  # ids -> [PinnedPrefix, users]

    # ---- creating and resuming ----------------------------------------------------------

    def session(self, system: str | None = None, session_id: str | None = None,
                pin_system: bool = True, sampling: SamplingParams | None = None) -> Session:
        """A multi-turn conversation whose KV stays cached between turns. The system prompt
        is pinned (once, shared by every session with the same system prompt). With
        session_dir set, an id that was persisted there resumes that session."""
        if session_id is not None and session_id not in self._sessions and \
                self.disk is not None and self.disk.path_for(session_id).is_file():
            return self.restore(self.disk.path_for(session_id))
        return self._new_session(session_id, system, sampling,
                                 self._system_key(system) if pin_system else None)

    def _system_key(self, system: str | None) -> tuple[int, ...] | None:
        if system is None or not self.config.enable_prefix_caching:
            return None
        ids = self.tokenizer.encode_chat([{"role": "system", "content": system}],
                                         add_generation_prompt=False)
        return tuple(ids) if len(ids) >= self.config.block_size else None

    def _new_session(self, session_id, system, sampling, system_key) -> Session:
        self._engine_loop()
        if session_id is not None:
            check_session_id(session_id)
            if session_id in self._sessions:
                raise ConfigError(f"session_id {session_id!r} is already in use by a live "
                                  f"session")
        sess = Session(self, session_id, system, sampling, None)
        if system_key is not None:
            entry = self._system_pins.get(system_key)
            if entry is None:
                try:
                    entry = self._system_pins[system_key] = [self.pin(list(system_key)), 0]
                except CacheFullError as e:
                    log.warning("system prompt not pinned: %s", e)
            if entry is not None:
                entry[1] += 1
                sess._system_key = system_key
        self._engine_loop().call(lambda: self.policy.register(sess._kv)).result()
        self._sessions[sess.session_id] = sess
        return sess

    def sessions(self) -> list[str]:
        """Ids of the sessions persisted in session_dir (empty without one)."""
        return sorted(self.disk.scan()) if self.disk is not None else []

    def _close_session(self, sess: Session, delete: bool) -> None:
        self._sessions.pop(sess.session_id, None)
        kv = sess._kv
        if self._loop is not None:
            self._loop.call(lambda: self.policy.release(kv, delete_file=delete)).result()
        if delete and self.disk is not None:
            self.disk.path_for(sess.session_id).unlink(missing_ok=True)
        entry = self._system_pins.get(sess._system_key)
        if entry is not None:
            entry[1] -= 1
            if entry[1] == 0:
                del self._system_pins[sess._system_key]
                entry[0].unpin()

    # ---- snapshots ------------------------------------------------------------------------

    def _header_fields(self) -> dict:
        spec = self.runtime.spec
        return {
            "model_fingerprint": self.runtime.model_fingerprint,
            "tokenizer_digest": self.tokenizer.digest,
            "template_digest": self.tokenizer.template_digest,
            "kv_dtype": self.config.kv_cache_dtype_name, "block_size": self.config.block_size,
            "num_layers": spec.num_layers, "num_kv_heads": spec.num_kv_heads,
            "head_dim": spec.head_dim, "tensor_names": list(self.kv.tensors()),
        }

    def _save_session(self, sess: Session, path) -> None:
        """Engine thread: write the session's snapshot from wherever its KV is."""
        path, kv = Path(path), sess._kv
        if kv.tier is Tier.DISK and kv.disk_path is not None:
            if kv.disk_path.resolve() != path.resolve():
                shutil.copyfile(kv.disk_path, path)
            return
        write_snapshot(path, self.policy.snapshot_fields(kv), self.policy._block_tensors(kv))

    def _persist_sessions(self) -> None:
        if self.disk is None:
            return
        for sess in list(self._sessions.values()):
            try:
                sess.save(self.disk.path_for(sess.session_id))
            except Exception as e:  # persistence is best effort at shutdown; never lose more
                log.warning("could not persist session %s: %s", sess.session_id, e)

    def restore(self, path, session_id: str | None = None) -> Session:
        """A Session continuing exactly where the snapshot at `path` left off. Its KV is
        loaded into the device pool now (blocks already resident, such as a shared system
        prompt, are re-referenced, not re-read); a file that does not fit this engine or is
        damaged raises SnapshotError and changes nothing."""
        path = Path(path)
        header = read_header(path)
        check_compatible(path, header, {k: v for k, v in self._header_fields().items()
                                        if k != "tensor_names"})
        if set(header.tensor_names) != set(self.kv.tensors()):
            raise SnapshotError(f"{path}: tensors {header.tensor_names} do not match this "
                                f"engine's cache {list(self.kv.tensors())}")
        sid = session_id or header.session_id
        if sid in self._sessions:
            raise ConfigError(f"session {sid!r} is live; pass restore(path, session_id=...)")
        sampling = SamplingParams(**{k: v for k, v in header.sampling.items()
                                     if k in SAMPLING_FIELDS})
        sess = self._new_session(sid, header.system, sampling, self._system_key(header.system))
        sess._messages = [dict(m) for m in header.messages]
        try:
            self._engine_loop().call(lambda: self._load_snapshot(sess, path, header)).result()
        except BaseException:
            sess.close()
            raise
        return sess

    def _load_snapshot(self, sess: Session, path: Path, h: SnapshotHeader) -> None:
        """Engine thread: the snapshot's KV into device blocks (blocks already resident are
        re-referenced, not re-read). If the device is full even after spilling idle
        sessions, the file is only validated and stays the session's disk tier: its next
        turn loads or recomputes."""
        kv = sess._kv
        kv.tokens = list(h.token_ids)
        kv.hashes = [bytes.fromhex(x) for x in h.block_hashes]
        kv.disk_path, kv.tier = path, Tier.DISK
        if self.pool.num_free < h.num_blocks:
            self.policy.reclaim(h.num_blocks - self.pool.num_free, exclude=kv)
        if self.pool.num_free < h.num_blocks:
            for _ in read_blocks(path, h, list(range(h.num_blocks))):
                pass  # validate every block now; load on the next turn
            return
        try:
            self.policy.load_blocks(kv, Tier.DISK, 0)
        except BaseException:
            kv.tokens, kv.hashes, kv.tier, kv.disk_path = [], [], Tier.DEVICE, None
            raise
        self.policy.restores["disk"] += 1

    # ---- block hand-offs (engine thread) ---------------------------------------------------

    def _attach_blocks(self, blocks: list, num_tokens: int) -> tuple[list, int]:
        """Keep the blocks holding a session's first `num_tokens` tokens for its next turn
        and release the rest. A partial last block is written in place only if nothing else
        can see it (one reference, not published); otherwise it is copied first
        (copy-on-write), or dropped and recomputed when no block is free. Returns (blocks,
        number of tokens whose KV they hold)."""
        bs, pool = self.config.block_size, self.pool
        num_full = num_tokens // bs
        keep, rest, valid = blocks[:num_full], blocks[num_full:], num_full * bs
        if num_tokens % bs and rest:
            tail = rest[0]
            if tail.ref_cnt == 1 and tail.block_hash is None:
                keep, rest, valid = keep + [tail], rest[1:], num_tokens
            elif pool.num_free:
                (fresh,) = pool.allocate(1)
                self.kv.copy_block(tail.block_id, fresh.block_id)
                keep, valid = keep + [fresh], num_tokens
        pool.free(rest)
        return keep, valid
