"""HTTP helpers the single-engine app (serve/app.py) and the Ray ingress
(serve/ray_ingress.py) share: server-sent events that end their request as soon as the
response ends, and awaiting work unless the client disconnects first."""

from __future__ import annotations

import asyncio
import json

import anyio
from starlette.requests import Request
from starlette.responses import StreamingResponse


class ClientGone(Exception):
    """The client disconnected before its answer was ready."""


class SSEResponse(StreamingResponse):
    """Server-sent events. However the response ends (a disconnect included), its body
    iterator is closed and `on_close` runs at once, so the request behind it is cancelled
    and its admission slot released now, not when the iterator is garbage collected."""

    media_type = "text/event-stream"

    def __init__(self, content, on_close, headers: dict[str, str] | None = None):
        super().__init__(content, headers={"Cache-Control": "no-cache",
                                           "X-Accel-Buffering": "no", **(headers or {})})
        self._on_close = on_close

    async def stream_response(self, send) -> None:
        try:
            await super().stream_response(send)
        finally:
            with anyio.CancelScope(shield=True):
                await self.body_iterator.aclose()
                await self._on_close()


def sse(obj) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


async def _disconnected(request: Request) -> None:
    """Returns when the client has disconnected (the body was already read, so the next
    ASGI message is the disconnect)."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


async def unless_disconnected(request: Request, work):
    """Await `work` unless the client disconnects first: it is then cancelled (and awaited)
    and ClientGone raised."""
    work = asyncio.ensure_future(work)
    gone = asyncio.ensure_future(_disconnected(request))
    try:
        await asyncio.wait({work, gone}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        gone.cancel()
    if work.done():
        return work.result()
    work.cancel()
    with suppress_all():
        await work
    raise ClientGone()


class suppress_all:
    """Swallows what a cancelled piece of work raises as it ends (its error, or its
    cancellation), so the caller can go on raising its own."""

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return exc[0] is not None and issubclass(exc[0], (Exception, asyncio.CancelledError))
