"""`POST /v1/responses` (OpenAI's Responses API), `GET` and `DELETE /v1/responses/{id}`,
driven by the `openai` package and by the `openai-agents` package's default Responses
model, against a server subprocess on the tiny model (random weights: a forced tool call or
a format stands in for what a real model would choose). A chain of responses is one
Session: `previous_response_id` sends only the new items (the cached tokens show the rest
was not computed again), and with --session-dir a restarted server continues it."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("starlette")  # the `server` extra
openai = pytest.importorskip("openai")

from kvsession.serve.process import ServerProcess  # noqa: E402

KEY = "responses-key"
ENGINE = ["--device", "cpu", "--kv-cache-memory", "64MiB", "--max-model-len", "1024",
          "--host-cache-memory", "0", "--api-key", KEY]
READ_FILE = {"type": "function", "name": "read_file", "description": "Read a file",
             "parameters": {"type": "object", "properties": {
                 "path": {"type": "string", "minLength": 1, "maxLength": 16}},
                 "required": ["path"], "additionalProperties": False}}
FORCE_READ = {"type": "function", "name": "read_file"}


def start(model, sessions) -> ServerProcess:
    return ServerProcess(model, *ENGINE, "--session-dir", str(sessions),
                         stderr_path=sessions.parent / "server.stderr")


@pytest.fixture(scope="module")
def model(model_dirs):
    return model_dirs("llama", chat_template="hermes")


@pytest.fixture(scope="module")
def sessions(tmp_path_factory):
    return tmp_path_factory.mktemp("responses") / "sessions"


@pytest.fixture(scope="module")
def server(model, sessions):
    s = start(model, sessions)
    yield s
    assert s.stop() == 0, s.stderr_tail()


def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key=KEY, max_retries=0, timeout=60)


def test_a_chain_of_responses_is_one_session(server, model):
    c = client(server)
    r1 = c.responses.create(model=model.name, input="List the files.",
                            instructions="You are a terse coding agent.",
                            max_output_tokens=8, temperature=0)
    assert r1.id.startswith("resp_") and r1.status in ("completed", "incomplete")
    assert [item.type for item in r1.output] == ["message"]
    assert isinstance(r1.output_text, str) and r1.usage.input_tokens > 0
    r2 = c.responses.create(model=model.name, input="And the tests?",
                            previous_response_id=r1.id, max_output_tokens=8, temperature=0)
    assert r2.previous_response_id == r1.id
    # the whole conversation before the new message was served from the session's KV
    assert r2.usage.input_tokens_details.cached_tokens >= \
        r1.usage.input_tokens + r1.usage.output_tokens - 1
    assert c.responses.retrieve(r1.id).output_text == r1.output_text
    c.responses.delete(r1.id)
    with pytest.raises(openai.NotFoundError):
        c.responses.retrieve(r1.id)
    with pytest.raises(openai.NotFoundError) as e:
        c.responses.create(model=model.name, input="x", previous_response_id="resp_" + "0" * 32)
    assert e.value.body["param"] == "previous_response_id"


def test_continuing_an_older_response_branches(server, model):
    """A second continuation of the same response is a branch: a chain of its own from the
    stored conversation up to that response, which does not hold the other branch's turn;
    the first branch goes on as before."""
    c = client(server)
    r1 = c.responses.create(model=model.name, input="Start.", max_output_tokens=6,
                            temperature=0)
    r2 = c.responses.create(model=model.name, input="Go on.", previous_response_id=r1.id,
                            max_output_tokens=6, temperature=0)
    r3 = c.responses.create(model=model.name, input="Go on.", previous_response_id=r1.id,
                            max_output_tokens=6, temperature=0)
    assert r3.id[5:21] != r1.id[5:21] == r2.id[5:21]  # its own chain; r2 in r1's
    # its prompt is the conversation up to r1 and its own message, as a client sending
    # that conversation whole has it rendered (not r1's chain, which holds r2's turn)
    whole = c.responses.create(model=model.name, store=False, max_output_tokens=6,
                               temperature=0, input=[
                                   {"role": "user", "content": "Start."},
                                   {"role": "assistant", "content": r1.output_text},
                                   {"role": "user", "content": "Go on."}])
    assert r3.usage.input_tokens == whole.usage.input_tokens
    r4 = c.responses.create(model=model.name, input="And?", previous_response_id=r2.id,
                            max_output_tokens=6, temperature=0)
    assert r4.usage.input_tokens_details.cached_tokens >= \
        r2.usage.input_tokens + r2.usage.output_tokens - 1


def test_function_calls_round_trip(server, model):
    """A forced call comes back as a function_call item (call_id, name, JSON arguments);
    its output, sent as a function_call_output item with previous_response_id, continues
    the same session."""
    c = client(server)
    r1 = c.responses.create(model=model.name, input="Read the readme.", tools=[READ_FILE],
                            tool_choice=FORCE_READ, max_output_tokens=100, temperature=0)
    (call,) = [item for item in r1.output if item.type == "function_call"]
    assert call.name == "read_file" and call.call_id and r1.status == "completed"
    assert isinstance(json.loads(call.arguments)["path"], str)
    r2 = c.responses.create(
        model=model.name, previous_response_id=r1.id, tools=[READ_FILE],
        input=[{"type": "function_call_output", "call_id": call.call_id,
                "output": "# kvsession"}], max_output_tokens=8, temperature=0)
    assert r2.usage.input_tokens_details.cached_tokens >= r1.usage.input_tokens
    # the same conversation sent whole (a client that keeps its own history) is answered
    # too: its items in chat's shape (rendered anew: the session held the call's tokens as
    # generated, so the two prompts, and the answers, may differ)
    r3 = c.responses.create(
        model=model.name, tools=[READ_FILE], store=False, max_output_tokens=8, temperature=0,
        input=[{"role": "user", "content": "Read the readme."},
               {"type": "function_call", "call_id": call.call_id, "name": "read_file",
                "arguments": call.arguments},
               {"type": "function_call_output", "call_id": call.call_id,
                "output": "# kvsession"}])
    assert r3.status in ("completed", "incomplete")
    assert r3.usage.input_tokens >= r1.usage.input_tokens + r1.usage.output_tokens
    with pytest.raises(openai.NotFoundError):
        c.responses.retrieve(r3.id)  # store=False: not stored


def test_streaming_events(server, model):
    """The stream's events in order (created first, completed last, sequence numbers
    counting up); the text deltas join to the final text, the argument deltas to the
    call's arguments."""
    c = client(server)
    events = list(c.responses.create(model=model.name, input="Read main.py",
                                     tools=[READ_FILE], tool_choice=FORCE_READ,
                                     max_output_tokens=100, temperature=0, stream=True))
    kinds = [e.type for e in events]
    assert kinds[0] == "response.created" and kinds[-1] == "response.completed"
    assert [e.sequence_number for e in events] == list(range(len(events)))
    final = events[-1].response
    (call,) = [item for item in final.output if item.type == "function_call"]
    deltas = [e.delta for e in events if e.type == "response.function_call_arguments.delta"]
    assert len(deltas) >= 2 and "".join(deltas) == call.arguments
    assert kinds.index("response.output_item.added") < kinds.index(
        "response.function_call_arguments.delta")
    with c.responses.stream(model=model.name, input="Say something.", max_output_tokens=12,
                            temperature=0) as stream:
        text = "".join(e.delta for e in stream if e.type == "response.output_text.delta")
        done = stream.get_final_response()
    assert text == done.output_text and done.status in ("completed", "incomplete")


