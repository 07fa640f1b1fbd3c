"""Prefix lookup: the longest run of a token sequence's leading full blocks already cached.

Every hit is verified token by token (BlockPool.lookup); the walk stops at the first miss,
because a chained hash after a missing block can never match.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import ClassVar

from kvsession.cache.block_pool import Block
from kvsession.cache.hashing import BlockHasher, Salt, SaltArg
from kvsession.cache.manager import Holder, HolderKind, KVCacheManager
from kvsession.errors import CacheFullError


def common_prefix_len(a: Sequence[int], b: Sequence[int]) -> int:
    """How many leading tokens a and b share."""
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n


class PrefixCache:
    """Lookup, pins and the in-flight map. Mutated only on the engine thread.

    `pending` maps the hash of a block that a running sequence is computing right now (its
    tokens are known, its KV not yet) to that sequence's id: a request that would compute
    the same block waits for it instead, so concurrent requests with a common prefix share
    blocks rather than computing them twice."""

    def __init__(self, manager: KVCacheManager, hasher: BlockHasher,
                 max_pinned_blocks: int = 0):
        self.pool, self.hasher = manager.pool, hasher
        self.pins = PinRegistry(manager, max_pinned_blocks)
        self.pending: dict[bytes, int] = {}
        self.clock = time.monotonic  # pin TTLs are measured on it (replaceable in tests)
        self.queried_tokens = 0
        self.hit_tokens = 0

    def match(self, token_ids: Sequence[int], hashes: list[bytes], max_tokens: int,
              cache_salt: SaltArg) -> list[Block]:
        """Cached blocks covering the longest prefix of `token_ids[:max_tokens]` (whole
        blocks only). `hashes` is the sequence's hash list, extended in place as far as it is
        computed. Takes no references: the caller touches the blocks it keeps. Counts the
        query in the hit-rate statistics."""
        bs = self.pool.block_size
        hits: list[Block] = []
        if self.pool.enable_caching:
            self.hasher.extend(hashes, token_ids, max_tokens - max_tokens % bs, cache_salt)
            hits = self.lookup_blocks(token_ids, hashes, max_tokens // bs)
        self.queried_tokens += max_tokens
        self.hit_tokens += len(hits) * bs
        self.pins.note_hits(hits, self.clock())
        return hits

    def lookup_blocks(self, token_ids: Sequence[int], hashes: list[bytes],
                      num_blocks: int, start: int = 0) -> list[Block]:
        """The verified cached blocks of blocks start..num_blocks-1, up to the first miss
        (no statistics, no references)."""
        return self.pool.lookup_run(token_ids, hashes, start, num_blocks)

    def mark_pending(self, seq_id: int, hashes: list[bytes]) -> None:
        for h in hashes:
            self.pending.setdefault(h, seq_id)

    def clear_pending(self, seq_id: int, hashes: list[bytes]) -> None:
        for h in hashes:
            if self.pending.get(h) == seq_id:
                del self.pending[h]


class Pin:
    """A pinned prefix: one held reference on each of its full blocks (so eviction needs no
    special case), an optional idle TTL, and the time of its last hit. Its block table is
    written by KVCacheManager."""

    holder_kind: ClassVar[HolderKind] = HolderKind.PIN

    def __init__(self, pin_id: int, token_ids: list[int], ttl_s: float | None, now: float,
                 salt: Salt | None = None):
        self.pin_id, self.token_ids = pin_id, token_ids
        self.cache_salt = None if salt is None else salt.value  # None: public, shared
        # a salted pin's leading blocks hashed unsalted (the public pins of its time)
        self.salt_after = 0 if salt is None else salt.after_blocks
        self.blocks: tuple[Block, ...] = ()
        self.ttl_s, self.last_hit = ttl_s, now
        self.active = True

    def expired(self, now: float) -> bool:
        return self.ttl_s is not None and now - self.last_hit > self.ttl_s


class PinRegistry:
    """Pinned prefixes. Mutated only on the engine thread; references go through the
    KVCacheManager.

    Budget: the distinct blocks held by pins never exceed `max_pinned_blocks`; a pin over
    budget is refused (CacheFullError) and existing pins are untouched."""

    def __init__(self, manager: KVCacheManager, max_pinned_blocks: int):
        self.manager, self.max_pinned_blocks = manager, max_pinned_blocks
        self.pins: dict[int, Pin] = {}
        self.block_pins: dict[int, int] = {}  # block id -> number of pins holding it
        # the unsalted pins' full-block token prefixes, replaced whole on every change so
        # callers' threads may read it without a lock (salt layering: public_blocks)
        self.public: tuple[tuple[int, ...], ...] = ()
        # the salted pins' (salt, tokens, leading unsalted blocks), published the same way
        self.salted: tuple[tuple[str, tuple[int, ...], int], ...] = ()
        self._next_id = 0

    @property
    def num_pinned_blocks(self) -> int:
        return len(self.block_pins)

    def num_new_blocks(self, blocks: Sequence[Block]) -> int:
        return sum(1 for b in blocks if b.block_id not in self.block_pins)

    def check_budget(self, num_new_blocks: int) -> None:
        if self.num_pinned_blocks + num_new_blocks > self.max_pinned_blocks:
            raise CacheFullError(
                f"pinning {num_new_blocks} more blocks would exceed the pin budget: "
                f"asked {num_new_blocks}, pinned {self.num_pinned_blocks}, limit "
                f"{self.max_pinned_blocks} blocks (max_pinned_fraction of the device pool)")

    def public_blocks(self, token_ids: Sequence[int]) -> int:
        """Full blocks of the longest public pinned prefix `token_ids` starts with (any
        thread)."""
        best = 0
        for pre in self.public:
            if len(pre) > best and len(pre) <= len(token_ids) and \
                    tuple(token_ids[: len(pre)]) == pre:
                best = len(pre)
        return best // self.manager.block_size

    def salted_after(self, token_ids: Sequence[int], cache_salt: str) -> int | None:
        """The leading unsalted blocks of the longest pin of `cache_salt` that `token_ids`
        start with, as it was hashed; None if none (any thread). A tenant's requests hash
        as its pin did whatever public pins came or went since: with the public pins of
        now they would miss it."""
        best, after = 0, None
        for salt, pre, pre_after in self.salted:
            if salt == cache_salt and len(pre) > best and len(pre) <= len(token_ids) and \
                    tuple(token_ids[: len(pre)]) == pre:
                best, after = len(pre), pre_after
        return after

    def _publish(self) -> None:
        self.public = tuple({tuple(p.token_ids) for p in self.pins.values()
                             if p.cache_salt is None and p.blocks})
        self.salted = tuple({(p.cache_salt, tuple(p.token_ids), p.salt_after)
                             for p in self.pins.values()
                             if p.cache_salt is not None and p.blocks})

    def add(self, token_ids: list[int], source: Holder, ttl_s: float | None,
            now: float, salt: Salt | None = None) -> Pin:
        """Pin the blocks of `source` (its references are handed over to the pin). Raises
        CacheFullError, changing nothing, when over budget: `source` keeps them then."""
        self.check_budget(self.num_new_blocks(source.blocks))
        pin = Pin(self._next_id, token_ids, ttl_s, now, salt)
        self.manager.transfer(source, pin)
        self._next_id += 1
        self.pins[pin.pin_id] = pin
        for b in pin.blocks:
            self.block_pins[b.block_id] = self.block_pins.get(b.block_id, 0) + 1
        self._publish()
        return pin

    def remove(self, pin: Pin) -> None:
        if not pin.active:
            return
        pin.active = False
        del self.pins[pin.pin_id]
        for b in pin.blocks:
            n = self.block_pins[b.block_id] - 1
            if n:
                self.block_pins[b.block_id] = n
            else:
                del self.block_pins[b.block_id]
        self.manager.release(pin)
        self._publish()

    def note_hits(self, blocks: list[Block], now: float) -> None:
        """A lookup hit these blocks: refresh the TTL of pins that hold them."""
        if not self.pins or not blocks:
            return
        hit = {b.block_id for b in blocks if b.block_id in self.block_pins}
        for pin in self.pins.values():
            if pin.blocks and pin.blocks[0].block_id in hit:
                pin.last_hit = now

    def expire(self, now: float) -> list[Pin]:
        gone = [p for p in self.pins.values() if p.expired(now)]
        for p in gone:
            self.remove(p)
        return gone

    def next_deadline(self) -> float | None:
        ttls = [p.last_hit + p.ttl_s for p in self.pins.values() if p.ttl_s is not None]
        return min(ttls) if ttls else None
