"""`kvsession.openai_compat`: the server's routes in this process (serve/inprocess.py),
driven by clients no one here wrote (the `openai` package sync and async, the `anthropic`
package, openai-agents, pydantic-ai) through the streaming httpx transports, and by the
package's own dict clients. The same answers as `LLM.chat`, conversations continued on
their sessions' KV, errors in the protocols' shapes, and streams that arrive while they
are generated: a stream closed after its first chunk ends its request there."""

from __future__ import annotations

import asyncio
import json
import time

import pytest

pytest.importorskip("starlette")  # the `inprocess` extra
httpx = pytest.importorskip("httpx")
openai = pytest.importorskip("openai")

from kvsession import LLM, SamplingParams  # noqa: E402
from kvsession.openai_compat import APIError, AsyncClient, Client, transport  # noqa: E402

SYSTEM = "You are a helpful coding assistant."
READ_FILE = {"type": "function", "function": {
    "name": "read_file", "description": "Read a file",
    "parameters": {"type": "object", "properties": {
        "path": {"type": "string", "minLength": 1, "maxLength": 16}},
        "required": ["path"], "additionalProperties": False}}}


@pytest.fixture(scope="module")
def llm(model_dirs):
    """The tiny Llama with a Hermes tool-calling template."""
    d = model_dirs("llama", chat_template="hermes")
    with LLM(d, device="cpu", kv_cache_memory="64MiB", max_model_len=1024) as llm:
        yield llm


@pytest.fixture
def client(llm):
    with Client(llm) as c:
        yield c


def generated_tokens(c: Client) -> float:
    text = c.http.get("/metrics").text
    line = next(x for x in text.splitlines()
                if x.startswith("kvsession_generated_tokens_total "))
    return float(line.split()[1])


def test_chat_equals_llm_chat_in_openai_types_streamed_or_not(client, llm):
    msgs = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "List files"}]
    want = llm.chat(msgs, SamplingParams(max_tokens=24, temperature=0.0), use_tqdm=False)[0]
    r = client.chat.completions.create(model="any-name", messages=msgs, max_tokens=24,
                                       temperature=0)
    assert isinstance(r, openai.types.chat.ChatCompletion)
    assert r.choices[0].message.content == want.text
    assert r.usage.completion_tokens == len(want.token_ids)
    chunks = list(client.chat.completions.create(
        model="any-name", messages=msgs, max_tokens=24, temperature=0, stream=True,
        stream_options={"include_usage": True}))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == want.text
    assert len([c for c in chunks if c.choices and c.choices[0].delta.content]) > 1
    assert chunks[-1].usage.completion_tokens == len(want.token_ids)
    assert [m.id for m in client.models.list().data] == [llm.config.model.name]


def test_a_stream_arrives_while_it_is_generated(client):
    """The first chunk is read while the request is still running (httpx's own ASGI
    transport would hand the body over only at its end); closing the stream there is the
    client going away: the request ends, nowhere near its max_tokens."""
    before = generated_tokens(client)
    stream = client.chat.completions.create(
        model="m", messages=[{"role": "user", "content": "a long answer"}], max_tokens=900,
        temperature=0, stream=True, extra_body={"ignore_eos": True})
    with stream:
        chunks = iter(stream)
        next(chunks), next(chunks)  # the role, then the first token
        assert client.server.requests_in_flight == 1
    # the engine ends the request at its next step: a bounded poll for it
    deadline = time.monotonic() + 30
    while client.server.requests_in_flight and time.monotonic() < deadline:
        time.sleep(0.02)
    assert client.server.requests_in_flight == 0
    assert generated_tokens(client) - before < 900


