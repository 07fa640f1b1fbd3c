"""Aligned appends with O_DIRECT: how the write-behind writes KV segments (tiers/writeback.py).

Why not the page cache: a buffered write costs the writing thread a kernel copy per byte
into the page cache, and on the 2-core CI machine that cost varied ~10x from one run to the
next (0.14 to 1.6 s of CPU for 512 MiB, with nothing else changed), all of
it taken from the cores the engine computes on. The same appends with O_DIRECT ran at the
disk's speed for ~0.03 s of CPU, every time (docs/benchmarks.md, durability). The KV written
behind is read back only when a session resumes after a crash or a restart, so keeping it
in the page cache bought little.

O_DIRECT takes only aligned memory, offsets and lengths. Small pieces (record frames,
metas, safetensors prefixes) are copied into two page-aligned staging buffers, one written
by an I/O thread while the other is filled; a block's tensor data, gathered into
page-aligned memory and placed on an aligned file offset by the segment format's gap
(tiers/segments.py), is written in place (`Aligned`): without that, copying 512 MiB of
blocks into the stages took the writer ~0.1 s of a core, as much as the disk took to write
them. The bytes of a partial block already in the file are read back and written again,
and every append ends with zeros up to an aligned end (the segment format's padding). A file
system that refuses O_DIRECT (tmpfs on older kernels, some network and FUSE file systems)
gets the same bytes through the page cache.
"""

from __future__ import annotations

import collections
import errno
import fcntl
import itertools
import os
from collections.abc import Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

from kvsession.host_memory import fresh_memory
from kvsession.tiers.segments import ALIGN_BYTES, padding_after

IOV_BATCH = 512  # buffers per pwritev (IOV_MAX is 1024 on Linux)
O_DIRECT = getattr(os, "O_DIRECT", 0)  # Linux; elsewhere every append is buffered


def open_for_append(path) -> int:
    """A read-write descriptor of `path` (created if missing), O_DIRECT where the file
    system takes it."""
    flags = os.O_RDWR | os.O_CREAT | getattr(os, "O_CLOEXEC", 0)
    if O_DIRECT:
        try:
            return os.open(path, flags | O_DIRECT, 0o644)
        except OSError as e:
            if e.errno != errno.EINVAL:
                raise
    return os.open(path, flags, 0o644)


def _buffered(fd: int) -> bool:
    """Take O_DIRECT off `fd`; False when it had none (nothing to retry)."""
    flags = fcntl.fcntl(fd, fcntl.F_GETFL)
    if not flags & O_DIRECT:
        return False
    fcntl.fcntl(fd, fcntl.F_SETFL, flags & ~O_DIRECT)
    return True


@dataclass(frozen=True)
class Aligned:
    """A buffer to append without a copy: page-aligned memory, its length a multiple of
    ALIGN_BYTES, which the caller keeps alive and unchanged until `append` returns. Written
    in place where it falls on an aligned file offset; otherwise copied like any buffer."""

    view: memoryview


