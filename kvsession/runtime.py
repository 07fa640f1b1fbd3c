"""Runtime: builds and wires the engine side of one `LLM`, in dependency order.

    config -> model spec, tokenizer, KV sizing (sizing.py)   (all validation: no memory yet)
           -> weights, model, KV pool
           -> BlockPool -> KVCacheManager -> PrefixCache -> Scheduler
           -> host / disk tiers -> TierMover -> TierPolicy (reads the scheduler's queue depth;
              the scheduler asks it to reclaim blocks: attached once, explicitly)
           -> prefill connector + RemoteOffload (optional: remote_offload.py)
           -> ModelRunner -> Engine -> EngineLoop
           -> what the API asks of the engine: SequenceFactory (requests in, outputs out),
              Pinning (prefixes held in the cache), StatsCollector (llm.stats())

Every component gets its collaborators as typed constructor arguments. Beyond building,
the Runtime is the gateway to the engine thread (`call`, `submit`, `cancel`, `close`) and
checks the whole engine's integrity (the test suite turns it on after every step).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
from collections.abc import Callable, Generator
from concurrent.futures import Future
from functools import partial

from kvsession import costmodel
from kvsession.attention import resolve_backend
from kvsession.cache.block_pool import BlockPool, blocks_for
from kvsession.cache.identity import StorageIdentity
from kvsession.cache.kv_pool import KVPool
from kvsession.cache.manager import KVCacheManager
from kvsession.cache.prefix import Pin, PrefixCache
from kvsession.config import AttentionBackend, Durability, EngineConfig, RemotePrefillMode
from kvsession.connector.base import compat_hash
from kvsession.engine.drafts import Drafter
from kvsession.engine.graphs import DecodeGraphs
from kvsession.engine.loop import Engine, EngineLoop, OnUpdate
from kvsession.engine.remote import RemoteOffload
from kvsession.engine.runner import ModelRunner
from kvsession.engine.sampler import Sampler
from kvsession.engine.scheduler import Scheduler
from kvsession.engine.sequence import Sequence
from kvsession.engine.slo_chunking import SloChunking
from kvsession.errors import EngineClosedError
from kvsession.generation_defaults import GenerationDefaults
from kvsession.host_memory import release_free_memory
from kvsession.integrity import IntegrityCheck
from kvsession.metrics import SLO, LatencyTracker, Stats
from kvsession.model.config import load_model_spec
from kvsession.model.llama import LlamaModel, weight_format
from kvsession.model.loader import load_weights, weights_digest
from kvsession.model.region_store import RegionStore
from kvsession.model.tokenizer import Tokenizer
from kvsession.observability import StatsCollector
from kvsession.pinning import Pinning
from kvsession.remote_offload import connect_workers, remote_client_class
from kvsession.sequence_factory import SequenceFactory
from kvsession.sizing import RuntimeInfo, size_kv
from kvsession.tiers.block_record import BlockRecords
from kvsession.tiers.commit import GroupCommit
from kvsession.tiers.disk import DiskTier
from kvsession.tiers.disk_cache import DiskCache, DiskCacheBusy
from kvsession.tiers.host import HostPool
from kvsession.tiers.mover import TierMover
from kvsession.tiers.object_store import ObjectCache
from kvsession.tiers.policy import HostEvictions, TierPolicy
from kvsession.tiers.session_mirror import SessionMirror
from kvsession.tiers.writeback import SnapshotLocks, WriteBehind

log = logging.getLogger("kvsession")
# pools up to this many blocks are checked after every step when checking is on (the
# test suite's tiny models); larger ones at close only
CHECK_EVERY_STEP_MAX_BLOCKS = 4096
PinHandle = Pin


class Runtime:
    def __init__(self, cfg: EngineConfig):
        self.config = cfg
        self._loop: EngineLoop | None = None
        # ---- everything that can be refused, before any memory is taken
        spec = load_model_spec(cfg.model)
        self.tokenizer = Tokenizer(cfg.model, chat_template=cfg.chat_template)
        sizing = size_kv(cfg, spec)
        max_model_len, bpt, num_blocks = (sizing.max_model_len, sizing.kv_bytes_per_token,
                                          sizing.num_blocks)
        remote = bool(cfg.prefill_workers) and cfg.remote_prefill != RemotePrefillMode.NEVER
        client_class = remote_client_class() if remote else None
        backend = resolve_backend(cfg.attention_backend, cfg.device, cfg.block_size)
        fingerprint = hashlib.sha256(json.dumps(
            [spec.to_dict(), weights_digest(cfg.model)], sort_keys=True).encode()).hexdigest()
        # what a request's unset sampling fields become (the checkpoint's own defaults)
        self.generation = GenerationDefaults.load(cfg.model, cfg.generation_config,
                                                  max_model_len)
        self.disk = DiskTier(cfg.session_dir) if cfg.session_dir is not None else None

        # ---- memory: weights and the KV pool
        self.model = LlamaModel(spec, load_weights(cfg.model, spec, cfg.dtype, cfg.device),
                                max_model_len, weight_format(cfg))
        self.kv_pool = KVPool(spec.num_layers, num_blocks, cfg.block_size, spec.num_kv_heads,
                              spec.head_dim, cfg.kv_cache_dtype, cfg.device,
                              use_kernels=backend == AttentionBackend.TRITON)
        self.model.warm_up(self.kv_pool, backend, RegionStore.default())
        self.info = RuntimeInfo(spec, max_model_len, num_blocks, bpt, fingerprint,
                                self.model.weight_bytes())
        # the originals the weights were fused and packed from are freed: give them back
        release_free_memory()
        # what stored KV is valid under: block hashes, snapshots, segments, the session log
        # and a remote worker's handshake all take it from here (cache/identity.py)
        self.identity = StorageIdentity(
            fingerprint, cfg.kv_cache_dtype_name, cfg.block_size, self.tokenizer.digest,
            self.tokenizer.template_digest, spec.num_layers, spec.num_kv_heads, spec.head_dim,
            tuple(self.kv_pool.tensors()))
        self.compat = compat_hash(self.identity, str(cfg.dtype))

        # ---- the cache and the scheduler
        self.pool = BlockPool(num_blocks, cfg.block_size, cfg.enable_prefix_caching,
                              cfg.eviction_policy)
        host_blocks = cfg.host_cache_memory_bytes // (bpt * cfg.block_size)
        self.host = HostPool(self.kv_pool, host_blocks) if host_blocks > 0 else None
        self.disk_cache = open_disk_cache(cfg, self.kv_pool, self.identity)
        self.objects = open_object_store(cfg, self.kv_pool, self.identity)
        # session_dir given as a store's URL: sessions' files mirrored there
        self.mirror = SessionMirror(cfg.session_store.url, cfg.session_store.options) \
            if cfg.session_store is not None else None
        self.manager = KVCacheManager(self.pool, self.kv_pool,
                                      self.host.index if self.host is not None else None)
        self.prefix = PrefixCache(self.manager, self.identity.hasher(),
                                  int(cfg.max_pinned_fraction * num_blocks))
        self.latency, self.slo = LatencyTracker(), SLO()
        # measured by the engine; read by the tier policy and the remote-prefill decision
        prefill_tps = costmodel.RateEstimator(prior=2000.0)
        stall_ratio = costmodel.StallRatio()
        self.connector = None
        offload = None
        if client_class is not None:
            self.connector = connect_workers(cfg, client_class, self.kv_pool.tensors(),
                                             self.compat, self._schedule)
            offload = RemoteOffload(self.connector, cfg.remote_prefill, self.latency, bpt,
                                    prefill_tps, stall_ratio)
        self.scheduler = Scheduler(self.manager, self.prefix, cfg.max_num_seqs,
                                   cfg.max_num_batched_tokens, offload, cfg.prefill_caps)

        # ---- tiers: the mover copies, the policy decides
        snapshot_locks = SnapshotLocks()  # spills and saves vs write-behind compaction
        self.mover = TierMover(self.manager, self.host, self.disk, self.prefix.hasher,
                               self.identity, prefill_tps, snapshot_locks, self.disk_cache,
                               self.scheduler, self.objects)
        self.policy = TierPolicy(self.mover, self.prefix, self.scheduler, prefill_tps, bpt,
                                 cfg.spill_after_s,
                                 blocks_for(cfg.max_num_batched_tokens, cfg.block_size),
                                 device_ahead=self.mover.copier.own_engine)
        self.scheduler.attach_reclaimer(self.policy)
        # SLO-aware chunking: off until `llm.slo` is set (`set_slo`)
        self.slo_chunking = SloChunking(stall_ratio)
        self.scheduler.attach_chunk_limit(self.slo_chunking)
        # drafts verified in one pass: grammar-forced spans always, prompt lookup when asked
        self.drafter = Drafter(cfg.speculative, stall_ratio)
        self.scheduler.attach_drafts(self.drafter)
        below_host = self.disk_cache is not None or self.objects is not None
        if self.host is not None or below_host:
            # any request's device misses look in the host tier, the disk cache and the
            # object store, and what the device evicts is kept there (what the host
            # evicts, in the disk cache and the object store)
            self.scheduler.attach_lower_tiers(self.policy)
            self.pool.attach_sink(self.policy)
            if self.host is not None and below_host:
                self.host.index.attach_sink(HostEvictions(self.policy))

        # ---- the engine and its thread
        runner = ModelRunner(self.model, self.kv_pool, cfg.device, backend)
        if cfg.device.type == "cuda" and backend == AttentionBackend.TRITON:
            runner.graphs = DecodeGraphs(self.model, self.kv_pool, cfg.device, backend,
                                         blocks_for(max_model_len, cfg.block_size),
                                         cfg.max_num_seqs, capture=True)
        self.engine = Engine(self.scheduler, runner, Sampler(cfg.seed),
                             self.tokenizer.incremental_text,
                             self.latency, prefill_tps, timers=[self.policy.housekeeping],
                             connector=self.connector, stall_ratio=stall_ratio,
                             remote_required=cfg.remote_prefill is RemotePrefillMode.REQUIRED,
                             drafter=self.drafter, chunking=self.slo_chunking)
        # ---- durability="turn": session logs, group-committed by one thread
        durable = self.disk is not None and cfg.durability is Durability.TURN
        self.journal = GroupCommit(cfg.session_dir, self.mirror) if durable else None
        # full KV blocks written behind to each session's segment (never waited on)
        self.writeback = WriteBehind(self.disk, self.identity, snapshot_locks) \
            if durable else None

        # ---- what the API asks of the engine: requests in and out, pins, stats
        self.sequences = SequenceFactory(cfg.model, self.tokenizer, spec.vocab_size,
                                         max_model_len, self.prefix.pins)
        self.pinning = Pinning(self, self.sequences, self.prefix, self.manager,
                               cfg.block_size)
        self.stats_collector = StatsCollector(
            self.pool, self.prefix, self.host, self.disk, self.policy, self.scheduler,
            self.engine, self.latency, self.connector, cfg.block_size, bpt, self.slo_chunking,
            self.disk_cache, self.writeback, self.objects)
        self.integrity = IntegrityCheck(self.manager, self.scheduler, self.engine,
                                        self.disk_cache, self.policy)
        if self.integrity.checking and num_blocks <= CHECK_EVERY_STEP_MAX_BLOCKS:
            self.engine.step_observers.append(self.integrity.after_step)
        self._loop = EngineLoop(self.engine)
        log.info("kvsession: %s on %s, kv %s: %d blocks x %d tokens = %d tokens, %d bytes/token",
                 spec.architecture, cfg.device, cfg.kv_cache_dtype_name, num_blocks,
                 cfg.block_size, num_blocks * cfg.block_size, bpt)

    # ---- the engine thread ---------------------------------------------------------------

    def _schedule(self, fn: Callable[[], None]) -> None:
        """Run fn on the engine thread when it runs (any thread; the prefill connector
        asks for its polls this way)."""
        loop = self._loop
        if loop is not None:
            loop.call(fn)

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

    def set_slo(self, slo: SLO) -> None:
        """`llm.slo = ...`: the targets stats() measures against, and the ones the
        scheduler's chunking keeps (engine/slo_chunking.py) from the next step on."""
        self.slo = slo
        self.call(partial(self.slo_chunking.set_target, slo.ttft_s, slo.tpot_s)).result()

    def submit(self, seq: Sequence, on_update: OnUpdate | None = None,
               prepare: Callable[[], Generator[Future, None, None] | None] | None = None
               ) -> Future:
        return self.check_open().submit(seq, on_update=on_update, prepare=prepare)

    def call_steps(self, fn: Callable[[], Generator[Future, None, object]]) -> Future:
        """Run the generator `fn()` on the engine thread, which keeps stepping while it
        waits on the Futures it yields (EngineLoop.call_steps)."""
        return self.check_open().call_steps(fn)

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
        if self.integrity.checking and loop.failure is None:
            try:
                loop.call(self.integrity.at_rest).result(timeout=60)
            except AssertionError:  # (recorded: raised below)
                pass
            except EngineClosedError:  # the engine thread died meanwhile: checked below
                pass
        loop.close()
        self._loop = None
        if self.integrity.checking and loop.failure is not None and not loop.alive:
            with contextlib.suppress(AssertionError):  # (recorded: raised below)
                self.integrity.at_rest()  # the engine thread is gone: its state is ours
        if self.connector is not None:
            self.connector.close()
        if self.writeback is not None:
            self.writeback.close()
        if self.journal is not None:
            self.journal.close()
        if self.mirror is not None:
            self.mirror.close()
        self.mover.copier.close()
        if self.objects is not None:
            self.objects.close()  # what was queued is stored (bounded)
        if self.disk_cache is not None:
            self.disk_cache.close()
        self.kv_pool = None
        if self.integrity.failure is not None:
            raise self.integrity.failure

    def stats(self) -> Stats:
        """llm.stats(): the counters on the engine thread, the disk's room on this one."""
        st = self.call(lambda: self.stats_collector.now(self.slo)).result()
        return self.stats_collector.add_disk_room(st)


def open_disk_cache(cfg: EngineConfig, kv_pool: KVPool,
                    identity: StorageIdentity) -> DiskCache | None:
    """The disk tier's cache in session_dir when `disk_cache_memory` asks for one; None
    (logged) when another process owns the directory's cache: this one runs without."""
    if not cfg.disk_cache_memory_bytes or cfg.session_dir is None:
        return None
    try:
        cache = DiskCache(cfg.session_dir, kv_pool.tensors(), cfg.block_size,
                          identity.header_fields(), cfg.disk_cache_memory_bytes)
    except DiskCacheBusy as e:
        log.warning("%s: running without a disk cache", e)
        return None
    if cache.num_blocks == 0:
        cache.close()
        return None
    return cache


def open_object_store(cfg: EngineConfig, kv_pool: KVPool,
                      identity: StorageIdentity) -> ObjectCache | None:
    """The object-store tier when `object_store` names one (ConfigError when it cannot be
    opened: obstore missing, a URL or options the store refuses)."""
    if cfg.object_store is None:
        return None
    records = BlockRecords(kv_pool.tensors(), cfg.block_size, identity.header_fields())
    return ObjectCache(cfg.object_store.url, cfg.object_store.options, records,
                       cfg.object_store.memory_bytes)
