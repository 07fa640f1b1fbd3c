"""Sessions: multi-turn conversations whose KV cache outlives each turn.

Between turns a Session holds references on the blocks of every token it has computed
(prompt and generated), so nothing it needs is evicted while it is idle. A turn hands those
references to the turn's Sequence (attached blocks) and takes them back when it finishes:
at any moment exactly one of them owns the references. All block work happens on the engine
thread (posted `prepare` / `call` functions); the caller's thread only renders and tokenizes.

Exactness: each turn re-renders the whole conversation with the chat template and compares
it to the cached tokens. KV is reused only for the longest common token prefix; from the
first differing position on it is recomputed (`Reply.diverged_at`). A turn therefore yields
exactly what `llm.chat` gives for the same full history.
"""

from __future__ import annotations

import asyncio
import queue
import threading
import uuid
from collections.abc import Iterator
from concurrent.futures import Future
from dataclasses import dataclass, field, replace

from kvsession.cache.block_pool import blocks_for
from kvsession.engine.sequence import Sequence
from kvsession.errors import ConfigError, SessionClosedError
from kvsession.metrics import RequestMetrics
from kvsession.params import SamplingParams
from kvsession.tiers.policy import SessionKV


@dataclass
class Reply:
    """One turn's answer. prefill_tokens: prompt tokens computed this turn; cached_tokens:
    prompt tokens whose KV was reused; restored_from: where that KV came from;
    diverged_at: first position where the re-rendered history differed from the cache."""

    text: str
    token_ids: list[int]
    finish_reason: str
    metrics: RequestMetrics
    prefill_tokens: int
    cached_tokens: int
    restored_from: str | None
    diverged_at: int | None
    logprobs: list[dict[int, float]] | None = field(default=None, repr=False)


@dataclass
class StreamChunk:
    """Incremental output of `Session.stream`; the last chunk carries the Reply."""

    text: str
    token_ids: list[int]
    reply: Reply | None = None


@dataclass
class SessionStats:
    turns: int = 0
    prompt_tokens: int = 0
    generated_tokens: int = 0
    cached_tokens: int = 0
    computed_tokens: int = 0
    ttfts_s: list[float] = field(default_factory=list)


SAMPLING_FIELDS = ("max_tokens", "temperature", "top_p", "top_k", "seed", "stop",
                   "stop_token_ids", "ignore_eos", "logprobs", "cache_salt")


