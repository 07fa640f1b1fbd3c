"""A session turn's way through the engine, one way: `Session` -> `TurnExecutor` -> engine
-> back to the Session.

    Session (caller's thread)            TurnExecutor                engine thread
    _prepare: messages, params, tools
    _render_turn: prompt token ids  ---> submit: Sequence (validated
                                         once), TurnInfo        ---> prepare: the session's
                                                                     blocks handed to the
                                                                     sequence (restored from
                                                                     a tier, or recomputed)
                                                                     ... steps ...
                                                                     finished: blocks taken
                                                                     back (checkin), new full
                                                                     blocks written behind,
                                                                     the log record announced
    _finish: Reply, messages, log   <--- output(seq)
    LogEntry (typed)                ---> commit: the record, group-committed (fsync)
    reply handed back once durable

The executor never reads a Session: what the engine side needs comes as arguments (the
session's `SessionKV`, its `SessionLog`) and what the log records comes as a `LogEntry`
the Session builds. The concurrency contract of a session's turns (one at a time, in call
order) is the Session's `TurnQueue`; everything here runs in the caller's thread except
the `prepare` / `finished` callbacks, which run on the engine thread.
"""

from __future__ import annotations

from collections.abc import Generator
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path

from kvsession.cache.manager import SessionKV, Tier
from kvsession.cache.prefix import common_prefix_len
from kvsession.engine.loop import OnUpdate
from kvsession.engine.sequence import Sequence
from kvsession.generation_defaults import GenerationDefaults
from kvsession.history import ChatRenderer, HistoryMode
from kvsession.model.tokenizer import Tokenizer
from kvsession.outputs import RequestOutput
from kvsession.params import SamplingParams
from kvsession.runtime import Runtime
from kvsession.sampling_record import sampling_record
from kvsession.tiers.commit import SessionLog
from kvsession.tiers.snapshot import messages_to_text


@dataclass
class TurnInfo:
    """Filled on the engine thread when a turn starts (and ends: `tokens`)."""

    restored_from: str | None = None
    diverged_at: int | None = None
    tokens: tuple[int, ...] = ()  # whose KV the session holds after the turn (its log record)


@dataclass(frozen=True)
class SessionOptions:
    """A session's rendering (template, tools, chat_template_kwargs), history mode and,
    when resumed, restored or forked, its token log and pending message count."""

    renderer: ChatRenderer
    history: HistoryMode = HistoryMode.APPEND
    log: tuple[int, ...] = ()
    pending: int = 0


@dataclass(frozen=True)
class LogEntry:
    """A session's state after a turn, as its log records it (durability="turn"): every
    message, `tokens` (its token log in append history, else the token ids whose KV it
    holds; None: unchanged since the last record), the turn's sampling, the session's
    system prompt and sampling defaults, and its history (HistoryState's fields but the
    log, which `tokens` is). Read while the record is built (`TurnExecutor.commit`), not
    kept."""

    messages: list[dict]
    tokens: tuple[int, ...] | None
    sampling: SamplingParams
    system: str | None
    defaults: SamplingParams
    history: dict


@dataclass(frozen=True)
class ForkPoint:
    """What a fork starts from: its parent's system prompt, sampling defaults, shared
    system pin, messages and rendering/history (the blocks are shared afterwards, on the
    engine thread: `TurnExecutor.share`)."""

    system: str | None
    sampling: SamplingParams
    system_key: tuple[int, ...] | None
    messages: list[dict]
    options: SessionOptions


