"""Running one request on the engine, as a stream of events for the HTTP layer:
`("delta", chunk)` while tokens arrive (a TextChunk or a Session's StreamChunk: `text` as
generated, and for a conversation `content`, `reasoning` and `tool_calls` split as the
reply will be, their last pieces included), then `("done", Result)`.

Three ways, by the request's plan:
- a Session turn (`Session.astream`, run by a task of its own). A turn whose client went
  away is cancelled: the task is cancelled, which ends the request, frees its new blocks
  and leaves the session as it was before the turn; `settled` then tells the caller;
- a stateless stream (`LLM.astream`): closing it cancels the request at once and frees its
  blocks;
- a stateless batch (`LLM.achat` / `LLM.agenerate`, n > 1 or several prompts): one "done".
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable

from kvsession import LLM, SamplingParams
from kvsession.serve.protocol import Result


def turn_overrides(params: SamplingParams, extra: dict | None = None) -> dict:
    """A request's sampling as `Session.send` keyword arguments (n is always 1 there):
    the fields it set, so the others take the model's defaults as a stateless request's
    do. Arguments the params keep in another form (response_format becomes `structured`)
    are given in that form."""
    out = {n: getattr(params, n) for n in sorted(params.explicit) if n != "n"}
    return out | (extra or {})


class Slot:
    """One admitted request's place in the server's bound; released exactly once."""

    def __init__(self, release: Callable[[], None]):
        self._release, self.released = release, False

    def release(self) -> None:
        if not self.released:
            self.released = True
            self._release()


class SessionTurn:
    """A `Session.astream` turn, run by a task of its own that feeds the event loop's
    queue (no thread): the request's events come from `events()`, and `cancel()` (the
    client went away) cancels the turn at once, which leaves the session as it was before
    it; `settled` resolves (with the turn's error, or None) once the turn has ended."""

    def __init__(self, session, messages: list[dict], overrides: dict):
        loop = asyncio.get_running_loop()
        self._queue: asyncio.Queue = asyncio.Queue()
        self.settled: asyncio.Future = loop.create_future()
        self._task = loop.create_task(self._run(session, messages, overrides),
                                      name="kvsession-serve-turn")
        # (a task cancelled before it ran never enters _run: settled all the same)
        self._task.add_done_callback(self._settle)

    def _settle(self, _task) -> None:
        if not self.settled.done():
            self.settled.set_result(None)

    async def _run(self, session, messages, overrides) -> None:
        error = None
        chunks = session.astream(messages, **overrides)
        try:
            reply = None
            async for chunk in chunks:
                if chunk.reply is not None:
                    reply = chunk.reply
                if _says_something(chunk):
                    self._queue.put_nowait(("delta", chunk))
            self._queue.put_nowait(("done", Result.of_reply(reply, session)))
        except asyncio.CancelledError:
            pass  # cancel(): the turn was cancelled with it (nobody reads the queue)
        except BaseException as e:  # handed to the reader, raised there
            error = e
            self._queue.put_nowait(("error", e))
        finally:
            await chunks.aclose()
            if not self.settled.done():
                self.settled.set_result(error)

    async def events(self) -> AsyncIterator[tuple[str, object]]:
        while True:
            kind, value = await self._queue.get()
            if kind == "error":
                raise value
            yield kind, value
            if kind == "done":
                return

    def cancel(self) -> None:
        """The client went away: the turn is cancelled (the session is left as it was
        before it); `settled` resolves once it is."""
        self._task.cancel()


async def stateless_events(llm: LLM, params: SamplingParams, *, messages=None, prompt=None,
                           prompt_token_ids=None, tool_kwargs: dict | None = None,
                           priority: int | None = None) -> AsyncIterator[tuple[str, object]]:
    """A stateless request: streamed (cancelled when closed early) when n == 1 and there is
    one prompt, else batched. `priority`: the agent hint's (None: the default)."""
    tool_kwargs = tool_kwargs or {}
    if params.n > 1:
        if messages is not None:
            outs = await llm.achat(messages, params, priority=priority, **tool_kwargs)
        else:
            outs = await llm.agenerate(prompt, params, prompt_token_ids=prompt_token_ids,
                                       priority=priority)
        yield "done", Result.of_output(outs[0])
        return
    stream = llm.astream(prompt, params, prompt_token_ids=prompt_token_ids, messages=messages,
                         priority=priority, **tool_kwargs)
    try:
        async for chunk in stream:
            if _says_something(chunk):
                yield "delta", chunk
        yield "done", Result.of_output(stream.output)
    finally:
        if stream.output is None:
            await stream.aclose()  # cancels the request: its blocks are freed now


def _says_something(chunk) -> bool:
    return bool(chunk.text or chunk.content or chunk.reasoning or chunk.tool_calls)


async def collect(events: AsyncIterator[tuple[str, object]]) -> Result:
    async for kind, value in events:
        if kind == "done":
            return value
    raise RuntimeError("the request ended without a result")
