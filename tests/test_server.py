"""`python -m kvsession serve`, driven by clients no one here wrote: the official `openai`
package and an agent framework (pydantic-ai), against one server subprocess on the tiny
model (port 0; the address is read from its stdout), and a second one that is shut down."""

from __future__ import annotations

import json
import re
import signal
import socket
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

pytest.importorskip("starlette")  # the `server` extra
pytest.importorskip("uvicorn")
openai = pytest.importorskip("openai")

from kvsession import LLM, SamplingParams  # noqa: E402
from kvsession.flags import add_llm_flags, llm_kwargs  # noqa: E402
from kvsession.serve.process import ServerProcess  # noqa: E402

KEY = "test-key"
MAX_CONCURRENT = 40
ENGINE = ["--device", "cpu", "--kv-cache-memory", "64MiB", "--max-model-len", "1024",
          "--host-cache-memory", "0"]
SYSTEM = "You are a helpful coding assistant."
ORIGIN = "https://agents.example"  # the one origin the module's server allows (CORS)


class Server(ServerProcess):
    """The server subprocess with this module's clients."""

    def client(self, **kw) -> openai.OpenAI:
        return openai.OpenAI(**{"base_url": f"{self.url}/v1", "api_key": KEY, "max_retries": 0,
                                "timeout": 60, **kw})

    def health(self) -> dict:
        return json.loads(self.http("GET", "/health")[1])

    def http(self, method: str, path: str, body: bytes | None = None,
             headers: dict | None = None) -> tuple[int, bytes]:
        """(status, body) of a raw request (any status)."""
        req = urllib.request.Request(f"{self.url}{path}", data=body, method=method,
                                     headers=headers or {})
        try:
            with urllib.request.urlopen(req, timeout=10) as r:
                return r.status, r.read()
        except urllib.error.HTTPError as e:
            return e.code, e.read()


def start(model: Path, tmp: Path, *extra: str) -> Server:
    return Server(model, *ENGINE, *extra, stderr_path=tmp / "server.stderr")


@pytest.fixture(scope="module")
def hermes_dir(model_dirs):
    """The tiny Llama with a Hermes tool-calling chat template (ChatML otherwise)."""
    return model_dirs("llama", chat_template="hermes")


@pytest.fixture(scope="module")
def server(hermes_dir, tmp_path_factory):
    s = start(hermes_dir, tmp_path_factory.mktemp("server"), "--api-key", KEY,
              "--max-concurrent-requests", str(MAX_CONCURRENT), "--allowed-origins", ORIGIN)
    yield s
    rc = s.stop()
    assert rc == 0, s.stderr_tail()


@pytest.fixture(scope="module")
def llm(hermes_dir):
    """The same model in this process: the oracle for greedy outputs."""
    with LLM(hermes_dir, device="cpu", kv_cache_memory="64MiB", max_model_len=1024) as llm:
        yield llm


def model_name(model: Path) -> str:
    return model.name


def wait_until(pred, timeout: float = 30.0, what: str = "condition"):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if (value := pred()):
            return value
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")


# ---- chat ------------------------------------------------------------------------------


def test_chat_greedy_equals_llm_chat(server, llm, hermes_dir):
    msgs = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "List the files"}]
    want = llm.chat(msgs, SamplingParams(max_tokens=24, temperature=0.0), use_tqdm=False)[0]
    c = server.client()
    r = c.chat.completions.create(model=model_name(hermes_dir), messages=msgs, max_tokens=24,
                                  temperature=0)
    assert r.choices[0].message.content == want.text
    assert r.choices[0].message.role == "assistant"
    assert r.choices[0].finish_reason == want.finish_reason
    assert r.usage.prompt_tokens == len(want.prompt_token_ids)
    assert r.usage.completion_tokens == len(want.token_ids)
    # streamed: the deltas join to the same text; usage comes last when asked
    chunks = list(c.chat.completions.create(
        model=model_name(hermes_dir), messages=msgs, max_tokens=24, temperature=0,
        stream=True, stream_options={"include_usage": True}))
    text = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
    assert text == want.text
    assert len([ch for ch in chunks if ch.choices and ch.choices[0].delta.content]) > 1
    assert [ch.choices[0].finish_reason for ch in chunks if ch.choices][-1] == \
        want.finish_reason
    assert chunks[-1].usage.completion_tokens == len(want.token_ids)


def test_text_completion_equals_generate(server, llm, hermes_dir):
    want = llm.generate("the agent reads a file", SamplingParams(max_tokens=12, temperature=0),
                        use_tqdm=False)[0]
    c = server.client()
    r = c.completions.create(model=model_name(hermes_dir), prompt="the agent reads a file",
                             max_tokens=12, temperature=0)
    assert r.choices[0].text == want.text
    streamed = "".join(ch.choices[0].text for ch in c.completions.create(
        model=model_name(hermes_dir), prompt="the agent reads a file", max_tokens=12,
        temperature=0, stream=True) if ch.choices)
    assert streamed == want.text
    lp = c.completions.create(model=model_name(hermes_dir), prompt="the agent reads a file",
                              max_tokens=5, temperature=0, logprobs=2).choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 5
    assert all(x <= 0 for x in lp.token_logprobs) and all(1 <= len(t) <= 2
                                                          for t in lp.top_logprobs)
    assert lp.text_offset == sorted(lp.text_offset)


def test_sampling_fields_logprobs_n_stop_seed(server, hermes_dir):
    c = server.client()
    msgs = [{"role": "user", "content": "write the answer"}]
    r = c.chat.completions.create(model=model_name(hermes_dir), messages=msgs, max_tokens=6,
                                  temperature=0, logprobs=True, top_logprobs=3)
    content = r.choices[0].logprobs.content
    assert len(content) == r.usage.completion_tokens == 6
    for t in content:
        assert t.logprob <= 0 and len(t.top_logprobs) == 3
        # greedy: the chosen token is the most likely one
        assert t.logprob == pytest.approx(max(x.logprob for x in t.top_logprobs))
    kw = dict(model=model_name(hermes_dir), messages=msgs, max_tokens=8, temperature=1.0,
              seed=7, n=2, presence_penalty=0.5, frequency_penalty=0.5, top_p=0.9)
    a, b = c.chat.completions.create(**kw), c.chat.completions.create(**kw)
    assert [ch.message.content for ch in a.choices] == [ch.message.content for ch in b.choices]
    assert len(a.choices) == 2 and a.usage.completion_tokens <= 16
    assert {ch.finish_reason for ch in a.choices} <= {"stop", "length"}
    streamed = {}
    for ch in c.chat.completions.create(stream=True, **kw):
        for choice in ch.choices:
            streamed[choice.index] = streamed.get(choice.index, "") + (
                choice.delta.content or "")
    assert streamed == {ch.index: ch.message.content for ch in a.choices}
    full = c.chat.completions.create(model=model_name(hermes_dir), messages=msgs,
                                     max_completion_tokens=10, temperature=0)
    cut = full.choices[0].message.content[3:6]
    if cut:
        stopped = c.chat.completions.create(model=model_name(hermes_dir), messages=msgs,
                                            max_tokens=10, temperature=0, stop=[cut])
        assert cut not in stopped.choices[0].message.content
        assert stopped.choices[0].finish_reason == "stop"


