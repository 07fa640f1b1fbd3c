"""Sessions in an object store: `LLM(session_dir="s3://bucket/sessions")`, so that a
session resumes on any machine that names the same store (a replica that died, another
host behind the router).

The session directory stays a local directory (`$KVSESSION_CACHE/sessions/<digest of the
URL>`): every file operation, lock, write-behind segment and start-up recovery works on it
as on any session_dir (tiers/disk.py). The store holds a mirror of each session's two files
that carry it across machines, put whole as `<prefix>/<id>.log` and `<prefix>/<id>.kvs`:

- the log (the truth about the conversation, durability="turn"): put by the commit thread
  after a batch of turns is durable here and before those turns are acknowledged
  (`GroupCommit` calls `logs_changed`), so an acknowledged turn is in the store unless the
  put failed (logged: the turn is still acknowledged, the local log holding it, and the
  next put of that log carries it);
- the snapshot (its KV, and the whole session with durability="close"): put when it is
  written at close, before the log it replaces is removed there (`put`), and the files
  as they are when the session closes (`sync`);
- a session closed with delete=True: both removed from the store too.

Resuming a session fetches its files from the store first where the store's copy differs
from the one here (`fetch`: another machine continued it; a log here that extends the
store's is kept), into temporary names renamed into place, then resumes it as if this
process had written them: the log is replayed, the snapshot's KV attached or recomputed by
the cost model (blocks of its history that the object-store tier holds are loaded from
there). A session deleted elsewhere but still here is kept (nothing tells it from one
whose puts failed).
`llm.sessions()` lists the store's sessions too. Segments (KV written behind turns) stay
local: a session resumed elsewhere takes its KV from the snapshot, the tiers, or recompute.

Ownership across machines is the router's (a session is sticky to one replica; the lock
file is per machine): two processes writing one session at once through one store is not
prevented here. A store that is down or failing makes puts and fetches fail, logged with
credentials scrubbed; sessions keep working from the local directory. A session of which
nothing is here while the store cannot be read is refused (SessionStoreError), never
started anew over the store's copy.

The server's stored Responses (serve/openai_responses.py) go through a mirror of their own
under `<prefix>/responses/` (`put`, `fetch_file`, `delete`), so a chain continues on any
replica; listing sessions looks at the top level only.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from kvsession.errors import SessionStoreError, SnapshotError
from kvsession.tiers.files import atomic_write
from kvsession.tiers.object_store import Scrubber, open_store, public_url

log = logging.getLogger("kvsession")
SUFFIXES = (".log", ".kvs")
# puts of one commit batch in flight at once
PUT_CONCURRENCY = 8
# a batch's puts are waited for at most this long before its turns are acknowledged anyway
# (the client's own timeouts bound each request; this bounds the whole batch)
PUT_WAIT_S = 60.0


def local_root(url: str, cache_root: Path) -> Path:
    """The local session directory that mirrors `url` (one per store URL)."""
    digest = hashlib.blake2b(public_url(url).encode(), digest_size=8).hexdigest()
    return cache_root / "sessions" / digest


class SessionMirror:
    def __init__(self, url: str, options: dict):
        """Raises ConfigError when the store cannot be opened (tiers/object_store.py)."""
        self.store = open_store(url, options, "session_dir")
        import obstore

        self.obs, self.url = obstore, public_url(url)
        self.scrub = Scrubber(options)
        self.puts = ThreadPoolExecutor(PUT_CONCURRENCY, thread_name_prefix="kvs-mirror-put")
        self.errors = 0

    def close(self) -> None:
        self.puts.shutdown(wait=True, cancel_futures=False)

    # ---- putting -------------------------------------------------------------------------

    def logs_changed(self, written: list[Path], deleted: list[Path]) -> None:
        """Commit thread, a batch durable here: its logs put (concurrently) and deleted
        ones removed, waited for (bounded) before the batch's turns are acknowledged."""
        jobs = [self.puts.submit(self.put, p) for p in written] + \
            [self.puts.submit(self._delete, p.name) for p in deleted]
        for job in jobs:
            with contextlib.suppress(Exception):  # logged by the job; the wait is bounded
                job.result(timeout=PUT_WAIT_S)

    def sync(self, root: Path, session_id: str) -> None:
        """The session's files as they are here now: each put, or removed from the store
        where it is gone here."""
        for suffix in SUFFIXES:
            path = root / f"{session_id}{suffix}"
            if path.is_file():
                self.put(path)
            else:
                self._delete(path.name)

    def put(self, path: Path) -> bool:
        """One file put whole under its name (a snapshot just written). Returns whether it
        was."""
        return self._put(path, path.name)

    def put_file(self, root: Path, name: str) -> bool:
        """`root / name` put whole under `name` (a path below the prefix: a side file,
        side_files.py). Returns whether it was."""
        return self._put(root / name, name)

    def _put(self, path: Path, key: str) -> bool:
        try:
            data = path.read_bytes()
        except FileNotFoundError:
            return False  # removed since (its removal is mirrored by whoever removed it)
        except OSError as e:
            return self._failed(f"reading {path}: {e}")
        try:
            self.obs.put(self.store, key, data)
        except Exception as e:  # noqa: BLE001 - logged; the local file still holds it
            return self._failed(f"putting {key}: {e}")
        return True

    def _delete(self, name: str) -> bool:
        try:
            self.obs.delete(self.store, name)
        except FileNotFoundError:
            pass
        except Exception as e:  # noqa: BLE001 - a stale copy there; retried at the next sync
            return self._failed(f"deleting {name}: {e}")
        return True

    def _failed(self, what: str) -> bool:
        self.errors += 1
        log.warning("session store %s: %s", self.url, self.scrub(what))
        return False

    # ---- getting -------------------------------------------------------------------------

    def fetch(self, root: Path, session_id: str) -> bool:
        """The session's files from the store into `root` wherever the store's copy is not
        the one here (the caller holds the session's lock): another machine continued or
        closed the session since this one last had it. A log here that extends the store's
        is kept (a put that failed: this machine is ahead). Each file is written to a
        temporary name and renamed into place, the snapshot first (a log is the truth once
        it is there). A snapshot fetched where the store holds no log (the session was
        closed elsewhere) makes the log here, and its segment, an older state: removed.
        Returns whether any was fetched.

        A file the store could not give (down, failing, a transfer cut short) is taken from
        here, logged; where nothing of the session is here, SessionStoreError: whether it
        exists is unknown, and a new session under its id would replace the store's copy."""
        fetched, stored, unread = [], [], None
        for suffix in (".kvs", ".log"):
            name = f"{session_id}{suffix}"
            try:
                data = self._get(name)
            except Exception as e:  # noqa: BLE001 - resumed from what is here, if anything
                unread = self.scrub(f"getting {name}: {e}")
                self._failed(unread)
                continue
            if data is None:
                continue
            stored.append(suffix)
            path = root / name
            if _same_or_ahead(path, data, suffix == ".log"):
                continue
            if self._write(path, data):
                fetched.append(suffix)
        if unread is not None and not any(
                (root / f"{session_id}{suffix}").is_file() for suffix in SUFFIXES):
            raise SessionStoreError(
                f"session {session_id!r}: the session store {self.url} could not be read "
                f"({unread}) and this machine has no copy of it; retry once the store "
                f"answers")
        if ".kvs" in fetched and ".log" not in stored:
            # closed elsewhere since: its snapshot replaced its log there, so a log (and the
            # KV segment written behind it) here is an older state
            for stale in (f"{session_id}.log", f"{session_id}.seg"):
                with contextlib.suppress(FileNotFoundError):
                    (root / stale).unlink()
        return bool(fetched)

    def fetch_file(self, root: Path, name: str, max_bytes: int) -> bool:
        """One file of the store, `name`, into `root` (written whole, then renamed into
        place). Returns whether it is there now; False where the store has none, could not
        give it (logged) or holds more than `max_bytes` there (not read)."""
        try:
            data = self._get(name, max_bytes)
        except Exception as e:  # noqa: BLE001 - a miss for the caller
            return self._failed(f"getting {name}: {e}")
        return data is not None and self._write(root / name, data)

    def delete(self, name: str) -> bool:
        """One file removed from the store (gone here). Returns whether the store has none
        now."""
        return self._delete(name)

    def _get(self, name: str, max_bytes: int | None = None) -> memoryview | None:
        """The object's bytes; None when the store has none. Raises what the client raised
        for any other failure (a body cut short included), ValueError for an object over
        `max_bytes` (its size is read before its body)."""
        try:
            result = self.obs.get(self.store, name)
        except FileNotFoundError:
            return None
        if max_bytes is not None and result.meta["size"] > max_bytes:
            raise ValueError(f"{result.meta['size']} bytes, more than {max_bytes}")
        return memoryview(result.bytes())

    def _write(self, path: Path, data: memoryview) -> bool:
        """`data` written beside `path` and renamed into place (tiers/files.py): a reader
        sees the old file or the whole new one."""
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            atomic_write(path, lambda f: f.write(data))
        except (OSError, SnapshotError) as e:
            return self._failed(f"writing {path}: {e}")
        return True

    def session_ids(self) -> set[str]:
        """The ids of the sessions the store holds (empty when it cannot be listed). Only
        the top level is listed: folders below it (the server's stored responses) are not
        sessions."""
        ids = set()
        try:
            listing = self.obs.list_with_delimiter(self.store)
        except Exception as e:  # noqa: BLE001 - listed from here only
            self._failed(f"listing: {e}")
            return ids
        for meta in listing["objects"]:
            name = meta["path"].rsplit("/", 1)[-1]
            for suffix in SUFFIXES:
                if name.endswith(suffix) and not name.startswith("."):
                    ids.add(name[: -len(suffix)])
        return ids


def _same_or_ahead(path: Path, stored: memoryview, append_only: bool) -> bool:
    """Whether the file here is the store's copy, or (`append_only`: a log) extends it."""
    try:
        size = path.stat().st_size
    except FileNotFoundError:
        return False
    if size < len(stored) or (size > len(stored) and not append_only):
        return False
    with open(path, "rb") as f:
        return f.read(len(stored)) == stored
