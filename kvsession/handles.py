"""Handles an `LLM` returns: streams (`LLM.stream` / `LLM.astream`: `TextChunk`s of one
request as its tokens arrive, text deltas with stop strings never leaked and UTF-8 never
split, the last chunk carrying the RequestOutput; closing one early cancels the request)
and pinned prefixes (`LLM.pin`)."""

from __future__ import annotations

import asyncio
import contextlib
import queue
from collections.abc import AsyncIterator, Iterator

from kvsession import display
from kvsession.outputs import DeltaText, RequestOutput, TextChunk
from kvsession.requests import ChatInputs
from kvsession.runtime import PinHandle, Runtime


def _progress(seq) -> int:
    """Engine thread, after each token: how many tokens the caller may decode, 0 once the
    request has finished (its last token may complete a stop string: the final text,
    already cut, comes from the output instead)."""
    return 0 if seq.finish_reason is not None else seq.num_tokens


class _Chunks:
    """Turns the engine's progress reports into TextChunks; the last one (always sent, its
    text possibly empty) carries the output, so a caller reading chunks alone gets it.
    A chat's reply is split as it streams by `chat`'s ReplySplitter (reply_stream.py),
    reading the text as generated (or as `chat.splitter_text` spells it)."""

    def __init__(self, rt: Runtime, seq, prompt: str | None, chat: ChatInputs | None):
        self._rt, self._seq, self._prompt, self._chat = rt, seq, prompt, chat
        self._text = DeltaText(rt.tokenizer.incremental_text(), seq.params.stop_strings)
        self._sent = seq.num_prompt_tokens  # tokens reported so far (an index into the log)
        prompt_ids = seq.token_ids[:seq.num_prompt_tokens]
        self._splitter = chat.splitter(prompt_ids) if chat is not None else None
        marked = chat.splitter_text() if chat is not None else None
        # the splitter's own view of the text where it differs (markers put back)
        self._split_text = None if marked is None else \
            DeltaText(marked, seq.params.stop_strings)

    def _ids(self, end: int) -> list[int]:
        ids = self._seq.token_ids[self._sent:end]
        self._sent = end  # progress only grows
        return ids

    def update(self, n: int) -> TextChunk | None:
        """The request has `n` tokens (0: it finished): a chunk if there is new text."""
        if not n:
            return None
        seq = self._seq
        start = seq.num_prompt_tokens  # the output's ids: seq.token_ids[start:n]
        delta = self._text.update(seq.token_ids, start, n)
        if self._splitter is None:
            return TextChunk(delta, self._ids(n), content=delta) if delta else None
        split = self._splitter.feed(delta if self._split_text is None
                                    else self._split_text.update(seq.token_ids, start, n))
        if delta or split:
            return TextChunk(delta, self._ids(n), None, split.content, split.reasoning,
                             split.tool_calls)
        return None

    def last(self, result) -> TextChunk:
        out = self._rt.sequences.output(result, self._prompt)
        tail = self._text.finish(out.text)
        if self._chat is not None:
            out = self._chat.finish(out)
        if self._splitter is None:
            return TextChunk(tail, self._ids(len(self._seq.token_ids)), out, content=tail)
        # (what the splitter has not seen: the finished split's rest, from `finish`)
        rest = self._splitter.finish(out.reasoning, out.text, out.tool_calls)
        return TextChunk(tail, self._ids(len(self._seq.token_ids)), out, rest.content,
                         rest.reasoning, rest.tool_calls)


