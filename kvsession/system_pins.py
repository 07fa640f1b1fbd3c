"""SystemPins: the system prompts a `SessionStore`'s sessions share. Every distinct system
prefix (the system turn as the template renders it before any message, with the session's
tools: `ChatRenderer.system_prefix`) is pinned once and counted by the sessions using it;
the last one to leave unpins it. Callers' threads open and close sessions concurrently, so
"look up, else pin" is atomic (a second pin would be overwritten and leak its blocks)."""

from __future__ import annotations

import logging
import threading

from kvsession.errors import CacheFullError, ConfigError, SnapshotError
from kvsession.history import ChatRenderer
from kvsession.runtime import PinHandle, Runtime
from kvsession.tiers.resume import open_shared, warm_prefix

log = logging.getLogger("kvsession")

SystemKey = tuple[int, ...]


class SystemPins:
    def __init__(self, runtime: Runtime):
        self.rt = runtime
        self._pins: dict[SystemKey, list] = {}  # key -> [PinHandle, users]
        self._lock = threading.Lock()

    def key(self, system: str | None, renderer: ChatRenderer) -> SystemKey | None:
        """The tokens a session with this system prompt pins (None: no system prompt, no
        prefix caching, a template that refuses a system message alone, or less than a
        block)."""
        if system is None or not self.rt.config.enable_prefix_caching:
            return None
        try:
            ids = renderer.system_prefix(system)
        except ConfigError:
            return None
        return tuple(ids) if len(ids) >= self.rt.config.block_size else None

    def prefix(self, system: str) -> list[int]:
        """llm.pin(system=...): the system message's tokens (ConfigError if the template
        refuses it)."""
        return ChatRenderer(self.rt.tokenizer).system_prefix(system)

    def is_pinned(self, key: SystemKey) -> bool:
        with self._lock:
            return key in self._pins

    def acquire(self, key: SystemKey) -> int | None:
        """One more user of `key`'s pin, pinning it first if needed: the tokens pinning it
        computed (0 when it was pinned, or the cache held it); None (logged) when the pin
        budget refuses it."""
        computed = 0
        with self._lock:
            entry = self._pins.get(key)
            if entry is None:
                try:
                    pin, computed = self.rt.pinning.pin_counted(list(key), None)
                except CacheFullError as e:
                    log.warning("system prompt not pinned: %s", e)
                    return None
                entry = self._pins[key] = [pin, 0]
            entry[1] += 1
            return computed

    def release(self, key: SystemKey | None) -> None:
        """One user fewer; the last one unpins (outside the lock: it waits on the engine)."""
        pin: PinHandle | None = None
        with self._lock:
            entry = self._pins.get(key)
            if entry is not None:
                entry[1] -= 1
                if entry[1] == 0:
                    del self._pins[key]
                    pin = entry[0]
        if pin is not None:
            self.rt.pinning.unpin(pin)

    def warm_from_directory(self, key: SystemKey) -> None:
        """Before `key` is pinned here: its blocks from the session_dir's shared prefix store
        (another process, or a replica sharing the directory, wrote them behind) into the
        prefix cache (tiers/resume.warm_prefix), so that pinning it reads them instead of
        prefilling them. Nothing when it is pinned already or there is no store; a damaged
        store, or one its last user removed meanwhile, only costs the prefill."""
        rt = self.rt
        if rt.disk is None or self.is_pinned(key):
            return
        ids = list(key)
        try:
            shared = open_shared(rt.disk, rt.identity)
            if shared is None:
                return
            hashes = rt.mover.block_hashes(ids, rt.sequences.salt_for(ids, None))
            rt.call(lambda: warm_prefix(rt.mover, shared, rt.disk.shared_path(), ids,
                                        hashes)).result()
        except (SnapshotError, OSError) as e:
            log.warning("%s; the system prompt will be recomputed", e)
