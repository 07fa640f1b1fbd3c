"""TierPolicy + TierMover alone, on a real manager, host pool and disk tier: which session
moves where, exact host ids and device blocks, exact bytes back, and decisions driven by
controlled rates and queue depth (no clocks: `now` and the rates are set by the tests)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from kvsession import costmodel
from kvsession.cache.block_pool import BlockPool, blocks_for
from kvsession.cache.identity import StorageIdentity
from kvsession.cache.kv_pool import KVPool, kv_bytes_per_token
from kvsession.cache.manager import KVCacheManager, SessionKV, Tier, Transient
from kvsession.cache.prefix import PrefixCache
from kvsession.tiers.disk import DiskTier
from kvsession.tiers.host import HostPool
from kvsession.tiers.mover import TierMover
from kvsession.tiers.policy import MOVE_POLL_S, TierPolicy
from kvsession.tiers.snapshot_read import read_header

BS = 4
BPT = kv_bytes_per_token(2, 1, 4, torch.float32)
HASHER = StorageIdentity("m", "float32", BS).hasher()
HEADER = StorageIdentity("m", "float32", BS, tokenizer_digest="t", template_digest="c",
                         num_layers=2, num_kv_heads=1, head_dim=4, tensor_names=("k", "v"))


class Probe:
    """The policy's load probe, with a queue depth the test sets."""

    def __init__(self):
        self.depth = 0

    def queue_depth(self) -> int:
        return self.depth


def build(tmp_path, num_blocks=8, host_blocks=4, disk=True, spill_after_s=None):
    kv = KVPool(2, num_blocks, BS, 1, 4, torch.float32, torch.device("cpu"))
    host = HostPool(kv, host_blocks) if host_blocks else None
    m = KVCacheManager(BlockPool(num_blocks, BS), kv, host.index if host else None)
    prefix = PrefixCache(m, HASHER, max_pinned_blocks=4)
    mover = TierMover(m, host, DiskTier(tmp_path) if disk else None, HASHER, HEADER)
    probe = Probe()
    policy = TierPolicy(mover, prefix, load=probe,
                        prefill_tps=costmodel.RateEstimator(prior=2000.0),
                        bytes_per_token=BPT, spill_after_s=spill_after_s)
    return SimpleNamespace(m=m, kv=kv, host=host, mover=mover, policy=policy, probe=probe,
                           prefix=prefix, tmp=tmp_path)


def content(i: int) -> torch.Tensor:
    """Known K bytes of the block first allocated as block i (V is its negation)."""
    return torch.arange(32.0).view(2, BS, 1, 4) + 100 * (i + 1)


def add_session(e, sid, num_tokens, last_used, start=0):
    """A session holding `num_tokens` tokens of KV, every block filled with content(id)."""
    tokens = list(range(start, start + num_tokens))
    q = Transient()
    e.m.allocate_slots(q, blocks_for(num_tokens, BS))
    hashes = HASHER.extend([], tokens, num_tokens, None)
    for i, (b, h) in enumerate(zip(q.blocks, hashes, strict=False)):
        e.m.pool.cache_full_block(b, h, tokens[i * BS:(i + 1) * BS])
    for b in q.blocks:
        e.kv.k[:, b.block_id], e.kv.v[:, b.block_id] = content(b.block_id), -content(b.block_id)
    s = SessionKV(sid, meta=lambda: {"messages": [], "system": None, "sampling": {}})
    e.m.checkin(s, q, tokens, hashes)
    e.policy.register(s)
    s.last_used = last_used
    return s


def fifo(e):
    return [b.block_id for b in e.m.pool.free_queue]


def ids(holder):
    return [b.block_id for b in holder.blocks]


def holds(tensors, i, orig):
    return torch.equal(tensors["k"][:, i], content(orig)) and \
        torch.equal(tensors["v"][:, i], -content(orig))


def check(e):
    e.m.check_integrity()