def test_streamed_completions_logprobs_and_usage(server, hermes_dir):
    """A streamed completion sends its tokens' logprobs (with its last chunk), and a
    batched one (several prompts) its usage once, in a last chunk of its own, only when
    stream_options asks for it."""
    c = server.client()
    kw = dict(model=model_name(hermes_dir), max_tokens=5, temperature=0,
              extra_body={"ignore_eos": True})
    want = c.completions.create(prompt="the agent", logprobs=2, **kw).choices[0].logprobs
    chunks = list(c.completions.create(prompt="the agent", logprobs=2, stream=True, **kw))
    got = [ch.choices[0].logprobs for ch in chunks if ch.choices[0].logprobs]
    assert len(got) == 1 and got[0].tokens == want.tokens == got[0].tokens
    assert got[0].token_logprobs == pytest.approx(want.token_logprobs)
    for include in (False, True):
        chunks = list(c.completions.create(prompt=["one", "two"], stream=True,
                                           stream_options={"include_usage": include}, **kw))
        with_usage = [ch for ch in chunks if ch.usage is not None]
        assert len(with_usage) == include
        assert sorted(ch.choices[0].index for ch in chunks if ch.choices) == [0, 1]
        if include:
            assert with_usage[0].choices == [] and with_usage[0].usage.completion_tokens == 10


def test_response_format_json_schema(server, hermes_dir):
    jsonschema = pytest.importorskip("jsonschema")
    schema = {"type": "object", "properties": {
        "file": {"type": "string", "maxLength": 12},
        "lines": {"type": "integer", "minimum": 0, "maximum": 999}},
        "required": ["file", "lines"], "additionalProperties": False}
    r = server.client().chat.completions.create(
        model=model_name(hermes_dir), messages=[{"role": "user", "content": "read a file"}],
        max_tokens=60, temperature=0,
        response_format={"type": "json_schema",
                         "json_schema": {"name": "read", "schema": schema, "strict": True}})
    jsonschema.validate(json.loads(r.choices[0].message.content), schema)


# ---- reuse for stateless clients -------------------------------------------------------


def test_resent_conversation_reuses_its_kv(server, hermes_dir):
    c = server.client()
    msgs = [{"role": "system", "content": SYSTEM + " Turn counting."},
            {"role": "user", "content": "List the files in the project"}]
    history = 0
    for turn in range(6):
        r = c.chat.completions.create(model=model_name(hermes_dir), messages=msgs,
                                      max_tokens=16, temperature=0)
        if turn:
            cached = r.usage.prompt_tokens_details.cached_tokens
            assert cached >= 0.9 * history, (turn, cached, history)
        history = r.usage.prompt_tokens + r.usage.completion_tokens
        msgs += [{"role": "assistant", "content": r.choices[0].message.content},
                 {"role": "user", "content": f"now run the tests, step {turn}"}]
    metrics = server.http("GET", "/metrics")[1].decode()
    hits = re.search(r"^kvsession_server_conversation_hits_total (\d+)", metrics, re.M)
    assert int(hits.group(1)) >= 5


def test_named_session_binds_turns(server, hermes_dir):
    c = server.client()
    msgs = [{"role": "user", "content": "open the json file"}]
    r1 = c.chat.completions.create(model=model_name(hermes_dir), messages=msgs, max_tokens=8,
                                   temperature=0, extra_body={"session_id": "named-1"})
    # a stateful client sends only the new message; the header binds the session too
    r2 = c.chat.completions.create(
        model=model_name(hermes_dir), messages=[{"role": "user", "content": "and close it"}],
        max_tokens=8, temperature=0, extra_headers={"X-Session-Id": "named-1"})
    assert r2.usage.prompt_tokens_details.cached_tokens >= 0.9 * (
        r1.usage.prompt_tokens + r1.usage.completion_tokens)
    # a retry of the last turn (its reply lost on the way) is answered with the stored
    # reply: nothing is generated and the history is not forked
    history = msgs + [{"role": "assistant", "content": r1.choices[0].message.content},
                      {"role": "user", "content": "and close it"}]
    generated = _metric(server, "kvsession_generated_tokens_total")
    raw = c.chat.completions.with_raw_response.create(
        model=model_name(hermes_dir), messages=history, max_tokens=8, temperature=0,
        extra_body={"session_id": "named-1"})
    again = raw.parse()
    assert raw.headers["x-kvsession-replayed"] == "true"
    assert again.choices[0].message.content == r2.choices[0].message.content
    assert _metric(server, "kvsession_generated_tokens_total") == generated
    chunks = list(c.chat.completions.create(
        model=model_name(hermes_dir), messages=history, max_tokens=8, temperature=0,
        stream=True, extra_body={"session_id": "named-1"}))
    assert "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices) == \
        r2.choices[0].message.content
    # the session goes on from the stored reply
    r3 = c.chat.completions.create(
        model=model_name(hermes_dir), max_tokens=4, temperature=0,
        messages=history + [again.choices[0].message.model_dump(exclude_none=True),
                            {"role": "user", "content": "done?"}],
        extra_body={"session_id": "named-1"})
    assert r3.usage.prompt_tokens_details.cached_tokens >= r2.usage.prompt_tokens
    # a stateful client's new message may repeat the session's first one
    again = c.chat.completions.create(
        model=model_name(hermes_dir), messages=[msgs[0]], max_tokens=4, temperature=0,
        extra_body={"session_id": "named-1"})
    assert again.usage.prompt_tokens_details.cached_tokens >= r3.usage.prompt_tokens
    # an edited history cannot continue the session
    with pytest.raises(openai.ConflictError):
        c.chat.completions.create(
            model=model_name(hermes_dir), max_tokens=4, extra_body={"session_id": "named-1"},
            messages=[msgs[0], {"role": "assistant", "content": "something else"},
                      {"role": "user", "content": "x"}])


# ---- tools -------------------------------------------------------------------------------

def streamed_calls(chunks) -> list[tuple[str, str]]:
    """(name, arguments) of each call of a streamed reply, its pieces joined by index."""
    calls: dict[int, list] = {}
    for ch in chunks:
        for piece in (ch.choices[0].delta.tool_calls or ()) if ch.choices else ():
            call = calls.setdefault(piece.index, [None, ""])
            if piece.function.name:
                call[0] = piece.function.name
            call[1] += piece.function.arguments or ""
    return [tuple(calls[i]) for i in sorted(calls)]


READ_FILE = {"type": "function", "function": {
    "name": "read_file", "description": "Read a file of the project",
    "parameters": {"type": "object", "properties": {"path": {"type": "string", "maxLength": 8}},
                   "required": ["path"], "additionalProperties": False}}}


def test_a_named_session_keeps_its_tools(server, hermes_dir):
    """A named session's tools are rendered into its history at its first turn: later
    turns sending them again get them (a forced call works); other tools are a 400 naming
    `tools`, never tools silently neither rendered nor parsed."""
    c = server.client()
    name = model_name(hermes_dir)
    msgs = [{"role": "user", "content": "list the project"}]
    r1 = c.chat.completions.create(model=name, messages=msgs, max_tokens=4, temperature=0,
                                   tools=[READ_FILE], extra_body={"session_id": "tools-1"})
    msgs += [r1.choices[0].message.model_dump(exclude_none=True),
             {"role": "user", "content": "read the readme"}]
    r2 = c.chat.completions.create(model=name, messages=msgs, max_tokens=200, temperature=0,
                                   tools=[READ_FILE], tool_choice="required",
                                   extra_body={"session_id": "tools-1"})
    assert r2.choices[0].finish_reason == "tool_calls", r2
    assert r2.choices[0].message.tool_calls[0].function.name == "read_file"
    other = {"type": "function", "function": {**READ_FILE["function"], "name": "ls"}}
    msgs += [r2.choices[0].message.model_dump(exclude_none=True),
             {"role": "tool", "tool_call_id": r2.choices[0].message.tool_calls[0].id,
              "content": "# readme"}]
    with pytest.raises(openai.BadRequestError) as e:
        c.chat.completions.create(model=name, messages=msgs, max_tokens=4, tools=[other],
                                  extra_body={"session_id": "tools-1"})
    assert e.value.body["param"] == "tools"


