"""`POST /v1/messages` (Anthropic's Messages API) driven by the `anthropic` package against a
server subprocess on the tiny model (random weights: forced tool calls stand in for a real
model's choices): messages and content blocks, a conversation continued from its Session
(`cache_read_input_tokens`), `cache_control` pinning the system prompt, tool use and tool
results, streaming events (text and input_json deltas), errors in Anthropic's shape,
`x-api-key`, and fuzzed bodies."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("starlette")  # the `server` extra
anthropic = pytest.importorskip("anthropic")
httpx = pytest.importorskip("httpx")

from kvsession.serve.process import ServerProcess  # noqa: E402

KEY = "anthropic-key"
ENGINE = ["--device", "cpu", "--kv-cache-memory", "64MiB", "--max-model-len", "1024",
          "--host-cache-memory", "0", "--api-key", KEY]
SYSTEM = "You are a coding agent. Read files when asked, then answer briefly."
READ_FILE = {"name": "read_file", "description": "Read a file of the project",
             "input_schema": {"type": "object", "properties": {
                 "path": {"type": "string", "minLength": 1, "maxLength": 16}},
                 "required": ["path"], "additionalProperties": False}}
FORCE_READ = {"type": "tool", "name": "read_file"}
# the anthropic package (2.x) has no sampling arguments of its own: sent in the body
GREEDY = {"temperature": 0}


@pytest.fixture(scope="module")
def model(model_dirs):
    return model_dirs("llama", chat_template="hermes")


@pytest.fixture(scope="module")
def server(model, tmp_path_factory):
    s = ServerProcess(model, *ENGINE,
                      stderr_path=tmp_path_factory.mktemp("anthropic") / "server.stderr")
    yield s
    assert s.stop() == 0, s.stderr_tail()
    assert "Traceback" not in s.stderr_tail(10**7), s.stderr_tail()


def client(server) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=server.url, api_key=KEY, max_retries=0, timeout=60)


def test_a_conversation_is_continued_from_its_session(server, model):
    """The second turn re-sends the conversation (as Anthropic clients do): it is served
    from the Session of the first, its history read from the cache; the system prompt's
    cache_control breakpoint pins it once (written by the first request, read after)."""
    c = client(server)
    system = [{"type": "text", "text": SYSTEM, "cache_control": {"type": "ephemeral"}}]
    first = [{"role": "user", "content": "List the files."}]
    m1 = c.messages.create(model=model.name, max_tokens=8, system=system, messages=first,
                           extra_body=GREEDY)
    assert m1.type == "message" and m1.role == "assistant"
    assert m1.content[0].type == "text" and m1.stop_reason in ("end_turn", "max_tokens")
    assert m1.usage.cache_creation_input_tokens > 0 and m1.usage.output_tokens > 0
    history = first + [{"role": "assistant", "content": m1.content[0].text},
                       {"role": "user", "content": [{"type": "text", "text": "And then?"}]}]
    m2 = c.messages.create(model=model.name, max_tokens=8, system=system, messages=history,
                           extra_body=GREEDY)
    prompt1 = m1.usage.input_tokens + m1.usage.cache_read_input_tokens + \
        m1.usage.cache_creation_input_tokens
    assert m2.usage.cache_creation_input_tokens == 0
    assert m2.usage.cache_read_input_tokens >= prompt1 + m1.usage.output_tokens - 1


def test_tool_use_streams_and_round_trips(server, model):
    """A forced tool call: a tool_use block (stop_reason tool_use) whose input streams as
    input_json_delta fragments joining to the non-streamed input; its tool_result, sent
    back in a user message, continues the conversation's Session."""
    c = client(server)
    kw = dict(model=model.name, max_tokens=100, system=SYSTEM, tools=[READ_FILE],
              tool_choice=FORCE_READ, extra_body=GREEDY,
              messages=[{"role": "user", "content": "Read the readme."}])
    m = c.messages.create(**kw)
    (use,) = [b for b in m.content if b.type == "tool_use"]
    assert m.stop_reason == "tool_use" and use.name == "read_file" and use.id
    assert isinstance(use.input["path"], str)
    events = list(c.messages.create(stream=True, **kw))
    kinds = [e.type for e in events]
    assert kinds[0] == "message_start" and kinds[-1] == "message_stop"
    fragments = [e.delta.partial_json for e in events if e.type == "content_block_delta"
                 and e.delta.type == "input_json_delta"]
    assert len(fragments) >= 2 and json.loads("".join(fragments)) == use.input
    start = next(e for e in events if e.type == "content_block_start")
    assert start.content_block.type == "tool_use" and start.content_block.name == "read_file"
    assert kinds.count("content_block_start") == kinds.count("content_block_stop")
    with c.messages.stream(**kw) as s:
        final = s.get_final_message()
    assert [(b.type, getattr(b, "input", None)) for b in final.content] == \
        [(b.type, getattr(b, "input", None)) for b in m.content]
    r = c.messages.create(model=model.name, max_tokens=8, system=SYSTEM, tools=[READ_FILE],
                          extra_body=GREEDY, messages=[
                              {"role": "user", "content": "Read the readme."},
                              {"role": "assistant", "content": [b.model_dump() for b in
                                                                m.content]},
                              {"role": "user", "content": [
                                  {"type": "tool_result", "tool_use_id": use.id,
                                   "content": "# kvsession"},
                                  {"type": "text", "text": "Summarise it."}]}])
    assert r.usage.cache_read_input_tokens >= m.usage.input_tokens + \
        m.usage.cache_read_input_tokens


