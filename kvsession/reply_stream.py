"""A reply as it streams, split as the finished reply is: reasoning, content, tool calls.

A finished reply is split by `history.split_reasoning` (a reasoning template's
`<think>...</think>`) and then `ToolSpec.parse` (the checkpoint's call markup: Hermes /
Qwen `<tool_call>`, Llama 3 JSON, Mistral `[TOOL_CALLS]`). A stream shows the same split as
the text arrives, in OpenAI's delta shapes: `reasoning` and `content` text, and tool calls
as `ToolCallDelta`s (a call's index, id and name first, then fragments of its JSON
`arguments` as the model writes them). Markup never reaches the content.

    splitter = ReplySplitter(reasoning, spec, starts_in_reasoning)
    delta = splitter.feed(text)     # the raw text generated since the last feed -> ReplyDelta
    delta = splitter.finish(reasoning, content, calls)   # the finished split: what is left

The deltas of a stream join to the finished reply's fields (`finish` sends what is left of
each; the finished calls take the ids the stream announced). What is held back, and why:
- trailing whitespace of reasoning and content, and a content's leading newlines after the
  reasoning: the finished split strips them;
- a text end that may be the start of a marker (`</think>`, `<tool_call>`,
  `[TOOL_CALLS]`, `<|python_tag|>`), and a reply's first characters while they may still
  open a Llama 3 or Mistral call written without its marker (`{`, `[{`);
- a call until its name is complete and one of the tools (a name that is not is no call:
  the text held since the markup goes out as content, and so does the rest, as the
  finished parse then finds no call either);
- within the arguments, whatever may still change: arguments stream as the canonical text
  of the finished call (`json.dumps(arguments, ensure_ascii=False)`, what `ToolCall.to_dict`
  sends), written token by token from the JSON the model writes (separators normalised,
  escapes decoded where JSON allows the character, a number once it has ended).

Where the finished split cannot extend what was streamed (markup that turns out malformed
after its call was announced, a thinking block never closed), `finish` sends what it can
and logs the divergence: a stream cannot take back what it sent. (vLLM's streamed parsers
have the same limit.)
"""

from __future__ import annotations

import json
import logging
import re
from dataclasses import dataclass, field

from kvsession.history import THINK_CLOSE, THINK_OPEN
from kvsession.tools import ToolCall, ToolChoice, ToolFormat, ToolSpec, new_call_id

log = logging.getLogger("kvsession")

_HERMES_OPEN, _HERMES_CLOSE = "<tool_call>", "</tool_call>"
_MISTRAL_MARK, _MISTRAL_ARGS = "[TOOL_CALLS]", "[ARGS]"
_PYTHON_TAG = "<|python_tag|>"
_NAME_CHARS = re.compile(r"[A-Za-z0-9_.\-]*")
_WS = " \t\n\r"


@dataclass(frozen=True)
class ToolCallDelta:
    """A piece of one streamed call: its `index` in the reply; `id` and `name` on its
    first delta (None after); `arguments`: the next fragment of its JSON arguments."""

    index: int
    id: str | None = None
    name: str | None = None
    arguments: str = ""

    def to_dict(self) -> dict:
        """OpenAI's `tool_calls` delta entry."""
        fn: dict = {"arguments": self.arguments}
        out: dict = {"index": self.index}
        if self.id is not None:
            out |= {"id": self.id, "type": "function"}
            fn = {"name": self.name, **fn}
        return out | {"function": fn}


@dataclass
class ReplyDelta:
    """What a stream can say of a reply since its previous delta."""

    reasoning: str = ""
    content: str = ""
    tool_calls: list[ToolCallDelta] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.reasoning or self.content or self.tool_calls)


class _Incomplete(Exception):
    """The text ends inside what is being read."""


class _NotACall(Exception):
    """The markup is not a call the finished parse would take."""


@dataclass
class _Call:
    """One call as scanned so far."""

    name: str | None = None
    arguments: str = ""  # canonical text so far
    complete: bool = False  # the call's JSON ended (its arguments are whole)


