"""`LLM`: the user's handle on one model in this process.

Construction validates every argument (ConfigError) and sizes the KV cache before any
memory is taken, then loads the weights and starts the engine thread. Public methods are
thread-safe: they post work to the engine loop and wait on Futures.
"""

from __future__ import annotations

import atexit
import hashlib
import json
import logging
import sys
import time
import weakref
from concurrent.futures import Future, as_completed
from dataclasses import dataclass

import torch
from tqdm.auto import tqdm

from kvsession import costmodel
from kvsession.attention import resolve_backend
from kvsession.cache.block_pool import BlockPool, blocks_for
from kvsession.cache.hashing import BlockHasher
from kvsession.cache.kv_pool import KVPool
from kvsession.cache.prefix import PrefixCache
from kvsession.config import AttentionBackend, EngineConfig, RemotePrefillMode
from kvsession.engine.graphs import DecodeGraphs
from kvsession.engine.loop import Engine, EngineLoop, request_metrics
from kvsession.engine.runner import ModelRunner
from kvsession.engine.sampler import Sampler
from kvsession.engine.scheduler import Scheduler
from kvsession.engine.sequence import Sequence
from kvsession.errors import CacheFullError, ConfigError, EngineClosedError
from kvsession.metrics import SLO, LatencyTracker, PrefixStats, RemoteStats, Stats, TierStats
from kvsession.model.config import ModelSpec, check_sliding_window, load_model_spec
from kvsession.model.llama import LlamaModel
from kvsession.model.loader import load_weights, weights_digest
from kvsession.model.tokenizer import Tokenizer
from kvsession.outputs import RequestOutput
from kvsession.params import SamplingParams
from kvsession.session_store import SessionStore
from kvsession.tiers.disk import DiskTier
from kvsession.tiers.host import HostPool
from kvsession.tiers.policy import TierPolicy

log = logging.getLogger("kvsession")
CPU_DEFAULT_KV_BYTES = 2**30
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


# share of decode time lost to co-located prefills (DESIGN-NOTES: 0.15-0.45 is typical);
# used until the engine measures it
REMOTE_STALL_RATIO = 0.3


@dataclass(frozen=True)
class RuntimeInfo:
    """Facts established at start-up (not configuration)."""

    spec: ModelSpec
    max_model_len: int
    num_blocks: int
    kv_bytes_per_token: int
    model_fingerprint: str


def _weight_bytes(spec: ModelSpec, dtype: torch.dtype) -> int:
    h, hd, inter = spec.hidden_size, spec.head_dim, spec.intermediate_size
    per_layer = h * hd * (2 * spec.num_heads + 2 * spec.num_kv_heads) + 3 * h * inter
    embed = spec.vocab_size * h * (1 if spec.tie_word_embeddings else 2)
    return (spec.num_layers * per_layer + embed) * torch.empty((), dtype=dtype).element_size()