class TurnExecutor:
    """The engine side of session turns, for every Session of one `LLM`."""

    def __init__(self, runtime: Runtime):
        self.rt = runtime
        self.tokenizer: Tokenizer = runtime.tokenizer
        self.defaults: GenerationDefaults = runtime.generation

    def submit(self, kv: SessionKV, ids: list[int], params: SamplingParams,
               on_update: OnUpdate | None, slog: SessionLog | None,
               priority: int | None = None) -> tuple[Sequence, TurnInfo, Future]:
        """Submit one turn whose KV starts from the session's (`ids`: its whole prompt,
        validated here, once): on the engine thread the session's blocks are handed to the
        turn's sequence (after restoring them from a spilled tier, or dropping them when
        recomputing is cheaper) and taken back when it ends. Exactly one of the two holds
        them at any moment. `slog`: the session's log, whose record the turn announces as
        it ends (so the records of one step share a group commit). `priority`: the turn's
        (None: the session's)."""
        rt = self.rt
        seq = rt.sequences.new(ids, params, retain_blocks=True,
                               priority=kv.priority if priority is None else priority)
        info = TurnInfo()
        bs = rt.config.block_size

        def finished(seq: Sequence, ok: bool) -> None:  # engine thread: the session takes it back
            n = seq.num_computed_tokens if ok else 0  # failed: the engine released the blocks
            info.tokens = tuple(seq.token_ids[:n])  # what the turn's log record says
            rt.manager.checkin(kv, seq, seq.token_ids[:n], seq.block_hashes[: n // bs])
            rt.policy.checkin(kv)
            if ok and rt.writeback is not None:  # its new full blocks, written behind
                rt.writeback.after_turn(kv, rt.kv_pool.tensors(), rt.policy.num_lead(kv))
            if ok and slog is not None:  # its record follows: batched with its step's
                rt.journal.expect(slog)

        def prepare():  # engine thread: bring the KV back, hand it to the sequence
            history = common_prefix_len(kv.tokens, ids)
            info.diverged_at = history if history < len(kv.tokens) else None
            # (a generator: while the copier brings the KV back, the batch keeps decoding)
            source = yield from rt.policy.checkout_steps(kv)
            common = min(common_prefix_len(kv.tokens, ids), len(ids) - 1)
            hashes = kv.hashes
            seq.num_computed_tokens = rt.manager.checkout(kv, seq, common)
            seq.block_hashes = list(hashes[: seq.num_computed_tokens // bs])
            info.restored_from = source if seq.num_computed_tokens else None
            seq.on_finish = finished

        return seq, info, rt.submit(seq, on_update=on_update, prepare=prepare)

    def check_owner(self, session_id: str | None) -> None:
        """SessionLockedError when another process continued this session through the
        store session_dir names since this one resumed it (tiers/session_mirror.py)."""
        if session_id is not None and self.rt.mirror is not None:
            self.rt.mirror.check_owner(session_id)

    def output(self, seq: Sequence) -> RequestOutput:
        return self.rt.sequences.output(seq, prompt=None)

    def cancel(self, seq: Sequence) -> None:
        """End a turn whose caller gave up; the turn's `finished` gives the session its KV
        back on the engine thread, and its Future fails with CancelledError."""
        self.rt.cancel(seq)

    def commit(self, slog: SessionLog | None, entry: LogEntry) -> Future | None:
        """durability="turn": the session's state after a turn goes to its log; the Future
        resolves when the record is durable. None without a log (nothing to wait for)."""
        if slog is None:
            return None
        op, data = slog.record(messages_to_text(entry.messages),
                               slog.tokens if entry.tokens is None else entry.tokens,
                               sampling_record(entry.sampling), entry.system,
                               sampling_record(entry.defaults), entry.history)
        return self.rt.journal.submit(slog, op, data)

    def call(self, fn) -> Future:
        """Run fn on the engine thread between steps (a session's exclusive work)."""
        return self.rt.call(fn)

    def call_steps(self, fn) -> Future:
        """`call` for a steps generator (work that waits on the copier: `Runtime.call_steps`)."""
        return self.rt.call_steps(fn)

    # ---- a session's KV between turns (engine thread: through `call`) ----------------------

    def save(self, kv: SessionKV, path) -> None:
        """Engine thread: write the session's snapshot from wherever its KV is, atomically.
        Any failure (disk full, unwritable directory) is a SnapshotError naming the cause;
        the session and the file it replaced are unchanged."""
        path = Path(path)
        mover = self.rt.mover
        if mover.has_plan(kv):  # resumed, untouched: its KV is in several files
            mover.write_plan_snapshot(kv, path)
            return
        if kv.tier is Tier.DISK and kv.disk_path is not None:
            # rewritten with the session's messages, never taken as is: a spill can land
            # between a turn's KV and its messages (and with a log, the log is then removed)
            mover.rewrite_disk_snapshot(kv, path)
            return
        mover.write_snapshot(kv, path)

    def share(self, parent: SessionKV, child: SessionKV) -> None:
        """Engine thread: a fork references every block of its parent (no copy; the first
        write into a shared partial block copies it); a spilled parent comes back first."""
        rt = self.rt
        rt.policy.prefetch(parent)
        rt.manager.share(parent, child)
        rt.policy.forked(parent, child)

    def suspend(self, kv: SessionKV,
                expected_idle_s: float | None) -> Generator[Future, None, str]:
        """Engine thread, a steps generator (`call_steps`): the tier policy's decision for an
        idle session, a spill's bytes moved on the copier while the engine keeps stepping."""
        return self.rt.policy.suspend_steps(kv, expected_idle_s)

    def prefetch(self, kv: SessionKV) -> Future:
        """The session's KV loaded back ahead of its next turn, on the copier: the Future
        resolves when it is on the device (the engine keeps stepping meanwhile)."""
        return self.rt.call_steps(lambda: self.rt.policy.prefetch_steps(kv))