class ReplySplitter:
    """Splits one reply's text as it streams (module docstring). Not thread-safe: one
    stream's reader feeds it."""

    def __init__(self, reasoning: bool, spec: ToolSpec | None = None,
                 starts_in_reasoning: bool = False):
        """`reasoning`: the template marks thinking with <think>...</think>;
        `starts_in_reasoning`: the prompt ends inside an open thinking block; `spec`: the
        request's tools (None, or tool_choice "none": no call is parsed)."""
        self.spec = spec if spec is not None and spec.choice is not ToolChoice.NONE else None
        self.text = ""
        # where the reply's answer starts (after a closed thinking block), None while the
        # reply is (or may be) thinking
        self.answer_at: int | None = None if reasoning else 0
        self.thinking = starts_in_reasoning
        self.reasoning_sent = self.content_sent = ""
        self.plain = self.spec is None  # no call can start any more: all content
        # in the answer: where the call markup starts, and where its body (the calls' JSON)
        self.markup_at = self.calls_at = None
        self.sent_calls: list[tuple[str, str]] = []  # (id, arguments sent) per call
        self._scanner = None if self.spec is None else \
            _CallScanner(self.spec.format, set(self.spec.names))

    # ---- feeding -----------------------------------------------------------------------

    def feed(self, text: str) -> ReplyDelta:
        self.text += text
        delta = ReplyDelta()
        if self.answer_at is None:
            delta.reasoning = self._reasoning()
        if self.answer_at is not None:
            self._answer(delta)
        return delta

    def _reasoning(self) -> str:
        """Reasoning text that is certain; sets answer_at once the block closes."""
        t = self.text
        if not self.thinking:
            head = t.lstrip()
            if head.startswith(THINK_OPEN):
                self.thinking = True
            elif THINK_OPEN.startswith(head):
                return ""  # may still open a thinking block
            else:
                self.answer_at = 0  # no thinking block: all answer
                return ""
        start = t.find(THINK_OPEN)
        start = 0 if start < 0 or t[:start].strip() else start + len(THINK_OPEN)
        close = t.find(THINK_CLOSE, start)
        if close >= 0:
            # the answer after the block, its leading newlines held (the split strips them)
            self.answer_at = close + len(THINK_CLOSE)
            body = t[start:close]
        else:
            body = _hold_marker(t[start:], THINK_CLOSE)
        return self._more(body.strip() if close >= 0 else body.lstrip().rstrip(_WS),
                          "reasoning_sent")

    def _more(self, certain: str, attr: str) -> str:
        """The part of `certain` (the channel's text so far) not sent yet."""
        sent = getattr(self, attr)
        if len(certain) <= len(sent) or not certain.startswith(sent):
            return ""
        setattr(self, attr, certain)
        return certain[len(sent):]

    def _answer(self, delta: ReplyDelta) -> None:
        answer = self.text[self.answer_at:]
        if self.answer_at:
            answer = answer.lstrip("\n")  # as split_reasoning
        if self.calls_at is None and not self.plain:
            self._find_calls(answer)
        if self.calls_at is None:
            delta.content = self._more(self._content_before_calls(answer), "content_sent")
            return
        content = answer[:self.markup_at].rstrip()
        delta.content = self._more(content, "content_sent")
        try:
            calls = self._scanner.scan(answer[self.calls_at:])
        except _NotACall:
            if self.sent_calls:
                return  # announced already: the finished split decides (finish)
            # no call: the held text is content
            self.plain, self.markup_at, self.calls_at = True, None, None
            delta.content += self._more(self._content_before_calls(answer), "content_sent")
            return
        if not self.spec.parallel:
            calls = calls[:1]
        delta.tool_calls = self._call_deltas(calls)

    def _find_calls(self, answer: str) -> None:
        """Where the call markup's body starts in `answer`, if it has started."""
        fmt = self.spec.format
        marker = {ToolFormat.HERMES: _HERMES_OPEN, ToolFormat.MISTRAL: _MISTRAL_MARK,
                  ToolFormat.LLAMA3_JSON: _PYTHON_TAG}[fmt]
        at = answer.find(marker)
        if at >= 0:
            self.markup_at, self.calls_at = at, at + len(marker)
            return
        head = answer.lstrip()
        bare = {ToolFormat.LLAMA3_JSON: "{", ToolFormat.MISTRAL: "[{"}.get(fmt)
        if bare is not None and not self.content_sent and head.startswith(bare):
            # a call without its marker
            self.markup_at = self.calls_at = len(answer) - len(head)

    def _content_before_calls(self, answer: str) -> str:
        """The content that is certain while no call has started: the answer less its
        trailing whitespace and any end that may start a call's markup (or, at the
        reply's start, a call written without its marker)."""
        if self.plain:
            return answer.rstrip(_WS)
        fmt = self.spec.format
        marker = {ToolFormat.HERMES: _HERMES_OPEN, ToolFormat.MISTRAL: _MISTRAL_MARK,
                  ToolFormat.LLAMA3_JSON: _PYTHON_TAG}[fmt]
        bare = {ToolFormat.LLAMA3_JSON: "{", ToolFormat.MISTRAL: "[{"}.get(fmt)
        head = answer.lstrip()
        if bare is not None and not self.content_sent and bare.startswith(head):
            return ""  # may still be a call without its marker
        return _hold_marker(answer, marker).rstrip(_WS)

    def _call_deltas(self, calls: list[_Call]) -> list[ToolCallDelta]:
        out = []
        for i, call in enumerate(calls):
            if call.name is None:
                break  # the calls after it have not started
            if i == len(self.sent_calls):  # its name is complete: announce it
                self.sent_calls.append((new_call_id(self.spec.format), ""))
                out.append(ToolCallDelta(i, self.sent_calls[i][0], call.name))
            call_id, sent = self.sent_calls[i]
            if len(call.arguments) > len(sent):
                fragment = call.arguments[len(sent):]
                self.sent_calls[i] = (call_id, call.arguments)
                if out and out[-1].index == i:
                    out[-1] = ToolCallDelta(i, out[-1].id, out[-1].name, fragment)
                else:
                    out.append(ToolCallDelta(i, arguments=fragment))
        return out

    @property
    def announced_ids(self) -> list[str]:
        """The ids of the calls announced so far, in order."""
        return [call_id for call_id, _ in self.sent_calls]

    # ---- the finished reply ------------------------------------------------------------

    def finish(self, reasoning: str | None, content: str,
               calls: list[ToolCall]) -> ReplyDelta:
        """The rest of the finished split: (reasoning or None, content, calls), as
        split_reasoning and ToolSpec.parse made it. Each call streamed takes the id the
        stream announced (`calls` are changed in place)."""
        delta = ReplyDelta(reasoning=self._rest(reasoning or "", self.reasoning_sent,
                                                "reasoning"),
                           content=self._rest(content, self.content_sent, "content"))
        for i, call in enumerate(calls):
            text = json.dumps(call.arguments, ensure_ascii=False)
            if i >= len(self.sent_calls):
                call.id = call.id or new_call_id(self.spec.format if self.spec else None)
                delta.tool_calls.append(ToolCallDelta(i, call.id, call.name, text))
                continue
            call_id, sent = self.sent_calls[i]
            call.id = call_id
            if text.startswith(sent):
                if len(text) > len(sent):
                    delta.tool_calls.append(ToolCallDelta(i, arguments=text[len(sent):]))
            else:
                log.warning("streamed tool call %d: its arguments diverged from the "
                            "finished call's", i)
        if len(calls) < len(self.sent_calls):
            log.warning("a streamed tool call was not a call of the finished reply (its "
                        "markup ended malformed)")
        return delta

    @staticmethod
    def _rest(final: str, sent: str, what: str) -> str:
        if final.startswith(sent):
            return final[len(sent):]
        log.warning("the streamed %s diverged from the finished reply's", what)
        return ""


