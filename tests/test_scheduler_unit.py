"""The Scheduler alone, on a real KVCacheManager and PrefixCache: exact work per step,
exact block ids, preemption order, failures, in-flight blocks and the reclaimer hook."""

from __future__ import annotations

import weakref

import pytest
import torch

from kvsession import costmodel
from kvsession.cache.block_pool import BlockPool
from kvsession.cache.identity import StorageIdentity
from kvsession.cache.kv_pool import KVPool
from kvsession.cache.manager import HolderKind, KVCacheManager, SessionKV, Tier
from kvsession.cache.prefix import PrefixCache
from kvsession.config import PrefillCaps
from kvsession.costmodel import StallRatio
from kvsession.engine.scheduler import Scheduler
from kvsession.engine.sequence import Sequence, SequenceStatus
from kvsession.engine.slo_chunking import SloChunking
from kvsession.params import SamplingParams
from kvsession.tiers.host import HostPool
from kvsession.tiers.mover import TierMover
from kvsession.tiers.policy import TierPolicy

BS = 4
HEADER = StorageIdentity("m", "float32", BS, tokenizer_digest="t", template_digest="c",
                         num_layers=2, num_kv_heads=1, head_dim=4, tensor_names=("k", "v"))


# each manager's host tier (4 blocks; the manager owns its tables, the policy's mover copies)
HOSTS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def build(num_blocks=8, max_num_seqs=4, budget=64, caps=None):
    kv = KVPool(2, num_blocks, BS, 1, 4, torch.float32, torch.device("cpu"))
    host = HostPool(kv, 4)
    m = KVCacheManager(BlockPool(num_blocks, BS), kv, host.index)
    HOSTS[m] = host
    prefix = PrefixCache(m, StorageIdentity("m", "float32", BS).hasher())
    return m, Scheduler(m, prefix, max_num_seqs, budget, caps=caps)


def seq(tokens) -> Sequence:
    return Sequence(token_ids=list(tokens), params=SamplingParams(max_tokens=8, temperature=0.0),
                    max_model_len=64)


def fifo(m):
    return [b.block_id for b in m.pool.free_queue]


def ids(holder):
    return [b.block_id for b in holder.blocks]


def work(scheduled):
    return [(item.seq, item.num_new_tokens) for item in scheduled]


def run(sched, scheduled, token=7):
    """What the engine does after the model ran: update, then append a sampled token."""
    sampling = [item.seq for item in scheduled if item.samples]
    sched.update(scheduled)
    for s in sampling:
        s.append_token(token, None)


def test_chunked_prefill_within_the_token_budget():
    """Uncapped (caps=None, the scheduler before PrefillCaps): a prefill takes all the budget
    left, and the short request behind it waits for the long one's next step."""
    m, sched = build(budget=8)
    a, b = seq(range(10)), seq(range(100, 106))
    sched.add(a)
    sched.add(b)
    assert sched.queue_depth() == 2
    scheduled, failed = sched.schedule()
    assert work(scheduled) == [(a, 8)] and failed == [] and not scheduled[0].samples
    assert ids(a) == [0, 1] and list(sched.waiting) == [b] and sched.running == [a]
    assert sched.queue_depth() == 2 and fifo(m) == [2, 3, 4, 5, 6, 7]
    run(sched, scheduled)
    assert a.num_computed_tokens == 8 and sched.prefix.pending == {}
    assert [blk.block_hash for blk in a.blocks] == a.block_hashes
    scheduled, _ = sched.schedule()
    assert work(scheduled) == [(a, 2), (b, 6)] and all(x.samples for x in scheduled)
    assert ids(a) == [0, 1, 2] and ids(b) == [3, 4] and sched.running == [a, b]
    run(sched, scheduled)
    assert sched.queue_depth() == 0 and a.num_tokens == 11 and b.num_tokens == 7
    scheduled, _ = sched.schedule()
    assert work(scheduled) == [(a, 1), (b, 1)] and fifo(m) == [5, 6, 7]
    m.check_integrity()


CAPS = PrefillCaps(max_num_partial_prefills=2, max_long_partial_prefills=1,
                   long_prefill_token_threshold=4)