def test_a_named_sessions_tools_hold_a_stream_back_without_tools_in_the_request(
        server, hermes_dir):
    """A stateful client sends only the new message: the named session parses the reply
    with its own tools, and the streamed answer keeps the call markup out of its content
    as the non-streamed one does (it once streamed the raw markup as content)."""
    c, name = server.client(), model_name(hermes_dir)
    text = 'Adding.\n<tool_call>\n{"name": "read_file", "arguments": {"path": "a"}}\n</tool_call>'
    fmt = {"type": "grammar", "ebnf": f"root ::= {json.dumps(text)}"}  # the reply, fixed
    got = []
    for stream in (False, True):
        sid = f"tools-held-{stream}"
        c.chat.completions.create(model=name, messages=[{"role": "user", "content": "hi"}],
                                  max_tokens=2, tools=[READ_FILE],
                                  extra_body={"session_id": sid})
        kw = dict(model=name, messages=[{"role": "user", "content": "read a"}], max_tokens=200,
                  temperature=0, response_format=fmt, extra_body={"session_id": sid})
        if stream:
            with c.chat.completions.stream(**kw) as events:
                for _ in events:
                    pass
                r = events.get_final_completion()
        else:
            r = c.chat.completions.create(**kw)
        m = r.choices[0].message
        got.append((r.choices[0].finish_reason, m.content,
                    [(t.function.name, t.function.arguments) for t in m.tool_calls]))
    assert got[0] == got[1] == ("tool_calls", "Adding.", [("read_file", '{"path": "a"}')])


def test_tool_calls_stream_in_pieces(server, hermes_dir):
    """A streamed reply with a call: content deltas until the markup, then the call in
    OpenAI's pieces (index, id, type and name first; argument fragments after), joining to
    the non-streamed answer; the openai package's streaming helper sees the fragments as
    `tool_calls.function.arguments.delta` events and ends with the same completion."""
    c, name = server.client(), model_name(hermes_dir)
    text = ('Let me look.\n<tool_call>\n{"name": "read_file", "arguments": {"path": '
            '"src/a.py"}}\n</tool_call>')
    kw = dict(model=name, messages=[{"role": "user", "content": "read a"}], max_tokens=200,
              temperature=0, tools=[READ_FILE],
              response_format={"type": "grammar", "ebnf": f"root ::= {json.dumps(text)}"})
    ref = c.chat.completions.create(**kw).choices[0]
    chunks = list(c.chat.completions.create(stream=True, **kw))
    deltas = [ch.choices[0].delta for ch in chunks if ch.choices]
    pieces = [t for d in deltas for t in d.tool_calls or ()]
    content = "".join(d.content or "" for d in deltas)
    assert content == ref.message.content == "Let me look."
    assert pieces[0].id and pieces[0].type == "function" and pieces[0].function.name == \
        "read_file" and all(p.id is None and p.index == 0 for p in pieces[1:])
    assert sum(bool(p.function.arguments) for p in pieces) >= 2
    assert "".join(p.function.arguments or "" for p in pieces) == \
        ref.message.tool_calls[0].function.arguments == '{"path": "src/a.py"}'
    first_piece = next(i for i, d in enumerate(deltas) if d.tool_calls)
    assert first_piece < len(deltas) - 1 and chunks[-1].choices[0].finish_reason == "tool_calls"
    assert not any(d.content for d in deltas[first_piece:])
    with c.chat.completions.stream(**kw) as events:
        kinds = [e.type for e in events]
        final = events.get_final_completion().choices[0]
    assert kinds.count("tool_calls.function.arguments.delta") >= 2
    assert final.finish_reason == "tool_calls" and final.message.content == "Let me look."
    assert [(t.function.name, t.function.arguments) for t in final.message.tool_calls] == \
        [(t.function.name, t.function.arguments) for t in ref.message.tool_calls]


def tool_waits(server) -> float:
    """Sessions the server suspended while their client ran a tool (every decision)."""
    text = server.http("GET", "/metrics")[1].decode()
    return sum(float(v) for v in re.findall(
        r"^kvsession_server_tool_waits_total\{[^}]*\} (\S+)$", text, re.M))


def test_agent_hints_suspend_a_session_waiting_on_a_tool(server, hermes_dir):
    """After a reply that calls a tool, the session is suspended for the tool's expected
    latency: the hint's (in the body's kvsession object, or a header), or, without one,
    the gap the server learned for that conversation; a reply without calls is not."""
    c, name = server.client(), model_name(hermes_dir)
    forced = dict(model=name, max_tokens=200, temperature=0, tools=[READ_FILE],
                  tool_choice="required")
    before = tool_waits(server)
    c.chat.completions.create(messages=[{"role": "user", "content": "hinted"}],
                              extra_body={"kvsession": {"expected_tool_latency_s": 600}},
                              **forced)
    wait_until(lambda: tool_waits(server) == before + 1, what="a suspended session")
    c.chat.completions.create(messages=[{"role": "user", "content": "by header"}],
                              extra_headers={"X-KVSession-Expected-Tool-Latency-S": "0.5"},
                              **forced)
    wait_until(lambda: tool_waits(server) == before + 2, what="a suspended session")
    # no hint: nothing is known of this conversation's tools at its first call...
    msgs = [{"role": "user", "content": "learned"}]
    r = c.chat.completions.create(messages=msgs, **forced)
    call = r.choices[0].message.tool_calls[0]
    msgs += [r.choices[0].message.model_dump(exclude_none=True),
             {"role": "tool", "tool_call_id": call.id, "content": "print(1)"}]
    # ...its second call is suspended with the gap its first one took (learned)
    r2 = c.chat.completions.create(messages=msgs, **forced)
    assert r2.usage.prompt_tokens_details.cached_tokens > 0  # the same Session, continued
    wait_until(lambda: tool_waits(server) == before + 3, what="a learned suspension")
    c.chat.completions.create(model=name, max_tokens=2, messages=[
        {"role": "user", "content": "no tools"}],
        extra_body={"kvsession": {"expected_tool_latency_s": 600}})
    assert tool_waits(server) == before + 3


def test_agent_hint_session_ttl_closes_an_idle_conversation(server, hermes_dir):
    c, name = server.client(), model_name(hermes_dir)
    expired = _metric(server, "kvsession_server_sessions_expired_total")
    kept = server.health()["conversations"]
    c.chat.completions.create(model=name, max_tokens=2, messages=[
        {"role": "user", "content": "a short-lived conversation"}],
        extra_body={"kvsession": {"session_ttl_s": 0.2}})
    wait_until(lambda: _metric(server, "kvsession_server_sessions_expired_total")
               == expired + 1, what="the conversation's session closed")
    assert server.health()["conversations"] <= kept