def test_a_resent_conversation_continues_on_its_session(client):
    msgs = [{"role": "system", "content": SYSTEM + " Turns."},
            {"role": "user", "content": "List the files in the project"}]
    history = 0
    for turn in range(3):
        r = client.chat.completions.create(model="m", messages=msgs, max_tokens=12,
                                           temperature=0)
        if turn:
            assert r.usage.prompt_tokens_details.cached_tokens >= 0.9 * history
        history = r.usage.prompt_tokens + r.usage.completion_tokens
        msgs += [{"role": "assistant", "content": r.choices[0].message.content},
                 {"role": "user", "content": f"now step {turn}"}]


def test_errors_are_the_protocols_error_objects(client, llm):
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="m", messages=[], max_tokens=4)
    assert e.value.body["param"] == "messages"
    with Client(llm, model_name="served") as named:  # a name given: others are 404s
        with pytest.raises(openai.NotFoundError):
            named.chat.completions.create(model="other", messages=[
                {"role": "user", "content": "hi"}], max_tokens=4)
    with Client(llm, return_dicts=True) as plain:
        with pytest.raises(APIError) as e:
            plain.chat.completions.create(model="m", messages=[], max_tokens=4)
        assert e.value.status_code == 400 and e.value.body["error"]["param"] == "messages"


def test_dict_clients_answer_and_stream_plain_dicts(llm):
    msgs = [{"role": "user", "content": "Read the readme"}]
    want = llm.chat(msgs, SamplingParams(max_tokens=16, temperature=0.0), use_tqdm=False)[0]
    with Client(llm, return_dicts=True) as c:
        r = c.chat.completions.create(model="m", messages=msgs, max_tokens=16, temperature=0)
        assert isinstance(r, dict) and r["choices"][0]["message"]["content"] == want.text
        events = list(c.chat.completions.create(model="m", messages=msgs, max_tokens=16,
                                                temperature=0, stream=True))
        assert "".join(e["choices"][0]["delta"].get("content") or "" for e in events) == \
            want.text
        called = c.chat.completions.create(model="m", messages=msgs, max_tokens=64,
                                           temperature=0, tools=[READ_FILE],
                                           tool_choice="required")
        call = called["choices"][0]["message"]["tool_calls"][0]["function"]
        assert call["name"] == "read_file" and 1 <= len(json.loads(call["arguments"])["path"])
        assert c.responses.create(model="m", input="hi", max_output_tokens=8)["object"] == \
            "response"

    async def run():
        async with AsyncClient(llm, return_dicts=True) as ac:
            r = await ac.chat.completions.create(model="m", messages=msgs, max_tokens=16,
                                                 temperature=0)
            stream = await ac.chat.completions.create(model="m", messages=msgs,
                                                      max_tokens=16, temperature=0,
                                                      stream=True)
            text = "".join([e["choices"][0]["delta"].get("content") or ""
                            async for e in stream])
            return r["choices"][0]["message"]["content"], text

    assert asyncio.run(run()) == (want.text, want.text)


def test_async_openai_client_streams_in_the_callers_loop(llm):
    msgs = [{"role": "user", "content": "List files"}]
    want = llm.chat(msgs, SamplingParams(max_tokens=20, temperature=0.0), use_tqdm=False)[0]

    async def run():
        async with AsyncClient(llm) as ac:
            stream = await ac.chat.completions.create(model="m", messages=msgs,
                                                      max_tokens=20, temperature=0,
                                                      stream=True)
            pieces = [c.choices[0].delta.content async for c in stream
                      if c.choices and c.choices[0].delta.content]
            return pieces

    pieces = asyncio.run(run())
    assert "".join(pieces) == want.text and len(pieces) > 1


def test_the_anthropic_sdk_over_the_transport(llm):
    anthropic = pytest.importorskip("anthropic")
    msgs = [{"role": "user", "content": "List files"}]
    want = llm.chat(msgs, SamplingParams(max_tokens=16, temperature=0.0), use_tqdm=False)[0]
    # the SDK 2.x takes `httpx2` clients (httpx's API under another name), 1.x httpx ones
    http = pytest.importorskip("httpx2") if int(anthropic.__version__.split(".")[0]) >= 2 \
        else httpx
    with http.Client(transport=transport(llm, http=http)) as client:
        c = anthropic.Anthropic(base_url="http://kvsession", api_key="-",
                                http_client=client, max_retries=0)
        r = c.messages.create(model="m", max_tokens=16, messages=msgs,
                              extra_body={"temperature": 0.0})
        assert r.content[0].text == want.text
        with c.messages.stream(model="m", max_tokens=16, messages=msgs,
                               extra_body={"temperature": 0.0}) as s:
            assert "".join(s.text_stream) == want.text


