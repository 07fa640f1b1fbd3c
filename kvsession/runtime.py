"""Runtime: builds and wires the engine side of one `LLM`, in dependency order.

    config -> model spec, tokenizer, cache identity, pool size   (all validation: no memory yet)
           -> weights, model, KV pool
           -> BlockPool -> KVCacheManager -> PrefixCache -> Scheduler
           -> host / disk tiers -> TierMover -> TierPolicy (reads the scheduler's queue depth;
              the scheduler asks it to reclaim blocks: attached once, explicitly)
           -> prefill connector + RemoteOffload (optional) -> ModelRunner -> Engine -> EngineLoop

Every component gets its collaborators as typed constructor arguments. The `LLM` facade and
the `SessionStore` talk to the engine thread only through the methods here (`call`,
`submit`, `pin`, `stats_now`, ...).
"""

from __future__ import annotations

import collections
import hashlib
import json
import logging
import numbers
import os
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass

import torch

from kvsession import costmodel
from kvsession.attention import resolve_backend
from kvsession.cache.block_pool import BlockPool, blocks_for
from kvsession.cache.hashing import CacheIdentity, Salt
from kvsession.cache.kv_pool import KVPool, kv_bytes_per_token
from kvsession.cache.manager import HolderKind, KVCacheManager, Tier, Transient
from kvsession.cache.prefix import Pin, PrefixCache
from kvsession.config import AttentionBackend, Durability, EngineConfig, RemotePrefillMode
from kvsession.engine.graphs import DecodeGraphs
from kvsession.engine.loop import Engine, EngineLoop, OnUpdate, request_metrics
from kvsession.engine.runner import ModelRunner
from kvsession.engine.sampler import Sampler
from kvsession.engine.scheduler import Scheduler
from kvsession.engine.sequence import Sequence
from kvsession.errors import CacheFullError, ConfigError, EngineClosedError
from kvsession.metrics import (
    SLO,
    LatencyTracker,
    PrefixStats,
    RemoteStats,
    Stats,
    TierStats,
    WorkerStats,
)
from kvsession.model.config import ModelSpec, check_sliding_window, load_model_spec
from kvsession.model.llama import LlamaModel
from kvsession.model.loader import load_weights, weights_digest
from kvsession.model.tokenizer import Tokenizer
from kvsession.outputs import CompletionOutput, RequestOutput
from kvsession.params import SamplingParams
from kvsession.tiers.commit import GroupCommit
from kvsession.tiers.disk import DiskTier
from kvsession.tiers.host import HostPool
from kvsession.tiers.mover import TierMover
from kvsession.tiers.policy import TierPolicy
from kvsession.tiers.wal import IDENTITY_FIELDS, Identity
from kvsession.tiers.writeback import SnapshotLocks, WriteBehind

log = logging.getLogger("kvsession")
CPU_DEFAULT_KV_BYTES = 2**30
# set (to anything) by the test suite: check holder-level integrity after every step of
# small pools and when the LLM closes, and raise from close() if it ever failed
CHECK_INTEGRITY_ENV = "KVSESSION_CHECK_INTEGRITY"
CHECK_EVERY_STEP_MAX_BLOCKS = 4096
PinHandle = Pin


@dataclass(frozen=True)
class RuntimeInfo:
    """Facts established at start-up (not configuration)."""

    spec: ModelSpec
    max_model_len: int
    num_blocks: int
    kv_bytes_per_token: int
    model_fingerprint: str


def weight_bytes(spec: ModelSpec, dtype: torch.dtype) -> int:
    h, hd, inter = spec.hidden_size, spec.head_dim, spec.intermediate_size
    per_layer = h * hd * (2 * spec.num_heads + 2 * spec.num_kv_heads) + 3 * h * inter
    embed = spec.vocab_size * h * (1 if spec.tie_word_embeddings else 2)
    return (spec.num_layers * per_layer + embed) * torch.empty((), dtype=dtype).element_size()