@pytest.mark.parametrize("hints,param", [
    ({"priority": 1.5}, "kvsession.priority"), ({"session_ttl_s": 0}, "kvsession.session_ttl_s"),
    ({"expected_tool_latency_s": -1}, "kvsession.expected_tool_latency_s"),
    ({"session_ttl_s": "soon"}, "kvsession.session_ttl_s"), ({"nope": 1}, "kvsession.nope"),
    ([1], "kvsession")])
def test_bad_agent_hints_are_400s_naming_them(server, hermes_dir, hints, param):
    with pytest.raises(openai.BadRequestError) as e:
        server.client().chat.completions.create(
            model=model_name(hermes_dir), max_tokens=2, extra_body={"kvsession": hints},
            messages=[{"role": "user", "content": "hi"}])
    assert e.value.body["param"] == param


def test_tool_choice_required_returns_tool_calls(server, hermes_dir):
    jsonschema = pytest.importorskip("jsonschema")
    c = server.client()
    msgs = [{"role": "system", "content": "You are a coding agent."},
            {"role": "user", "content": "read the main file"}]
    r = c.chat.completions.create(model=model_name(hermes_dir), messages=msgs,
                                  tools=[READ_FILE], tool_choice="required", max_tokens=200,
                                  temperature=0)
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls"
    (call,) = choice.message.tool_calls
    assert call.type == "function" and call.function.name == "read_file" and call.id
    jsonschema.validate(json.loads(call.function.arguments),
                        READ_FILE["function"]["parameters"])
    # the client sends the call back with its result; the conversation goes on
    msgs += [choice.message.model_dump(exclude_none=True),
             {"role": "tool", "tool_call_id": call.id, "content": "print('hello')"}]
    r2 = c.chat.completions.create(model=model_name(hermes_dir), messages=msgs,
                                   tools=[READ_FILE], max_tokens=8, temperature=0)
    assert r2.choices[0].finish_reason in ("stop", "length", "tool_calls")
    assert r2.usage.prompt_tokens_details.cached_tokens >= 0.5 * r.usage.prompt_tokens
    # streamed, a named function: the call arrives in pieces (name first, then arguments)
    chunks = list(c.chat.completions.create(
        model=model_name(hermes_dir), messages=msgs[:2], tools=[READ_FILE], max_tokens=200,
        tool_choice={"type": "function", "function": {"name": "read_file"}}, temperature=0,
        stream=True))
    assert [name for name, _ in streamed_calls(chunks)] == ["read_file"]
    assert chunks[-1].choices[0].finish_reason == "tool_calls"
    # no text: content None, as in the non-streamed answer (not "")
    assert all(ch.choices[0].delta.content is None for ch in chunks if ch.choices)


def test_parallel_tool_calls_false(server, hermes_dir):
    """parallel_tool_calls=false: a reply has at most one call, the first (a grammar makes
    the tiny model write two). A named session cannot keep the reply's other calls out of
    its history, so there it is a 400 naming the field; true (the default) is accepted
    everywhere."""
    c = server.client()
    msgs = [{"role": "user", "content": "read the two files"}]
    reply = ('<tool_call>\n{"name": "read_file", "arguments": {"path": "a.py"}}\n</tool_call>\n'
             '<tool_call>\n{"name": "read_file", "arguments": {"path": "b.py"}}\n</tool_call>')
    kw = dict(model=model_name(hermes_dir), messages=msgs, tools=[READ_FILE], max_tokens=400,
              temperature=0, response_format={"type": "grammar",
                                              "ebnf": f"root ::= {json.dumps(reply)}"})

    def paths(r):
        assert r.choices[0].finish_reason == "tool_calls"
        return [json.loads(t.function.arguments)["path"] for t in r.choices[0].message.tool_calls]

    assert paths(c.chat.completions.create(**kw)) == ["a.py", "b.py"]
    assert paths(c.chat.completions.create(parallel_tool_calls=False, **kw)) == ["a.py"]
    chunks = list(c.chat.completions.create(parallel_tool_calls=False, stream=True, **kw))
    assert [json.loads(args)["path"] for _, args in streamed_calls(chunks)] == ["a.py"]
    with pytest.raises(openai.BadRequestError) as e:
        c.chat.completions.create(parallel_tool_calls=False,
                                  extra_body={"session_id": "one-call"}, **kw)
    assert e.value.body["param"] == "parallel_tool_calls"
    r = c.chat.completions.create(parallel_tool_calls=True,
                                  extra_body={"session_id": "one-call"}, **kw)
    assert paths(r) == ["a.py", "b.py"]
    with pytest.raises(openai.BadRequestError):
        c.chat.completions.create(extra_body={"parallel_tool_calls": "no"}, **kw)


def coding_agent(server, hermes_dir):
    """agents.coding_agent on the server: (the agent, the directories list_files was
    called with)."""
    from pydantic_agent import coding_agent as build
    from pydantic_ai.providers.openai import OpenAIProvider

    return build(model_name(hermes_dir), OpenAIProvider(base_url=f"{server.url}/v1",
                                                        api_key=KEY))


def test_agent_framework_two_step_tool_task(server, hermes_dir):
    """pydantic-ai drives the server through a two-step tool task (coding_agent)."""
    pytest.importorskip("pydantic_ai")
    agent, listed = coding_agent(server, hermes_dir)
    result = agent.run_sync("How many files are in the project?")
    assert 0 <= result.output.count <= 9
    assert len(listed) == 1
    kinds = [type(p).__name__ for m in result.all_messages() for p in m.parts]
    assert kinds.count("ToolCallPart") == 2 and kinds.count("ToolReturnPart") == 2


def test_agent_framework_streams_its_tool_steps(server, hermes_dir):
    """pydantic-ai's streamed run (`run_stream`: every model request streamed): the tool
    call of step 1 and the output tool of step 2 arrive as streamed tool-call pieces,
    which pydantic-ai assembles into its calls."""
    pytest.importorskip("pydantic_ai")
    import asyncio

    agent, listed = coding_agent(server, hermes_dir)

    async def run():
        async with agent.run_stream("How many files are in the project?") as result:
            return await result.get_output(), result.all_messages()

    output, messages = asyncio.run(run())
    assert 0 <= output.count <= 9
    assert len(listed) == 1
    kinds = [type(p).__name__ for m in messages for p in m.parts]
    assert kinds.count("ToolCallPart") == 2


def test_langchain_and_llamaindex_over_http(server, hermes_dir):
    """The frameworks tests/test_inprocess.py drives in process, over HTTP: LangChain's
    ChatOpenAI (a streamed, forced tool call; the conversation with its result continues
    the session) and LlamaIndex's OpenAILike (a required call, run)."""
    pytest.importorskip("langchain_openai")
    pytest.importorskip("llama_index.llms.openai_like")
    from langchain_core.messages import HumanMessage
    from langchain_core.tools import tool
    from langchain_openai import ChatOpenAI
    from llama_index.core.tools import FunctionTool
    from llama_index.llms.openai_like import OpenAILike

    @tool
    def read_file(path: str) -> str:
        """Read a file of the project."""
        return f"contents of {path}"

    chat = ChatOpenAI(model=model_name(hermes_dir), base_url=f"{server.url}/v1", api_key=KEY,
                      temperature=0, max_tokens=64, max_retries=0)
    messages = [HumanMessage("Read the readme, LangChain.")]
    chunks = list(chat.bind_tools([read_file], tool_choice="read_file").stream(messages))
    call = sum(chunks[1:], chunks[0])
    assert [c["name"] for c in call.tool_calls] == ["read_file"]
    result = read_file.invoke(call.tool_calls[0])
    reply = chat.bind_tools([read_file], tool_choice="none").invoke(messages + [call, result])
    assert reply.usage_metadata["input_token_details"]["cache_read"] > 0
    ran = []

    def list_files(recursive: bool) -> str:
        """List the files of the project."""
        ran.append(recursive)
        return "a.py"

    fn = FunctionTool.from_defaults(fn=list_files)
    model = OpenAILike(model=model_name(hermes_dir), api_base=f"{server.url}/v1", api_key=KEY,
                       is_chat_model=True, is_function_calling_model=True, temperature=0.0,
                       max_tokens=128, max_retries=0)
    first = model.chat_with_tools([fn], user_msg="List the files.", tool_required=True)
    (selected,) = model.get_tool_calls_from_response(first)
    fn(**selected.tool_kwargs)
    assert len(ran) == 1 and isinstance(ran[0], bool)