def test_openai_agents_runs_a_tool_in_process(llm):
    """The openai-agents package, its chat-completions model on the in-process async
    client: the forced tool call runs the tool with schema-valid arguments; the run's
    second model request continues the first's session (its prompt cached)."""
    agents = pytest.importorskip("agents")
    from agents import Agent, ModelSettings, Runner, function_tool
    from agents.models.openai_chatcompletions import OpenAIChatCompletionsModel

    agents.set_tracing_disabled(True)  # no trace export: nothing leaves this machine
    calls = []

    @function_tool
    def read_file(path: str) -> str:
        """Read a file of the project."""
        calls.append(path)
        return f"contents of {path}"

    async def run():
        async with AsyncClient(llm) as ac:
            agent = Agent(name="reader", instructions="You read files.", tools=[read_file],
                          model=OpenAIChatCompletionsModel(model="m", openai_client=ac.openai),
                          model_settings=ModelSettings(tool_choice="read_file",
                                                       temperature=0.0, max_tokens=64),
                          tool_use_behavior="stop_on_first_tool")
            return await Runner.run(agent, "Read the readme.")

    result = asyncio.run(run())
    assert len(calls) == 1 and 1 <= len(calls[0]) <= 16
    assert result.final_output == f"contents of {calls[0]}"


def test_pydantic_ai_two_step_tool_task_in_process_reuses_the_session(llm):
    """pydantic-ai on the in-process transport: step 1 calls `list_files`, step 2 answers
    through its output tool; step 2's request is step 1's conversation with the tool's
    result: its prompt comes from the session's KV."""
    pytest.importorskip("pydantic_ai")
    from pydantic_agent import coding_agent
    from pydantic_ai.providers.openai import OpenAIProvider

    async def run():
        async with AsyncClient(llm) as ac:
            agent, listed = coding_agent("m", OpenAIProvider(openai_client=ac.openai))
            result = await agent.run("How many files are in the project?")
            return result, listed

    result, listed = asyncio.run(run())
    assert 0 <= result.output.count <= 9 and len(listed) == 1
    responses = [m for m in result.all_messages() if type(m).__name__ == "ModelResponse"]
    assert len(responses) == 2
    assert responses[1].usage.cache_read_tokens >= responses[0].usage.input_tokens


def conversation_hits(http) -> float:
    text = http.get("http://kvsession/metrics").text
    line = next(x for x in text.splitlines()
                if x.startswith("kvsession_server_conversation_hits_total "))
    return float(line.split()[1])


