"""What `LLM.generate` / `LLM.chat` return, and the detokenizer behind `LLM.stream`."""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from kvsession import display
from kvsession.metrics import RequestMetrics

if TYPE_CHECKING:
    from kvsession.model.tokenizer import IncrementalText
    from kvsession.reply_stream import ToolCallDelta
    from kvsession.tools import ToolCall

log = logging.getLogger("kvsession")


@dataclass
class CompletionOutput:
    """One completion of a request (`SamplingParams(n=...)` asks for several). `text`
    excludes any matched stop string; `logprobs` (if asked) has one {token_id: logprob}
    dict per generated token; `finish_reason` is "stop" (EOS, a stop token or string, or a
    structured format completed) or "length". With `tools`, `tool_calls` holds the calls
    parsed from the output and `text` is the content before them ([] and the whole text
    when there are none). A chat reply of a reasoning template has its thinking in
    `reasoning` and the answer after it in `text`."""

    index: int
    text: str
    token_ids: list[int]
    finish_reason: str
    logprobs: list[dict[int, float]] | None = field(default=None, repr=False)
    tool_calls: list[ToolCall] = field(default_factory=list)
    # a chat reply of a reasoning template (<think>...</think>): its thinking (`text` is
    # then the answer after it); None when the reply has no closed thinking block
    reasoning: str | None = None


@dataclass
class RequestOutput:
    """One finished request: its completions in `outputs` (index order). `text`,
    `token_ids`, `finish_reason` and `logprobs` are those of `outputs[0]`. `prompt_logprobs`
    (if asked): None for the first prompt token, then one {token_id: logprob} dict per
    prompt token."""

    request_id: int
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    num_cached_tokens: int
    metrics: RequestMetrics
    prompt_logprobs: list[dict[int, float] | None] | None = field(default=None, repr=False)

    @property
    def text(self) -> str:
        return self.outputs[0].text

    def _repr_html_(self) -> str:
        rows = []
        for c in self.outputs:
            tag = f" {c.index}" if len(self.outputs) > 1 else ""
            rows.append((f"text{tag}", display.text(c.text)))
            if c.reasoning:
                rows.append((f"reasoning{tag}", display.text(c.reasoning)))
            rows += [(f"tool call{tag}", f"{t.name}({t.arguments})") for t in c.tool_calls]
            rows.append((f"finish{tag}", f"{c.finish_reason} after {len(c.token_ids)} "
                                         f"tokens"))
        rows += [("prompt", f"{len(self.prompt_token_ids)} tokens "
                            f"({self.num_cached_tokens} from the cache)"),
                 ("TTFT", display.ms(self.metrics.ttft_s))]
        return display.table(f"RequestOutput {self.request_id}", rows)

    @property
    def token_ids(self) -> list[int]:
        return self.outputs[0].token_ids

    @property
    def finish_reason(self) -> str:
        return self.outputs[0].finish_reason

    @property
    def logprobs(self) -> list[dict[int, float]] | None:
        return self.outputs[0].logprobs

    @property
    def tool_calls(self) -> list[ToolCall]:
        return self.outputs[0].tool_calls

    @property
    def reasoning(self) -> str | None:
        return self.outputs[0].reasoning


@dataclass
class TextChunk:
    """One piece of `LLM.stream` / `LLM.astream`: `text` is a delta of the text as
    generated (the deltas join to exactly the text `generate` returns for a prompt; for a
    conversation, markup and thinking included), `token_ids` the tokens generated since the
    previous chunk, and the last chunk carries the request's `output` (None before it).

    The same delta split as the finished reply is (kvsession/reply_stream.py): `content`
    and `reasoning` deltas join to the output's `text` and `reasoning`, and `tool_calls`
    (ToolCallDelta: a call's index, id and name first, then fragments of its JSON
    arguments) to its `tool_calls`, whose ids are the ones streamed. For a prompt,
    `content` is `text`."""

    text: str
    token_ids: list[int]
    output: RequestOutput | None = None
    content: str = ""
    reasoning: str = ""
    tool_calls: list[ToolCallDelta] = field(default_factory=list)


class DeltaText:
    """Streaming detokenizer: turns a growing list of output ids into text deltas whose
    concatenation is the final text. Text that may still become the start of a stop string
    (the last len(longest stop) - 1 characters) is held back, so a stop string never
    leaks; an incomplete UTF-8 character is held back by `text` (IncrementalText, which
    decodes each new id once: O(1) a token where decoding every id again was O(n))."""

    def __init__(self, text: IncrementalText, stop_strings: tuple[str, ...]):
        self._text, self._fed = text, 0  # ids given to `text` so far
        self._hold = max((len(s) for s in stop_strings), default=1) - 1
        # characters of `text` sent (its text only grows, so what was sent is its prefix:
        # each update slices only the new characters, not the whole text again)
        self._sent_len = 0

    def update(self, token_ids: list[int], start: int = 0, end: int | None = None) -> str:
        """The output ids so far are token_ids[start:end] (a list that only grows: a
        sequence's whole log, its output from `start`); only the ids since the last update
        are read."""
        end = len(token_ids) if end is None else end
        self._text.extend(token_ids[start + self._fed:end])
        self._fed = end - start
        text = self._text.text
        safe_len = len(text) - self._hold
        if safe_len <= self._sent_len:
            return ""  # nothing new that is certain
        delta = text[self._sent_len:safe_len]
        self._sent_len = safe_len
        return delta

    def finish(self, final_text: str) -> str:
        """The rest of `final_text` (the request's output, cut at its stop string)."""
        sent = self._text.text[:self._sent_len]
        if not final_text.startswith(sent):
            # a tokenizer whose decode of a prefix is not a prefix of the whole decode
            # (byte-level BPE never is): what was sent cannot be taken back
            log.warning("streamed text diverged from the final text of the request")
            sent = os.path.commonprefix([sent, final_text])
        self._sent_len = len(final_text)  # (no update follows the finish)
        return final_text[len(sent):]
