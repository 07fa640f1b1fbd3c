"""Crash-safe file primitives of the session directory: atomic rewrites (a temporary file
named TEMP_NAME, locked while written, fsynced, renamed over the target, the directory
fsynced), directory fsyncs, and opening untrusted paths without blocking (a FIFO is
refused, never waited on). Snapshots, session logs, recovery reports and the start-up
scan (tiers/disk.py, which removes the temporaries of writers that died) share them.
"""

from __future__ import annotations

import contextlib
import os
import re
import stat
import threading
import uuid
from collections.abc import Callable
from pathlib import Path

from kvsession.errors import SnapshotError

try:  # POSIX: a writer locks its temporary file, so a scan never removes a live one
    import fcntl
except ImportError:  # Windows: the scan goes by age alone
    fcntl = None

TEMP_NAME = re.compile(
    r"\.(?P<target>.+\.(?:kvs|log|seg|recovery))\.(?P<pid>[0-9]+)\.[0-9a-f]{8}\.tmp")



def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def atomic_write(path: Path, fill: Callable) -> int:
    """fill(f) writes the content into a temporary file next to `path` (named TEMP_NAME,
    locked while open so a directory scan knows it is live); fsync, rename over `path`,
    fsync the directory. Returns the size. Any failure removes the temporary file and
    raises SnapshotError (OSError: naming its cause, e.g. no space left)."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{uuid.uuid4().hex[:8]}.tmp")
    try:
        try:
            with open(tmp, "xb") as f:
                if fcntl is not None:
                    fcntl.flock(f.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
                fill(f)
                f.flush()
                os.fsync(f.fileno())
                size = f.tell()
            _replace_releasing_later(tmp, path)
            fsync_dir(path.parent)
            return size
        except BaseException:
            with contextlib.suppress(OSError):
                tmp.unlink(missing_ok=True)
            raise
    except OSError as e:
        raise SnapshotError(f"{path}: cannot write: {e}") from e


def open_regular(path: Path):
    """An unbuffered binary file on `path`, which must be a regular file. Opened with
    O_NONBLOCK: opening a FIFO for reading would otherwise wait for a writer forever (the
    flag changes nothing for I/O on a regular file)."""
    flags = os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0)
    try:
        fd = os.open(path, flags)
    except OSError as e:
        raise SnapshotError(f"{path}: cannot read: {e}") from None
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise SnapshotError(f"{path}: not a regular file")
        return os.fdopen(fd, "rb", buffering=0)
    except BaseException:
        os.close(fd)
        raise


def _replace_releasing_later(tmp: Path, path: Path) -> None:
    """os.replace(tmp, path), but the replaced file's storage is released by a background
    thread: renaming over a large file frees its blocks inside rename() (30 ms for 128 MiB
    here), on the spill's critical path. Holding an fd across the rename moves that work to
    the fd's close."""
    try:  # non-blocking: `path` may be a FIFO (replaced like anything else, never opened)
        old = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0))
    except OSError:
        old = None
    try:
        os.replace(tmp, path)
    finally:
        if old is not None:
            threading.Thread(target=os.close, args=(old,), daemon=True).start()
