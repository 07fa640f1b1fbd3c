"""Files an application keeps beside its sessions (`LLM.put_file` / `get_file` /
`delete_file`): small documents that belong with the conversations, such as the server's
stored Responses (serve/openai_responses.py keeps `responses/<id>.json` here).

A side file is named `<folder>/<file>` (two segments of letters, digits, `_`, `-` and `.`,
neither starting with a dot), so it never collides with a session's own files, which sit
at the top level of session_dir. It lives in session_dir, written whole and renamed into
place (a reader sees the old content or the new, never half). Where session_dir is an
object store's URL it is put in the store under the same name as it is written (the last
writer wins) and removed there with it; a read first asks the store whether its copy
changed since this process last put or read it (a conditional get) and takes the store's
where it did, so every machine naming the store sees the latest (tiers/session_mirror.py).
A store that fails is logged: the local copy stands, and a read that finds nothing
anywhere is a miss.

Thread-safe: each call touches only its own file; the last writer of a name wins.
"""

from __future__ import annotations

import re
from pathlib import Path

from kvsession.errors import ConfigError
from kvsession.tiers.files import atomic_write
from kvsession.tiers.session_mirror import SessionMirror

_SEGMENT = re.compile(r"[A-Za-z0-9_-][A-Za-z0-9._-]{0,127}")
# a side file is a small document, read whole into memory
MAX_SIDE_FILE_BYTES = 64 << 20


def check_side_file_name(name: object) -> str:
    """`name` as a side file's relative path, or ConfigError."""
    if not isinstance(name, str):
        raise ConfigError(f"name must be a string '<folder>/<file>', got "
                          f"{type(name).__name__}")
    parts = name.split("/")
    if len(parts) != 2 or not all(_SEGMENT.fullmatch(p) for p in parts):
        raise ConfigError(f"name must be '<folder>/<file>' (letters, digits, '_', '-', '.'; "
                          f"up to 128 characters each, not starting with '.'), got {name!r}")
    return name


class SideFiles:
    def __init__(self, root: Path | None, mirror: SessionMirror | None):
        """root: the (local) session directory, None without one; mirror: its store."""
        self.root, self.mirror = root, mirror

    def _path(self, name: str) -> Path:
        name = check_side_file_name(name)
        if self.root is None:
            raise ConfigError("side files are kept in session_dir: LLM(session_dir=...)")
        return self.root / name

    def put(self, name: str, data: bytes) -> None:
        """Write the file here (atomically; SnapshotError when session_dir cannot be
        written), then put it in the store, if one (a failure there is logged)."""
        path = self._path(name)
        if not isinstance(data, bytes | bytearray | memoryview):
            raise ConfigError(f"data must be bytes, got {type(data).__name__}")
        if len(data) > MAX_SIDE_FILE_BYTES:
            raise ConfigError(f"data is {len(data)} bytes; a side file holds at most "
                              f"{MAX_SIDE_FILE_BYTES}")
        path.parent.mkdir(parents=True, exist_ok=True)
        atomic_write(path, lambda f: f.write(data))
        if self.mirror is not None:
            self.mirror.put_file(self.root, name)

    def get(self, name: str) -> bytes | None:
        """The file's bytes, None where there is none. With a store, the copy here is
        first made the store's where that changed since this process last put or read it
        (another machine wrote or removed it: a conditional get, nothing read where it did
        not); while the store cannot be read, the copy here (logged)."""
        path = self._path(name)
        if self.mirror is not None:
            self.mirror.refresh_file(self.root, name, MAX_SIDE_FILE_BYTES)
        try:
            if path.stat().st_size > MAX_SIDE_FILE_BYTES:
                raise ConfigError(f"{path} is larger than a side file may be "
                                  f"({MAX_SIDE_FILE_BYTES} bytes)")
            return path.read_bytes()
        except (FileNotFoundError, NotADirectoryError):
            return None

    def delete(self, name: str) -> bool:
        """Remove the file here and from the store. Returns whether it was here."""
        path = self._path(name)
        try:
            path.unlink()
            existed = True
        except FileNotFoundError:
            existed = False
        if self.mirror is not None:
            self.mirror.delete(name)
        return existed