def test_a_short_request_is_admitted_beside_a_long_prefill():
    """With caps, the long prompt takes the threshold, the short one is admitted in the same
    step; while a request decodes beside it the long prompt keeps to the threshold (the
    step's length is what the decode waits for)."""
    m, sched = build(budget=8, caps=CAPS)
    a, b = seq(range(10)), seq(range(100, 103))
    sched.add(a)
    sched.add(b)
    scheduled, _ = sched.schedule()
    assert work(scheduled) == [(a, 4), (b, 3)] and [x.samples for x in scheduled] == [
        False, True]
    assert ids(a) == [0] and ids(b) == [1] and not sched.waiting
    run(sched, scheduled)
    assert a.num_computed_tokens == 4 and b.num_tokens == 4
    scheduled, _ = sched.schedule()
    assert work(scheduled) == [(a, 4), (b, 1)] and ids(a) == [0, 2] and ids(b) == [1]
    run(sched, scheduled)
    scheduled, _ = sched.schedule()
    assert work(scheduled) == [(a, 2), (b, 1)] and all(x.samples for x in scheduled)
    assert ids(a) == [0, 2, 3] and ids(b) == [1, 4]
    run(sched, scheduled)
    scheduled, _ = sched.schedule()
    assert work(scheduled) == [(a, 1), (b, 1)] and fifo(m) == [5, 6, 7]
    m.check_integrity()


def test_a_long_prompt_alone_takes_the_whole_budget():
    """Nothing else runs: the threshold first, then the rest of the budget (the top-up)."""
    m, sched = build(budget=8, caps=CAPS)
    a = seq(range(20))
    sched.add(a)
    scheduled, _ = sched.schedule()
    assert work(scheduled) == [(a, 8)] and ids(a) == [0, 1]
    run(sched, scheduled)
    scheduled, _ = sched.schedule()
    assert work(scheduled) == [(a, 8)] and ids(a) == [0, 1, 2, 3]
    m.check_integrity()


def test_a_short_request_jumps_a_waiting_long_one():
    """One long prefill at a time (max_long_partial_prefills=1): the second long prompt
    waits, the short one behind it is admitted; the second starts in the step where the
    first has no more than the threshold left."""
    m, sched = build(num_blocks=16, budget=8, caps=CAPS)
    a, c, d = seq(range(12)), seq(range(50, 62)), seq(range(100, 102))
    for s in (a, c, d):
        sched.add(s)
    scheduled, _ = sched.schedule()
    assert work(scheduled) == [(a, 4), (d, 2)] and list(sched.waiting) == [c]
    run(sched, scheduled)
    scheduled, _ = sched.schedule()  # a has 8 left: still long, c still waits
    assert work(scheduled) == [(a, 4), (d, 1)] and list(sched.waiting) == [c]
    run(sched, scheduled)
    scheduled, _ = sched.schedule()  # a's last 4: c is admitted with what is left
    assert work(scheduled) == [(a, 4), (d, 1), (c, 3)] and not sched.waiting
    assert ids(a) == [0, 2, 3] and ids(d) == [1] and ids(c) == [4]
    m.check_integrity()


def test_priority_orders_admission_and_preemption():
    """Lower is more urgent: the urgent request is admitted first although it came second,
    and when blocks run out the less urgent one is preempted although it is older."""
    m, sched = build(num_blocks=3, budget=16)
    b, a = seq(range(100, 104)), seq(range(4))
    b.priority, a.priority = 1, 0
    sched.add(b)
    sched.add(a)
    scheduled, _ = sched.schedule()
    assert work(scheduled) == [(a, 4), (b, 4)] and ids(a) == [0] and ids(b) == [1]
    run(sched, scheduled)
    scheduled, _ = sched.schedule()
    assert work(scheduled) == [(a, 1)] and ids(a) == [0, 2]
    assert list(sched.waiting) == [b] and b.num_preemptions == 1 and b.blocks == ()
    m.check_integrity()


def test_max_num_seqs_caps_admission():
    m, sched = build(max_num_seqs=2)
    a, b, c = seq(range(4)), seq(range(10, 14)), seq(range(20, 24))
    for s in (a, b, c):
        sched.add(s)
    scheduled, _ = sched.schedule()
    assert work(scheduled) == [(a, 4), (b, 4)] and list(sched.waiting) == [c]
    run(sched, scheduled)
    scheduled, _ = sched.schedule()
    assert work(scheduled) == [(a, 1), (b, 1)] and ids(a) == [0, 2] and ids(b) == [1, 3]
    run(sched, scheduled)
    sched.finish(a)
    assert a.status is SequenceStatus.FINISHED and fifo(m) == [4, 5, 6, 7, 2, 0]
    scheduled, _ = sched.schedule()
    assert work(scheduled) == [(b, 1), (c, 4)] and ids(c) == [4] and not sched.waiting
    m.check_integrity()


