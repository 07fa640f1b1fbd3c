"""BlockPool: the sole owner of block ref counts, the free queue and the prefix hash index.

Invariants (checked by `check_integrity`):
- a block is in the free queue iff its ref count is 0;
- the free queue is in eviction order: head = next to be reused (least recently freed);
- the hash index maps a hash to exactly one block whose `block_hash` equals it, and every
  block with a hash is in the index; a block's hash is set once (when it becomes full) and
  cleared only when the block is reused for other content (eviction);
- a freed block keeps its content and its hash (content-retaining): a later prefix hit
  revives it from the middle of the free queue;
- a cached block counts its cached children (the blocks published with it as their chain
  parent), so the eviction policy can evict leaves first.

Which free block is reused next is the eviction policy's (cache/eviction.py): LRU (least
recently freed first) or COST (the default in the engine: scan resistant, cost aware, leaf
first, following whichever of its recency and frequency orders its shadow pools show
hitting more). Callers free a sequence's blocks tail-first (`free(blocks)` reverses them): the
last block of a sequence, the one least likely to be shared, goes first among equals, and a
shared prefix survives longest.
"""

from __future__ import annotations

import itertools
from collections import Counter, OrderedDict
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Protocol

from kvsession.cache.eviction import BOTH_ORDERS, DUEL_DECAY, CostAwareQueue, EvictionPolicy, Order
from kvsession.errors import CacheFullError