def hids(s):
    """The host block ids a session holds, in order."""
    return tuple(h.block_id for h in s.host_blocks)


def host_free(e):
    """The host blocks no session holds (some with cached content), by id."""
    index = e.host.index  # it creates its blocks as they are first needed
    return sorted([b.block_id for b in index.free_queue]
                  + list(range(len(index.blocks), index.num_blocks)))


def evict_all_and_zero(e):
    """Reuse every free block (evicting cached content), zero the pool, free them again;
    then take block 0 so that loads land on other ids. Returns that holder."""
    filler, other = Transient(), Transient()
    e.m.allocate_slots(filler, e.m.pool.num_free)
    e.m.release(filler)
    e.kv.k.zero_()
    e.kv.v.zero_()
    e.m.allocate_slots(other, 1)
    return other


def test_reclaim_takes_the_less_urgent_sessions_kv_first(tmp_path):
    """Priority first (higher value: less urgent), whatever the return forecast: s2 was
    used last but is less urgent, so it goes before s1; equal priorities keep LRU."""
    e = build(tmp_path)
    s1 = add_session(e, "s1", 8, last_used=1.0)
    s2 = add_session(e, "s2", 8, last_used=2.0, start=100)
    s2.priority = 1
    assert e.policy.reclaim(2) == 2
    assert s2.tier is Tier.HOST and s1.tier is Tier.DEVICE
    s2.priority = 0
    check(e)


def test_reclaim_spills_least_recently_used_idle_sessions(tmp_path):
    e = build(tmp_path)
    s1 = add_session(e, "s1", 8, last_used=1.0)
    s2 = add_session(e, "s2", 8, last_used=2.0, start=100)
    s3 = add_session(e, "s3", 4, last_used=0.5, start=200)
    s3.busy = True
    assert (ids(s1), ids(s2), ids(s3), fifo(e)) == ([0, 1], [2, 3], [4], [5, 6, 7])
    assert e.policy.reclaim(2) == 2
    assert s1.tier is Tier.HOST and hids(s1) == (0, 1) and s1.blocks == ()
    assert holds(e.host.tensors, 0, 0) and holds(e.host.tensors, 1, 1)
    assert fifo(e) == [5, 6, 7, 1, 0]  # released, still cached:
    assert e.m.pool.lookup(s1.hashes[1], range(4, 8)) is e.m.pool.blocks[1]
    assert (ids(s2), ids(s3)) == ([2, 3], [4]) and s2.tier is s3.tier is Tier.DEVICE
    assert e.policy.spills == {"host": 1, "disk": 0}
    assert e.policy.decisions == [("s1", "spill to host", "device pool short of 2 blocks")]
    check(e)
    assert e.policy.reclaim(3) == 2  # s2 moves; busy s3 never does
    assert hids(s2) == (2, 3) and ids(s3) == [4] and host_free(e) == []
    assert fifo(e) == [5, 6, 7, 1, 0, 3, 2]
    assert e.policy.decisions[-1] == ("s2", "spill to host", "device pool short of 3 blocks")
    check(e)


def test_spill_to_disk_when_the_host_is_full_then_restore_exact_bytes(tmp_path):
    e = build(tmp_path, host_blocks=1)
    s = add_session(e, "s1", 10, last_used=1.0)
    assert e.policy.spill(s, reason="r") is Tier.DISK
    path = tmp_path / "s1.kvs"
    assert s.tier is Tier.DISK and s.disk_path == path and path.exists()
    assert s.blocks == () and hids(s) == () and fifo(e) == [3, 4, 5, 6, 7, 2, 1, 0]
    h = read_header(path)
    assert (h.session_id, h.token_ids, h.num_blocks) == ("s1", list(range(10)), 3)
    assert h.block_hashes == [x.hex() for x in s.hashes]
    assert e.policy.spills == {"host": 0, "disk": 1}
    assert e.policy.decisions == [("s1", "spill to disk", "r")]
    check(e)
    other = evict_all_and_zero(e)
    assert e.policy.restore(s) == "disk"
    assert ids(s) == [1, 2, 7] and s.tier is Tier.DEVICE and s.tokens == tuple(range(10))
    assert all(holds(e.kv.tensors(), b, orig) for b, orig in [(1, 0), (2, 1), (7, 2)])
    assert e.policy.restores == {"host": 0, "disk": 1} and e.policy.recomputes == 0
    e.m.release(other)
    check(e)


