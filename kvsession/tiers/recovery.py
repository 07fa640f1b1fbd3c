"""What crash recovery did to a session's log, said out loud and kept.

The log's torn-tail rule (tiers/wal.py) cuts whatever follows the last intact record: the
torn append of a turn that was never acknowledged, but also a last record damaged after it
was acknowledged (a flipped bit, a file system that kept the size and lost the data). A log
without any intact record is removed. Neither can be told apart from the bytes alone, so
recovery never does it silently:

- `repair_log` (the one place that applies the rule to a file, for the start-up scan of
  `session_dir` and for a resume) logs a warning naming the session and what was cut, and
  files a `LogRecovery` in the session's recovery file `<id>.recovery` *before* it changes
  the log (a crash in between leaves the report, and the next recovery redoes the cut).
- A resumed session reports the recoveries of its log in `Session.stats.recovery`;
  `llm.stats().recovery` lists those the `LLM` did.
- A log removed by recovery leaves its recovery file behind as a tombstone: opening that id
  again raises `SessionLostError` naming what happened, instead of starting an empty
  session under it, unless the caller asks for a fresh one
  (`llm.session(session_id=..., fresh=True)`), which removes the tombstone. A session that
  still has a snapshot resumes from it (the report says what the log lost).

The recovery file is untrusted like every file in the directory: read with a size bound,
decoded into exact types; a damaged one is reported (a warning) and treated as absent, never
a reason to refuse the session. It keeps the last MAX_EVENTS reports. `close(delete=True)`
removes it with the session's other files.
"""

from __future__ import annotations

import contextlib
import enum
import logging
import os
import time
from pathlib import Path
from typing import Annotated

import msgspec

from kvsession.errors import SessionLostError, SnapshotError
from kvsession.tiers import wal
from kvsession.tiers.files import atomic_write, fsync_dir, open_regular
from kvsession.tiers.snapshot_format import SESSION_ID_PATTERN

log = logging.getLogger("kvsession")
RECOVERY_SUFFIX = ".recovery"
# reports kept per session: recovery cuts at most one tail per crash, so this many is a
# session that crashed this often; older reports are dropped first
MAX_EVENTS = 16
# a report is ~250 bytes of JSON: the bound leaves room for MAX_EVENTS of them with long
# causes, and is what a crafted file can make the reader allocate
MAX_FILE_BYTES = 64 << 10


class RecoveryAction(enum.Enum):
    TRUNCATED = "truncated"  # the bytes after the last intact record were cut off
    REMOVED = "removed"      # the log had no intact record: the file was removed


class LogRecovery(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """One cut recovery made to a session's log.

    bytes_cut: the bytes removed (the tail, or the whole file); records_dropped: the
    records begun in them (a frame header with a length: 0 for a tail of zeros); each record
    commits one turn (`send`, `stream`, `add`), so turns_dropped is the same count, kept
    apart because a record that could not be read may still have been acknowledged (the
    report cannot tell a torn append from damage, so it names what may be lost).
    """

    session_id: Annotated[str, msgspec.Meta(pattern=f"^{SESSION_ID_PATTERN}$")]
    action: RecoveryAction
    bytes_cut: Annotated[int, msgspec.Meta(ge=0)]
    records_dropped: Annotated[int, msgspec.Meta(ge=0)]
    turns_dropped: Annotated[int, msgspec.Meta(ge=0)]
    unix_s: Annotated[float, msgspec.Meta(ge=0.0, le=1e11)]
    cause: Annotated[str, msgspec.Meta(max_length=512)]

    def describe(self) -> str:
        when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(self.unix_s))
        what = ("its log had no intact record and was removed"
                if self.action is RecoveryAction.REMOVED else "the tail of its log was cut")
        return (f"{what} by crash recovery at {when} ({self.bytes_cut} bytes, "
                f"{self.records_dropped} records: {self.cause})")


_Events = Annotated[list[LogRecovery], msgspec.Meta(max_length=MAX_EVENTS)]
_DECODER = msgspec.json.Decoder(_Events)


def recovery_path(root: Path, session_id: str) -> Path:
    return Path(root) / f"{session_id}{RECOVERY_SUFFIX}"


def read_events(root: Path, session_id: str) -> list[LogRecovery]:
    """The session's recovery reports, oldest first ([] when none, or when the file is not
    readable: a warning)."""
    path = recovery_path(root, session_id)
    if not os.path.lexists(path):
        return []
    try:
        with open_regular(path) as f:
            data = f.read(MAX_FILE_BYTES + 1)
        if len(data) > MAX_FILE_BYTES:
            raise SnapshotError(f"{path}: over {MAX_FILE_BYTES} bytes")
        events = _DECODER.decode(data)
    except (SnapshotError, OSError, msgspec.MsgspecError) as e:
        log.warning("session %s: its recovery file cannot be read (%s); treated as absent",
                    session_id, e)
        return []
    return [e for e in events if e.session_id == session_id]


def _file_event(root: Path, event: LogRecovery) -> None:
    """Append `event` to the session's recovery file, durably (atomic rewrite)."""
    events = [*read_events(root, event.session_id), event][-MAX_EVENTS:]
    data = msgspec.json.encode(events)
    atomic_write(recovery_path(root, event.session_id), lambda f: f.write(data))


def tombstone(root: Path, session_id: str) -> LogRecovery | None:
    """The report that removed the session's log, when recovery did. Asked by the store
    only once it found nothing else of the session (no log, no snapshot): the id must not
    then silently start empty."""
    removed = [e for e in read_events(root, session_id) if e.action is RecoveryAction.REMOVED]
    return removed[-1] if removed else None


def refuse_lost(root: Path, session_id: str) -> None:
    """SessionLostError when the id is a tombstone (see `tombstone`; the caller found no
    log and no snapshot of it)."""
    event = tombstone(root, session_id)
    if event is not None:
        raise SessionLostError(
            f"session {session_id!r}: {event.describe()}; its acknowledged turns may be "
            f"lost. llm.session(session_id={session_id!r}, fresh=True) starts a new, empty "
            f"session under this id", session_id=session_id)


def clear(root: Path, session_id: str) -> None:
    """Remove the session's recovery file (a fresh session under its id, or a deleted
    session), durably."""
    path = recovery_path(root, session_id)
    with contextlib.suppress(FileNotFoundError):
        path.unlink()
        with contextlib.suppress(OSError):
            fsync_dir(path.parent)


def repair_log(path: Path, session_id: str, scan: wal.LogScan) -> LogRecovery | None:
    """Apply the torn-tail rule to a scanned log (the caller owns the session: its lock is
    held): cut a torn tail, remove a log without an intact record. The report is filed
    (and logged) before the file changes. None when the log is whole."""
    path = Path(path)
    if scan.state is None:
        action, cut, cause = RecoveryAction.REMOVED, scan.size, scan.cause or "empty file"
    elif scan.torn:
        action, cut, cause = RecoveryAction.TRUNCATED, scan.size - scan.end, scan.cause
    else:
        return None
    event = LogRecovery(session_id=session_id, action=action, bytes_cut=cut,
                        records_dropped=scan.dropped_records,
                        turns_dropped=scan.dropped_records, unix_s=time.time(),
                        cause=cause[:512])
    log.warning("session %s: %s", session_id, event.describe())
    _file_event(path.parent, event)
    if action is RecoveryAction.REMOVED:
        path.unlink(missing_ok=True)
        fsync_dir(path.parent)
    else:
        wal.truncate(path, scan.end)
    return event