class AlignedAppender:
    """Appends buffers to files in whole ALIGN_BYTES blocks. Bytes are copied into two
    staging buffers and `Aligned` buffers are written in place, together in vectored writes
    of up to WRITE_BYTES; while one write runs (an O_DIRECT write returns when the device
    has the data) the next is built, so copying and the disk overlap. One thread's (the
    writer's) at a time."""

    STAGE_BYTES = 8 << 20  # a multiple of ALIGN_BYTES
    WRITE_BYTES = 8 << 20  # a write is submitted once it holds this much
    IO_TIMEOUT_S = 120.0  # one write; a disk slower than 70 KB/s is an I/O error

    def __init__(self):
        # page-aligned, as O_DIRECT needs
        self._stages = [fresh_memory(self.STAGE_BYTES) for _ in range(2)]
        self._views = [memoryview(m) for m in self._stages]
        self._stage_write: list[Future | None] = [None, None]  # the last write using it
        self._inflight: list[Future] = []  # every write of the append under way
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="kvsession-direct-io")
        self.bytes_in_place = 0  # written from the callers' Aligned buffers (stats, tests)

    def close(self) -> None:
        self._pool.shutdown(wait=True)

    def append(self, fd: int, buffers: Iterable, offset: int) -> int:
        """Write `buffers` back to back at `offset`, then the padding up to an aligned end,
        which is returned once every byte is written. Bytes from the aligned block before
        `offset` are kept. `buffers` may be a generator: it is consumed while the writes of
        what it yielded earlier run (so encoding overlaps the disk), and it is iterated
        again from the start if O_DIRECT is refused (a list then). Raises OSError (the file
        then holds some prefix of the pieces: a torn append)."""
        rest, taken = iter(buffers), []

        def recorded():
            for b in rest:
                taken.append(b)
                yield b

        try:
            return self._append_all(fd, recorded(), offset)
        except OSError as e:
            # O_DIRECT refused only at the first write (some FUSE file systems): buffered
            if e.errno != errno.EINVAL or not _buffered(fd):
                raise
            return self._append_all(fd, itertools.chain(taken, rest), offset)

    def _append_all(self, fd: int, buffers: Iterable, offset: int) -> int:
        try:
            end = self._append(fd, buffers, offset)
        except BaseException:
            self._drain(quiet=True)  # no write of this append left running
            raise
        self._drain()
        return end

    def _drain(self, quiet: bool = False) -> None:
        """Wait for every write under way; the first error is raised (after all ended)."""
        error = None
        for fut in self._inflight:
            try:
                self._wait(fut)
            except OSError as e:
                error = error or e
        self._inflight.clear()
        self._stage_write = [None, None]
        if error is not None and not quiet:
            raise error

    def _wait(self, fut: Future) -> None:
        try:
            fut.result(timeout=self.IO_TIMEOUT_S)
        except TimeoutError:
            raise OSError(errno.EIO, f"a write took over {self.IO_TIMEOUT_S} s") from None

    def _stage(self, k: int) -> memoryview:
        """Stage k, once the last write that used it has finished (its error raised)."""
        fut, self._stage_write[k] = self._stage_write[k], None
        if fut is not None:
            self._wait(fut)
        return self._views[k]

    def _append(self, fd: int, buffers: Iterable, offset: int) -> int:
        k = 0
        view = self._stage(k)
        at = offset - offset % ALIGN_BYTES  # where the write being built goes in the file
        fill = offset - at  # bytes of the stage in use
        if fill:  # the partial block already in the file, read back (aligned, whole)
            got = os.preadv(fd, [view[:ALIGN_BYTES]], at)
            if got < fill:
                raise OSError(errno.EIO, f"short read of {got} bytes at {at}")
        start = 0  # the stage's bytes from here to `fill` are not in `batch` yet
        batch: list[memoryview] = []  # the write being built, in file order
        size = 0  # its bytes
        stage_used = False

        def take_stage() -> None:
            """The stage's bytes not yet in the batch join it (a whole number of blocks)."""
            nonlocal start, size, stage_used
            if fill > start:
                batch.append(view[start:fill])
                size += fill - start
                start, stage_used = fill, True

        def submit() -> None:
            nonlocal k, view, at, fill, start, batch, size, stage_used
            take_stage()
            if batch:
                fut = self._pool.submit(pwrite_all, fd, batch, at)
                self._inflight.append(fut)
                at, batch, size = at + size, [], 0
                if stage_used:  # refilled only once this write is done
                    self._stage_write[k] = fut
                    k = 1 - k
                    view = self._stage(k)
                    fill = start = 0
                    stage_used = False

        end = offset
        for b in itertools.chain(buffers, [None]):
            if b is None:  # the end: zeros up to an aligned end (the padding)
                src = memoryview(bytes(padding_after(end)))
            else:
                src = memoryview(b.view if isinstance(b, Aligned) else b).cast("B")
                end += len(src)
            if isinstance(b, Aligned) and (fill - start) % ALIGN_BYTES == 0:
                take_stage()
                batch.append(src)
                size += len(src)
                self.bytes_in_place += len(src)
                if size >= self.WRITE_BYTES or len(batch) >= IOV_BATCH - 1:
                    submit()
                continue
            while len(src):
                n = min(len(src), self.STAGE_BYTES - fill)
                view[fill: fill + n] = src[:n]
                fill, src = fill + n, src[n:]
                if fill == self.STAGE_BYTES:
                    submit()
        submit()  # the rest ends on a multiple of ALIGN_BYTES (the padding)
        return end + padding_after(end)


def pwrite_all(fd: int, buffers: list, offset: int) -> None:
    """Write the buffers back to back at `offset`: vectored, IOV_BATCH at a time, a short
    write continued where it stopped."""
    views = collections.deque(memoryview(b).cast("B") for b in buffers)
    while views:
        batch = [views[k] for k in range(min(IOV_BATCH, len(views)))]
        n = os.pwritev(fd, batch, offset) if hasattr(os, "pwritev") else \
            os.pwrite(fd, batch[0], offset)
        if n <= 0:
            raise OSError("short write")
        offset += n
        while n:
            if n >= len(views[0]):
                n -= len(views.popleft())
            else:
                views[0], n = views[0][n:], 0