def test_prefix_hits_reuse_a_finished_sequences_blocks():
    m, sched = build()
    prompt = list(range(10))
    a = seq(prompt)
    sched.add(a)
    scheduled, _ = sched.schedule()
    run(sched, scheduled)
    sched.finish(a)
    assert fifo(m) == [3, 4, 5, 6, 7, 2, 1, 0] and m.holders() == []
    b = seq(prompt)
    sched.add(b)
    scheduled, _ = sched.schedule()
    assert work(scheduled) == [(b, 2)] and ids(b) == [0, 1, 3]  # hits 0, 1 (revived)
    assert b.num_computed_tokens == b.num_cached_tokens == 8
    assert fifo(m) == [4, 5, 6, 7, 2]
    assert (sched.prefix.queried_tokens, sched.prefix.hit_tokens) == (18, 8)
    c = seq(range(8))  # one full block short of the lookup limit: the last token computes
    sched.add(c)
    scheduled, _ = sched.schedule()
    assert work(scheduled) == [(b, 2), (c, 4)] and ids(c) == [0, 4]
    assert [blk.ref_cnt for blk in m.pool.blocks[:5]] == [2, 1, 0, 1, 1]
    m.check_integrity()


def test_preemption_frees_the_newest_tail_first():
    m, sched = build(num_blocks=4)
    a, b = seq(range(8)), seq(range(100, 107))
    sched.add(a)
    sched.add(b)
    scheduled, _ = sched.schedule()
    assert work(scheduled) == [(a, 8), (b, 7)] and ids(b) == [2, 3] and fifo(m) == []
    run(sched, scheduled)
    scheduled, failed = sched.schedule()  # a needs a block: b is preempted
    assert work(scheduled) == [(a, 1)] and failed == []
    # b freed [3, 2] tail first: a took 3 (unpublished), 2 stays cached
    assert ids(a) == [0, 1, 3] and fifo(m) == [2] and m.pool.num_evictions == 0
    assert m.pool.blocks[2].block_hash == b.block_hashes[0]
    assert b.blocks == () and b.num_computed_tokens == 0 and b.status is SequenceStatus.WAITING
    assert list(sched.waiting) == [b] and sched.running == [a]
    assert b.num_preemptions == 1 and sched.num_preemptions == 1
    run(sched, scheduled)
    scheduled, failed = sched.schedule()  # b needs its hit plus one block: 1 free
    assert work(scheduled) == [(a, 1)] and failed == [] and list(sched.waiting) == [b]
    sched.finish(a)
    assert fifo(m) == [2, 3, 1, 0]
    scheduled, _ = sched.schedule()
    assert work(scheduled) == [(b, 4)] and ids(b) == [2, 3] and b.num_computed_tokens == 4
    m.check_integrity()


def test_a_sequence_too_big_to_ever_fit_fails():
    m, sched = build(num_blocks=4)
    big = seq(range(20))
    sched.add(big)
    assert sched.schedule() == ([], [big])
    assert not sched.waiting and m.holders() == [] and fifo(m) == [0, 1, 2, 3]
    assert sched.prefix.queried_tokens == 0  # the lookup is not counted


def test_a_running_sequence_that_outgrows_the_pool_fails():
    m, sched = build(num_blocks=2, budget=8)
    long = seq(range(12))
    sched.add(long)
    scheduled, _ = sched.schedule()
    assert work(scheduled) == [(long, 8)] and ids(long) == [0, 1]
    run(sched, scheduled)
    assert sched.schedule() == ([], [long])
    assert long.blocks == () and sched.running == [] and fifo(m) == [1, 0]
    m.check_integrity()


def test_attached_sequence_that_can_never_fit_fails():
    m, sched = build(num_blocks=4)
    turn = seq(range(20))
    m.allocate_slots(turn, 1)  # a session's next turn: KV of its first 4 tokens attached
    turn.num_computed_tokens = 4
    sched.add(turn)
    assert sched.schedule() == ([], [turn])
    sched.finish(turn)  # what the engine does with a failed sequence
    assert m.holders() == [] and fifo(m) == [1, 2, 3, 0]
    m.check_integrity()