def _hold_marker(text: str, marker: str) -> str:
    """`text` less an end that may be the start of `marker`."""
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-n:]):
            return text[:-n]
    return text


# ---- the call markup, scanned from its start ------------------------------------------


class _CallScanner:
    """Reads a call markup's body (what follows the marker, or the JSON of a call written
    without it) again at each feed, as far as the text goes. The structure around the
    calls is short; their arguments may be long (a file's content), so each arguments
    object is read by a `_JsonCanon` kept between scans (by where the value starts: the
    body only grows), which reads each character once."""

    def __init__(self, fmt: ToolFormat, names):
        self.fmt, self.names = fmt, names
        self._canons: dict[int, _JsonCanon] = {}

    def scan(self, body: str) -> list[_Call]:
        """The calls so far. _NotACall: what the finished parse would not take (malformed
        JSON, a name not in `names` when given, text where a call's markup must go on)."""
        calls: list[_Call] = []
        try:
            if self.fmt is ToolFormat.HERMES:
                self._hermes(body, calls)
            elif self.fmt is ToolFormat.LLAMA3_JSON:
                self._llama3(body, calls)
            else:
                self._mistral(body, calls)
        except _Incomplete:
            pass
        return calls

    def _hermes(self, body: str, calls: list[_Call]) -> None:
        pos = 0
        while True:
            pos = _skip(body, self._call_object(body, _skip(body, pos), calls))
            if body.startswith(_HERMES_CLOSE, pos):
                pos += len(_HERMES_CLOSE)
            elif _HERMES_CLOSE.startswith(body[pos:]):
                raise _Incomplete
            else:
                raise _NotACall  # only the last call may be cut short
            nxt = body.find(_HERMES_OPEN, pos)
            if nxt < 0:
                raise _Incomplete
            pos = nxt + len(_HERMES_OPEN)

    def _llama3(self, body: str, calls: list[_Call]) -> None:
        pos = _skip(body, 0)
        while True:
            if pos == len(body):
                raise _Incomplete
            if body[pos] != "{":
                raise _NotACall
            pos = self._call_object(body, pos, calls)
            while pos < len(body) and (body[pos] in _WS or body[pos] == ";"):
                pos += 1

    def _mistral(self, body: str, calls: list[_Call]) -> None:
        pos = 0
        while True:
            pos = _skip(body, pos)
            m = _NAME_CHARS.match(body, pos)
            if m.end() > pos or pos == len(body):  # v11+: name[ARGS]{json}
                end = m.end()
                if not body.startswith(_MISTRAL_ARGS, end):
                    raise _Incomplete if _MISTRAL_ARGS.startswith(body[end:]) else _NotACall
                if self.names is not None and m.group() not in self.names:
                    raise _NotACall
                call = _Call(m.group())
                calls.append(call)
                pos = self._arguments(body, _skip(body, end + len(_MISTRAL_ARGS)), call)
            else:  # v0.3: a JSON list of call objects
                if body[pos] != "[":
                    raise _NotACall
                pos = _skip(body, pos + 1)
                while True:
                    pos = _skip(body, self._call_object(body, pos, calls))
                    if pos == len(body):
                        raise _Incomplete
                    if body[pos] == "]":
                        pos += 1
                        break
                    if body[pos] != ",":
                        raise _NotACall
                    pos = _skip(body, pos + 1)
            pos = _skip(body, pos)
            if body.startswith(_MISTRAL_MARK, pos):
                pos += len(_MISTRAL_MARK)
            elif _MISTRAL_MARK.startswith(body[pos:]):
                raise _Incomplete
            else:
                raise _NotACall

    def _call_object(self, text: str, pos: int, calls: list[_Call]) -> int:
        """Reads one call object `{"name": ..., "arguments": {...}}` (or "parameters") at
        `pos` into a new entry of `calls` (appended before reading: a partial call is
        seen); where it ends."""
        if pos == len(text):
            raise _Incomplete
        if text[pos] != "{":
            raise _NotACall
        call = _Call()
        calls.append(call)
        seen_arguments = False
        pos = _skip(text, pos + 1)
        if text.startswith("}", pos):
            raise _NotACall  # no name
        while True:
            key, pos = _string(text, pos, None)
            pos = _skip(text, pos)
            if pos == len(text):
                raise _Incomplete
            if text[pos] != ":":
                raise _NotACall
            pos = _skip(text, pos + 1)
            if key == "name":
                if not text.startswith('"', pos):
                    raise _Incomplete if pos == len(text) else _NotACall
                name, pos = _string(text, pos, None)
                if self.names is not None and name not in self.names:
                    raise _NotACall
                call.name = name
            elif key in ("arguments", "parameters") and not seen_arguments:
                seen_arguments = True
                pos = self._arguments(text, pos, call)
            else:
                pos = _value(text, pos, [])  # read and dropped
            pos = _skip(text, pos)
            if pos == len(text):
                raise _Incomplete
            if text[pos] == "}":
                if call.name is None:
                    raise _NotACall
                if not seen_arguments:
                    call.arguments = "{}"
                call.complete = True
                return pos + 1
            if text[pos] != ",":
                raise _NotACall
            pos = _skip(text, pos + 1)

    def _arguments(self, text: str, pos: int, call: _Call) -> int:
        """A call's arguments value at `pos`: an object's canonical text into
        `call.arguments` as it is read, or a value written otherwise (JSON in a string, or
        null) at once when whole."""
        if pos == len(text):
            raise _Incomplete
        if text[pos] == "{":
            canon = self._canons.setdefault(pos, _JsonCanon())
            end = canon.feed(text, pos)
            call.arguments = canon.text()
            if end is None:
                raise _Incomplete
            return end
        value_out: list[str] = []
        end = _value(text, pos, value_out)  # whole, or _Incomplete
        value = json.loads("".join(value_out))
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except ValueError:
                raise _NotACall from None
        if value is None:
            value = {}
        if not isinstance(value, dict):
            raise _NotACall
        call.arguments = json.dumps(value, ensure_ascii=False)
        return end


