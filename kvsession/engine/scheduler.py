"""The scheduler: the only place that decides what runs in a step.

Continuous batching with chunked prefill, by priority (lower is more urgent, as vLLM), FCFS
within a priority. Each step has a token budget (`max_num_batched_tokens`) and a sequence
cap (`max_num_seqs`). Running sequences go first, the most urgent first (equal priorities in
admission order), each taking what it still has to compute (1 token when decoding, a chunk
of its prompt otherwise); then waiting sequences are admitted, the most urgent first, while
budget, seats and blocks last, a few blocks kept back for the running sequences to grow
into (`headroom`). When blocks run out, the last running sequence (the least urgent, the
newest among equals) is preempted by recompute: its blocks are freed (tail first, content
kept, so its full blocks can be hit again when it is readmitted) and it goes back to the
queue. The first sequence therefore always progresses: no deadlock, and no request is
lost.

Long prompts share a step (`PrefillCaps`): a prompt with more than
`long_prefill_token_threshold` tokens left to compute takes at most that many in the step's
first pass, at most `max_long_partial_prefills` long prompts are in the middle of their
prefill at once (a short request behind a waiting long one is admitted past it), and at
most `max_num_partial_prefills` prompts of any length; a step of long prefills alone
(nothing decodes, nothing else was admitted) gets the whole budget (`_top_up`), so a long
prompt alone goes as fast as without caps. With `llm.slo` set, SLO-aware chunking
(`ChunkLimit`) bounds a long prompt's share further: beside decodes to what the TPOT target
leaves (0: it sits the step out), alone to what a quarter of the TTFT target holds.
Without caps a prefill takes all the budget left and admission stops at 0: a two-block tool
result waits behind a 30k-token prompt's ~15 steps, each as long as the budget makes it.

    one step, budget B, threshold T:
    |decodes: 1 each|long prefill: <= T|admitted short prompts|   (left unused)   |
    |long prefill alone: T, then the top-up                                       |
    0                                                                             B
"""

from __future__ import annotations

import time
from collections import deque
from concurrent.futures import FIRST_COMPLETED, Future, wait
from dataclasses import dataclass
from typing import Protocol

from kvsession.cache.block_pool import blocks_for
from kvsession.cache.manager import KVCacheManager, Quarantine
from kvsession.cache.prefix import PrefixCache
from kvsession.config import PrefillCaps
from kvsession.engine.sequence import Sequence, SequenceStatus

# admission keeps min(running sequences, num_blocks // HEADROOM_DIVISOR) blocks free: room
# for the running sequences' next blocks, so a sequence is not admitted only to be preempted
# when one of them grows (a preemption storm). On the engine stress workload (tests/
# test_engine.py's, pools of 40 / 64 / 128 blocks) preemptions fell 36 -> 25, 33 -> 15,
# 13 -> 6 and recomputed prompt tokens 1-5%, for 0.5-3% more steps
HEADROOM_DIVISOR = 16


@dataclass(frozen=True)
class ScheduledSeq:
    """One sequence's work in a step: `num_new_tokens` positions from its
    `num_computed_tokens` on, of which the last `num_draft_tokens` are its drafts.

        token_ids:  | computed             | t | d0 d1 .. d(k-1) |
                    0          num_computed_tokens ^              ^ + num_new_tokens
                    (t: its last token; d: seq.draft_token_ids[:k], k = num_draft_tokens)
    """

    seq: Sequence
    num_new_tokens: int
    num_draft_tokens: int = 0

    @property
    def samples(self) -> bool:
        """This chunk reaches the end of the sequence's tokens, so a token is sampled (one
        per position from `t` on when it verifies drafts)."""
        return (self.seq.num_computed_tokens + self.num_new_tokens - self.num_draft_tokens
                == self.seq.num_tokens)

    @property
    def num_rows(self) -> int:
        """The positions whose logits it samples from: the last, or `t` and each draft."""
        return 1 + self.num_draft_tokens if self.samples else 0


