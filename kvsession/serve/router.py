"""Which engine replica takes a request: the routing policy of `serve --replicas N`.

Pure state and decisions, no HTTP and no Ray (kvsession/serve/ray_ingress.py does the I/O
and calls this from its one event loop; not thread-safe). Three kinds of requests:

- bound to a named session (`session_id`): sticky. The session goes to the replica that
  holds it (learned from where it was served, and from the replicas' summaries: the lock
  holder is the truth). It moves only when that replica is gone (died, drained) or
  overloaded: holding at least its bounded-load cap while another replica is idle and the
  session has no turn in flight. A session's first request is placed by rendezvous hashing
  on its id under the same load bound.
- a stateless conversation (every OpenAI client re-sending its history): keyed by the hash
  chain of its canonical messages (`conversations.conversation_keys`, the same hashes the
  replica files its Session under). A replica is believed to hold a conversation's first d
  messages when it answered a request with those messages (all their prefixes are in its
  cache) or when its last summary listed a filed Session under key d. The deepest match
  wins, under the bounded-load rule of `kvsession.routing.PrefixRouter`: no replica takes a
  request that puts it above ceil(1.25 * (in flight + 1) / ready replicas). A conversation
  that continues its own history on a replica (a match past the system message) is treated
  like a session: moving it would recompute that history, so it leaves only when its
  replica is at the cap while another is idle. A new conversation (or session) is placed
  under the fair share instead (bound 1.0: 8 starting together split 4/4, not 5/3): its
  whole history will live where it lands, and the uneven split would later cost a move.
- anything else (completions, models): the same rule on its own keys.

Replicas that restart come back with an empty cache: a new epoch, whose keys start over.
"""

from __future__ import annotations

import enum
import hashlib
import random
from collections import Counter
from collections.abc import Collection, Iterable, Sequence
from dataclasses import dataclass

from kvsession import ConfigError
from kvsession.routing import DEFAULT_LOAD_BOUND, DEFAULT_MAX_KEYS, PrefixRouter


class ReplicaState(enum.Enum):
    STARTING = "starting"  # its actor is loading the model (at start, or after a restart)
    READY = "ready"
    DRAINING = "draining"  # takes no new work; its requests in flight finish
    STOPPING = "stopping"  # persisting its sessions: they wait for it, then move
    DEAD = "dead"  # its process died; Ray restarts it (STARTING) or it is dropped
    GONE = "gone"  # dropped for good (drained without restart, restarts exhausted)


class Kind(enum.Enum):
    """A routing decision, as counted in /metrics."""

    SESSION_STICKY = "session_sticky"
    SESSION_NEW = "session_new"
    SESSION_MIGRATED = "session_migrated"
    CONVERSATION_AFFINE = "conversation_affine"  # the replica holding its deepest prefix
    CONVERSATION_NEW = "conversation_new"  # nobody holds any of it: its rendezvous replica
    CONVERSATION_SPILLED = "conversation_spilled"  # not its first choice: the load bound
    RANDOM = "random"  # Routing.RANDOM
    OTHER = "other"


class Routing(enum.Enum):
    """How stateless requests are placed (named sessions are sticky either way)."""

    AFFINITY = "affinity"  # the replica holding the deepest prefix, under the load bound
    RANDOM = "random"  # uniformly at random (seeded): the baseline affinity is measured by


class Reason(enum.Enum):
    """Why a session moved to another replica."""

    DEAD = "dead"
    DRAINED = "drained"
    OVERLOADED = "overloaded"


@dataclass(frozen=True)
class Decision:
    replica: str
    kind: Kind
    depth: int = 0  # messages (keys) the replica is believed to hold
    moved_from: str | None = None  # a session's previous replica
    reason: Reason | None = None  # why it moved


# a match this deep (keys: the system message, then the first user message...) is a
# conversation's own history, not only a shared system prompt
CONTINUED = 2
FAIR_SHARE = 1.0  # the load bound a new conversation is placed under


def session_key(session_id: str) -> bytes:
    """The rendezvous key of a named session (its first placement)."""
    return hashlib.sha256(b"kvsession-session\0" + session_id.encode()).digest()


@dataclass
class _Session:
    replica: str
    epoch: int
    busy: int = 0  # requests in flight on it


