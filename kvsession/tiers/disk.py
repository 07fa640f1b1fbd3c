"""The disk tier: one `.kvs` snapshot per session under `session_dir`.

The directory is the index: files are self-describing and scanned at start-up, so there is
no separate catalogue that could be lost or disagree with the files.
"""

from __future__ import annotations

import logging
import re
from pathlib import Path

from kvsession.errors import ConfigError, SnapshotError
from kvsession.tiers.snapshot import read_header

log = logging.getLogger("kvsession")
SESSION_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")


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

    def path_for(self, session_id: str) -> Path:
        """session_id was validated where it entered (SessionStore): `check_session_id`."""
        return self.root / f"{session_id}.kvs"

    def scan(self) -> dict[str, Path]:
        """session id -> file, for every valid snapshot in the directory (invalid files are
        skipped with a warning, never deleted)."""
        found = {}
        for path in sorted(self.root.glob("*.kvs")):
            try:
                found[read_header(path).session_id] = path
            except SnapshotError as e:
                log.warning("skipping %s", e)
        return found