def test_a_full_host_moves_its_oldest_session_to_disk(tmp_path):
    e = build(tmp_path, host_blocks=2)
    s1 = add_session(e, "s1", 8, last_used=1.0)
    s2 = add_session(e, "s2", 8, last_used=2.0, start=100)
    assert e.policy.spill(s1, reason="r") is Tier.HOST and hids(s1) == (0, 1)
    assert e.policy.spill(s2, reason="r") is Tier.HOST
    assert s1.tier is Tier.DISK and hids(s1) == () and (tmp_path / "s1.kvs").exists()
    # s1's host copies stay cached until s2 needs the room: leaf first (block 1 is the
    # child of block 0 in s1's chain)
    assert hids(s2) == (1, 0) and host_free(e) == []
    assert holds(e.host.tensors, 1, 2) and holds(e.host.tensors, 0, 3)
    assert e.policy.decisions == [("s1", "spill to host", "r"),
                                  ("s1", "spill to disk", "host tier full"),
                                  ("s2", "spill to host", "r")]
    assert e.policy.spills == {"host": 2, "disk": 1}
    check(e)


def test_drop_without_any_tier_keeps_the_pinned_lead(tmp_path):
    e = build(tmp_path, host_blocks=0, disk=False)
    s = add_session(e, "s1", 12, last_used=1.0)
    t = Transient()
    e.m.attach(t, s.blocks[:1])
    e.prefix.pins.add(list(range(4)), t, None, now=0.0)
    assert e.policy.spill(s) is Tier.DEVICE
    assert ids(s) == [0] and s.tokens == (0, 1, 2, 3)
    assert s.hashes == tuple(HASHER.extend([], range(4), 4, None))
    assert e.m.pool.blocks[0].ref_cnt == 2  # the pin's and the session's
    assert fifo(e) == [3, 4, 5, 6, 7, 2, 1]
    assert e.policy.decisions == [("s1", "drop (recompute later)", "no room in any tier")]
    assert e.policy.spills == {"host": 0, "disk": 0}
    assert e.policy.reclaim(1) == 0  # only the pinned lead is left
    check(e)


def test_restore_from_host_copies_exact_bytes(tmp_path):
    e = build(tmp_path)
    s = add_session(e, "s1", 10, last_used=1.0)
    assert e.policy.spill(s) is Tier.HOST and hids(s) == (0, 1, 2)
    other = evict_all_and_zero(e)
    assert e.policy.restore(s) == "host"
    assert ids(s) == [1, 2, 7] and hids(s) == () and s.tier is Tier.DEVICE
    assert all(holds(e.kv.tensors(), b, orig) for b, orig in [(1, 0), (2, 1), (7, 2)])
    assert host_free(e) == [0, 1, 2, 3] and fifo(e) == [6, 5, 4, 3]
    assert e.policy.restores == {"host": 1, "disk": 0}
    assert e.policy.decisions[-1][:2] == ("s1", "load from host")
    e.m.release(other)
    check(e)


def test_restore_rereferences_blocks_still_cached(tmp_path):
    e = build(tmp_path)
    s = add_session(e, "s1", 10, last_used=1.0)
    e.policy.spill(s)
    assert fifo(e) == [3, 4, 5, 6, 7, 2, 1, 0]
    for t in e.host.tensors.values():
        t[:, :2] = -1.0  # a copy from host blocks 0, 1 would show
    e.kv.k[:, 2] = e.kv.v[:, 2] = 0.0
    assert e.policy.restore(s) == "host"
    assert ids(s) == [0, 1, 3] and fifo(e) == [4, 5, 6, 7, 2]
    assert holds(e.kv.tensors(), 0, 0) and holds(e.kv.tensors(), 1, 1)
    assert holds(e.kv.tensors(), 3, 2)  # the unpublished tail: copied from host block 2
    check(e)


