"""The copier: one thread that runs tier copies (a spilled session's blocks coming back from
the host or from its files) off the engine thread, so the batch keeps decoding meanwhile.

Concurrency contract:
- The engine thread decides and books (allocates the destination blocks, records the
  placement afterwards); the copier only moves bytes, into blocks that a `Transient` holder
  references and that nothing else reads or writes until the copy is settled, from host
  blocks or files that the session holding them keeps (it is busy: nothing moves it).
- `submit` is called on the engine thread and returns a Future; the copy's result or
  exception lands there, and the engine thread settles the copy when it sees the Future
  done (a continuation posted to it, or a bounded wait). Nothing else crosses threads.
- On CUDA the copies are issued on the copier's own stream, synchronized before the Future
  completes: they overlap the engine's kernels instead of queueing behind them.
- `close` stops the thread after the copies already submitted (bounded: a copy that never
  returns cannot hang close; the thread is a daemon).
"""

from __future__ import annotations

import contextlib
import logging
import os
import queue
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from typing import Protocol

import torch

log = logging.getLogger("kvsession")
# how long close() waits for the copies already submitted
CLOSE_TIMEOUT_S = 60.0
# the copier's CPU priority (a nice value): on a machine whose cores the decode's threads
# fill, the scheduler gives a copy the time they leave. Measured (bench/restore_overlap.py,
# 2 cores): a 6k-token disk restore at nice 0 made the decode steps around it 30-40 ms
# against 12 ms; at nice 10, 12-20 ms
COPIER_NICE = 10
# while the engine has sequences to run, a copy sleeps this many times as long as it worked,
# between blocks (`pace`): the memory bandwidth a decode step needs is shared with the copy,
# which nice cannot divide. Measured (same benchmark, medians of 3 rounds): the worst decode
# gap during a 6k-token restore / the step was 2.8x unpaced (restore 0.3-1.0 s), 2.3x at 0.5
# (0.35-1.5 s), 2.0x at 1.0 (1.6-2.0 s); 0.5 halves the excess for a restore that the
# session's own turn waits on
PACE_RATIO = 0.5


class Contention(Protocol):
    """Whether the engine has sequences to run (the scheduler): a copy paces itself only
    then."""

    def has_work(self) -> bool: ...


class Copier:
    def __init__(self, device: torch.device, contention: Contention | None = None):
        """contention: read from the copier thread (a heuristic: a stale answer only
        paces one block more or less)."""
        self.contention = contention
        self.stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._mark: float | None = None  # pace(): when the copy last resumed work
        self._thread = threading.Thread(target=self._run, name="kvsession-copier",
                                        daemon=True)
        self._thread.start()

    @property
    def own_engine(self) -> bool:
        """Whether its copies run beside the engine's compute rather than on the cores and
        the memory bus a step uses (a CUDA stream: the GPU's copy engines). Only then is a
        copy that may turn out unneeded (a copy ahead of eviction) free."""
        return self.stream is not None

    def submit(self, fn: Callable[..., object], *args) -> Future:
        fut: Future = Future()
        self._queue.put((fut, fn, args))
        return fut

    def _run(self) -> None:
        with contextlib.suppress(OSError, AttributeError):
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), COPIER_NICE)
        while True:
            item = self._queue.get()
            if item is None:
                return
            fut, fn, args = item
            if not fut.set_running_or_notify_cancel():
                continue
            try:
                ctx = torch.cuda.stream(self.stream) if self.stream is not None \
                    else contextlib.nullcontext()
                with ctx:
                    result = fn(*args)
                if self.stream is not None:
                    self.stream.synchronize()
            except BaseException as e:  # noqa: BLE001 - it belongs to the Future's owner
                fut.set_exception(e)
            else:
                fut.set_result(result)

    def pace(self) -> None:
        """Copier thread, between two blocks of a copy: while the engine has work, sleep
        PACE_RATIO times as long as the copy worked since the previous call (the first call
        of a copy only starts the clock: `start_pacing`)."""
        now = time.perf_counter()
        if self._mark is not None and self.contention is not None \
                and self.contention.has_work():
            time.sleep((now - self._mark) * PACE_RATIO)
        self._mark = time.perf_counter()

    def start_pacing(self) -> None:
        self._mark = None

    def close(self, timeout_s: float = CLOSE_TIMEOUT_S) -> None:
        self._queue.put(None)
        self._thread.join(timeout_s)
        if self._thread.is_alive():
            log.error("the copier thread did not stop within %.0f s", timeout_s)
