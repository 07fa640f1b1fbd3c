"""The test suite's one way into an `LLM`'s engine (its private `Runtime`, `llm._rt`).

The contract:

* Tests observe behaviour through the public API wherever it shows it: `llm.generate`,
  `llm.session(...)` and the turns' outputs (`restored_from`, `cached_tokens`, ...),
  `session.stats`, `session.state`, `llm.stats()` (spills, restores, recomputes,
  preemptions, prefill tokens, prefix hits, remote prefills, fallbacks, worker states,
  bandwidth), `llm.check_integrity()`, `llm.runtime` (the model spec, KV bytes per token).
* This module exists for what no public seam shows or can arrange: forcing a session's KV
  to a tier, pinning a measured rate so the cost model decides deterministically, running
  a function on the engine thread (or holding it, to batch requests into one step),
  observing or failing steps, driving the prefill workers' connector, and reading or
  changing the model and the KV pool a kernel test works on.
* `Internals(llm)` is the only code in tests/ that touches `llm._rt` (or the LLM's other
  private parts, its session store and request builder; tests/test_test_seams.py checks
  it). Every member says which behaviour it makes
  testable; a new need gets a member here, with its reason, not a reach-in in a test.
  Members return internal objects only where a test must drive them (the connector's
  knobs, the kernels' model and pool); specific verbs are preferred.

Child processes started by a test (a script run with `python -c`) import it after
`CHILD_PRELUDE`, which puts tests/ on their path.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent.futures import Future
from pathlib import Path

# first line of a child script that uses Internals: tests/ on sys.path
CHILD_PRELUDE = f"import sys; sys.path.insert(0, {str(Path(__file__).resolve().parent)!r})\n"

# fix_rate's names: the cost model's measured inputs
_RATES = {"host": ("mover", "host_bytes_per_s"),  # host tier load bandwidth, bytes/s
          "disk_read": ("mover", "disk_read_bytes_per_s"),  # disk tier read bandwidth
          "object_read": ("mover", "object_read_bytes_per_s"),  # object store, bytes/s
          "object_latency": ("mover", "object_latency_s"),  # its round trip, seconds
          "prefill": ("engine", "prefill_tps")}  # prefill throughput, tokens/s


class Internals:
    """What tests need of one LLM's engine that its public API does not show."""

    def __init__(self, llm):
        self._rt = llm._rt
        self._store = llm._store

    # ---- the engine thread -----------------------------------------------------------

    def on_engine(self, fn: Callable[[], object]) -> object:
        """Run fn on the engine thread between two steps and return its result: engine
        state is only consistent (and only mutable) there."""
        return self._rt.call(fn).result()

    def post(self, fn: Callable[[], object]) -> Future:
        """Post fn to the engine thread without waiting: holding the thread in a call
        batches what is submitted meanwhile into one step; a call left in the inbox shows
        what a dying engine does to pending calls."""
        return self._rt.call(fn)

    def submit(self, prompt_ids: list[int], params, on_finish=None) -> Future:
        """One request's own Future, outside generate(): to batch raw requests into one
        step and give one a finish callback that fails (a fault of a single request)."""
        seq = self._rt.sequences.new(prompt_ids, params)
        if on_finish is not None:
            seq.on_finish = on_finish
        return self._rt.submit(seq)

    @property
    def futures(self) -> dict:
        """The engine's unresolved request futures: a dead engine must leave none behind."""
        return self._rt.engine.futures

    def after_each_step(self, fn: Callable[[], None]) -> None:
        """Call fn on the engine thread after every step: count steps, or inject a fault
        at a chosen step."""
        self._rt.engine.step_observers.append(fn)

    def check_every_step(self) -> None:
        """Check the block accounting after every step whatever the pool's size (the suite
        does it for small pools only): a leak fails the step that made it."""
        self.after_each_step(self._rt.integrity.now)

    def add_timer(self, fn: Callable[[float], float | None]) -> None:
        """A housekeeping timer of the engine loop: a timer that raises kills the engine
        thread, which every caller must then be told about."""
        self._rt.engine.timers.append(fn)

    @property
    def steps(self) -> int:
        """Engine steps so far: concurrent requests must share steps (batching), forced
        tokens must take fewer of them (jump-forward)."""
        return self._rt.engine.num_steps

    @property
    def drafter(self):
        """The engine's drafter: a test replaces its draft source (`replace_lookup`, e.g.
        kvsession.testing.ReplayLookup) to control what verifications keep, or reads what
        they kept (`accepted_tokens`, `proposed_tokens`)."""
        return self._rt.drafter

    def running_priorities(self) -> list[int]:
        """The priorities of the sequences the scheduler runs (engine thread: call it from
        `after_each_step` or `on_engine`): where a request's priority came from an HTTP
        hint, that it reached the scheduler."""
        return [s.priority for s in self._rt.scheduler.running]

    def idle(self) -> bool:
        """Nothing queued, running or at a worker (asked on the engine thread): a cancelled
        stream or a refused call must leave no request behind."""
        return not self.on_engine(self._rt.scheduler.has_work)

    def housekeeping(self) -> float | None:
        """Run the engine's timed work now (pin expiry, idle spills) and return its next
        wait: TTLs are tested against a fake clock, far deadlines against the wait cap."""
        return self.on_engine(self._rt.engine.housekeeping)

    @property
    def stall_ratio(self):
        """The measured decode stall of mixed prefill/decode steps (the remote-prefill cost
        model's input), to check how it is measured."""
        return self._rt.engine.stall_ratio

    @property
    def runner(self):
        """The model runner: the attention backend it resolved, its CUDA graphs (replaced
        by padded ones in a test), its thread governor."""
        return self._rt.engine.runner

    # ---- tiers: where a session's KV lives -----------------------------------------

    def spill(self, session, tier):
        """Move an idle session's KV to `tier` now (no memory pressure needed); returns
        the tier it went to: every path a session's KV can take is tested this way."""
        return self.on_engine(lambda: self._rt.policy.spill(session.kv, tier))

    def restore(self, session) -> str | None:
        """Load a spilled session back now, before its next turn: to compare the loaded
        bytes with what was spilled."""
        return self.on_engine(lambda: self._rt.policy.restore(session.kv))

    def drop(self, session, reason: str = "test") -> None:
        """Forget a session's private KV (what a loaded-ahead session loses under
        pressure): its next turn recomputes."""
        self.on_engine(lambda: self._rt.policy.drop(session.kv, reason=reason))

    def hold_copier(self) -> HeldCopier:
        """Occupy the copier thread until released: a session's load queued behind it
        stays in flight, so a test sees what runs meanwhile (the engine keeps stepping)
        without timing anything."""
        return HeldCopier(self)

    def tier_housekeeping(self, now: float, settle: bool = True) -> None:
        """The tier policy's timed work as if the clock read `now` (monotonic): sessions
        idle past spill_after_s spill, and what the device's next allocations would evict
        is copied to the host ahead of them, without the test waiting for either. Their
        copies run on the copier: with `settle` they are waited for and settled before
        this returns, else they are left in flight (the engine loop settles them)."""
        policy = self._rt.policy

        def spill():
            policy.housekeeping(now)
            if settle:
                policy.settle_moves()
        self.on_engine(spill)

    def num_lead(self, session) -> int:
        """How many of a session's leading blocks are pinned (shared, never spilled): what
        the shared prefix store holds once per directory."""
        return self.on_engine(lambda: self._rt.policy.num_lead(session.kv))

    @property
    def sessions(self) -> tuple[dict, list]:
        """(the LLM's registry of open sessions, the sessions the tier policy holds): a
        refused fork must leave nothing in either; a server conversation's Session is found
        by its id."""
        return self._store.live, self._rt.policy.sessions

    @property
    def host_index(self):
        """The host tier's block pool (its content index): to make a host block claim
        other tokens and see that a lookup misses."""
        return self._rt.host.index

    @property
    def disk_cache(self):
        """The disk tier's cache (None without one): its index and file, to damage a slot
        and see that a load stops there."""
        return self._rt.disk_cache

    def disk_plan(self, session):
        """Where a resumed session's KV will be read from (snapshot, segment, shared
        store): to check which files a restart reuses."""
        return self._rt.mover.plans[session.kv]

    def fix_rate(self, name: str, value: float) -> None:
        """Pin a measured rate ("host", "disk_read": bytes/s; "prefill": tokens/s) so the
        cost model's load-or-recompute choice does not depend on this machine's speed."""
        owner, attr = _RATES[name]
        getattr(getattr(self._rt, owner), attr).fix(value)

    @property
    def host_staged(self) -> bool:
        """Whether host moves are staged through the block-copy kernel (the CUDA path)."""
        return self._rt.host.staged

    # ---- durability ----------------------------------------------------------------

    @property
    def journal(self):
        """The session logs' group commit (None without durability="turn"): its records
        and batches show that turns ending together share fsyncs."""
        return self._rt.journal

    @property
    def writeback(self):
        """The write-behind of KV blocks to segments: its counters (blocks written, syncs,
        compactions) and requests (close one session's segment)."""
        return self._rt.writeback

    def flush_writes(self, timeout: float = 60) -> None:
        """Wait until every block queued behind the turns is on disk: what reaches the
        disk then no longer depends on the machine's load."""
        from kvsession.tiers.writeback import WriteOp

        self._rt.writeback.request(WriteOp.FLUSH, None).result(timeout)

    @property
    def identity(self):
        """The storage identity files are written under: to scan a segment directly."""
        return self._rt.identity

    # ---- the model and the KV cache -----------------------------------------------

    @property
    def model(self):
        """The model itself: kernel tests swap its one-row kernels and time its steps."""
        return self._rt.model

    @property
    def kv_pool(self):
        """The KV cache's tensors: to poison, overwrite or compare them bit for bit, and
        to check what was really allocated."""
        return self._rt.kv_pool

    @property
    def manager(self):
        """The block manager: to take and release blocks as a stand-in holder
        (copy-on-write of a shared tail, evicting every cached block)."""
        return self._rt.manager

    @property
    def hasher(self):
        """The prefix cache's block hasher: its scope (fp8 and bf16 never share hashes),
        a colliding hash function, the hashes a poisoned snapshot claims."""
        return self._rt.prefix.hasher

    def set_prefix_clock(self, clock: Callable[[], float]) -> None:
        """Replace the clock pin TTLs are measured on: expiry tested without sleeping."""
        self._rt.prefix.clock = clock

    def grammars(self):
        """The structured-output compiler: a format must be compiled once, then reused."""
        return self._rt.sequences.grammars()

    # ---- remote prefill ------------------------------------------------------------

    @property
    def connector(self):
        """The prefill workers' client (None when not connected): its timing knobs made
        small, its pending requests and transfer samples, a forged notification's target."""
        return self._rt.connector

    @property
    def compat(self) -> str:
        """The compatibility hash a worker's handshake must carry: fuzz callers speak it."""
        return self._rt.compat

    def poll_remote(self) -> bool:
        """Drive the workers once on the engine thread, as the idle engine does (late
        answers, notifications); returns whether no blocks are left in quarantine."""
        def poll():
            self._rt.engine.poll_remote(0.02)
            return not self._rt.scheduler.quarantine

        return self.on_engine(poll)

    def remote_holds(self) -> dict[str, object]:
        """What remote prefill still holds (requests at a worker, quarantined blocks):
        all empty once nothing is in flight, or a block leaked."""
        conn, sched = self._rt.connector, self._rt.scheduler
        return {"pending": conn.pending, "connector quarantine": conn.quarantine,
                "quarantine": sched.quarantine, "at a worker": sched.remote}


class HeldCopier:
    """The copier thread held by a test (`Internals.hold_copier`) until `set()`."""

    def __init__(self, ins: Internals):
        self._ins = ins
        self._release = threading.Event()
        ins._rt.mover.copier.submit(self._release.wait, 60)

    def set(self) -> None:
        self._release.set()

    def loads_in_flight(self) -> int:
        """Sessions whose KV, and requests whose prompt blocks, are on their way from a
        lower tier on the copier (not settled yet)."""
        rt = self._ins._rt
        return self._ins.on_engine(
            lambda: rt.policy.moves_in_flight() + len(rt.scheduler.loading))
