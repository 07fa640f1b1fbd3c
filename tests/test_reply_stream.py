"""A reply split as it streams (kvsession/reply_stream.py): fed in pieces of every size, the
deltas join to exactly the finished split (split_reasoning, then ToolSpec.parse: the same
reasoning, content, calls and `ToolCall.to_dict` arguments), markup never reaches the
content, and a call is announced (id and name) and its arguments flow before the reply
ends. The three call formats, reasoning before calls, arguments the model writes in
another spelling (spacing, escapes, numbers, JSON as a string), and text that only looks
like markup."""

from __future__ import annotations

import json
import random

import pytest

from kvsession.history import split_reasoning
from kvsession.reply_stream import ReplySplitter, ToolCallDelta
from kvsession.tools import ToolChoice, ToolFormat, ToolSpec

TOOLS = [{"type": "function", "function": {"name": n, "parameters": {"type": "object"}}}
         for n in ("read_file", "ls")]
H = ToolFormat.HERMES
L = ToolFormat.LLAMA3_JSON
M = ToolFormat.MISTRAL

# (format or None: no tools, reasoning template, starts in reasoning, the reply's text)
CASES = [
    (H, False, False, 'Let me look.\n<tool_call>\n{"name": "read_file", "arguments": '
                      '{"path":"a.py" ,"n": 1.50, "big": 1E2, "u": "caf\\u00e9 \\ud83d\\ude00'
                      ' \\/ \\ud800", "deep": [true, null, {"x": -0}]}}\n</tool_call>\n'
                      '<tool_call>\n{"arguments": {}, "name": "ls"}\n</tool_call>'),
    (H, False, False, '<tool_call>{"name": "ls", "arguments": "{\\"all\\": true}"}</tool_call>'),
    (H, False, False, 'Not a tool: <tool_call>\n{"name": "rm", "arguments": {}}\n</tool_call>'),
    (H, False, False, "a <tool> b <tool_cal and the end   "),
    (H, True, False, "<think>\nI should read it.  \n</think>\n\nSure. <tool_call>\n"
                     '{"name": "read_file", "arguments": {"path": "b"}}\n</tool_call>'),
    (H, True, True, "the prompt opened the block\n</think>\n\nanswer only"),
    (None, True, False, "<think>short</think>\n\n\nAnd the answer.\n"),
    (None, True, False, "no thinking at all"),
    (L, False, False, ' {"name": "read_file", "parameters": {"path": "x"}}; '
                      '{"name": "ls", "parameters": {}}'),
    (L, False, False, "<|python_tag|>" + '{"name": "ls", "parameters": {"a": "b"}}'),
    (L, False, False, "Hello {not a call}"),
    (M, False, False, '[TOOL_CALLS][{"name": "read_file", "arguments": {"path": "x"}}, '
                      '{"name": "ls", "arguments": {}}]'),
    (M, False, False, '[{"name": "ls", "arguments": {"a": [1, 2.0, true, null]}}]'),
    (M, False, False, '[TOOL_CALLS]read_file[ARGS]{"path": "x"}[TOOL_CALLS]ls[ARGS]{}'),
    (M, False, False, "[not a call] but text"),
    (H, False, False, '<tool_call>{"name": "read_file", "arguments": {"content": "' +
     'def f(x):\\n    return \\"x\\" * 2  # \\u00e9t\\u00e9 \\\\ back\\t' * 12 + '"}}'),
]


def spec_for(fmt, parallel: bool = True) -> ToolSpec | None:
    return None if fmt is None else ToolSpec(TOOLS, fmt, ToolChoice.AUTO, parallel=parallel)


def finished(text: str, reasoning: bool, spec: ToolSpec | None):
    thought, answer = split_reasoning(text) if reasoning else (None, text)
    content, calls = spec.parse(answer) if spec is not None else (answer, [])
    return thought, content, calls


def run(text: str, reasoning: bool, starts: bool, spec, pieces: list[int]):
    """Feed `text` in pieces of the given sizes; the deltas, and after how many characters
    each came."""
    splitter = ReplySplitter(reasoning, spec, starts)
    deltas, fed = [], 0
    for n in pieces:
        d = splitter.feed(text[fed:fed + n])
        fed += n
        deltas.append((fed, d))
    thought, content, calls = finished(text, reasoning, spec)
    deltas.append((fed, splitter.finish(thought, content, calls)))
    return deltas, (thought, content, calls)