class TextStream:
    """The `TextChunk`s of one streamed request (an iterator); `output` is its RequestOutput
    once the stream is exhausted (also on the last chunk). `close()` (or leaving a `with`
    block) before the end cancels the request. A conversation's `chat` inputs turn the
    request's output into a reply (`ChatInputs.finish`: reasoning, tool calls) and split
    the chunks as they come (`TextChunk.content`, `.reasoning`, `.tool_calls`); `.text`
    is the text as generated."""

    def __init__(self, rt: Runtime, seq, prompt: str | None, chat: ChatInputs | None = None):
        self._rt, self._seq, self._prompt = rt, seq, prompt
        self._chat = chat
        self.output: RequestOutput | None = None
        self._updates: queue.SimpleQueue = queue.SimpleQueue()
        self._fut = rt.submit(seq, on_update=lambda s: self._updates.put(_progress(s)))
        self._fut.add_done_callback(lambda f: self._updates.put(None))
        self._gen = self._deltas()

    def _deltas(self) -> Iterator[TextChunk]:
        chunks = _Chunks(self._rt, self._seq, self._prompt, self._chat)
        try:
            while (n := self._updates.get()) is not None:
                if chunk := chunks.update(n):
                    yield chunk
            last = chunks.last(self._fut.result())
            self.output = last.output
            yield last
        finally:
            if self.output is None:
                self._rt.cancel(self._seq)

    def __iter__(self) -> TextStream:
        return self

    def __next__(self) -> TextChunk:
        return next(self._gen)

    def close(self) -> None:
        self._gen.close()
        if self.output is None:  # also before the first chunk: the generator never ran,
            self._rt.cancel(self._seq)  # so its finally did not cancel

    def __enter__(self) -> TextStream:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class AsyncTextStream:
    """`TextStream` for asyncio (`async for`); `output` once exhausted, `aclose()` cancels."""

    def __init__(self, rt: Runtime, seq, prompt: str | None, chat: ChatInputs | None = None):
        self._rt, self._seq, self._prompt = rt, seq, prompt
        self._chat = chat
        self.output: RequestOutput | None = None
        self._gen = self._deltas()

    async def _deltas(self) -> AsyncIterator[TextChunk]:
        seq, loop = self._seq, asyncio.get_running_loop()
        updates: asyncio.Queue = asyncio.Queue()

        def post(item) -> None:  # engine thread -> the event loop (closed: nobody listens)
            with contextlib.suppress(RuntimeError):
                loop.call_soon_threadsafe(updates.put_nowait, item)

        fut = self._rt.submit(seq, on_update=lambda s: post(_progress(s)))
        fut.add_done_callback(lambda f: post(None))
        chunks = _Chunks(self._rt, seq, self._prompt, self._chat)
        try:
            while (n := await updates.get()) is not None:
                if chunk := chunks.update(n):
                    yield chunk
            last = chunks.last(fut.result())
            self.output = last.output
            yield last
        finally:
            if self.output is None:
                self._rt.cancel(seq)

    def __aiter__(self) -> AsyncTextStream:
        return self

    async def __anext__(self) -> TextChunk:
        return await self._gen.__anext__()

    async def aclose(self) -> None:
        await self._gen.aclose()


class PinnedPrefix:
    """A handle on a pinned prefix. `num_tokens` / `num_blocks`: what is held (whole blocks;
    a trailing partial block is not pinned)."""

    def __init__(self, runtime: Runtime, pin: PinHandle):
        self._rt, self._pin = runtime, pin
        self.token_ids = list(pin.token_ids)
        self.num_tokens = len(pin.token_ids)
        self.num_blocks = len(pin.blocks)
        self.ttl_s = pin.ttl_s

    @property
    def active(self) -> bool:
        """False once unpinned or expired."""
        return self._pin.active

    def unpin(self) -> None:
        """Release the pin's references (idempotent); the blocks stay cached until evicted."""
        self._rt.pinning.unpin(self._pin)

    def __repr__(self) -> str:
        state = "active" if self.active else "released"
        return f"PinnedPrefix({self.num_tokens} tokens, {self.num_blocks} blocks, {state})"

    def _repr_html_(self) -> str:
        return display.table("PinnedPrefix", [
            ("state", "active" if self.active else "released"),
            ("held", f"{self.num_tokens} tokens in {self.num_blocks} blocks"),
            ("ttl", "none" if self.ttl_s is None else f"{self.ttl_s:g} s")])
