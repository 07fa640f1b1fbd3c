"""Handles an `LLM` returns: streams (`LLM.stream` / `LLM.astream`: text deltas of one
request as its tokens arrive, stop strings never leaked, UTF-8 never split, its
RequestOutput once exhausted; closing one early cancels the request) and pinned prefixes
(`LLM.pin`)."""

from __future__ import annotations

import asyncio
import contextlib
import queue
from collections.abc import AsyncIterator, Iterator

from kvsession.outputs import DeltaText, RequestOutput
from kvsession.runtime import PinHandle, Runtime


def _progress(seq) -> int:
    """Engine thread, after each token: how many tokens the caller may decode, 0 once the
    request has finished (its last token may complete a stop string: the final text,
    already cut, comes from the output instead)."""
    return 0 if seq.finish_reason is not None else seq.num_tokens


class TextStream:
    """Text deltas of one streamed request (an iterator); `output` is its RequestOutput once
    the stream is exhausted. `close()` (or leaving a `with` block) before the end cancels
    the request. `finish` (e.g. tool-call parsing) turns the request's output into
    `output`; the deltas are the raw text."""

    def __init__(self, rt: Runtime, seq, prompt: str | None, finish=None):
        self._rt, self._seq, self._prompt = rt, seq, prompt
        self._finish = finish
        self.output: RequestOutput | None = None
        self._updates: queue.SimpleQueue = queue.SimpleQueue()
        self._fut = rt.submit(seq, on_update=lambda s: self._updates.put(_progress(s)))
        self._fut.add_done_callback(lambda f: self._updates.put(None))
        self._gen = self._deltas()

    def _deltas(self) -> Iterator[str]:
        seq = self._seq
        text = DeltaText(self._rt.tokenizer.decode, seq.params.stop_strings)
        try:
            while (n := self._updates.get()) is not None:
                if n and (delta := text.update(seq.token_ids[seq.num_prompt_tokens:n])):
                    yield delta
            out = self._rt.output(self._fut.result(), self._prompt)
            tail = text.finish(out.text)
            self.output = out if self._finish is None else self._finish(out)
            if tail:
                yield tail
        finally:
            if self.output is None:
                self._rt.cancel(seq)

    def __iter__(self) -> TextStream:
        return self

    def __next__(self) -> str:
        return next(self._gen)

    def close(self) -> None:
        self._gen.close()

    def __enter__(self) -> TextStream:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class AsyncTextStream:
    """`TextStream` for asyncio (`async for`); `output` once exhausted, `aclose()` cancels."""

    def __init__(self, rt: Runtime, seq, prompt: str | None, finish=None):
        self._rt, self._seq, self._prompt = rt, seq, prompt
        self._finish = finish
        self.output: RequestOutput | None = None
        self._gen = self._deltas()

    async def _deltas(self) -> AsyncIterator[str]:
        seq, loop = self._seq, asyncio.get_running_loop()
        updates: asyncio.Queue = asyncio.Queue()

        def post(item) -> None:  # engine thread -> the event loop (closed: nobody listens)
            with contextlib.suppress(RuntimeError):
                loop.call_soon_threadsafe(updates.put_nowait, item)

        fut = self._rt.submit(seq, on_update=lambda s: post(_progress(s)))
        fut.add_done_callback(lambda f: post(None))
        text = DeltaText(self._rt.tokenizer.decode, seq.params.stop_strings)
        try:
            while (n := await updates.get()) is not None:
                if n and (delta := text.update(seq.token_ids[seq.num_prompt_tokens:n])):
                    yield delta
            out = self._rt.output(fut.result(), self._prompt)
            tail = text.finish(out.text)
            self.output = out if self._finish is None else self._finish(out)
            if tail:
                yield tail
        finally:
            if self.output is None:
                self._rt.cancel(seq)

    def __aiter__(self) -> AsyncTextStream:
        return self

    async def __anext__(self) -> str:
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
        self._rt.unpin(self._pin)

    def __repr__(self) -> str:
        state = "active" if self.active else "released"
        return f"PinnedPrefix({self.num_tokens} tokens, {self.num_blocks} blocks, {state})"