DEFERRED = object()  # _admit's answer when the sequence should wait for an in-flight block
REMOTE = object()  # _admit's answer when the sequence's prefill went to a remote worker
LOADING = object()  # _admit's answer when its blocks are coming from a lower tier


class Reclaimer(Protocol):
    """Frees device blocks by moving idle sessions off the device (the tier policy)."""

    def reclaim(self, num_blocks: int) -> int:
        """Free about `num_blocks` device blocks; returns how many were freed."""


class LowerTiers(Protocol):
    """Blocks that missed on the device but a lower tier holds by content (the tier policy
    over the host tier and the disk cache): found, then loaded, for any prompt."""

    def lower_hits(self, token_ids: list[int], hashes: list[bytes], start: int,
                   num_blocks: int) -> list:
        """What holds blocks start.. (up to num_blocks) of a prompt, verified, up to the
        first miss; empty when loading them is not worth it. Takes nothing."""

    def load_lower(self, holder: Sequence, found: list, token_ids: list[int],
                   hashes: list[bytes], start: int) -> int:
        """Copy `found` (from `lower_hits`, this engine call: blocks start.. of the prompt
        `token_ids` / `hashes`) into fresh device blocks, published, appended to the
        holder's table. Returns how many leading ones were loaded (a damaged copy on disk
        ends the run: the rest is computed)."""

    def start_lower(self, holder: Sequence, found: list, token_ids: list[int],
                    hashes: list[bytes], start: int) -> LowerLoadTicket:
        """`load_lower` off the engine thread: the holder's next blocks are in its table at
        once, filled when the ticket's `future` is done."""

    def finish_lower(self, ticket: LowerLoadTicket) -> int:
        """Engine thread, the ticket's future done: publish what was loaded; returns how
        many leading blocks that is."""

    def reused(self, hits: list) -> None:
        """A prompt's device hits, just referenced: their content is used once more (a
        tier shared with other processes may take it now, before any eviction)."""


class LowerLoadTicket(Protocol):
    """A load started by `LowerTiers.start_lower`."""

    future: Future


class ChunkLimit(Protocol):
    """How many tokens of a long prompt a step may take (SLO-aware chunking:
    engine/slo_chunking.py)."""

    def prefill_tokens(self, num_decodes: int, min_tokens: int, context_tokens: int
                       ) -> int | None:
        """For a long prompt `context_tokens` into its prefill, in a step with `num_decodes`
        decodes: at least `min_tokens`, or 0 (it sits the step out: only beside decodes);
        None: no limit."""


class DraftProposer(Protocol):
    """Drafts for a decoding sequence, verified in the same step (engine/drafts.py)."""

    def propose(self, seq: Sequence, num_decodes: int) -> list[int]:
        """Tokens proposed to follow `seq` (one token left to compute) in a step with
        `num_decodes` decoding sequences; [] for none."""


class OffloadDecider(Protocol):
    """Decides whether a sequence's prefill goes to a remote worker."""

    def should_offload(self, seq: Sequence, num_cached: int) -> bool:
        """`num_cached`: the leading tokens whose KV the caller already holds (prefix hits,
        a session's earlier turns); only the rest would move."""