@pytest.mark.parametrize("host_bw, tps, depth, load", [
    (640e3, 2000.0, 0, True),    # load 1 ms < recompute 5 ms
    (640e3, 20000.0, 0, False),  # recompute 0.5 ms
    (640e3, 20000.0, 4, True),   # a queue slows recompute to 2 ms
    (1.0, 2000.0, 0, False),
])
def test_restore_loads_or_recomputes_by_measured_rates(tmp_path, host_bw, tps, depth, load):
    e = build(tmp_path)
    s = add_session(e, "s1", 10, last_used=1.0)
    e.policy.spill(s)
    e.mover.host_bytes_per_s.fix(host_bw)
    e.policy.prefill_tps.fix(tps)
    e.probe.depth = depth
    assert costmodel.should_load(10, BPT, host_bw, tps, depth) is load
    if load:
        assert e.policy.restore(s) == "host" and e.policy.recomputes == 0
        assert ids(s) == [0, 1, 3] and s.tokens == tuple(range(10))
    else:
        assert e.policy.restore(s) is None and e.policy.recomputes == 1
        assert s.tokens == () and s.blocks == () and s.tier is Tier.DEVICE
        decision, reason = e.policy.decisions[-1][1:]
        assert decision == "drop (recompute later)"
        assert reason.startswith("recompute is cheaper: 10 tokens")
    assert hids(s) == () and host_free(e) == [0, 1, 2, 3]
    check(e)


def test_restore_recomputes_without_device_room(tmp_path):
    e = build(tmp_path, num_blocks=4)
    s = add_session(e, "s1", 10, last_used=1.0)
    e.policy.spill(s)
    filler = Transient()
    e.m.allocate_slots(filler, 3)
    assert e.policy.restore(s) is None and e.policy.recomputes == 1
    assert e.policy.decisions[-1][1:] == ("drop (recompute later)", "no device room to load into")
    assert s.tokens == () and host_free(e) == [0, 1, 2, 3] and fifo(e) == [0]
    check(e)


@pytest.mark.parametrize("idle_s, fill, host_bw, disk_bw, tps, want", [
    (0.0, 0, 10e9, 1e9, 2000.0, "keep"),      # idle shorter than a reload
    (30.0, 0, 10e9, 1e9, 2000.0, "keep"),     # memory plentiful (5 of 8 free)
    (30.0, 4, 10e9, 1e9, 2000.0, "host"),     # 1 of 8 free
    (120.0, 0, 1.0, 1e9, 1e-3, "keep"),       # reload 640 s and recompute 10^4 s: keep
    (600.0, 0, 10e9, 1e9, 2000.0, "disk"),    # too long for host; disk beats recompute
    (None, 0, 10e9, 1e9, 2000.0, "disk"),
    (600.0, 0, 10e9, 1.0, 2000.0, "drop"),    # disk slower than recompute
])
def test_suspend_decisions(tmp_path, idle_s, fill, host_bw, disk_bw, tps, want):
    e = build(tmp_path)
    s = add_session(e, "s1", 10, last_used=1.0)
    filler = Transient()
    e.m.allocate_slots(filler, fill)
    e.mover.host_bytes_per_s.fix(host_bw)
    e.mover.disk_read_bytes_per_s.fix(disk_bw)
    e.policy.prefill_tps.fix(tps)
    assert e.policy.suspend(s, idle_s) == want
    tier, decision = {"keep": (Tier.DEVICE, "keep"), "host": (Tier.HOST, "spill to host"),
                      "disk": (Tier.DISK, "spill to disk"),
                      "drop": (Tier.DEVICE, "drop (recompute later)")}[want]
    assert s.tier is tier and [d[1] for d in e.policy.decisions] == [decision]
    assert ids(s) == ([0, 1, 2] if want == "keep" else [])
    assert hids(s) == ((0, 1, 2) if want == "host" else ())
    assert (tmp_path / "s1.kvs").exists() is (want == "disk")
    assert e.policy.recomputes == (want == "drop") and len(s.tokens) == (want != "drop") * 10
    s.busy = True
    # a busy session is left where it is: "keep" on the device (one of the documented
    # answers), else its tier
    assert e.policy.suspend(s, 600.0) == ("keep" if tier is Tier.DEVICE else tier.value)
    assert len(e.policy.decisions) == 1
    check(e)


