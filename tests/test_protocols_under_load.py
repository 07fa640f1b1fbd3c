"""The three protocols at once on one server (item 7 of #48): 32 concurrent streaming
clients mixing chat completions (openai), Responses (openai) and Messages (anthropic), all
answered; a client of each API that disconnects mid-stream frees its blocks (nothing stays
in use, nowhere near its max_tokens generated)."""

from __future__ import annotations

import json
import socket
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

pytest.importorskip("starlette")  # the `server` extra
openai = pytest.importorskip("openai")
anthropic = pytest.importorskip("anthropic")

from kvsession.serve.process import ServerProcess  # noqa: E402

KEY = "load-key"
ENGINE = ["--device", "cpu", "--kv-cache-memory", "64MiB", "--max-model-len", "1024",
          "--host-cache-memory", "0", "--api-key", KEY, "--max-concurrent-requests", "40"]


@pytest.fixture(scope="module")
def server(model_dirs, tmp_path_factory):
    model = model_dirs("llama", chat_template="hermes")
    s = ServerProcess(model, *ENGINE,
                      stderr_path=tmp_path_factory.mktemp("load") / "server.stderr")
    s.model = model.name
    yield s
    assert s.stop() == 0, s.stderr_tail()


def health(server) -> dict:
    import urllib.request
    with urllib.request.urlopen(f"{server.url}/health", timeout=10) as r:
        return json.loads(r.read())


def metric(server, name: str) -> float:
    import re
    import urllib.request
    with urllib.request.urlopen(f"{server.url}/metrics", timeout=10) as r:
        text = r.read().decode()
    return float(re.search(rf"^{name} (\S+)$", text, re.M).group(1))


def test_32_streaming_clients_mixing_three_apis(server):
    def one(i: int) -> str:
        kind = i % 3
        msg = f"client {i}: list the files"
        if kind == 0:
            c = openai.OpenAI(base_url=f"{server.url}/v1", api_key=KEY, max_retries=0)
            text = "".join(ch.choices[0].delta.content or "" for ch in c.chat.completions.create(
                model=server.model, messages=[{"role": "user", "content": msg}], max_tokens=8,
                temperature=0, stream=True) if ch.choices)
            return f"chat:{bool(text)}"
        if kind == 1:
            c = openai.OpenAI(base_url=f"{server.url}/v1", api_key=KEY, max_retries=0)
            events = list(c.responses.create(model=server.model, input=msg, stream=True,
                                             max_output_tokens=8, temperature=0))
            return f"responses:{events[-1].type}"
        c = anthropic.Anthropic(base_url=server.url, api_key=KEY, max_retries=0)
        with c.messages.stream(model=server.model, max_tokens=8,
                               messages=[{"role": "user", "content": msg}]) as s:
            final = s.get_final_message()
        return f"messages:{final.stop_reason}"

    with ThreadPoolExecutor(32) as pool:
        got = list(pool.map(one, range(32)))
    assert got.count("chat:True") + got.count("chat:False") == 11
    assert got.count("responses:response.completed") == 11
    assert sum(g.startswith("messages:") for g in got) == 10
    assert all(g.split(":")[1] in ("end_turn", "max_tokens")
               for g in got if g.startswith("messages:"))


@pytest.mark.parametrize("path,body", [
    ("/v1/responses", {"input": "a long answer", "max_output_tokens": 900}),
    ("/v1/messages", {"max_tokens": 900,
                      "messages": [{"role": "user", "content": "a long answer"}]}),
])
def test_a_client_gone_mid_stream_frees_its_blocks(server, path, body):
    """The stream's first event read, then the connection closed: the request is
    cancelled (it generates nowhere near its 900 tokens) and its blocks come back."""
    baseline = health(server)["blocks_used"]
    generated = metric(server, "kvsession_generated_tokens_total")
    host, port = server.url.removeprefix("http://").split(":")
    data = json.dumps({"model": server.model, "stream": True, "temperature": 0.8,
                       "ignore_eos": True, **body}).encode()
    with socket.create_connection((host, int(port)), timeout=30) as sock:
        sock.sendall(f"POST {path} HTTP/1.1\r\nHost: {host}\r\nx-api-key: {KEY}\r\n"
                     f"Authorization: Bearer {KEY}\r\nContent-Type: application/json\r\n"
                     f"Content-Length: {len(data)}\r\n\r\n".encode() + data)
        got = b""
        while b"data:" not in got:
            chunk = sock.recv(4096)
            assert chunk, got
            got += chunk
    deadline = time.monotonic() + 60
    while True:
        h = health(server)
        if h["requests_in_flight"] == 0 and h["blocks_used"] <= baseline:
            break
        assert time.monotonic() < deadline, h
        time.sleep(0.05)
    assert metric(server, "kvsession_generated_tokens_total") - generated < 900


def test_agent_hints_in_the_responses_and_messages_apis(server):
    """The same hints in the other two APIs: a body's kvsession object (Responses) and a
    header (Messages) suspend the session after a forced tool call; a bad one is a 400
    in that API's shape."""
    import re
    import urllib.request

    def waits() -> float:
        with urllib.request.urlopen(f"{server.url}/metrics", timeout=10) as r:
            text = r.read().decode()
        return sum(float(v) for v in re.findall(
            r"^kvsession_server_tool_waits_total\{[^}]*\} (\S+)$", text, re.M))

    tool = {"name": "read_file", "input_schema": {"type": "object", "properties": {
        "path": {"type": "string", "maxLength": 8}}, "required": ["path"]}}
    before = waits()
    oc = openai.OpenAI(base_url=f"{server.url}/v1", api_key=KEY, max_retries=0)
    oc.responses.create(model=server.model, input="read it", max_output_tokens=80,
                        tools=[{"type": "function", "name": "read_file",
                                "parameters": tool["input_schema"]}],
                        tool_choice="required", extra_body={"kvsession": {
                            "expected_tool_latency_s": 30}})
    ac = anthropic.Anthropic(base_url=server.url, api_key=KEY, max_retries=0)
    ac.messages.create(model=server.model, max_tokens=80, tools=[tool],
                       tool_choice={"type": "any"},
                       messages=[{"role": "user", "content": "read it"}],
                       extra_headers={"X-KVSession-Expected-Tool-Latency-S": "30"})
    deadline = time.monotonic() + 30
    while waits() < before + 2:
        assert time.monotonic() < deadline, "the sessions were not suspended"
        time.sleep(0.05)
    with pytest.raises(openai.BadRequestError) as e:
        oc.responses.create(model=server.model, input="x", max_output_tokens=2,
                            extra_body={"kvsession": {"priority": "high"}})
    assert e.value.body["param"] == "kvsession.priority"
    with pytest.raises(anthropic.BadRequestError) as e:
        ac.messages.create(model=server.model, max_tokens=2,
                           messages=[{"role": "user", "content": "x"}],
                           extra_body={"kvsession": {"session_ttl_s": -1}})
    assert "kvsession.session_ttl_s" in e.value.body["error"]["message"]
