"""PrefixRouter: prefix affinity with bounded load, on crafted keys and loads (no workers)."""

from __future__ import annotations

import hashlib

import pytest

from kvsession.errors import ConfigError
from kvsession.routing import PrefixRouter, Route


def chain(*blocks: str) -> list[bytes]:
    """Chain hashes, as the block hasher makes them: key i names the whole prefix."""
    keys, parent = [], b"root"
    for b in blocks:
        parent = hashlib.sha256(parent + b.encode()).digest()
        keys.append(parent)
    return keys


def rendezvous_order(key: bytes, targets: list[str]) -> list[str]:
    """The documented tie-break, computed independently of the router."""
    return sorted(targets, key=lambda t: hashlib.sha256(key + b"\0" + t.encode()).digest(),
                  reverse=True)


SYSTEM = ["sys0", "sys1", "sys2"]


def test_an_unseen_prefix_goes_to_its_rendezvous_target_and_stays_there():
    targets = ["a", "b", "c"]
    r = PrefixRouter(targets)
    keys = chain(*SYSTEM, "user-1")
    first = rendezvous_order(keys[0], targets)[0]
    assert r.choose(keys, {}) == Route(first, 0, True)
    # another conversation with the same first block: same target, by hash alone
    assert r.choose(chain(*SYSTEM, "user-2"), {}).target == first
    # 1 in flight over 3 targets: cap ceil(1.25 * 2 / 3) = 1, so a second concurrent
    # request goes to the next target in its rendezvous order while two idle
    _, second, third = rendezvous_order(keys[0], targets)
    assert r.choose(keys, {first: 1}) == Route(second, 0, False)
    assert r.choose(keys, {first: 1, second: 1, third: 1}).target == first  # cap 2


def test_eight_concurrent_requests_sharing_a_prefix_split_five_three():
    r = PrefixRouter(["a", "b"])
    loads = {"a": 0, "b": 0}
    pref = rendezvous_order(chain(*SYSTEM)[0], ["a", "b"])[0]
    other = "b" if pref == "a" else "a"
    got = []
    for i in range(8):
        keys = chain(*SYSTEM, f"user-{i}")
        route = r.choose(keys, loads)
        r.record(route.target, keys)
        loads[route.target] += 1
        got.append((route.target, route.preferred))
    # cap = ceil(1.25 * (in flight + 1) / 2): 1, 2, 2, 3, 4, 4, 5, 5
    p, o = (pref, True), (other, False)
    assert got == [p, p, o, p, p, o, p, o]
    assert loads == {pref: 5, other: 3}  # 1.25x the fair share of 4, not 8/0


def test_requests_one_at_a_time_all_stay_affine():
    r = PrefixRouter(["a", "b"])
    seen = set()
    for i in range(8):
        keys = chain(*SYSTEM, f"user-{i}")
        route = r.choose(keys, {})  # nothing in flight: the bound never bites
        assert route.preferred
        r.record(route.target, keys)
        seen.add(route.target)
    assert len(seen) == 1


def test_a_follow_up_returns_to_the_target_holding_its_deepest_prefix():
    r = PrefixRouter(["a", "b"])
    pref = rendezvous_order(chain(*SYSTEM)[0], ["a", "b"])[0]
    other = "b" if pref == "a" else "a"
    turn1 = chain(*SYSTEM, "user-1")
    r.record(pref, chain(*SYSTEM, "user-0"))  # the system prompt is on pref too
    r.record(other, turn1)  # this session's first turn spilled over to `other`
    turn2 = chain(*SYSTEM, "user-1", "reply-1", "user-1b")
    assert r.matched_blocks(turn2) == {pref: 3, other: 4}
    assert r.choose(turn2, {}) == Route(other, 4, True)  # depth beats the hash order
    # ... unless that target is at the bound: then the next deepest, still preferred-first
    assert r.choose(turn2, {other: 2, pref: 0}) == Route(pref, 3, False)


def test_a_key_deeper_than_a_miss_does_not_count():
    # chain hashes name whole prefixes, but the table is an approximation: a later key
    # without its earlier ones (evicted from the table) is not a match
    r = PrefixRouter(["a", "b"])
    keys = chain("k0", "k1", "k2")
    r.record("b", keys[1:])
    assert r.matched_blocks(keys) == {"a": 0, "b": 0}


def test_forget_and_eligibility():
    r = PrefixRouter(["a", "b", "c"])
    keys = chain("x0", "x1")
    r.record("a", keys)
    r.record("b", keys[:1])
    assert r.choose(keys, {}).target == "a"
    assert r.choose(keys, {}, eligible={"b", "c"}) == Route("b", 1, True)
    assert r.choose(keys, {}, eligible=set()) is None
    r.forget("a")  # it restarted: its cache is empty
    assert r.matched_blocks(keys) == {"a": 0, "b": 1, "c": 0}
    r.forget("b")
    assert r.matched_blocks(keys) == {"a": 0, "b": 0, "c": 0}


def test_the_key_table_is_bounded_lru():
    r = PrefixRouter(["a", "b"], max_keys=4)
    old, new = chain("o0", "o1", "o2"), chain("n0", "n1", "n2")
    r.record("a", old)
    r.record("b", new)  # 6 keys recorded: the 2 least recently used are gone
    assert r.matched_blocks(old)["a"] == 0  # its first key was evicted
    assert r.matched_blocks(new)["b"] == 3


def test_no_keys_and_the_cap():
    r = PrefixRouter(["a", "b"])
    assert r.choose([], {"a": 0, "b": 0}).preferred  # a key-less request still routes
    assert r.cap(0, 2) == 1 and r.cap(7, 2) == 5 and r.cap(3, 1) == 5
    # one target: it takes everything, however loaded
    assert PrefixRouter(["solo"]).choose(chain("q"), {"solo": 100}) == Route("solo", 0, True)


@pytest.mark.parametrize("kwargs, name", [
    (dict(targets=[]), "targets"), (dict(targets=["a", "a"]), "targets"),
    (dict(targets=["a"], load_bound=0.9), "load_bound"),
    (dict(targets=["a"], max_keys=0), "max_keys")])
def test_bad_arguments_are_config_errors(kwargs, name):
    with pytest.raises(ConfigError, match=name):
        PrefixRouter(**kwargs)
