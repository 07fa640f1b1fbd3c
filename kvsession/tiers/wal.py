"""The session log: an append-only write-ahead log per session (`<session_id>.log`).

With `durability="turn"` the log is the truth about a session's conversation: every turn
appends one record (the messages it added, the token ids whose KV the session holds after
it, the turn's sampling parameters) and `send()` returns only once that record is fsynced
(kvsession/tiers/commit.py batches the fsyncs of concurrent sessions). KV blocks on disk
(snapshots, write-behind segments) are caches of it: they are matched to the log's tokens
block by block and anything that does not match is recomputed.

Layout (little endian):

    MAGIC (8) | u32 format version
    records, back to back: u32 payload length | u32 crc32(payload) | payload

A payload is msgpack of one of two typed records:

- `BaseRecord`: the session's whole state (identity of the engine that wrote it, system
  prompt, sampling defaults, every message, every token id). A log starts with one; a log
  that grew is rewritten as a single base record (atomically: temporary file, fsync,
  rename, fsync of the directory).
- `TurnRecord`: a delta: messages appended, `keep` (how many of the previous token ids
  stay: a re-rendered history can differ from the cached tokens) and the token ids after
  them, the turn's sampling, and a digest of the engine identity.

Records carry consecutive sequence numbers from the base on.

A log is untrusted input, like a snapshot: payload lengths are bounded before anything is
read (MAX_RECORD_BYTES), every field has an exact type and a bound checked before objects
are built (msgpack array and map headers state their lengths), and the replayed state is
bounded as it grows (tokens, and messages against tokens). Nothing is unpickled.

Recovery rules (`read_log`): the valid log is the longest prefix of intact frames. A frame
that runs past the end of the file, whose checksum does not match, or of length 0 (a
record is never empty: zeros are what a file system leaves when a crash kept an append's
size but not its data) ends the log: it is the torn tail of a write that was never
acknowledged (an acknowledged record was fsynced in full, and records are only ever
appended), and the owner cuts it away (tiers/recovery.py, which reports every cut: a
damaged last record that *was* acknowledged looks the same). Such a tail followed by an
intact record is not a torn write but damage in the middle: refused (SnapshotError), the
file left as it is. A frame that is intact but does not decode, or breaks the sequence, is
corruption, not a torn write: the log is refused rather than silently shortened. So is a
base record of another session than the one whose name the file bears.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import struct
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated

import msgspec

from kvsession.cache.identity import LOG_FIELDS, StorageIdentity
from kvsession.errors import SnapshotError
from kvsession.tiers.checksum import crc32
from kvsession.tiers.files import open_regular
from kvsession.tiers.snapshot_format import (
    MAX_EXTRA_MESSAGES,
    SESSION_ID_PATTERN,
    HistoryState,
    SamplingFields,
    StoredIdentity,
    TokenId,
)

LOG_MAGIC = b"KVSLOG\x00\x01"
LOG_VERSION = 1
LOG_PREFIX = LOG_MAGIC + struct.pack("<I", LOG_VERSION)
FRAME = struct.Struct("<II")
# a record holds one turn (or a whole session in a base record): 64 MiB is far above any
# real one, and bounds what one frame can make the reader allocate
MAX_RECORD_BYTES = 64 << 20
MAX_TOKENS = 1 << 22  # tokens in a session (max_model_len is far below)
MAX_MESSAGES_PER_RECORD = 1 << 16
MAX_MESSAGE_FIELDS = 32
IDENTITY_FIELDS = LOG_FIELDS  # (what Identity holds)

_Tokens = Annotated[list[TokenId], msgspec.Meta(max_length=MAX_TOKENS)]
_Message = Annotated[dict[Annotated[str, msgspec.Meta(max_length=256)], str],
                     msgspec.Meta(max_length=MAX_MESSAGE_FIELDS)]
_Messages = Annotated[list[_Message], msgspec.Meta(max_length=MAX_MESSAGES_PER_RECORD)]
_Seq = Annotated[int, msgspec.Meta(ge=1, lt=1 << 62)]


class Identity(StoredIdentity, frozen=True, forbid_unknown_fields=True):
    """The engine a log was written for: its KV must not be mixed with another's."""

    def digest(self) -> str:
        return hashlib.sha256(msgspec.msgpack.encode(self)).hexdigest()[:32]

    @classmethod
    def of(cls, identity: StorageIdentity | Identity) -> Identity:
        """The engine's storage identity as a log records it."""
        return identity if isinstance(identity, Identity) else cls(**identity.log_fields())


