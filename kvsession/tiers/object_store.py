"""The object-store tier: KV blocks in an object store (S3, GCS, Azure, MinIO, a local
directory; through `obstore`), below the host tier and the disk cache, shared by every
process that names the same store: a prefix one machine computed is loaded by another.

Objects are content-addressed: `<prefix>/kv/<identity>/<block hash>`, where identity is the
digest of what stored KV is valid under (model, tokenizer, template, KV dtype, block size,
geometry) and the hash is the block's chained hash, so two engines that could not share KV
never name the same object. An object is one block's record (tiers/block_record.py),
verified when it is read (identity, hash, tokens, checksums): a foreign, damaged or missing
object is a miss (the rest of the prompt is computed), never wrong KV and never an error.

What goes there: content used more than once (the tier policy's `DISK_ADMIT_HITS`), when a
prompt finds it on the device again (other processes find it while this one holds it),
and, if it is not there yet, as the device or the host evicts it; whether or not a disk
cache keeps it too; with its cached ancestors the store lacks (another process finds a run
only from its first miss). The engine thread encodes the record (one memory copy of the
block) and queues it; the uploader thread puts it. The queue is bounded
(UPLOAD_QUEUE_BLOCKS): what does not fit is not stored (a later miss recomputes it).
`object_store_memory` bounds this identity's objects in the store, every process's: what
this process wrote is kept within it as it writes (its least recently used deleted beyond
it), and every listing deletes the oldest objects beyond it, whoever wrote them (`_trim`).

What is there: `known`, the hashes this process wrote or saw listed. The store's objects of
this identity are listed at start-up (before the first request), and again by the uploader
every LIST_INTERVAL_S (at least ten times the last listing's duration), so blocks other
processes wrote are found by a lookup on the engine thread without a request to the store.
A block listed but gone since is a miss when it is read.

Concurrency: `lookup_run`, `has`, `offer` run on the engine thread, `flush` and `close` on
its owner's (the runtime's, at close);
`load` on the copier; the uploader thread puts, deletes and lists. `known` and the
counters are under `_lock`; nothing else is shared. Every request to the store is bounded
(the client's timeouts and retries: REQUEST_TIMEOUT_S, CONNECT_TIMEOUT_S, MAX_RETRIES), and
a load waits for its reads at most LOAD_WAIT_S; a store that is down, slow or failing makes
loads miss and uploads drop, and is logged, with no credential in any message. After a
failure, lookups find nothing there for a back-off (BACKOFF_S, doubling, reset by a
listing that succeeds), so a dead store costs one load's wait per period.
"""

from __future__ import annotations

import logging
import queue
import re
import threading
import time
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from datetime import timedelta

import torch

from kvsession.costmodel import RateEstimator
from kvsession.errors import ConfigError
from kvsession.tiers.block_record import BlockRecords

log = logging.getLogger("kvsession")

SCHEMES = ("s3://", "s3a://", "gs://", "az://", "azure://", "abfs://", "abfss://",
           "file://", "memory://", "http://", "https://")
# one request's bounds: a store that does not answer costs a load at most about
# (MAX_RETRIES + 1) x REQUEST_TIMEOUT_S, after which it is a miss and the prompt is computed
REQUEST_TIMEOUT_S, CONNECT_TIMEOUT_S, MAX_RETRIES, RETRY_TIMEOUT_S = 10, 2, 2, 15
LOAD_WAIT_S = (MAX_RETRIES + 1) * REQUEST_TIMEOUT_S + 5
# reads of one load in flight at once: a store's latency (tens of ms on S3) is paid once
# per load instead of once per block
GET_CONCURRENCY = 8
# records waiting for the uploader (a burst beyond it is not stored: a cache, not data)
UPLOAD_QUEUE_BLOCKS = 1024
# how often what other processes wrote is listed again (at least 10x the listing's time)
LIST_INTERVAL_S = 5.0
# the store's round trip until one is timed (S3 in the same region: tens of ms)
LATENCY_PRIOR_S = 0.05
# after a request to the store fails, lookups find nothing there for this long, doubled on
# each failure up to the max and reset by a listing that succeeds: a store that is down or
# timing out costs one load's wait per period, not every request's
BACKOFF_S, MAX_BACKOFF_S = 2.0, 60.0
# options obstore takes as its HTTP client's (the rest configure the store itself)
CLIENT_KEYS = frozenset({
    "allow_http", "allow_invalid_certificates", "connect_timeout", "default_content_type",
    "default_headers", "http1_only", "http2_keep_alive_interval", "http2_keep_alive_timeout",
    "http2_keep_alive_while_idle", "http2_only", "pool_idle_timeout",
    "pool_max_idle_per_host", "proxy_url", "proxy_ca_certificate", "proxy_excludes",
    "root_certificate", "randomize_addresses", "read_timeout", "timeout", "user_agent"})
