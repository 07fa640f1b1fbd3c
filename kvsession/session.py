"""Sessions: multi-turn conversations whose KV cache outlives each turn.

Between turns a Session holds references on the blocks of every token it has computed
(prompt and generated), so nothing it needs is evicted while it is idle. A turn hands those
references to the turn's Sequence (attached blocks) and takes them back when it finishes:
at any moment exactly one of them owns the references (the KVCacheManager moves them). All
block work happens on the engine thread: a turn goes one way, through the `TurnExecutor`
(kvsession/turns.py), and the log gets a typed `LogEntry`; the `SessionStore` only creates,
forks and closes sessions. The caller's thread renders and tokenizes.

History (kvsession/history.py): in append mode (the default) the session's token log is
the truth: a turn's prompt is the log plus the delta the template renders for the new
messages, so it yields exactly what `llm.generate(prompt_token_ids=log + delta)` gives. In
template mode each turn re-renders the whole conversation and reuses the longest common
token prefix with the cached tokens (`Reply.diverged_at`), so it yields exactly what
`llm.chat` gives for the same full history.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import logging
import queue
import uuid
from collections.abc import AsyncIterator, Iterator
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from kvsession import display
from kvsession.cache.manager import SessionKV
from kvsession.choices import ToolChoiceName
from kvsession.engine.sequence import Sequence
from kvsession.errors import ConfigError, SessionClosedError, SnapshotError
from kvsession.generation_defaults import Budget
from kvsession.history import (
    ChatRenderer,
    HistoryMode,
    NotAppendStable,
    split_reasoning,
    template_marks_reasoning,
)
from kvsession.metrics import RequestMetrics
from kvsession.model.tokenizer import IncrementalText, check_messages, message_content
from kvsession.notebook import activity
from kvsession.outputs import DeltaText, RequestOutput
from kvsession.params import SamplingParams
from kvsession.reply_stream import ReplySplitter, ToolCallDelta, prompt_opens_reasoning
from kvsession.sampling_record import OVERRIDE_FIELDS, sampling_record
from kvsession.tiers.commit import SessionLog
from kvsession.tiers.recovery import LogRecovery
from kvsession.tiers.snapshot import messages_to_text
from kvsession.tools import ToolSpec
from kvsession.turn_queue import TurnQueue
from kvsession.turns import ForkPoint, LogEntry, SessionOptions, TurnExecutor, TurnInfo
from kvsession.validation import check_bool, check_float, check_int, check_path, check_str

# a session turn's fallbacks below the model's defaults: greedy (an agent's turns are
# reproducible unless the model card or the caller asks for sampling)
SESSION_FALLBACK = {"temperature": 0.0}

if TYPE_CHECKING:  # the store imports this module; only the type is needed here
    from kvsession.session_store import SessionStore

log = logging.getLogger("kvsession")


@dataclass
class Reply:
    """One turn's answer. prefill_tokens: prompt tokens computed this turn (a prompt
    computed again after a preemption counts again); cached_tokens: prompt tokens whose KV
    was reused; prompt_tokens: the turn's prompt; restored_from: where that KV came from;
    diverged_at: first position where the re-rendered history differed from the cache
    (template history); reasoning: the reply's thinking when the template marks it
    (<think>...</think>; `text` is then the answer after it)."""

    text: str
    token_ids: list[int]
    finish_reason: str
    metrics: RequestMetrics
    prefill_tokens: int
    cached_tokens: int
    restored_from: str | None
    diverged_at: int | None
    logprobs: list[dict[int, float]] | None = field(default=None, repr=False)
    reasoning: str | None = None
    tool_calls: list = field(default_factory=list)
    prompt_tokens: int = 0

    def _repr_html_(self) -> str:
        rows = [("text", display.text(self.text))]
        if self.reasoning:
            rows.append(("reasoning", display.text(self.reasoning)))
        rows += [(f"tool call {i}", f"{c.name}({c.arguments})")
                 for i, c in enumerate(self.tool_calls)]
        rows += [("finish", self.finish_reason),
                 ("tokens", f"{len(self.token_ids)} generated; prompt {self.prompt_tokens} "
                            f"({self.cached_tokens} from the cache, {self.prefill_tokens} "
                            f"computed)"),
                 ("TTFT", display.ms(self.metrics.ttft_s))]
        if self.restored_from:
            rows.append(("KV restored from", self.restored_from))
        return display.table("Reply", rows)


@dataclass
class StreamChunk:
    """Incremental output of `Session.stream`; the last chunk carries the Reply. `text` is
    the text as generated; `content`, `reasoning` and `tool_calls` (ToolCallDelta) the same
    delta split as the Reply is (kvsession/reply_stream.py): they join to `reply.text`,
    `reply.reasoning` and `reply.tool_calls` (whose ids are the ones streamed)."""

    text: str
    token_ids: list[int]
    reply: Reply | None = None
    content: str = ""
    reasoning: str = ""
    tool_calls: list[ToolCallDelta] = field(default_factory=list)


@dataclass
class SessionStats:
    turns: int = 0
    prompt_tokens: int = 0
    generated_tokens: int = 0
    cached_tokens: int = 0
    computed_tokens: int = 0
    # the system prompt's tokens that opening this session computed when it pinned them (0:
    # another session's pin or the cache held them); its first turn counts them as cached
    system_computed_tokens: int = 0
    ttfts_s: list[float] = field(default_factory=list)
    # what crash recovery cut from this session's log, oldest first (tiers/recovery.py)
    recovery: list[LogRecovery] = field(default_factory=list)


class _Unset:
    """An override not given (None is a value: e.g. seed=None); named in help()."""

    def __repr__(self) -> str:
        return "UNSET"


UNSET = _Unset()
# durability="turn": how long a turn waits for its log record to be fsynced before the
# reply is refused as not durable (a healthy disk takes milliseconds)
DURABLE_TIMEOUT_S = 60.0


def _overrides(args: dict) -> dict:
    """The per-turn overrides given to send/asend/stream, unknown names included (they are
    refused with a suggestion by SamplingParams.with_overrides)."""
    given = {k: v for k, v in args.items()
             if k in OVERRIDE_FIELDS and v is not UNSET}
    return given | args["unknown"]


def _tool_args(args: dict) -> tuple:
    return args["tools"], args["tool_choice"]


class _TurnChunks:
    """A streamed turn's progress reports as StreamChunks (`stream` and `astream`), as
    LLM.stream makes them: a chunk when there is new text, with the token ids since the
    last one (ids whose text is held back, an incomplete UTF-8 character or a possible stop
    string, wait for it); the last chunk carries the Reply and the text not sent yet."""

    def __init__(self, seq: Sequence, text: IncrementalText, splitter: ReplySplitter,
                 split_text: IncrementalText | None = None):
        self._seq, self._sent = seq, 0  # token ids sent so far (of the reply)
        self._text = DeltaText(text, seq.params.stop_strings)
        self.splitter = splitter
        # the splitter's own view of the text where it differs (Mistral's markers put back)
        self._split_text = None if split_text is None else \
            DeltaText(split_text, seq.params.stop_strings)

    def update(self, n: int) -> StreamChunk | None:
        """The turn has `n` tokens: a chunk if there is new text."""
        seq = self._seq
        start = seq.num_prompt_tokens  # the reply's ids: seq.token_ids[start:n]
        text = self._text.update(seq.token_ids, start, n)
        split = self.splitter.feed(text if self._split_text is None
                                   else self._split_text.update(seq.token_ids, start, n))
        if text or split:
            chunk = StreamChunk(text, seq.token_ids[start + self._sent:n], None, split.content,
                                split.reasoning, split.tool_calls)
            self._sent = n - start
            return chunk
        return None

    def last(self, reply: Reply, raw_text: str) -> StreamChunk:
        """The last chunk: the rest of the text as generated (`raw_text`, the turn's
        output) and of the split (the Reply's)."""
        tail = self._text.finish(raw_text)
        rest = self.splitter.finish(reply.reasoning, reply.text, reply.tool_calls)
        return StreamChunk(tail, reply.token_ids[self._sent:], reply, rest.content,
                           rest.reasoning, rest.tool_calls)


class Session:
    """A conversation handle. Thread-safe; sends to one session run in call order."""

    def __init__(self, store: SessionStore, turns: TurnExecutor, session_id: str | None,
                 system: str | None, sampling: SamplingParams | None,
                 messages: list[dict] | None = None,
                 history: HistoryMode = HistoryMode.APPEND,
                 renderer: ChatRenderer | None = None, log: list[int] | None = None,
                 pending: int = 0, slog: SessionLog | None = None,
                 system_key: tuple[int, ...] | None = None,
                 recovery: list[LogRecovery] | None = None):
        # lifecycle (fork, close) goes to the store; a turn and the work on the session's
        # KV between turns go one way, to the executor (kvsession/turns.py)
        self._store, self._exec = store, turns
        # durability="turn": the log this session's records go to (the store opened it)
        self._slog = slog
        self.history = history
        self.renderer = renderer or ChatRenderer(turns.tokenizer)
        # append history: the token log (prompt and reply tokens as computed/generated) and
        # how many trailing messages are not rendered into it yet (added without a reply)
        self._log: list[int] = list(log or ())
        self._pending = pending
        self.session_id = session_id or uuid.uuid4().hex
        # what the caller set; each turn fills the rest (the model's defaults, then greedy
        # and up to the end of the turn: SESSION_FALLBACK)
        self.sampling = sampling or SamplingParams()
        self.system = system
        self._messages: list[dict] = (
            [dict(m) for m in messages] if messages is not None
            else [{"role": "system", "content": system}] if system is not None else [])
        # the shared system pin it holds (acquired by the store that created it; handed
        # back at close)
        self.system_key = system_key
        # the KV (tokens, blocks, tier): changed only on the engine thread, by the manager
        self.kv = SessionKV(self.session_id, meta=self._snapshot_meta)
        self._turns = TurnQueue(self.session_id)
        self.stats = SessionStats(recovery=list(recovery or ()))

    def _snapshot_meta(self) -> dict:
        return {"messages": messages_to_text(self._messages), "system": self.system,
                "sampling": sampling_record(self.sampling),
                "history": self.history_state()}

    def history_state(self, with_log: bool = True) -> dict:
        """What snapshots record of the history (HistoryState's fields; without the token
        log when the caller records it apart, as a log record's tokens)."""
        r = self.renderer
        log = {"log": list(self._log) if self.history is HistoryMode.APPEND else []} \
            if with_log else {}
        return {"mode": self.history.value, **log,
                "pending": self._pending,
                "tools": json.dumps(r.tools, ensure_ascii=False) if r.tools else "",
                "template_kwargs": json.dumps(r.template_kwargs, ensure_ascii=False)
                if r.template_kwargs else ""}

    def options(self) -> SessionOptions:
        """How this session renders and where its history stands (a fork starts here)."""
        return SessionOptions(self.renderer, self.history, tuple(self._log), self._pending)

    # ---- state -------------------------------------------------------------------------

    @property
    def messages(self) -> list[dict]:
        return [dict(m) for m in self._messages]

    @property
    def state(self) -> str:
        """"active" (a turn is running), "idle" (KV on the device), "host", "disk" (KV
        spilled there) or "closed"."""
        if self._turns.closed:
            return "closed"
        if self._turns.in_flight:
            return "active"
        tier = self.kv.tier.value
        return "idle" if tier == "device" else tier

    @property
    def token_ids(self) -> list[int]:
        """The session's token log: every prompt and reply token so far, as the model saw
        them (append history). In template history: the last turn's prompt and reply."""
        return list(self._log)

    @property
    def num_cached_tokens(self) -> int:
        """Tokens whose KV this session holds (in any tier)."""
        return len(self.kv.tokens)

    def _check_open(self) -> None:
        self._turns.check_open()

    # ---- one turn ----------------------------------------------------------------------

    def _prepare(self, message, overrides: dict, tools, tool_choice
                 ) -> tuple[list[dict], SamplingParams, ToolSpec | None]:
        """Validate a turn's arguments (the caller's thread, before it takes its place in
        the queue): a bad one fails alone and the session is unchanged. The turn's tools are
        the session's (rendered into its history); another list is for template history,
        which re-renders every turn."""
        self._check_open()
        if isinstance(message, str):
            message = [{"role": "user", "content": message}]
        elif isinstance(message, dict):
            message = [message]
        if not isinstance(message, (list, tuple)) or not message:
            raise ConfigError(f"message must be a string, a message dict or a non-empty list "
                              f"of them, got {message!r:.80}")
        new_msgs = check_messages(message, "message")
        params = self.sampling.with_overrides(**overrides) if overrides else self.sampling
        if params.cache_salt != self.sampling.cache_salt:
            # the turn extends the session's KV, hashed under the session's salt: its new
            # blocks would be published in the session's namespace, not the turn's
            raise ConfigError(f"cache_salt must be the session's ({self.sampling.cache_salt!r})"
                              f" in its turns, got {params.cache_salt!r}: a session is one "
                              f"tenant's (llm.session(cache_salt=...))")
        if tools is not UNSET and not tools:
            tools = None  # [] is no tools, as llm.session(tools=[]) keeps it
        if tools is not UNSET and tools != self.renderer.tools and \
                self.history is HistoryMode.APPEND:
            raise ConfigError("tools of a session with history='append' are rendered into its "
                              "history: give them to llm.session(tools=...), or use "
                              "history='template' to change them per turn")
        tools = self.renderer.tools if tools is UNSET else tools
        spec = ToolSpec.from_args(tools, None if tool_choice is UNSET else tool_choice,
                                  self._exec.tokenizer)
        params = self._exec.defaults.apply(params, Budget.END_OF_TURN, SESSION_FALLBACK)
        if spec is not None:
            params = spec.constrain(params)
        return new_msgs, params, spec

    def _start(self, new_msgs: list[dict], params: SamplingParams, spec: ToolSpec | None,
               on_update=None, priority=UNSET):
        """Render and submit. Returns (seq, turn info, future). Runs in the caller's thread,
        after the previous turn of this session finished. `priority`: the turn's (UNSET:
        the session's)."""
        self._check_open()
        self._exec.check_owner(self.session_id)
        priority = None if priority is UNSET else check_int("priority", priority)
        # (validated once, as the turn's Sequence is built)
        return self._exec.submit(self.kv, self._render_turn(new_msgs, spec), params,
                                 on_update, self._slog, priority)

    def _render_turn(self, new_msgs: list[dict], spec: ToolSpec | None) -> list[int]:
        """The turn's prompt: append history extends the log by the template's delta for
        the messages not in it yet; template history (or a first turn, or a message shape
        the template cannot append) renders the whole conversation."""
        if self.history is HistoryMode.APPEND and self._log:
            pending = self._messages[len(self._messages) - self._pending:] + new_msgs
            lead = [m for m in self._messages[:1] if m["role"] == "system"]
            try:
                return self._log + self.renderer.delta(lead, pending, self._log[-1])
            except NotAppendStable as e:
                log.warning("session %s: the chat template cannot append %s after a reply "
                            "(%s); this turn re-renders the conversation", self.session_id,
                            [m["role"] for m in pending], e)
        renderer = self.renderer
        tools = spec.template_tools if spec is not None else None
        if tools != renderer.tools:  # template history: this turn's own tools
            renderer = dataclasses.replace(renderer, tools=tools)
        return renderer.encode(self._messages + new_msgs)

    def _turn_chunks(self, seq: Sequence, spec: ToolSpec | None) -> _TurnChunks:
        """A streamed turn's chunks, split as its Reply will be."""
        tokenizer = self._exec.tokenizer
        reasoning = template_marks_reasoning(tokenizer.chat_template)
        splitter = ReplySplitter(reasoning, spec, reasoning and prompt_opens_reasoning(
            tokenizer, seq.token_ids[:seq.num_prompt_tokens]))
        return _TurnChunks(seq, tokenizer.incremental_text(), splitter,
                           spec.marked_text() if spec is not None and spec.markers else None)

    def _finish(self, seq: Sequence, new_msgs: list[dict], info: TurnInfo,
                spec: ToolSpec | None, out: RequestOutput | None = None,
                announced: list[str] | tuple = ()) -> Reply:
        """Record the finished turn (caller's thread; the KV went back on the engine
        thread). `out`: the turn's output, if already built; `announced`: the ids a stream
        gave the reply's calls (the reply's calls keep them)."""
        out = out if out is not None else self._exec.output(seq)
        reasoning, text = None, out.text
        if template_marks_reasoning(self._exec.tokenizer.chat_template):
            reasoning, text = split_reasoning(out.text)
        calls = []
        if spec is not None:
            text, calls = spec.parse(text) if reasoning is not None else \
                spec.parse_output(out.token_ids, text)
        reply_msg = {"role": "assistant", "content": text}
        for call, call_id in zip(calls, announced, strict=False):  # (a stream may announce
            # a call the finished parse did not keep, or not see the last ones)
            call.id = call_id
        if reasoning is not None:  # what reasoning templates (Qwen3) read back
            reply_msg["reasoning_content"] = reasoning
        if calls:  # the OpenAI shape, as a client would send it back
            reply_msg["tool_calls"] = [c.to_dict() for c in calls]
        self._messages += new_msgs + [reply_msg]
        self._log = list(seq.token_ids)  # the prompt, and the reply as generated
        self._pending = 0
        cached = max(seq.num_cached_tokens, 0)
        reply = Reply(text=text, token_ids=out.token_ids, finish_reason=out.finish_reason,
                      metrics=out.metrics, prefill_tokens=seq.num_prompt_computed,
                      cached_tokens=cached,
                      # attached session KV came from its tier; prefix hits from the device;
                      # new tokens a prefill worker computed: "remote"
                      restored_from="remote" if seq.num_remote_tokens else
                      (info.restored_from or "device") if cached else None,
                      diverged_at=info.diverged_at, logprobs=out.logprobs,
                      reasoning=reasoning, tool_calls=calls,
                      prompt_tokens=seq.num_prompt_tokens)
        st = self.stats
        st.turns += 1
        st.prompt_tokens += seq.num_prompt_tokens
        st.generated_tokens += len(out.token_ids)
        st.cached_tokens += cached
        st.computed_tokens += seq.num_prompt_computed
        st.ttfts_s.append(out.metrics.ttft_s)
        return reply

    def send(self, message, *, max_tokens=UNSET, temperature=UNSET, top_p=UNSET,
             top_k=UNSET, seed=UNSET, stop=UNSET, stop_token_ids=UNSET, ignore_eos=UNSET,
             logprobs=UNSET, cache_salt=UNSET, min_p=UNSET, min_tokens=UNSET,
             repetition_penalty=UNSET, presence_penalty=UNSET, frequency_penalty=UNSET,
             logit_bias=UNSET, response_format=UNSET, structured=UNSET, tools=UNSET,
             tool_choice: ToolChoiceName | dict = UNSET, priority: int = UNSET,
             **unknown) -> Reply:
        """Add `message` (a string is a user message; or a dict / list of dicts) and
        generate the assistant's reply. Blocks until done. Keyword arguments override the
        session's SamplingParams for this turn (unknown names: ConfigError); `priority`
        overrides the session's for this turn."""
        new_msgs, params, spec = self._prepare(message, _overrides(locals()),
                                              *_tool_args(locals()))
        mine, prev = self._turns.enter()
        try:
            if prev is not None:
                prev.result()
            seq, info, fut = self._start(new_msgs, params, spec, priority=priority)
            reply = self._finish(fut.result(), new_msgs, info, spec)
            self._wait_durable(self._commit(self._record_tokens(info), params))
            return reply
        finally:
            self._turns.leave(mine)

    def _commit(self, tokens: tuple[int, ...] | None, params: SamplingParams) -> Future | None:
        """durability="turn": this session's state after a turn, handed to its log as a
        typed record (`tokens`: None when unchanged); None without a log."""
        if self._slog is None:
            return None
        # (the record's tokens are the log in append history; the messages are read while
        # the record is built, in this call: no copy of either)
        return self._exec.commit(self._slog, LogEntry(
            self._messages, tokens, params, self.system, self.sampling,
            self.history_state(with_log=False)))

    def _record_tokens(self, info: TurnInfo) -> tuple[int, ...]:
        """What the turn's log record holds: the token log (append history) or the token
        ids whose KV the session holds (template history)."""
        return tuple(self._log) if self.history is HistoryMode.APPEND else info.tokens

    def _wait_durable(self, commit: Future | None) -> None:
        """durability="turn": the turn's log record is fsynced before the reply is handed
        back (SnapshotError if it cannot be: the turn stays in memory, and the session's
        next record rewrites its whole log)."""
        if commit is None:
            return
        try:
            commit.result(timeout=DURABLE_TIMEOUT_S)
        except TimeoutError:  # concurrent.futures raises the builtin (3.11+)
            raise SnapshotError(f"session {self.session_id!r}: the turn was not durable "
                                f"within {DURABLE_TIMEOUT_S:.0f} s") from None

    async def _await_durable(self, commit: Future | None) -> None:
        if commit is None:
            return
        try:
            # shielded: a cancelled wait must not cancel the record's Future, which the
            # commit thread settles
            await asyncio.wait_for(asyncio.shield(asyncio.wrap_future(commit)),
                                   DURABLE_TIMEOUT_S)
        except TimeoutError:
            raise SnapshotError(f"session {self.session_id!r}: the turn was not durable "
                                f"within {DURABLE_TIMEOUT_S:.0f} s") from None

    async def asend(self, message, *, max_tokens=UNSET, temperature=UNSET, top_p=UNSET,
             top_k=UNSET, seed=UNSET, stop=UNSET, stop_token_ids=UNSET, ignore_eos=UNSET,
             logprobs=UNSET, cache_salt=UNSET, min_p=UNSET, min_tokens=UNSET,
             repetition_penalty=UNSET, presence_penalty=UNSET, frequency_penalty=UNSET,
             logit_bias=UNSET, response_format=UNSET, structured=UNSET, tools=UNSET,
             tool_choice: ToolChoiceName | dict = UNSET, priority: int = UNSET,
             **unknown) -> Reply:
        """`send` for asyncio: awaits the engine without blocking the event loop."""
        new_msgs, params, spec = self._prepare(message, _overrides(locals()),
                                              *_tool_args(locals()))
        mine, prev = self._turns.enter()
        abandoned = False
        try:
            if prev is not None:
                try:  # shielded: cancelling this wait must not cancel the turn before
                    await asyncio.shield(asyncio.wrap_future(prev))
                except asyncio.CancelledError:
                    # cancelled in the queue: this place is given up once the turn before
                    # it ends, so the turns after it still run in call order
                    abandoned = True
                    self._turns.leave_after(prev, mine)
                    raise
            seq, info, fut = self._start(new_msgs, params, spec, priority=priority)
            try:
                done = await asyncio.wrap_future(fut)
            except asyncio.CancelledError:  # the caller's task was cancelled: so is the turn
                abandoned = True
                self._abandon(seq, fut, mine)
                raise
            reply = self._finish(done, new_msgs, info, spec)
            await self._await_durable(self._commit(self._record_tokens(info), params))
            return reply
        finally:
            if not abandoned:
                self._turns.leave(mine)

    def stream(self, message, *, max_tokens=UNSET, temperature=UNSET, top_p=UNSET,
             top_k=UNSET, seed=UNSET, stop=UNSET, stop_token_ids=UNSET, ignore_eos=UNSET,
             logprobs=UNSET, cache_salt=UNSET, min_p=UNSET, min_tokens=UNSET,
             repetition_penalty=UNSET, presence_penalty=UNSET, frequency_penalty=UNSET,
             logit_bias=UNSET, response_format=UNSET, structured=UNSET, tools=UNSET,
             tool_choice=UNSET, priority=UNSET, **unknown) -> Iterator[StreamChunk]:
        """Like `send`, yielding text as it is generated; the last chunk has `.reply`."""
        new_msgs, params, spec = self._prepare(message, _overrides(locals()),
                                              *_tool_args(locals()))
        mine, prev = self._turns.enter()
        abandoned, st = False, None
        try:
            if prev is not None:
                prev.result()
            updates: queue.SimpleQueue = queue.SimpleQueue()
            seq, info, fut = self._start(
                new_msgs, params, spec, on_update=lambda s: updates.put(s.num_tokens),
                priority=priority)
            fut.add_done_callback(lambda f: updates.put(None))
            st = self._turns.open_stream(seq, fut, mine)
            chunks = self._turn_chunks(seq, spec)
            try:
                while (n := updates.get()) is not None:
                    if chunk := chunks.update(n):
                        yield chunk
            except GeneratorExit:  # the caller closed the stream before the reply: cancelled
                abandoned = True
                if self._turns.claim(st):
                    self._abandon(seq, fut, mine)
                raise
            if not self._turns.claim(st):
                abandoned = True  # the close that took it gives its place up
                raise SessionClosedError(f"session {self.session_id!r} was closed while this "
                                         f"stream was open: its turn was cancelled")
            done = fut.result()
            out = self._exec.output(done)
            reply = self._finish(done, new_msgs, info, spec, out, chunks.splitter.announced_ids)
            self._wait_durable(self._commit(self._record_tokens(info), params))
            yield chunks.last(reply, out.text)
        finally:
            if not abandoned and (st is None or self._turns.claim(st)):
                self._turns.leave(mine)

    async def astream(self, message, *, max_tokens=UNSET, temperature=UNSET, top_p=UNSET,
             top_k=UNSET, seed=UNSET, stop=UNSET, stop_token_ids=UNSET, ignore_eos=UNSET,
             logprobs=UNSET, cache_salt=UNSET, min_p=UNSET, min_tokens=UNSET,
             repetition_penalty=UNSET, presence_penalty=UNSET, frequency_penalty=UNSET,
             logit_bias=UNSET, response_format=UNSET, structured=UNSET, tools=UNSET,
             tool_choice=UNSET, priority=UNSET, **unknown) -> AsyncIterator[StreamChunk]:
        """`stream` for asyncio (`async for`): the same chunks, awaited without a thread;
        closing it early (`aclose()`, or the consuming task cancelled) cancels the turn,
        which then never happened, as for `stream`."""
        new_msgs, params, spec = self._prepare(message, _overrides(locals()),
                                              *_tool_args(locals()))
        mine, prev = self._turns.enter()
        abandoned, st = False, None
        try:
            if prev is not None:
                try:  # shielded: cancelling this wait must not cancel the turn before
                    await asyncio.shield(asyncio.wrap_future(prev))
                except asyncio.CancelledError:  # (as asend: the place is given up in order)
                    abandoned = True
                    self._turns.leave_after(prev, mine)
                    raise
            loop = asyncio.get_running_loop()
            updates: asyncio.Queue = asyncio.Queue()

            def post(item) -> None:  # engine thread -> the event loop (closed: nobody listens)
                with contextlib.suppress(RuntimeError):
                    loop.call_soon_threadsafe(updates.put_nowait, item)

            seq, info, fut = self._start(new_msgs, params, spec,
                                         on_update=lambda s: post(s.num_tokens),
                                         priority=priority)
            fut.add_done_callback(lambda f: post(None))
            st = self._turns.open_stream(seq, fut, mine)
            chunks = self._turn_chunks(seq, spec)
            try:
                while (n := await updates.get()) is not None:
                    if chunk := chunks.update(n):
                        yield chunk
            except (GeneratorExit, asyncio.CancelledError):  # closed or cancelled: so is the turn
                abandoned = True
                if self._turns.claim(st):
                    self._abandon(seq, fut, mine)
                raise
            if not self._turns.claim(st):
                abandoned = True  # the close that took it gives its place up
                raise SessionClosedError(f"session {self.session_id!r} was closed while this "
                                         f"stream was open: its turn was cancelled")
            done = fut.result()
            out = self._exec.output(done)
            reply = self._finish(done, new_msgs, info, spec, out, chunks.splitter.announced_ids)
            await self._await_durable(self._commit(self._record_tokens(info), params))
            yield chunks.last(reply, out.text)
        finally:
            if not abandoned and (st is None or self._turns.claim(st)):
                self._turns.leave(mine)

    def _cancel_open_streams(self) -> None:
        """Closing: a stream() its caller has neither finished nor closed would hold the
        queue for ever (from the caller's own thread, and at interpreter exit too): its
        turn is cancelled, as if the stream had been closed; resumed, the stream raises
        SessionClosedError."""
        for st in self._turns.take_open_streams():
            self._abandon(st.seq, st.fut, st.mine)

    def _abandon(self, seq: Sequence, fut: Future, mine: Future) -> None:
        """The caller gave up on a running turn (a stream closed before its reply, an
        `asend` task cancelled): the engine ends the request and frees its new blocks, and
        the turn never happened (messages and token log as before it; a reply that was
        complete anyway is dropped too, and the log being the truth, its KV is not used).
        The session's next turn starts once the engine has settled this one and the
        session holds its KV again; nothing here waits for it."""
        self._exec.cancel(seq)
        self._turns.leave_after(fut, mine)

    def add(self, role: str, content: str, **fields) -> None:
        """Append a message (e.g. a tool result: `add("tool", text, tool_call_id=...)`)
        without generating. In append history it is rendered into the log with the next
        turn's messages (a template may group consecutive tool results)."""
        check_str("role", role, non_empty=True)
        (msg,) = check_messages([{**fields, "role": role,
                                  "content": message_content(content, "content")}], "add()")
        mine, prev = self._turns.enter()
        try:
            if prev is not None:
                prev.result()
            self._messages.append(msg)
            self._pending += 1
            self._wait_durable(self._commit(None, self.sampling))
        finally:
            self._turns.leave(mine)

    # ---- lifecycle -----------------------------------------------------------------------

    def exclusive(self, fn, seal: bool = False, steps: bool = False):
        """Run fn() on the engine thread once this session's queued turns are done (the
        store's way to act on this session between turns). `seal`: no turn may be queued
        after this one (the LLM persisting the session at close: a turn run after the
        snapshot would be acknowledged and lost); unsealed if fn fails, the session then
        staying live. `steps`: fn returns a steps generator (it waits on the copier without
        holding the engine thread: `EngineLoop.call_steps`)."""
        mine, prev = self._turns.enter(seal)
        if seal:
            self._cancel_open_streams()
        try:
            if prev is not None:
                prev.result()
            return (self._exec.call_steps if steps else self._exec.call)(fn).result()
        except BaseException:
            if seal:
                self._turns.unseal()
            raise
        finally:
            self._turns.leave(mine)

    def fork(self, session_id: str | None = None) -> Session:
        """A new session sharing every block so far (references, no copy); the first write
        into a shared partial block copies it. Parent and child then evolve independently."""
        if self.state == "closed":  # before anything is created (a child, a system pin)
            raise SessionClosedError(f"session {self.session_id!r} is closed")
        child = self._store.fork(ForkPoint(self.system, self.sampling, self.system_key,
                                           self.messages, self.options()), session_id)
        try:
            self.exclusive(lambda: self._exec.share(self.kv, child.kv))
        except BaseException:
            child.close()
            raise
        child.priority = self.priority
        return child

    def save(self, path) -> None:
        """Write this session (messages, tokens, KV with fp8 scales) to a `.kvs` snapshot,
        atomically. `llm.restore(path)` continues exactly where this session is. A write
        that fails (disk full, unwritable directory) raises SnapshotError naming the cause;
        the session and any file already at `path` are unchanged."""
        check_path("path", path)
        with activity(f"saving session {self.session_id}"):  # (a bar in a notebook)
            self.exclusive(lambda: self._exec.save(self.kv, path))

    def save_sealed(self, path) -> None:
        """`save`, the last thing this session does (the store's, at LLM close): a turn
        queued after it raises SessionClosedError. Unsealed if the write fails."""
        self.exclusive(lambda: self._exec.save(self.kv, path), seal=True)

    @property
    def priority(self) -> int:
        """Its turns' priority unless a send says otherwise (lower is more urgent), and the
        order in which idle sessions' KV is reclaimed (less urgent first)."""
        return self.kv.priority

    @priority.setter
    def priority(self, value: int) -> None:
        self.kv.priority = check_int("priority", value)

    def suspend(self, expected_idle_s: float | None = None) -> str:
        """The session is waiting (tool call, human). The engine decides, by expected waste,
        to keep its KV on the device, spill it to host or disk, or drop it for recompute.
        Returns the decision: "keep" | "host" | "disk" | "drop"."""
        expected_idle_s = check_float("expected_idle_s", expected_idle_s, min_value=0.0,
                                      allow_none=True)
        return self.exclusive(lambda: self._exec.suspend(self.kv, expected_idle_s),
                              steps=True)

    def prefetch(self) -> Future:
        """Start bringing a spilled session back to the device ahead of its next send;
        returns a Future that resolves when done (or when recompute was chosen)."""
        self._check_open()
        return self._exec.prefetch(self.kv)

    def close(self, delete: bool = False) -> None:
        """Release this session's KV in every tier (idempotent); delete=True also removes its
        own snapshot file from session_dir (`<session_id>.kvs`; never the file it was
        restored from elsewhere). Using it afterwards raises SessionClosedError. Queued
        turns finish first; a `stream()` still open is cancelled (its turn never happened;
        resumed, it raises SessionClosedError)."""
        check_bool("delete", delete)
        try:
            mine, prev = self._turns.enter(closing=True)  # later sends are refused
        except SessionClosedError:
            return  # closed already
        self._cancel_open_streams()
        try:
            if prev is not None:
                prev.result()
            self._turns.mark_closed()
            key, self.system_key = self.system_key, None  # released once
            self._store.close_session(self.session_id, self.kv, key, delete)
        finally:
            self._turns.leave(mine)

    def mark_closed(self) -> None:
        """The LLM is closing: further use raises SessionClosedError."""
        self._turns.mark_closed()

    def __enter__(self) -> Session:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _repr_html_(self) -> str:
        st = self.stats
        last = f"{st.ttfts_s[-1] * 1e3:.1f} ms" if st.ttfts_s else "-"
        return (f"<b>kvsession Session</b> <code>{self.session_id}</code>: {self.state}, "
                f"{st.turns} turns, {len(self._messages)} messages<br>"
                f"KV held: {self.num_cached_tokens} tokens ({self.kv.tier.value}); prompt "
                f"tokens from cache {st.cached_tokens}, computed {st.computed_tokens}; "
                f"last TTFT {last}")

    def __repr__(self) -> str:
        return (f"Session({self.session_id!r}, state={self.state}, turns={self.stats.turns}, "
                f"messages={len(self._messages)}, cached_tokens={self.num_cached_tokens})")
