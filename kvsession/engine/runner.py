"""The model runner: turns a scheduled batch into tensors + AttentionMetadata, runs the
model, and returns logits for the sequences that sample this step."""

from __future__ import annotations

import ctypes
import enum
import statistics
import time
from collections import deque

import torch

from kvsession.attention import AttentionMetadata
from kvsession.cache.kv_pool import KVPool
from kvsession.config import AttentionBackend
from kvsession.engine.graphs import DecodeGraphs
from kvsession.engine.scheduler import ScheduledSeq
from kvsession.kernels.reference import Workspace
from kvsession.model.llama import LlamaModel


def release_openmp_workers() -> bool:
    """Free the OpenMP worker threads the calling thread owns (OpenMP 5's
    `omp_pause_resource_all`, through the OpenMP runtime torch loaded); they are created
    again if this thread runs a parallel region later. Returns whether it was done.

    Why: libgomp keeps each thread's workers for good, and once the workers of all threads
    outnumber the cores it stops spin-waiting (100 spins instead of ~300,000): every
    parallel region then wakes its workers from sleep, ~50-70 us each on this VM, against
    ~10 us. Building the runtime runs parallel regions on the caller's thread (weights, the
    KV pool), so the engine thread's own workers would push the count over and make every
    2-thread decode step ~2x slower (measured: 12 ms on a second thread vs 6 ms). Releasing
    the builder's workers keeps the engine's regions at full speed as long as no other
    thread runs parallel torch work; when one does, the ThreadGovernor measures it."""
    for line in open("/proc/self/maps"):
        path = line.split()[-1]
        if "libgomp" in path or "libiomp" in path:
            lib = ctypes.CDLL(path)  # already loaded: the same handle torch uses
            pause = getattr(lib, "omp_pause_resource_all", None)
            return pause is not None and pause(2) == 0  # 2: omp_pause_hard
    return False


class StepKind(enum.Enum):
    DECODE = "decode"
    PREFILL = "prefill"


def step_kind(batch: list[ScheduledSeq]) -> tuple:
    """The ThreadGovernor's kind of a step: decode by batch size and by the context its
    attention reads (total cached tokens, to a power of two), prefill by token count.
    Context counts for decode: a 2,048-token step reads ~20% more than a 128-token one (the
    bench model) and its attention scales with threads differently, so one estimate for both
    compared a one-thread probe at one length with two-thread steps at another."""
    tokens = sum(i.num_new_tokens for i in batch)
    if tokens == len(batch):
        context = sum(i.seq.num_computed_tokens for i in batch)
        return StepKind.DECODE, len(batch), context.bit_length()
    return StepKind.PREFILL, tokens.bit_length()