def test_suspend_writes_no_file_when_it_decides_to_drop(tmp_path):
    e = build(tmp_path, host_blocks=1)
    s = add_session(e, "s1", 10, last_used=1.0)
    e.mover.disk_read_bytes_per_s.fix(1.0)  # disk slower than recompute
    assert e.policy.suspend(s, 120.0) == "drop"
    assert not (tmp_path / "s1.kvs").exists()
    assert e.policy.spills == {"host": 0, "disk": 0}


def test_housekeeping_spills_sessions_idle_past_the_deadline(tmp_path):
    e = build(tmp_path, spill_after_s=10.0)
    s1 = add_session(e, "s1", 4, last_used=100.0)
    s2 = add_session(e, "s2", 4, last_used=105.0, start=100)
    s3 = add_session(e, "s3", 4, last_used=0.0, start=200)
    s4 = add_session(e, "s4", 4, last_used=0.0, start=300)
    s3.busy = True
    t = Transient()
    e.m.attach(t, s4.blocks)
    e.prefix.pins.add(list(range(300, 304)), t, None, now=0.0)  # s4 is all pinned lead
    # s1's copy runs on the copier: housekeeping comes back soon to settle it
    assert e.policy.housekeeping(now=112.0) == MOVE_POLL_S
    assert s1.moving is not None and s1.tier is Tier.DEVICE and not e.policy.decisions
    e.policy.settle_moves()
    assert s1.moving is None and s1.tier is Tier.HOST and hids(s1) == (0,)
    assert e.policy.housekeeping(now=112.0) == 3.0  # s2's deadline
    assert [x.tier for x in (s2, s3, s4)] == [Tier.DEVICE] * 3 and ids(s4) == [3]
    assert e.policy.decisions == [("s1", "spill to host", "idle > spill_after_s=10.0")]
    assert e.policy.housekeeping(now=115.0) == MOVE_POLL_S
    e.policy.settle_moves()
    assert e.policy.housekeeping(now=115.0) is None
    assert hids(s2) == (1,) and ids(s3) == [2] and e.policy.spills == {"host": 2, "disk": 0}
    e.policy.spill_after_s = None
    assert e.policy.housekeeping(now=1e9) is None and ids(s3) == [2]
    check(e)


@pytest.mark.parametrize("reload_vs_recompute, want", [
    (0.9, "disk"),   # disk cheaper: spill there
    (1.5, "disk"),   # recompute cheaper, but within the margin: keep a copy, restore decides
    (1.9, "disk"),
    (2.1, "drop"),   # recompute under half the reload: drop
    (10.0, "drop"),
])
def test_suspend_drops_only_when_recompute_is_clearly_cheaper(tmp_path, reload_vs_recompute,
                                                             want):
    """A near tie between reloading from disk and recomputing keeps the copy (a drop cannot
    be undone; restore decides again): the drop needs recompute < DROP_BELOW_FRACTION x
    the reload."""
    from kvsession.tiers.policy import DROP_BELOW_FRACTION

    assert DROP_BELOW_FRACTION == 0.5
    e = build(tmp_path, host_blocks=0)
    s = add_session(e, "s1", 10, last_used=1.0)
    tps = 2000.0
    recompute_s = 10 / tps
    e.policy.prefill_tps.fix(tps)
    e.mover.disk_read_bytes_per_s.fix(10 * BPT / (reload_vs_recompute * recompute_s))
    assert e.policy.suspend(s, 900.0) == want
    assert (tmp_path / "s1.kvs").exists() is (want == "disk")
    assert e.policy.recomputes == (want == "drop")
    check(e)