def joined(deltas):
    reasoning = "".join(d.reasoning for _, d in deltas)
    content = "".join(d.content for _, d in deltas)
    calls: dict[int, dict] = {}
    for _, d in deltas:
        for c in d.tool_calls:
            entry = calls.setdefault(c.index, {"id": None, "name": None, "arguments": ""})
            if c.id is not None:
                assert entry["id"] is None, "a call announced twice"
                entry["id"], entry["name"] = c.id, c.name
            else:
                assert entry["id"] is not None, "arguments before the call's name"
            entry["arguments"] += c.arguments
    return reasoning, content, [calls[i] for i in sorted(calls)]


def piece_sizes(n: int, rng: random.Random) -> list[int]:
    sizes = []
    while sum(sizes) < n:
        sizes.append(rng.choice([1, 1, 2, 3, 5, 8]))
    return sizes


@pytest.mark.parametrize("case", range(len(CASES)))
def test_the_deltas_join_to_the_finished_split(case):
    fmt, reasoning, starts, text = CASES[case]
    spec = spec_for(fmt)
    rng = random.Random(case)
    for pieces in ([1] * len(text), [len(text)], *(piece_sizes(len(text), rng)
                                                    for _ in range(5))):
        deltas, (thought, content, calls) = run(text, reasoning, starts, spec, pieces)
        got_reasoning, got_content, got_calls = joined(deltas)
        assert got_reasoning == (thought or "")
        assert got_content == content
        assert [(c["id"], c["name"], c["arguments"]) for c in got_calls] == \
            [(c.id, c.name, c.to_dict()["function"]["arguments"]) for c in calls]
        # (the finished content of a reply with calls holds no markup: neither did the
        # stream's, which joins to it)


def test_calls_stream_before_the_reply_ends():
    """Fed a token at a time: the call is announced as soon as its name is whole, and its
    arguments arrive in several fragments, each before the reply's last character."""
    text = ('I will read it.\n<tool_call>\n{"name": "read_file", "arguments": {"path": '
            '"src/kvsession/llm.py", "start_line": 10, "end_line": 80}}\n</tool_call>')
    deltas, _ = run(text, False, False, spec_for(H), [1] * len(text))
    name_at = text.index('"read_file"') + len('"read_file"')
    announced = [fed for fed, d in deltas if any(c.id for c in d.tool_calls)]
    fragments = [fed for fed, d in deltas[:-1]
                 if any(c.arguments and c.id is None for c in d.tool_calls)]
    assert announced == [name_at]
    assert len(fragments) > 10 and fragments[-1] < len(text)
    content_end = max(fed for fed, d in deltas if d.content)
    assert content_end <= text.index("<tool_call>") + 1  # no markup held as content


def test_one_call_when_calls_may_not_be_parallel():
    text = CASES[0][3]
    spec = spec_for(H, parallel=False)
    deltas, (_, _, calls) = run(text, False, False, spec, [1] * len(text))
    assert len(calls) == 1 and {c.index for _, d in deltas for c in d.tool_calls} == {0}


def test_markup_that_ends_malformed_after_its_call_was_announced(caplog):
    """A stream cannot take back a call it announced: the content still joins to the
    finished reply's (the whole text), and the divergence is logged."""
    text = '<tool_call>\n{"name": "ls", "arguments": {"a": 1}}\nand then text'
    deltas, (_, content, calls) = run(text, False, False, spec_for(H), [1] * len(text))
    assert calls == [] and content == text
    assert joined(deltas)[1] == text and joined(deltas)[2][0]["name"] == "ls"
    assert "not a call of the finished reply" in caplog.text


def test_tool_call_delta_in_openais_shape():
    first = ToolCallDelta(0, "call_1", "ls", '{"a"')
    assert first.to_dict() == {"index": 0, "id": "call_1", "type": "function",
                               "function": {"name": "ls", "arguments": '{"a"'}}
    assert ToolCallDelta(1, arguments=": 1}").to_dict() == {
        "index": 1, "function": {"arguments": ": 1}"}}
    assert json.loads('{"a"' + ": 1}") == {"a": 1}