class LLM(SessionStore):
    def __init__(self, model, **kwargs):
        self._loop = None
        self.config = cfg = EngineConfig.from_args(model, **kwargs)
        spec = load_model_spec(cfg.model)
        max_model_len = cfg.max_model_len or spec.max_position_embeddings
        check_sliding_window(spec, max_model_len)
        self.tokenizer = Tokenizer(cfg.model)
        bpt = KVPool.bytes_per_token(spec.num_layers, spec.num_kv_heads, spec.head_dim,
                                     cfg.kv_cache_dtype)
        num_blocks = self._num_blocks(cfg, spec, bpt)
        needed = blocks_for(max_model_len, cfg.block_size)
        if num_blocks < needed:
            raise ConfigError(
                f"kv_cache_memory holds {num_blocks} blocks of {cfg.block_size} tokens "
                f"({num_blocks * cfg.block_size} tokens at {bpt} bytes/token), but one sequence "
                f"of max_model_len={max_model_len} needs {needed}; raise kv_cache_memory or "
                f"lower max_model_len")
        fingerprint = hashlib.sha256(json.dumps(
            [spec.to_dict(), weights_digest(cfg.model)], sort_keys=True).encode()).hexdigest()
        self.runtime = RuntimeInfo(spec, max_model_len, num_blocks, bpt, fingerprint)

        weights = load_weights(cfg.model, spec, cfg.dtype, cfg.device)
        self.model = LlamaModel(spec, weights, max_model_len)
        backend = resolve_backend(cfg.attention_backend, cfg.device, cfg.block_size)
        self.kv = KVPool(spec.num_layers, num_blocks, cfg.block_size, spec.num_kv_heads,
                         spec.head_dim, cfg.kv_cache_dtype, cfg.device,
                         use_kernels=backend == AttentionBackend.TRITON)
        self.pool = BlockPool(num_blocks, cfg.block_size, cfg.enable_prefix_caching)
        hasher = BlockHasher({"model": fingerprint, "kv_dtype": cfg.kv_cache_dtype_name},
                             cfg.block_size)
        self.prefix = PrefixCache(self.pool, hasher,
                                  int(cfg.max_pinned_fraction * num_blocks))
        self.scheduler = Scheduler(self.pool, self.prefix, cfg.max_num_seqs,
                                   cfg.max_num_batched_tokens,
                                   reclaim=lambda n: self.policy.reclaim(n))
        self.latency = LatencyTracker()
        self.slo = SLO()
        runner = ModelRunner(self.model, self.kv, cfg.device, backend)
        if cfg.device.type == "cuda" and backend == AttentionBackend.TRITON:
            runner.graphs = DecodeGraphs(self.model, self.kv, cfg.device, backend,
                                         blocks_for(max_model_len, cfg.block_size),
                                         cfg.max_num_seqs, capture=True)
        engine = Engine(self.scheduler, runner, Sampler(cfg.seed), self.tokenizer.decode,
                        self.latency)
        host_blocks = cfg.host_cache_memory_bytes // (bpt * cfg.block_size)
        self.host = HostPool(self.kv, host_blocks) if host_blocks > 0 else None
        self.disk = DiskTier(cfg.session_dir) if cfg.session_dir is not None else None
        self.policy = TierPolicy(
            self.pool, self.kv, self.prefix, self.host, self.disk, self._header_fields, bpt,
            engine.prefill_tps, engine.queue_depth, cfg.spill_after_s)
        engine.timers.append(self.policy.housekeeping)
        self._init_sessions()
        self._init_remote(engine)
        self._loop = EngineLoop(engine)
        _LIVE.add(self)
        log.info("kvsession: %s on %s, kv %s: %d blocks x %d tokens = %d tokens, %d bytes/token",
                 spec.architecture, cfg.device, cfg.kv_cache_dtype_name, num_blocks,
                 cfg.block_size, num_blocks * cfg.block_size, bpt)

    def _init_remote(self, engine: Engine) -> None:
        """Connect the prefill workers (handshakes finish here, before the engine thread
        starts) and install the per-request offload decision."""
        cfg = self.config
        self.connector = None
        if not cfg.prefill_workers or cfg.remote_prefill == RemotePrefillMode.NEVER:
            return
        try:
            from kvsession.connector.nixl import NixlPrefillClient
        except ImportError as e:
            raise ConfigError(f"prefill_worker needs the remote extra (nixl, pyzmq): "
                              f"pip install 'kvsession[remote]' ({e})") from None
        from kvsession.cache.hashing import LAYOUT_VERSION
        from kvsession.connector.base import compat_hash

        compat = compat_hash(self.runtime.model_fingerprint, cfg.kv_cache_dtype_name,
                             cfg.block_size, LAYOUT_VERSION)
        conn = NixlPrefillClient(list(cfg.prefill_workers), self.kv.tensors(), compat,
                                 cfg.remote_prefill_timeout_s)
        deadline = time.monotonic() + min(cfg.remote_prefill_timeout_s, 5.0)
        while time.monotonic() < deadline and any(
                w.state == "connecting" for w in conn.workers):
            conn.poll(0.05)
        self.connector = engine.connector = conn
        self.scheduler.offload = self._should_offload

        def idle_poll(now: float) -> float | None:  # fences and heartbeats while idle
            if conn.pending or conn.quarantine or self.scheduler.quarantine:
                engine._remote()
                return 0.02
            return None

        engine.timers.append(idle_poll)

    def _should_offload(self, seq: Sequence) -> bool:
        """remote_prefill: "always" when a worker is healthy; "auto": when the cost model's
        gain (decode time no longer stalled minus the KV transfer, DESIGN-NOTES) is
        positive, with the transfer bandwidth measured on past transfers."""
        conn = self.connector
        if conn is None or not conn.healthy():
            return False
        if self.config.remote_prefill == RemotePrefillMode.ALWAYS:
            return True
        tpot_ms = (self.latency.tpot_p50_s() or 0.025) * 1000
        gain = costmodel.pd_split_gain_ms(
            seq.num_tokens - 1, seq.params.max_tokens, self.runtime.kv_bytes_per_token,
            conn.bandwidth_bytes_per_s or 5e9, tpot_ms, REMOTE_STALL_RATIO)
        return gain > 0

    @staticmethod
    def _num_blocks(cfg: EngineConfig, spec: ModelSpec, bytes_per_token: int) -> int:
        budget = cfg.kv_cache_memory_bytes
        if budget is None and cfg.device.type == "cuda":
            free, total = torch.cuda.mem_get_info(cfg.device)
            used = total - free
            budget = int(total * cfg.gpu_memory_utilization) - used - _weight_bytes(
                spec, cfg.dtype)
            budget = max(budget, 0)
        elif budget is None:
            budget = CPU_DEFAULT_KV_BYTES
        return budget // (bytes_per_token * cfg.block_size)

    # ---- lifecycle -------------------------------------------------------------------

    def close(self) -> None:
        """Persist live sessions to session_dir (when set), stop the engine thread (pending
        calls fail with EngineClosedError), close every session and drop the KV cache.
        Idempotent."""
        if self._loop is not None:
            self._persist_sessions()
        for sess in list(getattr(self, "_sessions", {}).values()):
            sess._closed = True
        if self._loop is not None:
            self._loop.close()
            self._loop = None
            if getattr(self, "connector", None) is not None:
                self.connector.close()
            self.kv = None

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

    def _engine_loop(self) -> EngineLoop:
        if self._loop is None:
            raise EngineClosedError("this LLM is closed")
        return self._loop

    # ---- stateless generation --------------------------------------------------------

    def _validate_prompt(self, ids: list[int]) -> list[int]:
        if not ids:
            raise ConfigError("a prompt must have at least one token")
        vocab = self.runtime.spec.vocab_size
        bad = [t for t in ids if not isinstance(t, int) or not 0 <= t < vocab]
        if bad:
            raise ConfigError(f"prompt token ids {bad[:5]} are outside the vocabulary [0, {vocab})")
        if len(ids) >= self.runtime.max_model_len:
            raise ConfigError(
                f"prompt of {len(ids)} tokens leaves no room to generate within max_model_len="
                f"{self.runtime.max_model_len}")
        return list(ids)

    def _new_sequence(self, ids: list[int], params: SamplingParams) -> Sequence:
        return Sequence(token_ids=self._validate_prompt(ids), params=params,
                        max_model_len=self.runtime.max_model_len,
                        eos_token_ids=self.tokenizer.eos_token_ids)

    def _output(self, seq: Sequence, prompt: str | None) -> RequestOutput:
        out_ids = seq.output_token_ids
        text = self.tokenizer.decode(out_ids)
        if seq.stop_text_len is not None:
            text = text[: seq.stop_text_len]
        return RequestOutput(
            request_id=seq.seq_id, prompt=prompt, prompt_token_ids=seq.token_ids[
                : seq.num_prompt_tokens], text=text, token_ids=out_ids,
            finish_reason=seq.finish_reason, num_cached_tokens=max(seq.num_cached_tokens, 0),
            metrics=request_metrics(seq),
            logprobs=seq.output_logprobs if seq.params.logprobs is not None else None)

    def _run_batch(self, prompts: list[str | None], ids: list[list[int]],
                   params: list[SamplingParams], use_tqdm: bool) -> list[RequestOutput]:
        seqs = [self._new_sequence(i, p) for i, p in zip(ids, params, strict=True)]
        loop = self._engine_loop()
        futures: list[Future] = [loop.submit(s) for s in seqs]
        if use_tqdm and len(futures) > 1:
            with tqdm(total=len(futures), desc="generate", unit="req") as bar:
                for _ in as_completed(futures):
                    bar.update(1)
        done = [f.result() for f in futures]
        return [self._output(s, p) for s, p in zip(done, prompts, strict=True)]

    @staticmethod
    def _params_list(sampling_params, n: int) -> list[SamplingParams]:
        if sampling_params is None:
            return [SamplingParams()] * n
        if isinstance(sampling_params, SamplingParams):
            return [sampling_params] * n
        params = list(sampling_params)
        if len(params) != n or not all(isinstance(p, SamplingParams) for p in params):
            raise ConfigError(f"sampling_params must be one SamplingParams or a list of {n}")
        return params

    def generate(self, prompts=None, sampling_params=None, prompt_token_ids=None,
                 use_tqdm: bool = True) -> list[RequestOutput]:
        """Generate for a prompt or a batch (strings, or token ids via prompt_token_ids);
        outputs come back in input order."""
        if (prompts is None) == (prompt_token_ids is None):
            raise ConfigError("pass exactly one of prompts or prompt_token_ids")
        if prompts is not None:
            texts = [prompts] if isinstance(prompts, str) else list(prompts)
            if not all(isinstance(t, str) for t in texts):
                raise ConfigError("prompts must be a string or a list of strings")
            ids = [self.tokenizer.encode(t) for t in texts]
        else:
            ids = list(prompt_token_ids)
            if ids and isinstance(ids[0], int):
                ids = [ids]
            texts = [None] * len(ids)
        return self._run_batch(texts, ids, self._params_list(sampling_params, len(ids)),
                               use_tqdm)

    def chat(self, messages, sampling_params=None, use_tqdm: bool = True,
             add_generation_prompt: bool = True) -> list[RequestOutput]:
        """Generate replies to one conversation (a list of {role, content} dicts) or a list
        of conversations, rendered with the checkpoint's chat template."""
        convs = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        texts = [self.tokenizer.render_chat(c, add_generation_prompt) for c in convs]
        ids = [self.tokenizer.encode(t, add_special_tokens=False) for t in texts]
        return self._run_batch(texts, ids, self._params_list(sampling_params, len(ids)),
                               use_tqdm)

    # ---- pinned prefixes -------------------------------------------------------------

    def pin(self, prefix, ttl_s: float | None = None) -> PinnedPrefix:
        """Compute `prefix` (text or token ids) into the cache if absent and hold its full
        blocks: they are never evicted until `unpin()` or `ttl_s` seconds without a hit.
        Raises CacheFullError (nothing already pinned is affected) past max_pinned_fraction."""
        ids = self.tokenizer.encode(prefix) if isinstance(prefix, str) else list(prefix)
        ids = self._validate_prompt(ids)
        bs = self.config.block_size
        num_blocks = len(ids) // bs
        if num_blocks == 0:
            raise ConfigError(f"a pinned prefix needs at least block_size={bs} tokens, "
                              f"got {len(ids)}")
        if not self.config.enable_prefix_caching:
            raise ConfigError("pin() needs enable_prefix_caching=True")
        if ttl_s is not None and not ttl_s > 0:
            raise ConfigError(f"ttl_s must be None or > 0, got {ttl_s!r}")
        loop = self._engine_loop()
        pins = self.prefix.pins
        loop.call(lambda: pins.check_budget(num_blocks - self._num_pinned_among(ids))).result()
        seq = Sequence(token_ids=ids, params=SamplingParams(max_tokens=1, temperature=0.0),
                       max_model_len=self.runtime.max_model_len, retain_blocks=True)
        loop.submit(seq).result()
        pin = loop.call(lambda: self._hold_pin(seq, num_blocks, ttl_s)).result()
        return PinnedPrefix(self, pin)

    def _num_pinned_among(self, ids: list[int]) -> int:
        hashes = self.prefix.hasher.extend([], ids, len(ids), None)
        blocks = self.prefix.lookup_blocks(ids, hashes, len(hashes))
        return len(blocks) - self.prefix.pins.num_new_blocks(blocks)

    def _hold_pin(self, seq: Sequence, num_blocks: int, ttl_s: float | None):
        """Engine thread: move the prefill's references onto the indexed copy of each full
        block (a recomputed duplicate is not what lookups find), then register the pin."""
        bs, pool = self.config.block_size, self.pool
        keep = []
        for i in range(num_blocks):
            tokens = seq.token_ids[i * bs:(i + 1) * bs]
            pool.cache_full_block(seq.blocks[i], seq.block_hashes[i], tokens)
            keep.append(pool.lookup(seq.block_hashes[i], tokens))
        pool.touch(keep)
        pool.free(seq.blocks)
        seq.blocks = []
        try:
            return self.prefix.pins.add(seq.token_ids[: num_blocks * bs], keep, ttl_s,
                                        self.prefix.clock())
        except CacheFullError:
            pool.free(keep)
            raise

    # ---- observability ---------------------------------------------------------------

    def stats(self) -> Stats:
        """A consistent snapshot, taken on the engine thread between steps."""
        return self._engine_loop().call(self._stats_now).result()

    def _stats_now(self) -> Stats:
        pool, bs = self.pool, self.config.block_size
        device = TierStats(
            blocks_total=pool.num_blocks, blocks_used=pool.num_blocks - pool.num_free,
            blocks_free=pool.num_free, blocks_pinned=self.prefix.pins.num_pinned_blocks,
            bytes_per_token=self.runtime.kv_bytes_per_token,
            tokens_capacity=pool.num_blocks * bs)
        q, h = self.prefix.queried_tokens, self.prefix.hit_tokens
        lat, goodput, attainment = self.latency.summary(self.slo)
        host = TierStats(bytes_per_token=self.runtime.kv_bytes_per_token)
        if self.host is not None:
            hp = self.host
            host = TierStats(blocks_total=hp.num_blocks, blocks_used=hp.num_blocks - hp.num_free,
                             blocks_free=hp.num_free, bytes_per_token=host.bytes_per_token,
                             tokens_capacity=hp.num_blocks * bs)
        on_disk = sum(blocks_for(len(s.tokens), bs) for s in self.policy.sessions
                      if s.tier.value == "disk")
        disk = TierStats(blocks_used=on_disk, bytes_per_token=self.runtime.kv_bytes_per_token)
        policy = self.policy
        return Stats(
            tiers={"device": device, "host": host, "disk": disk},
            prefix=PrefixStats(queried_tokens=q, hit_tokens=h, hit_rate=h / q if q else 0.0,
                               evictions=pool.num_evictions, cached_blocks=len(pool.index),
                               pinned_blocks=self.prefix.pins.num_pinned_blocks,
                               pinned_bytes=self.prefix.pins.num_pinned_blocks * bs
                               * self.runtime.kv_bytes_per_token,
                               num_pins=len(self.prefix.pins.pins)),
            spills=dict(policy.spills), restores=dict(policy.restores),
            recomputes=policy.recomputes,
            remote=self._remote_stats(), latency=lat, goodput_tokens_per_s=goodput,
            slo_attainment=attainment, num_requests=self.latency.num_requests,
            num_preemptions=self.scheduler.num_preemptions)

    def __repr__(self) -> str:
        if self._loop is None:
            return f"LLM({self.config.model.name}, closed)"
        pool = self.pool
        return (f"LLM({self.runtime.spec.architecture}, {self.config.device}, kv "
                f"{self.config.kv_cache_dtype_name}: {pool.num_blocks - pool.num_free}/"
                f"{pool.num_blocks} blocks used, {len(self._sessions)} sessions, prefix hit "
                f"rate {self.prefix.hit_tokens / max(self.prefix.queried_tokens, 1):.0%})")

    def _repr_html_(self) -> str:
        """A notebook summary: the model, every tier's occupancy, prefix and tier counters."""
        if self._loop is None:
            return f"<b>kvsession LLM</b> ({self.config.model.name}): closed"
        st = self.stats()
        rows = "".join(
            f"<tr><td>{name}</td><td>{t.blocks_used}/{t.blocks_total}</td>"
            f"<td>{t.blocks_pinned}</td><td>{t.tokens_capacity}</td>"
            f"<td>{t.bytes_per_token}</td></tr>" for name, t in st.tiers.items())
        return (f"<b>kvsession LLM</b>: {self.runtime.spec.architecture} on "
                f"{self.config.device}, KV {self.config.kv_cache_dtype_name}, "
                f"{len(self._sessions)} live sessions<br>"
                f"<table><tr><th>tier</th><th>blocks used</th><th>pinned</th>"
                f"<th>token capacity</th><th>bytes/token</th></tr>{rows}</table>"
                f"prefix hit rate {st.prefix.hit_rate:.0%}, spills {st.spills}, restores "
                f"{st.restores}, recomputes {st.recomputes}")

    def _remote_stats(self) -> RemoteStats:
        conn = self.connector
        if conn is None:
            return RemoteStats()
        return RemoteStats(prefills=conn.num_prefills, fallbacks=dict(conn.fallbacks),
                           bytes=conn.bytes, bandwidth_gbps=conn.bandwidth_bytes_per_s * 8 / 1e9)

    def check_integrity(self) -> None:
        """Run BlockPool.check_integrity on the engine thread (tests call this)."""
        self._engine_loop().call(self.pool.check_integrity).result()


class PinnedPrefix:
    """A handle on a pinned prefix. `num_tokens` / `num_blocks`: what is held (whole blocks;
    a trailing partial block is not pinned)."""

    def __init__(self, llm: LLM, pin):
        self._llm, self._pin = llm, pin
        self.token_ids = list(pin.token_ids)
        self.num_tokens = len(pin.token_ids)
        self.num_blocks = len(pin.blocks)
        self.ttl_s = pin.ttl_s

    @property
    def active(self) -> bool:
        """False once unpinned or expired."""
        return self._pin.active

    def unpin(self) -> None:
        """Release the pin's references (idempotent); the blocks stay cached until evicted."""
        if self._llm._loop is not None:
            pins = self._llm.prefix.pins
            self._llm._loop.call(lambda: pins.remove(self._pin)).result()

    def __repr__(self) -> str:
        state = "active" if self.active else "released"
        return f"PinnedPrefix({self.num_tokens} tokens, {self.num_blocks} blocks, {state})"
