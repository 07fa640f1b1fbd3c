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
import queue
import threading
from collections.abc import Callable
from concurrent.futures import Future

import torch

log = logging.getLogger("kvsession")
# how long close() waits for the copies already submitted
CLOSE_TIMEOUT_S = 60.0


class Copier:
    def __init__(self, device: torch.device):
        self.stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name="kvsession-copier",
                                        daemon=True)
        self._thread.start()

    def submit(self, fn: Callable[..., object], *args) -> Future:
        fut: Future = Future()
        self._queue.put((fut, fn, args))
        return fut

    def _run(self) -> None:
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

    def close(self, timeout_s: float = CLOSE_TIMEOUT_S) -> None:
        self._queue.put(None)
        self._thread.join(timeout_s)
        if self._thread.is_alive():
            log.error("the copier thread did not stop within %.0f s", timeout_s)