def blocks_for(num_tokens: int, block_size: int) -> int:
    """How many blocks hold `num_tokens` tokens (the last one possibly partial)."""
    return -(-num_tokens // block_size)


@dataclass(frozen=True)
class Evicted:
    """Cached content that an allocation is about to overwrite (its KV is still intact in
    block `block_id` until the caller of `allocate` writes there)."""

    block_id: int
    block_hash: bytes
    token_ids: tuple[int, ...]
    parent_hash: bytes | None  # the cached block its chain links to, if still cached
    hits: int = 1  # references its content took while cached here (1: used once)
    # the block's eviction count when this was taken (`BlockPool.next_victims`):
    # `still_holds` compares it to tell whether the content has been evicted since
    generation: int = 0


class EvictionSink(Protocol):
    """Keeps evicted content below the pool (the tier policy: copies it to the host tier,
    or from the host to the disk cache, when that is worth it). Called on the engine
    thread, inside `allocate`."""

    def evicting(self, victims: list[Evicted]) -> dict[int, str]:
        """Returns the ids of the victims whose content now lives in a lower tier, each
        with that tier's name ("host", "disk"). Must not raise (a failed copy is simply not
        kept) nor allocate from this pool."""


class EvictionState:
    """A cached block's bookkeeping for eviction (cache/eviction.py's cost rule), apart
    from what the pool needs to own and verify it."""

    __slots__ = ("parent", "generation", "num_children", "depth", "hits", "branches",
                 "shared", "copy_tier", "copy_cost", "keys", "tick", "queue_tick")

    def __init__(self):
        # chain structure of cached content: (parent block, its generation when linked);
        # the generation changes whenever a block's content is evicted, so a link to
        # content that is gone is recognised as stale
        self.parent: tuple[Block, int] | None = None
        self.generation = 0
        self.num_children = 0
        self.depth = 0  # position of the block in its chain (0: the first block)
        self.hits = 0  # references taken on this content since it was cached
        # distinct continuations published under this content (a recomputed child that
        # its ghost remembers is not a new one); `shared`: this block or a descendant has
        # branched, i.e. it is a prefix of several different continuations
        self.branches = 0
        self.shared = False
        self.copy_tier: str | None = None  # the content also lives in "host" / "disk"
        self.copy_cost = 1.0  # reload cost from that copy, as a fraction of recomputing
        # CostAwareQueue bookkeeping: priority per order, when freed, live heap entries
        self.keys: tuple[float, ...] = ()
        self.tick = 0
        self.queue_tick: int | None = None


class Block:
    __slots__ = ("block_id", "ref_cnt", "block_hash", "token_ids", "prev", "next", "evict")

    def __init__(self, block_id: int):
        self.block_id = block_id
        self.ref_cnt = 0
        self.block_hash: bytes | None = None
        self.token_ids: tuple[int, ...] | None = None  # stored for hit verification
        self.prev: Block | None = None  # intrusive free-queue links
        self.next: Block | None = None
        self.evict = EvictionState()

    def __repr__(self) -> str:
        h = self.block_hash.hex()[:8] if self.block_hash else None
        return f"Block({self.block_id}, ref={self.ref_cnt}, hash={h})"


class FreeQueue:
    """Intrusive doubly linked list of blocks: O(1) append, popleft and remove-from-middle."""

    last_reason = "lru"  # why the last victim was chosen (stats)

    def __init__(self, blocks: Iterable[Block]):
        self.head = Block(-1)  # sentinels
        self.tail = Block(-1)
        self.head.next, self.tail.prev = self.tail, self.head
        self.num_blocks = 0
        for b in blocks:
            self.append(b)

    def append(self, b: Block) -> None:
        last = self.tail.prev
        last.next, b.prev, b.next, self.tail.prev = b, last, self.tail, b
        self.num_blocks += 1

    def remove(self, b: Block) -> None:
        b.prev.next, b.next.prev = b.next, b.prev
        b.prev = b.next = None
        self.num_blocks -= 1

    def popleft(self) -> Block:
        if self.num_blocks == 0:
            raise CacheFullError("no free KV block")
        b = self.head.next
        self.remove(b)
        return b

    def __iter__(self) -> Iterator[Block]:
        b = self.head.next
        while b is not self.tail:
            yield b
            b = b.next

    def __contains__(self, b: Block) -> bool:
        return b.prev is not None


class BlockPool:
    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool = True,
                 eviction: EvictionPolicy = EvictionPolicy.LRU,
                 orders: tuple[Order, ...] = BOTH_ORDERS, shadow: bool = False,
                 grow: bool = False):
        """`orders`: the COST policy's victim orders; with more than one, the pool runs a
        metadata-only shadow pool per order and follows the better one (`observe`).
        `shadow`: this pool is such a shadow (hashes only, no tokens, no KV).
        `grow`: blocks are created as they are first needed (ids in order), not all at
        once: the host tier's pool, sized in bytes, may hold hundreds of thousands of
        small blocks of which a run uses few (COST eviction only: a block never used is
        taken before any cached content, as its queue takes uncached blocks first)."""
        if grow and eviction is not EvictionPolicy.COST:
            raise ValueError("a growing BlockPool needs COST eviction")
        self.num_blocks, self.block_size, self.is_shadow = num_blocks, block_size, shadow
        self.enable_caching, self.eviction = enable_caching, eviction
        self.blocks = [Block(i) for i in range(0 if grow else num_blocks)]
        self.free_queue: FreeQueue | CostAwareQueue = (
            FreeQueue(self.blocks) if eviction is EvictionPolicy.LRU
            else CostAwareQueue(self.blocks, block_size, FreeQueue, num_blocks, orders))
        # set dueling: one shadow per order replays every observed prompt; `duel_scores`
        # are their decayed hit counts (blocks)
        self.shadows: list[BlockPool] = []
        if eviction is EvictionPolicy.COST and enable_caching and len(orders) > 1:
            self.shadows = [BlockPool(num_blocks, block_size, True, eviction, (o,), True)
                            for o in orders]
        self.duel_scores = [0.0] * len(self.shadows)
        self.index: dict[bytes, Block] = {}
        self.num_evictions = 0
        # evicted cached content, by where a copy of it survives ("none", "host", "disk"),
        # and by why it was the victim ("lru"; "recency" / "frequency": the cheapest leaf
        # in that order; "non_leaf": only prefixes of blocks in use were free)
        self.evictions_by_copy: Counter[str] = Counter()
        self.evictions_by_reason: Counter[str] = Counter()
        # ghosts: what recently evicted content had earned (hash -> (hits, shared)), at
        # most one pool's worth. Content computed again while its ghost remembers it is a
        # re-use, not a one-off: it keeps its frequency and its shared mark (the ghost queue
        # of S3-FIFO / ARC), and it is not a new continuation of its parent
        self.ghosts: OrderedDict[bytes, tuple[int, bool]] = OrderedDict()
        self.sink: EvictionSink | None = None

    def attach_sink(self, sink: EvictionSink) -> None:
        """Install what keeps evicted content (the tier policy, built after the pool)."""
        self.sink = sink

    @property
    def num_free(self) -> int:
        """Blocks with ref count 0 (some may still hold reusable cached content), and those
        a growing pool has not created yet."""
        return self.free_queue.num_blocks + self.num_blocks - len(self.blocks)

    def _grow(self) -> None:
        """A growing pool with blocks still to create, about to take a victim: a block
        never used comes before any cached content (a new one joins the queue's uncached
        blocks)."""
        if not self.free_queue.uncached.num_blocks:
            b = Block(len(self.blocks))
            self.blocks.append(b)
            self.free_queue.append(b)

    def allocate(self, num_blocks: int) -> list[Block]:
        """Take `num_blocks` blocks from the head of the free queue (least recently freed),
        evicting their cached content. All-or-nothing: raises CacheFullError, changing
        nothing, when fewer are free."""
        if num_blocks > self.num_free:
            raise CacheFullError(f"asked for {num_blocks} KV blocks, {self.num_free} free")
        out, evicted, victims = [], [], []  # evicted: (block id, where a copy lives)
        for _ in range(num_blocks):
            # one at a time: evicting a leaf can make its parent the next victim
            if len(self.blocks) < self.num_blocks:
                self._grow()
            b = self.free_queue.popleft()
            if b.block_hash is not None:
                self.evictions_by_reason[self.free_queue.last_reason] += 1
                evicted.append((b.block_id, b.evict.copy_tier))
                if self.sink is not None:
                    victims.append(_evicted(b))
            self._evict(b)
            b.ref_cnt = 1
            out.append(b)
        # the victims' KV is intact until the caller writes these blocks: the sink copies it
        kept = self.sink.evicting(victims) if victims else {}
        for block_id, copy in evicted:
            self.evictions_by_copy[copy or kept.get(block_id, "none")] += 1
        return out

    def _evict(self, b: Block) -> None:
        if b.block_hash is not None:
            del self.index[b.block_hash]
            if self.eviction is EvictionPolicy.COST:
                self.ghosts[b.block_hash] = (b.evict.hits, b.evict.shared)
                if len(self.ghosts) > self.num_blocks:
                    self.ghosts.popitem(last=False)
            b.block_hash = b.token_ids = None
            self.num_evictions += 1
            if b.evict.parent is not None:
                parent, generation = b.evict.parent
                if parent.evict.generation == generation:
                    parent.evict.num_children -= 1
                    if parent.evict.num_children == 0 and parent.ref_cnt == 0 and \
                            isinstance(self.free_queue, CostAwareQueue):
                        self.free_queue.leaf(parent)
        b.evict.generation += 1
        b.evict.parent, b.evict.num_children, b.evict.depth, b.evict.hits = None, 0, 0, 0
        b.evict.branches, b.evict.shared = 0, False
        b.evict.copy_tier, b.evict.copy_cost = None, 1.0

    def cached_record(self, block_hash: bytes) -> Evicted | None:
        """The content cached under `block_hash` as a victim's record (its block, tokens,
        cached parent's hash, hits), or None when it is not cached here. Changes nothing:
        the tier policy reads a block's chain through it (`parent_hash`)."""
        b = self.index.get(block_hash)
        return _evicted(b) if b is not None else None

    def next_victims(self, num_blocks: int) -> list[Evicted]:
        """Changing nothing: the cached content that the next `num_blocks` allocations
        would evict, in eviction order, each as `allocate` hands it to the sink (with its
        `generation`). Blocks without content go first and evict nothing; under COST the
        cheapest free leaves follow, each prefix after its last cached child
        (`CostAwareQueue.cached_order`)."""
        if isinstance(self.free_queue, CostAwareQueue):
            empty = self.num_empty_free
            ahead = list(itertools.islice(self.free_queue.cached_order(),
                                          max(num_blocks - empty, 0)))
        else:
            ahead = [b for b in itertools.islice(self.free_queue, num_blocks)
                     if b.block_hash is not None]
        return [_evicted(b) for b in ahead]

    def still_holds(self, v: Evicted) -> bool:
        """Whether block `v.block_id` still holds the content `v` was taken from
        (`next_victims`): it has not been evicted since, so its bytes are the same (a full
        cached block is never written)."""
        b = self.blocks[v.block_id]
        return b.evict.generation == v.generation and b.block_hash == v.block_hash

    @property
    def num_empty_free(self) -> int:
        """Free blocks holding no content (and those a growing pool has not created yet):
        what can be allocated without evicting anything. COST pools only count them; an
        LRU pool takes its blocks in order whatever they hold, and reports 0."""
        if not isinstance(self.free_queue, CostAwareQueue):
            return 0
        return self.free_queue.uncached.num_blocks + self.num_blocks - len(self.blocks)

    def touch(self, blocks: Iterable[Block]) -> None:
        """Add a reference to each block (prefix hit, fork, pin); a free block is revived
        from the middle of the free queue and keeps its content."""
        for b in blocks:
            if b.ref_cnt == 0:
                self.free_queue.remove(b)
            b.ref_cnt += 1
            if b.block_hash is not None:
                b.evict.hits += 1
                b.evict.copy_tier = None  # whoever held the copy takes this block instead

    def free(self, blocks: Sequence[Block]) -> None:
        """Drop one reference from each of a sequence's blocks, tail first; blocks reaching
        0 join the free queue's tail (evicted last), keeping their cached content."""
        for b in reversed(blocks):
            if b.ref_cnt <= 0:
                raise RuntimeError(f"double free of {b}")
            b.ref_cnt -= 1
            if b.ref_cnt == 0:
                if b.block_hash is None or not self.enable_caching:
                    self._evict(b)
                self.free_queue.append(b)

    def cache_full_block(self, b: Block, block_hash: bytes, token_ids: Sequence[int],
                         parent_hash: bytes | None = None, earned_hits: int = 0) -> None:
        """Publish a full, computed block under its chained hash (`parent_hash`: the hash of
        the block before it in its sequence, None for the first block). If another block
        already holds that content, this one stays unpublished (it is freed like any
        other). `earned_hits`: the uses the content had in the tier it comes from (a lower
        tier's copy of an evicted block keeps its frequency, which its own admission
        below reads)."""
        if not self.enable_caching or b.block_hash is not None:
            return
        if block_hash in self.index:
            return
        b.block_hash, b.token_ids = block_hash, tuple(token_ids)
        self.index[block_hash] = b
        ghost = self.ghosts.pop(block_hash, None)
        b.evict.hits, b.evict.shared = (ghost[0] + 1, ghost[1]) if ghost is not None else (1, False)
        b.evict.hits = max(b.evict.hits, earned_hits)
        parent = self.index.get(parent_hash) if parent_hash is not None else None
        if parent is not None:
            ev, up = b.evict, parent.evict
            ev.parent, ev.depth = (parent, up.generation), up.depth + 1
            if parent.evict.num_children == 0:
                # it extends a chain end (a conversation's next turn): as likely to be
                # reused as the history it extends. A branch off a prefix that already has
                # continuations (a one-off query under a shared system prompt) does not.
                b.evict.hits = max(b.evict.hits, parent.evict.hits)
            parent.evict.num_children += 1
            if ghost is None:  # a new continuation, not the old one computed again
                parent.evict.branches += 1
            if parent.evict.branches >= 2 or b.evict.shared:
                self._mark_shared(parent)

    @staticmethod
    def _mark_shared(b: Block | None) -> None:
        """`b` branched: it and its cached ancestors are shared prefixes. Amortised O(1):
        each content is marked once, and the walk stops at a marked ancestor."""
        while b is not None and not b.evict.shared:
            b.evict.shared = True
            parent = b.evict.parent
            b = parent[0] if parent is not None and parent[0].evict.generation == parent[1] \
                else None

    def discard(self, b: Block) -> None:
        """Forget the content of a free block (its stored copy was found damaged): it is
        no longer found by hash and is reused before any cached block."""
        if b.ref_cnt != 0:
            raise RuntimeError(f"discard of {b}, which is referenced")
        self.free_queue.remove(b)
        self._evict(b)
        self.free_queue.append(b)

    def note_copy(self, blocks: Iterable[Block], tier: str, copy_cost: float) -> None:
        """The content of `blocks` (about to be freed) now also lives in `tier`, from where
        reloading costs `copy_cost` (a fraction of recomputing): cheaper to evict."""
        for b in blocks:
            if b.block_hash is not None:
                b.evict.copy_tier, b.evict.copy_cost = tier, min(max(copy_cost, 0.0), 1.0)

    def observe(self, block_hashes: Sequence[bytes]) -> None:
        """A prompt with these full-block hashes was admitted: replay it through each
        shadow (as if alone: hit the cached prefix, compute and publish the rest, free it)
        and follow the order whose shadow has hit more blocks recently. No-op without
        shadows."""
        if not self.shadows:
            return
        for i, shadow in enumerate(self.shadows):
            self.duel_scores[i] = self.duel_scores[i] * DUEL_DECAY + shadow.replay(
                block_hashes)
        q = self.free_queue
        lead = q.orders.index(q.leader)
        best = max(range(len(self.shadows)), key=self.duel_scores.__getitem__)
        if self.duel_scores[best] > self.duel_scores[lead]:
            q.leader = q.orders[best]

    def replay(self, block_hashes: Sequence[bytes]) -> int:
        """A shadow's step: one prompt as if it ran alone (the shadow holds no references
        between prompts). Returns the number of leading blocks it hit."""
        n = min(len(block_hashes), self.num_blocks)
        hits = []
        for h in block_hashes[:n]:
            b = self.index.get(h)
            if b is None:
                break
            hits.append(b)
        self.touch(hits)
        blocks = hits + self.allocate(n - len(hits))
        for i in range(len(hits), n):
            self.cache_full_block(blocks[i], block_hashes[i], (),
                                  block_hashes[i - 1] if i else None)
        self.free(blocks)
        return len(hits)

    def lookup(self, block_hash: bytes, token_ids: Sequence[int]) -> Block | None:
        """The cached block with this hash *and* these exact tokens, else None. Does not
        take a reference (call `touch`)."""
        b = self.index.get(block_hash)
        if b is None or b.token_ids != tuple(token_ids):
            return None  # a hash collision is a miss, never a wrong hit
        return b

    def lookup_run(self, token_ids: Sequence[int], hashes: Sequence[bytes], start: int,
                   end: int) -> list[Block]:
        """The cached blocks holding blocks start..end-1 of `token_ids` (whose chained
        hashes are `hashes`), each verified as `lookup` does, up to the first miss: a
        chained hash after a missing block can never match. Takes no references."""
        bs, hits = self.block_size, []
        for i in range(start, end):
            b = self.lookup(hashes[i], token_ids[i * bs:(i + 1) * bs])
            if b is None:
                break
            hits.append(b)
        return hits

    def check_integrity(self) -> None:
        """Raise AssertionError if any invariant in the module docstring is broken."""
        in_queue = list(self.free_queue)
        ids = [b.block_id for b in in_queue]
        if len(set(ids)) != len(ids) or len(ids) != self.free_queue.num_blocks:
            raise AssertionError(f"free queue corrupt: {ids}")
        for b in self.blocks:
            if b.ref_cnt < 0:
                raise AssertionError(f"negative ref count: {b}")
            if (b.ref_cnt == 0) != (b in self.free_queue):
                raise AssertionError(f"free-queue membership disagrees with ref count: {b}")
            if b.block_hash is not None and self.index.get(b.block_hash) is not b:
                raise AssertionError(f"hashed block missing from index: {b}")
        for h, b in self.index.items():
            if b.block_hash != h or b.token_ids is None or \
                    len(b.token_ids) != (0 if self.is_shadow else self.block_size):
                raise AssertionError(f"index entry inconsistent: {b}")
        children = Counter(_live_parent(b).block_id for b in self.blocks
                           if _live_parent(b) is not None)
        for b in self.blocks:
            if b.evict.num_children != children[b.block_id]:
                raise AssertionError(f"{b}: counts {b.evict.num_children} cached children, "
                                     f"{children[b.block_id]} link to it")
            up = _live_parent(b)
            if b.evict.shared and up is not None and not up.evict.shared:
                raise AssertionError(f"{b} is a shared prefix, its cached parent is not")
        for shadow in self.shadows:
            shadow.check_integrity()


def _evicted(b: Block) -> Evicted:
    """A cached block's content as the sink sees it, before the block is evicted."""
    parent = _live_parent(b)
    return Evicted(b.block_id, b.block_hash, b.token_ids,
                   parent.block_hash if parent is not None else None, b.evict.hits,
                   b.evict.generation)


def _live_parent(b: Block) -> Block | None:
    """The cached block `b`'s chain links to, if its content is still the one linked."""
    link = b.evict.parent
    return link[0] if link is not None and link[0].evict.generation == link[1] else None
