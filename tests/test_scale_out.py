"""Scale-out (`serve --replicas N --ray-address local`): the routing policy on its own, then
two replicas of the tiny model on a local Ray cluster behind the ingress (skipped without
the `ray` extra): sticky sessions, prefix affinity of re-sent conversations, bounded load
under a skewed workload, a replica killed mid-workload, a replica drained."""

from __future__ import annotations

import pytest

from kvsession import ConfigError
from kvsession.serve.conversations import conversation_keys
from kvsession.serve.router import Decision, Kind, Reason, ReplicaRouter, ReplicaState

SYSTEM = {"role": "system", "content": "You are a careful agent. " * 8}


def convo(i: int, turns: int = 1) -> list[dict]:
    msgs = [SYSTEM]
    for t in range(turns):
        msgs.append({"role": "user", "content": f"conversation {i} turn {t}"})
        if t < turns - 1:
            msgs.append({"role": "assistant", "content": f"reply {i}.{t}"})
    return msgs


def keys_of(messages):
    return conversation_keys(messages)[1:]


def ready_router(n: int = 2) -> ReplicaRouter:
    r = ReplicaRouter([f"replica-{i}" for i in range(n)])
    for name in r.names:
        r.set_state(name, ReplicaState.READY)
    return r


def test_the_conversation_key_is_the_one_a_replica_files():
    # the key of a request's messages + the reply is the next request's key at that depth,
    # whatever shape the client echoes the reply back in
    turn1 = convo(0)
    reply = {"role": "assistant", "content": "reply 0.0"}
    echoed = {"role": "assistant", "content": [{"type": "text", "text": "reply 0.0"}],
              "refusal": None}
    turn2 = [*turn1, echoed, {"role": "user", "content": "more"}]
    assert conversation_keys([*turn1, reply])[-1] == conversation_keys(turn2)[len(turn1) + 1]
    assert conversation_keys(turn1, tools=[{"type": "function"}])[1] != \
        conversation_keys(turn1)[1]


def test_a_conversation_returns_to_the_replica_that_answered_it():
    r = ready_router()
    d = r.route_conversation(keys_of(convo(0)))
    assert d.kind is Kind.CONVERSATION_NEW
    r.started(d)
    r.finished(d)
    r.served(d.replica, keys_of(convo(0)))
    follow_up = keys_of(convo(0, turns=2))
    d2 = r.route_conversation(follow_up)
    assert d2 == Decision(d.replica, Kind.CONVERSATION_AFFINE, len(keys_of(convo(0))))


def test_a_summary_teaches_a_filed_conversation_deeper_than_any_answered_prefix():
    r = ready_router()
    follow_up = keys_of(convo(3, turns=3))
    # replica-1 reports a Session filed under the conversation's first 4 messages (an
    # ingress that restarted knows nothing else); replica-0 answered its system prompt
    r.served("replica-0", follow_up[:1])
    r.report("replica-1", {follow_up[3]}, [])
    assert r.depths(follow_up) == {"replica-0": 1, "replica-1": 4}
    assert r.route_conversation(follow_up).replica == "replica-1"
    r.report("replica-1", set(), [])  # evicted there
    assert r.depths(follow_up)["replica-1"] == 0


def test_eight_concurrent_conversations_sharing_a_system_prompt_split_within_the_bound():
    r = ready_router()
    r.served("replica-0", keys_of(convo(99)))  # the system prompt's affinity: replica-0
    placed = []
    for i in range(8):
        cap = r.cap()
        d = r.route_conversation(keys_of(convo(i)))
        assert r.load[d.replica] < cap  # taking it keeps the replica within its cap
        r.started(d)
        placed.append(d)
    assert r.load == {"replica-0": 5, "replica-1": 3}  # 1.25x the fair share of 4
    assert {d.kind for d in placed} == {Kind.CONVERSATION_AFFINE, Kind.CONVERSATION_SPILLED}


def test_sessions_are_sticky_and_move_when_their_replica_is_lost():
    r = ready_router()
    d = r.route_session("agent-7")
    assert d.kind is Kind.SESSION_NEW
    r.started(d, "agent-7")
    r.finished(d, "agent-7")
    assert r.route_session("agent-7") == Decision(d.replica, Kind.SESSION_STICKY)
    other = next(n for n in r.names if n != d.replica)
    r.set_state(d.replica, ReplicaState.DEAD)
    r.lost(d.replica, Reason.DEAD)
    moved = r.route_session("agent-7")
    assert moved == Decision(other, Kind.SESSION_MIGRATED, moved_from=d.replica,
                             reason=Reason.DEAD)
    r.started(moved, "agent-7")
    r.finished(moved, "agent-7")
    # the dead replica restarts empty: the session stays where it went
    r.set_state(d.replica, ReplicaState.READY)
    assert r.route_session("agent-7").replica == other
    assert r.migrations[Reason.DEAD] == 1


def test_a_draining_replica_keeps_its_sessions_until_it_stops():
    r = ready_router()
    d = r.route_session("s")
    r.started(d, "s")
    r.finished(d, "s")
    r.set_state(d.replica, ReplicaState.DRAINING)
    assert r.route_session("s").kind is Kind.SESSION_STICKY  # its lock is still there
    assert r.route_session("new").replica != d.replica  # new work goes elsewhere
    r.set_state(d.replica, ReplicaState.STOPPING)
    assert r.waiting_on("s") == d.replica
    r.lost(d.replica, Reason.DRAINED)
    r.set_state(d.replica, ReplicaState.GONE)
    assert r.waiting_on("s") is None
    moved = r.route_session("s")
    assert (moved.kind, moved.reason) == (Kind.SESSION_MIGRATED, Reason.DRAINED)


def test_an_idle_session_leaves_an_overloaded_replica_for_an_idle_one():
    r = ready_router()
    d = r.route_session("s")
    r.started(d, "s")
    r.finished(d, "s")
    other = next(n for n in r.names if n != d.replica)
    r.load[d.replica] = 3  # other requests in flight there, none on `other`
    moved = r.route_session("s")
    assert moved == Decision(other, Kind.SESSION_MIGRATED, moved_from=d.replica,
                             reason=Reason.OVERLOADED)
    # the old replica refused to let it go (a turn was running): it stays
    assert r.stay("s", moved) == Decision(d.replica, Kind.SESSION_STICKY)
    assert r.migrations[Reason.OVERLOADED] == 0
    r.load[other] = 1  # nobody idle: no move, however loaded
    assert r.route_session("s").kind is Kind.SESSION_STICKY


def test_a_summary_names_the_lock_holder():
    r = ready_router()
    r.report("replica-1", set(), ["resumed-elsewhere"])
    assert r.route_session("resumed-elsewhere").replica == "replica-1"
    assert r.sessions_on("replica-1") == 1


def test_no_ready_replica_and_bad_arguments():
    r = ReplicaRouter(["a", "b"])
    assert r.route_session("s") is None and r.route_conversation([b"k"]) is None
    with pytest.raises(ConfigError, match="replica"):
        r.set_state("c", ReplicaState.READY)
    with pytest.raises(ConfigError, match="targets"):
        ReplicaRouter([])
    with pytest.raises(ConfigError, match="load_bound"):
        ReplicaRouter(["a"], load_bound=0.5)