# option names whose values are secrets: scrubbed from every message
_SECRET = re.compile(r"secret|key|token|password|credential|sas|signature", re.IGNORECASE)
_HEX = re.compile(r"[0-9a-f]+")


def public_url(url: str) -> str:
    """The URL without any user:password part (what messages name)."""
    return re.sub(r"^([a-z0-9+.-]+://)[^/@]*@", r"\1", url, flags=re.IGNORECASE)


def is_url(value) -> bool:
    """Whether a session_dir (or object_store) names a store rather than a directory."""
    return isinstance(value, str) and "://" in value


def check_url(url, name: str = "object_store") -> str:
    if not isinstance(url, str) or not url.lower().startswith(SCHEMES):
        shown = public_url(url) if isinstance(url, str) else type(url).__name__
        raise ConfigError(f"{name} must be a URL starting with one of "
                          f"{', '.join(SCHEMES)}; got {shown!r}")
    return url


def check_options(options) -> dict:
    if options is None:
        return {}
    if not isinstance(options, dict) or not all(isinstance(k, str) for k in options):
        raise ConfigError("object_store_options must be a dict of option names (str) to "
                          "values")
    return dict(options)


class Scrubber:
    """Replaces the secret option values in a message (obstore's errors may quote a
    request; an option's value never reaches a log, an error or a snapshot)."""

    def __init__(self, options: dict):
        self.secrets = [str(v) for k, v in options.items()
                        if _SECRET.search(k) and v is not None and len(str(v)) >= 4]

    def __call__(self, message: object) -> str:
        text = str(message)
        for s in self.secrets:
            text = text.replace(s, "***")
        return text.splitlines()[0][:300] if text else text


def open_store(url: str, options: dict, name: str = "object_store"):
    """An obstore store for `url` with `options` (the store's own config keys, and its
    HTTP client's: CLIENT_KEYS), requests bounded by this module's timeouts and retries.
    Raises ConfigError when obstore is missing or the URL and options are refused."""
    try:
        from obstore.store import from_url
    except ImportError:
        raise ConfigError("object_store needs the obstore package: pip install "
                          "'kvsession[objectstore]'") from None
    scheme = url.split("://", 1)[0].lower()
    scrub = Scrubber(options)
    try:
        if scheme in ("file", "memory"):
            if options:
                raise ConfigError(f"object_store_options do not apply to {scheme}:// stores")
            return from_url(url, mkdir=True) if scheme == "file" else from_url(url)
        client = {"timeout": f"{REQUEST_TIMEOUT_S}s", "connect_timeout": f"{CONNECT_TIMEOUT_S}s"}
        config = {}
        for k, v in options.items():
            (client if k in CLIENT_KEYS else config)[k] = v
        retry = {"max_retries": MAX_RETRIES, "retry_timeout": timedelta(seconds=RETRY_TIMEOUT_S)}
        return from_url(url, config=config, client_options=client, retry_config=retry)
    except ConfigError:
        raise
    except Exception as e:  # noqa: BLE001 - obstore raises several kinds for bad config
        raise ConfigError(f"{name}={public_url(url)!r}: {scrub(e)}") from None