def test_text_streams_with_the_sdks_helper(server, model):
    c = client(server)
    with c.messages.stream(model=model.name, max_tokens=12, extra_body=GREEDY,
                           messages=[{"role": "user", "content": "Say something."}]) as s:
        text = "".join(s.text_stream)
        final = s.get_final_message()
    assert final.content[0].text == text and final.stop_reason in ("end_turn", "max_tokens")
    assert final.usage.output_tokens > 0


def test_output_config_json_schema(server, model):
    schema = {"type": "object", "properties": {"count": {"type": "integer", "minimum": 0,
                                                         "maximum": 9}},
              "required": ["count"], "additionalProperties": False}
    m = client(server).messages.create(
        model=model.name, max_tokens=40, extra_body=GREEDY,
        messages=[{"role": "user", "content": "How many files?"}],
        output_config={"format": {"type": "json_schema", "schema": schema}})
    assert 0 <= json.loads(m.content[0].text)["count"] <= 9


def test_errors_in_anthropics_shape(server, model):
    bad = anthropic.Anthropic(base_url=server.url, api_key="wrong", max_retries=0)
    with pytest.raises(anthropic.AuthenticationError) as e:
        bad.messages.create(model=model.name, max_tokens=4,
                            messages=[{"role": "user", "content": "hi"}])
    assert e.value.body["error"]["type"] == "authentication_error"
    with pytest.raises(anthropic.NotFoundError) as e:
        client(server).messages.create(model="nope", max_tokens=4,
                                       messages=[{"role": "user", "content": "hi"}])
    assert e.value.body["type"] == "error"
    with httpx.Client(base_url=server.url, headers={"x-api-key": KEY}) as http:
        for body, says in (({"model": model.name, "messages": []}, "max_tokens"),
                           ({"model": model.name, "max_tokens": 4, "messages": [
                               {"role": "user", "content": [{"type": "image"}]}]}, "image"),
                           ({"model": model.name, "max_tokens": 4, "messages": [
                               {"role": "robot", "content": "hi"}]}, "role"),
                           ({"model": model.name, "max_tokens": 4, "tool_choice": {
                               "type": "sometimes"}, "messages": [
                               {"role": "user", "content": "hi"}]}, "tool_choice")):
            r = http.post("/v1/messages", json=body)
            assert r.status_code == 400, r.text
            err = r.json()
            assert err["type"] == "error" and err["error"]["type"] == "invalid_request_error"
            assert says in err["error"]["message"], err
        ok = http.post("/v1/messages", json={"model": model.name, "max_tokens": 2,
                                             "messages": [{"role": "user", "content": "hi"}]})
        assert ok.status_code == 200 and ok.json()["type"] == "message"


def test_fuzzed_bodies_are_answered_or_refused_in_anthropics_shape(server, model):
    from http_fuzz import VALUE as value
    from http_fuzz import post_each
    from hypothesis import strategies as st

    block = st.one_of(st.fixed_dictionaries({
        "type": st.sampled_from(["text", "tool_use", "tool_result", "image", "thinking"]),
        "text": value, "id": value, "name": value, "input": value, "tool_use_id": value,
        "content": value}), value)
    message = st.one_of(st.fixed_dictionaries({
        "role": st.sampled_from(["user", "assistant", "system"]),
        "content": st.one_of(st.text(max_size=8), st.lists(block, max_size=3), value)}),
        value)
    body = st.fixed_dictionaries({"messages": st.one_of(st.lists(message, max_size=3), value),
                                  "max_tokens": st.one_of(st.integers(-1, 4), value)},
                                 optional={"system": value, "tools": st.one_of(
                                     st.just([READ_FILE]), value), "tool_choice": st.one_of(
                                     st.just(FORCE_READ), value), "stop_sequences": value,
                                     "temperature": value, "top_p": value, "top_k": value})

    def error(body: dict) -> None:
        assert body["type"] == "error" and set(body["error"]) == {"type", "message"}, body

    def answer(body: dict) -> None:
        assert body["type"] == "message"

    with httpx.Client(base_url=server.url, timeout=120, headers={"x-api-key": KEY}) as http:
        post_each(http, "/v1/messages", {"model": model.name}, body, error, answer)
