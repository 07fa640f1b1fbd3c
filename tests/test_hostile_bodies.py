"""Hostile request bodies (a red-team pass over the HTTP server): each is a 400 in OpenAI's
error JSON naming the field (`param`), never a 500 or a silent 200, and the server answers
a normal request afterwards. One server subprocess for the module (the tiny Llama with a
Hermes tool template, as tests/test_server.py starts it), driven with httpx; the checks
that need no server (the nesting scan, regexes, template variable names, the Ray
ingress's parse) are called directly."""

from __future__ import annotations

import functools
import json

import pytest

pytest.importorskip("starlette")  # the `server` extra
pytest.importorskip("uvicorn")
httpx = pytest.importorskip("httpx")

from kvsession import ConfigError  # noqa: E402
from kvsession.history import check_template_kwargs  # noqa: E402
from kvsession.serve import protocol as P  # noqa: E402
from kvsession.serve.process import ServerProcess  # noqa: E402

MAX_MODEL_LEN = 1024
ENGINE = ["--device", "cpu", "--kv-cache-memory", "64MiB", "--max-model-len",
          str(MAX_MODEL_LEN), "--host-cache-memory", "0"]
DEEP = 50_000
CHAT, COMPLETIONS = "/v1/chat/completions", "/v1/completions"
HI = [{"role": "user", "content": "hi"}]
HEADER = "x-kvsession-max-tokens"


@pytest.fixture(scope="module")
def server(model_dirs, tmp_path_factory):
    model = model_dirs("llama", chat_template="hermes")
    s = ServerProcess(model, *ENGINE,
                      stderr_path=tmp_path_factory.mktemp("hostile") / "server.stderr")
    s.model = model.name
    yield s
    assert s.stop() == 0, s.stderr_tail()
    # none of these bodies reached a handler's bug (a 500 logs its traceback)
    assert "Traceback" not in s.stderr_tail(10**7), s.stderr_tail()


@pytest.fixture(scope="module")
def client(server):
    with httpx.Client(base_url=server.url, timeout=120) as c:
        yield c


def nest(levels: int, leaf=1):
    """`leaf` inside `levels` arrays."""
    for _ in range(levels):
        leaf = [leaf]
    return leaf


def deep_json(levels: int) -> bytes:
    return b"[" * levels + b"]" * levels


def refused(r: httpx.Response, param: str | None, says: str = "") -> dict:
    """The error of a 400 in OpenAI's shape, naming `param`."""
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["type"] == "invalid_request_error"
    assert err["param"] == param, err
    assert says in err["message"], err
    return err


def serves(client: httpx.Client, model: str) -> None:
    """The server still answers a normal request (both routes)."""
    r = client.post(CHAT, json={"model": model, "messages": HI, "max_tokens": 2})
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["message"]["role"] == "assistant"
    r = client.post(COMPLETIONS, json={"model": model, "prompt": "hi", "max_tokens": 2})
    assert r.status_code == 200, r.text


def chat(client, model: str, **body) -> httpx.Response:
    return client.post(CHAT, json={"model": model, "messages": HI, "max_tokens": 2, **body})


# ---- nesting --------------------------------------------------------------------------


def _deep_body(field: str, model: str) -> bytes:
    """A body whose `field` holds DEEP levels of arrays (or objects), raw: json.dumps of
    such a value would itself recurse too deep."""
    head = json.dumps({"model": model, "max_tokens": 2, **(
        {} if field in ("messages", "prompt") else {"messages": HI})})[:-1].encode()
    if field == "chat_template_kwargs":
        value = b'{"a": ' * DEEP + b"1" + b"}" * DEEP
    elif field == "messages":
        value = b'[{"role": "user", "content": "hi", "x": ' + deep_json(DEEP) + b"}]"
    else:
        value = deep_json(DEEP)
    return head + b', "' + field.encode() + b'": ' + value + b"}"