class BaseRecord(msgspec.Struct, frozen=True, tag="base"):
    seq: _Seq
    session_id: Annotated[str, msgspec.Meta(pattern=f"^{SESSION_ID_PATTERN}$")]
    identity: Identity
    unix_s: Annotated[float, msgspec.Meta(ge=0.0, le=1e11)]
    system: str | None
    sampling: SamplingFields
    messages: _Messages
    tokens: _Tokens
    # the history mode (append: `tokens` is the session's token log) and the messages not
    # rendered into it; None in logs written before it existed (template mode)
    history: HistoryState | None = None


class TurnRecord(msgspec.Struct, frozen=True, tag="turn"):
    seq: _Seq
    identity_digest: Annotated[str, msgspec.Meta(pattern="^[0-9a-f]{32}$")]
    unix_s: Annotated[float, msgspec.Meta(ge=0.0, le=1e11)]
    messages: _Messages
    keep: Annotated[int, msgspec.Meta(ge=0, le=MAX_TOKENS)]
    tokens: _Tokens
    sampling: SamplingFields
    pending: Annotated[int, msgspec.Meta(ge=0, le=1 << 16)] = 0  # as HistoryState.pending


Record = BaseRecord | TurnRecord
_DECODER = msgspec.msgpack.Decoder(Record)
_ENCODER = msgspec.msgpack.Encoder()


@dataclass
class LogState:
    """A session as its log says it is after the last record."""

    session_id: str
    identity: Identity
    system: str | None
    sampling: dict
    messages: list[dict]
    tokens: list[int]
    seq: int
    num_records: int = 0
    history: str = "template"  # HistoryMode value
    pending: int = 0
    tools: str = ""  # JSON text, as HistoryState
    template_kwargs: str = ""
    sampling_per_turn: list[dict] = field(default_factory=list, repr=False)


@dataclass
class LogScan:
    """What reading a log found: the state (None: no intact record), where the intact
    records end, the file's size (bytes past `end` are a torn tail); for a torn tail, the
    records begun in it (frame headers with a length) and why the first of its bytes is no
    intact record."""

    state: LogState | None
    end: int
    size: int
    dropped_records: int = 0
    cause: str = ""

    @property
    def torn(self) -> bool:
        return self.size > self.end


def sampling_struct(path: Path, sampling: dict) -> SamplingFields:
    """The sampling fields as the log stores them (typed: what the reader accepts)."""
    try:
        return msgspec.convert({k: v for k, v in sampling.items()
                                if k in SamplingFields.__struct_fields__}, SamplingFields)
    except msgspec.ValidationError as e:
        raise SnapshotError(f"{path}: sampling parameters not storable: {e}") from None


def sampling_dict(s: SamplingFields) -> dict:
    return {k: v for k, v in msgspec.structs.asdict(s).items() if v is not msgspec.UNSET}


def frame(payload: bytes) -> bytes:
    if len(payload) > MAX_RECORD_BYTES:
        raise SnapshotError(f"a log record of {len(payload)} bytes is over the "
                            f"{MAX_RECORD_BYTES}-byte limit")
    return FRAME.pack(len(payload), crc32(payload)) + payload


def encode(record: BaseRecord | TurnRecord) -> bytes:
    """One framed record (what is appended to the file)."""
    return frame(_ENCODER.encode(record))


