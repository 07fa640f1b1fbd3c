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
  as they are when the session closes (`sync`, snapshot first). Where the snapshot could
  not be put, the log stays there (`unsent`): the store keeps an older state whole, and
  the next sync retries both;
- a session closed with delete=True: both removed from the store too.

Beside a session's files, `<id>.synced` records the store's version (etag) of each as this
machine last put, fetched or removed it (`SYNCED`; a hint, rewritten without fsync).
Resuming a session asks the store for each file here unless it still holds that version
(a conditional get: where it does, nothing is read, and the file here, that version or
newer, is resumed); a file that changed there (another machine continued or closed the session)
is fetched, unless it is a log that the one here extends (a put that failed: this machine
is ahead), into a temporary name renamed into place, the snapshot first; then the session
is resumed as if this process had written them: the log is replayed, the snapshot's KV
attached or recomputed by the cost model (blocks of its history that the object-store tier
holds are loaded from there). Without the record, the store's copy is compared by content.
A session deleted elsewhere but still here is kept (nothing tells it from one whose puts
failed).
`llm.sessions()` lists the store's sessions too. Segments (KV written behind turns) stay
local: a session resumed elsewhere takes its KV from the snapshot, the tiers, or recompute.

Ownership across machines: the router keeps a session on one replica (the lock file is per
machine), and the store fences a second writer. Every put of a session's file is
conditional on the version this process last read or wrote there (`versions`: If-Match,
or If-None-Match where it had none), so a session another process continued since is never
overwritten: the put is refused, the session is fenced here (`check_owner`: its next turn
is a SessionLockedError; nothing more of it is put or removed from here) and the store
keeps the other's. A put whose answer was lost (the store has the new version, this process
does not know it) is told apart by content: the store's copy is this process's own log's
prefix (or its own snapshot), so it is adopted and put again. A close checks the store's
log first (`_log_still_ours`): a process that lost the session (a replica taken for dead)
neither puts its snapshot nor removes the new owner's log. Deletes are unconditional in
stores, so only a put landing between that check and the delete is lost with it. Stores
without conditional puts (file://) overwrite, unfenced. A store that is down or failing makes puts
and fetches fail, logged with credentials scrubbed; sessions keep working from the local
directory. A session of which nothing is here while the store cannot be read is refused
(SessionStoreError), never started anew over the store's copy.

Side files (side_files.py: `<folder>/<file>`, the server's stored Responses among them) go
to the same store under their names (`put_file`, `refresh_file`, `delete`; the last writer
wins; a read asks the store whether its copy changed), so a Responses chain continues on
any replica; listing sessions looks at the top level only.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from kvsession.errors import SessionLockedError, SessionStoreError, SnapshotError
from kvsession.tiers.files import atomic_write
from kvsession.tiers.object_store import Scrubber, open_store, public_url

log = logging.getLogger("kvsession")
SUFFIXES = (".log", ".kvs")
# beside a session's files here: the store's versions of them as this machine last put,
# fetched or removed them (JSON; a hint, rewritten without fsync: lost, the store's copy is
# compared by content instead)
SYNCED = ".synced"
# a conditional get's answer: the store's copy is the version this machine last synced
_UNCHANGED = object()
# puts of one commit batch in flight at once
PUT_CONCURRENCY = 8
# a batch's puts are waited for at most this long before its turns are acknowledged anyway
# (the client's own timeouts bound each request; this bounds the whole batch)
PUT_WAIT_S = 60.0


def local_root(url: str, cache_root: Path, options: dict | None = None) -> Path:
    """The local session directory that mirrors `url` (one per store: the URL and the
    endpoint the options name, so one bucket name on two servers is two stores; where
    the endpoint comes from the environment, one per URL)."""
    endpoint = sorted(str(v) for k, v in (options or {}).items()
                      if "endpoint" in k.lower() and v is not None)
    name = "\n".join([public_url(url), *endpoint])
    digest = hashlib.blake2b(name.encode(), digest_size=8).hexdigest()
    return cache_root / "sessions" / digest


class SessionMirror:
    def __init__(self, url: str, options: dict):
        """Raises ConfigError when the store cannot be opened (tiers/object_store.py)."""
        self.store = open_store(url, options, "session_dir")
        import obstore
        from obstore.exceptions import AlreadyExistsError, NotModifiedError, PreconditionError

        self.obs, self.url = obstore, public_url(url)
        self.scrub = Scrubber(options)
        self.puts = ThreadPoolExecutor(PUT_CONCURRENCY, thread_name_prefix="kvs-mirror-put")
        self.errors = 0
        # a session's file in the store -> the version (etag) this process last read or
        # wrote there, None: it had none there. Its next put is conditional on that version
        # ("create" where it had none), so a session another process wrote since is never
        # overwritten: the put fails and the session is fenced here.
        self.versions: dict[str, str | None] = {}
        self.fenced: set[str] = set()
        self._lost = (PreconditionError, AlreadyExistsError)
        self._unchanged = NotModifiedError
        # sessions whose snapshot, written here, could not be put there: their logs stay
        self.unsent: set[str] = set()
        self._lock = threading.Lock()  # (SYNCED files: one writer at a time)
        # False once the store refused a conditional put as unsupported (file://): puts
        # overwrite, unfenced
        self.conditional = True

    def close(self) -> None:
        self.puts.shutdown(wait=True, cancel_futures=False)

    # ---- ownership -----------------------------------------------------------------------

    def check_owner(self, session_id: str) -> None:
        """Raises SessionLockedError when another process wrote the session in the store
        since this one read it (a turn's put found a newer version there)."""
        if session_id in self.fenced:
            raise SessionLockedError(
                f"session {session_id!r} was continued by another process through the "
                f"store {self.url} since this one resumed it: close this Session (its turns "
                f"since then stay in the local log only) and resume it to continue from the "
                f"store's copy")

    def _fence(self, key: str) -> None:
        session_id = _session_of(key)
        if session_id not in self.fenced:  # (two threads racing here only log it twice)
            self.fenced.add(session_id)
            log.error("session store %s: %s was written by another process since this one "
                      "read it; nothing more of session %r is put or removed there from "
                      "this process, and its next turn here is refused", self.url, key,
                      session_id)

    # ---- putting -------------------------------------------------------------------------

    def logs_changed(self, written: list[Path], deleted: list[Path]) -> None:
        """Commit thread, a batch durable here: its logs put (concurrently) and deleted
        ones removed, waited for (bounded) before the batch's turns are acknowledged."""
        jobs = [self.puts.submit(self.put, p) for p in written] + \
            [self.puts.submit(self._delete, p.name, p.parent) for p in deleted]
        for job in jobs:
            with contextlib.suppress(Exception):  # logged by the job; the wait is bounded
                job.result(timeout=PUT_WAIT_S)

    def sync(self, root: Path, session_id: str) -> None:
        """The session's files as they are here now: each put, or removed from the store
        where it is gone here (the snapshot first: a log goes only once the snapshot that
        replaced it is there)."""
        for suffix in (".kvs", ".log"):
            path = root / f"{session_id}{suffix}"
            if path.is_file():
                self.put(path)
            else:
                self._delete(path.name, root)

    def put(self, path: Path) -> bool:
        """One of a session's files put whole under its name (a log after a commit, a
        snapshot just written), conditional on the version this process knows there.
        Returns whether it was."""
        return self._put(path, path.name, guarded=True)

    def put_file(self, root: Path, name: str) -> bool:
        """`root / name` put whole under `name` (a path below the prefix: a side file,
        side_files.py; the last writer wins). Returns whether it was."""
        return self._put(root / name, name, guarded=False)

    def _put(self, path: Path, key: str, guarded: bool) -> bool:
        if guarded and _session_of(key) in self.fenced:
            return False  # another process's now: never overwritten from here
        if guarded and key.endswith(".kvs") and not self._log_still_ours(_session_of(key)):
            return False  # (a close's snapshot: the session was continued elsewhere)
        try:
            data = path.read_bytes()
        except FileNotFoundError:
            return False  # removed since (its removal is mirrored by whoever removed it)
        except OSError as e:
            return self._failed(f"reading {path}: {e}")
        try:
            for attempt in range(2):
                mode = "overwrite"
                if guarded and self.conditional and key in self.versions:
                    known = self.versions[key]
                    mode = "create" if known is None else {"e_tag": known}
                try:
                    result = self.obs.put(self.store, key, data, mode=mode)
                    break
                except NotImplementedError:  # (file://): no conditional puts, no fencing
                    self.conditional = False
                    result = self.obs.put(self.store, key, data)
                    break
                except (*self._lost, FileNotFoundError) as e:
                    if isinstance(e, FileNotFoundError) and not isinstance(mode, dict):
                        raise  # (no bucket: not a version's question)
                    # the store's version is not the one this process knows (or the object
                    # is gone): its own put whose answer was lost (then the store's copy is
                    # one this process wrote: adopted, and put again), or another process's
                    stored, version = self._get_versioned(key)
                    if attempt or not _ours(data, stored, key.endswith(".log")):
                        self._fence(key)
                        return False
                    self.versions[key] = version
        except Exception as e:  # noqa: BLE001 - logged; the local file still holds it
            if guarded and key.endswith(".kvs"):
                self.unsent.add(_session_of(key))  # its log stays there (`_delete`)
            return self._failed(f"putting {key}: {e}")
        self.versions[key] = result.get("e_tag")
        if guarded:
            self.unsent.discard(_session_of(key))
            self._save_synced(path.parent, _session_of(key))
        return True

    def _delete(self, name: str, root: Path | None = None) -> bool:
        """Remove a file from the store (gone here). A session's (`root`: where it was)
        stays while the session is fenced, and its log stays while the snapshot that
        replaced it here could not be put there (the store keeps an older state whole;
        the next sync retries both) or while the store's log is not the one this process
        last put (`_log_still_ours`). (Stores delete unconditionally: only a put by
        another process between that check and this delete is removed with it.)"""
        sid = _session_of(name)
        if root is not None and (sid in self.fenced or (
                name.endswith(".log") and sid in self.unsent)):
            return False
        if root is not None and name.endswith(".log") and not self._log_still_ours(sid):
            return False
        try:
            self.obs.delete(self.store, name)
        except FileNotFoundError:
            pass
        except Exception as e:  # noqa: BLE001 - a stale copy there; retried at the next sync
            return self._failed(f"deleting {name}: {e}")
        self.versions[name] = None
        if root is not None:
            self._save_synced(root, sid)
        return True

    def _log_still_ours(self, session_id: str) -> bool:
        """Before a close's snapshot put and log removal (stores delete unconditionally):
        whether the store's log is still the version this process last put or read. One
        another process wrote since fences the session here (False); so the close of a
        process that lost the session (a replica taken for dead) neither shadows nor
        removes the new owner's log. True where this process knows no version of it, or
        the store has none or cannot be asked (the snapshot's own put is conditional)."""
        log_name = f"{session_id}.log"
        known = self.versions.get(log_name)
        if not isinstance(known, str) or not self.conditional:
            return True
        try:
            version = self.obs.head(self.store, log_name).get("e_tag")
        except Exception:  # noqa: BLE001 - none there, or unknown: the puts decide
            return True
        if version == known:
            return True
        self._fence(log_name)
        return False

    def _load_synced(self, root: Path, session_id: str) -> None:
        """The versions this machine last synced of the session's files (its `SYNCED`
        file), where this process knows none."""
        names = [f"{session_id}{suffix}" for suffix in SUFFIXES]
        if all(n in self.versions for n in names):
            return
        try:
            record = json.loads((root / f"{session_id}{SYNCED}").read_bytes()[:4096])
        except (OSError, ValueError):
            return
        if not isinstance(record, dict):
            return
        for n in names:
            v = record.get(n, "")
            if n not in self.versions and (v is None or (isinstance(v, str) and v)):
                self.versions[n] = v

    def _save_synced(self, root: Path, session_id: str) -> None:
        """Record the versions of the session's files (removed once it has none here or
        there)."""
        names = [f"{session_id}{suffix}" for suffix in SUFFIXES]
        record = {n: self.versions[n] for n in names if n in self.versions}
        path = root / f"{session_id}{SYNCED}"
        gone = not any(record.values()) and not any((root / n).exists() for n in names)
        with self._lock, contextlib.suppress(OSError):  # a hint (SYNCED)
            if gone:
                path.unlink(missing_ok=True)
                return
            tmp = root / f".{path.name}.{threading.get_ident()}.tmp"
            tmp.write_text(json.dumps(record))
            os.replace(tmp, path)

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
        self.fenced.discard(session_id)  # read again: the store's copy is the one resumed
        self._load_synced(root, session_id)
        for suffix in (".kvs", ".log"):
            name = f"{session_id}{suffix}"
            # the version this machine last synced: where the store still holds it, the
            # file here is that or newer (a put that failed), so nothing is read (a file
            # gone here, e.g. a torn log recovery removed, is read again)
            known = self.versions.pop(name, None)  # (unknown until read: puts overwrite)
            unless = known if (root / name).is_file() else None
            try:
                data, self.versions[name] = self._get_versioned(name, unless=unless)
            except Exception as e:  # noqa: BLE001 - resumed from what is here, if anything
                unread = self.scrub(f"getting {name}: {e}")
                self._failed(unread)
                continue
            if data is None:
                continue
            stored.append(suffix)
            if data is _UNCHANGED:
                continue
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
        if unread is None:
            self._save_synced(root, session_id)
        return bool(fetched)

    def refresh_file(self, root: Path, name: str, max_bytes: int) -> None:
        """`root / name` made the store's `name` where the store's changed since this
        process last put or read it (a conditional get where there is a copy here): fetched
        (written whole, then renamed into place), or removed here where another process
        removed it there. A copy here the store never had (its put failed) stays; so does
        any copy while the store cannot be read (logged), or holds more than `max_bytes`
        there."""
        path = root / name
        known = self.versions.get(name) if path.is_file() else None
        try:
            data, version = self._get_versioned(name, max_bytes, unless=known)
        except Exception as e:  # noqa: BLE001 - the copy here, if any, stands
            self._failed(f"getting {name}: {e}")
            return
        if data is _UNCHANGED:
            return
        if data is None:
            if known is not None:  # removed there since this process had it
                with contextlib.suppress(FileNotFoundError):
                    path.unlink()
                self.versions[name] = None
            return
        if self._write(path, data):
            self.versions[name] = version

    def delete(self, name: str) -> bool:
        """One file removed from the store (gone here). Returns whether the store has none
        now."""
        return self._delete(name)

    def _get_versioned(self, name: str, max_bytes: int | None = None,
                       unless: str | None = None) -> tuple[object, str | None]:
        """(the object's bytes, its version there); (None, None) where the store has none;
        with `unless`, a version: (_UNCHANGED, it) where the store still holds that one (a
        conditional get: nothing read). Raises what the client raised for any other
        failure (a body cut short included), ValueError for an object over `max_bytes`
        (its size is read before its body)."""
        try:
            result = self.obs.get(self.store, name,
                                  options={"if_none_match": unless} if unless else None)
        except FileNotFoundError:
            return None, None
        except self._unchanged:
            return _UNCHANGED, unless
        if max_bytes is not None and result.meta["size"] > max_bytes:
            raise ValueError(f"{result.meta['size']} bytes, more than {max_bytes}")
        return memoryview(result.bytes()), result.meta.get("e_tag")

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


def _session_of(name: str) -> str:
    """The session id a session's file name (`<id>.log`, `<id>.kvs`) names."""
    return name.rsplit(".", 1)[0]


def _ours(data: bytes, stored: memoryview | None, append_only: bool) -> bool:
    """Whether the store's copy is one this process wrote on its way to `data`: the same
    bytes, or (`append_only`: a log) a prefix of them."""
    if stored is None:
        return False
    return bytes(stored) == (data[:len(stored)] if append_only else data)


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