class ThreadGovernor:
    """The engine thread's CPU thread count (intra-op: OpenMP, MKL, oneDNN), chosen per kind
    of step from measured step times.

    All cores streaming weights make a decode step fastest on an otherwise idle machine (the
    bench model's batch-1 step: ~5.5 ms on 2 threads, ~6.6 ms on 1, where one core's reads
    reach ~80% of two cores' bandwidth; 7 vs 13 ms before the one-row decode region). But
    OpenMP threads spin-wait, and a parallel region ends only when its slowest thread does:
    as soon as anything else wants a core (the callers' Python, the tokenizer, another
    process), one thread waits on a preempted partner while the other burns CPU. Measured
    on the 2-core bench machine: the same step at 15-190 ms on 2 threads with twice the
    process CPU, against 13-20 ms on 1, and whole agent-workload runs landing in a fast or a
    slow mode.
    Passive waiting is no cure there: waking a sleeping thread costs milliseconds on this
    VM, so it is as slow as one thread. Neither count wins everywhere, so the engine
    measures: each kind of step (`step_kind`: decode at a batch size and context length, or
    prefill by token count) runs at the count with the lower recent time (the median of its
    last few steps; all cores until one thread has been tried), and now and then a couple of
    steps try the other count, so that the choice follows the machine's load. Probes get
    rarer while they keep confirming a clear choice, and come soon again when the choice
    changes. (An exponential average took one slow two-thread step, common on this VM, for
    a change: the engine then ran on one thread until the next probe, up to 256 steps.)

    Changing the count is not free (the first parallel region after going back to more
    threads took ~6 ms here): a short step right after a change is not measured. A step's float
    rounding can depend on the thread count (MKL splits long dot products across threads),
    as it already depends on the batch a sequence shares a step with."""

    PROBE_EVERY = (16, 256)  # steps of a kind between probes: first, and at most
    PROBE_STEPS = 2          # a probe: one step to settle, one measured
    WINDOW = 5               # step times kept per kind and count: the estimate is their median
    CLEAR = 1.3              # a choice this much faster makes probes rarer
    SWITCH_S = 0.006         # what a change of count can add to the next step

    def __init__(self, max_threads: int):
        self.counts = (max_threads, 1)
        self.recent: dict[tuple, dict[int, deque[float]]] = {}  # the latest step times
        self.due: dict[tuple, list[int]] = {}  # [steps until the next probe, interval]
        self.chosen: dict[tuple, int] = {}  # each kind's count outside probes
        self.current = max_threads
        self.settling = False  # the coming step follows a change of count
        self.used = dict.fromkeys(self.counts, 0)  # steps run at each count (stats)

    def choose(self, key: tuple) -> int:
        """The count for the coming step of this kind: the faster one so far (all cores
        until the other has been tried), or the other one during a probe. When the faster
        one changes, the count left behind is probed again soon (its times are old)."""
        # a median, not an average: one slow step on a noisy machine must not move the choice
        known = {c: statistics.median(times)
                 for c, times in self.recent.setdefault(key, {}).items()}
        due = self.due.setdefault(key, [self.PROBE_EVERY[0], self.PROBE_EVERY[0]])
        best = min(known, key=known.__getitem__) if known else self.counts[0]
        if self.chosen.setdefault(key, best) != best:
            self.chosen[key] = best
            due[:] = [self.PROBE_EVERY[0], self.PROBE_EVERY[0]]
        other = next(c for c in self.counts if c != best)
        due[0] -= 1
        threads = best
        if due[0] < 0:
            threads = other
            if due[0] == -self.PROBE_STEPS:  # probe done: the next one sooner or later
                clear = other in known and known[other] > self.CLEAR * known[best]
                due[1] = min(2 * due[1], self.PROBE_EVERY[1]) if clear else self.PROBE_EVERY[0]
                due[0] = due[1]
        self.settling = threads != self.current
        self.current = threads
        return threads

    def record(self, key: tuple, threads: int, seconds: float) -> None:
        self.used[threads] += 1
        if self.settling and seconds < 20 * self.SWITCH_S:  # the change would weigh in
            return
        self.recent[key].setdefault(threads, deque(maxlen=self.WINDOW)).append(seconds)