def _apply(path: Path, state: LogState | None, rec, expect: Identity | None) -> LogState:
    if isinstance(rec, BaseRecord):
        if state is not None and rec.seq != state.seq + 1:
            raise SnapshotError(f"{path}: record {rec.seq} follows record {state.seq}")
        if expect is not None:
            for name in IDENTITY_FIELDS:
                got, want = getattr(rec.identity, name), getattr(expect, name)
                if got != want:
                    raise SnapshotError(f"{path}: written for another "
                                        f"{name.replace('_', ' ')} ({got!r}, this engine "
                                        f"has {want!r})")
        new = LogState(rec.session_id, rec.identity, rec.system, sampling_dict(rec.sampling),
                       list(rec.messages), list(rec.tokens), rec.seq)
        if rec.history is not None:
            new.history, new.pending = rec.history.mode, rec.history.pending
            new.tools, new.template_kwargs = rec.history.tools, rec.history.template_kwargs
    else:
        if state is None:
            raise SnapshotError(f"{path}: the log does not start with a base record")
        if rec.seq != state.seq + 1:
            raise SnapshotError(f"{path}: record {rec.seq} follows record {state.seq}")
        if rec.identity_digest != state.identity.digest():
            raise SnapshotError(f"{path}: record {rec.seq} was written by another engine")
        if rec.keep > len(state.tokens):
            raise SnapshotError(f"{path}: record {rec.seq} keeps {rec.keep} of "
                                f"{len(state.tokens)} tokens")
        new = state
        del new.tokens[rec.keep:]
        new.tokens += rec.tokens
        new.messages += rec.messages
        new.seq = rec.seq
        new.pending = rec.pending
        new.sampling_per_turn.append(sampling_dict(rec.sampling))
        del new.sampling_per_turn[:-64]
    if len(new.tokens) > MAX_TOKENS:
        raise SnapshotError(f"{path}: more than {MAX_TOKENS} tokens (corrupted or crafted)")
    if len(new.messages) > MAX_EXTRA_MESSAGES + len(new.tokens):
        raise SnapshotError(f"{path}: {len(new.messages)} messages for {len(new.tokens)} "
                            f"tokens (corrupted or crafted)")
    new.num_records += 1
    return new


def _read_exact(fd: int, n: int, offset: int) -> bytes:
    out = os.pread(fd, n, offset)
    while len(out) < n:
        more = os.pread(fd, n - len(out), offset + len(out))
        if not more:
            break
        out += more
    return out


def read_log(path: Path, expect: StorageIdentity | Identity | None = None,
             session_id: str | None = None) -> LogScan:
    """Replay a log (see the module docstring for the rules). Reads record by record: the
    memory used is the replayed state plus one record. session_id: the session the file is
    the log of (its name): a base record of another session is refused (a copy of another
    session's log must not resume as this one)."""
    path = Path(path)
    with open_regular(path) as f:
        fd = f.fileno()
        try:
            size = os.fstat(fd).st_size
            head = _read_exact(fd, len(LOG_PREFIX), 0)
        except OSError as e:
            raise SnapshotError(f"{path}: cannot read: {e}") from None
        # a log is created whole (its base record written to a temporary file, fsynced,
        # renamed in): a file without a whole header, or zeros where it should be, is one
        # whose data did not reach the disk before a crash (the rename did), or a cut file
        if not any(head) or (len(head) < len(LOG_PREFIX) and LOG_PREFIX.startswith(head)):
            _refuse_if_intact_after(path, fd, 0, size)
            return LogScan(None, 0, size, 0, "no whole log header" if any(head)
                           else "zeros where the log header should be")
        if len(head) < len(LOG_PREFIX):
            raise SnapshotError(f"{path}: not a kvsession log (bad magic)")
        if head[:len(LOG_MAGIC)] != LOG_MAGIC:
            raise SnapshotError(f"{path}: not a kvsession log (bad magic)")
        if head != LOG_PREFIX:
            raise SnapshotError(f"{path}: unknown log format version "
                                f"{struct.unpack('<I', head[len(LOG_MAGIC):])[0]}")
        state, pos, cause = None, len(LOG_PREFIX), ""
        while pos + FRAME.size <= size:
            try:
                length, crc = FRAME.unpack(_read_exact(fd, FRAME.size, pos))
                # a record is never empty: a frame of length 0 (crc32 of nothing is 0, so
                # it "checks") is a tail of zeros, the size of an append that reached the
                # disk before its data (XFS, ext4 data=writeback, network file systems)
                if length == 0 or length > MAX_RECORD_BYTES or \
                        pos + FRAME.size + length > size:
                    cause = ("zeros" if length == 0 else
                             f"a frame of {length} bytes runs past the end")
                    _refuse_if_intact_after(path, fd, pos, size)
                    break  # runs past the end (torn), a torn length field, or zeros
                payload = _read_exact(fd, length, pos + FRAME.size)
            except OSError as e:
                raise SnapshotError(f"{path}: cannot read: {e}") from None
            if len(payload) != length or crc32(payload) != crc:
                cause = "a checksum mismatch"
                _refuse_if_intact_after(path, fd, pos, size)
                break  # torn
            try:
                rec = _DECODER.decode(payload)
            except (msgspec.MsgspecError, RecursionError, ValueError) as e:
                raise SnapshotError(f"{path}: malformed record at byte {pos}: {e}") from None
            if session_id is not None and isinstance(rec, BaseRecord) and \
                    rec.session_id != session_id:
                raise SnapshotError(f"{path}: the log of session {rec.session_id!r}, not of "
                                    f"{session_id!r} (a copy of another session's log?); "
                                    f"the file is left as it is")
            state = _apply(path, state, rec, expect)
            pos += FRAME.size + length
        if pos < size and not cause:
            cause = f"{size - pos} bytes, less than a frame header"
        dropped = _frames_begun(fd, pos, size) if pos < size else 0
        if state is None:
            return LogScan(None, len(LOG_PREFIX) if pos >= len(LOG_PREFIX) else 0, size,
                           dropped, f"the first record at byte {pos}: {cause}" if cause
                           else "no record")
        return LogScan(state, pos, size, dropped,
                       f"the record at byte {pos}: {cause}" if cause else "")


