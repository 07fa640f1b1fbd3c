"""Streams split as their replies are (kvsession/reply_stream.py, end to end): `llm.stream`,
`llm.astream` and `Session.stream` on tiny models whose replies are forced by grammars.
The chunks' `content`, `reasoning` and `tool_calls` join to the finished reply's text,
reasoning and calls (ids included, and the session's history keeps the streamed ids), a
call is announced and its arguments flow before the reply ends, markup never reaches the
content, and `chunk.text` stays the text as generated."""

from __future__ import annotations

import asyncio
import json

import pytest

from kvsession import LLM, SamplingParams, StructuredOutput

TOOLS = [{"type": "function", "function": {
    "name": "read_file", "description": "Read a file",
    "parameters": {"type": "object", "properties": {
        "path": {"type": "string", "minLength": 1, "maxLength": 24},
        "lines": {"type": "array", "items": {"type": "integer", "minimum": 0,
                                             "maximum": 99}, "maxItems": 3}},
        "required": ["path", "lines"]}}}]
CONVERSATION = [{"role": "system", "content": "You are an agent."},
                {"role": "user", "content": "Read main.py"}]


@pytest.fixture(scope="module")
def llms(model_dirs):
    built = {}

    def get(template):
        if template not in built:
            built[template] = LLM(model_dirs("llama", chat_template=template),
                                  kv_cache_memory="32MiB", max_model_len=1024)
        return built[template]

    yield get
    for llm in built.values():
        llm.close()


def joined(chunks):
    calls: dict[int, dict] = {}
    for ch in chunks:
        for c in ch.tool_calls:
            entry = calls.setdefault(c.index, {"id": None, "name": None, "arguments": "",
                                               "fragments": 0})
            if c.id is not None:
                entry["id"], entry["name"] = c.id, c.name
            entry["arguments"] += c.arguments
            entry["fragments"] += bool(c.arguments)
    return ("".join(ch.reasoning for ch in chunks), "".join(ch.content for ch in chunks),
            [calls[i] for i in sorted(calls)])


def as_streamed(calls) -> list[tuple]:
    return [(c.id, c.name, c.to_dict()["function"]["arguments"]) for c in calls]


@pytest.mark.parametrize("template", ["hermes", "llama3", "mistral"])
def test_a_forced_call_streams_as_the_reply_parses_it(llms, template):
    """tool_choice="required" (random weights, temperature 1: the grammar decides): the
    call's id and name arrive first, its arguments in fragments before the last chunk,
    no content, and all of it is the finished reply's call, which `chat` gives too."""
    llm = llms(template)
    params = SamplingParams(max_tokens=200, temperature=1.0, seed=5)
    kwargs = {"tools": TOOLS, "tool_choice": "required"}
    stream = llm.stream(messages=CONVERSATION, sampling_params=params, **kwargs)
    chunks = list(stream)
    out = stream.output
    reasoning, content, calls = joined(chunks)
    assert len(out.tool_calls) == 1 and out.text == "" and content == "" and reasoning == ""
    assert [(c["id"], c["name"], c["arguments"]) for c in calls] == as_streamed(out.tool_calls)
    assert json.loads(calls[0]["arguments"]) == out.tool_calls[0].arguments
    announced = next(i for i, ch in enumerate(chunks) if ch.tool_calls)
    assert announced < len(chunks) - 1 and calls[0]["fragments"] >= 2
    (ref,) = llm.chat(CONVERSATION, params, use_tqdm=False, **kwargs)
    assert ref.token_ids == out.token_ids
    assert [(c.name, c.arguments) for c in ref.tool_calls] == \
        [(c.name, c.arguments) for c in out.tool_calls]
    assert "".join(ch.text for ch in chunks) == llm.tokenizer.decode(out.token_ids)

    async def run():
        s = llm.astream(messages=CONVERSATION, sampling_params=params, **kwargs)
        got = [ch async for ch in s]
        return got, s.output

    achunks, aout = asyncio.run(run())
    assert [(c["name"], c["arguments"]) for c in joined(achunks)[2]] == \
        [(c["name"], c["arguments"]) for c in calls]
    assert as_streamed(aout.tool_calls) == [(c["id"], c["name"], c["arguments"])
                                            for c in joined(achunks)[2]]