def common_prefix_len(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n


class Session:
    """A conversation handle. Thread-safe; sends to one session run in call order."""

    def __init__(self, llm, session_id: str | None, system: str | None,
                 sampling: SamplingParams | None, system_key=None):
        self._llm = llm
        self.session_id = session_id or uuid.uuid4().hex
        self.sampling = sampling or SamplingParams(max_tokens=256, temperature=0.0)
        self.system = system
        self._messages: list[dict] = ([{"role": "system", "content": system}]
                                      if system is not None else [])
        self._system_key = system_key
        # the KV (tokens, blocks, tier): mutated only on the engine thread
        self._kv = SessionKV(self.session_id, meta=self._snapshot_meta)
        self._closed = False
        self._lock = threading.Lock()
        self._last_turn: Future | None = None
        self._in_flight = 0
        self.stats = SessionStats()

    def _snapshot_meta(self) -> dict:
        return {"messages": self.messages, "system": self.system,
                "sampling": {k: getattr(self.sampling, k) for k in SAMPLING_FIELDS}}

    # ---- state -------------------------------------------------------------------------

    @property
    def messages(self) -> list[dict]:
        return [dict(m) for m in self._messages]

    @property
    def state(self) -> str:
        """"active" (a turn is running), "idle" (KV on the device), "host", "disk" (KV
        spilled there) or "closed"."""
        if self._closed:
            return "closed"
        if self._in_flight:
            return "active"
        tier = self._kv.tier.value
        return "idle" if tier == "device" else tier

    @property
    def num_cached_tokens(self) -> int:
        """Tokens whose KV this session holds (in any tier)."""
        return len(self._kv.tokens)

    def _check_open(self) -> None:
        if self._closed:
            raise SessionClosedError(f"session {self.session_id!r} is closed")

    def _enqueue_turn(self) -> tuple[Future, Future | None]:
        """Take a place in this session's queue: returns (mine, the one before me)."""
        with self._lock:
            self._check_open()
            mine: Future = Future()
            prev, self._last_turn = self._last_turn, mine
            self._in_flight += 1
            return mine, prev

    def _leave_turn(self, mine: Future) -> None:
        with self._lock:
            self._in_flight -= 1
        mine.set_result(None)

    # ---- one turn ----------------------------------------------------------------------

    @staticmethod
    def _normalize(message) -> list[dict]:
        if isinstance(message, str):
            return [{"role": "user", "content": message}]
        if isinstance(message, dict):
            return [message]
        msgs = list(message) if isinstance(message, (list, tuple)) else []
        if not msgs or not all(isinstance(m, dict) for m in msgs):
            raise ConfigError("send() takes a string, a message dict or a list of them")
        return msgs

    def _start(self, message, overrides: dict, on_update=None):
        """Render and submit. Returns (seq, new messages, turn info, future). Runs in the
        caller's thread, after the previous turn of this session finished."""
        self._check_open()
        llm = self._llm
        new_msgs = self._normalize(message)
        params = replace(self.sampling, **overrides) if overrides else self.sampling
        ids = llm._validate_prompt(llm.tokenizer.encode_chat(self._messages + new_msgs))
        seq = Sequence(token_ids=ids, params=params, max_model_len=llm.runtime.max_model_len,
                       eos_token_ids=llm.tokenizer.eos_token_ids, retain_blocks=True)
        info: dict = {}
        kv, policy, bs = self._kv, llm.policy, llm.config.block_size

        def finished(seq: Sequence, ok: bool):  # engine thread: the session takes it back
            if not ok:  # the engine released the blocks; the next turn recomputes
                policy.checkin(kv, [], [], [])
                return
            n = seq.num_computed_tokens
            keep = blocks_for(n, bs)
            llm.pool.free(seq.blocks[keep:])
            policy.checkin(kv, seq.token_ids[:n], seq.blocks[:keep], seq.block_hashes[: n // bs])
            seq.blocks = []

        def prepare():  # engine thread: bring the KV back, hand it to the sequence
            history = common_prefix_len(kv.tokens, ids)
            info["diverged_at"] = history if history < len(kv.tokens) else None
            source = policy.checkout(kv)
            common = min(common_prefix_len(kv.tokens, ids), len(ids) - 1)
            blocks, hashes = kv.blocks, kv.hashes
            kv.blocks, kv.hashes, kv.tokens = [], [], []
            seq.blocks, seq.num_computed_tokens = llm._attach_blocks(blocks, common)
            seq.block_hashes = hashes[: seq.num_computed_tokens // bs]
            info["restored_from"] = source if seq.num_computed_tokens else None
            seq.on_finish = finished

        fut = llm._engine_loop().submit(seq, on_update=on_update, prepare=prepare)
        return seq, new_msgs, info, fut

    def _finish(self, seq: Sequence, new_msgs: list[dict], info: dict) -> Reply:
        """Record the finished turn (caller's thread; the KV went back on the engine
        thread)."""
        out = self._llm._output(seq, prompt=None)
        self._messages += new_msgs + [{"role": "assistant", "content": out.text}]
        cached = max(seq.num_cached_tokens, 0)
        reply = Reply(text=out.text, token_ids=out.token_ids, finish_reason=out.finish_reason,
                      metrics=out.metrics, prefill_tokens=seq.num_prompt_computed,
                      cached_tokens=cached,
                      # attached session KV came from its tier; prefix hits from the device
                      restored_from=(info.get("restored_from") or "device") if cached else None,
                      diverged_at=info.get("diverged_at"), logprobs=out.logprobs)
        st = self.stats
        st.turns += 1
        st.prompt_tokens += seq.num_prompt_tokens
        st.generated_tokens += len(out.token_ids)
        st.cached_tokens += cached
        st.computed_tokens += seq.num_prompt_computed
        st.ttfts_s.append(out.metrics.ttft_s)
        return reply

    def send(self, message, **sampling_overrides) -> Reply:
        """Add `message` (a string is a user message; or a dict / list of dicts) and
        generate the assistant's reply. Blocks until done."""
        mine, prev = self._enqueue_turn()
        try:
            if prev is not None:
                prev.result()
            seq, new_msgs, info, fut = self._start(message, sampling_overrides)
            return self._finish(fut.result(), new_msgs, info)
        finally:
            self._leave_turn(mine)

    async def asend(self, message, **sampling_overrides) -> Reply:
        """`send` for asyncio: awaits the engine without blocking the event loop."""
        mine, prev = self._enqueue_turn()
        try:
            if prev is not None:
                await asyncio.wrap_future(prev)
            seq, new_msgs, info, fut = self._start(message, sampling_overrides)
            return self._finish(await asyncio.wrap_future(fut), new_msgs, info)
        finally:
            self._leave_turn(mine)

    def stream(self, message, **sampling_overrides) -> Iterator[StreamChunk]:
        """Like `send`, yielding text as it is generated; the last chunk has `.reply`."""
        mine, prev = self._enqueue_turn()
        try:
            if prev is not None:
                prev.result()
            updates: queue.SimpleQueue = queue.SimpleQueue()
            seq, new_msgs, info, fut = self._start(
                message, sampling_overrides, on_update=lambda s: updates.put(s.num_tokens))
            fut.add_done_callback(lambda f: updates.put(None))
            decode = self._llm.tokenizer.decode
            hold = max((len(s) for s in seq.params.stop_strings), default=1) - 1
            sent_text, sent_tokens = "", 0
            while (n := updates.get()) is not None:
                ids = seq.token_ids[seq.num_prompt_tokens:n]
                text = decode(ids)
                safe = text[: len(text) - hold] if hold else text
                if safe.endswith("\ufffd"):  # an incomplete UTF-8 sequence: wait for more
                    continue
                if len(safe) > len(sent_text) or len(ids) > sent_tokens:
                    yield StreamChunk(safe[len(sent_text):], ids[sent_tokens:])
                    sent_text, sent_tokens = safe, len(ids)
            reply = self._finish(fut.result(), new_msgs, info)
            tail = reply.text[len(sent_text):] if reply.text.startswith(sent_text) else ""
            yield StreamChunk(tail, reply.token_ids[sent_tokens:], reply)
        finally:
            self._leave_turn(mine)

    def add(self, role: str, content: str) -> None:
        """Append a message (e.g. a tool result) without generating."""
        mine, prev = self._enqueue_turn()
        try:
            if prev is not None:
                prev.result()
            self._messages.append({"role": role, "content": content})
        finally:
            self._leave_turn(mine)

    # ---- lifecycle -----------------------------------------------------------------------

    def _exclusive(self, fn):
        """Run fn() on the engine thread once this session's queued turns are done."""
        mine, prev = self._enqueue_turn()
        try:
            if prev is not None:
                prev.result()
            return self._llm._engine_loop().call(fn).result()
        finally:
            self._leave_turn(mine)

    def fork(self, session_id: str | None = None) -> Session:
        """A new session sharing every block so far (references, no copy); the first write
        into a shared partial block copies it. Parent and child then evolve independently."""
        llm = self._llm
        child = llm._new_session(session_id, self.system, self.sampling, self._system_key)
        child._messages = self.messages

        def share():
            llm.policy.restore(self._kv)  # a spilled parent comes back first
            kv = self._kv
            llm.pool.touch(kv.blocks)
            llm.policy.checkin(child._kv, list(kv.tokens), list(kv.blocks), list(kv.hashes))

        self._exclusive(share)
        return child

    def save(self, path) -> None:
        """Write this session (messages, tokens, KV with fp8 scales) to a `.kvs` snapshot,
        atomically. `llm.restore(path)` continues exactly where this session is."""
        self._exclusive(lambda: self._llm._save_session(self, path))

    def suspend(self, expected_idle_s: float | None = None) -> str:
        """The session is waiting (tool call, human). The engine decides, by expected waste,
        to keep its KV on the device, spill it to host or disk, or drop it for recompute.
        Returns the decision: "keep" | "host" | "disk" | "drop"."""
        return self._exclusive(lambda: self._llm.policy.suspend(self._kv, expected_idle_s))

    def prefetch(self) -> Future:
        """Start bringing a spilled session back to the device ahead of its next send;
        returns a Future that resolves when done (or when recompute was chosen)."""
        self._check_open()
        return self._llm._engine_loop().call(lambda: self._llm.policy.restore(self._kv))

    def close(self, delete: bool = False) -> None:
        """Release this session's KV in every tier (idempotent); delete=True also removes its
        snapshot file from session_dir. Using it afterwards raises SessionClosedError."""
        with self._lock:
            if self._closed:
                return
            prev = self._last_turn
        if prev is not None:
            prev.result()
        with self._lock:
            self._closed = True
        self._llm._close_session(self, delete)

    def __enter__(self) -> Session:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _repr_html_(self) -> str:
        st = self.stats
        last = f"{st.ttfts_s[-1] * 1e3:.1f} ms" if st.ttfts_s else "-"
        return (f"<b>kvsession Session</b> <code>{self.session_id}</code>: {self.state}, "
                f"{st.turns} turns, {len(self._messages)} messages<br>"
                f"KV held: {self.num_cached_tokens} tokens ({self._kv.tier.value}); prompt "
                f"tokens from cache {st.cached_tokens}, computed {st.computed_tokens}; "
                f"last TTFT {last}")

    def __repr__(self) -> str:
        return (f"Session({self.session_id!r}, state={self.state}, turns={self.stats.turns}, "
                f"messages={len(self._messages)}, cached_tokens={self.num_cached_tokens})")
