"""The engine step and the engine thread that drives it.

`Engine.step()` runs one scheduled batch: schedule -> run the model -> sample -> advance ->
finish. Only the engine thread calls it. `EngineLoop` owns that thread and a request inbox:
any thread submits sequences (or engine-side calls, e.g. pinning) and gets a
`concurrent.futures.Future`; the loop batches everything that is pending into shared steps.
An exception inside a step fails only the requests of that step; the loop survives.
"""

from __future__ import annotations

import inspect
import itertools
import logging
import threading
import time
from collections.abc import Callable, Generator
from concurrent.futures import CancelledError, Future, InvalidStateError

import torch

from kvsession.costmodel import RateEstimator, StallRatio, key_reads
from kvsession.engine.drafts import Drafter
from kvsession.engine.remote import RemotePrefillDriver, RemotePrefills
from kvsession.engine.runner import ModelRunner
from kvsession.engine.sampler import Sampled, Sampler, top_logprobs
from kvsession.engine.scheduler import ScheduledSeq, Scheduler
from kvsession.engine.sequence import Sequence, SequenceStatus
from kvsession.engine.slo_chunking import SloChunking
from kvsession.errors import CacheFullError, EngineClosedError
from kvsession.metrics import LatencyTracker, RequestMetrics
from kvsession.model.tokenizer import IncrementalText

log = logging.getLogger("kvsession")

OnUpdate = Callable[[Sequence], None]
# how long close() waits for the step in progress to end
CLOSE_TIMEOUT_S = 120.0
# the longest the idle loop sleeps before it looks at its deadlines again
MAX_IDLE_WAIT_S = 3600.0
# with only lower-tier copies in flight, the longest a step waits on them before it looks
# at its inbox again (new requests, calls)
LOAD_POLL_S = 0.002
# prompt_logprobs: prompt positions turned into vocabulary-wide logits at a time (bounds the
# float32 [rows, vocab] temporary: 256 x 128k is 128 MiB)
PROMPT_LOGPROBS_ROWS = 256


def request_metrics(seq: Sequence) -> RequestMetrics:
    first = seq.first_token_time or seq.finish_time
    ttft = first - seq.arrival_time
    n = seq.num_output_tokens
    tpot = (seq.finish_time - first) / (n - 1) if n > 1 else 0.0
    queue = (seq.first_scheduled_time or first) - seq.arrival_time
    return RequestMetrics(ttft_s=ttft, tpot_s=tpot, e2e_s=seq.finish_time - seq.arrival_time,
                          queue_s=queue, forward_passes=seq.num_forward_passes,
                          accepted_draft_tokens=seq.num_accepted_drafts)


Timer = Callable[[float], "float | None"]  # timer(monotonic now) -> seconds to next deadline


