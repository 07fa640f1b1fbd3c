"""One owner per session: OS file locks in session_dir.

A live session holds `flock(LOCK_EX)` on `<session_id>.lock`; the directory's shared files
(the shared prefix store, start-up recovery) are guarded by `.kvsession.lock`. flock locks
belong to an open file description, so the kernel drops them when their process dies,
however it dies: a lock left by a dead process is free by construction and the next owner
simply takes it. No pid files, no timeouts to guess.

Lock files exist only while held: the owner unlinks the file *while still holding it*, then
closes. Another process may have opened the old file just before the unlink and then
acquire the lock on that orphaned inode; so every acquisition checks afterwards that the
path still names the inode it locked, and starts over with the new file if not. Only the
holder of the lock on the inode the path names is an owner. A lock file left by a process
that was killed is unlocked; `sweep_stale_locks` removes it (taking the lock first, so a
live owner's file is never touched).
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import time
from pathlib import Path

from kvsession.errors import SessionLockedError, SnapshotError

try:
    import fcntl
except ImportError:  # Windows: no flock; sessions are then not protected across processes
    fcntl = None

log = logging.getLogger("kvsession")
DIR_LOCK_NAME = ".kvsession.lock"
# attempts at taking a lock whose file is being replaced by its previous owner's unlink
_RETRIES = 16


class FileLock:
    """An exclusive flock on `path`, created if missing, unlinked on release."""

    def __init__(self, path: Path):
        self.path = Path(path)
        self.fd: int | None = None

    @property
    def held(self) -> bool:
        return self.fd is not None

    def try_acquire(self) -> bool:
        """Take the lock without waiting; False if another open file description holds
        it. OSError (an unwritable directory) is raised as a SnapshotError."""
        if self.fd is not None:
            return True
        if fcntl is None:
            return True
        for _ in range(_RETRIES):
            try:
                fd = os.open(self.path, os.O_RDWR | os.O_CREAT | getattr(os, "O_CLOEXEC", 0),
                             0o644)
            except OSError as e:
                raise SnapshotError(f"{self.path}: cannot create the lock file: {e}") from None
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError as e:
                os.close(fd)
                if e.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                    return False
                raise SnapshotError(f"{self.path}: cannot lock: {e}") from None
            # the path must still name what we locked: a previous owner unlinks on release
            try:
                same = os.stat(self.path).st_ino == os.fstat(fd).st_ino
            except FileNotFoundError:
                same = False
            if same:
                self.fd = fd
                with contextlib.suppress(OSError):  # informational: who holds it
                    os.ftruncate(fd, 0)
                    os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
                return True
            os.close(fd)
        return False

    def acquire(self, timeout_s: float) -> bool:
        """Wait (polling, bounded by timeout_s) for the lock."""
        deadline = time.monotonic() + timeout_s
        delay = 0.001
        while not self.try_acquire():
            if time.monotonic() >= deadline:
                return False
            time.sleep(delay)
            delay = min(delay * 2, 0.05)
        return True

    def release(self) -> None:
        """Unlink (while still holding, see the module docstring), then unlock. Idempotent."""
        fd, self.fd = self.fd, None
        if fd is None:
            return
        with contextlib.suppress(OSError):
            os.unlink(self.path)
        os.close(fd)

    def __enter__(self) -> FileLock:
        return self

    def __exit__(self, *exc) -> None:
        self.release()


class NoLock:
    """What a session holds when ownership is not enforced (durability="close": the
    directory keeps today's shape, snapshot files only)."""

    held = True

    def release(self) -> None:
        pass


# another process's start-up takes the lock of every session nobody owns, for the moment
# its check of that session's log takes: a lock held that long is not an owner's
STARTUP_HOLD_S = 0.5


def lock_session(path: Path, session_id: str) -> FileLock:
    """The session's lock, taken now (waiting out another process's start-up check);
    SessionLockedError when another process holds it."""
    lock = FileLock(path)
    if not lock.acquire(STARTUP_HOLD_S):
        raise SessionLockedError(
            f"session {session_id!r} is in use by another process ({path} is locked); "
            f"close it there first, or use another session_id")
    return lock


@contextlib.contextmanager
def directory_lock(root: Path, timeout_s: float = 30.0):
    """The directory lock (`.kvsession.lock`), held for the duration of a with-block:
    writes of shared files and start-up recovery. A bounded wait: SnapshotError after
    timeout_s (a live process holding it that long is stuck)."""
    lock = FileLock(Path(root) / DIR_LOCK_NAME)
    if not lock.acquire(timeout_s):
        raise SnapshotError(f"{lock.path}: still locked by another process after "
                            f"{timeout_s:.0f} s")
    try:
        yield lock
    finally:
        lock.release()


def sweep_stale_locks(root: Path, is_lock_name) -> list[Path]:
    """Remove lock files nobody holds (left by killed processes): each is taken first, so
    a live owner's is never touched. is_lock_name(name) says which names are ours."""
    removed = []
    try:
        names = [e.name for e in os.scandir(root) if is_lock_name(e.name)]
    except OSError as e:
        log.warning("cannot list %s: %s", root, e)
        return removed
    for name in names:
        lock = FileLock(Path(root) / name)
        try:
            if lock.try_acquire():
                lock.release()
                removed.append(lock.path)
        except SnapshotError as e:
            log.warning("%s", e)
    return removed