def test_a_block_being_computed_defers_the_second_request():
    m, sched = build(budget=12)
    a, b = seq(range(10)), seq(range(10))
    sched.add(a)
    sched.add(b)
    scheduled, _ = sched.schedule()
    assert work(scheduled) == [(a, 10)] and list(sched.waiting) == [b]
    assert sched.prefix.pending == {a.block_hashes[0]: a.seq_id, a.block_hashes[1]: a.seq_id}
    assert b.blocks == () and b.num_cached_tokens == -1
    assert sched.prefix.queried_tokens == 9 and sched.queue_depth() == 2
    run(sched, scheduled)
    assert sched.prefix.pending == {}
    scheduled, _ = sched.schedule()
    assert work(scheduled) == [(a, 1), (b, 2)] and ids(b) == [0, 1, 3]
    assert b.num_cached_tokens == 8
    assert [blk.ref_cnt for blk in m.pool.blocks[:4]] == [2, 2, 1, 1]
    m.check_integrity()


def idle_session(m, sched, tokens, sid="s1"):
    """A finished turn's KV checked into a session, as the session store does."""
    x = seq(tokens)
    sched.add(x)
    scheduled, _ = sched.schedule()
    sched.update(scheduled)
    sched.finish(x, release=False)
    s = SessionKV(sid, meta=lambda: {"messages": [], "system": None, "sampling": {}})
    m.checkin(s, x, x.token_ids, x.block_hashes)
    return s


def with_policy(m, sched):
    host = HOSTS[m]
    mover = TierMover(m, host, None, sched.prefix.hasher, HEADER)
    policy = TierPolicy(mover, sched.prefix, load=sched,
                        prefill_tps=costmodel.RateEstimator(prior=2000.0), bytes_per_token=64)
    sched.attach_reclaimer(policy)
    return host, policy


@pytest.mark.parametrize("reclaimer", [True, False])
def test_reclaimer_is_tried_before_preempting(reclaimer):
    m, sched = build(num_blocks=4)
    s = idle_session(m, sched, range(50, 54))
    assert ids(s) == [0]
    if reclaimer:
        host, policy = with_policy(m, sched)
        policy.register(s)
    a, b = seq(range(5)), seq(range(100, 103))
    sched.add(a)
    sched.add(b)
    for _ in range(2):
        scheduled, _ = sched.schedule()
        run(sched, scheduled)
    assert ids(a) == [1, 2] and ids(b) == [3] and fifo(m) == [] and b.num_tokens == 5
    scheduled, _ = sched.schedule()  # b needs a block
    if reclaimer:
        assert work(scheduled) == [(a, 1), (b, 1)] and sched.num_preemptions == 0
        assert ids(b) == [3, 0] and m.pool.num_evictions == 1
        assert s.tier is Tier.HOST and s.blocks == ()
        assert [h.block_id for h in s.host_blocks] == [0]
        assert policy.spills == {"host": 1, "disk": 0}
        assert policy.decisions == [("s1", "spill to host", "device pool short of 1 blocks")]
        m.check_integrity()
    else:
        assert work(scheduled) == [(a, 1)] and sched.num_preemptions == 1
        assert list(sched.waiting) == [b] and fifo(m) == [3] and ids(s) == [0]
        m.check_integrity()


def test_reclaimer_makes_room_for_admission():
    m, sched = build(num_blocks=4)
    s = idle_session(m, sched, range(50, 58))
    host, policy = with_policy(m, sched)
    policy.register(s)
    c = seq(range(100, 109))  # 3 blocks, 2 free
    queried = sched.prefix.queried_tokens
    sched.add(c)
    scheduled, failed = sched.schedule()
    assert work(scheduled) == [(c, 9)] and failed == [] and ids(c) == [2, 3, 1]
    assert [h.block_id for h in s.host_blocks] == [0, 1] and s.blocks == () and fifo(m) == [0]
    assert sched.prefix.queried_tokens - queried == 8 and sched.num_preemptions == 0
    assert m.num_held(HolderKind.SEQUENCE) == 3 and m.num_held(HolderKind.SESSION) == 0
    m.check_integrity()