def test_smolagents_over_http(model_dirs, tmp_path):
    """smolagents' ToolCallingAgent on OpenAIServerModel against a server (a model with a
    longer context: its system prompt is ~2,500 tiny-tokenizer tokens): each step's
    forced call runs the tool with the schema's type."""
    pytest.importorskip("smolagents")
    from smolagents import OpenAIServerModel, Tool, ToolCallingAgent

    ran = []

    class ListFiles(Tool):
        name = "list_files"
        description = "List the files of the project."
        inputs = {"recursive": {"type": "boolean", "description": "into subdirectories"}}
        output_type = "string"

        def forward(self, recursive: bool) -> str:
            ran.append(recursive)
            return "a.py b.py"

    d = model_dirs("llama", chat_template="hermes", max_position_embeddings=8192)
    s = start(d, tmp_path, "--max-model-len", "8192", "--kv-cache-memory", "128MiB")
    try:
        model = OpenAIServerModel(
            model_name(d), api_base=f"{s.url}/v1", api_key="-",
            client_kwargs={"max_retries": 0, "timeout": 120}, temperature=0.0,
            max_tokens=256, tool_choice={"type": "function", "function": {
                "name": "list_files"}})
        ToolCallingAgent(tools=[ListFiles()], model=model, max_steps=2,
                         verbosity_level=0).run("How many files are there?")
    finally:
        assert s.stop() == 0, s.stderr_tail()
    assert len(ran) == 2 and all(isinstance(r, bool) for r in ran)


# ---- load, disconnects, errors ---------------------------------------------------------


def test_32_concurrent_clients_all_answered(server, hermes_dir):
    def one(i: int) -> str:
        c = server.client()
        r = c.chat.completions.create(
            model=model_name(hermes_dir), max_tokens=8, temperature=0,
            messages=[{"role": "system", "content": SYSTEM},
                      {"role": "user", "content": f"client {i}: list the files"}])
        return r.choices[0].finish_reason
    with ThreadPoolExecutor(32) as pool:
        reasons = list(pool.map(one, range(32)))
    assert len(reasons) == 32 and set(reasons) <= {"stop", "length"}


def _blocks_settled(server, baseline: int):
    h = server.health()
    return h if h["requests_in_flight"] == 0 and h["blocks_used"] <= baseline else None


def _give_up(server, path: str, body: dict) -> None:
    """POST `body` on a raw connection and close it once the server has admitted it."""
    host, port = server.url.removeprefix("http://").split(":")
    data = json.dumps(body).encode()
    with socket.create_connection((host, int(port)), timeout=10) as sock:
        sock.sendall(f"POST {path} HTTP/1.1\r\nHost: {host}\r\nAuthorization: Bearer {KEY}"
                     f"\r\nContent-Type: application/json\r\nContent-Length: {len(data)}"
                     f"\r\n\r\n".encode() + data)
        deadline = time.monotonic() + 30  # polled without a pause: 900 tokens are quick
        while server.health()["requests_in_flight"] == 0:
            assert time.monotonic() < deadline, "the request was never admitted"


def _metric(server, name: str) -> float:
    text = server.http("GET", "/metrics")[1].decode()
    return float(re.search(rf"^{re.escape(name)} ([0-9.e+-]+)$", text, re.M).group(1))


def test_disconnect_cancels_and_frees_blocks(server, hermes_dir):
    c = server.client()
    wait_until(lambda: server.health()["requests_in_flight"] == 0, what="idle server")
    baseline = server.health()["blocks_used"]
    generated = _metric(server, "kvsession_generated_tokens_total")
    # a stateless stream and a conversation's session turn, both cancelled when their
    # client goes away (the turn at its next token): no block in use, nowhere near
    # max_tokens generated
    long = dict(model=model_name(hermes_dir), max_tokens=900, temperature=0,
                extra_body={"ignore_eos": True})
    with c.completions.create(prompt="the agent reads a file", stream=True, **long) as s:
        next(iter(s))
    first = [{"role": "user", "content": "a short answer"}]
    r = c.chat.completions.create(model=model_name(hermes_dir), messages=first, max_tokens=4,
                                  temperature=0)
    convo = first + [{"role": "assistant", "content": r.choices[0].message.content},
                     {"role": "user", "content": "now a long answer"}]
    with c.chat.completions.create(messages=convo, stream=True, **long) as s:
        it = iter(s)
        next(it), next(it)
    # non-streaming clients that give up (close the connection once admitted) likewise
    body = dict(long, ignore_eos=True)
    del body["extra_body"]
    _give_up(server, "/v1/completions", dict(body, prompt="the agent reads"))
    _give_up(server, "/v1/chat/completions", dict(body, messages=convo))
    wait_until(lambda: _blocks_settled(server, baseline), what="blocks freed")
    assert _metric(server, "kvsession_generated_tokens_total") - generated < 900 + 4
    # the cancelled turn never happened: its conversation, re-sent, continues the session
    hits = _metric(server, "kvsession_server_conversation_hits_total")
    r = c.chat.completions.create(model=model_name(hermes_dir), messages=convo, max_tokens=4,
                                  temperature=0)
    assert _metric(server, "kvsession_server_conversation_hits_total") == hits + 1
    assert r.usage.prompt_tokens_details.cached_tokens > 0


def test_giving_up_on_a_batch_cancels_every_completion(server, hermes_dir):
    """n > 1 (streamed or not) and several prompts in one request: the client going away
    cancels every completion, not only the wait for them."""
    wait_until(lambda: server.health()["requests_in_flight"] == 0, what="idle server")
    baseline = server.health()["blocks_used"]
    generated = _metric(server, "kvsession_generated_tokens_total")
    long = dict(model=model_name(hermes_dir), max_tokens=900, temperature=0.8, seed=1,
                ignore_eos=True)
    msgs = [{"role": "user", "content": "many answers"}]
    _give_up(server, "/v1/chat/completions", dict(long, messages=msgs, n=4))
    _give_up(server, "/v1/chat/completions", dict(long, messages=msgs, n=4, stream=True))
    _give_up(server, "/v1/completions", dict(long, prompt=["one", "two", "three", "four"]))
    wait_until(lambda: _blocks_settled(server, baseline), what="blocks freed")
    # 12 completions of 900 tokens each had they run on
    assert _metric(server, "kvsession_generated_tokens_total") - generated < 900 * 4


