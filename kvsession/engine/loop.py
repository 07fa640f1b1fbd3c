"""The engine step and the engine thread that drives it.

`Engine.step()` runs one scheduled batch: schedule -> run the model -> sample -> advance ->
finish. Only the engine thread calls it. `EngineLoop` owns that thread and a request inbox:
any thread submits sequences (or engine-side calls, e.g. pinning) and gets a
`concurrent.futures.Future`; the loop batches everything that is pending into shared steps.
An exception inside a step fails only the requests of that step; the loop survives.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from typing import Protocol

from kvsession.costmodel import RateEstimator
from kvsession.engine.runner import ModelRunner
from kvsession.engine.sampler import Sampler
from kvsession.engine.scheduler import Scheduler
from kvsession.engine.sequence import Sequence
from kvsession.errors import CacheFullError, EngineClosedError
from kvsession.metrics import LatencyTracker, RequestMetrics

log = logging.getLogger("kvsession")

OnUpdate = Callable[[Sequence], None]


def request_metrics(seq: Sequence) -> RequestMetrics:
    first = seq.first_token_time or seq.finish_time
    ttft = first - seq.arrival_time
    n = seq.num_output_tokens
    tpot = (seq.finish_time - first) / (n - 1) if n > 1 else 0.0
    queue = (seq.first_scheduled_time or first) - seq.arrival_time
    return RequestMetrics(ttft_s=ttft, tpot_s=tpot, e2e_s=seq.finish_time - seq.arrival_time,
                          queue_s=queue)


Timer = Callable[[float], "float | None"]  # timer(monotonic now) -> seconds to next deadline


class RemotePrefills(Protocol):
    """What the engine needs of a prefill connector (kvsession.connector.base)."""

    fallbacks: dict[str, int]
    pending: dict
    quarantine: dict

    def submit(self, seq_id: int, token_ids: list[int], first_block: int,
               block_ids: list[int], affinity: bytes, cache_salt: str | None) -> bool: ...

    def poll(self, timeout_s: float) -> list: ...


class Engine:
    """One step at a time; not thread-safe (the engine thread owns it).

    `prefill_tps` is measured here (prompt tokens/s of steps that prefill) and read by the
    tier policy's load-vs-recompute rule; `timers` are called between steps (the tier
    policy's idle spills, remote-prefill polling while idle)."""

    def __init__(self, scheduler: Scheduler, runner: ModelRunner, sampler: Sampler,
                 decode: Callable[[list[int]], str], latency: LatencyTracker,
                 prefill_tps: RateEstimator, timers: list[Timer] | None = None,
                 connector: RemotePrefills | None = None):
        self.scheduler, self.runner, self.sampler = scheduler, runner, sampler
        self.decode, self.latency = decode, latency
        self.prefill_tps = prefill_tps
        self.timers: list[Timer] = list(timers or [])
        self.connector = connector
        if connector is not None:
            self.timers.append(self.remote_idle_poll)
        self.futures: dict[int, tuple[Future, OnUpdate | None]] = {}
        self.num_steps = 0
        # Called on the engine thread after every step (debug checks, tests, tracing).
        self.step_observers: list[Callable[[], None]] = []

    def housekeeping(self) -> float | None:
        """Timed work between steps (pin expiry). Returns seconds until the next deadline,
        or None when nothing is timed."""
        pins = self.scheduler.prefix.pins
        now = self.scheduler.prefix.clock()
        pins.expire(now)
        deadline = pins.next_deadline()
        waits = [] if deadline is None else [max(deadline - now, 0.0)]
        mono = time.monotonic()
        waits += [w for timer in self.timers if (w := timer(mono)) is not None]
        return min(waits) + 1e-3 if waits else None

    def add(self, seq: Sequence, fut: Future, on_update: OnUpdate | None) -> None:
        self.futures[seq.seq_id] = (fut, on_update)
        self.scheduler.add(seq)

    def remote_idle_poll(self, now: float) -> float | None:
        """Timer: fences and heartbeats while no step runs."""
        conn = self.connector
        if conn.pending or conn.quarantine or self.scheduler.quarantine:
            self.poll_remote()
            return 0.02
        return None

    def poll_remote(self, timeout_s: float = 0.0) -> None:
        """Submit newly offloaded prefills; apply what the workers finished or failed."""
        sched, conn = self.scheduler, self.connector
        for seq in sched.new_remote:
            affinity = seq.block_hashes[0] if seq.block_hashes else b""
            first = seq.num_computed_tokens // sched.pool.block_size  # caller's own hits
            if not conn.submit(seq.seq_id, seq.token_ids[: seq.num_tokens - 1], first,
                               [b.block_id for b in seq.blocks[first:]], affinity,
                               seq.params.cache_salt):
                conn.fallbacks["no healthy worker"] = conn.fallbacks.get(
                    "no healthy worker", 0) + 1
                sched.remote_failed(seq, fenced=True)
        sched.new_remote = []
        for c in conn.poll(timeout_s):
            seq = sched.remote.get(c.seq_id)
            if c.kind == "fenced":
                sched.release_quarantine(c.seq_id)
            elif seq is not None and c.kind == "done":
                sched.remote_done(seq)
            elif seq is not None:
                sched.remote_failed(seq, fenced=c.fenced)

    def step(self) -> None:
        if self.connector is not None:
            self.poll_remote()
        batch, failed = self.scheduler.schedule()
        if self.connector is not None and (self.scheduler.new_remote or not batch):
            # nothing to run locally while workers prefill: wait on them briefly
            self.poll_remote(0.0 if self.scheduler.new_remote or batch else 0.002)
        for seq in failed:
            self._fail(seq, CacheFullError(
                f"request of {seq.num_tokens} tokens cannot fit in the KV blocks that are not "
                f"pinned ({self.scheduler.pool.num_free} free of "
                f"{self.scheduler.pool.num_blocks})"))
        if not batch:
            return
        prompt_tokens = sum(min(item.num_new_tokens, max(
            0, item.seq.num_prompt_tokens - item.seq.num_computed_tokens)) for item in batch)
        t0 = time.perf_counter()
        try:
            logits = self.runner.run(batch)
            sampling = [item.seq for item in batch if item.samples]
            sampled = self.sampler(logits, sampling)
        except Exception as e:  # a broken step fails its requests, not the engine
            log.exception("engine step failed")
            for item in batch:
                self._fail(item.seq, e)
            return
        if prompt_tokens >= 16:
            self.prefill_tps.observe(prompt_tokens, time.perf_counter() - t0)
        self.num_steps += 1
        self.scheduler.update(batch)
        for seq, (token, logprobs) in zip(sampling, sampled, strict=True):
            seq.append_token(token, logprobs)
            done = seq.check_finished(self.decode)
            if done:
                seq.finish_time = time.perf_counter()
                self.scheduler.finish(seq, release=not seq.retain_blocks)
            fut, on_update = self.futures[seq.seq_id] if not done else self.futures.pop(
                seq.seq_id)
            if done and seq.on_finish is not None:
                seq.on_finish(seq, True)
            if on_update is not None:
                self._notify(on_update, seq)
            if done:
                m = request_metrics(seq)
                self.latency.record(seq.arrival_time, seq.finish_time, m, seq.num_output_tokens)
                fut.set_result(seq)
        for observe in self.step_observers:
            observe()

    @staticmethod
    def _notify(on_update: OnUpdate, seq: Sequence) -> None:
        try:
            on_update(seq)
        except Exception:  # a caller's callback must not break the engine
            log.exception("on_update callback failed")

    def _fail(self, seq: Sequence, exc: BaseException) -> None:
        self.scheduler.finish(seq)
        if seq.on_finish is not None:
            seq.on_finish(seq, False)
        fut, _ = self.futures.pop(seq.seq_id, (None, None))
        if fut is not None and not fut.done():
            fut.set_exception(exc)

    def fail_all(self, exc: BaseException) -> None:
        for seq in list(self.scheduler.running) + list(self.scheduler.waiting):
            self._fail(seq, exc)