@pytest.mark.parametrize("route,field", [
    (COMPLETIONS, "prompt"), (CHAT, "messages"), (CHAT, "tools"), (CHAT, "response_format"),
    (CHAT, "chat_template_kwargs"), (CHAT, "logit_bias"), (CHAT, "stop"),
    (COMPLETIONS, "logit_bias")])
def test_deep_nesting_in_a_field_is_400_naming_it(server, client, route, field):
    r = client.post(route, content=_deep_body(field, server.model),
                    headers={"Content-Type": "application/json"})
    refused(r, field, f"more than {P.MAX_NESTING} levels deep")
    serves(client, server.model)


def test_deep_nesting_of_the_body_itself_and_the_bound(server, client):
    for route in (CHAT, COMPLETIONS):
        r = client.post(route, content=deep_json(DEEP),
                        headers={"Content-Type": "application/json"})
        refused(r, None, "the request body nests")
    # the bound, exactly: the body is level 1, chat_template_kwargs 2, then the arrays
    ok = chat(client, server.model, chat_template_kwargs={"a": nest(P.MAX_NESTING - 2)})
    assert ok.status_code == 200, ok.text
    r = chat(client, server.model, chat_template_kwargs={"a": nest(P.MAX_NESTING - 1)})
    refused(r, "chat_template_kwargs")
    # brackets in strings are text, however many (here more than the bound)
    text = '[{\\"' * (P.MAX_NESTING // 2 + 1)
    r = client.post(CHAT, json={"model": server.model, "max_tokens": 2, "messages": [
        {"role": "user", "content": text}]})
    assert r.status_code == 200, r.text
    serves(client, server.model)


def test_a_large_body_does_not_leak_its_route_into_the_next_request(server, client):
    """After a text completion whose large body paused reading, uvicorn starts the
    connection's next request in that request's context: a chat's too-long prompt was then
    named "prompt" (the completion's field), not "messages"."""
    body = {"model": server.model, "prompt": "hi", "max_tokens": 2, "user": "x" * 300_000}
    assert client.post(COMPLETIONS, json=body).status_code == 200
    long = [{"role": "user", "content": "hello " * 400}]
    for _ in range(2):
        r = chat(client, server.model, messages=long)
        assert r.status_code == 413 and r.json()["error"]["param"] == "messages", r.text


def test_nesting_scan_reads_strings_and_escapes_as_json_does():
    limit = 4
    P.check_nesting(b'{"a": "[[[[[[[[", "b": [[["]]]]]]\\"[[[[[["]]]}', limit)
    # an escaped backslash escapes no quote: the string ends there
    P.check_nesting(b'{"a\\\\": [[["\\\\", "[[[["]]]}', limit)
    with pytest.raises(P.APIError) as e:
        P.check_nesting(b'{"m": 1, "a\\"b": [[[["\\"", [1]]]]]}', limit)
    assert (e.value.status, e.value.param) == (400, 'a"b')
    with pytest.raises(P.APIError) as e:  # the backslash pair is not an escaped quote
        P.check_nesting(b'{"a": "\\\\", "b": [[[[[]]]]]}', limit)
    assert e.value.param == "b"
    with pytest.raises(P.APIError) as e:  # not an object member: no field to name
        P.check_nesting(b"[[[[[[]]]]]]", limit)
    assert e.value.param is None
    # every way decode_body answers a deep body is a 400, whatever the type
    for kind in (P.ChatRequest, P.CompletionRequest):
        with pytest.raises(P.APIError) as e:
            P.decode_body(b'{"model": "x", "prompt": ' + deep_json(DEEP) + b"}", kind)
        assert e.value.status == 400


def test_the_ray_ingress_leaves_a_deep_body_to_the_replica():
    """The ingress parses a body to route it (json.loads recurses: a 500); a deep one goes
    on unparsed, and the replica answers its 400."""
    ray_ingress = pytest.importorskip("kvsession.serve.ray_ingress")
    assert ray_ingress._json(b'{"model": "x", "prompt": ' + deep_json(DEEP) + b"}") == {}
    assert ray_ingress._json(b'{"model": "x", "session_id": "s"}')["session_id"] == "s"


# ---- messages ---------------------------------------------------------------------------


def test_a_tool_message_needs_its_tool_call_id(server, client):
    msgs = [*HI, {"role": "assistant", "content": "calling"},
            {"role": "tool", "content": "the result"}, {"role": "user", "content": "go on"}]
    refused(chat(client, server.model, messages=msgs), "messages",
            "messages[2].tool_call_id is required for a tool message")
    refused(chat(client, server.model, messages=msgs, stream=True), "messages",
            "messages[2].tool_call_id")
    msgs[2] = {**msgs[2], "tool_call_id": "call_1"}
    assert chat(client, server.model, messages=msgs).status_code == 200
    serves(client, server.model)


def test_an_unknown_role_is_400(server, client):
    for role in ("wizard", "", None, 7):
        msgs = [{"role": "system", "content": "s"}, {"role": role, "content": "hi"}]
        refused(chat(client, server.model, messages=msgs), "messages", "messages[1].role")
    # OpenAI's roles other than the usual three are taken (the template renders them)
    r = chat(client, server.model, messages=[{"role": "developer", "content": "be brief"},
                                             *HI])
    assert r.status_code == 200, r.text
    serves(client, server.model)


# ---- max_tokens -------------------------------------------------------------------------


def test_a_limit_above_the_whole_context_is_400(server, client):
    for field in ("max_tokens", "max_completion_tokens"):
        for stream in (False, True):
            r = chat(client, server.model, **{field: 10**12}, stream=stream)
            refused(r, field, f"max_model_len={MAX_MODEL_LEN}")
    r = client.post(COMPLETIONS, json={"model": server.model, "prompt": "hi",
                                       "max_tokens": MAX_MODEL_LEN + 1})
    refused(r, "max_tokens")
    serves(client, server.model)


def _events(r: httpx.Response) -> list[dict]:
    events = [json.loads(line[6:]) for line in r.text.splitlines()
              if line.startswith("data: {")]
    assert not any("error" in e for e in events), events
    return events


def _cut_as_said(r: httpx.Response, stream: bool, n: int = 1) -> int:
    """The header's limit, checked against what ran: the room the prompt left, and (with
    ignore_eos) the tokens each of the `n` completions generated."""
    assert r.status_code == 200, r.text
    usage = _events(r)[-1]["usage"] if stream else r.json()["usage"]
    room = MAX_MODEL_LEN - usage["prompt_tokens"]
    assert r.headers.get(HEADER) == str(room), (r.headers, usage)
    assert usage["completion_tokens"] == n * room, usage
    return room


def _reply(r: httpx.Response, stream: bool) -> str:
    if not stream:
        return r.json()["choices"][0]["message"]["content"]
    return "".join(e["choices"][0]["delta"].get("content") or "" for e in _events(r)
                   if e["choices"])


@pytest.mark.parametrize("stream", [False, True])
def test_a_limit_cut_by_the_prompt_is_said_in_a_header(server, client, stream):
    """A limit that fits the context but not after the prompt runs to the context's end,
    and the answer, streamed or not, says the limit it ran under: on every path (a new
    session, a continued one, a named one, stateless, a batch, the text completions)."""
    base = {"model": server.model, "temperature": 0, "ignore_eos": True, "stream": stream,
            "stream_options": {"include_usage": True} if stream else None}
    cut, fits = dict(base, max_tokens=1000), dict(base, max_tokens=4)
    long = [{"role": "system", "content": f"You answer at length ({stream})."},
            {"role": "user", "content": "tell " * 210}]
    rooms = []
    # a new conversation (a session's first turn)
    rooms.append(_cut_as_said(client.post(CHAT, json={**cut, "messages": long}), stream))
    # a continued one (the turn's prompt: the session's log and the template's delta)
    other = [long[0], {"role": "user", "content": "say " * 280}]
    r = client.post(CHAT, json={**fits, "messages": other})
    assert r.status_code == 200 and HEADER not in r.headers
    more = [*other, {"role": "assistant", "content": _reply(r, stream)},
            {"role": "user", "content": "more"}]
    r = client.post(CHAT, json={**cut, "messages": more})
    rooms.append(_cut_as_said(r, stream))
    usage = _events(r)[-1]["usage"] if stream else r.json()["usage"]
    assert usage["prompt_tokens_details"]["cached_tokens"] > 0  # it did continue it
    # stateless (a conversation ending with the assistant's start), and a batch (n = 2)
    r = client.post(CHAT, json={**cut, "messages": [*long, {"role": "assistant",
                                                            "content": "Well"}]})
    rooms.append(_cut_as_said(r, stream))
    r = client.post(CHAT, json={**cut, "messages": long, "n": 2, "temperature": 1})
    rooms.append(_cut_as_said(r, stream, n=2))
    # a named session's second turn (max_completion_tokens: the field chat prefers)
    sid = {"session_id": f"cut-{stream}"}
    r = client.post(CHAT, json={**fits, **sid, "messages": other})
    assert r.status_code == 200 and HEADER not in r.headers
    r = client.post(CHAT, json={**fits, **sid, "max_completion_tokens": 1000,
                                "messages": [{"role": "user", "content": "again"}]})
    rooms.append(_cut_as_said(r, stream))
    # text completions: token ids, a string, several prompts (the longest's room)
    for prompt in ([7] * 900, "tell " * 220):
        rooms.append(_cut_as_said(client.post(COMPLETIONS, json={**cut, "prompt": prompt}),
                                  stream))
    r = client.post(COMPLETIONS, json={**base, "max_tokens": 200,
                                       "prompt": [[7] * 900, [7] * 10]})
    assert r.status_code == 200 and r.headers[HEADER] == str(MAX_MODEL_LEN - 900)
    assert all(0 < room < 1000 for room in rooms), rooms
    # no limit cut, no header: one that fits, or none given (up to the context's end)
    for limit in ({"max_tokens": 4}, {}):
        r = client.post(CHAT, json={**base, **limit, "messages": long})
        assert r.status_code == 200 and HEADER not in r.headers, r.headers
    serves(client, server.model)


# ---- schemas: regexes -------------------------------------------------------------------


def _schema(pattern: str) -> dict:
    return {"type": "object", "properties": {"a": {"type": "string", "pattern": pattern}}}


def _tool(parameters: dict) -> list[dict]:
    return [{"type": "function", "function": {"name": "f", "parameters": parameters}}]


def test_an_invalid_regex_in_a_schema_is_400(server, client):
    rf = {"type": "json_schema", "json_schema": {"name": "x", "schema": _schema("((")}}
    for stream in (False, True):
        refused(chat(client, server.model, response_format=rf, stream=stream),
                "response_format", "invalid regular expression in 'pattern' (at /properties/a)")
    refused(chat(client, server.model, tools=_tool(_schema("(("))), "tools",
            "tools[0].function.parameters has an invalid regular expression")
    deep = {"type": "object", "properties": {"a": {"type": "array", "items": {
        "type": "object", "patternProperties": {"[": {"type": "string"}}}}}}
    refused(chat(client, server.model, tools=_tool(deep)), "tools",
            "'patternProperties' (at /properties/a/items)")
    # valid ones are taken: plain, and one only ECMA's dialect reads (a named group)
    for pattern in ("^[a-z]+$", "(?<word>a+)"):
        r = chat(client, server.model, tools=_tool(_schema(pattern)))
        assert r.status_code == 200, r.text
    serves(client, server.model)


def test_regexes_are_refused_only_when_no_parser_reads_them():
    from kvsession.json_schema import check_patterns, regex_error

    assert regex_error("((") is not None and regex_error("[") is not None
    assert regex_error("^a{2,5}$") is None
    assert regex_error("(?<word>a)") is None  # ECMA 262 (xgrammar), not Python
    assert regex_error("(?=a)a") is None  # a lookahead: Python's (xgrammar's engine
    # refuses it itself when it must compile it)
    # a pattern in data (an enum's value, a default) is not a schema's
    check_patterns({"enum": [{"pattern": "(("}], "default": {"pattern": "(("},
                    "properties": {"pattern": {"type": "string"}}}, "x")
    with pytest.raises(ConfigError, match=r"x has an invalid regular expression in "
                                          r"'pattern' \(at /anyOf/1\)"):
        check_patterns({"anyOf": [{"type": "null"}, {"pattern": "(("}]}, "x")


# ---- chat_template_kwargs ---------------------------------------------------------------


@pytest.mark.parametrize("name", ["__class__", "_private", "not-an-identifier", "1a", ""])
def test_template_kwargs_names_are_refused_in_process(name):
    with pytest.raises(ConfigError, match="chat_template_kwargs keys must be template"):
        check_template_kwargs({name: 1})


def test_template_kwargs_names_that_are_variables_are_taken():
    assert check_template_kwargs({"enable_thinking": False, "x1": {"a": [1]}}) == {
        "enable_thinking": False, "x1": {"a": [1]}}


def test_a_dunder_template_kwarg_is_400(server, client):
    for extra in ({}, {"stream": True}, {"n": 2}, {"session_id": "kwargs-1"}):
        refused(chat(client, server.model, chat_template_kwargs={"__class__": 1}, **extra),
                "chat_template_kwargs", "'__class__'")
    # a named session already open does not read a request's kwargs: refused all the same
    assert chat(client, server.model, session_id="kwargs-2").status_code == 200
    refused(chat(client, server.model, session_id="kwargs-2",
                 messages=[{"role": "user", "content": "again"}],
                 chat_template_kwargs={"_x": 1}), "chat_template_kwargs")
    serves(client, server.model)


# ---- Content-Type -----------------------------------------------------------------------


@pytest.mark.parametrize("route", [CHAT, COMPLETIONS])
def test_a_body_declared_as_not_json_is_400(server, client, route):
    body = json.dumps({"model": server.model, "max_tokens": 2, "messages": HI,
                       "prompt": "hi"}).encode()
    for ctype in ("text/plain", "application/x-www-form-urlencoded"):
        r = client.post(route, content=body, headers={"Content-Type": ctype})
        err = refused(r, None, ctype)
        assert err["code"] == "unsupported_content_type"
        # the body was refused unread: the connection serves the next request
        serves(client, server.model)
    for ctype in ("application/json; charset=utf-8", "Application/JSON", None):
        r = client.post(route, content=body, headers={"Content-Type": ctype} if ctype else {})
        assert r.request.headers.get("content-type") == ctype
        assert r.status_code == 200, (ctype, r.text)


def test_content_types_in_process():
    for ok in (None, "", "application/json", "application/json; charset=utf-8",
               "application/vnd.api+json"):
        P.check_content_type(ok)
    for bad in ("text/plain", "multipart/form-data; boundary=x", "application/jsonx"):
        with pytest.raises(P.APIError) as e:
            P.check_content_type(bad)
        assert e.value.status == 400 and e.value.code == "unsupported_content_type"


def test_tool_schemas_with_invalid_regexes_are_refused_in_process():
    """A tool's parameters are compiled only when a call is forced: with tool_choice
    "auto" an invalid pattern went unnoticed in-process (the server refused it)."""
    from kvsession.tools import check_tools

    bad = [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"a": {"type": "string", "pattern": "(("}}}}}]
    deep = [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"a": functools.reduce(
            lambda s, _: {"items": s}, range(5000), {})}}}}]

    with pytest.raises(ConfigError, match=r"tools\[0\]\.function\.parameters has an invalid "
                                          r"regular expression in 'pattern' \(at /properties/a"):
        check_tools(bad)
    with pytest.raises(ConfigError, match="nested too deeply"):
        check_tools(deep)
    named_group = {"type": "string", "pattern": "^(?<y>[0-9]+)$"}  # ECMA, not Python
    ok = [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"a": named_group}}}}]
    assert check_tools(ok) == ok
