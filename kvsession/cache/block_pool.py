"""BlockPool: the sole owner of block ref counts, the free queue and the prefix hash index.

Invariants (checked by `check_integrity`):
- a block is in the free queue iff its ref count is 0;
- the free queue is in eviction order: head = next to be reused (least recently freed);
- the hash index maps a hash to exactly one block whose `block_hash` equals it, and every
  block with a hash is in the index; a block's hash is set once (when it becomes full) and
  cleared only when the block is reused for other content (eviction);
- a freed block keeps its content and its hash (content-retaining LRU): a later prefix hit
  revives it from the middle of the free queue in O(1).

Callers free a sequence's blocks tail-first (`free(blocks)` reverses them): the last block
of a sequence, the one least likely to be shared, is evicted first, and a shared prefix
survives longest.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence

from kvsession.errors import CacheFullError


def blocks_for(num_tokens: int, block_size: int) -> int:
    """How many blocks hold `num_tokens` tokens (the last one possibly partial)."""
    return -(-num_tokens // block_size)


class Block:
    __slots__ = ("block_id", "ref_cnt", "block_hash", "token_ids", "prev", "next")

    def __init__(self, block_id: int):
        self.block_id = block_id
        self.ref_cnt = 0
        self.block_hash: bytes | None = None
        self.token_ids: tuple[int, ...] | None = None  # stored for hit verification
        self.prev: Block | None = None  # intrusive free-queue links
        self.next: Block | None = None

    def __repr__(self) -> str:
        h = self.block_hash.hex()[:8] if self.block_hash else None
        return f"Block({self.block_id}, ref={self.ref_cnt}, hash={h})"


class FreeQueue:
    """Intrusive doubly linked list of blocks: O(1) append, popleft and remove-from-middle."""

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
    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool = True):
        self.num_blocks, self.block_size = num_blocks, block_size
        self.enable_caching = enable_caching
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.free_queue = FreeQueue(self.blocks)
        self.index: dict[bytes, Block] = {}
        self.num_evictions = 0

    @property
    def num_free(self) -> int:
        """Blocks with ref count 0 (some may still hold reusable cached content)."""
        return self.free_queue.num_blocks

    def allocate(self, num_blocks: int) -> list[Block]:
        """Take `num_blocks` blocks from the head of the free queue (least recently freed),
        evicting their cached content. All-or-nothing: raises CacheFullError, changing
        nothing, when fewer are free."""
        if num_blocks > self.num_free:
            raise CacheFullError(f"asked for {num_blocks} KV blocks, {self.num_free} free")
        out = []
        for _ in range(num_blocks):
            b = self.free_queue.popleft()
            self._evict(b)
            b.ref_cnt = 1
            out.append(b)
        return out

    def _evict(self, b: Block) -> None:
        if b.block_hash is not None:
            del self.index[b.block_hash]
            b.block_hash = b.token_ids = None
            self.num_evictions += 1

    def touch(self, blocks: Iterable[Block]) -> None:
        """Add a reference to each block (prefix hit, fork, pin); a free block is revived
        from the middle of the free queue and keeps its content."""
        for b in blocks:
            if b.ref_cnt == 0:
                self.free_queue.remove(b)
            b.ref_cnt += 1

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

    def cache_full_block(self, b: Block, block_hash: bytes, token_ids: Sequence[int]) -> None:
        """Publish a full, computed block under its chained hash. If another block already
        holds that content, this one stays unpublished (it is freed like any other)."""
        if not self.enable_caching or b.block_hash is not None:
            return
        if block_hash in self.index:
            return
        b.block_hash, b.token_ids = block_hash, tuple(token_ids)
        self.index[block_hash] = b

    def lookup(self, block_hash: bytes, token_ids: Sequence[int]) -> Block | None:
        """The cached block with this hash *and* these exact tokens, else None. Does not
        take a reference (call `touch`)."""
        b = self.index.get(block_hash)
        if b is None or b.token_ids != tuple(token_ids):
            return None  # a hash collision is a miss, never a wrong hit
        return b

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
            if b.block_hash != h or b.token_ids is None or len(b.token_ids) != self.block_size:
                raise AssertionError(f"index entry inconsistent: {b}")