def test_text_format_json_schema(server, model):
    schema = {"type": "object", "properties": {"count": {"type": "integer", "minimum": 0,
                                                         "maximum": 9}},
              "required": ["count"], "additionalProperties": False}
    c = client(server)
    r = c.responses.create(model=model.name, input="How many files?", temperature=0,
                           max_output_tokens=40, text={"format": {
                               "type": "json_schema", "name": "count", "schema": schema,
                               "strict": True}})
    assert 0 <= json.loads(r.output_text)["count"] <= 9


def test_bad_items_are_400s_in_openais_shape(server, model):
    c = client(server)
    for bad in ([{"type": "input_image", "image_url": "x"}],
                [{"role": "robot", "content": "hi"}],
                [{"role": "user", "content": [{"type": "input_file", "file_id": "f"}]}], []):
        with pytest.raises(openai.BadRequestError) as e:
            c.responses.create(model=model.name, input=bad, max_output_tokens=4)
        assert e.value.body["param"] == "input"
    with pytest.raises(openai.BadRequestError) as e:
        c.responses.create(model=model.name, input="x", tools=[{"type": "web_search"}])
    assert e.value.body["param"] == "tools"
    assert client(server).responses.create(model=model.name, input="still fine",
                                           max_output_tokens=2).status


def test_stored_responses_survive_a_restart(model, tmp_path):
    """With --session-dir, a restarted server finds the stored response and continues its
    session (persisted at shutdown) from what the KV held."""
    sessions = tmp_path / "sessions"
    s = start(model, sessions)
    try:
        r1 = client(s).responses.create(model=model.name, input="Remember this.",
                                        max_output_tokens=6, temperature=0)
    finally:
        assert s.stop() == 0, s.stderr_tail()
    s = start(model, sessions)
    try:
        c = client(s)
        assert c.responses.retrieve(r1.id).output_text == r1.output_text
        r2 = c.responses.create(model=model.name, input="What was it?",
                                previous_response_id=r1.id, max_output_tokens=6,
                                temperature=0)
        assert r2.usage.input_tokens_details.cached_tokens >= r1.usage.input_tokens
    finally:
        assert s.stop() == 0, s.stderr_tail()