class _JsonCanon:
    """One JSON value's canonical text (json.dumps of what it decodes to, ensure_ascii
    False), written as the value's text arrives: `feed(text, start)` reads what it has
    not read yet of the value starting at `start`. Strings, arrays and objects are read
    character by character (a run of plain string characters at once); a number, literal
    or escape once it is whole (until then it is read again at the next feed)."""

    def __init__(self):
        self._out: list[str] = []
        self._read = 0  # characters of the value read so far
        self._stack: list[str] = []  # the open containers: "{" or "["
        self._state = "value"  # what comes next (see feed)
        self._key = False  # the string being read is an object's key
        self.end: int | None = None

    def text(self) -> str:
        if len(self._out) > 1:
            self._out[:] = ["".join(self._out)]
        return self._out[0] if self._out else ""

    def feed(self, text: str, start: int) -> int | None:
        """Where the value ends in `text`, once it is whole; None before."""
        i, n, out = start + self._read, len(text), self._out
        try:
            while i < n and self.end is None:
                state = self._state
                if state == "string":
                    if m := _PLAIN.match(text, i):
                        out.append(m.group())
                        i = m.end()
                        continue
                    c = text[i]
                    if c == '"':
                        out.append('"')
                        i += 1
                        if self._key:
                            self._key, self._state = False, "colon"
                        else:
                            i = self._after_value(i)
                    elif c == "\\":
                        ch, i = _escape(text, i)
                        out.append(json.dumps(ch, ensure_ascii=False)[1:-1])
                    else:
                        raise _NotACall  # a raw control character: not JSON
                    continue
                c = text[i]
                if c in _WS:
                    i += 1
                elif state == "value":
                    i = self._value_start(text, i)
                elif state in ("key", "key_or_end"):
                    if c == "}" and state == "key_or_end":
                        out.append("}")
                        self._stack.pop()
                        i = self._after_value(i + 1)
                    elif c == '"':
                        out.append('"')
                        self._key, self._state = True, "string"
                        i += 1
                    else:
                        raise _NotACall
                elif state == "colon":
                    if c != ":":
                        raise _NotACall
                    out.append(": ")
                    self._state = "value"
                    i += 1
                elif state == "value_or_end":
                    if c == "]":
                        out.append("]")
                        self._stack.pop()
                        i = self._after_value(i + 1)
                    else:
                        self._state = "value"
                else:  # "comma_or_end"
                    top = self._stack[-1]
                    if c == ",":
                        out.append(", ")
                        self._state = "key" if top == "{" else "value"
                        i += 1
                    elif c == ("}" if top == "{" else "]"):
                        out.append(c)
                        self._stack.pop()
                        i = self._after_value(i + 1)
                    else:
                        raise _NotACall
        except _Incomplete:
            pass  # an escape, number or literal not whole yet: read again next time
        self._read = i - start
        return self.end

    def _value_start(self, text: str, i: int) -> int:
        c = text[i]
        if c in "{[":
            self._out.append(c)
            self._stack.append(c)
            self._state = "key_or_end" if c == "{" else "value_or_end"
            return i + 1
        if c == '"':
            self._out.append('"')
            self._state = "string"
            return i + 1
        scalar: list[str] = []
        end = _scalar(text, i, scalar)  # whole, or _Incomplete
        self._out += scalar
        return self._after_value(end)

    def _after_value(self, i: int) -> int:
        if self._stack:
            self._state = "comma_or_end"
        else:
            self.end = i
        return i