def test_identical_requests_keep_one_conversation(server, hermes_dir):
    """The same conversation answered twice (a retry, a regenerate at temperature 0) files
    its session under the same key: the one it replaces is closed, not leaked."""
    c = server.client()
    msgs = [{"role": "user", "content": "the same question every time"}]
    used = []
    for _ in range(4):
        c.chat.completions.create(model=model_name(hermes_dir), messages=msgs, max_tokens=20,
                                  temperature=0)
        wait_until(lambda: server.health()["requests_in_flight"] == 0, what="idle server")
        used.append(server.health()["blocks_used"])
    # the replaced sessions are closed off the event loop: settled within the wait
    wait_until(lambda: server.health()["blocks_used"] <= used[1], what="sessions closed")
    assert used[3] <= used[1]


def test_a_chunked_body_over_the_limit_is_413(server, hermes_dir):
    """The body limit holds without a Content-Length (Transfer-Encoding: chunked): counted
    as it arrives, refused at the limit, the connection closed."""
    from kvsession.serve.app import MAX_BODY_BYTES
    host, port = server.url.removeprefix("http://").split(":")
    part = b"x" * (1 << 20)
    with socket.create_connection((host, int(port)), timeout=30) as sock:
        sock.sendall(f"POST /v1/chat/completions HTTP/1.1\r\nHost: {host}\r\n"
                     f"Authorization: Bearer {KEY}\r\nContent-Type: application/json\r\n"
                     f"Transfer-Encoding: chunked\r\n\r\n".encode())
        try:
            for _ in range(MAX_BODY_BYTES // len(part) + 2):
                sock.sendall(b"%x\r\n" % len(part) + part + b"\r\n")
        except OSError:  # the server answered and closed before the end
            pass
        data = b""
        while b"\r\n\r\n" not in data and (chunk := sock.recv(65536)):
            data += chunk
    assert data.startswith(b"HTTP/1.1 413"), data[:200]
    assert server.health()["status"] == "ok"


@pytest.fixture(scope="module")
def thinking_server(model_dirs, tmp_path_factory):
    """A server on a model with a Qwen3-like template (replies think in <think>...</think>
    first; enable_thinking=false closes the block in the prompt)."""
    model = model_dirs("llama", chat_template="qwen3")
    s = start(model, tmp_path_factory.mktemp("thinking"), "--api-key", KEY)
    s.model = model_name(model)
    yield s
    assert s.stop() == 0, s.stderr_tail()


THINK = {"type": "regex",
         "pattern": r"<think>\n[a-z]{4,9}( [a-z]{2,6}){2}\n</think>\n\n[a-z]{3,8}( [a-z]{2,6})"}


def test_reasoning_content_stateless_and_session_served(thinking_server):
    """`reasoning_content` beside the answer: on the message, and streamed as its own
    deltas before the content's (joining to the same), for a stateless request and for a
    conversation the server continues as a Session; none with enable_thinking false."""
    s = thinking_server
    c = s.client()
    msgs = [{"role": "user", "content": "think, then answer"}]
    kw = dict(model=s.model, max_tokens=80, temperature=0, response_format=THINK)
    r = c.chat.completions.create(messages=msgs, **kw).choices[0].message
    thinking = r.model_extra["reasoning_content"]
    assert thinking and r.content and "<think>" not in r.content + thinking
    assert "</think>" not in r.content + thinking
    chunks = [ch.choices[0].delta for ch in c.chat.completions.create(
        messages=msgs, stream=True, **kw) if ch.choices]
    streamed = "".join((d.model_extra or {}).get("reasoning_content") or "" for d in chunks)
    assert streamed == thinking and "".join(d.content or "" for d in chunks) == r.content
    last_thought = max(i for i, d in enumerate(chunks)
                       if (d.model_extra or {}).get("reasoning_content"))
    assert last_thought < min(i for i, d in enumerate(chunks) if d.content)
    # the next turn continues the conversation's Session (the client drops the thinking,
    # as OpenAI clients do): served from it, and split alike
    msgs += [{"role": "assistant", "content": r.content},
             {"role": "user", "content": "and again"}]
    r2 = c.chat.completions.create(messages=msgs, **kw)
    assert r2.usage.prompt_tokens_details.cached_tokens > 0
    assert r2.choices[0].message.model_extra["reasoning_content"]
    plain = c.chat.completions.create(
        messages=msgs[:1], model=s.model, max_tokens=8, temperature=0,
        extra_body={"chat_template_kwargs": {"enable_thinking": False}}).choices[0].message
    assert (plain.model_extra or {}).get("reasoning_content") is None


@pytest.fixture(scope="module")
def slow_server(model_dirs, tmp_path_factory):
    """A server with a bound of 2 on a model big enough (~270 MB) that a stream of 1,000
    tokens takes seconds while opening a request takes milliseconds: what it holds is
    still held when the next request arrives (with the tiny model, a 400-token stream could
    end on CI before the test's next request)."""
    model = model_dirs("llama", hidden_size=1024, intermediate_size=4096, num_hidden_layers=4,
                       num_attention_heads=16, num_key_value_heads=8, head_dim=64)
    s = start(model, tmp_path_factory.mktemp("slow"), "--api-key", KEY,
              "--max-concurrent-requests", "2")
    s.model = model_name(model)
    yield s
    assert s.stop() == 0, s.stderr_tail()


def hold(client, model: str, **kw):
    """A cancellable stream of 1,000 tokens (a stream's response starts with its first
    token: it is running once this returns)."""
    return client.completions.create(model=model, prompt="the agent", max_tokens=1000,
                                     temperature=0, stream=True,
                                     extra_body={"ignore_eos": True, **kw})


def test_overload_is_503_with_retry_after(slow_server):
    s = slow_server
    c = s.client()
    streams = []
    try:
        for _ in range(2):  # fill the bound
            streams.append(hold(c, s.model))
        with pytest.raises(openai.APIStatusError) as e:
            c.chat.completions.create(model=s.model, max_tokens=4,
                                      messages=[{"role": "user", "content": "one more"}])
        assert e.value.status_code == 503
        assert e.value.response.headers["retry-after"] == "1"
        assert e.value.body["code"] == "overloaded"
    finally:
        for st in streams:
            st.close()
    wait_until(lambda: s.health()["requests_in_flight"] == 0, what="streams cancelled")
    r = c.chat.completions.create(model=s.model, max_tokens=4,
                                  messages=[{"role": "user", "content": "after the flood"}])
    assert r.choices[0].message.content is not None


def test_a_queued_named_turn_whose_client_left_never_runs(slow_server):
    """A turn waiting behind its named session's running turn is dropped when its client
    disconnects: it neither runs later nor joins the session's history."""
    s = slow_server
    c = s.client()
    sid = {"session_id": "queued-1"}
    hi = {"role": "user", "content": "hi"}
    r0 = c.chat.completions.create(model=s.model, messages=[hi], max_tokens=2, temperature=0,
                                   extra_body=sid)
    history = [hi, {"role": "assistant", "content": r0.choices[0].message.content}]
    running = c.chat.completions.create(
        model=s.model, messages=[*history, {"role": "user", "content": "a long answer"}],
        max_tokens=1000, temperature=0, stream=True, extra_body={"ignore_eos": True, **sid})
    try:
        host, port = s.url.removeprefix("http://").split(":")
        body = json.dumps({"model": s.model, "max_tokens": 1, **sid, "messages": [
            *history, {"role": "user", "content": "queued"}]}).encode()
        with socket.create_connection((host, int(port)), timeout=30) as sock:
            sock.sendall(f"POST /v1/chat/completions HTTP/1.1\r\nHost: {host}\r\n"
                         f"Authorization: Bearer {KEY}\r\nContent-Type: application/json\r\n"
                         f"Content-Length: {len(body)}\r\n\r\n".encode() + body)
            wait_until(lambda: s.health()["requests_in_flight"] == 2, what="the turn queued")
        # its client is gone: its place in the bound is free at once, while the turn ahead
        # of it still runs (it had waited for that turn to end, then noticed)
        wait_until(lambda: s.health()["requests_in_flight"] == 1, what="the queued turn gone")
        assert next(iter(running)).choices[0].finish_reason is None
        assert s.health()["requests_in_flight"] == 1
    finally:
        running.close()
    wait_until(lambda: s.health()["requests_in_flight"] == 0, what="both requests over")
    # the session holds only its first turn: the next turn extends that history (a history
    # with the queued turn in it would make this a 409)
    r = c.chat.completions.create(
        model=s.model, messages=[*history, {"role": "user", "content": "next"}], max_tokens=2,
        temperature=0, extra_body=sid)
    assert r.choices[0].message.content is not None


def test_errors_are_openai_json_and_fail_alone(server, hermes_dir):
    c = server.client()
    name = model_name(hermes_dir)
    msgs = [{"role": "user", "content": "hello"}]
    with pytest.raises(openai.AuthenticationError) as e:
        server.client(api_key="wrong").chat.completions.create(model=name, messages=msgs)
    assert e.value.body["code"] == "invalid_api_key"
    with pytest.raises(openai.NotFoundError) as e:
        c.chat.completions.create(model="gpt-nope", messages=msgs)
    assert e.value.body["code"] == "model_not_found" and e.value.body["param"] == "model"
    with pytest.raises(openai.BadRequestError) as e:
        c.chat.completions.create(model=name, messages=msgs, temperature=-1)
    assert e.value.body["param"] == "temperature"
    with pytest.raises(openai.BadRequestError) as e:
        c.chat.completions.create(model=name, messages=msgs, max_tokens=0)
    assert e.value.body["param"] == "max_tokens"
    with pytest.raises(openai.BadRequestError) as e:
        c.chat.completions.create(model=name, messages=msgs, extra_body={"max_tokens": "x"})
    assert e.value.body["param"] == "max_tokens"
    with pytest.raises(openai.BadRequestError) as e:  # OpenAI refuses it too
        c.chat.completions.create(model=name, messages=msgs, top_logprobs=2)
    assert e.value.body["param"] == "top_logprobs"
    with pytest.raises(openai.BadRequestError):
        c.chat.completions.create(model=name, messages=msgs, response_format={
            "type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nope"}}})
    long = [{"role": "user", "content": " ".join(["the agent reads a file"] * 300)}]
    with pytest.raises(openai.APIStatusError) as e:
        c.chat.completions.create(model=name, messages=long, max_tokens=4)
    assert e.value.status_code == 413 and e.value.body["code"] == "context_length_exceeded"
    assert e.value.body["param"] == "messages"
    with pytest.raises(openai.APIStatusError) as e:  # named by the endpoint's own field
        c.completions.create(model=name, prompt=long[0]["content"], max_tokens=4)
    assert e.value.status_code == 413 and e.value.body["param"] == "prompt"
    with pytest.raises(openai.APIStatusError) as e:  # per request: chat still says messages
        c.chat.completions.create(model=name, messages=long, max_tokens=4)
    assert e.value.body["param"] == "messages"
    with pytest.raises(openai.APIStatusError) as e:  # streamed: still an HTTP status
        list(c.chat.completions.create(model=name, messages=long, max_tokens=4, stream=True))
    assert e.value.status_code == 413
    status, body = server.http("POST", "/v1/chat/completions", b"{not json",
                               {"Authorization": f"Bearer {KEY}",
                                "Content-Type": "application/json"})
    assert status == 400 and set(json.loads(body)["error"]) == {
        "message", "type", "param", "code"}
    status, body = server.http("GET", "/v1/nothing")
    assert status == 404 and json.loads(body)["error"]["code"] == "not_found"
    # bad requests sent together with good ones fail alone
    def good(i):
        return c.chat.completions.create(model=name, messages=msgs, max_tokens=4,
                                         temperature=0).choices[0].finish_reason
    def bad(i):
        with pytest.raises(openai.APIStatusError):
            c.chat.completions.create(model=name, messages=long, max_tokens=4)
    with ThreadPoolExecutor(8) as pool:
        futs = [pool.submit(good if i % 2 else bad, i) for i in range(8)]
        results = [f.result() for f in futs]
    assert all(r in ("stop", "length") for r in results[1::2])