class ModelRunner:
    def __init__(self, model: LlamaModel, kv: KVPool, device: torch.device,
                 backend: AttentionBackend):
        self.model, self.kv_pool, self.device, self.backend = model, kv, device, backend
        self.workspace = Workspace()
        self.graphs: DecodeGraphs | None = None  # set on CUDA with the Triton kernels
        # on CPU with several threads: the thread count is measured per kind of step; the
        # count torch is set to when the runner is built is the most it uses
        threads = torch.get_num_threads()
        self.governor = ThreadGovernor(threads) if device.type == "cpu" and threads > 1 \
            else None
        if self.governor is not None:  # built on the caller's thread: drop its workers
            release_openmp_workers()

    def prepare(self, batch: list[ScheduledSeq]) -> tuple[torch.Tensor, torch.Tensor,
                                                          AttentionMetadata, list[int]]:
        """(input_ids, positions, metadata, rows whose hidden state is sampled).

        Built from Python lists with one tensor per field: a decode step's model work is a
        few milliseconds on CPU, and a handful of small tensor ops per sequence (what a
        per-sequence arange/index/cat costs) would be a visible part of it."""
        bs = self.kv_pool.block_size
        ids, pos, slots, starts, seq_lens, sample_rows, tables = [], [], [], [0], [], [], []
        for item in batch:
            seq, start = item.seq, item.seq.num_computed_tokens
            end = start + item.num_new_tokens
            table = seq.block_ids
            ids += seq.token_ids[start:end - item.num_draft_tokens]
            ids += seq.draft_token_ids[:item.num_draft_tokens]
            pos += range(start, end)
            slots += [table[p // bs] * bs + p % bs for p in range(start, end)]
            tables.append(table)
            starts.append(starts[-1] + item.num_new_tokens)
            seq_lens.append(end)
            # a verifying sequence samples at its last token and at each draft
            sample_rows += range(starts[-1] - item.num_rows, starts[-1])
        width = max(len(t) for t in tables)
        dev, long = self.device, torch.long
        meta = AttentionMetadata(
            slot_mapping=torch.tensor(slots, dtype=long, device=dev),
            block_tables=torch.tensor([t + [-1] * (width - len(t)) for t in tables],
                                      dtype=long, device=dev),
            query_start_loc=starts,
            seq_lens=seq_lens,
            seq_lens_tensor=torch.tensor(seq_lens, dtype=long, device=dev),
            decode_only=all(item.num_new_tokens == 1 for item in batch),
            softmax_scale=self.model.softmax_scale,
            backend=self.backend,
            workspace=self.workspace,
            query_start_loc_tensor=torch.tensor(starts, dtype=long, device=dev),
            max_query_len=max(item.num_new_tokens for item in batch),
            on_layer_done=self._layer_hook(batch),
            all_slots_valid=True,  # every token of the batch is stored
        )
        return (torch.tensor(ids, dtype=long, device=dev), torch.tensor(pos, dtype=long,
                device=dev), meta, sample_rows)

    @staticmethod
    def _layer_hook(batch: list[ScheduledSeq]):
        hooks = [i.seq.on_layer_done for i in batch if i.seq.on_layer_done and i.samples]
        if not hooks:
            return None

        def done(layer: int) -> None:
            for hook in hooks:
                hook(layer)
        return done

    def run(self, batch: list[ScheduledSeq]) -> torch.Tensor:
        """Run one step; float32 logits [rows, vocab] in batch order: a row per sampling
        sequence, 1 + its drafts for one that verifies drafts (ScheduledSeq.num_rows)."""
        if self.graphs is not None and all(i.num_new_tokens == 1 and i.samples for i in batch) \
                and self.graphs.bucket(len(batch)) is not None:
            bs = self.kv_pool.block_size
            pos = [i.seq.num_computed_tokens for i in batch]
            return self.graphs.run(
                [i.seq.token_ids[p] for i, p in zip(batch, pos, strict=True)], pos,
                [i.seq.blocks[p // bs].block_id * bs + p % bs
                 for i, p in zip(batch, pos, strict=True)],
                [i.seq.block_ids for i in batch])
        if self.governor is None:
            return self._run(batch)
        key = step_kind(batch)
        threads = self.governor.choose(key)
        if threads != torch.get_num_threads():
            torch.set_num_threads(threads)  # this thread's OpenMP and MKL thread counts
        t = time.perf_counter()
        logits = self._run(batch)
        self.governor.record(key, threads, time.perf_counter() - t)
        return logits

    def _run(self, batch: list[ScheduledSeq]) -> torch.Tensor:
        input_ids, positions, meta, rows = self.prepare(batch)
        return self.model.step_logits(input_ids, positions, self.kv_pool, meta, rows)
