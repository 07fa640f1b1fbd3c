"""The disk tier: one `.kvs` snapshot per session under `session_dir`.

The directory is the index: files are self-describing and scanned at start-up, so there is
no separate catalogue that could be lost or disagree with the files. A file's name is its
session's id (`<session_id>.kvs`): a copy under another name is another session, and a
session only ever writes or deletes the file of its own id.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import stat
import time
from pathlib import Path

from kvsession.errors import ConfigError, SnapshotError
from kvsession.tiers.snapshot import SESSION_ID_PATTERN, TEMP_NAME, fcntl
from kvsession.tiers.snapshot_read import read_frame

log = logging.getLogger("kvsession")
SESSION_ID = re.compile(SESSION_ID_PATTERN)
# a temporary snapshot untouched this long, and not locked, is a crashed save's leftover
STALE_TEMP_S = 60.0


def check_session_id(session_id: str) -> str:
    if not isinstance(session_id, str) or not SESSION_ID.fullmatch(session_id):
        raise ConfigError(f"session_id must match {SESSION_ID.pattern} (it names a file), "
                          f"got {session_id!r}")
    return session_id


class DiskTier:
    def __init__(self, root: Path):
        self.root = Path(root)
        try:
            self.root.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise ConfigError(f"session_dir={str(root)!r} cannot be created: {e}") from None
        self.remove_stale_temporaries()

    def path_for(self, session_id: str) -> Path:
        """session_id was validated where it entered (SessionStore): `check_session_id`."""
        return self.root / f"{session_id}.kvs"

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
        """session id (the file name) -> file, for every snapshot in the directory. Skipped
        with a warning, never deleted: names that are not session ids, anything that is not
        a regular file (a FIFO is never opened) and files whose frame (magic, footer,
        header checksum and scalars) is invalid."""
        found = {}
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
        """Remove the temporary files of saves that crashed: ours by name (TEMP_NAME), older
        than max_age_s and not locked by a live writer (a writer holds a lock on its
        temporary file until it is renamed). Returns what was removed."""
        removed = []
        now = time.time()
        try:
            entries = list(os.scandir(self.root))
        except OSError as e:
            log.warning("cannot list session_dir %s: %s", self.root, e)
            return removed
        for entry in entries:
            if not TEMP_NAME.fullmatch(entry.name):
                continue
            path = Path(entry.path)
            try:
                st = entry.stat(follow_symlinks=False)
                if not stat.S_ISREG(st.st_mode) or now - st.st_mtime < max_age_s:
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
