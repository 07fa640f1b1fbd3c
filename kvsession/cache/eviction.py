"""Which free block is reused next: the eviction order of BlockPool's free blocks.

Two policies with one interface (the free queue's: `append` a freed block, `remove` a
revived one, `popleft` the victim, iterate in eviction order):

- LRU (`block_pool.FreeQueue`): least recently freed first. Simple, but a scan of one-off
  prompts larger than the pool flushes every reused prefix.
- COST (`CostAwareQueue`, the engine's default): scan resistant, cost aware, leaf first.
  A freed block gets the priority `H = clock + value`, `value = min(hits, 2) * cost`; the
  victim is the block with the lowest H. The clock is logical time: it advances by one
  every `2 * num_blocks` blocks freed, so a block that is not referenced again ages out
  after about two pool turnovers (recency), a block that was reused survives one more
  (frequency: a one-off scan leaves before a prefix that was hit, so a scan larger than
  the pool cannot flush it), and a block that is expensive to get back survives longer.
  `cost` is the reload cost relative to recomputing a block at position 0: recomputing
  grows with the block's position (attention over the prefix; the quadratic knee of
  docs/cost-model.md), and a block whose content also lives in the host or disk tier costs
  only the load from there (`copy_cost`, a fraction of recomputing, set when the tier mover
  spills it). Referenced blocks are never here (a free block has ref count 0), so pinned
  and in-use blocks are never victims.
  Leaf-first: a cached block with cached children is *parked*, not a candidate, until its
  last cached child is evicted: a prefix is never evicted while a block that depends on it
  survives. A parked block keeps the priority it got when freed, so a dead chain drains
  tail first without fresh leases. Free blocks without content are always reused first.
  Frequency of new content: a block that extends a chain end (a conversation's next turn)
  starts with its parent's hit count, a block branching off a prefix that already has
  continuations (a one-off query under a shared system prompt) with 1
  (BlockPool.cache_full_block).
  The constants (2 turnovers, hits capped at 2) were chosen on bench/eviction.py's traces:
  a stronger frequency term (no cap) gains 1-2 points on a Zipf conversation trace but
  loses up to 3 points to LRU on agent traces with a tight pool; see docs/benchmarks.md.
  Operations are O(log n) (a heap with lazy deletion).
"""

from __future__ import annotations

import enum
import heapq
import itertools
from collections.abc import Iterator
from typing import TYPE_CHECKING

from kvsession.errors import CacheFullError

if TYPE_CHECKING:  # block_pool imports this module
    from kvsession.cache.block_pool import Block, FreeQueue

# attention makes recomputing a token at position p cost ~(1 + p / knee) times one at
# position 0 (the same knee as costmodel.recompute_ms; docs/cost-model.md)
POSITION_KNEE_TOKENS = 32768
TURNOVERS_PER_CLOCK_UNIT = 2  # pool turnovers (blocks freed / pool size) per clock unit
MAX_COUNTED_HITS = 2


class EvictionPolicy(enum.Enum):
    LRU = "lru"
    COST = "cost"


class CostAwareQueue:
    def __init__(self, blocks, block_size: int, free_queue_type: type[FreeQueue],
                 num_blocks: int):
        self.block_size = block_size
        self._frees_per_unit = TURNOVERS_PER_CLOCK_UNIT * max(num_blocks, 1)
        self.uncached = free_queue_type(())  # no content: reused first, FIFO
        self._heap: list[tuple[float, int, Block]] = []  # (H, tick, block): cached leaves
        self._parked: dict[int, Block] = {}  # cached free blocks with cached children
        self._ticks = itertools.count()
        self.clock = 0.0  # logical time, in units of TURNOVERS_PER_CLOCK_UNIT pool turnovers
        self._frees = 0
        self.num_blocks = 0
        self.last_reason = "score"  # why the last victim was chosen (stats)
        for b in blocks:
            self.append(b)

    def value(self, b: Block) -> float:
        """hits x reload cost: what evicting the block is expected to cost."""
        return min(b.hits, MAX_COUNTED_HITS) * self.cost(b)

    def cost(self, b: Block) -> float:
        recompute = 1.0 + b.depth * self.block_size / POSITION_KNEE_TOKENS
        return recompute * (b.copy_cost if b.copy_tier is not None else 1.0)

    # ---- the free-queue interface --------------------------------------------------------

    def append(self, b: Block) -> None:
        """`b` was just freed (ref count 0)."""
        self.num_blocks += 1
        if b.block_hash is None:
            self.uncached.append(b)
            b.heap_key = None
        else:
            # priced when freed; a parked block keeps that price until it becomes a leaf
            # (re-pricing it then would give every block of a dead chain a fresh lease)
            self._frees += 1
            self.clock = self._frees / self._frees_per_unit
            key = (self.clock + self.value(b), next(self._ticks))
            if b.num_children:
                self._parked[b.block_id] = b
                b.heap_key, b.parked_key = None, key
            else:
                self._push(b, key)

    def _push(self, b: Block, key: tuple[float, int]) -> None:
        b.heap_key = key
        heapq.heappush(self._heap, (*key, b))

    def remove(self, b: Block) -> None:
        """`b` is referenced again (a prefix hit, a fork): it leaves the queue."""
        self.num_blocks -= 1
        if b in self.uncached:
            self.uncached.remove(b)
        elif self._parked.pop(b.block_id, None) is None:
            b.heap_key = None  # its heap entry is stale now; dropped when it surfaces
        self._compact()

    def popleft(self) -> Block:
        """The victim: a block without content, else the cheapest leaf."""
        if self.uncached.num_blocks:
            self.num_blocks -= 1
            return self.uncached.popleft()
        while self._heap:
            h, tick, b = heapq.heappop(self._heap)
            if b.heap_key == (h, tick):
                b.heap_key = None
                self.last_reason = "score"
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
            self._push(b, b.parked_key)

    def __iter__(self) -> Iterator[Block]:
        """The eviction order if nothing else happened: blocks without content, then the
        leaves by priority, each prefix entering when its last cached child has gone
        (blocks whose descendants are in use last)."""
        yield from self.uncached
        heap = [e for e in self._heap if e[2].heap_key == (e[0], e[1])]
        heapq.heapify(heap)
        parked = dict(self._parked)
        remaining: dict[int, int] = {}
        while heap:
            *_, b = heapq.heappop(heap)
            yield b
            if b.parent is not None:
                p, generation = b.parent
                if p.generation == generation and p.block_id in parked:
                    left = remaining[p.block_id] = remaining.get(p.block_id,
                                                                 p.num_children) - 1
                    if left == 0:
                        del parked[p.block_id]
                        heapq.heappush(heap, (*p.parked_key, p))
        yield from parked.values()

    def __contains__(self, b: Block) -> bool:
        return b in self.uncached or b.heap_key is not None or b.block_id in self._parked

    def _compact(self) -> None:
        """Rebuild the heap when stale entries dominate (keeps memory O(free blocks))."""
        if len(self._heap) > 64 and len(self._heap) > 2 * self.num_blocks:
            self._heap = [e for e in self._heap if e[2].heap_key == (e[0], e[1])]
            heapq.heapify(self._heap)