class EngineLoop:
    """The engine thread. `submit` and `call` are thread-safe and return Futures."""

    def __init__(self, engine: Engine, name: str = "kvsession-engine"):
        self.engine = engine
        self._inbox: list[tuple[Callable[[], None], Future]] = []
        self._cv = threading.Condition()
        self._closed = False
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def submit(self, seq: Sequence, on_update: OnUpdate | None = None,
               prepare: Callable[[], None] | None = None) -> Future:
        """Queue `seq`; the Future resolves to it when finished. `prepare` runs first on the
        engine thread (e.g. attaching a session's blocks); if it raises, the Future fails
        and the sequence never runs."""
        fut: Future = Future()

        def add():
            if prepare is not None:
                try:
                    prepare()
                except Exception as e:
                    fut.set_exception(e)
                    return
            self.engine.add(seq, fut, on_update)

        self._post(add, fut)
        return fut

    def call(self, fn: Callable[[], object]) -> Future:
        """Run `fn` on the engine thread between steps (for anything that touches engine
        state: pins, session bookkeeping, stats snapshots); its result or exception lands
        in the Future."""
        fut: Future = Future()

        def run():
            try:
                fut.set_result(fn())
            except Exception as e:
                fut.set_exception(e)

        self._post(run, fut)
        return fut

    def _post(self, item: Callable[[], None], fut: Future) -> None:
        with self._cv:
            if self._closed:
                fut.set_exception(EngineClosedError("the LLM is closed"))
                return
            self._inbox.append((item, fut))
            self._cv.notify()

    def _run(self) -> None:
        while True:
            timeout = self.engine.housekeeping()
            with self._cv:
                if not self._closed and not self._inbox and not self.engine.scheduler.has_work():
                    self._cv.wait(timeout)  # woken by a post, or at the next deadline
                    continue
                if self._closed:
                    break
                items, self._inbox = self._inbox, []
            for item, _ in items:
                item()
            if self.engine.scheduler.has_work():
                try:
                    self.engine.step()
                except Exception as e:  # engine bookkeeping broke: fail what is in flight
                    log.exception("engine step raised outside the model run")
                    self.engine.fail_all(e)
        self.engine.fail_all(EngineClosedError("the LLM was closed while this request ran"))
        with self._cv:
            items, self._inbox = self._inbox, []
        for _, fut in items:  # posted but never started
            if not fut.done():
                fut.set_exception(EngineClosedError("the LLM was closed before this call ran"))

    def close(self) -> None:
        with self._cv:
            self._closed = True
            self._cv.notify()
        if threading.current_thread() is not self._thread:
            self._thread.join()