class ObjectCache:
    def __init__(self, url: str, options: dict, records: BlockRecords, budget_bytes: int,
                 list_interval_s: float = LIST_INTERVAL_S):
        """records: this engine's block record layout (its identity names the objects).
        budget_bytes: the most the store keeps of this identity (`object_store_memory`).
        Raises ConfigError (see `open_store`)."""
        self.store = open_store(url, options)
        import obstore

        self.obs, self.records, self.url = obstore, records, public_url(url)
        self.scrub = Scrubber(options)
        self.prefix = f"kv/{records.identity.hex()}/"
        self.budget_blocks = budget_bytes // records.record_bytes
        self.list_interval_s = list_interval_s
        self._lock = threading.Lock()
        # hashes found there: written by this process, or listed
        self.known: set[bytes] = set()
        # hashes queued for the uploader (offered once)
        self.pending: set[bytes] = set()
        # what this process wrote, least recently used first (the budget deletes from here)
        self.written: OrderedDict[bytes, None] = OrderedDict()
        # counters (llm.stats().tiers["object"])
        self.hit_tokens = self.bytes_read = self.bytes_written = 0
        self.errors = self.dropped_blocks = 0
        # lookups find nothing before this (time.monotonic()), after failures
        self.down_until, self.backoff_s = 0.0, BACKOFF_S
        # seconds a request waits for the store's first byte (what every load pays once):
        # timed by each listing's probe and by every load (the mover), so the cost model
        # knows a fast store before its first load (a prior alone could keep a store on
        # this host from ever being tried)
        self.latency = RateEstimator(prior=LATENCY_PRIOR_S)
        self.uploads: queue.Queue = queue.Queue(UPLOAD_QUEUE_BLOCKS)
        self.readers = ThreadPoolExecutor(GET_CONCURRENCY, thread_name_prefix="kvs-object-get")
        self._closing = threading.Event()
        # what is there at start-up, listed before the first request (bounded by the
        # client's timeouts; a store that does not answer is logged and listed again later)
        self.list_s = self._list()  # (and the first round trip timed: `latency`)
        self.uploader = threading.Thread(target=self._upload_loop, name="kvs-object-put",
                                         daemon=True)
        self.uploader.start()

    def key(self, block_hash: bytes) -> str:
        return self.prefix + block_hash.hex()

    # ---- engine thread -------------------------------------------------------------------

    def has(self, block_hash: bytes) -> bool:
        """Whether the block is known there, or queued to be put there."""
        with self._lock:
            return block_hash in self.known or block_hash in self.pending

    def lookup_run(self, hashes: list[bytes], start: int, end: int) -> list[bytes]:
        """The hashes of blocks start.. (before end) known to be there, up to the first
        that is not; none while the store is backed off after a failure. Makes no request
        (a hit is verified when it is read)."""
        run = []
        with self._lock:
            if time.monotonic() < self.down_until:
                return run
            for h in hashes[start:end]:
                if h not in self.known:
                    break
                run.append(h)
        return run

    def offer(self, src: dict[str, torch.Tensor], entries: list[tuple[int, bytes, tuple,
                                                                     bytes | None, int]]) -> int:
        """Queue blocks of `src` (tensors laid out as the pool's) for the uploader: entries
        are (block id, hash, token ids, parent hash, hits), as `DiskCache.store` takes.
        Blocks already there are skipped; what the queue has no room for is dropped.
        Returns how many were queued."""
        queued = 0
        for block_id, block_hash, tokens, parent, hits in entries:
            if self.has(block_hash):
                continue
            record = self.records.encode(src, block_id, block_hash, tokens, parent, 0, hits)
            with self._lock:
                self.pending.add(block_hash)
            try:
                self.uploads.put_nowait((block_hash, record))
            except queue.Full:
                with self._lock:
                    self.pending.discard(block_hash)
                    self.dropped_blocks += 1
                continue
            queued += 1
        return queued

    def flush(self, timeout_s: float) -> bool:
        """Wait (at most timeout_s) until what was queued before this call is stored.
        Returns whether it was."""
        done = threading.Event()
        try:
            self.uploads.put(done, timeout=timeout_s)
        except queue.Full:
            return False
        return done.wait(timeout_s)

    def close(self, timeout_s: float = 10.0) -> None:
        """Store what is queued (waiting at most timeout_s), then stop the threads."""
        if self._closing.is_set():
            return
        self.flush(timeout_s)
        self._closing.set()
        try:
            self.uploads.put_nowait(None)  # wakes the uploader
        except queue.Full:
            pass
        self.uploader.join(timeout_s)
        self.readers.shutdown(wait=False, cancel_futures=True)

    # ---- the copier ------------------------------------------------------------------------

    def load(self, hashes: list[bytes], token_ids: list[tuple], dst: dict[str, torch.Tensor],
             dst_ids: list[int]) -> tuple[int, float]:
        """Read the objects of `hashes` (block i over token_ids[i]) into blocks `dst_ids` of
        `dst`, every one checked before its bytes are used; the reads run GET_CONCURRENCY at
        a time. Returns how many leading blocks were loaded (a missing, damaged or foreign
        object, or the store failing, ends the run there: the caller computes the rest)
        and the seconds until the first object arrived (the store's latency)."""
        t0 = time.perf_counter()
        reads = [self.readers.submit(self._get, self.key(h)) for h in hashes]
        first_s = 0.0
        loaded = 0
        try:
            for j, (h, fut) in enumerate(zip(hashes, reads, strict=True)):
                try:
                    raw = fut.result(timeout=LOAD_WAIT_S)
                except FutureTimeout:
                    raw = None
                    self._failed(f"reading {self.key(h)} took over {LOAD_WAIT_S} s")
                if j == 0:
                    first_s = time.perf_counter() - t0
                if raw is None:
                    break  # the store failed: the block is likely still there
                payload = self.records.check(raw, h, token_ids[j]) if raw else None
                if payload is None:
                    with self._lock:
                        self.known.discard(h)  # gone, or never to be used: forgotten
                    if raw:
                        log.warning("object store %s: %s is damaged or foreign; computing "
                                    "from there", self.url, self.key(h))
                    break
                self.records.copy_into(payload, dst, dst_ids[j])
                loaded += 1
                with self._lock:
                    self.bytes_read += len(raw)
                    self.hit_tokens += self.records.block_size
                    if h in self.written:
                        self.written.move_to_end(h)
        finally:
            for fut in reads[loaded + 1:]:
                fut.cancel()
        return loaded, first_s

    def _get(self, key: str) -> bytearray | None:
        """The object's bytes; empty when there is no such object (deleted since it was
        listed); None when the store failed."""
        try:
            data = self.obs.get(self.store, key).bytes()
        except FileNotFoundError:
            return bytearray()
        except Exception as e:  # noqa: BLE001 - the store failing is a miss
            self._failed(f"reading {key}: {e}")
            return None
        # writable (the payload is viewed as tensors); one copy, beside a network read
        return bytearray(memoryview(data))

    def _failed(self, what: str) -> None:
        with self._lock:
            self.errors += 1
            n = self.errors
            self.down_until = time.monotonic() + self.backoff_s
            self.backoff_s = min(self.backoff_s * 2, MAX_BACKOFF_S)
        if n <= 3 or n % 100 == 0:  # a store that is down fails every request
            log.warning("object store %s: %s (%d errors)", self.url, self.scrub(what), n)

    # ---- the uploader --------------------------------------------------------------------

    def _upload_loop(self) -> None:
        next_list = time.monotonic() + max(self.list_interval_s, 10 * self.list_s)
        while not self._closing.is_set():
            now = time.monotonic()
            if now >= next_list:
                took = self._list()
                next_list = time.monotonic() + max(self.list_interval_s, 10 * took)
            try:
                item = self.uploads.get(timeout=max(0.0, next_list - time.monotonic()))
            except queue.Empty:
                continue
            if isinstance(item, threading.Event):
                item.set()
            elif item is not None:
                self._put(*item)

    def _put(self, block_hash: bytes, record: bytes) -> None:
        with self._lock:
            if block_hash in self.known:
                self.pending.discard(block_hash)
                return
        try:
            self.obs.put(self.store, self.key(block_hash), record)
        except Exception as e:  # noqa: BLE001 - not stored: a later miss recomputes
            with self._lock:
                self.pending.discard(block_hash)
            self._failed(f"writing {self.key(block_hash)}: {e}")
            return
        with self._lock:
            self.pending.discard(block_hash)
            self.known.add(block_hash)
            self.written[block_hash] = None
            self.bytes_written += len(record)
            over = max(0, len(self.written) - self.budget_blocks)
            victims = [self.written.popitem(last=False)[0] for _ in range(over)]
            self.known.difference_update(victims)
        for h in victims:
            try:
                self.obs.delete(self.store, self.key(h))
            except Exception as e:  # noqa: BLE001 - left there: another process's cache
                self._failed(f"deleting {self.key(h)}: {e}")

    def _list(self) -> float:
        """Learn what is there (other processes' blocks), time a round trip (`_probe`) and
        keep the store's objects of this identity within the budget (`_trim`); returns the
        seconds the listing took."""
        t0 = time.monotonic()
        found: dict[bytes, tuple] = {}  # hash -> (last modified, key): the trim's order
        try:
            for batch in self.obs.list(self.store, self.prefix, chunk_size=1000):
                for meta in batch:
                    name = meta["path"].rsplit("/", 1)[-1]
                    if _HEX.fullmatch(name) and len(name) % 2 == 0 and \
                            meta["size"] == self.records.record_bytes:
                        found[bytes.fromhex(name)] = (meta["last_modified"], name)
        except Exception as e:  # noqa: BLE001 - listed again later
            self._failed(f"listing {self.prefix}: {e}")
            return time.monotonic() - t0
        took = time.monotonic() - t0
        self._probe()
        victims = self._trim(found)
        with self._lock:
            # what was listed, and this process's own (written after the listing began)
            self.known = (set(found) - victims) | (set(self.written) - victims)
            for h in victims:
                self.written.pop(h, None)
            self.down_until, self.backoff_s = 0.0, BACKOFF_S  # it answers again
        return took

    def _probe(self) -> None:
        """Time one round trip: a HEAD of an object that is never there (its 404 carries
        nothing but the store's latency)."""
        t0 = time.monotonic()
        try:
            self.obs.head(self.store, f"{self.prefix}probe")
        except FileNotFoundError:
            self.latency.observe(time.monotonic() - t0, 1.0)
        except Exception:  # noqa: BLE001 - untimed; the listing just answered
            pass

    def _trim(self, found: dict[bytes, tuple]) -> set[bytes]:
        """The budget over every process: where the listing holds more than
        `budget_blocks` objects of this identity, the oldest written are deleted (ties in
        key order; every process that lists computes the same set, so their deletes
        agree). Reads do not refresh an object's age (the store keeps none): a block still
        in use is put again by a process that evicts it after its reuse. Returns the
        hashes deleted (or tried: one that failed is left there, and forgotten here)."""
        over = len(found) - self.budget_blocks
        if over <= 0:
            return set()
        victims = sorted(found, key=found.__getitem__)[:over]
        keys = [self.key(h) for h in victims]
        for i in range(0, len(keys), 1000):  # (a bulk delete takes up to 1000)
            try:
                self.obs.delete(self.store, keys[i:i + 1000])
            except FileNotFoundError:
                pass  # another process deleted them first
            except Exception as e:  # noqa: BLE001 - left there; deleted at a later listing
                self._failed(f"deleting {len(keys[i:i + 1000])} objects beyond "
                             f"object_store_memory: {e}")
        return set(victims)