def test_openai_agents_runs_a_tool_with_its_default_responses_model(server, model):
    """The openai-agents package (its Responses model, the SDK's default): the agent's
    forced tool call runs the tool, whose result ends the run (stop_on_first_tool)."""
    agents = pytest.importorskip("agents")
    import asyncio

    from agents import Agent, ModelSettings, Runner, function_tool
    from agents.models.openai_responses import OpenAIResponsesModel

    agents.set_tracing_disabled(True)  # no trace export: nothing leaves this machine
    calls = []

    @function_tool
    def read_file(path: str) -> str:
        """Read a file of the project."""
        calls.append(path)
        return f"contents of {path}"

    aclient = openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key=KEY, max_retries=0)
    agent = Agent(name="reader", instructions="You read files.", tools=[read_file],
                  model=OpenAIResponsesModel(model=model.name, openai_client=aclient),
                  model_settings=ModelSettings(tool_choice="read_file", temperature=0.0,
                                               max_tokens=100),
                  tool_use_behavior="stop_on_first_tool")
    result = asyncio.run(Runner.run(agent, "Read the readme."))
    assert len(calls) == 1 and result.final_output == f"contents of {calls[0]}"


def test_fuzzed_bodies_are_answered_or_refused_in_openais_shape(server, model):
    """Seeded bodies with every field of any JSON type: each is answered (200) or refused
    with a 4xx in OpenAI's error shape, never a 500; the server serves on after them and
    logged no traceback."""
    httpx = pytest.importorskip("httpx")
    from http_fuzz import VALUE as value
    from http_fuzz import post_each
    from hypothesis import strategies as st

    items = st.lists(st.one_of(
        st.fixed_dictionaries({"role": st.sampled_from(["user", "assistant", "system",
                                                        "tool"]),
                               "content": st.one_of(st.text(max_size=8), value)}),
        st.fixed_dictionaries({"type": st.sampled_from(["function_call",
                                                        "function_call_output", "message",
                                                        "reasoning", "other"]),
                               "call_id": value, "name": value, "arguments": value,
                               "output": value}), value), max_size=3)
    fields = {"input": st.one_of(st.text(max_size=8), items, value),
              "instructions": value, "tools": st.one_of(st.just([READ_FILE]), value),
              "tool_choice": st.one_of(st.sampled_from(["auto", "none", "required"]),
                                       st.just(FORCE_READ), value),
              "text": value, "max_output_tokens": st.one_of(st.integers(-2, 6), value),
              "temperature": value, "top_p": value, "store": value,
              "previous_response_id": value, "parallel_tool_calls": value, "metadata": value}
    body = st.fixed_dictionaries({"input": fields["input"]}, optional={
        k: v for k, v in fields.items() if k != "input"})

    def error(body: dict) -> None:
        assert set(body["error"]) == {"message", "type", "param", "code"}, body

    def answer(body: dict) -> None:
        assert body["object"] == "response"

    with httpx.Client(base_url=server.url, timeout=120,
                      headers={"Authorization": f"Bearer {KEY}"}) as http:
        post_each(http, "/v1/responses", {"model": model.name}, body, error, answer)
        r = http.post("/v1/responses", json={"model": model.name, "input": "hi",
                                             "max_output_tokens": 2})
        assert r.status_code == 200
    assert "Traceback" not in server.stderr_tail(10**7), server.stderr_tail()
