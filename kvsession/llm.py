"""`LLM`: the user's handle on one model in this process — a thin facade.

Construction validates every argument (ConfigError, before any memory is taken), then
`Runtime` builds and wires the engine (kvsession/runtime.py) and `SessionStore` holds the
sessions (kvsession/session_store.py). Public methods are thread-safe: they post work to
the engine thread and wait on Futures.
"""

from __future__ import annotations

import asyncio
import atexit
import logging
import os
import sys
import weakref
from concurrent.futures import Future, as_completed, wait
from pathlib import Path

from tqdm.auto import tqdm

from kvsession.choices import (
    AttentionBackendName,
    Device,
    DType,
    DurabilityName,
    EvictionPolicyName,
    GenerationConfigName,
    KVCacheDType,
    QuantizationName,
    RemotePrefill,
    WeightLayoutName,
)
from kvsession.config import EngineConfig
from kvsession.engine.sequence import Sequence
from kvsession.errors import ConfigError
from kvsession.generation_defaults import Budget
from kvsession.handles import AsyncTextStream, PinnedPrefix, TextStream
from kvsession.metrics import Stats
from kvsession.notebook import activity, progress, release_stale
from kvsession.outputs import RequestOutput
from kvsession.params import SamplingParams
from kvsession.requests import (
    ACHAT_ARGS,
    AGENERATE_ARGS,
    CHAT_ARGS,
    GENERATE_ARGS,
    SESSION_ARGS,
    STREAM_ARGS,
    TO_SAMPLING_PARAMS,
    RequestBuilder,
)
from kvsession.runtime import Runtime
from kvsession.session import Session
from kvsession.session_store import SessionStore
from kvsession.side_files import SideFiles
from kvsession.validation import (
    check_bool,
    check_float,
    check_int,
    check_path,
    check_priorities,
    check_str,
    reject_unknown,
)

log = logging.getLogger("kvsession")
_LIVE: weakref.WeakSet = weakref.WeakSet()
@atexit.register
def _close_all_at_exit() -> None:
    """An LLM left open is closed (sessions persisted, workers told, NIXL released) while
    its engine thread still runs: at interpreter exit, before daemon threads stop."""
    for llm in list(_LIVE):
        try:
            llm.close()
        except Exception:  # best effort at exit; never raise from here
            log.exception("closing an LLM at exit failed")


def _model_of(llm: LLM) -> Path:
    return llm.config.model


def _token_progress(seq: Sequence, future: Future) -> None:
    """One request's tokens as a progress bar while it runs, in a notebook only (shown
    after a second: a short request stays silent); returns when it is done."""
    bar = progress(seq.params.max_tokens, "generate", "tok")
    if bar is None:
        return
    with bar:
        done = False
        while not done:
            done = future.done()  # (one last update after the end)
            wait([future], timeout=0.25)  # each wait bounded; the request's own end ends it
            bar.n = seq.num_output_tokens  # (an int the engine thread grows)
            bar.refresh()


