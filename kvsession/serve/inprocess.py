"""The server's routes inside the caller's process: httpx transports that hand each request
to the Starlette app (serve/app.py) over ASGI, with no socket, and stream each response's
body as the app produces it.

Why the app itself: an OpenAI-shaped client inside an agent app must mean what the server
means (a conversation continued on its Session, tools, structured output, the Responses
and Anthropic Messages APIs, agent hints, errors as the protocols' error objects); one code
path serves both, so they cannot drift. What is saved against HTTP on localhost: the
socket, the second process, the port.

Why not `httpx.ASGITransport`: it collects the whole response before returning it, so a
stream arrives in one piece at the end. Here the response returns at the app's
`http.response.start`, and each body chunk (one server-sent event) crosses as it is sent.

Concurrency contract:
- `AsyncTransport` runs the app as a task of the caller's event loop (its blocking calls go
  to that loop's default executor, as `asyncio.to_thread` does in the server).
- `Transport` (synchronous) runs it on an event loop of its own, in one daemon thread per
  InProcessServer (its default executor sized for `max_concurrent` requests, as `serve`
  sizes uvicorn's); each body chunk is one hop from that loop to the caller's thread.
- Between the app and the reader, body chunks wait in a bounded queue (BODY_QUEUE): a
  reader that stops reading stops the app at its next chunk, as a socket's buffer would.
- Every wait has a bound: httpx's read timeout for each chunk and for the response head
  (None where the caller set none, as with a socket); closing a response early is the
  client going away: the app receives `http.disconnect`, and a streamed request is
  cancelled (a session turn at its next token, its session as before the turn).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import threading
from collections.abc import AsyncIterator, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import NamedTuple

import httpx

from kvsession import LLM
from kvsession.serve.app import Server

log = logging.getLogger("kvsession.serve")

BASE_URL = "http://kvsession"  # any host: requests never leave the process
BODY_QUEUE = 64  # body chunks in flight between the app and its reader
CLOSE_BOUND_S = 30.0  # how long closing waits for the app's own end, and the loop thread's


class InProcessServer:
    """The server (serve/app.py `Server`) over `llm`, reached through `transport()` or
    `async_transport()` instead of a socket. One InProcessServer keeps one table of
    conversations: clients that should share sessions share it.

    `model_name`: the name requests must give (404 otherwise, as `serve
    --served-model-name`); None: any name is this LLM (in process there is one model, and
    frameworks send whatever name they were configured with)."""

    def __init__(self, llm: LLM, model_name: str | None = None, *,
                 max_concurrent: int = 256, max_conversations: int = 256,
                 default_max_tokens: int | None = None, session_dir: str | None = None):
        self.server = Server(llm, model_name or Path(llm.config.model).name, None,
                             max_concurrent, max_conversations, default_max_tokens,
                             session_dir=session_dir, any_model_name=model_name is None)
        self.app = self.server.app()
        self.max_concurrent = max_concurrent
        self._loop: _LoopThread | None = None  # the synchronous transport's, at first use
        self._lock = threading.Lock()

    @property
    def requests_in_flight(self) -> int:
        return self.server.in_flight

    def transport(self, http=httpx) -> Transport:
        """A synchronous transport (`httpx.Client(transport=...)`). `http`: the httpx
        package the client is of: httpx, or one with its API under another name (the
        `anthropic` SDK 2.x takes `httpx2` clients)."""
        return _classes(http).Transport(self, http)

    def async_transport(self, http=httpx) -> AsyncTransport:
        """An asynchronous transport (`httpx.AsyncClient(transport=...)`); `http` as
        `transport`'s."""
        return _classes(http).AsyncTransport(self, http)

    def loop(self) -> _LoopThread:
        with self._lock:
            if self._loop is None:
                self._loop = _LoopThread(self.max_concurrent + 4)
            return self._loop

    def close(self) -> None:
        """No more requests; the conversations' sessions closed (named ones persist to
        `session_dir`, as at a server's shutdown); the loop thread stopped. The LLM stays
        open: it is the caller's."""
        self.server.accepting = False
        self.server.conversations.close_all()
        with self._lock:
            loop, self._loop = self._loop, None
        if loop is not None:
            loop.close()

    async def call(self, request, body: bytes, read_timeout_s: float | None, http=httpx):
        """`request` (an `http` Request, its `body` read) answered by the app in the
        running loop: the response once its head is sent, its body streaming after
        (`_Body`)."""
        url = request.url
        scope = {
            "type": "http", "asgi": {"version": "3.0", "spec_version": "2.3"},
            "http_version": "1.1", "method": request.method, "scheme": url.scheme,
            "path": url.path, "raw_path": url.raw_path.split(b"?")[0],
            "query_string": url.query, "root_path": "",
            "headers": [(k.lower(), v) for k, v in request.headers.raw],
            "client": ("127.0.0.1", 0), "server": (url.host, url.port or 80),
        }
        body_ = _classes(http).Body(read_timeout_s, http)
        received = False

        async def receive() -> dict:
            nonlocal received
            if not received:
                received = True
                return {"type": "http.request", "body": body, "more_body": False}
            await body_.gone.wait()  # the next message is the client leaving
            return {"type": "http.disconnect"}

        task = asyncio.ensure_future(self.app(scope, receive, body_.send))
        task.add_done_callback(body_.app_ended)
        body_.task = task
        status, headers = await body_.head()
        return http.Response(status, headers=headers, stream=body_, request=request)


