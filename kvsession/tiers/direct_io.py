"""Aligned appends with O_DIRECT: how the write-behind writes KV segments (tiers/writeback.py).

Why not the page cache: a buffered write costs the writing thread a kernel copy per byte
into the page cache, and on the 2-core CI machine that cost varied ~10x from one run to the
next (0.14 to 1.6 s of CPU for 512 MiB, with nothing else changed), all of
it taken from the cores the engine computes on. The same appends with O_DIRECT ran at the
disk's speed for ~0.03 s of CPU, every time (docs/benchmarks.md, durability). The KV written
behind is read back only when a session resumes after a crash or a restart, so keeping it
in the page cache bought little.

O_DIRECT takes only aligned memory, offsets and lengths. The data go through two
page-aligned staging buffers (a user-space copy, far cheaper than the kernel's), in pieces
of whole ALIGN_BYTES blocks, one written by an I/O thread while the other is filled; the
bytes of a partial block already in the file are read back and written again, and the
last piece is padded with zeros (the segment format's padding: tiers/segments.py). A file
system that refuses O_DIRECT (tmpfs on older kernels, some network and FUSE file systems)
gets the same bytes through the page cache.
"""

from __future__ import annotations

import collections
import errno
import fcntl
import os
from concurrent.futures import Future, ThreadPoolExecutor

from kvsession.tiers.segments import ALIGN_BYTES, padding_after
from kvsession.tiers.staging import fresh_memory

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


class AlignedAppender:
    """Appends buffers to files in whole ALIGN_BYTES blocks through two staging buffers:
    while one is written (an O_DIRECT write returns when the device has the data) the next
    is filled, so copying and the disk overlap. One thread's (the writer's) at a time."""

    STAGE_BYTES = 8 << 20  # a multiple of ALIGN_BYTES; larger appends go in several writes
    IO_TIMEOUT_S = 120.0  # one staged write; a disk slower than 70 KB/s is an I/O error

    def __init__(self):
        # page-aligned, as O_DIRECT needs
        self._stages = [fresh_memory(self.STAGE_BYTES) for _ in range(2)]
        self._views = [memoryview(m) for m in self._stages]
        self._pending: list[Future | None] = [None, None]
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="kvsession-direct-io")

    def close(self) -> None:
        self._pool.shutdown(wait=True)

    def append(self, fd: int, buffers: list, offset: int) -> int:
        """Write `buffers` back to back at `offset`, then the padding up to an aligned end,
        which is returned once every byte is written. Bytes from the aligned block before
        `offset` are kept. Raises OSError (the file then holds some prefix of the pieces: a
        torn append)."""
        try:
            return self._append_all(fd, buffers, offset)
        except OSError as e:
            # O_DIRECT refused only at the first write (some FUSE file systems): buffered
            if e.errno != errno.EINVAL or not _buffered(fd):
                raise
            return self._append_all(fd, buffers, offset)

    def _append_all(self, fd: int, buffers: list, offset: int) -> int:
        try:
            end = self._append(fd, buffers, offset)
        except BaseException:
            self._drain(quiet=True)  # no write of this append left running
            raise
        self._drain()
        return end

    def _drain(self, quiet: bool = False) -> None:
        """Wait for both staged writes; the first error is raised (after both ended)."""
        error = None
        for k in range(2):
            try:
                self._stage(k)
            except OSError as e:
                error = error or e
        if error is not None and not quiet:
            raise error

    def _stage(self, k: int) -> memoryview:
        """Stage k, once its previous write has finished (its error raised)."""
        fut, self._pending[k] = self._pending[k], None
        if fut is not None:
            try:
                fut.result(timeout=self.IO_TIMEOUT_S)
            except TimeoutError:
                raise OSError(errno.EIO, f"a staged write took over {self.IO_TIMEOUT_S} s"
                              ) from None
        return self._views[k]

    def _append(self, fd: int, buffers: list, offset: int) -> int:
        stage, k = self.STAGE_BYTES, 0
        view = self._stage(k)
        at = offset - offset % ALIGN_BYTES  # where the stage goes in the file
        fill = offset - at  # bytes of the stage in use
        if fill:  # the partial block already in the file, read back (aligned, whole)
            got = os.preadv(fd, [view[:ALIGN_BYTES]], at)
            if got < fill:
                raise OSError(errno.EIO, f"short read of {got} bytes at {at}")
        end = offset
        for b in buffers:
            src = memoryview(b).cast("B")
            end += len(src)
            while len(src):
                n = min(len(src), stage - fill)
                view[fill: fill + n] = src[:n]
                fill, src = fill + n, src[n:]
                if fill == stage:  # written while the other stage fills
                    self._pending[k] = self._pool.submit(pwrite_all, fd, [view], at)
                    k = 1 - k
                    view = self._stage(k)
                    at, fill = at + stage, 0
        pad = padding_after(end)
        if fill + pad > stage:  # the padding spills past the stage: write what is full
            whole = fill - fill % ALIGN_BYTES
            tail = bytes(view[whole: fill])
            self._pending[k] = self._pool.submit(pwrite_all, fd, [view[:whole]], at)
            k = 1 - k
            view = self._stage(k)
            view[: len(tail)] = tail
            at, fill = at + whole, len(tail)
        view[fill: fill + pad] = bytes(pad)
        fill += pad
        if fill:
            self._pending[k] = self._pool.submit(pwrite_all, fd, [view[:fill]], at)
        return end + pad


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