def on_clock(e, start: float):
    """The policy's clock, set by the test: a list whose one item is now."""
    now = [start]
    e.policy.clock = lambda: now[0]
    return now


def test_a_session_learns_its_gaps_between_turns(tmp_path):
    e = build(tmp_path)
    now = on_clock(e, 0.0)
    s = add_session(e, "s", 8, last_used=0.0)
    for t in (0.0, 10.0, 20.0, 60.0):  # turns ending at these times, each instant
        now[0] = t
        e.policy.checkout(s)
        e.policy.checkin(s)
    # gaps 10, 10, 40: the newest weighs GAP_WEIGHT (0.3)
    assert s.turns == 4 and s.gap_s == pytest.approx(0.3 * 40 + 0.7 * 10)
    assert e.policy.expected_return_s(s, 65.0) == pytest.approx(14.0)
    # overdue: expected to stay away as long again as it has been
    assert e.policy.expected_return_s(s, 90.0) == pytest.approx(30.0)
    # an announced wait wins over the learned gaps until the next turn
    e.policy.suspend(s, expected_idle_s=100.0)
    assert s.expected_idle_s == 100.0
    assert e.policy.expected_return_s(s, 65.0) == pytest.approx(95.0)
    e.policy.checkout(s)
    assert s.expected_idle_s is None
    check(e)


def test_reclaim_spills_the_session_expected_back_last_first(tmp_path):
    e = build(tmp_path)
    on_clock(e, 100.0)
    a = add_session(e, "a", 8, last_used=90.0)  # least recently used: LRU's victim
    b = add_session(e, "b", 8, last_used=99.0, start=100)
    # their forecasts (what suspend() and their gaps set): a is back in 2 s, b in ~10 min
    a.expected_idle_s, b.expected_idle_s = 12.0, 600.0
    assert e.policy.reclaim(2) == 2
    assert b.tier is Tier.HOST and a.tier is Tier.DEVICE
    # with nothing known, the one idle longest is expected back last (LRU)
    c = add_session(e, "c", 8, last_used=95.0, start=200)
    d = add_session(e, "d", 8, last_used=98.0, start=300)
    a.expected_idle_s = None
    a.last_used = 99.5
    assert e.policy.reclaim(2) == 2
    assert c.tier is Tier.HOST and d.tier is Tier.DEVICE and a.tier is Tier.DEVICE
    check(e)


def test_a_keep_lapses_after_its_ttl(tmp_path):
    e = build(tmp_path, num_blocks=32)  # plenty of room: a short wait is kept
    on_clock(e, 0.0)
    s = add_session(e, "s", 8, last_used=0.0)
    assert e.policy.suspend(s, expected_idle_s=5.0) == "keep"
    assert s.keep_until == 10.0  # KEEP_TTL_FACTOR (2) expected idle times
    assert e.policy.housekeeping(9.0) == pytest.approx(1.0) and s.tier is Tier.DEVICE
    assert e.policy.housekeeping(10.0) == MOVE_POLL_S
    e.policy.settle_moves()
    assert e.policy.housekeeping(10.0) is None
    assert s.tier is Tier.HOST and s.keep_until is None
    assert e.policy.decisions[-1] == ("s", "spill to host", "kept past its expected return")
    # a wait announced as nothing keeps for KEEP_TTL_MIN_S (5 s), not for 0
    t = add_session(e, "t", 8, last_used=20.0, start=100)
    assert e.policy.suspend(t, expected_idle_s=0.0) == "keep" and t.keep_until == 5.0
    check(e)
