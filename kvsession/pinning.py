"""Pinning a prefix into the device cache (`llm.pin`, a session's system prompt): its
tokens computed once if absent, then every full block held by a `Pin` that eviction never
takes until it is removed or its TTL ends. The pin budget (max_pinned_fraction) is checked
before anything is computed; a salted pin is its tenant's own."""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future
from typing import Protocol

from kvsession.cache.hashing import Salt
from kvsession.cache.manager import KVCacheManager, Transient
from kvsession.cache.prefix import Pin, PrefixCache
from kvsession.engine.sequence import Sequence
from kvsession.errors import CacheFullError
from kvsession.params import SamplingParams
from kvsession.sequence_factory import SequenceFactory


class EngineCalls(Protocol):
    """What pinning needs of the engine thread's gateway (the Runtime)."""

    @property
    def closed(self) -> bool: ...

    def call(self, fn: Callable[[], object]) -> Future: ...

    def submit(self, seq: Sequence) -> Future: ...


class Pinning:
    def __init__(self, engine: EngineCalls, sequences: SequenceFactory, prefix: PrefixCache,
                 manager: KVCacheManager, block_size: int):
        self.engine, self.sequences = engine, sequences
        self.prefix, self.manager, self.block_size = prefix, manager, block_size

    def pin(self, ids: list[int], ttl_s: float | None, cache_salt: str | None = None) -> Pin:
        """Compute `ids` into the cache if absent and pin its full blocks (CacheFullError,
        nothing already pinned affected, past the pin budget). A salted pin is its tenant's
        own (hashed with the salt after any public pinned prefix it starts with)."""
        return self.pin_counted(ids, ttl_s, cache_salt)[0]

    def pin_counted(self, ids: list[int], ttl_s: float | None, cache_salt: str | None = None
                    ) -> tuple[Pin, int]:
        """`pin`, and how many of `ids` it computed (0: the cache held them all)."""
        # every caller's pin fits the engine, or ConfigError
        ids = self.sequences.validate_prompt(ids)
        num_blocks = len(ids) // self.block_size
        pins = self.prefix.pins
        salt = self.sequences.salt_for(ids, cache_salt)
        self.engine.call(lambda: pins.check_budget(
            num_blocks - self._num_pinned_among(ids, salt))).result()
        seq = Sequence(token_ids=list(ids), params=SamplingParams(
            max_tokens=1, temperature=0.0, cache_salt=cache_salt),
            max_model_len=self.sequences.max_model_len, retain_blocks=True, salt=salt,
            internal=True)
        self.engine.submit(seq).result()
        pin = self.engine.call(lambda: self._hold_pin(seq, num_blocks, ttl_s)).result()
        return pin, len(ids) - max(seq.num_cached_tokens, 0)

    def unpin(self, pin: Pin) -> None:
        if not self.engine.closed:
            self.engine.call(lambda: self.prefix.pins.remove(pin)).result()

    def _num_pinned_among(self, ids: list[int], salt: Salt | None) -> int:
        hashes = self.prefix.hasher.extend([], ids, len(ids), salt)
        blocks = self.prefix.lookup_blocks(ids, hashes, len(hashes))
        return len(blocks) - self.prefix.pins.num_new_blocks(blocks)

    def _hold_pin(self, seq: Sequence, num_blocks: int, ttl_s: float | None) -> Pin:
        """Engine thread: the prefill's references move onto the indexed copy of each full
        block, then to the pin."""
        staged = Transient()
        self.manager.transfer(seq, staged, num_blocks)
        self.manager.retarget_to_indexed(staged, seq.block_hashes[:num_blocks], seq.token_ids)
        try:
            return self.prefix.pins.add(seq.token_ids[: num_blocks * self.block_size],
                                        staged, ttl_s, self.prefix.clock(), seq.salt)
        except CacheFullError:
            self.manager.release(staged)
            raise