def test_admission_leaves_headroom_for_running_sequences_to_grow():
    # 32 blocks: up to min(running, 32 // 16 = 2) blocks stay free at admission, so a new
    # sequence is not let in only to be preempted the next time a running one needs a block
    m, sched = build(num_blocks=32, budget=128)
    a = Sequence(token_ids=list(range(116)), max_model_len=256,
                 params=SamplingParams(max_tokens=8, temperature=0.0))
    sched.add(a)
    scheduled, _ = sched.schedule()
    assert work(scheduled) == [(a, 116)] and len(a.blocks) == 29
    run(sched, scheduled)
    c = seq(range(200, 208))  # 2 blocks: they are free, but a's room would go with them
    sched.add(c)
    scheduled, _ = sched.schedule()  # a's 117th token takes block 30: 2 free, 1 kept back
    assert work(scheduled) == [(a, 1)] and list(sched.waiting) == [c]
    assert m.pool.num_free == 2
    while a.status is not SequenceStatus.FINISHED:
        run(sched, scheduled)
        if a.num_tokens - a.num_prompt_tokens == 8:
            sched.finish(a)
            break
        scheduled, _ = sched.schedule()
        assert work(scheduled) == [(a, 1)] and list(sched.waiting) == [c]
    assert sched.num_preemptions == 0  # before: c was admitted, then preempted
    scheduled, _ = sched.schedule()  # nothing running: no headroom to keep
    assert work(scheduled) == [(c, 8)] and not sched.waiting
    m.check_integrity()


def slo_chunking(ttft_s=None, tpot_s=None) -> SloChunking:
    """SLO-aware chunking with measured times: a pure step of one decode 0.5 s, a prompt
    token adds 0.25 s (attention pairs free)."""
    stall = StallRatio()
    stall.observe(1, 0, 0.5)
    chunking = SloChunking(stall)
    for n in (4, 8, 12):
        chunking.observe(1, n, costmodel.key_reads(n, 0), 0.5 + 0.25 * n)
    chunking.set_target(ttft_s, tpot_s)
    return chunking


def test_a_tpot_target_shrinks_a_long_prompts_chunk_beside_a_decode():
    """SLO-aware chunking (engine/slo_chunking.py): a 2 s target leaves 1.5 s beside the
    decode, 6 tokens, below the threshold of 8: the long prompt takes 6 beside it."""
    m, sched = build(num_blocks=16, budget=16, caps=PrefillCaps(2, 1, 8))
    sched.attach_chunk_limit(slo_chunking(tpot_s=2.0))
    b, a = seq(range(100, 102)), seq(range(20))
    sched.add(b)
    scheduled, _ = sched.schedule()
    assert work(scheduled) == [(b, 2)]  # nothing decodes yet, no TTFT target: no limit
    run(sched, scheduled)
    sched.add(a)
    scheduled, _ = sched.schedule()
    assert work(scheduled) == [(b, 1), (a, 6)] and ids(a) == [1, 2]
    m.check_integrity()


def test_a_long_prompt_sits_out_steps_its_block_does_not_fit_beside_a_decode():
    """A 1.05 s target leaves 0.55 s, 2.2 tokens, less than a block (4): the waiting long
    prompt is not admitted and the decode runs alone; with the held step's room banked (1.1
    s: 4.4 tokens) it takes a block, then sits out again while running, through its last
    chunks (below the threshold: a long prompt's tail is as costly). Steps timed as
    predicted."""
    m, sched = build(num_blocks=16, budget=16, caps=PrefillCaps(2, 1, 8))
    chunking = slo_chunking(tpot_s=1.05)
    sched.attach_chunk_limit(chunking)
    b, a = seq(range(100, 102)), seq(range(20))
    sched.add(b)
    run(sched, sched.schedule()[0])
    sched.add(a)
    steps = []
    for _ in range(10):
        scheduled, _ = sched.schedule()
        steps.append([n for s, n in work(scheduled) if s is a])
        n = sum(item.num_new_tokens for item in scheduled if item.seq is a)
        chunking.observe(1, n, costmodel.key_reads(n, 0), 0.5 + 0.25 * n)
        run(sched, scheduled)
    # a block every other step, its last 8 tokens (below the threshold) too
    assert steps == [[], [4], [], [4], [], [4], [], [4], [], [4]]
    assert a.num_computed_tokens == 20 and chunking.held_steps == 5
    m.check_integrity()


def test_alone_a_long_prompt_takes_what_a_quarter_of_the_ttft_target_holds():
    """Nothing decodes: the top-up stops at what a quarter of the TTFT target holds past a
    one-decode step's time (0.5 s + 10 tokens' 2.5 s: 10 tokens), not the whole budget."""
    m, sched = build(num_blocks=16, budget=16, caps=PrefillCaps(2, 1, 4))
    sched.attach_chunk_limit(slo_chunking(ttft_s=4 * 3.1))
    a = seq(range(30))
    sched.add(a)
    scheduled, _ = sched.schedule()
    assert work(scheduled) == [(a, 10)] and ids(a) == [0, 1, 2]
    m.check_integrity()
