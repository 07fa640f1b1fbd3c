"""Which free block is reused next: the eviction order of BlockPool's free blocks.

Two policies with one interface (the free queue's: `append` a freed block, `remove` a
revived one, `popleft` the victim, iterate in eviction order):

- LRU (`block_pool.FreeQueue`): least recently freed first. Simple, but a scan of one-off
  prompts larger than the pool flushes every reused prefix.
- COST (`CostAwareQueue`, the engine's default): scan resistant, cost aware, leaf first,
  and adaptive between recency and frequency.
  A freed block gets one priority per *order*, `H = clock + value`, `value = f(hits) *
  cost`; the victim is the block with the lowest H in the leading order. The clock is
  logical time: it advances by one every `turnovers * num_blocks` cached blocks freed.
  Two orders, because which signal predicts reuse depends on the workload:
  - RECENCY (2 turnovers per clock unit, hits counted up to 2): a block not referenced
    again ages out after about two pool turnovers, a reused block survives one more (so a
    one-off scan larger than the pool cannot flush a prefix that was hit), and a shared
    prefix (one that has branched into different continuations: a system prompt, a tool
    schema) counts its hits on a log scale (`log2(1 + hits)`), so it outlives a private
    history. Right for agent sessions: bursts of turns, then never again.
  - FREQUENCY (1 turnover per clock unit, hits uncounted: all of them): what was reused
    often stays, however long ago; the clock only retires what stopped being used
    (LFU with dynamic aging, GDSF). Right for independent references over a long tail
    (Mooncake-style conversations with Zipf popularity), where recency says little.
  The pool replays every prompt's block hashes through two metadata-only shadow pools,
  one per order (BlockPool.observe), and follows the order whose shadow hit more blocks
  over the recent prompts (exponentially weighted, about the last 200): set dueling.
  `cost` is the reload cost relative to recomputing a block at position 0: recomputing
  grows with the block's position (attention over the prefix: the marginal form of the
  cost model's knee, docs/cost-model.md), and a block whose content also lives in the host
  or disk tier costs only the load from there (`copy_cost`, a fraction of recomputing, set
  when the tier mover spills it). Referenced blocks are never here (a free block has ref
  count 0), so pinned and in-use blocks are never victims.
  Leaf-first: a cached block with cached children is *parked*, not a candidate, until its
  last cached child is evicted: a prefix is never evicted while a block that depends on it
  survives. A parked block keeps the priorities it got when freed, so a dead chain drains
  tail first without fresh leases. Free blocks without content are always reused first.
  Frequency of new content: a block that extends a chain end (a conversation's next turn)
  starts with its parent's hit count, a block branching off a prefix that already has
  continuations (a one-off query under a shared system prompt) with 1; content computed
  again while its ghost remembers it keeps its count (BlockPool.cache_full_block).
  The constants were chosen on bench/eviction.py's traces (docs/benchmarks.md).
  Operations are O(log n) (one heap per order, lazy deletion); a shadow costs the same
  per prompt block as the real pool.
"""

from __future__ import annotations

import enum
import heapq
import itertools
import math
from collections.abc import Iterator
from typing import TYPE_CHECKING

from kvsession.errors import CacheFullError

if TYPE_CHECKING:  # block_pool imports this module
    from kvsession.cache.block_pool import Block, FreeQueue

# recomputing a token at position p costs its position-independent work (projections, MLP)
# plus attention over the p tokens before it, which equals that work at the knee: ~(1 + p /
# knee) times a token at position 0. The marginal form of the cost model's knee (a whole
# prefix's recompute grows past it by sqrt(n / knee): costmodel.recompute_ms), same constant
POSITION_KNEE_TOKENS = 32768
MAX_COUNTED_HITS = 2  # the recency order's cap on a private block's hit count
# the shadows' hit counts decay by this factor per observed prompt (a memory of ~200)
DUEL_DECAY = 0.995


class EvictionPolicy(enum.Enum):
    LRU = "lru"
    COST = "cost"


class Order(enum.Enum):
    """A victim order of the COST policy (also the reason recorded for its evictions)."""

    RECENCY = "recency"
    FREQUENCY = "frequency"


# pool turnovers (cached blocks freed / pool size) per clock unit
TURNOVERS_PER_CLOCK_UNIT = {Order.RECENCY: 2, Order.FREQUENCY: 1}
BOTH_ORDERS = (Order.RECENCY, Order.FREQUENCY)