def num_kv_blocks(cfg: EngineConfig, spec: ModelSpec, bytes_per_token: int) -> int:
    """How many blocks the KV budget holds (on CUDA without a budget: what is left of
    gpu_memory_utilization after the weights)."""
    budget = cfg.kv_cache_memory_bytes
    if budget is None and cfg.device.type == "cuda":
        free, total = torch.cuda.mem_get_info(cfg.device)
        budget = int(total * cfg.gpu_memory_utilization) - (total - free) - weight_bytes(
            spec, cfg.dtype)
        budget = max(budget, 0)
    elif budget is None:
        budget = CPU_DEFAULT_KV_BYTES
    return budget // (bytes_per_token * cfg.block_size)


class RemoteOffload:
    """remote_prefill: "always" when a worker is healthy; "required": always (the engine
    fails a prompt no worker takes: RemotePrefillMode); "auto": when the cost model's gain
    (decode time no longer stalled, minus the transfer of the KV the caller lacks, minus
    the worker's recompute of the context its cache probably lacks; docs/cost-model.md) is
    positive, with the transfer bandwidth measured on past transfers and the worker-side
    hit predicted by the connector's router. A session's follow-up turn is decided like a
    fresh prompt: only its new tokens would move. A request that should go remote but that
    no worker can take is counted once in the connector's fallbacks (so a dead worker shows
    in stats().remote even while nothing is sent to it)."""

    def __init__(self, connector, mode: RemotePrefillMode, latency: LatencyTracker,
                 kv_bytes_per_token: int, prefill_tps: costmodel.RateEstimator,
                 stall_ratio: costmodel.StallRatio):
        self.connector, self.mode, self.latency = connector, mode, latency
        self.kv_bytes_per_token = kv_bytes_per_token
        self.prefill_tps, self.stall_ratio = prefill_tps, stall_ratio
        # admission may ask again for a sequence it could not place: count each once
        self._counted: collections.deque[int] = collections.deque(maxlen=4096)

    def gain_ms(self, seq: Sequence, num_cached: int) -> float:
        """The cost model's gain of offloading `seq`, whose first `num_cached` tokens the
        caller holds (its block hashes cover the tokens the worker would compute)."""
        num_tokens = seq.num_tokens - 1  # the worker computes all but the last
        tpot_ms = (self.latency.tpot_p50_s() or 0.025) * 1000
        worker_hit = self.connector.expected_cached_tokens(seq.block_hashes, num_tokens)
        return costmodel.remote_prefill_gain_ms(
            num_tokens - num_cached, num_cached, worker_hit, seq.params.max_tokens,
            self.kv_bytes_per_token, self.connector.bandwidth_bytes_per_s or 5e9, tpot_ms,
            self.stall_ratio.value, self.prefill_tps.value)

    def should_offload(self, seq: Sequence, num_cached: int = 0) -> bool:
        if self.mode is RemotePrefillMode.REQUIRED:
            return True  # no local fallback: a prompt no worker can take fails at submit
        if self.mode is not RemotePrefillMode.ALWAYS and self.gain_ms(seq, num_cached) <= 0:
            return False
        conn = self.connector
        reason = conn.refusal(seq.num_tokens - 1)
        if reason and seq.seq_id not in self._counted:
            self._counted.append(seq.seq_id)
            conn.fallbacks[reason] = conn.fallbacks.get(reason, 0) + 1
        return not reason


def check_memory_fits(cfg: EngineConfig, kv_bytes: int) -> None:
    """On CPU the KV pool is committed up front and the host tier can grow to its size: a
    budget beyond this machine's memory is a ConfigError now, not an allocator failure
    (or the OOM killer) later."""
    if cfg.device.type != "cpu":
        return
    try:
        physical = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):  # not a POSIX system: nothing to check
        return
    if kv_bytes + cfg.host_cache_memory_bytes > physical:
        raise ConfigError(
            f"kv_cache_memory ({kv_bytes} bytes) + host_cache_memory "
            f"({cfg.host_cache_memory_bytes} bytes) exceed this machine's memory "
            f"({physical} bytes); lower them")


def _remote_client_class():
    try:
        from kvsession.connector.nixl import NixlPrefillClient
    except ImportError as e:
        raise ConfigError(f"prefill_worker needs the remote extra (nixl, pyzmq): "
                          f"pip install 'kvsession[remote]' ({e})") from None
    return NixlPrefillClient