def test_models_health_metrics(server, hermes_dir):
    for _ in range(2):  # the second starts a new session on the pinned system prompt
        server.client().chat.completions.create(
            model=model_name(hermes_dir), max_tokens=2,
            messages=[{"role": "system", "content": SYSTEM}, {"role": "user", "content": "m"}])
    models = server.client().models.list()
    assert [m.id for m in models.data] == [model_name(hermes_dir)]
    h = server.health()
    assert h["status"] == "ok" and h["blocks_total"] > 0
    text = server.http("GET", "/metrics")[1].decode()
    # read by prometheus_client's own parser: what a Prometheus server would see
    from prometheus_client.parser import text_string_to_metric_families
    families = {f.name: f for f in text_string_to_metric_families(text)}

    def value(name: str, sample: str | None = None, **labels) -> float:
        found = [s.value for s in families[name].samples
                 if s.name == (sample or name) and s.labels == labels]
        assert len(found) == 1, (name, labels, families[name].samples)
        return found[0]

    kinds = {name: f.type for name, f in families.items()}
    # counts since start are counters (exposed with _total), levels are gauges
    for name in ("kvsession_prefix_hit_tokens", "kvsession_generated_tokens",
                 "kvsession_num_requests", "kvsession_spills", "kvsession_server_requests",
                 "kvsession_server_cached_tokens"):
        assert kinds[name] == "counter", name
    for name in ("kvsession_tiers_blocks_used", "kvsession_goodput_tokens_per_s",
                 "kvsession_server_requests_in_flight", "kvsession_prefix_hit_rate"):
        assert kinds[name] == "gauge", name
    assert value("kvsession_tiers_blocks_used", tier="device") >= 0
    assert value("kvsession_spills", "kvsession_spills_total", tier="host") >= 0
    assert value("kvsession_server_requests", "kvsession_server_requests_total",
                 route="/v1/chat/completions", code="200") >= 2
    assert value("kvsession_server_cached_tokens", "kvsession_server_cached_tokens_total") > 0
    # latency: histograms over every finished request, which add up across replicas; no
    # window percentiles
    requests = value("kvsession_num_requests", "kvsession_num_requests_total")
    for name in ("kvsession_request_ttft_seconds", "kvsession_request_queue_seconds"):
        assert kinds[name] == "histogram"
        buckets = [(float(s.labels["le"]), s.value) for s in families[name].samples
                   if s.name == f"{name}_bucket"]
        counts = [n for _, n in buckets]
        assert counts == sorted(counts) and buckets[-1][0] == float("inf")
        assert counts[-1] == value(name, f"{name}_count") == requests >= 2
        assert value(name, f"{name}_sum") > 0 or name.endswith("queue_seconds")
    assert kinds["kvsession_request_tpot_seconds"] == "histogram"
    assert not any("p99" in name or "p50" in name for name in families)