class LLM:
    """One model in this process. See docs/api.md for every argument."""

    def __init__(self, model: str | os.PathLike, *, device: Device | str = "auto",
                 dtype: DType = "auto", kv_cache_dtype: KVCacheDType = "auto",
                 max_model_len: int | None = None, block_size: int = 16,
                 kv_cache_memory: int | str | None = None,
                 gpu_memory_utilization: float = 0.90, host_cache_memory: int | str = "4GiB",
                 session_dir: str | os.PathLike | None = None, max_num_seqs: int = 64,
                 max_num_batched_tokens: int = 2048, enable_prefix_caching: bool = True,
                 max_pinned_fraction: float = 0.5, spill_after_s: float | None = None,
                 prefill_worker: str | None = None, remote_prefill: RemotePrefill = "auto",
                 remote_prefill_timeout_s: float = 30.0,
                 attention_backend: AttentionBackendName = "auto", seed: int = 0,
                 prefill_auth_key_file: str | os.PathLike | None = None,
                 eviction_policy: EvictionPolicyName = "cost",
                 durability: DurabilityName = "turn", chat_template: str | None = None,
                 revision: str | None = None, download_dir: str | os.PathLike | None = None,
                 generation_config: GenerationConfigName = "auto",
                 cpu_weight_layout: WeightLayoutName = "single",
                 quantization: QuantizationName | None = None,
                 disk_cache_memory: int | str | None = None,
                 max_num_partial_prefills: int = 4, max_long_partial_prefills: int = 1,
                 long_prefill_token_threshold: int | None = None,
                 speculative_config: dict | None = None,
                 object_store: str | None = None, object_store_options: dict | None = None,
                 object_store_memory: int | str | None = None, **unknown):
        self._rt: Runtime | None = None
        self.config = EngineConfig.from_args(
            model, device=device, dtype=dtype, kv_cache_dtype=kv_cache_dtype,
            max_model_len=max_model_len, block_size=block_size,
            kv_cache_memory=kv_cache_memory, gpu_memory_utilization=gpu_memory_utilization,
            host_cache_memory=host_cache_memory, session_dir=session_dir,
            max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
            enable_prefix_caching=enable_prefix_caching,
            max_pinned_fraction=max_pinned_fraction, spill_after_s=spill_after_s,
            prefill_worker=prefill_worker, remote_prefill=remote_prefill,
            remote_prefill_timeout_s=remote_prefill_timeout_s,
            attention_backend=attention_backend, seed=seed,
            prefill_auth_key_file=prefill_auth_key_file, eviction_policy=eviction_policy,
            durability=durability, chat_template=chat_template, revision=revision,
            download_dir=download_dir, generation_config=generation_config,
            cpu_weight_layout=cpu_weight_layout, quantization=quantization,
            disk_cache_memory=disk_cache_memory,
            max_num_partial_prefills=max_num_partial_prefills,
            max_long_partial_prefills=max_long_partial_prefills,
            long_prefill_token_threshold=long_prefill_token_threshold,
            speculative_config=speculative_config, object_store=object_store,
            object_store_options=object_store_options,
            object_store_memory=object_store_memory, **unknown)
        # in a notebook, an earlier LLM over this model that only the output history holds
        # is closed before this one takes memory (kvsession/notebook.py)
        release_stale(self.config.model, _LIVE, _model_of)
        self._rt = Runtime(self.config)
        self._store = SessionStore(self._rt)
        self._files = SideFiles(self.config.session_dir, self._rt.mirror)
        self._requests = RequestBuilder(self._rt)
        self.tokenizer = self._rt.tokenizer
        self.runtime = self._rt.info
        _LIVE.add(self)

    # ---- lifecycle -------------------------------------------------------------------

    @property
    def closed(self) -> bool:
        """Whether close() ran (or building failed)."""
        return self._rt is None or self._rt.closed

    def close(self) -> None:
        """Persist live sessions to session_dir (when set), stop the engine thread (pending
        calls fail with EngineClosedError), close every session and drop the KV cache.
        Idempotent.

        If a session cannot be persisted (disk full, session_dir unwritable), nothing is
        lost: close() closes the sessions that were persisted and raises SnapshotError
        naming the others (its `.sessions`), which stay live with their KV while the
        engine stays open. Free space and call close() again, or save them elsewhere
        (`session.save(path)`), or give them up (`session.close()`) and call close()."""
        rt = self._rt
        if rt is None or rt.closed:
            return
        self._store.persist_all()  # SnapshotError, nothing closed, if any was not persisted
        self._store.close_all()
        rt.close()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __del__(self):
        # never block during interpreter shutdown (the engine thread may be gone);
        # _close_all_at_exit has closed every LLM before that
        if sys.is_finalizing():
            return
        try:
            self.close()
        except Exception:
            pass

    # ---- stateless generation --------------------------------------------------------

    def _submit_all(self, ids: list[list[int]], params: list[SamplingParams], priority
                    ) -> tuple[list[Sequence], list[Future]]:
        """Validate every request (ConfigError, nothing submitted) then submit them all."""
        rt = self._rt
        priorities = check_priorities(priority, len(ids))
        seqs = [rt.sequences.new(i, p, priority=u)
                for i, p, u in zip(ids, params, priorities, strict=True)]
        rt.check_open()
        return seqs, rt.submit_all(seqs)

    def _cancel_unfinished(self, seqs: list[Sequence], futures: list[Future]) -> None:
        """The caller stopped waiting (a request failed, Ctrl-C, a cancelled or timed-out
        task): end the requests still running, which would otherwise compute on to
        max_tokens for nobody, holding their blocks and batch slots."""
        for seq, fut in zip(seqs, futures, strict=True):
            # cancelled: asyncio cancels the Futures it wrapped, and the engine does not
            # look at them, so such a request still runs
            if not fut.done() or fut.cancelled():
                self._rt.cancel(seq)

    def _run_batch(self, prompts: list[str | None], ids: list[list[int]],
                   params: list[SamplingParams], use_tqdm: bool,
                   priority=None) -> list[RequestOutput]:
        rt = self._rt
        seqs, futures = self._submit_all(ids, params, priority)
        try:
            if use_tqdm and len(futures) > 1:
                with tqdm(total=len(futures), desc="generate", unit="req") as bar:
                    for _ in as_completed(futures):
                        bar.update(1)
            elif use_tqdm:
                _token_progress(seqs[0], futures[0])
            done = [f.result() for f in futures]
        except BaseException:
            self._cancel_unfinished(seqs, futures)
            raise
        return [rt.sequences.output(s, p) for s, p in zip(done, prompts, strict=True)]

    def generate(self, prompts=None, sampling_params=None, prompt_token_ids=None,
                 use_tqdm: bool = True, priority: int | list[int] | None = None,
                 **unknown) -> list[RequestOutput]:
        """Generate for a prompt or a batch (strings, or token ids via prompt_token_ids);
        outputs come back in input order. `priority`: one int, or one per prompt (lower is
        more urgent, as vLLM; default 0): it orders admission and preemption."""
        reject_unknown("generate()", unknown, GENERATE_ARGS, hints=TO_SAMPLING_PARAMS)
        check_bool("use_tqdm", use_tqdm)
        texts, ids = self._requests.prompt_inputs(prompts, prompt_token_ids)
        params = self._requests.params_list(sampling_params, len(ids), Budget.FIXED)
        return self._run_batch(texts, ids, params, use_tqdm, priority)

    def chat(self, messages, sampling_params=None, use_tqdm: bool = True,
             add_generation_prompt: bool = True, tools: list[dict] | None = None,
             tool_choice="auto", chat_template_kwargs: dict | None = None,
             parallel_tool_calls: bool = True, priority: int | list[int] | None = None,
             **unknown) -> list[RequestOutput]:
        """Generate replies to one conversation (a list of {role, content} dicts, OpenAI tool
        shapes included) or a list of conversations, rendered with the checkpoint's chat
        template. `tools` (OpenAI function tools) are rendered by the template and the calls
        parsed into `out.tool_calls` (`out.text` is then the content before them);
        tool_choice "required" or {"type": "function", "function": {"name": ...}} forces a
        valid call, "none" parses none. `parallel_tool_calls=False`: at most one call per
        reply (the first). `chat_template_kwargs`: extra template variables. `priority`: as
        `generate`'s (one per conversation)."""
        reject_unknown("chat()", unknown, CHAT_ARGS, hints=TO_SAMPLING_PARAMS)
        check_bool("use_tqdm", use_tqdm)
        chat = self._requests.chat_inputs(messages, add_generation_prompt, tools, tool_choice,
                                          chat_template_kwargs, parallel_tool_calls)
        params = chat.params(self._requests.params_list(sampling_params, len(chat.ids)))
        return [chat.finish(o) for o in self._run_batch(chat.texts, chat.ids, params, use_tqdm,
                                                        priority)]

    # ---- asyncio and streaming -----------------------------------------------------------

    async def agenerate(self, prompts=None, sampling_params=None, prompt_token_ids=None,
                        priority: int | list[int] | None = None,
                        **unknown) -> list[RequestOutput]:
        """`generate` for asyncio: awaits the outputs without blocking the event loop;
        concurrent calls batch together in the one engine loop."""
        reject_unknown("agenerate()", unknown, AGENERATE_ARGS, hints=TO_SAMPLING_PARAMS)
        texts, ids = self._requests.prompt_inputs(prompts, prompt_token_ids)
        return await self._arun(texts, ids, self._requests.params_list(
            sampling_params, len(ids), Budget.FIXED), priority)

    async def achat(self, messages, sampling_params=None, add_generation_prompt: bool = True,
                    tools: list[dict] | None = None, tool_choice="auto",
                    chat_template_kwargs: dict | None = None, parallel_tool_calls: bool = True,
                    priority: int | list[int] | None = None,
                    **unknown) -> list[RequestOutput]:
        """`chat` for asyncio."""
        reject_unknown("achat()", unknown, ACHAT_ARGS, hints=TO_SAMPLING_PARAMS)
        chat = self._requests.chat_inputs(messages, add_generation_prompt, tools, tool_choice,
                                          chat_template_kwargs, parallel_tool_calls)
        params = chat.params(self._requests.params_list(sampling_params, len(chat.ids)))
        return [chat.finish(o) for o in await self._arun(chat.texts, chat.ids, params,
                                                         priority)]

    async def _arun(self, texts, ids, params, priority=None) -> list[RequestOutput]:
        seqs, futures = self._submit_all(ids, params, priority)
        try:
            done = await asyncio.gather(*(asyncio.wrap_future(f) for f in futures))
        except BaseException:  # CancelledError too: the awaiting task was cancelled
            self._cancel_unfinished(seqs, futures)
            raise
        return [self._rt.sequences.output(s, t) for s, t in zip(done, texts, strict=True)]

    def stream(self, prompt=None, sampling_params=None, prompt_token_ids=None, messages=None,
               tools: list[dict] | None = None, tool_choice="auto",
               chat_template_kwargs: dict | None = None, parallel_tool_calls: bool = True,
               priority: int | None = None, **unknown) -> TextStream:
        """Generate for one prompt (a string, `prompt_token_ids`, or a conversation: a list
        of message dicts, in the prompt's place or as `messages`), yielding `TextChunk`s as
        tokens arrive: `chunk.text` deltas join to exactly the text `generate` returns (stop
        strings never leak, no UTF-8 character is split), and the last chunk's `.output` is
        the RequestOutput (also the stream's `.output` once exhausted). Closing the stream
        early (or leaving a `with` block) cancels the request. For a conversation each chunk
        also has the delta split as the finished reply is: `chunk.content`,
        `chunk.reasoning` (a reasoning template's <think> block) and, with `tools` (as
        `chat`), `chunk.tool_calls` (ToolCallDelta: index, id and name first, then
        fragments of the arguments' JSON) — markup never in `content`; `chunk.text` stays
        the text as generated, and `.output` has the parsed reply. `priority`: as
        `generate`'s."""
        reject_unknown("stream()", unknown, STREAM_ARGS, hints=TO_SAMPLING_PARAMS)
        text, seq, chat = self._requests.one_request(prompt, sampling_params, prompt_token_ids,
                                                     messages, tools, tool_choice,
                                                     chat_template_kwargs, parallel_tool_calls)
        seq.priority = check_int("priority", 0 if priority is None else priority)
        return TextStream(self._rt, seq, text, chat)

    def astream(self, prompt=None, sampling_params=None, prompt_token_ids=None,
                messages=None, tools: list[dict] | None = None, tool_choice="auto",
                chat_template_kwargs: dict | None = None, parallel_tool_calls: bool = True,
                priority: int | None = None, **unknown) -> AsyncTextStream:
        """`stream` for asyncio: `async for chunk in llm.astream(...)`; many concurrent
        streams batch together in the one engine loop."""
        reject_unknown("astream()", unknown, STREAM_ARGS, hints=TO_SAMPLING_PARAMS)
        text, seq, chat = self._requests.one_request(prompt, sampling_params, prompt_token_ids,
                                                     messages, tools, tool_choice,
                                                     chat_template_kwargs, parallel_tool_calls)
        seq.priority = check_int("priority", 0 if priority is None else priority)
        return AsyncTextStream(self._rt, seq, text, chat)

    # ---- sessions ----------------------------------------------------------------------

    def session(self, system: str | None = None, session_id: str | None = None,
                pin_system: bool = True, sampling: SamplingParams | None = None,
                history: str = "append", tools: list[dict] | None = None,
                chat_template_kwargs: dict | None = None, cache_salt: str | None = None,
                fresh: bool = False, priority: int = 0, **unknown) -> Session:
        """A multi-turn conversation whose KV stays cached between turns. The system prompt
        is pinned (once, shared by every session with the same system prompt and tools).
        history: "append" (the token log is the truth; only new messages are rendered and
        computed) or "template" (each turn re-renders the conversation). tools and
        chat_template_kwargs are rendered by the chat template; cache_salt isolates this
        session's blocks after the shared, pinned system prompt. With session_dir set, an
        id that was persisted there resumes that session (with its stored history, tools
        and salt); an id whose log crash recovery removed (nothing else of it left) raises
        SessionLostError rather than starting empty, unless fresh=True: a new, empty
        session under that id (an id that still names a persisted session is refused).
        `priority`: its turns' (each `send` may override it), and the order in which idle
        sessions' KV is reclaimed: the less urgent (higher value) first."""
        reject_unknown("session()", unknown, SESSION_ARGS)
        check_str("system", system, allow_none=True)
        check_bool("pin_system", pin_system)
        check_bool("fresh", fresh)
        if sampling is not None and not isinstance(sampling, SamplingParams):
            raise ConfigError(f"sampling must be None or a SamplingParams, got {sampling!r:.80}")
        check_str("cache_salt", cache_salt, allow_none=True)
        if cache_salt is not None:
            sampling = (sampling or SamplingParams()).with_overrides(cache_salt=cache_salt)
        options = self._store.options(history, tools, chat_template_kwargs)
        priority = check_int("priority", priority)
        self._rt.check_open()
        sess = self._store.session(system, session_id, pin_system, sampling, options, fresh)
        sess.priority = priority
        return sess

    def put_file(self, name: str, data: bytes) -> None:
        """Keep `data` beside the sessions as `name` ('<folder>/<file>'): in session_dir,
        and in its store where session_dir is a URL, so that any machine naming it reads
        it (kvsession/side_files.py). Written whole: a reader sees the old content or the
        new. ConfigError without a session_dir or for a bad name; up to 64 MiB."""
        self._rt.check_open()
        self._files.put(name, data)

    def get_file(self, name: str) -> bytes | None:
        """A file `put_file` kept (by this process or, through the store, any other);
        None where there is none."""
        self._rt.check_open()
        return self._files.get(name)

    def delete_file(self, name: str) -> bool:
        """Remove a kept file here and from the store. Returns whether it was here."""
        self._rt.check_open()
        return self._files.delete(name)

    def sessions(self) -> list[str]:
        """Ids of the sessions persisted in session_dir: each snapshot file's name
        (`<id>.kvs`), so a copy under another name is listed as its own session; files
        that are not intact snapshots (or not regular files) are skipped with a warning.
        Empty without a session_dir."""
        return self._store.sessions()

    def restore(self, path, session_id: str | None = None) -> Session:
        """A Session continuing exactly where the snapshot at `path` left off. Its KV is
        loaded into the device pool now (blocks already resident, such as a shared system
        prompt, are re-referenced, not re-read); a file that does not fit this engine or is
        damaged raises SnapshotError and changes nothing."""
        path = check_path("path", path)
        self._rt.check_open()
        with activity(f"restoring {path.name}"):  # (a bar in a notebook)
            return self._store.restore(path, session_id)

    # ---- pinned prefixes -------------------------------------------------------------

    def pin(self, prefix=None, ttl_s: float | None = None, *, system: str | None = None,
            cache_salt: str | None = None) -> PinnedPrefix:
        """Compute `prefix` (text or token ids) into the cache if absent and hold its full
        blocks: they are never evicted until `unpin()` or `ttl_s` seconds without a hit.
        `system=` pins a system message as the chat template renders it, so `llm.chat` and
        sessions with that system prompt hit it. A `cache_salt` pin is that tenant's own;
        an unsalted one is shared by every tenant's requests that start with it. Raises
        CacheFullError (nothing already pinned is affected) past max_pinned_fraction."""
        ttl_s = check_float("ttl_s", ttl_s, min_value=0.0, min_inclusive=False, allow_none=True,
                            finite=True)  # None: no expiry
        check_str("cache_salt", cache_salt, allow_none=True)
        if (prefix is None) == (system is None):
            raise ConfigError("pass exactly one of prefix or system")
        if system is not None:
            prefix = self._store.pins.prefix(check_str("system", system))
        if isinstance(prefix, str):
            ids = self.tokenizer.encode(prefix)
        elif isinstance(prefix, (list, tuple)):
            ids = list(prefix)
        else:
            raise ConfigError(f"prefix must be a string or a list of token ids, "
                              f"got {prefix!r:.80}")
        ids = self._rt.sequences.validate_prompt(ids)
        bs = self.config.block_size
        if len(ids) < bs:
            raise ConfigError(f"a pinned prefix needs at least block_size={bs} tokens, "
                              f"got {len(ids)}")
        if not self.config.enable_prefix_caching:
            raise ConfigError("pin() needs enable_prefix_caching=True")
        return PinnedPrefix(self._rt, self._rt.pinning.pin(ids, ttl_s, cache_salt))

    # ---- observability ---------------------------------------------------------------

    @property
    def slo(self):
        """The latency targets (`SLO`) that goodput and attainment in `stats()` are
        measured against; replace them with `llm.slo = SLO(...)`. Once set, the scheduler
        also keeps both targets where the hardware allows: a long prompt's chunk in a step
        that decodes shrinks to what `tpot_s` leaves, or sits the step out where less than a
        block fits (`stats().slo_held_steps`; `slo_unmet_steps` counts the steps where the
        target was out of reach), and a step without decodes lasts at most a quarter of
        `ttft_s` (a request arriving meanwhile waits for it)."""
        return self._rt.slo

    @slo.setter
    def slo(self, value) -> None:
        from kvsession.metrics import SLO

        if not isinstance(value, SLO):
            raise ConfigError(f"slo must be a kvsession.metrics.SLO, got {value!r}")
        self._rt.set_slo(value)

    def get_default_sampling_params(self, sampling_params: SamplingParams | None = None
                                    ) -> SamplingParams:
        """The SamplingParams a chat request gets (vLLM's name): the fields
        `sampling_params` sets, the others from the checkpoint's generation_config.json
        (with generation_config="auto"), else SamplingParams' own; max_tokens unset runs to
        the end of the turn. Every field of the result counts as set."""
        if sampling_params is not None and not isinstance(sampling_params, SamplingParams):
            raise ConfigError(f"sampling_params must be None or a SamplingParams, got "
                              f"{sampling_params!r:.80}")
        return self._rt.generation.complete(sampling_params or SamplingParams(),
                                            Budget.END_OF_TURN)

    def stats(self) -> Stats:
        """A consistent snapshot, taken on the engine thread between steps."""
        return self._rt.stats()

    def check_integrity(self) -> None:
        """Check, on the engine thread, the block pool's invariants and that every block
        reference is held by a known holder (sequence, session, pin, quarantine) and every
        host block by one session or free. Raises AssertionError (tests call this)."""
        self._rt.call(self._rt.integrity.now).result()

    def __repr__(self) -> str:
        if self._rt is None or self._rt.closed:
            return f"LLM({self.config.model.name}, closed)"
        pool, prefix = self._rt.pool, self._rt.prefix
        return (f"LLM({self.runtime.spec.architecture}, {self.config.device}, kv "
                f"{self.config.kv_cache_dtype_name}: {pool.num_blocks - pool.num_free}/"
                f"{pool.num_blocks} blocks used, {len(self._store.live)} sessions, prefix hit "
                f"rate {prefix.hit_tokens / max(prefix.queried_tokens, 1):.0%})")

    def _repr_html_(self) -> str:
        """A notebook summary: the model, every tier's occupancy, prefix and tier counters."""
        if self._rt is None or self._rt.closed:
            return f"<b>kvsession LLM</b> ({self.config.model.name}): closed"
        st = self.stats()
        rows = "".join(
            f"<tr><td>{name}</td><td>{t.blocks_used}/{t.blocks_total}</td>"
            f"<td>{t.blocks_pinned}</td><td>{t.tokens_capacity}</td>"
            f"<td>{t.bytes_per_token}</td></tr>" for name, t in st.tiers.items())
        return (f"<b>kvsession LLM</b>: {self.runtime.spec.architecture} on "
                f"{self.config.device}, KV {self.config.kv_cache_dtype_name}, "
                f"{len(self._store.live)} live sessions<br>"
                f"<table><tr><th>tier</th><th>blocks used</th><th>pinned</th>"
                f"<th>token capacity</th><th>bytes/token</th></tr>{rows}</table>"
                f"prefix hit rate {st.prefix.hit_rate:.0%}, spills {st.spills}, restores "
                f"{st.restores}, recomputes {st.recomputes}")