class Runtime:
    def __init__(self, cfg: EngineConfig):
        self.config = cfg
        self._loop: EngineLoop | None = None
        # ---- everything that can be refused, before any memory is taken
        spec = load_model_spec(cfg.model)
        max_model_len = cfg.max_model_len or spec.max_position_embeddings
        check_sliding_window(spec, max_model_len)
        self.tokenizer = Tokenizer(cfg.model)
        bpt = kv_bytes_per_token(spec.num_layers, spec.num_kv_heads, spec.head_dim,
                                 cfg.kv_cache_dtype)
        num_blocks = num_kv_blocks(cfg, spec, bpt)
        needed = blocks_for(max_model_len, cfg.block_size)
        if num_blocks < needed:
            raise ConfigError(
                f"kv_cache_memory holds {num_blocks} blocks of {cfg.block_size} tokens "
                f"({num_blocks * cfg.block_size} tokens at {bpt} bytes/token), but one sequence "
                f"of max_model_len={max_model_len} needs {needed}; raise kv_cache_memory or "
                f"lower max_model_len")
        check_memory_fits(cfg, num_blocks * cfg.block_size * bpt)
        remote = bool(cfg.prefill_workers) and cfg.remote_prefill != RemotePrefillMode.NEVER
        client_class = _remote_client_class() if remote else None
        backend = resolve_backend(cfg.attention_backend, cfg.device, cfg.block_size)
        fingerprint = hashlib.sha256(json.dumps(
            [spec.to_dict(), weights_digest(cfg.model)], sort_keys=True).encode()).hexdigest()
        self.info = RuntimeInfo(spec, max_model_len, num_blocks, bpt, fingerprint)
        self.identity = CacheIdentity(fingerprint, cfg.kv_cache_dtype_name, cfg.block_size)
        # what a remote prefill worker and this engine must agree on
        from kvsession.connector.base import compat_hash
        self.compat = compat_hash(self.identity, str(cfg.dtype))
        self.disk = DiskTier(cfg.session_dir) if cfg.session_dir is not None else None

        # ---- memory: weights and the KV pool
        self.model = LlamaModel(spec, load_weights(cfg.model, spec, cfg.dtype, cfg.device),
                                max_model_len)
        self.kv = KVPool(spec.num_layers, num_blocks, cfg.block_size, spec.num_kv_heads,
                         spec.head_dim, cfg.kv_cache_dtype, cfg.device,
                         use_kernels=backend == AttentionBackend.TRITON)
        self.model.warm_up(self.kv, backend)

        # ---- the cache and the scheduler
        self.pool = BlockPool(num_blocks, cfg.block_size, cfg.enable_prefix_caching,
                              cfg.eviction_policy)
        self.manager = KVCacheManager(self.pool, self.kv)
        self.prefix = PrefixCache(self.manager, self.identity.hasher(),
                                  int(cfg.max_pinned_fraction * num_blocks))
        self.latency, self.slo = LatencyTracker(), SLO()
        # measured by the engine; read by the tier policy and the remote-prefill decision
        prefill_tps = costmodel.RateEstimator(prior=2000.0)
        stall_ratio = costmodel.StallRatio()
        self.connector = None
        offload = None
        if client_class is not None:
            self.connector = self._connect(client_class)
            offload = RemoteOffload(self.connector, cfg.remote_prefill, self.latency, bpt,
                                    prefill_tps, stall_ratio)
        self.scheduler = Scheduler(self.manager, self.prefix, cfg.max_num_seqs,
                                   cfg.max_num_batched_tokens, offload)

        # ---- tiers: the mover copies, the policy decides
        host_blocks = cfg.host_cache_memory_bytes // (bpt * cfg.block_size)
        self.host = HostPool(self.kv, host_blocks) if host_blocks > 0 else None
        self.header_fields = {
            "model_fingerprint": fingerprint,
            "tokenizer_digest": self.tokenizer.digest,
            "template_digest": self.tokenizer.template_digest,
            "kv_dtype": self.identity.kv_dtype, "block_size": self.identity.block_size,
            "num_layers": spec.num_layers, "num_kv_heads": spec.num_kv_heads,
            "head_dim": spec.head_dim, "tensor_names": list(self.kv.tensors()),
        }
        snapshot_locks = SnapshotLocks()  # spills and saves vs write-behind compaction
        self.mover = TierMover(self.manager, self.host, self.disk, self.prefix.hasher,
                               self.header_fields, prefill_tps, snapshot_locks)
        self.policy = TierPolicy(self.mover, self.prefix, self.scheduler, prefill_tps, bpt,
                                 cfg.spill_after_s)
        self.scheduler.attach_reclaimer(self.policy)

        # ---- the engine and its thread
        runner = ModelRunner(self.model, self.kv, cfg.device, backend)
        if cfg.device.type == "cuda" and backend == AttentionBackend.TRITON:
            runner.graphs = DecodeGraphs(self.model, self.kv, cfg.device, backend,
                                         needed, cfg.max_num_seqs, capture=True)
        self.engine = Engine(self.scheduler, runner, Sampler(cfg.seed), self.tokenizer.decode,
                             self.latency, prefill_tps, timers=[self.policy.housekeeping],
                             connector=self.connector, stall_ratio=stall_ratio,
                             remote_required=cfg.remote_prefill is RemotePrefillMode.REQUIRED)
        # ---- durability="turn": session logs, group-committed by one thread
        self.log_identity = Identity(**{k: self.header_fields[k] for k in IDENTITY_FIELDS})
        durable = self.disk is not None and cfg.durability is Durability.TURN
        self.journal = GroupCommit(cfg.session_dir) if durable else None
        # full KV blocks written behind to each session's segment (never waited on)
        self.writeback = WriteBehind(self.disk, self.header_fields, snapshot_locks) \
            if durable else None

        self._grammars = None  # kvsession.structured.GrammarCompiler, on first use
        self._grammar_lock = threading.Lock()
        self._integrity_failure: AssertionError | None = None
        self.checking = bool(os.environ.get(CHECK_INTEGRITY_ENV))
        if self.checking and num_blocks <= CHECK_EVERY_STEP_MAX_BLOCKS:
            self.engine.step_observers.append(self._check_after_step)
        self._loop = EngineLoop(self.engine)
        log.info("kvsession: %s on %s, kv %s: %d blocks x %d tokens = %d tokens, %d bytes/token",
                 spec.architecture, cfg.device, cfg.kv_cache_dtype_name, num_blocks,
                 cfg.block_size, num_blocks * cfg.block_size, bpt)

    def _connect(self, client_class):
        """Connect the prefill workers (with the caller's CURVE keys when configured);
        handshakes finish here, before the engine thread starts. Later the client asks the
        engine thread for a poll whenever it idles (heartbeats, reconnects)."""
        from kvsession.connector.base import load_keys

        cfg = self.config
        auth = None if cfg.prefill_auth_key_file is None else load_keys(
            cfg.prefill_auth_key_file, "caller")

        def schedule(fn: Callable[[], None]) -> None:  # any thread
            loop = self._loop
            if loop is not None:
                loop.call(fn)

        conn = client_class(list(cfg.prefill_workers), self.kv.tensors(),
                            self.compat, cfg.remote_prefill_timeout_s,
                            auth=auth, schedule=schedule)
        deadline = time.monotonic() + min(cfg.remote_prefill_timeout_s, 5.0)
        while time.monotonic() < deadline and any(
                w.state == "connecting" for w in conn.workers):
            conn.poll(0.05)
        return conn

    # ---- the engine thread ---------------------------------------------------------------

    @property
    def closed(self) -> bool:
        return self._loop is None

    def check_open(self) -> EngineLoop:
        if self._loop is None:
            raise EngineClosedError("this LLM is closed")
        return self._loop

    def call(self, fn: Callable[[], object]) -> Future:
        """Run fn on the engine thread between steps."""
        return self.check_open().call(fn)

    def submit(self, seq: Sequence, on_update: OnUpdate | None = None,
               prepare: Callable[[], None] | None = None) -> Future:
        return self.check_open().submit(seq, on_update=on_update, prepare=prepare)

    def submit_all(self, seqs: list[Sequence]) -> list[Future]:
        """A batch, added to the engine between the same two steps."""
        return self.check_open().submit_all(seqs)

    def cancel(self, seq: Sequence) -> None:
        """Stop a request whose caller went away (a stream closed early); its Future fails
        with CancelledError. Fire and forget: a closed LLM has nothing left to cancel."""
        loop = self._loop
        if loop is not None:
            loop.call(lambda: self.engine.cancel(seq))

    def close(self) -> None:
        """Stop the engine thread (pending calls fail with EngineClosedError), release the
        workers and the KV cache. Idempotent. With integrity checking on, raises the first
        integrity failure seen (after closing)."""
        loop = self._loop
        if loop is None:
            return
        if self.checking and loop.failure is None:
            try:
                loop.call(self._check_at_rest).result(timeout=60)
            except AssertionError as e:
                self._integrity_failure = self._integrity_failure or e
            except EngineClosedError:  # the engine thread died meanwhile: checked below
                pass
        loop.close()
        self._loop = None
        if self.checking and loop.failure is not None and not loop.alive:
            try:  # the engine thread is gone: its state is safe to read from here
                self._check_at_rest()
            except AssertionError as e:
                self._integrity_failure = self._integrity_failure or e
        if self.connector is not None:
            self.connector.close()
        if self.writeback is not None:
            self.writeback.close()
        if self.journal is not None:
            self.journal.close()
        self.kv = None
        if self._integrity_failure is not None:
            raise self._integrity_failure

    def _check_after_step(self) -> None:
        try:
            self.check_integrity_now()
        except AssertionError as e:
            self._integrity_failure = self._integrity_failure or e
            raise

    # ---- requests --------------------------------------------------------------------------

    def validate_prompt(self, ids: list[int]) -> list[int]:
        if not ids:
            raise ConfigError("a prompt must have at least one token")
        # bool is an int to Python but never a token id; numpy ints are fine. Plain ints
        # are checked by type first: a session validates its whole history every turn, and
        # the ABC check alone took ~1.5 ms per 1,000 ids
        bad = [t for t in ids if type(t) is not int and (
            not isinstance(t, numbers.Integral) or isinstance(t, bool))]
        if bad:
            raise ConfigError(f"prompt token ids must be ints, got {bad[:5]!r:.80}")
        ids = [int(t) for t in ids]
        vocab = self.info.spec.vocab_size
        bad = [] if 0 <= min(ids) and max(ids) < vocab else [
            t for t in ids if not 0 <= t < vocab]
        if bad:
            raise ConfigError(f"prompt token ids {bad[:5]} are outside the vocabulary [0, {vocab})")
        if len(ids) >= self.info.max_model_len:
            raise ConfigError(
                f"prompt of {len(ids)} tokens leaves no room to generate within max_model_len="
                f"{self.info.max_model_len}")
        return list(ids)

    def validate_params(self, params: SamplingParams, retain_blocks: bool) -> None:
        """What SamplingParams cannot check alone: token ids against the vocabulary, the
        structured format against the tokenizer (compiled here, in the caller's thread),
        and what a session turn (retain_blocks) cannot do."""
        vocab = self.info.spec.vocab_size
        bad = [t for t, _ in params.logit_bias or () if t >= vocab]
        if bad:
            raise ConfigError(f"logit_bias token ids {bad[:5]} are outside the vocabulary "
                              f"[0, {vocab})")
        if retain_blocks and params.n > 1:
            raise ConfigError(f"n must be 1 for a session turn (one reply), got {params.n}")
        if retain_blocks and params.prompt_logprobs is not None:
            raise ConfigError("prompt_logprobs must be None for a session turn (its prompt "
                              "is mostly cached KV, whose logits are not kept)")

    def grammars(self):
        """The structured-output compiler (built, and xgrammar imported, on first use)."""
        with self._grammar_lock:
            if self._grammars is None:
                from kvsession.structured import GrammarCompiler

                self._grammars = GrammarCompiler(self.config.model / "tokenizer.json",
                                                 self.info.spec.vocab_size,
                                                 self.tokenizer.eos_token_ids)
            return self._grammars

    def new_sequence(self, ids: list[int], params: SamplingParams,
                     retain_blocks: bool = False) -> Sequence:
        self.validate_params(params, retain_blocks)
        ids = self.validate_prompt(ids)
        grammar = None if params.structured is None else \
            self.grammars().new_state(params.structured)
        return Sequence(token_ids=ids, params=params, max_model_len=self.info.max_model_len,
                        eos_token_ids=self.tokenizer.eos_token_ids, retain_blocks=retain_blocks,
                        grammar=grammar, salt=self.salt_for(ids, params.cache_salt))

    def salt_for(self, ids: list[int], cache_salt: str | None) -> Salt | None:
        """Layered isolation: a salted request shares the public pinned prefix it starts
        with (unsalted, computed once for every tenant) and nothing after it."""
        if cache_salt is None:
            return None
        pins = self.prefix.pins
        after = pins.salted_after(ids, cache_salt)  # as the tenant's own pin was hashed
        return Salt(cache_salt, pins.public_blocks(ids) if after is None else after)

    def completion(self, seq: Sequence) -> CompletionOutput:
        out_ids = seq.output_token_ids
        text = self.tokenizer.decode(out_ids)
        if seq.stop_text_len is not None:
            text = text[: seq.stop_text_len]
        return CompletionOutput(
            index=seq.index, text=text, token_ids=out_ids, finish_reason=seq.finish_reason,
            logprobs=seq.output_logprobs if seq.params.logprobs is not None else None)

    def output(self, seq: Sequence, prompt: str | None) -> RequestOutput:
        members = seq.group or [seq]
        last = max(members, key=lambda m: m.finish_time or 0.0)
        prompt_lp = None
        if seq.params.prompt_logprobs is not None:
            prompt_lp = [None] + [seq.prompt_logprobs.get(i)
                                  for i in range(1, seq.num_prompt_tokens)]
        return RequestOutput(
            request_id=seq.seq_id, prompt=prompt, prompt_token_ids=seq.token_ids[
                : seq.num_prompt_tokens], outputs=[self.completion(m) for m in members],
            num_cached_tokens=max(seq.num_cached_tokens, 0), metrics=request_metrics(last),
            prompt_logprobs=prompt_lp)

    # ---- pins ------------------------------------------------------------------------------

    def pin(self, ids: list[int], ttl_s: float | None, cache_salt: str | None = None) -> Pin:
        """Compute `ids` into the cache if absent and pin its full blocks (CacheFullError,
        nothing already pinned affected, past the pin budget). A salted pin is its tenant's
        own (hashed with the salt after any public pinned prefix it starts with)."""
        ids = self.validate_prompt(ids)  # every caller's pin fits the engine, or ConfigError
        num_blocks = len(ids) // self.config.block_size
        pins = self.prefix.pins
        salt = self.salt_for(ids, cache_salt)
        self.call(lambda: pins.check_budget(
            num_blocks - self._num_pinned_among(ids, salt))).result()
        seq = Sequence(token_ids=list(ids), params=SamplingParams(
            max_tokens=1, temperature=0.0, cache_salt=cache_salt),
            max_model_len=self.info.max_model_len, retain_blocks=True, salt=salt, internal=True)
        self.submit(seq).result()
        return self.call(lambda: self._hold_pin(seq, num_blocks, ttl_s)).result()

    def unpin(self, pin: Pin) -> None:
        if self._loop is not None:
            self.call(lambda: self.prefix.pins.remove(pin)).result()

    def _num_pinned_among(self, ids: list[int], salt: Salt | None) -> int:
        hashes = self.prefix.hasher.extend([], ids, len(ids), salt)
        blocks = self.prefix.lookup_blocks(ids, hashes, len(hashes))
        return len(blocks) - self.prefix.pins.num_new_blocks(blocks)

    def _hold_pin(self, seq: Sequence, num_blocks: int, ttl_s: float | None) -> Pin:
        """Engine thread: the prefill's references move onto the indexed copy of each full
        block, then to the pin."""
        staged = Transient()
        self.manager.transfer(seq, staged, num_blocks)
        self.manager.retarget_to_indexed(staged, seq.block_hashes[:num_blocks], seq.token_ids)
        try:
            return self.prefix.pins.add(seq.token_ids[: num_blocks * self.config.block_size],
                                        staged, ttl_s, self.prefix.clock(), seq.salt)
        except CacheFullError:
            self.manager.release(staged)
            raise

    # ---- observability (engine thread) -----------------------------------------------------

    def stats(self) -> Stats:
        """`stats_now` on the engine thread; then, on the caller's, the disk tier's room
        (a file-system query, kept off the engine thread: a slow mount must not stall
        decoding): free = what is left on session_dir's file system, in blocks."""
        st = self.call(self.stats_now).result()
        if self.disk is not None:
            d, bs = st.tiers["disk"], self.config.block_size
            d.blocks_free = self.disk.free_bytes() // (d.bytes_per_token * bs)
            d.blocks_total = d.blocks_used + d.blocks_free
            d.tokens_capacity = d.blocks_total * bs
            st.recovery = list(self.disk.recoveries)
        return st

    def stats_now(self) -> Stats:
        pool, bs, bpt = self.pool, self.config.block_size, self.info.kv_bytes_per_token
        pins = self.prefix.pins
        device = TierStats(
            blocks_total=pool.num_blocks, blocks_used=pool.num_blocks - pool.num_free,
            blocks_free=pool.num_free, blocks_pinned=pins.num_pinned_blocks,
            bytes_per_token=bpt, tokens_capacity=pool.num_blocks * bs)
        host = TierStats(bytes_per_token=bpt)
        if self.host is not None:
            hp = self.host
            host = TierStats(blocks_total=hp.num_blocks, blocks_used=hp.num_blocks - hp.num_free,
                             blocks_free=hp.num_free, bytes_per_token=bpt,
                             tokens_capacity=hp.num_blocks * bs)
        disk = TierStats(bytes_per_token=bpt)
        if self.disk is not None:  # sessions whose KV lives only there (free: see stats())
            disk.blocks_used = sum(blocks_for(len(s.tokens), bs) for s in self.policy.sessions
                                   if s.tier is Tier.DISK)
        q, h = self.prefix.queried_tokens, self.prefix.hit_tokens
        lat, goodput, attainment = self.latency.summary(self.slo)
        return Stats(
            tiers={"device": device, "host": host, "disk": disk},
            prefix=PrefixStats(queried_tokens=q, hit_tokens=h, hit_rate=h / q if q else 0.0,
                               evictions=pool.num_evictions, cached_blocks=len(pool.index),
                               pinned_blocks=pins.num_pinned_blocks,
                               pinned_bytes=pins.num_pinned_blocks * bs * bpt,
                               num_pins=len(pins.pins),
                               eviction_policy=pool.eviction.value,
                               evictions_by_copy=dict(pool.evictions_by_copy),
                               evictions_by_reason=dict(pool.evictions_by_reason)),
            spills=dict(self.policy.spills), restores=dict(self.policy.restores),
            recomputes=self.policy.recomputes, remote=self._remote_stats(), latency=lat,
            goodput_tokens_per_s=goodput, slo_attainment=attainment,
            num_requests=self.latency.num_requests,
            num_preemptions=self.scheduler.num_preemptions,
            prefill_tokens=self.engine.prefill_tokens,
            generated_tokens=self.engine.generated_tokens)

    def _remote_stats(self) -> RemoteStats:
        conn = self.connector
        if conn is None:
            return RemoteStats()
        workers = {w.address: WorkerStats(
            state=w.state, reason=w.reason, attempts=w.attempts, connects=w.connects,
            reconnects=w.reconnects, deaths=dict(w.deaths), heartbeats=w.heartbeats,
            rejected=w.rejected, requests=w.num_requests, prefills=w.prefills, bytes=w.bytes,
            routed=w.routed, spilled=w.spilled, cached_tokens=w.cached_tokens)
            for w in conn.workers}
        return RemoteStats(prefills=conn.num_prefills, fallbacks=dict(conn.fallbacks),
                           bytes=conn.bytes, bandwidth_gbps=conn.bandwidth_bytes_per_s * 8 / 1e9,
                           workers=workers, foreign_notifications=conn.foreign_notifications)

    def _check_at_rest(self) -> None:
        """Engine thread, at close: integrity, and when no request is in flight the pool is
        back to its baseline: only sessions and pins hold blocks."""
        self.check_integrity_now()
        if self.scheduler.has_work():
            return
        held_for_proof = self.engine.quarantine_at_rest()  # (blocks a worker may still write)
        for kind in (HolderKind.SEQUENCE, HolderKind.TRANSIENT,
                     *(() if held_for_proof else (HolderKind.QUARANTINE,))):
            if self.manager.num_held(kind):
                raise AssertionError(f"{self.manager.num_held(kind)} block references still "
                                     f"held by {kind.value} holders with no request in flight: "
                                     f"{self.manager.holders()}")

    def check_integrity_now(self) -> None:
        """Engine thread: the pool's invariants, every device reference accounted to a
        holder, every host block held once or free."""
        self.manager.check_integrity(self.host)
