"""Prefix-affinity routing with bounded load: which of several targets (prefill workers,
engine replicas behind `python -m kvsession serve --replicas N`) takes a request.

Inputs are plain: a request's keys (chain hashes, in order: key i identifies the whole
prefix up to piece i; the pieces are KV blocks for prefill workers, messages for
conversations) and the targets' current loads (requests in flight). Nothing here knows
about NIXL, sockets, HTTP or the engine, and the module imports nothing of kvsession but
its errors: the connector (library code) and the server (an application over the public
API) both use it, so it sits below both (tests/test_layering.py).

Affinity: the router remembers which target was sent which keys (a bounded LRU of key ->
set of targets). A target that was sent the first d keys of a request probably still has
that prefix cached, so a request prefers the target with the deepest such match; targets
matching equally deep (none at all, typically) are ordered by rendezvous hashing on the
first key, so a prefix nobody has seen yet still lands on one stable target. A memory
miss (evicted on the target, or forgotten here) costs the target compute, never
correctness.

Bounded load (consistent hashing with bounded loads, Mirrokni et al. 2018): with `total`
requests in flight over `n` eligible targets, no target may take a request that would put
it above `ceil(load_bound * (total + 1) / n)`; the request goes to the first target in its
preference order that is under that cap. So 8 requests sharing one system prompt over two
idle workers split 5/3 (at most 1.25x the fair share of 4), while requests that arrive one
at a time all go to the affine target.
"""

from __future__ import annotations

import hashlib
import math
from collections import OrderedDict
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass

from kvsession.errors import ConfigError

DEFAULT_LOAD_BOUND = 1.25
DEFAULT_MAX_KEYS = 1 << 17  # ~20 MB of memory; 2M tokens of distinct prefixes at 16/block


@dataclass(frozen=True)
class Route:
    """A routing decision: the target, how many leading keys it is believed to hold, and
    whether it was the request's first preference (False: spilled over by the load bound)."""

    target: str
    matched_blocks: int
    preferred: bool


class PrefixRouter:
    """Not thread-safe: one owner calls it (the engine thread, for prefill workers)."""

    def __init__(self, targets: Sequence[str], load_bound: float = DEFAULT_LOAD_BOUND,
                 max_keys: int = DEFAULT_MAX_KEYS):
        targets = list(targets)
        if not targets or len(set(targets)) != len(targets):
            raise ConfigError(f"targets must be distinct and at least one, got {targets!r:.200}")
        if not (isinstance(load_bound, (int, float)) and load_bound >= 1.0):
            raise ConfigError(f"load_bound must be a number >= 1.0, got {load_bound!r}")
        if not (isinstance(max_keys, int) and max_keys >= 1):
            raise ConfigError(f"max_keys must be an int >= 1, got {max_keys!r}")
        self.targets = targets
        self.load_bound = float(load_bound)
        self.max_keys = max_keys
        self._bit = {t: 1 << i for i, t in enumerate(targets)}
        self._where: OrderedDict[bytes, int] = OrderedDict()  # key -> bit set of targets

    # ---- what the targets hold ----------------------------------------------------------

    def record(self, target: str, keys: Sequence[bytes]) -> None:
        """`target` was given (and will cache) the prefix these keys identify."""
        bit = self._bit[target]
        where = self._where
        for k in keys:
            where[k] = where.get(k, 0) | bit
            where.move_to_end(k)
        while len(where) > self.max_keys:
            where.popitem(last=False)

    def forget(self, target: str) -> None:
        """`target` lost its cache (it died or restarted)."""
        keep = ~self._bit[target]
        for k in [k for k, m in self._where.items() if m & ~keep]:
            m = self._where[k] & keep
            if m:
                self._where[k] = m
            else:
                del self._where[k]

    def matched_blocks(self, keys: Sequence[bytes]) -> dict[str, int]:
        """Per target: how many leading keys it is believed to hold (one pass over the keys,
        stopping at the first key no target holds)."""
        depth = dict.fromkeys(self.targets, 0)
        alive, n = (1 << len(self.targets)) - 1, 0
        for k in keys:
            held = alive & self._where.get(k, 0)
            if held != alive:  # some targets stop matching at key n
                for t, bit in self._bit.items():
                    if alive & bit and not held & bit:
                        depth[t] = n
                alive = held
                if not alive:
                    break
            n += 1
        for t, bit in self._bit.items():
            if alive & bit:
                depth[t] = n
        return depth

    # ---- choosing -------------------------------------------------------------------------

    def discard(self, target: str, keys: Collection[bytes]) -> None:
        """`target` no longer holds these keys (it reported them evicted)."""
        keep = ~self._bit[target]
        for k in keys:
            m = self._where.get(k)
            if m is None:
                continue
            if m & keep:
                self._where[k] = m & keep
            else:
                del self._where[k]

    def ranked(self, keys: Sequence[bytes], eligible: Collection[str] | None = None,
               depth: Mapping[str, int] | None = None) -> list[tuple[str, int]]:
        """(target, matched blocks), most preferred first: deepest match, then rendezvous
        order on the first key (the target name alone when there are no keys). `depth`:
        the caller's own per-target match (what the targets reported holding), used
        instead of `matched_blocks` when given."""
        if depth is None:
            depth = self.matched_blocks(keys)
        first = keys[0] if keys else b""
        names = self.targets if eligible is None else [t for t in self.targets if t in eligible]
        return sorted(((t, depth.get(t, 0)) for t in names),
                      key=lambda td: (td[1], _score(first, td[0])), reverse=True)

    def cap(self, total_load: int, num_eligible: int, load_bound: float | None = None
            ) -> int:
        """The most requests one target may hold after taking the next one."""
        bound = self.load_bound if load_bound is None else load_bound
        return max(1, math.ceil(bound * (total_load + 1) / num_eligible))

    def choose(self, keys: Sequence[bytes], loads: Mapping[str, int],
               eligible: Collection[str] | None = None,
               depth: Mapping[str, int] | None = None,
               load_bound: float | None = None) -> Route | None:
        """The target for a request with these keys; None when no target is eligible.
        `loads`: requests in flight per target (missing: 0); `depth`: as for `ranked`;
        `load_bound`: this request's bound instead of the router's (1.0: the fair share).
        Records nothing: call `record` once the request is really sent."""
        order = self.ranked(keys, eligible, depth)
        if not order:
            return None
        total = sum(loads.get(t, 0) for t, _ in order)
        cap = self.cap(total, len(order), load_bound)
        for i, (t, d) in enumerate(order):
            if loads.get(t, 0) < cap:
                return Route(t, d, i == 0)
        t, d = min(order, key=lambda td: loads.get(td[0], 0))  # unreachable: sum < n * cap
        return Route(t, d, False)


def _score(key: bytes, target: str) -> bytes:
    """Rendezvous (highest random weight) score: stable across processes (sha256, no seed)."""
    return hashlib.sha256(key + b"\0" + target.encode()).digest()