def test_langchain_chat_openai_binds_tools_streams_and_reuses_the_session(llm):
    """LangChain's ChatOpenAI on the in-process transport: bind_tools with a forced call
    (streamed: the call arrives in tool_call_chunks), the tool run, then the conversation
    with its result sent back: it continues the first request's session (cached)."""
    pytest.importorskip("langchain_openai")
    from langchain_core.messages import HumanMessage, ToolMessage
    from langchain_core.tools import tool
    from langchain_openai import ChatOpenAI

    ran = []

    @tool
    def read_file(path: str) -> str:
        """Read a file of the project."""
        ran.append(path)
        return f"contents of {path}"

    with httpx.Client(transport=transport(llm)) as http:
        chat = ChatOpenAI(model="m", base_url="http://kvsession/v1", api_key="-",
                          http_client=http, temperature=0, max_tokens=64, max_retries=0)
        bound = chat.bind_tools([read_file], tool_choice="read_file")
        messages = [HumanMessage("Read the readme.")]
        chunks = list(bound.stream(messages))
        assert any(c.tool_call_chunks for c in chunks)
        call = sum(chunks[1:], chunks[0])
        assert len(call.tool_calls) == 1 and call.tool_calls[0]["name"] == "read_file"
        args = call.tool_calls[0]["args"]
        assert set(args) == {"path"} and 1 <= len(args["path"]) <= 16  # the schema's
        result = read_file.invoke(call.tool_calls[0])
        assert isinstance(result, ToolMessage) and ran == [args["path"]]
        hits = conversation_hits(http)
        # the same tools (a conversation's tools are part of its session), none forced
        reply = chat.bind_tools([read_file], tool_choice="none").invoke(
            messages + [call, result])
        assert conversation_hits(http) == hits + 1  # step 1's session, continued
        assert reply.usage_metadata["input_token_details"]["cache_read"] > 0


def test_smolagents_tool_calling_agent_in_process(model_dirs):
    """smolagents' ToolCallingAgent on OpenAIServerModel over the in-process transport:
    each step's forced call runs the tool; the second step's request reads the first's
    prompt from the cache. (Its system prompt is ~2,500 tokens of the tiny tokenizer: a
    model with a longer context.)"""
    pytest.importorskip("smolagents")
    from smolagents import OpenAIServerModel, Tool, ToolCallingAgent

    d = model_dirs("llama", chat_template="hermes", max_position_embeddings=8192)

    ran = []

    class ListFiles(Tool):  # a boolean argument: short whatever random weights say
        name = "list_files"
        description = "List the files of the project."
        inputs = {"recursive": {"type": "boolean", "description": "into subdirectories"}}
        output_type = "string"

        def forward(self, recursive: bool) -> str:
            ran.append(recursive)
            return "a.py b.py"

    with LLM(d, device="cpu", kv_cache_memory="128MiB", max_model_len=8192) as llm, \
            httpx.Client(transport=transport(llm)) as http:
        model = OpenAIServerModel(
            "m", api_base="http://kvsession/v1", api_key="-",
            client_kwargs={"http_client": http, "max_retries": 0}, temperature=0.0,
            max_tokens=256,  # the call's closing tag is many tiny-tokenizer tokens in
            # the tiny model has random weights: every step calls the tool (a real model
            # chooses, final_answer included)
            tool_choice={"type": "function", "function": {"name": "list_files"}})
        computed = []  # prompt tokens the engine computed, after each step

        def after_step(step, agent=None):
            computed.append(llm.stats().prefill_tokens)

        agent = ToolCallingAgent(tools=[ListFiles()], model=model, max_steps=2,
                                 verbosity_level=0, step_callbacks=[after_step])
        agent.run("How many files are there?")
    assert len(ran) == 2 and all(isinstance(r, bool) for r in ran)  # the schema's type
    # smolagents re-renders its memory each step (its own words for the call and the
    # observation), so the second request is not the first's conversation continued: its
    # shared ~2,500-token prefix comes from the prefix cache instead, and little of its
    # prompt is computed again
    first, second = computed[0], computed[1] - computed[0]
    assert second < first / 4, (first, second)