class Engine:
    """One step at a time; not thread-safe (the engine thread owns it).

    `prefill_tps` is measured here (prompt tokens/s of steps that prefill) and read by the
    tier policy's load-vs-recompute rule, and `stall_ratio` (the share of decode steps' time
    added by prefills batched with them) by the remote-prefill decision; `timers` are called
    between steps (the tier policy's idle spills, remote-prefill polling while idle).
    `remote_required`: a prompt the workers did not prefill fails with RemotePrefillError
    rather than being prefilled here (remote_prefill="required")."""

    def __init__(self, scheduler: Scheduler, runner: ModelRunner, sampler: Sampler,
                 new_text: Callable[[], IncrementalText], latency: LatencyTracker,
                 prefill_tps: RateEstimator, timers: list[Timer] | None = None,
                 connector: RemotePrefills | None = None,
                 stall_ratio: StallRatio | None = None, remote_required: bool = False,
                 drafter: Drafter | None = None, chunking: SloChunking | None = None):
        self.scheduler, self.runner, self.sampler = scheduler, runner, sampler
        # SLO-aware chunking learns each step's cost from the times measured here
        self.chunking = chunking
        # what verifications kept goes back to it (the scheduler asks it for drafts)
        self.drafter = drafter
        self.new_text, self.latency = new_text, latency
        self.prefill_tps = prefill_tps
        self.stall_ratio = stall_ratio or StallRatio()
        self.timers: list[Timer] = list(timers or [])
        # the remote-prefill side (engine/remote.py): None without prefill workers
        self.remote = RemotePrefillDriver(scheduler, connector, remote_required) \
            if connector is not None else None
        if self.remote is not None:
            self.timers.append(self.remote_idle_poll)
        self.futures: dict[int, tuple[Future, OnUpdate | None]] = {}
        # requests cancelled while a lower tier's copy fills their blocks: failed once it
        # is done (freeing blocks the copier still writes could hand them to another)
        self.cancel_after_load: set[int] = set()
        self.num_steps = 0
        self.prefill_tokens = 0  # prompt tokens computed here (stats().prefill_tokens)
        self.generated_tokens = 0  # tokens sampled (stats().generated_tokens)
        # Called on the engine thread after every step (debug checks, tests, tracing).
        self.step_observers: list[Callable[[], None]] = []

    def housekeeping(self) -> float | None:
        """Timed work between steps (pin expiry). Returns seconds until the next deadline
        (at most MAX_IDLE_WAIT_S), or None when nothing is timed."""
        pins = self.scheduler.prefix.pins
        now = self.scheduler.prefix.clock()
        pins.expire(now)
        deadline = pins.next_deadline()
        waits = [] if deadline is None else [max(deadline - now, 0.0)]
        mono = time.monotonic()
        waits += [w for timer in self.timers if (w := timer(mono)) is not None]
        # capped: Condition.wait raises OverflowError past threading.TIMEOUT_MAX (~292
        # years), which a pin's or an idle session's far deadline reaches; the loop wakes,
        # finds nothing due and waits again
        return min(min(waits) + 1e-3, MAX_IDLE_WAIT_S) if waits else None

    def add(self, seq: Sequence, fut: Future, on_update: OnUpdate | None) -> None:
        self.futures[seq.seq_id] = (fut, on_update)
        self.scheduler.add(seq)

    def poll_remote(self, timeout_s: float = 0.0) -> None:
        """Drive the prefill workers (engine/remote.py); fail the requests it gives up."""
        for seq, error in self.remote.poll(timeout_s):
            self._fail(seq, error)

    def remote_idle_poll(self, now: float) -> float | None:
        """Timer: fences and heartbeats while no step runs."""
        wait, failed = self.remote.idle_poll()
        for seq, error in failed:
            self._fail(seq, error)
        return wait

    def quarantine_at_rest(self) -> bool:
        """Engine thread, at close: whether quarantined blocks are held legitimately
        (RemotePrefillDriver.at_rest; False: no workers). Completions an idle tick read
        are applied first."""
        if self.remote is None:
            return False
        try:
            self.poll_remote()
        except Exception:  # noqa: BLE001 - closing: the accounting below still holds
            log.debug("closing: a last poll of the prefill workers failed", exc_info=True)
        return self.remote.at_rest()

    def step(self) -> None:
        if self.remote is not None:
            self.poll_remote()
        for seq in self.scheduler.poll_loads():
            if seq.seq_id in self.cancel_after_load:
                self.cancel_after_load.discard(seq.seq_id)
                self._fail(seq, CancelledError(f"request {seq.seq_id} was cancelled"))
        batch, failed = self.scheduler.schedule()
        if not batch and self.scheduler.loading:
            self.scheduler.wait_loads(LOAD_POLL_S)  # nothing else to run: not a hot loop
        if self.remote is not None and (self.scheduler.new_remote or not batch):
            # nothing to run locally while workers prefill: wait on them briefly
            self.poll_remote(0.0 if self.scheduler.new_remote or batch else 0.002)
        for seq in failed:
            self._fail(seq, CacheFullError(
                f"request of {seq.num_tokens} tokens cannot fit in the KV blocks that are not "
                f"pinned ({self.scheduler.pool.num_free} free of "
                f"{self.scheduler.pool.num_blocks})"))
        if not batch:
            return
        prompt_items = [(n, item.seq.num_computed_tokens) for item in batch if (n := min(
            item.num_new_tokens, max(0, item.seq.num_prompt_tokens
                                     - item.seq.num_computed_tokens))) > 0]
        prompt_tokens = sum(n for n, _ in prompt_items)
        decodes = sum(item.seq.num_computed_tokens >= item.seq.num_prompt_tokens
                      for item in batch)
        draft_tokens = sum(item.num_draft_tokens for item in batch)
        t0 = time.perf_counter()
        try:
            logits = self._run_model(batch)
            sampling = [item for item in batch if item.samples]
            # each sequence's first row (a verifying one has one more per draft); taken
            # now: `samples` reads the progress that `update` advances
            num_rows = [item.num_rows for item in sampling]
            first_rows = list(itertools.accumulate(num_rows, initial=0))[:-1]
            sampled = self.sampler(logits if not draft_tokens else logits[first_rows],
                                   [item.seq for item in sampling])
        except Exception as e:  # a broken step fails its requests, not the engine
            log.exception("engine step failed")
            for item in batch:
                self._fail(item.seq, e)
            return
        self.prefill_tokens += prompt_tokens
        elapsed_s = time.perf_counter() - t0
        if prompt_tokens >= 16:
            self.prefill_tps.observe(prompt_tokens, elapsed_s)
        # drafts are tokens a decode step carries beyond its decodes, as prompt tokens are
        self.stall_ratio.observe(decodes, prompt_tokens + draft_tokens, elapsed_s)
        if self.chunking is not None:
            self.chunking.observe(decodes, prompt_tokens, sum(
                key_reads(n, c) for n, c in prompt_items), elapsed_s)
        self.num_steps += 1
        for item in batch:
            item.seq.num_forward_passes += 1
        # a verifying sequence has computed its last token; its drafts count once kept
        self.scheduler.update([ScheduledSeq(item.seq, 1) if item.num_draft_tokens else item
                               for item in batch])
        # the requests this step completes resolve after every row is advanced: their
        # finish callbacks (a session's check-in, its log record announced to the group
        # commit) all run before any caller wakes, so the records of turns ending in one
        # step share one fsync however the callers' threads are scheduled
        completed: list[tuple[Future, Sequence]] = []
        try:
            for item, row, n, result in zip(sampling, first_rows, num_rows, sampled,
                                            strict=True):
                seq = item.seq
                # one request's failure (its sampling, its stop check, its session's check-in)
                # fails that request alone: the others of the batch go on unchanged
                if isinstance(result, BaseException):
                    log.warning("request %d failed in sampling: %r", seq.seq_id, result)
                    self._fail(seq, result)
                    continue
                try:
                    if item.num_draft_tokens:
                        self._verify(item, logits[row: row + n], result,
                                     decodes, completed)
                        continue
                    if seq.fork_pending:
                        self._fork(seq, logits[row], completed)
                    self._advance(seq, *result, completed)
                except Exception as e:
                    log.exception("request %d failed after its step", seq.seq_id)
                    if seq.status is not SequenceStatus.FINISHED:
                        self._fail(seq, e)
                    else:  # already handed over (on_finish ran or raised): tell the caller
                        fut, _ = self.futures.pop(seq.seq_id, (None, None))
                        settle(fut, exc=e)
        finally:
            for fut, owner in completed:
                settle(fut, result=owner)
        for observe in self.step_observers:
            observe()

    def _run_model(self, batch: list[ScheduledSeq]):
        """The runner's logits for the rows that sample. A step holding prompt positions of
        a prompt_logprobs request also needs their logits, which the runner does not return:
        such a step runs the model through the runner's own parts and keeps them."""
        want = [(i, item) for i, item in enumerate(batch)
                if item.seq.params.prompt_logprobs is not None
                and item.seq.num_computed_tokens < item.seq.num_prompt_tokens - 1]
        if not want:
            return self.runner.run(batch)
        r = self.runner
        input_ids, positions, meta, rows = r.prepare(batch)
        hidden = r.model.forward(input_ids, positions, r.kv_pool, meta)
        for i, item in want:
            seq, first = item.seq, item.seq.num_computed_tokens
            # position p predicts prompt token p + 1; the last prompt position predicts the
            # first output token, which is sampled, not a prompt logprob
            last = min(first + item.num_new_tokens, seq.num_prompt_tokens - 1)
            start = meta.query_start_loc[i]
            for lo in range(first, last, PROMPT_LOGPROBS_ROWS):
                hi = min(lo + PROMPT_LOGPROBS_ROWS, last)
                lp = torch.log_softmax(r.model.logits(
                    hidden[start + lo - first: start + hi - first]).float(), dim=-1).cpu()
                for p in range(lo, hi):
                    seq.prompt_logprobs[p + 1] = top_logprobs(
                        lp[p - lo], seq.token_ids[p + 1], seq.params.prompt_logprobs)
        return r.model.logits(hidden[rows])

    def _jump_forward(self, seq: Sequence) -> bool:
        """Append the tokens the format forces (they are computed in the next step with the
        token that follows them, like a prompt chunk); True if one of them ends the request
        (max_tokens, a stop string)."""
        for token in seq.grammar.forced_tokens():
            seq.append_token(token, None)
            if seq.check_finished(self.new_text):
                return True
        return False

    def _fork(self, parent: Sequence, logits, completed: list[tuple[Future, Sequence]]
              ) -> None:
        """n > 1, at the parent's first sample: the other completions are spawned, share its
        prompt KV (Scheduler.fork) and sample their first tokens from the same logits."""
        children = [parent.spawn(i) for i in range(1, parent.params.n)]
        parent.group = [parent, *children]
        for child in children:
            child.group = parent.group
        self.scheduler.fork(parent, children)
        sampled = self.sampler(logits.unsqueeze(0).expand(len(children), -1), children)
        for child, result in zip(children, sampled, strict=True):
            if isinstance(result, BaseException):
                raise result  # the request fails as a whole (the caller's except)
            self._advance(child, *result, completed)

    def _verify(self, item: ScheduledSeq, logits: torch.Tensor, first: Sampled,
                num_decodes: int, completed: list[tuple[Future, Sequence]]) -> None:
        """A sequence that computed drafts d0..d(k-1) after its last token t: row j of
        `logits` is its next-token distribution after t, d0 .. d(j-1). Each row is sampled
        as a step without drafts would sample it (the sampler, this sequence's state after
        the tokens before it, its generator), in order; a row is valid only while every
        draft before it was the token sampled, so the first token that differs from its
        draft is the last one taken (the bonus row's, when all k are kept). Greedy output is
        the same as without drafts; sampled output draws the same numbers from the same
        distributions, so a seeded request's tokens are the same too (a draft is kept with
        the probability the model gives it: speculative sampling with a one-token draft
        distribution). `first`: row 0, sampled with the batch."""
        seq, k = item.seq, item.num_draft_tokens
        drafts, seq.draft_token_ids = seq.draft_token_ids[:k], []
        token, logprobs = first
        kept = 0
        while True:
            done = self._append(seq, token, logprobs)
            if done or kept == k or token != drafts[kept]:
                break
            kept += 1
            (result,) = self.sampler(logits[kept: kept + 1], [seq])
            if isinstance(result, BaseException):
                raise result  # the request fails (the caller's except)
            token, logprobs = result
        seq.num_accepted_drafts += kept
        self.scheduler.keep_drafts(seq, kept)
        if self.drafter is not None:
            self.drafter.observe(seq, k, kept, num_decodes)
        self._settle(seq, done, completed)

    def _advance(self, seq: Sequence, token: int, logprobs: dict[int, float] | None,
                 completed: list[tuple[Future, Sequence]]) -> None:
        """Append the sampled token; a request it completes joins `completed` (resolved
        by the caller at the end of the step)."""
        self._settle(seq, self._append(seq, token, logprobs), completed)

    def _append(self, seq: Sequence, token: int, logprobs: dict[int, float] | None) -> bool:
        """Append a sampled token (and what the format forces after it, with
        StructuredOutput.jump_forward); True if the request is complete."""
        seq.append_token(token, logprobs)
        self.generated_tokens += not seq.internal
        done = seq.check_finished(self.new_text)
        if not done and seq.grammar is not None and seq.params.structured.jump_forward:
            done = self._jump_forward(seq)
        return done

    def _settle(self, seq: Sequence, done: bool,
                completed: list[tuple[Future, Sequence]]) -> None:
        """After a step's tokens were appended: finish a completed request (joining
        `completed`), tell the caller what is new."""
        if done:
            seq.finish_time = time.perf_counter()
            self.scheduler.finish(seq, release=not seq.retain_blocks)
        # a request's future resolves when its last completion finishes
        members = seq.group or [seq]
        complete = done and all(m.status is SequenceStatus.FINISHED for m in members)
        owner = members[0]
        fut, on_update = (self.futures.pop(owner.seq_id, (None, None)) if complete
                          else self.futures.get(owner.seq_id, (None, None)))
        if done and seq.on_finish is not None:
            try:
                seq.on_finish(seq, True)
            except BaseException as e:
                settle(fut, exc=e)  # taken from self.futures above: its caller is told here
                raise
        if on_update is not None:
            self._notify(on_update, seq)
        if complete:
            if not owner.internal:
                self.latency.record(owner.arrival_time, seq.finish_time, request_metrics(seq),
                                    sum(x.num_output_tokens for x in members))
            if fut is not None:
                completed.append((fut, owner))

    @staticmethod
    def _notify(on_update: OnUpdate, seq: Sequence) -> None:
        try:
            on_update(seq)
        except Exception:  # a caller's callback must not break the engine
            log.exception("on_update callback failed")

    def _fail(self, seq: Sequence, exc: BaseException) -> None:
        """Fail the request `seq` belongs to: with n > 1 every completion of it ends."""
        members = seq.group or [seq]
        # the caller hears of it even if releasing the request's blocks raises
        fut, _ = self.futures.pop(members[0].seq_id, (None, None))
        try:
            for m in members:
                if m is seq or m.status is not SequenceStatus.FINISHED:
                    self.scheduler.finish(m)
                    if m.on_finish is not None:
                        m.on_finish(m, False)
        finally:
            settle(fut, exc=exc)

    def cancel(self, seq: Sequence) -> None:
        """The caller gave up on `seq`'s request: end it (every completion) and free its
        blocks. A request at a remote prefill worker is left to finish there (its blocks
        may still be written); its result is simply not read."""
        owner = seq.group[0] if seq.group else seq
        if seq.seq_id in self.scheduler.loading:
            self.cancel_after_load.add(seq.seq_id)
        elif owner.seq_id in self.futures and seq.seq_id not in self.scheduler.remote:
            self._fail(seq, CancelledError(f"request {owner.seq_id} was cancelled"))

    def fail_all(self, exc: BaseException | Callable[[], BaseException]) -> None:
        """Fail the running and waiting requests (`exc`, or a factory of one exception per
        request). Every one of them is failed even when releasing another's blocks raises
        (that error is logged)."""
        make = exc if callable(exc) and not isinstance(exc, BaseException) else lambda: exc
        for seq in list(self.scheduler.running) + list(self.scheduler.waiting):
            try:
                self._fail(seq, make())
            except Exception:
                log.exception("releasing request %d failed", seq.seq_id)

    def abort(self, make_exc: Callable[[], BaseException]) -> None:
        """The engine stops for good: fail every request, those at a remote worker too
        (their blocks stay held: a worker may still write them; only the callers are told)."""
        self.fail_all(make_exc)
        for fut, _ in self.futures.values():
            settle(fut, exc=make_exc())
        self.futures.clear()