class _Body:
    """One response between the app (`send`) and its reader: the head once sent, then the
    body chunks through a bounded queue; `aclose` is the client going away. (An `http`
    AsyncByteStream: `_classes`.)"""

    def __init__(self, read_timeout_s: float | None, http):
        self.read_timeout_s, self.http = read_timeout_s, http
        self.started: asyncio.Future = asyncio.get_running_loop().create_future()
        self.chunks: asyncio.Queue = asyncio.Queue(BODY_QUEUE)
        self.gone = asyncio.Event()
        self.ended = False  # the last chunk was read
        self.task: asyncio.Future | None = None

    async def send(self, message: dict) -> None:
        if message["type"] == "http.response.start":
            if not self.started.done():
                self.started.set_result((message["status"], message.get("headers", [])))
        elif message["type"] == "http.response.body" and not self.gone.is_set():
            if message.get("body"):
                await self.chunks.put(message["body"])
            if not message.get("more_body", False):
                await self.chunks.put(None)

    def app_ended(self, task: asyncio.Future) -> None:
        """The app's task is over: an answer it never started is an error for the caller;
        one it raised after answering (Starlette re-raises after its 500) is logged, as
        uvicorn does; either way the reader is not left waiting."""
        error = None if task.cancelled() else task.exception()
        if not self.started.done():
            self.started.set_exception(error or RuntimeError(
                "the kvsession app ended without answering"))
        elif error is not None:
            log.error("in-process request failed after its answer started",
                      exc_info=error)
        with contextlib.suppress(asyncio.QueueFull):
            self.chunks.put_nowait(None)

    async def head(self) -> tuple[int, list]:
        """The response's status and headers once the app sends them. Past the read
        timeout the request is given up (the app sees the client leave) and
        the client's ReadTimeout raised."""
        try:
            return await asyncio.wait_for(asyncio.shield(self.started), self.read_timeout_s)
        except TimeoutError:
            self.gone.set()
            raise self.http.ReadTimeout("no answer from the in-process kvsession app "
                                        f"within {self.read_timeout_s} s") from None

    async def next_chunk(self) -> bytes | None:
        """The next body chunk; None at the end. Raises the client's ReadTimeout past the read
        timeout, as a socket read would."""
        if self.ended:
            return None
        try:
            chunk = await asyncio.wait_for(self.chunks.get(), self.read_timeout_s)
        except TimeoutError:
            raise self.http.ReadTimeout("no body chunk from the in-process kvsession app "
                                        f"within {self.read_timeout_s} s") from None
        if chunk is None:
            self.ended = True
        return chunk

    async def __aiter__(self) -> AsyncIterator[bytes]:
        while (chunk := await self.next_chunk()) is not None:
            yield chunk

    async def aclose(self) -> None:
        """The reader is done: before the end, that is the client disconnecting (the app
        receives `http.disconnect` and ends its request); waits for the app's end (bounded)."""
        self.gone.set()
        while not self.chunks.empty():  # a sender blocked on a full queue goes on
            self.chunks.get_nowait()
        if self.task is not None and not self.task.done():
            with contextlib.suppress(TimeoutError, asyncio.CancelledError, Exception):
                await asyncio.wait_for(asyncio.shield(self.task), CLOSE_BOUND_S)


