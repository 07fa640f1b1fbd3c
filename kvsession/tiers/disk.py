"""The disk tier: the files of each session under `session_dir`.

Per session (named by its id): `<id>.kvs`, a snapshot (docs/snapshot-format.md);
`<id>.log`, its write-ahead log with durability="turn" (tiers/wal.py), which is then the
truth about the conversation; `<id>.seg`, KV blocks written behind (tiers/segments.py);
`<id>.lock`, present while a process owns the session (tiers/locks.py).

The directory is the index: files are self-describing and scanned at start-up, so there is
no separate catalogue that could be lost or disagree with the files. A file's name is its
session's id: a copy under another name is another session, and a session only ever
writes or deletes the files of its own id.

Start-up recovery (`DiskTier.__init__`): temporary files of writers that died are removed,
lock files nobody holds are removed, and every log whose session nobody owns is checked:
a torn last record is cut off, a log with no intact record is removed (each cut reported
and kept in the session's `<id>.recovery` file: tiers/recovery.py), and so is a segment
without a log. A segment's torn tail is cut off by the session's next owner when it
resumes.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import shutil
import stat
import time
from pathlib import Path

from kvsession.errors import ConfigError, SnapshotError
from kvsession.tiers import wal
from kvsession.tiers.files import TEMP_NAME, fcntl
from kvsession.tiers.locks import DIR_LOCK_NAME, FileLock, directory_lock, sweep_stale_locks
from kvsession.tiers.recovery import LogRecovery, RecoveryAction, repair_log
from kvsession.tiers.snapshot_format import SESSION_ID_PATTERN
from kvsession.tiers.snapshot_read import read_frame

log = logging.getLogger("kvsession")
SESSION_ID = re.compile(SESSION_ID_PATTERN)
# a temporary snapshot untouched this long, and not locked, is a crashed save's leftover
STALE_TEMP_S = 60.0
SHARED_NAME = ".shared.seg"


# names Windows reserves for devices, whatever their extension (`nul.txt` is the device
# too): a session directory may move to Windows or an SMB share, where such a file cannot
# be created or opened
WINDOWS_RESERVED = frozenset({"con", "prn", "aux", "nul", *(f"com{i}" for i in range(1, 10)),
                              *(f"lpt{i}" for i in range(1, 10))})


def check_session_id(session_id: str) -> str:
    if not isinstance(session_id, str) or not SESSION_ID.fullmatch(session_id):
        raise ConfigError(f"session_id must match {SESSION_ID.pattern} (it names a file), "
                          f"got {session_id!r}")
    if session_id.split(".", 1)[0].lower() in WINDOWS_RESERVED:
        raise ConfigError(f"session_id {session_id!r} is a name Windows reserves for a "
                          f"device (CON, PRN, AUX, NUL, COM1-9, LPT1-9, with any extension): "
                          f"its files could not move to Windows or an SMB share")
    if session_id.endswith("."):
        raise ConfigError(f"session_id {session_id!r} ends with '.', which Windows drops "
                          f"from file names (it would name another session's files there)")
    return session_id


class DiskTier:
    def __init__(self, root: Path):
        self.root = Path(root)
        try:
            self.root.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise ConfigError(f"session_dir={str(root)!r} cannot be created: {e}") from None
        # the cuts recovery made to logs, this process's (a session's own, whoever made
        # them, are in its recovery file: Session.stats.recovery)
        self.recoveries: list[LogRecovery] = []
        self.recovered: dict[str, list[Path]] = {
            "temporaries": self.remove_stale_temporaries(),
            "locks": sweep_stale_locks(self.root, _is_lock_name)}
        self.recovered |= self.recover_logs()

    def free_bytes(self) -> int:
        """Room left on the file system that holds session_dir (0 if it cannot be read)."""
        try:
            return shutil.disk_usage(self.root).free
        except OSError:
            return 0

    def path_for(self, session_id: str) -> Path:
        """session_id was validated where it entered (SessionStore): `check_session_id`."""
        return self.root / f"{session_id}.kvs"

    def log_path(self, session_id: str) -> Path:
        return self.root / f"{session_id}.log"

    def segment_path(self, session_id: str) -> Path:
        return self.root / f"{session_id}.seg"

    def lock_path(self, session_id: str) -> Path:
        return self.root / f"{session_id}.lock"

    def shared_path(self) -> Path:
        """The shared prefix store: KV blocks of pinned prefixes (system prompts), stored
        once per directory (a segment file; its name is no session id)."""
        return self.root / SHARED_NAME

    def collect_shared(self) -> bool:
        """Remove the shared prefix store when no session in the directory can use it (no
        log, no segment: sessions persisted as snapshots carry their own copy). Under the
        directory lock; True when removed."""
        path = self.shared_path()
        if not path.exists():
            return False
        try:
            with directory_lock(self.root, timeout_s=5.0):
                if self._session_files(".log") or self._session_files(".seg"):
                    return False
                path.unlink(missing_ok=True)
                return True
        except (OSError, SnapshotError) as e:
            log.warning("shared prefix store %s: %s", path, e)
            return False

    def has_session(self, session_id: str) -> bool:
        """Whether session_dir holds the session (a log, or a snapshot)."""
        return self.log_path(session_id).is_file() or self.path_for(session_id).is_file()

    def recover_logs(self) -> dict[str, list[Path]]:
        """Check the log of every session nobody owns (its lock is taken for the check):
        cut a torn tail, remove a log without an intact record, each reported
        (tiers/recovery.py; `self.recoveries`). Logs that are corrupted (an intact record
        that does not decode, another session's log) are left as they are, with a warning:
        resuming such a session raises SnapshotError naming the cause."""
        truncated, removed = [], []
        for path in self._session_files(".log"):
            lock = FileLock(self.lock_path(path.stem))
            try:
                if not lock.try_acquire():
                    continue  # owned by a live process: its log is its business
                event = repair_log(path, path.stem, wal.read_log(path, session_id=path.stem))
                if event is not None:
                    self.recoveries.append(event)
                    (removed if event.action is RecoveryAction.REMOVED else
                     truncated).append(path)
            except (OSError, SnapshotError) as e:
                log.warning("session log %s: %s", path, e)
            finally:
                lock.release()
        return {"truncated_logs": truncated, "removed_logs": removed,
                "removed_segments": self._remove_orphan_segments(),
                "removed_shared": [self.shared_path()] if self.collect_shared() else []}

    def _remove_orphan_segments(self) -> list[Path]:
        """A segment without a log is KV of turns never acknowledged (written behind
        before the process died ahead of the turn's log record), or of a session persisted
        as a snapshot (which holds all of it): nobody will read it. Removed when its
        session is not owned by a live process."""
        removed = []
        for path in self._session_files(".seg"):
            if self.log_path(path.stem).exists():
                continue
            lock = FileLock(self.lock_path(path.stem))
            try:
                if lock.try_acquire() and not self.log_path(path.stem).exists():
                    path.unlink()
                    removed.append(path)
            except (OSError, SnapshotError) as e:
                log.warning("%s: %s", path, e)
            finally:
                lock.release()
        return removed

    def _session_files(self, suffix: str) -> list[Path]:
        try:
            paths = sorted(self.root.glob(f"*{suffix}"))
        except OSError as e:
            log.warning("cannot list session_dir %s: %s", self.root, e)
            return []
        out = []
        for p in paths:
            try:
                if SESSION_ID.fullmatch(p.stem) and stat.S_ISREG(os.stat(p).st_mode):
                    out.append(p)
            except OSError:
                continue
        return out

    def id_of(self, path: Path) -> str | None:
        """The session id that `path` is the file of (its stem), when it is a `.kvs` file
        directly in this directory with a valid id as its name; else None."""
        path = Path(path)
        if path.suffix != ".kvs" or not SESSION_ID.fullmatch(path.stem):
            return None
        try:
            same_dir = path.parent.resolve() == self.root.resolve()
        except OSError:
            return None
        return path.stem if same_dir else None

    def scan(self) -> dict[str, Path]:
        """session id (the file name) -> file, for every session in the directory: its
        log when it has one (the truth), else its snapshot. Skipped with a warning, never
        deleted: names that are not session ids, anything that is not a regular file (a
        FIFO is never opened) and snapshots whose frame (magic, footer, header checksum and
        scalars) is invalid."""
        found = {p.stem: p for p in self._session_files(".log")}
        try:
            paths = sorted(self.root.glob("*.kvs"))
        except OSError as e:
            log.warning("cannot list session_dir %s: %s", self.root, e)
            return found
        for path in paths:
            sid = path.name[: -len(".kvs")]
            if not SESSION_ID.fullmatch(sid):
                log.warning("skipping %s: its name is not a session id", path)
                continue
            if sid in found:
                continue
            try:
                if not stat.S_ISREG(os.stat(path).st_mode):
                    log.warning("skipping %s: not a regular file", path)
                    continue
                read_frame(path)
            except (OSError, SnapshotError) as e:
                log.warning("skipping %s", e)
                continue
            found[sid] = path
        return found

    def remove_stale_temporaries(self, max_age_s: float = STALE_TEMP_S) -> list[Path]:
        """Remove the temporary files of saves that crashed: ours by name (TEMP_NAME), not
        locked by a live writer (a writer holds a lock on its temporary file until it is
        renamed), and either older than max_age_s or named by a process that no longer
        exists (the name carries the writer's pid; a young file of a live process may be a
        save that has not locked it yet). Returns what was removed."""
        removed = []
        now = time.time()
        try:
            entries = list(os.scandir(self.root))
        except OSError as e:
            log.warning("cannot list session_dir %s: %s", self.root, e)
            return removed
        for entry in entries:
            m = TEMP_NAME.fullmatch(entry.name)
            if not m:
                continue
            path = Path(entry.path)
            try:
                st = entry.stat(follow_symlinks=False)
                if not stat.S_ISREG(st.st_mode) or (
                        now - st.st_mtime < max_age_s and _pid_alive(int(m["pid"]))):
                    continue
                fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0))
            except OSError:
                continue
            try:
                if fcntl is not None:
                    try:
                        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    except OSError:  # a live writer holds it
                        continue
                with contextlib.suppress(FileNotFoundError):
                    path.unlink()
                removed.append(path)
                log.info("removed %s, left by a save that did not finish", path)
            except OSError as e:
                log.warning("cannot remove stale temporary file %s: %s", path, e)
            finally:
                os.close(fd)
        return removed


def _is_lock_name(name: str) -> bool:
    """A session's lock file, or the directory lock (a process killed while it wrote a
    shared file leaves it; nothing else removes it when no process takes it again)."""
    return name == DIR_LOCK_NAME or (
        name.endswith(".lock") and bool(SESSION_ID.fullmatch(name[: -len(".lock")])))


def _pid_alive(pid: int) -> bool:
    """Whether a process `pid` exists (on this host; a pid reused since is taken as alive,
    which only delays the removal to max_age_s)."""
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except (PermissionError, OverflowError, OSError):
        return True
    return True