def settle(fut: Future | None, result=None, exc: BaseException | None = None) -> None:
    """Resolve `fut` unless it is already resolved or was cancelled by its caller (which
    must not raise on the engine thread)."""
    if fut is None:
        return
    try:
        if exc is not None:
            fut.set_exception(exc)
        else:
            fut.set_result(result)
    except InvalidStateError:
        pass


class EngineLoop:
    """The engine thread. `submit` and `call` are thread-safe and return Futures.

    If the thread itself fails (anything raised outside a step's own error handling: a
    timer, a posted item, the failure handling), the loop closes for good: every pending
    request and call fails with EngineClosedError whose `__cause__` is that error, and so
    does every later one, at once. Nothing waits on a thread that is gone."""

    def __init__(self, engine: Engine, name: str = "kvsession-engine"):
        self.engine = engine
        self._inbox: list[tuple[Callable[[], None], Future]] = []
        self._cv = threading.Condition()
        self._closed = False
        self.failure: BaseException | None = None  # what killed the thread, if anything
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    def submit(self, seq: Sequence, on_update: OnUpdate | None = None,
               prepare: Callable[[], Generator[Future, None, None] | None] | None = None
               ) -> Future:
        """Queue `seq`; the Future resolves to it when finished. `prepare` runs first on the
        engine thread (e.g. attaching a session's blocks); if it raises, the Future fails
        and the sequence never runs. A `prepare` that is a generator may wait on other
        threads (a session's KV coming back from a lower tier) by yielding Futures: the
        engine keeps stepping the batch meanwhile (`call_steps`), and the sequence joins
        the scheduler when the generator ends."""
        fut: Future = Future()

        def add():
            steps = None
            if prepare is not None:
                try:
                    steps = prepare()
                except Exception as e:
                    settle(fut, exc=e)
                    return
            if inspect.isgenerator(steps):
                self._advance(steps, fut, lambda _: self.engine.add(seq, fut, on_update))
            else:
                self.engine.add(seq, fut, on_update)

        self._post(add, fut)
        return fut

    def call_steps(self, fn: Callable[[], Generator[Future, None, object]]) -> Future:
        """`call` for work that waits on other threads (a tier copy): `fn()` is a generator
        run on the engine thread; each Future it yields is waited on without holding the
        thread (the generator resumes on the engine thread once that Future is done), and
        what it returns lands in the Future returned here."""
        fut: Future = Future()

        def start():
            try:
                steps = fn()
            except Exception as e:
                settle(fut, exc=e)
                return
            self._advance(steps, fut, lambda result: settle(fut, result=result))

        self._post(start, fut)
        return fut

    def _advance(self, steps: Generator[Future, None, object], fut: Future,
                 then: Callable[[object], None]) -> None:
        """Engine thread: run `steps` to its next yield (a Future: resumed when it is done,
        by an item posted to this thread) or its end (`then(result)`). Its exception fails
        `fut`; so does the loop closing while it waits."""
        try:
            waiting = next(steps)
        except StopIteration as stop:
            then(stop.value)
            return
        except Exception as e:
            settle(fut, exc=e)
            return
        waiting.add_done_callback(
            lambda _: self._post(lambda: self._advance(steps, fut, then), fut))

    def submit_all(self, seqs: list[Sequence]) -> list[Future]:
        """`submit` for a batch, queued in one go: the engine adds all of it before its
        next step, so a batch is scheduled together whatever the threads' timing."""
        futs: list[Future] = [Future() for _ in seqs]
        items = [(lambda s=s, f=f: self.engine.add(s, f, None), f)
                 for s, f in zip(seqs, futs, strict=True)]
        with self._cv:
            if self._closed:
                for f in futs:
                    settle(f, exc=self._closed_error("before this call"))
                return futs
            self._inbox.extend(items)
            self._cv.notify()
        return futs

    def call(self, fn: Callable[[], object]) -> Future:
        """Run `fn` on the engine thread between steps (for anything that touches engine
        state: pins, session bookkeeping, stats snapshots); its result or exception lands
        in the Future."""
        fut: Future = Future()

        def run():
            try:
                result = fn()
            except Exception as e:
                settle(fut, exc=e)
            else:
                settle(fut, result=result)

        self._post(run, fut)
        return fut

    def _closed_error(self, when: str) -> EngineClosedError:
        if self.failure is None:
            return EngineClosedError(f"the LLM was closed {when}")
        e = EngineClosedError(f"the engine thread failed ({type(self.failure).__name__}: "
                              f"{self.failure}); this LLM can only be closed")
        e.__cause__ = self.failure
        return e

    def _post(self, item: Callable[[], None], fut: Future) -> None:
        with self._cv:
            if self._closed:
                settle(fut, exc=self._closed_error("before this call"))
                return
            self._inbox.append((item, fut))
            self._cv.notify()

    def _run(self) -> None:
        try:
            self._serve()
        except BaseException as e:  # the thread is lost: nobody may wait on it any more
            log.exception("the engine thread failed; pending and later calls fail")
            with self._cv:
                self.failure = e
                self._closed = True
        finally:
            self._drain()

    def _serve(self) -> None:
        while True:
            timeout = self.engine.housekeeping()
            with self._cv:
                if not self._closed and not self._inbox and not self.engine.scheduler.has_work():
                    self._cv.wait(timeout)  # woken by a post, or at the next deadline
                    continue
                if self._closed:
                    return
                items, self._inbox = self._inbox, []
            for item, _ in items:
                item()
            if self.engine.scheduler.has_work():
                try:
                    self.engine.step()
                except Exception as e:  # engine bookkeeping broke: fail what is in flight
                    log.exception("engine step raised outside the model run")
                    self.engine.fail_all(e)

    def _drain(self) -> None:
        """Closed (or failed): fail what is in flight and what was posted but never ran."""
        try:
            self.engine.abort(lambda: self._closed_error("while this request ran"))
        finally:
            with self._cv:
                items, self._inbox = self._inbox, []
            for _, fut in items:
                settle(fut, exc=self._closed_error("before this call ran"))

    def close(self, timeout_s: float = CLOSE_TIMEOUT_S) -> None:
        with self._cv:
            self._closed = True
            self._cv.notify()
        if threading.current_thread() is not self._thread:
            # bounded: a step that never returns must not hang close() or interpreter exit
            # (the thread is a daemon; it fails its requests when the step ends)
            self._thread.join(timeout_s)
            if self._thread.is_alive():
                log.error("the engine thread did not stop within %.0f s", timeout_s)