def test_content_streams_before_the_call_and_no_markup_reaches_it(llms):
    """A reply that says something, then calls (tool_choice "auto", the reply forced
    by a grammar): the content arrives before the call markup is complete, and joins to
    the reply's text without it."""
    llm = llms("hermes")
    reply = ('Let me read it first.\n<tool_call>\n{"name": "read_file", "arguments": '
             '{"path": "src/main.py", "lines": [1, 2]}}\n</tool_call>')
    params = SamplingParams(max_tokens=200, temperature=0.0,
                            structured=StructuredOutput(grammar=f"root ::= {json.dumps(reply)}"))
    stream = llm.stream(messages=CONVERSATION, sampling_params=params, tools=TOOLS)
    chunks = list(stream)
    out = stream.output
    _, content, calls = joined(chunks)
    assert content == out.text == "Let me read it first."
    assert as_streamed(out.tool_calls) == [(c["id"], c["name"], c["arguments"]) for c in calls]
    assert calls[0]["arguments"] == '{"path": "src/main.py", "lines": [1, 2]}'
    first_call = next(i for i, ch in enumerate(chunks) if ch.tool_calls)
    assert all(not ch.content for ch in chunks[first_call:])
    assert "".join(ch.content for ch in chunks[:first_call]) == content


def test_a_session_streams_its_call_and_keeps_the_streamed_id(llms):
    llm = llms("hermes")
    reply = '<tool_call>\n{"name": "read_file", "arguments": {"path": "a.py", "lines": []}}' \
            '\n</tool_call>'
    grammar = StructuredOutput(grammar=f"root ::= {json.dumps(reply)}")
    with llm.session(system="You are an agent.", tools=TOOLS) as s:
        chunks = list(s.stream("Read a.py", structured=grammar, max_tokens=100))
        r = chunks[-1].reply
        _, content, calls = joined(chunks)
        assert content == r.text == "" and len(r.tool_calls) == 1
        assert as_streamed(r.tool_calls) == [(c["id"], c["name"], c["arguments"])
                                             for c in calls]
        assert s.messages[-1]["tool_calls"][0]["id"] == calls[0]["id"]
        s.add("tool", "print(1)")


def test_reasoning_streams_apart_from_the_answer(llms):
    """A Qwen3-like template: the reply's thinking streams as `reasoning`, the answer
    after it as `content`, as `chat` splits the finished reply (the <think> markup in
    neither); with enable_thinking false the prompt closes the block and all is content."""
    llm = llms("qwen3")
    params = SamplingParams(max_tokens=80, temperature=0.0, structured=StructuredOutput(
        regex=r"<think>\n[a-z]{4,9}( [a-z]{2,6}){2}\n</think>\n\n[a-z]{3,8}( [a-z]{2,6}){1,2}"))
    stream = llm.stream(messages=CONVERSATION, sampling_params=params)
    chunks = list(stream)
    out = stream.output
    reasoning, content, _ = joined(chunks)
    assert out.reasoning and reasoning == out.reasoning and content == out.text
    assert "<think>" not in content + reasoning and "</think>" not in content + reasoning
    last_reasoning = max(i for i, ch in enumerate(chunks) if ch.reasoning)
    first_content = min(i for i, ch in enumerate(chunks) if ch.content)
    assert last_reasoning < first_content
    (ref,) = llm.chat(CONVERSATION, params, use_tqdm=False)
    assert (ref.reasoning, ref.text) == (out.reasoning, out.text)

    plain = SamplingParams(max_tokens=20, temperature=0.0, structured=StructuredOutput(
        regex=r"[a-z]{3,8}( [a-z]{2,6}){1,3}"))
    stream = llm.stream(messages=CONVERSATION, sampling_params=plain,
                        chat_template_kwargs={"enable_thinking": False})
    chunks = list(stream)
    assert stream.output.reasoning is None and joined(chunks)[0] == ""
    assert joined(chunks)[1] == stream.output.text == "".join(ch.text for ch in chunks)