def test_cross_origin_requests_follow_allowed_origins(server):
    """A browser's preflight from the allowed origin is answered with the method and the
    headers it asked for; another origin gets no CORS headers (its browser refuses); an
    allowed page reads the answer of a real request."""
    def request(method: str, path: str, headers: dict) -> tuple[int, dict]:
        req = urllib.request.Request(f"{server.url}{path}", method=method, headers=headers)
        try:
            with urllib.request.urlopen(req, timeout=10) as r:
                return r.status, {k.lower(): v for k, v in r.headers.items()}
        except urllib.error.HTTPError as e:
            return e.code, {k.lower(): v for k, v in e.headers.items()}

    preflight = {"Access-Control-Request-Method": "POST",
                 "Access-Control-Request-Headers": "authorization, content-type"}
    status, headers = request("OPTIONS", "/v1/chat/completions",
                              {"Origin": ORIGIN, **preflight})
    assert status == 200 and headers["access-control-allow-origin"] == ORIGIN
    assert "POST" in headers["access-control-allow-methods"]
    assert "authorization" in headers["access-control-allow-headers"].lower()
    status, headers = request("OPTIONS", "/v1/chat/completions",
                              {"Origin": "https://elsewhere.example", **preflight})
    assert status == 400 and "access-control-allow-origin" not in headers
    status, headers = request("GET", "/v1/models",
                              {"Origin": ORIGIN, "Authorization": f"Bearer {KEY}"})
    assert status == 200 and headers["access-control-allow-origin"] == ORIGIN
    status, headers = request("GET", "/v1/models", {"Authorization": f"Bearer {KEY}"})
    assert status == 200 and "access-control-allow-origin" not in headers


def test_conversation_key_ignores_how_a_client_sends_the_reply_back():
    from kvsession.serve.conversations import canonical, chain

    reply = {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function",
         "function": {"name": "read_file", "arguments": '{"path": "a.py", "n": 1}'}}]}
    echoed = {"role": "assistant", "content": "", "refusal": None, "tool_calls": [
        {"id": "other-id", "type": "function",
         "function": {"name": "read_file", "arguments": {"n": 1, "path": "a.py"}}}]}
    assert canonical(reply) == canonical(echoed)
    assert canonical({"role": "user", "content": [{"type": "text", "text": "a"},
                                                  {"type": "text", "text": "b"}]}) == \
        canonical({"role": "user", "content": "ab", "name": None})
    other = {**echoed, "tool_calls": [{"function": {"name": "read_file",
                                                    "arguments": '{"path": "b.py", "n": 1}'}}]}
    assert canonical(reply) != canonical(other)
    msgs = [{"role": "user", "content": "x"}, reply]
    assert chain("", msgs)[-1] == chain("", [msgs[0], echoed])[-1] != chain("t", msgs)[-1]


def test_work_a_gone_client_started_in_a_thread_is_handed_over():
    """A Session opened on a worker thread for a client that left meanwhile is not lost
    open (holding KV): the thread cannot be stopped, so its result goes to if_cancelled."""
    import asyncio
    import threading

    from kvsession.serve.conversations import _in_thread

    release, handed = threading.Event(), []

    def opening():
        release.wait(30)
        return "a session"

    async def main():
        waiter = asyncio.ensure_future(_in_thread(opening, if_cancelled=handed.append))
        await asyncio.sleep(0)  # the thread starts
        waiter.cancel()
        with pytest.raises(asyncio.CancelledError):
            await waiter
        assert handed == []
        release.set()
        while not handed:  # bounded by opening()'s own wait
            await asyncio.sleep(0.01)

    asyncio.run(asyncio.wait_for(main(), 60))
    assert handed == ["a session"]


# ---- command line, shutdown --------------------------------------------------------------


def test_every_llm_argument_is_a_flag():
    import argparse

    p = argparse.ArgumentParser()
    add_llm_flags(p, LLM)
    args = p.parse_args(["--model", "m", "--block-size", "32", "--no-enable-prefix-caching",
                         "--max-model-len", "256", "--kv-cache-memory", "1GiB",
                         "--spill-after-s", "2.5", "--prefill-worker", "tcp://a:1",
                         "tcp://b:2", "--speculative-config",
                         '{"method": "ngram", "num_speculative_tokens": 3}'])
    kw = llm_kwargs(args, LLM)
    assert kw["speculative_config"] == {"method": "ngram", "num_speculative_tokens": 3}
    with pytest.raises(SystemExit):  # argparse's error: "not JSON: ..."
        p.parse_args(["--model", "m", "--speculative-config", "{ngram"])
    assert kw["block_size"] == 32 and kw["enable_prefix_caching"] is False
    assert kw["max_model_len"] == 256 and kw["kv_cache_memory"] == "1GiB"
    assert kw["spill_after_s"] == 2.5 and kw["prefill_worker"] == ["tcp://a:1", "tcp://b:2"]
    assert kw["seed"] == 0 and kw["device"] == "auto"
    import inspect
    named = {n for n, prm in inspect.signature(LLM.__init__).parameters.items()
             if prm.kind is inspect.Parameter.KEYWORD_ONLY}
    assert named == set(kw)


def test_sigterm_finishes_in_flight_and_persists_named_sessions(hermes_dir, tmp_path):
    sessions = tmp_path / "sessions"
    s = start(hermes_dir, tmp_path, "--session-dir", str(sessions))
    try:
        c = s.client(api_key="unused")
        first = c.chat.completions.create(
            model=model_name(hermes_dir), max_tokens=4, temperature=0,
            messages=[{"role": "user", "content": "remember me"}],
            extra_body={"session_id": "keep-me"})
        stream = c.chat.completions.create(
            model=model_name(hermes_dir), max_tokens=200, temperature=0, stream=True,
            messages=[{"role": "user", "content": "in flight"}], extra_body={"ignore_eos": True})
        it = iter(stream)
        next(it)
        s.proc.send_signal(signal.SIGTERM)
        rest = list(it)  # the request in flight finishes
        assert rest[-1].choices[0].finish_reason == "length"
        assert s.proc.wait(timeout=60) == 0, s.stderr_tail()
    finally:
        s.stop()
    assert (sessions / "keep-me.kvs").is_file()
    assert not [p for p in sessions.glob("*.kvs") if p.name != "keep-me.kvs"], \
        "conversation sessions are closed and deleted at shutdown"
    # a new server resumes the named session from --session-dir with its KV
    s = start(hermes_dir, tmp_path, "--session-dir", str(sessions))
    try:
        # a request re-sent to it (the first server went away before its client saw the
        # reply) is answered from the session's log
        retry = s.client(api_key="unused").chat.completions.create(
            model=model_name(hermes_dir), max_tokens=4, temperature=0,
            messages=[{"role": "user", "content": "remember me"}],
            extra_body={"session_id": "keep-me"})
        assert retry.choices[0].message.content == first.choices[0].message.content
        r = s.client(api_key="unused").chat.completions.create(
            model=model_name(hermes_dir), max_tokens=4, temperature=0,
            messages=[{"role": "user", "content": "still there?"}],
            extra_body={"session_id": "keep-me"})
        history = first.usage.prompt_tokens + first.usage.completion_tokens
        assert r.usage.prompt_tokens > history
        assert r.usage.prompt_tokens_details.cached_tokens >= 0.9 * history
    finally:
        assert s.stop() == 0, s.stderr_tail()