def _frames_begun(fd: int, pos: int, size: int) -> int:
    """The records begun in a torn tail [pos, size): frame headers with a length, followed
    from one to the next (a tail of zeros begins none). Reads only the headers."""
    count = 0
    while pos + FRAME.size <= size:
        try:
            length, _ = FRAME.unpack(_read_exact(fd, FRAME.size, pos))
        except OSError:
            break
        if length == 0:
            break
        count += 1
        pos += FRAME.size + length
    if count == 0 and pos < size:
        try:  # a cut inside a frame header: a record was begun when its bytes are not zeros
            count = int(any(_read_exact(fd, size - pos, pos)))
        except OSError:
            pass
    return count


def _refuse_if_intact_after(path: Path, fd: int, pos: int, size: int) -> None:
    """The frame at `pos` is bad. Only the last record can be torn (an acknowledged record
    was fsynced whole, and records are only appended): an intact record after it means
    corruption (bit rot, a stray write), and cutting the log there would destroy
    acknowledged turns. SnapshotError then, the file left as it is. (Reads the rest of
    the file: after a torn append, at most one record's bytes.)"""
    try:
        tail = _read_exact(fd, size - pos, pos)
    except OSError as e:
        raise SnapshotError(f"{path}: cannot read: {e}") from None
    for off in range(1, len(tail) - FRAME.size + 1):
        length, crc = FRAME.unpack_from(tail, off)
        end = off + FRAME.size + length
        # (records are never empty: a run of zeros is no frame)
        if 0 < length <= MAX_RECORD_BYTES and end <= len(tail) and \
                crc32(tail[off + FRAME.size:end]) == crc:
            try:
                _DECODER.decode(tail[off + FRAME.size:end])
            except (msgspec.MsgspecError, RecursionError, ValueError):
                continue
            raise SnapshotError(f"{path}: the record at byte {pos} is corrupted, and an "
                                f"intact one follows at byte {pos + off}: not a torn "
                                f"append; the log is left as it is")


def truncate(path: Path, end: int) -> None:
    """Cut a torn tail off (the caller owns the session: its lock is held) and make the
    new length durable."""
    try:
        fd = os.open(path, os.O_WRONLY | getattr(os, "O_CLOEXEC", 0))
        try:
            os.ftruncate(fd, end)
            os.fsync(fd)
        finally:
            os.close(fd)
    except OSError as e:
        raise SnapshotError(f"{path}: cannot truncate its torn tail: {e}") from None


def base_record(session_id: str, seq: int, identity: Identity, system: str | None,
                sampling: SamplingFields, messages: list[dict], tokens,
                history: HistoryState) -> BaseRecord:
    return BaseRecord(seq=seq, session_id=session_id, identity=identity, unix_s=time.time(),
                      system=system, sampling=sampling, messages=list(messages),
                      tokens=list(tokens), history=history)


def history_struct(path: Path, history: dict) -> HistoryState:
    try:
        return msgspec.convert(history, HistoryState)
    except msgspec.ValidationError as e:
        raise SnapshotError(f"{path}: history not storable: {e}") from None


def turn_record(seq: int, identity: Identity, messages: list[dict], keep: int, tokens,
                sampling: SamplingFields, pending: int) -> TurnRecord:
    return TurnRecord(seq=seq, identity_digest=identity.digest(), unix_s=time.time(),
                      messages=list(messages), keep=keep, tokens=list(tokens),
                      sampling=sampling, pending=pending)


def remove_quietly(path: Path) -> None:
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)
