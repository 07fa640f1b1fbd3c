"""A session's turn queue: its turns run one at a time, in call order, whatever threads or
asyncio tasks call them; and whether the session is open.

Contract:
- `enter()` takes the next place and returns (mine, the place before it, or None); the
  caller waits for the one before to be done, runs, then `leave(mine)`. A place is left
  exactly once. A caller that gives its place up early (a cancelled turn) leaves it only
  once the turn before it, or its own engine request, is done, so the turns after it still
  run in order.
- `enter(seal=True)` takes the last place: a later `enter` raises SessionClosedError (the
  LLM persisting the session at close: a turn run after the snapshot would be acknowledged
  and lost). `unseal()` if what it sealed for failed. The session's own close takes the
  last place too (`closing=True`): a send racing it is refused, never run on released KV.
- A `stream()` turn is registered from its start to its end (`open_stream`): either the
  stream decides its fate (`claim`: it finishes, or its caller closes it) or a close of
  the session takes it (`take_open_streams`: the turn is to be cancelled), never both. A
  stream its caller neither finishes nor closes would otherwise hold the queue for ever.
"""

from __future__ import annotations

import threading
from concurrent.futures import Future
from dataclasses import dataclass

from kvsession.engine.sequence import Sequence
from kvsession.errors import SessionClosedError


@dataclass(eq=False)
class OpenStream:
    """A stream() turn from its start to its end (`taken_by_close`: a close of the session
    took it; the turn is cancelled)."""

    seq: Sequence
    fut: Future
    mine: Future
    taken_by_close: bool = False


class TurnQueue:
    def __init__(self, session_id: str):
        self.session_id = session_id
        self._lock = threading.Lock()
        self._closed = False
        self._sealed = False
        self._last: Future | None = None
        self._in_flight = 0
        self._streams: set[OpenStream] = set()

    @property
    def closed(self) -> bool:
        return self._closed

    @property
    def in_flight(self) -> int:
        """Places taken and not left (turns queued or running)."""
        return self._in_flight

    def check_open(self) -> None:
        if self._closed or self._sealed:
            raise SessionClosedError(f"session {self.session_id!r} is closed"
                                     + (" (its LLM is closing)" if self._sealed else ""))

    def enter(self, seal: bool = False, closing: bool = False
              ) -> tuple[Future, Future | None]:
        """`closing`: the session's close takes the last place, sealed or not (the LLM's
        close may have sealed it); SessionClosedError only once it is closed."""
        with self._lock:
            if not (closing and not self._closed):
                self.check_open()
            if seal or closing:
                self._sealed = True
            mine: Future = Future()
            prev, self._last = self._last, mine
            self._in_flight += 1
            return mine, prev

    def leave(self, mine: Future) -> None:
        with self._lock:
            self._in_flight -= 1
        mine.set_result(None)

    def leave_after(self, done: Future, mine: Future) -> None:
        """Leave `mine` once `done` is (a turn given up before its end)."""
        done.add_done_callback(lambda _: self.leave(mine))

    def unseal(self) -> None:
        with self._lock:
            self._sealed = False

    def mark_closed(self) -> None:
        with self._lock:
            self._closed = True

    def open_stream(self, seq: Sequence, fut: Future, mine: Future) -> OpenStream:
        st = OpenStream(seq, fut, mine)
        with self._lock:
            self._streams.add(st)
        return st

    def claim(self, st: OpenStream) -> bool:
        """The stream's own decision on its turn; False when a close took it already.
        Idempotent for the stream."""
        with self._lock:
            if st.taken_by_close:
                return False
            self._streams.discard(st)
            return True

    def take_open_streams(self) -> list[OpenStream]:
        """The streams still open, now the close's (each to be cancelled)."""
        with self._lock:
            streams, self._streams = list(self._streams), set()
            for st in streams:
                st.taken_by_close = True
        return streams