def _skip(text: str, pos: int) -> int:
    while pos < len(text) and text[pos] in _WS:
        pos += 1
    return pos


_NUMBER = re.compile(r"-?(0|[1-9][0-9]*)(\.[0-9]+)?([eE][+-]?[0-9]+)?")
_NUMBER_CHARS = re.compile(r"[-+0-9.eE]+")
_PLAIN = re.compile(r'[^"\\\x00-\x1f]+')  # string characters JSON writes as they are
_ESCAPES = {'"': '"', "\\": "\\", "/": "/", "b": "\b", "f": "\f", "n": "\n", "r": "\r",
            "t": "\t"}


def _value(text: str, pos: int, out: list[str]) -> int:
    """Reads the JSON value at `pos` (after whitespace), appending its canonical text
    (json.dumps with ensure_ascii=False of what it decodes to) to `out` as far as it is
    certain; where it ends. _Incomplete at the text's end (`out` keeps what is certain)."""
    pos = _skip(text, pos)
    if pos == len(text):
        raise _Incomplete
    if text[pos] not in '{["':
        return _scalar(text, pos, out)
    canon = _JsonCanon()
    end = canon.feed(text, pos)
    out.append(canon.text())
    if end is None:
        raise _Incomplete
    return end


def _scalar(text: str, pos: int, out: list[str]) -> int:
    """A number or literal at `pos`, whole (_Incomplete while it may go on)."""
    for literal in ("true", "false", "null"):
        if text.startswith(literal, pos):
            out.append(literal)
            return pos + len(literal)
        if literal.startswith(text[pos:pos + len(literal)]) and \
                pos + len(literal) > len(text):
            raise _Incomplete
    m = _NUMBER_CHARS.match(text, pos)
    if m is None:
        raise _NotACall
    if m.end() == len(text):
        raise _Incomplete  # more of the number may follow
    if not _NUMBER.fullmatch(m.group()):
        raise _NotACall  # ("1.", "01", "1e": not JSON)
    out.append(json.dumps(json.loads(m.group())))  # as the parsed value prints
    return m.end()