def test_llamaindex_openai_like_tool_call_in_process(llm):
    """LlamaIndex's OpenAILike on the in-process transport: chat_with_tools with the call
    required, the tool run with the call's arguments (a boolean: the schema's type), the
    conversation with its result sent back continuing the first request's session."""
    pytest.importorskip("llama_index.llms.openai_like")
    from llama_index.core.llms import ChatMessage
    from llama_index.core.tools import FunctionTool
    from llama_index.llms.openai_like import OpenAILike

    ran = []

    def list_files(recursive: bool) -> str:
        """List the files of the project."""
        ran.append(recursive)
        return "a.py b.py"

    tool = FunctionTool.from_defaults(fn=list_files)
    with httpx.Client(transport=transport(llm)) as http:
        model = OpenAILike(model="m", api_base="http://kvsession/v1", api_key="-",
                           is_chat_model=True, is_function_calling_model=True,
                           http_client=http, temperature=0.0, max_tokens=128,
                           max_retries=0)
        # (LlamaIndex asks parallel_tool_calls=false by default, which a Session cannot
        # honour: such requests run stateless, their shared prefix from the prefix cache)
        first = model.chat_with_tools([tool], user_msg="List the files.", tool_required=True,
                                      allow_parallel_tool_calls=True)
        (call,) = model.get_tool_calls_from_response(first)
        assert call.tool_name == "list_files"
        result = tool(**call.tool_kwargs)
        assert ran == [call.tool_kwargs["recursive"]] and isinstance(ran[0], bool)
        hits = conversation_hits(http)
        messages = [ChatMessage(role="user", content="List the files."), first.message,
                    ChatMessage(role="tool", content=str(result),
                                additional_kwargs={"tool_call_id": call.tool_id})]
        model.chat_with_tools([tool], chat_history=messages, tool_choice="none",
                              allow_parallel_tool_calls=True)
        assert conversation_hits(http) == hits + 1


def test_a_langgraph_thread_is_a_named_session(llm):
    """A LangGraph graph (its checkpointer keeps the thread's messages) whose model node
    names the thread's session (`extra_body={"session_id": thread_id}`): every invocation
    on the thread continues that session, its history read from the KV."""
    pytest.importorskip("langgraph")
    pytest.importorskip("langchain_openai")
    from langchain_core.messages import HumanMessage
    from langchain_openai import ChatOpenAI
    from langgraph.checkpoint.memory import InMemorySaver
    from langgraph.graph import START, MessagesState, StateGraph

    with httpx.Client(transport=transport(llm)) as http:
        chat = ChatOpenAI(model="m", base_url="http://kvsession/v1", api_key="-",
                          http_client=http, temperature=0, max_tokens=12, max_retries=0)

        def model_node(state: MessagesState, config) -> dict:
            thread = config["configurable"]["thread_id"]
            return {"messages": [chat.bind(extra_body={"session_id": thread}).invoke(
                state["messages"])]}

        graph = StateGraph(MessagesState).add_node("model", model_node) \
            .add_edge(START, "model").compile(checkpointer=InMemorySaver())
        config = {"configurable": {"thread_id": "thread-7"}}
        first = graph.invoke({"messages": [HumanMessage("List the files.")]}, config)
        second = graph.invoke({"messages": [HumanMessage("Now read one.")]}, config)
    assert len(second["messages"]) == 4  # the thread's history, kept by the checkpointer
    used = first["messages"][-1].usage_metadata
    again = second["messages"][-1].usage_metadata
    assert again["input_token_details"]["cache_read"] >= used["input_tokens"]


def test_usage_counts_only_what_earlier_requests_computed_as_cached(llm):
    """A new conversation's system prompt is pinned when its session opens, within that
    same request: its usage reports none of it cached (OpenAI's meaning: reused from
    before). A second conversation with the same system prompt reuses the pin: cached."""
    system = {"role": "system", "content": "You are a careful reviewer. " * 6}
    with Client(llm) as c:
        first = c.chat.completions.create(model="m", max_tokens=4, temperature=0, messages=[
            system, {"role": "user", "content": "Review a.py"}])
        again = c.chat.completions.create(model="m", max_tokens=4, temperature=0, messages=[
            system, {"role": "user", "content": "Review b.py"}])
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    assert again.usage.prompt_tokens_details.cached_tokens >= 16  # the pinned blocks
    s1 = llm.session(system="A fresh system prompt for the session API. " * 4)
    s2 = llm.session(system="A fresh system prompt for the session API. " * 4)
    assert s1.stats.system_computed_tokens > 0 and s2.stats.system_computed_tokens == 0
    s1.close()
    s2.close()