class AsyncTransport:
    """An asynchronous transport into an InProcessServer: the app runs in the caller's
    loop. (An `http` AsyncBaseTransport: `_classes`.)"""

    def __init__(self, server: InProcessServer, http):
        self.server, self.http = server, http

    async def handle_async_request(self, request):
        body = await request.aread()
        return await self.server.call(request, body, _read_timeout(request), self.http)


class Transport:
    """A synchronous transport into an InProcessServer: the app runs on the server's loop
    thread, each body chunk handed over as it is sent. (An `http` BaseTransport:
    `_classes`.)"""

    def __init__(self, server: InProcessServer, http):
        self.server, self.http = server, http

    def handle_request(self, request):
        body = request.read()
        timeout = _read_timeout(request)
        loop = self.server.loop()
        # (the head's own wait is bounded inside the loop; this bound is for the hop)
        bound = None if timeout is None else timeout + CLOSE_BOUND_S
        response = loop.run(self.server.call(request, body, timeout, self.http), bound,
                            self.http.ReadTimeout)
        return self.http.Response(
            response.status_code, headers=response.headers, request=request,
            stream=_classes(self.http).SyncBody(response.stream, loop, timeout))


class _SyncBody:
    """A `_Body` read from another thread than its loop's. (An `http` SyncByteStream:
    `_classes`.)"""

    def __init__(self, body: _Body, loop: _LoopThread, read_timeout_s: float | None):
        self.body, self.loop, self.read_timeout_s = body, loop, read_timeout_s

    def __iter__(self) -> Iterator[bytes]:
        # (the chunk's own wait is bounded inside the loop; this bound is for the hop)
        bound = None if self.read_timeout_s is None else self.read_timeout_s + CLOSE_BOUND_S
        timeout = self.body.http.ReadTimeout
        while (chunk := self.loop.run(self.body.next_chunk(), bound, timeout)) is not None:
            yield chunk

    def close(self) -> None:
        self.loop.run(self.body.aclose(), CLOSE_BOUND_S * 2, self.body.http.ReadTimeout)


class _Classes(NamedTuple):
    Body: type
    SyncBody: type
    Transport: type
    AsyncTransport: type


@functools.cache
def _classes(http) -> _Classes:
    """The transports and body streams as subclasses of `http`'s own base classes (a
    client checks the streams it reads: httpx, or a package with its API under another
    name, such as `httpx2`)."""
    return _Classes(
        type("Body", (_Body, http.AsyncByteStream), {}),
        type("SyncBody", (_SyncBody, http.SyncByteStream), {}),
        type("Transport", (Transport, http.BaseTransport), {}),
        type("AsyncTransport", (AsyncTransport, http.AsyncBaseTransport), {}))


class _LoopThread:
    """An event loop running in a daemon thread of its own, for synchronous callers."""

    def __init__(self, workers: int):
        self.loop = asyncio.new_event_loop()
        self.loop.set_default_executor(ThreadPoolExecutor(
            max_workers=workers, thread_name_prefix="kvsession-inprocess"))
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True,
                                       name="kvsession-inprocess-loop")
        self.thread.start()

    def run(self, coro, timeout_s: float | None, timeout_error: type[Exception]):
        """`coro`'s result, run on the loop; past `timeout_s` it is cancelled and
        `timeout_error` raised (the client's ReadTimeout)."""
        future = asyncio.run_coroutine_threadsafe(coro, self.loop)
        try:
            return future.result(timeout_s)
        except TimeoutError:
            future.cancel()
            raise timeout_error(f"no answer from the in-process kvsession app within "
                                f"{timeout_s} s") from None

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(CLOSE_BOUND_S)
        if not self.thread.is_alive():
            self.loop.close()


def _read_timeout(request) -> float | None:
    return request.extensions.get("timeout", {}).get("read")