class CostAwareQueue:
    def __init__(self, blocks, block_size: int, free_queue_type: type[FreeQueue],
                 num_blocks: int, orders: tuple[Order, ...] = BOTH_ORDERS):
        self.block_size = block_size
        self.orders = orders
        self.leader = orders[0]  # the order victims are taken in
        self._frees_per_unit = [TURNOVERS_PER_CLOCK_UNIT[o] * max(num_blocks, 1)
                                for o in orders]
        self.uncached = free_queue_type(())  # no content: reused first, FIFO
        # per order: (H, tick, block) of cached leaves; an entry is live while its block's
        # queue_tick equals its tick (lazy deletion)
        self._heaps: list[list[tuple[float, int, Block]]] = [[] for _ in orders]
        self._parked: dict[int, Block] = {}  # cached free blocks with cached children
        self._ticks = itertools.count()
        self._frees = 0
        self.num_blocks = 0
        self.last_reason = orders[0].value  # why the last victim was chosen (stats)
        for b in blocks:
            self.append(b)

    def value(self, b: Block, order: Order = Order.RECENCY) -> float:
        """f(hits) x reload cost: what evicting the block is expected to cost, in clock
        units of `order`."""
        if order is Order.FREQUENCY:
            counted = float(b.evict.hits)
        else:
            counted = min(b.evict.hits, MAX_COUNTED_HITS)
            if b.evict.shared:  # a prefix of several continuations: its hits count, damped
                counted = max(counted, math.log2(1 + b.evict.hits))
        return counted * self.cost(b)

    def cost(self, b: Block) -> float:
        recompute = 1.0 + b.evict.depth * self.block_size / POSITION_KNEE_TOKENS
        return recompute * (b.evict.copy_cost if b.evict.copy_tier is not None else 1.0)

    # ---- the free-queue interface --------------------------------------------------------

    def append(self, b: Block) -> None:
        """`b` was just freed (ref count 0)."""
        self.num_blocks += 1
        if b.block_hash is None:
            self.uncached.append(b)
            b.evict.queue_tick = None
            return
        # priced when freed; a parked block keeps that price until it becomes a leaf
        # (re-pricing it then would give every block of a dead chain a fresh lease)
        self._frees += 1
        b.evict.keys = tuple(self._frees / per + self.value(b, o)
                       for o, per in zip(self.orders, self._frees_per_unit, strict=True))
        b.evict.tick = next(self._ticks)
        if b.evict.num_children:
            self._parked[b.block_id] = b
            b.evict.queue_tick = None
        else:
            self._push(b)
        self._compact()  # victims leave only the leader's heap: the others' entries go stale

    def _push(self, b: Block) -> None:
        b.evict.queue_tick = b.evict.tick
        for heap, key in zip(self._heaps, b.evict.keys, strict=True):
            heapq.heappush(heap, (key, b.evict.tick, b))

    def remove(self, b: Block) -> None:
        """`b` is referenced again (a prefix hit, a fork): it leaves the queue."""
        self.num_blocks -= 1
        if b in self.uncached:
            self.uncached.remove(b)
        elif self._parked.pop(b.block_id, None) is None:
            b.evict.queue_tick = None  # its heap entries are stale now; dropped when they surface
        self._compact()

    def popleft(self) -> Block:
        """The victim: a block without content, else the leading order's cheapest leaf."""
        if self.uncached.num_blocks:
            self.num_blocks -= 1
            return self.uncached.popleft()
        heap = self._heaps[self.orders.index(self.leader)]
        while heap:
            _, tick, b = heapq.heappop(heap)
            if b.evict.queue_tick == tick:
                b.evict.queue_tick = None
                self.last_reason = self.leader.value
                self.num_blocks -= 1
                return b
        if self._parked:  # only non-leaves are free: their children are all in use
            _, b = self._parked.popitem()
            self.last_reason = "non_leaf"
            self.num_blocks -= 1
            return b
        raise CacheFullError("no free KV block")

    def leaf(self, b: Block) -> None:
        """`b`'s last cached child was evicted: a parked block becomes a candidate."""
        if self._parked.pop(b.block_id, None) is not None:
            self._push(b)

    def __iter__(self) -> Iterator[Block]:
        """The eviction order if nothing else happened: blocks without content, then the
        cached ones (`cached_order`)."""
        yield from self.uncached
        yield from self.cached_order()

    def cached_order(self) -> Iterator[Block]:
        """The free cached blocks in eviction order if nothing else happened: the leaves by
        the leading order's priority, each prefix entering when its last cached child has
        gone, then the prefixes whose descendants are in use. Lazy, changing nothing: a
        walk down the heap from its root, cheapest first, stale entries skipped, so the
        first k cost O(k log k) and never the whole heap (the tier policy peeks at the next
        victims every step)."""
        i = self.orders.index(self.leader)
        heap = self._heaps[i]
        # ((key, tick, block), its index in `heap`, or -1 for a prefix exposed here)
        frontier = [(heap[0], 0)] if heap else []
        remaining: dict[int, int] = {}  # per parked prefix: cached children still ahead
        while frontier:
            (_, tick, b), at = heapq.heappop(frontier)
            if at >= 0:
                for child in (2 * at + 1, 2 * at + 2):
                    if child < len(heap):
                        heapq.heappush(frontier, (heap[child], child))
                if b.evict.queue_tick != tick:
                    continue  # stale
            yield b
            if b.evict.parent is not None:
                p, generation = b.evict.parent
                if p.evict.generation == generation and p.block_id in self._parked:
                    left = remaining[p.block_id] = remaining.get(p.block_id,
                                                                 p.evict.num_children) - 1
                    if left == 0:
                        heapq.heappush(frontier, ((p.evict.keys[i], p.evict.tick, p), -1))
        yield from (b for b in self._parked.values() if remaining.get(b.block_id) != 0)

    def __contains__(self, b: Block) -> bool:
        return b in self.uncached or b.evict.queue_tick is not None or b.block_id in self._parked

    @property
    def num_entries(self) -> int:
        """Heap entries, live and stale (bounded by ~2 per free block and order)."""
        return sum(len(heap) for heap in self._heaps)

    def _compact(self) -> None:
        """Rebuild a heap when stale entries dominate (keeps memory O(free blocks); each
        rebuild follows at least as many insertions as it keeps, so O(1) amortised)."""
        for i, heap in enumerate(self._heaps):
            if len(heap) > 64 and len(heap) > 2 * self.num_blocks:
                self._heaps[i] = [e for e in heap if e[2].evict.queue_tick == e[1]]
                heapq.heapify(self._heaps[i])