def _string(text: str, pos: int, out: list[str] | None) -> tuple[str, int]:
    """The JSON string at `pos`, decoded, and where it ends; its canonical text appended
    to `out` (when given) as far as it is read (a character once it is whole)."""
    if pos == len(text):
        raise _Incomplete
    if text[pos] != '"':
        raise _NotACall
    if out is not None:
        out.append('"')
    chars: list[str] = []
    pos += 1
    while True:
        # a run of characters that stand for themselves, canonical as written (the whole
        # markup is scanned again at every token: this keeps that at C speed)
        if m := _PLAIN.match(text, pos):
            chars.append(m.group())
            if out is not None:
                out.append(m.group())
            pos = m.end()
        if pos == len(text):
            raise _Incomplete
        c = text[pos]
        if c == '"':
            if out is not None:
                out.append('"')
            return "".join(chars), pos + 1
        if c != "\\":
            raise _NotACall  # a raw control character: not JSON
        ch, pos = _escape(text, pos)
        chars.append(ch)
        if out is not None:
            out.append(json.dumps(ch, ensure_ascii=False)[1:-1])


def _escape(text: str, pos: int) -> tuple[str, int]:
    """The character an escape at `pos` (a backslash) stands for, and where it ends; a
    surrogate that is not one of a pair becomes U+FFFD, as the finished parse makes it."""
    if pos + 1 >= len(text):
        raise _Incomplete
    e = text[pos + 1]
    if e in _ESCAPES:
        return _ESCAPES[e], pos + 2
    if e != "u":
        raise _NotACall
    code = _hex4(text, pos + 2)
    if 0xD800 <= code < 0xDC00:  # a high surrogate: a pair if a low one follows
        nxt = pos + 6
        if len(text) < nxt + 2 and text[nxt:] == "\\"[:len(text) - nxt]:
            raise _Incomplete
        if text.startswith("\\u", nxt):
            low = _hex4(text, nxt + 2)
            if 0xDC00 <= low < 0xE000:
                return chr(0x10000 + ((code - 0xD800) << 10) + (low - 0xDC00)), nxt + 6
        return "\ufffd", nxt
    if 0xDC00 <= code < 0xE000:
        return "\ufffd", pos + 6
    return chr(code), pos + 6


def _hex4(text: str, pos: int) -> int:
    digits = text[pos:pos + 4]
    if not all(ch in "0123456789abcdefABCDEF" for ch in digits):
        raise _NotACall
    if len(digits) < 4:
        raise _Incomplete
    return int(digits, 16)


def prompt_opens_reasoning(tokenizer, prompt_ids: list[int]) -> bool:
    """Whether a prompt ends inside an open thinking block (a template whose generation
    prompt writes `<think>`: the reply starts with its reasoning)."""
    tail = tokenizer.decode(prompt_ids[-16:], skip_special_tokens=False)
    return tail.rfind(THINK_OPEN) > tail.rfind(THINK_CLOSE)