class Scheduler:
    def __init__(self, manager: KVCacheManager, prefix: PrefixCache, max_num_seqs: int,
                 max_num_batched_tokens: int, offload: OffloadDecider | None = None,
                 caps: PrefillCaps | None = None):
        """`offload` decides remote prefills (None: never). `caps`: how long prompts share
        a step (None: uncapped, a prefill takes all the budget left)."""
        self.caps = caps
        self.manager, self.pool, self.prefix = manager, manager.pool, prefix
        self.reclaimer: Reclaimer | None = None
        self.lower: LowerTiers | None = None
        self.chunk_limit: ChunkLimit | None = None
        self.drafts: DraftProposer | None = None
        self._last_need = 0
        # remote prefill: sequences whose prompt KV a worker is writing wait in `remote`
        # holding their blocks; `new_remote` lists the ones admitted this step (the engine
        # submits them); `quarantine` holds the blocks of failed remote prefills until no
        # late write can reach them.
        self.offload = offload
        self.remote: dict[int, Sequence] = {}
        self.new_remote: list[Sequence] = []
        self.quarantine: dict[int, Quarantine] = {}
        # sequences admitted with blocks that a lower tier's copy is filling (the copier):
        # they hold their blocks and join `running` when it is done (`poll_loads`)
        self.loading: dict[int, tuple[Sequence, LowerLoadTicket, int]] = {}
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0

    def attach_reclaimer(self, reclaimer: Reclaimer) -> None:
        """Install the tier policy, tried before preempting or failing (it is built after
        the scheduler because it reads the scheduler's queue depth)."""
        self.reclaimer = reclaimer

    def attach_lower_tiers(self, lower: LowerTiers) -> None:
        """Install the lower tiers a prompt's device misses are looked up in (the tier
        policy, built after the scheduler)."""
        self.lower = lower

    def attach_chunk_limit(self, limit: ChunkLimit) -> None:
        """Install SLO-aware chunking (the engine's measurements against `llm.slo`)."""
        self.chunk_limit = limit

    def attach_drafts(self, drafts: DraftProposer) -> None:
        """Install the drafter (jump-forward, speculation): a decoding sequence's step then
        also computes its drafts, as far as budget and free blocks allow."""
        self.drafts = drafts

    def reclaim(self, num_blocks: int) -> int:
        return self.reclaimer.reclaim(num_blocks) if self.reclaimer is not None else 0

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def queue_depth(self) -> int:
        """Sequences waiting for or in the middle of their prefill."""
        return len(self.waiting) + sum(
            1 for s in self.running if s.num_computed_tokens < s.num_prompt_tokens)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running or self.remote or self.loading)

    def poll_loads(self) -> list[Sequence]:
        """Engine thread: sequences whose lower-tier blocks have arrived join `running`
        (one whose copy stopped short computes the rest: its blocks are in its table).
        Returns them."""
        ready = []
        for seq_id, (seq, ticket, num_found) in list(self.loading.items()):
            if not ticket.future.done():
                continue
            del self.loading[seq_id]
            short = (num_found - self.lower.finish_lower(ticket)) * self.pool.block_size
            seq.num_computed_tokens -= short
            seq.num_cached_tokens = min(seq.num_cached_tokens, seq.num_computed_tokens)
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            ready.append(seq)
        return ready

    def wait_loads(self, timeout_s: float) -> None:
        """Engine thread with nothing else to run: wait (at most `timeout_s`) for a
        lower-tier copy to finish."""
        if self.loading:
            wait([t.future for _, t, _ in self.loading.values()], timeout=timeout_s,
                 return_when=FIRST_COMPLETED)

    def schedule(self) -> tuple[list[ScheduledSeq], list[Sequence]]:
        """Pick this step's work. Returns (scheduled, failed): `failed` holds sequences that
        can never fit (more blocks than the pool can ever free for them); they are removed
        from the queues, and the engine fails them (`finish` releases what they hold)."""
        budget = self.max_num_batched_tokens
        caps = self.caps
        # a prompt is long above the threshold; its chunk is the threshold, less where a TPOT
        # target leaves the running decodes' step less room (short prompts go whole)
        threshold = budget if caps is None else caps.long_prefill_token_threshold
        num_decodes = sum(1 for s in self.running if _to_compute(s) == 1)
        self.running.sort(key=_urgency)  # stable: equal priorities keep admission order
        if any(s.priority for s in self.waiting):
            self.waiting = deque(sorted(self.waiting, key=_urgency))  # stable, as above
        slo_limit = self._slo_limit(threshold, num_decodes)
        long_chunk = threshold if slo_limit is None else min(threshold, slo_limit)
        scheduled: list[ScheduledSeq] = []
        failed: list[Sequence] = []
        preempted = False
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            cap = long_chunk if _to_compute(seq) > threshold \
                else slo_limit if slo_limit is not None and _to_compute(seq) > 1 else budget
            if cap == 0:  # a long prompt sitting this step out (SLO-aware chunking)
                i += 1
                continue
            n = min(_to_compute(seq), budget, cap)
            need = blocks_for(seq.num_computed_tokens + n, self.pool.block_size) - len(seq.blocks)
            drafts = self._drafts(seq, n, budget, need, num_decodes)
            if drafts:
                self.manager.allocate_slots(
                    seq, blocks_for(seq.num_computed_tokens + 1 + drafts,
                                    self.pool.block_size) - len(seq.blocks))
                scheduled.append(ScheduledSeq(seq, 1 + drafts, drafts))
                budget -= 1 + drafts
                i += 1
                continue
            if need > self.pool.num_free:
                self.reclaim(need - self.pool.num_free)
            while need > self.pool.num_free and self.running[-1] is not seq:
                self._preempt(self.running.pop())
                preempted = True
            if need > self.pool.num_free:
                self.running.pop(i)  # seq is the newest left
                if i > 0 or self.loading:  # older sequences hold the blocks: wait for them
                    self._preempt(seq)
                    preempted = True
                    break
                self._release(seq)  # oldest and alone, still too big: pins hold the rest
                failed.append(seq)
                continue
            self.manager.allocate_slots(seq, need)
            scheduled.append(ScheduledSeq(seq, n))
            budget -= n
            i += 1
        left = {item.seq.seq_id: _to_compute(item.seq) - item.num_new_tokens
                for item in scheduled}
        partial = sum(1 for s in self.running if left.get(s.seq_id, _to_compute(s)) > 0)
        partial_long = sum(1 for s in self.running if _to_compute(s) > threshold)
        i = 0
        while (i < len(self.waiting) and budget > 0 and not preempted
               and len(self.running) + len(self.loading) < self.max_num_seqs):
            seq = self.waiting[i]
            is_long = _to_compute(seq) > threshold
            chunk = min(budget, long_chunk) if is_long else budget
            if chunk == 0:  # long prompts sit this step out (SLO-aware chunking)
                i += 1
                continue
            if caps is not None and (
                    (_to_compute(seq) > chunk and partial >= caps.max_num_partial_prefills)
                    or (is_long and partial_long >= caps.max_long_partial_prefills)):
                i += 1  # a shorter one behind it may fit beside the prefills in progress
                continue
            item = self._admit(seq, chunk)
            if item is None and self.reclaim(self._last_need - self.pool.num_free) > 0:
                item = self._admit(seq, chunk)  # idle sessions were spilled: try again
            if item is DEFERRED:  # its next block is being computed by another sequence
                i += 1
                continue
            if item is REMOTE:
                del self.waiting[i]
                self.remote[seq.seq_id] = seq
                self.new_remote.append(seq)
                continue
            if item is LOADING:  # (recorded in `loading` by _admit)
                del self.waiting[i]
                continue
            if item is None:
                if not (self.running or scheduled or self.remote or self.quarantine
                        or self.loading):
                    del self.waiting[i]  # nothing will ever free a block
                    failed.append(seq)
                    continue
                break
            del self.waiting[i]
            self.running.append(seq)
            scheduled.append(item)
            budget -= item.num_new_tokens
            partial += item.num_new_tokens < _to_compute(seq)
            partial_long += is_long
        if caps is not None and budget > 0 and not preempted and all(
                item.num_new_tokens < _to_compute(item.seq) for item in scheduled):
            # only capped prefills run: nothing waits on this step's length
            scheduled = self._top_up(scheduled, budget, slo_limit)
        return scheduled, failed

    def _slo_limit(self, threshold: int, num_decodes: int) -> int | None:
        """The tokens a long prompt takes this step under SLO-aware chunking (None: no
        limit), asked with the context of the first prompt in urgency order that is in the
        middle of its prefill (running) or long (waiting); not asked when there is none
        (nothing it could limit, and it counts the steps it holds a prompt back). The limit
        also applies to a long prompt's last chunk, below the threshold: 495 tokens after a
        12k-token context took a 2.1 s step on the bench CPU."""
        if self.chunk_limit is None:
            return None
        first = next((s for s in self.running if _to_compute(s) > 1), None) or next(
            (s for s in self.waiting if _to_compute(s) > threshold), None)
        if first is None:
            return None
        return self.chunk_limit.prefill_tokens(num_decodes, self.pool.block_size,
                                               first.num_computed_tokens)

    def _drafts(self, seq: Sequence, n: int, budget: int, need: int,
                num_decodes: int) -> int:
        """How many of a decoding sequence's drafts its step computes (0: none), set in
        `seq.draft_token_ids`: those the budget leaves room for beside its token, and the
        free blocks beyond what admission keeps for the others to grow into (drafts never
        make anything wait: no reclaim, no preemption for them)."""
        seq.draft_token_ids = []
        if self.drafts is None or n != 1 or _to_compute(seq) != 1:
            return 0
        proposed = self.drafts.propose(seq, num_decodes)
        if not proposed:
            return 0
        k = min(len(proposed), budget - 1, self._room(seq, seq.num_computed_tokens + 1))
        if k <= 0 or need > self._spare_blocks():
            return 0
        seq.draft_token_ids = proposed[:k]
        return k

    def _headroom(self) -> int:
        """Free blocks admission keeps for the running sequences to grow into."""
        return min(len(self.running), self.pool.num_blocks // HEADROOM_DIVISOR)

    def _spare_blocks(self) -> int:
        """Free blocks beyond the headroom: what work that must not make anything wait (a
        top-up, drafts) may take."""
        return max(self.pool.num_free - self._headroom(), 0)

    def _room(self, seq: Sequence, end: int) -> int:
        """Positions after `end` that `seq`'s blocks and the spare blocks hold."""
        return (len(seq.blocks) + self._spare_blocks()) * self.pool.block_size - end

    def _top_up(self, scheduled: list[ScheduledSeq], budget: int,
                slo_limit: int | None) -> list[ScheduledSeq]:
        """A step of capped prefills alone (no decode, no prompt that ends in it: nobody
        waits on the step's length) gets the budget it has left, prefill by prefill, as far
        as free blocks allow without touching the headroom (no preemption, no reclaim for
        it), each up to `slo_limit` tokens in all (SLO-aware chunking). Returns the step's
        work. Where a request decodes or is admitted beside them, the cap stays: a step of
        the whole budget over a long context is what its tokens and the next arrivals
        would wait for (on the 2-core CPU, ~1.4 s at 2,048 tokens of an 8k context against
        ~0.06 s for a decode step)."""
        bs = self.pool.block_size
        out = []
        for item in scheduled:
            seq, n = item.seq, item.num_new_tokens
            end = seq.num_computed_tokens + n
            extra = min(seq.num_tokens - end, budget, self._room(seq, end))
            if slo_limit is not None:
                extra = min(extra, slo_limit - n)
            if extra > 0:
                self.manager.allocate_slots(seq, blocks_for(end + extra, bs) - len(seq.blocks))
                item = ScheduledSeq(seq, n + extra)
                budget -= extra
            out.append(item)
        return out

    def _admit(self, seq: Sequence, budget: int) -> ScheduledSeq | None:
        """Look up the prefix, take references, allocate the first chunk's blocks; None (and
        nothing changed) when the blocks are not there.

        A sequence may arrive with blocks already attached (a session's next turn: its
        references on the KV of its first `num_computed_tokens` tokens); then the lookup
        continues after them (a session whose KV was dropped but whose blocks the device
        cache or a lower tier still holds), when they end on a block boundary."""
        attached = bool(seq.blocks)
        bs = self.pool.block_size
        hits, lower = [], []  # device hits; what a lower tier holds after them
        if not attached and seq.params.prompt_logprobs is not None:
            num_cached = 0  # every prompt position must be computed for its logprobs
        elif not attached:
            # leave at least one token to compute, so the sequence gets logits to sample
            hits = self.prefix.match(seq.token_ids, seq.block_hashes, seq.num_tokens - 1,
                                     seq.salt)
            if self.lower is not None and self.pool.enable_caching:
                lower = self.lower.lower_hits(seq.token_ids, seq.block_hashes, len(hits),
                                              (seq.num_tokens - 1) // bs)
            num_cached = (len(hits) + len(lower)) * bs
            nxt = len(hits) + len(lower)
            if nxt < len(seq.block_hashes) and self.prefix.pending.get(
                    seq.block_hashes[nxt], seq.seq_id) != seq.seq_id:
                self._unquery(seq, len(hits) * bs)
                return DEFERRED
        else:
            hits, lower = self._after_attached(seq)
            num_cached = seq.num_computed_tokens + (len(hits) + len(lower)) * bs
        held = (*seq.blocks, *hits)
        if self._wants_remote(seq, num_cached):
            return self._admit_remote(seq, hits, lower, num_cached)
        n = min(seq.num_tokens - num_cached, budget)
        num_new_blocks = blocks_for(num_cached + n, self.pool.block_size) - len(held)
        num_revived = sum(1 for b in hits if b.ref_cnt == 0)  # they leave the free queue
        headroom = self._headroom()
        if num_new_blocks + num_revived + headroom > self.pool.num_free:
            self._last_need = num_new_blocks + num_revived + headroom
            if not attached and seq.params.prompt_logprobs is None:  # (those never query)
                self._unquery(seq, len(hits) * bs)
            return None
        num_full = num_cached // self.pool.block_size
        self.prefix.mark_pending(seq.seq_id, seq.block_hashes[num_full:])
        if not attached:  # the eviction policy's shadows replay each admitted prompt
            self.pool.observe(seq.block_hashes[:(seq.num_tokens - 1) // self.pool.block_size])
        self._take(seq, hits, lower, num_new_blocks, in_place=False)
        seq.num_computed_tokens = num_cached
        if seq.num_cached_tokens < 0:
            seq.num_cached_tokens = num_cached
        if seq.first_scheduled_time is None:
            seq.first_scheduled_time = time.perf_counter()
        if lower:
            return LOADING
        seq.status = SequenceStatus.RUNNING
        return ScheduledSeq(seq, n)

    def fork(self, parent: Sequence, children: list[Sequence]) -> None:
        """n > 1: the other completions continue from the parent's computed prompt (the
        parent has just sampled its first token). Each shares the parent's full prompt
        blocks and copies its partial last one (KVCacheManager.fork), so the prompt is
        computed once. Without a seat or a free block a completion waits at the front of
        the queue and is admitted like a preempted sequence (its full prompt blocks are
        prefix-cache hits)."""
        for child in reversed(children):
            if len(self.running) < self.max_num_seqs and self.manager.fork(
                    parent, child, parent.num_computed_tokens):
                child.num_computed_tokens = parent.num_computed_tokens
                child.status = SequenceStatus.RUNNING
                self.running.append(child)
            else:
                child.status = SequenceStatus.WAITING
                self.waiting.appendleft(child)

    def _take(self, seq: Sequence, hits: list, lower: list, num_new_blocks: int,
              in_place: bool = True) -> int:
        """Append to the sequence's table: the device hits (referenced), what a lower tier
        held after them (`num_new_blocks` counts them: fresh blocks filled from below),
        then the rest of the fresh blocks. `in_place`: the lower tiers' blocks are copied
        now; else on the copier, and the sequence waits in `loading` until they are (its
        whole table is there already). Returns how many of `lower` were not loaded in place
        (their fresh blocks are there, to be computed)."""
        start = len(seq.blocks) + len(hits)
        self.manager.attach(seq, hits)
        if hits and self.lower is not None:
            self.lower.reused(hits)
        if lower and not in_place:
            ticket = self.lower.start_lower(seq, lower, seq.token_ids, seq.block_hashes,
                                            start)
            self.loading[seq.seq_id] = (seq, ticket, len(lower))
            self.manager.allocate_slots(seq, num_new_blocks - len(lower))
            return 0
        loaded = self.lower.load_lower(seq, lower, seq.token_ids, seq.block_hashes,
                                       start) if lower else 0
        self.manager.allocate_slots(seq, num_new_blocks - loaded)
        return len(lower) - loaded

    def _after_attached(self, seq: Sequence) -> tuple[list, list]:
        """A session turn's attached blocks end on a block boundary before the prompt's
        last full block: the device blocks and then the lower-tier blocks holding the
        next ones (what a dropped session's spill or other requests left cached)."""
        bs, start = self.pool.block_size, len(seq.blocks)
        end = (seq.num_tokens - 1) // bs
        if (not self.pool.enable_caching or seq.params.prompt_logprobs is not None
                or seq.num_computed_tokens != start * bs or start >= end):
            return [], []
        # hashed as `match` hashes (the request's Salt): the same hashes `update` publishes
        self.prefix.hasher.extend(seq.block_hashes, seq.token_ids, end * bs, seq.salt)
        hits = self.prefix.lookup_blocks(seq.token_ids, seq.block_hashes, end, start)
        lower = self.lower.lower_hits(seq.token_ids, seq.block_hashes, start + len(hits),
                                      end) if self.lower is not None else []
        return hits, lower

    def _wants_remote(self, seq: Sequence, num_cached: int) -> bool:
        """A follow-up turn (attached blocks) qualifies like a fresh prompt: only its tokens
        after `num_cached` would move."""
        if (self.offload is None or seq.no_remote or seq.params.prompt_logprobs is not None
                or seq.num_tokens - 1 - num_cached < self.pool.block_size):
            return False
        if self.pool.enable_caching:
            # the routing keys: the hash of every full block the worker will compute (a
            # session turn arrives with its earlier turns' hashes only); the same hashes
            # `update` would publish. With the request's Salt (re-rooted after the public
            # pinned prefix it starts with), as `match` hashes: the bare cache_salt would
            # leave a session turn's private blocks unsalted, published for any tenant
            self.prefix.hasher.extend(seq.block_hashes, seq.token_ids, seq.num_tokens - 1,
                                      seq.salt)
        return self.offload.should_offload(seq, num_cached)

    def _admit_remote(self, seq: Sequence, hits: list, lower: list, num_cached: int):
        """Blocks for every prompt token but the last (computed locally, for the logits);
        the worker writes the KV of the tokens after `num_cached` into them (after the
        prefix hits and what a lower tier held, or from inside a session's partial last
        block)."""
        held = len(seq.blocks) + len(hits)  # attached blocks, then prefix hits
        need = blocks_for(seq.num_tokens - 1, self.pool.block_size) - held
        revived = sum(1 for b in hits if b.ref_cnt == 0)
        if need + revived > self.pool.num_free:
            self._last_need = need + revived
            self._unquery(seq, len(hits) * self.pool.block_size)
            return None
        num_cached -= self._take(seq, hits, lower, need) * self.pool.block_size
        seq.num_computed_tokens = num_cached
        if seq.num_cached_tokens < 0:
            seq.num_cached_tokens = num_cached
        if seq.first_scheduled_time is None:
            seq.first_scheduled_time = time.perf_counter()
        return REMOTE

    def remote_done(self, seq: Sequence) -> None:
        """The worker wrote the KV of every prompt token but the last: run the rest."""
        del self.remote[seq.seq_id]
        seq.num_remote_tokens = seq.num_tokens - 1 - seq.num_computed_tokens
        # advance progress and publish the full blocks as if computed here
        self.update([ScheduledSeq(seq, seq.num_remote_tokens)])
        seq.status = SequenceStatus.RUNNING
        self.running.append(seq)

    def remote_failed(self, seq: Sequence, fenced: bool, locally: bool = True) -> None:
        """Prefill it locally (unless not `locally`: then it waits nowhere, for the engine
        to fail it). Fenced (no remote write can land any more): it keeps the KV it already
        had (a session's earlier turns, its prefix hits) and computes only the rest.
        Otherwise every block goes to quarantine (a late write may still reach the new
        ones, or a session's partial last block) until `release_quarantine`, and it starts
        over (its full blocks, never written by the worker, are prefix hits)."""
        self.remote.pop(seq.seq_id, None)
        self.prefix.clear_pending(seq.seq_id, seq.block_hashes)
        keep = seq.num_computed_tokens if fenced else 0
        if keep:
            self.manager.truncate(seq, blocks_for(keep, self.pool.block_size))
        elif fenced:
            self.manager.release(seq)
        else:
            q = self.quarantine[seq.seq_id] = Quarantine(seq.seq_id)
            self.manager.transfer(seq, q)
        seq.num_computed_tokens = keep
        seq.no_remote = True
        seq.status = SequenceStatus.WAITING
        if locally:
            self.waiting.appendleft(seq)

    def release_quarantine(self, seq_id: int) -> None:
        q = self.quarantine.pop(seq_id, None)
        if q is not None:
            self.manager.release(q)

    def _unquery(self, seq: Sequence, num_cached: int) -> None:
        """A lookup that did not lead to admission is not counted as a query."""
        if seq.num_computed_tokens == 0:
            self.prefix.queried_tokens -= seq.num_tokens - 1
            self.prefix.hit_tokens -= num_cached

    def _preempt(self, seq: Sequence) -> None:
        self._release(seq)
        seq.status = SequenceStatus.WAITING
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(seq)

    def _release(self, seq: Sequence) -> None:
        self.prefix.clear_pending(seq.seq_id, seq.block_hashes)
        self.manager.release(seq)
        seq.num_computed_tokens = 0

    def update(self, scheduled: list[ScheduledSeq]) -> None:
        """After the model ran: advance progress and publish newly full blocks' hashes."""
        bs = self.pool.block_size
        for item in scheduled:
            seq = item.seq
            before = seq.num_computed_tokens // bs
            seq.num_prompt_computed += max(0, min(
                seq.num_prompt_tokens - seq.num_computed_tokens, item.num_new_tokens))
            seq.num_computed_tokens += item.num_new_tokens
            after = seq.num_computed_tokens // bs
            if after > before and self.pool.enable_caching:
                self.prefix.hasher.extend(seq.block_hashes, seq.token_ids, after * bs,
                                          seq.salt)
                for i in range(before, after):
                    self.pool.cache_full_block(seq.blocks[i], seq.block_hashes[i],
                                               seq.token_ids[i * bs:(i + 1) * bs],
                                               seq.block_hashes[i - 1] if i else None)
                self.prefix.clear_pending(seq.seq_id, seq.block_hashes[before:after])

    def keep_drafts(self, seq: Sequence, num_kept: int) -> None:
        """After a verification (its step's `update` counted the sequence's last token):
        the KV of its first `num_kept` drafts, now its tokens, counts as computed and full
        blocks are published; the blocks allocated for the drafts it did not keep are
        released (what they hold was never hashed, and a kept block's slots past the
        computed tokens are written again by the next step).

            before:  | computed | t | d0 .. d(kept-1) | rejected drafts |
            after:   | computed ........................ | (next token)
        """
        if num_kept:
            self.update([ScheduledSeq(seq, num_kept)])
        self.manager.truncate(seq, blocks_for(seq.num_computed_tokens, self.pool.block_size))

    def finish(self, seq: Sequence, release: bool = True) -> None:
        """Remove a finished (or failed) sequence. Its blocks are released, unless
        `release` is False: then its references stay in its table for whoever holds the
        sequence (a pin, a session), which takes them over through the KVCacheManager."""
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        if release:
            self._release(seq)
        else:
            self.prefix.clear_pending(seq.seq_id, seq.block_hashes)
        seq.status = SequenceStatus.FINISHED


def _urgency(seq: Sequence) -> int:
    """The order the scheduler serves sequences in (lower first; `sorted` keeps arrival
    order among equals)."""
    return seq.priority


def _to_compute(seq: Sequence) -> int:
    """Tokens the sequence has left to compute (1 when it decodes)."""
    return seq.num_tokens - seq.num_computed_tokens