class ReplicaRouter:
    def __init__(self, names: Sequence[str], load_bound: float = DEFAULT_LOAD_BOUND,
                 max_keys: int = DEFAULT_MAX_KEYS, routing: Routing = Routing.AFFINITY,
                 seed: int = 0):
        self.prefix = PrefixRouter(names, load_bound, max_keys)  # validates all three
        if not isinstance(routing, Routing):
            raise ConfigError(f"routing must be a Routing, got {routing!r}")
        self.routing = routing
        self._rng = random.Random(seed)
        self.names = list(names)
        self.state = dict.fromkeys(self.names, ReplicaState.STARTING)
        self.epoch = dict.fromkeys(self.names, 0)
        self.load: Counter = Counter()  # requests in flight per replica
        self.sessions: dict[str, _Session] = {}
        self._lost_reason: dict[str, Reason] = {}
        self._tips: dict[str, set[bytes]] = {n: set() for n in self.names}  # summaries
        self.decisions: Counter = Counter()  # Kind -> count
        self.migrations: Counter = Counter()  # Reason -> count
        self.routed: Counter = Counter()  # replica -> requests sent

    # ---- replicas --------------------------------------------------------------------

    def ready(self) -> list[str]:
        return [n for n in self.names if self.state[n] is ReplicaState.READY]

    def set_state(self, name: str, state: ReplicaState) -> None:
        if name not in self.state:
            raise ConfigError(f"replica must be one of {self.names}, got {name!r}")
        if not isinstance(state, ReplicaState):
            raise ConfigError(f"state must be a ReplicaState, got {state!r}")
        self.state[name] = state

    def lost(self, name: str, reason: Reason) -> None:
        """`name`'s process and cache are gone (it died, or was stopped after a drain):
        forget what it held; its sessions move at their next request, counted as
        `reason`."""
        self.prefix.forget(name)
        self._tips[name] = set()
        self.epoch[name] += 1
        self._lost_reason[name] = reason

    def cap(self) -> int:
        """The most requests one replica may hold after taking the next one."""
        ready = self.ready()
        total = sum(self.load[n] for n in ready)
        return self.prefix.cap(total, max(1, len(ready)))

    # ---- decisions -------------------------------------------------------------------

    def route_session(self, session_id: str) -> Decision | None:
        """Where a request on named session `session_id` goes (None: no replica ready).
        A decision with `reason` OVERLOADED needs the old replica to let the session go
        first (the caller asks it, and on refusal calls `stay`)."""
        ready = self.ready()
        s = self.sessions.get(session_id)
        if s is not None and self.epoch[s.replica] == s.epoch and (
                self.state[s.replica] is ReplicaState.DRAINING):
            # its lock is there until the replica stops: it finishes its turns there
            return self._count(Decision(s.replica, Kind.SESSION_STICKY))
        if s is not None and self.epoch[s.replica] == s.epoch and s.replica in ready:
            idle = [n for n in ready if n != s.replica and self.load[n] == 0]
            if not (idle and s.busy == 0 and self.load[s.replica] >= self.cap()):
                return self._count(Decision(s.replica, Kind.SESSION_STICKY))
            route = self.prefix.choose([session_key(session_id)], self.load, idle)
            return self._count(Decision(route.target, Kind.SESSION_MIGRATED,
                                        moved_from=s.replica, reason=Reason.OVERLOADED))
        # a new session is placed at the fair share, as a new conversation is (below)
        route = self.prefix.choose([session_key(session_id)], self.load, ready,
                                   load_bound=FAIR_SHARE if s is None else None)
        if route is None:
            return None
        if s is None:
            return self._count(Decision(route.target, Kind.SESSION_NEW))
        reason = (self._lost_reason.get(s.replica, Reason.DEAD)
                  if self.epoch[s.replica] != s.epoch else Reason.DRAINED)
        return self._count(Decision(route.target, Kind.SESSION_MIGRATED,
                                    moved_from=s.replica, reason=reason))

    def waiting_on(self, session_id: str) -> str | None:
        """The replica a session must wait for (it is persisting the session as it stops),
        or None."""
        s = self.sessions.get(session_id)
        if s is not None and self.epoch[s.replica] == s.epoch and (
                self.state[s.replica] is ReplicaState.STOPPING):
            return s.replica
        return None

    def stay(self, session_id: str, decision: Decision) -> Decision:
        """An overload move the old replica refused (the session was busy there)."""
        self.decisions[decision.kind] -= 1
        self.migrations[decision.reason] -= 1
        return self._count(Decision(decision.moved_from, Kind.SESSION_STICKY))

    def route_conversation(self, keys: Sequence[bytes]) -> Decision | None:
        """Where a stateless conversation with these message keys goes (None: no replica
        ready)."""
        if self.routing is Routing.RANDOM:
            return self._random()
        depth = self.depths(keys)
        ready = self.ready()
        order = self.prefix.ranked(keys, ready, depth)
        if order and order[0][1] >= CONTINUED:
            # it continues a conversation that replica holds: moving it recomputes its
            # history, so (as a session) it stays unless the replica is at its cap while
            # another is idle
            best, d = order[0]
            if self.load[best] < self.cap() or not any(
                    self.load[n] == 0 for n in ready if n != best):
                return self._count(Decision(best, Kind.CONVERSATION_AFFINE, d))
        # a new conversation (nothing past the system message matched) is placed at the
        # fair share, not within the 1.25x bound: its whole history will be computed where
        # it lands, and an uneven split costs either the busier replica's queue for the
        # conversation's whole life or, once the other idles, a move that recomputes that
        # history; the prefix it shares (a system prompt) costs once per replica
        fresh = not order or order[0][1] < CONTINUED
        route = self.prefix.choose(keys, self.load, ready, depth,
                                   FAIR_SHARE if fresh else None)
        if route is None:
            return None
        kind = (Kind.CONVERSATION_SPILLED if not route.preferred else
                Kind.CONVERSATION_AFFINE if route.matched_blocks else Kind.CONVERSATION_NEW)
        return self._count(Decision(route.target, kind, route.matched_blocks))

    def route_other(self, keys: Sequence[bytes]) -> Decision | None:
        if self.routing is Routing.RANDOM:
            return self._random()
        route = self.prefix.choose(keys, self.load, self.ready())
        return None if route is None else self._count(
            Decision(route.target, Kind.OTHER, route.matched_blocks))

    def _random(self) -> Decision | None:
        ready = self.ready()
        return self._count(Decision(self._rng.choice(ready), Kind.RANDOM)) if ready else None

    def depths(self, keys: Sequence[bytes]) -> dict[str, int]:
        """Per replica: how many leading keys it holds, from what it answered (all the
        prefixes of the requests it served) or, deeper, from a filed Session its summary
        listed (a chain hash names the whole prefix before it)."""
        depth = self.prefix.matched_blocks(keys)
        for i in range(len(keys) - 1, -1, -1):
            for n in self.names:
                if keys[i] in self._tips[n] and depth[n] < i + 1:
                    depth[n] = i + 1
        return depth

    def _count(self, d: Decision) -> Decision:
        self.decisions[d.kind] += 1
        if d.reason is not None:
            self.migrations[d.reason] += 1
        return d

    # ---- what happened ---------------------------------------------------------------

    def started(self, decision: Decision, session_id: str | None = None) -> None:
        """The request was sent to `decision.replica`."""
        self.load[decision.replica] += 1
        self.routed[decision.replica] += 1
        if session_id is not None:
            s = self.sessions.get(session_id)
            if s is None or s.replica != decision.replica:
                busy = s.busy if s is not None else 0
                s = self.sessions[session_id] = _Session(
                    decision.replica, self.epoch[decision.replica], busy)
            s.busy += 1

    def finished(self, decision: Decision, session_id: str | None = None) -> None:
        self.load[decision.replica] -= 1
        s = self.sessions.get(session_id) if session_id is not None else None
        if s is not None:
            s.busy = max(0, s.busy - 1)

    def served(self, replica: str, keys: Iterable[bytes]) -> None:
        """`replica` answered a conversation with these keys: its cache holds them."""
        if self.state[replica] in (ReplicaState.READY, ReplicaState.DRAINING):
            self.prefix.record(replica, list(keys))

    def report(self, replica: str, filed: Collection[bytes], named: Collection[str]) -> None:
        """A replica's summary: the conversation keys its Sessions are filed under, and
        the named sessions it holds open (their locks are its)."""
        gone = self._tips[replica] - set(filed)
        self.prefix.discard(replica, gone)
        self._tips[replica] = set(filed)
        for sid in named:
            s = self.sessions.get(sid)
            if s is None or (s.replica != replica and s.busy == 0):
                self.sessions[sid] = _Session(replica, self.epoch[replica])

    def holder(self, session_id: str) -> str | None:
        s = self.sessions.get(session_id)
        return None if s is None else s.replica

    def sessions_on(self, replica: str) -> int:
        return sum(1 for s in self.sessions.values()
                   if s.replica == replica and s.epoch == self.epoch[replica])
