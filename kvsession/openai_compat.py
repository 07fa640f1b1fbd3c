"""OpenAI-shaped clients over an `LLM` in this process, and the httpx transports under them,
for agent frameworks that take an OpenAI (or Anthropic) client: no port, no second
process. Needs the `inprocess` extra (the server's app and httpx).

    from kvsession import LLM
    from kvsession.openai_compat import Client, transport

    llm = LLM("Qwen/Qwen3-0.6B")
    client = Client(llm)                      # openai.OpenAI's surface, in process
    reply = client.chat.completions.create(model="any", messages=[...], tools=[...])

    import httpx, openai, anthropic           # or any SDK over httpx
    openai.OpenAI(base_url="http://kvsession/v1", api_key="-",
                  http_client=httpx.Client(transport=transport(llm)))
    anthropic.Anthropic(base_url="http://kvsession", api_key="-",
                        http_client=httpx.Client(transport=transport(llm)))

Every request is the server's (serve/inprocess.py hands it to the same Starlette app that
`python -m kvsession serve` runs): a conversation sent again with its next message
continues on its Session's KV, errors are the protocols' error objects, and streams arrive
chunk by chunk as they are generated. One transport (one client) keeps one table of
conversations: pass the same one where sessions should be shared.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Iterator
from typing import Any

import httpx

from kvsession import LLM, KVSessionError
from kvsession.serve.inprocess import BASE_URL, AsyncTransport, InProcessServer, Transport

__all__ = ["APIError", "AsyncClient", "Client", "transport"]


def transport(llm: LLM, asynchronous: bool = False, model_name: str | None = None,
              http=None, **server_kwargs) -> Transport | AsyncTransport:
    """An httpx transport into the server's routes over `llm`, in this process (a
    conversation table of its own: serve/inprocess.py). `asynchronous`: for
    `httpx.AsyncClient` (the app runs in the caller's event loop), else for `httpx.Client`
    (on a loop thread of its own). `model_name`: the name requests must give; None: any.
    `http`: the httpx package of the client that takes the transport: httpx by default,
    `httpx2` for the `anthropic` SDK 2.x (which refuses httpx clients). `server_kwargs`:
    InProcessServer's (max_concurrent, max_conversations, default_max_tokens,
    session_dir)."""
    server = InProcessServer(llm, model_name, **server_kwargs)
    http = httpx if http is None else http
    return server.async_transport(http) if asynchronous else server.transport(http)


class APIError(KVSessionError):
    """An error answer (the dict clients' form of openai's APIStatusError): `status_code`,
    and `body`, the OpenAI error object the server answered ({"error": {...}})."""

    def __init__(self, status_code: int, body: Any):
        self.status_code, self.body = status_code, body
        error = body.get("error") if isinstance(body, dict) else None
        message = error.get("message") if isinstance(error, dict) else body
        super().__init__(f"{status_code}: {message}")


class Client:
    """openai.OpenAI's `chat.completions.create(**body)` and `responses.create(**body)`
    (`models.list()` too) over `llm` in this process. Returns openai's types when the
    `openai` package is installed (this is then an openai.OpenAI client over the in-process
    transport, whose errors are openai's), else plain dicts (and for `stream=True` an
    iterator of chunk dicts; errors raise APIError); `return_dicts=True` asks for dicts
    either way. `close()` (or `with`) closes the conversations' sessions, not the LLM."""

    def __init__(self, llm: LLM, model_name: str | None = None, *,
                 return_dicts: bool = False, **server_kwargs):
        self.server = InProcessServer(llm, model_name, **server_kwargs)
        self.http = httpx.Client(transport=self.server.transport(), base_url=BASE_URL,
                                 timeout=None)
        _surface(self, None if return_dicts else _openai_class("OpenAI"), _Create, _Models)

    def close(self) -> None:
        self.http.close()
        self.server.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class AsyncClient:
    """Client's asynchronous twin (openai.AsyncOpenAI's surface): `await
    client.chat.completions.create(...)`; a stream is an async iterator. The app runs in
    the caller's event loop. `await aclose()` (or `async with`)."""

    def __init__(self, llm: LLM, model_name: str | None = None, *,
                 return_dicts: bool = False, **server_kwargs):
        self.server = InProcessServer(llm, model_name, **server_kwargs)
        self.http = httpx.AsyncClient(transport=self.server.async_transport(),
                                      base_url=BASE_URL, timeout=None)
        _surface(self, None if return_dicts else _openai_class("AsyncOpenAI"), _AsyncCreate,
                 _AsyncModels)

    async def aclose(self) -> None:
        await self.http.aclose()
        self.server.close()

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc) -> None:
        await self.aclose()


def _openai_class(name: str):
    """The openai package's client class `name`; None where openai is not installed."""
    try:
        import openai
    except ImportError:
        return None
    return getattr(openai, name)


def _surface(client: Client | AsyncClient, sdk_class, create: type, models: type) -> None:
    """`client`'s chat, responses and models (its `http` set): those of `sdk_class` (an
    openai client over `http`, its types and errors) when given, else the dict versions
    (`create` and `models`: the sync or async ones)."""
    if sdk_class is not None:
        client.openai = sdk_class(api_key="kvsession", base_url=BASE_URL + "/v1",
                                  http_client=client.http, max_retries=0)
        client.chat, client.responses, client.models = \
            client.openai.chat, client.openai.responses, client.openai.models
    else:
        client.openai = None
        client.chat = _Chat(create(client.http, "/v1/chat/completions"))
        client.responses = create(client.http, "/v1/responses")
        client.models = models(client.http)


class _Chat:
    def __init__(self, completions):
        self.completions = completions


class _Create:
    """POST `path` with the body's fields: the answer as a dict, or for `stream=True` an
    iterator of the events' dicts."""

    def __init__(self, http: httpx.Client, path: str):
        self.http, self.path = http, path

    def create(self, **body) -> dict | Iterator[dict]:
        if not body.get("stream"):
            response = self.http.post(self.path, json=body)
            return _json_or_raise(response.status_code, response.read())
        return self._events(body)

    def _events(self, body: dict) -> Iterator[dict]:
        with self.http.stream("POST", self.path, json=body) as response:
            if response.status_code >= 400:
                _json_or_raise(response.status_code, response.read())
            for line in response.iter_lines():
                event = _event(line)
                if event is _DONE:
                    return
                if event is not None:
                    yield event


class _AsyncCreate:
    """_Create's asynchronous twin."""

    def __init__(self, http: httpx.AsyncClient, path: str):
        self.http, self.path = http, path

    async def create(self, **body) -> dict | AsyncIterator[dict]:
        if not body.get("stream"):
            response = await self.http.post(self.path, json=body)
            return _json_or_raise(response.status_code, await response.aread())
        request = self.http.build_request("POST", self.path, json=body)
        response = await self.http.send(request, stream=True)
        if response.status_code >= 400:  # raised here, as openai raises at create
            try:
                _json_or_raise(response.status_code, await response.aread())
            finally:
                await response.aclose()
        return self._events(response)

    @staticmethod
    async def _events(response: httpx.Response) -> AsyncIterator[dict]:
        try:
            async for line in response.aiter_lines():
                event = _event(line)
                if event is _DONE:
                    return
                if event is not None:
                    yield event
        finally:
            await response.aclose()


class _Models:
    def __init__(self, http: httpx.Client):
        self.http = http

    def list(self) -> dict:
        response = self.http.get("/v1/models")
        return _json_or_raise(response.status_code, response.read())


class _AsyncModels:
    def __init__(self, http: httpx.AsyncClient):
        self.http = http

    async def list(self) -> dict:
        response = await self.http.get("/v1/models")
        return _json_or_raise(response.status_code, await response.aread())


_DONE = object()


def _event(line: str):
    """A server-sent event line's data as a dict; _DONE for `[DONE]`; None for other lines
    (blank separators, `event:` names: the data carries its own type)."""
    if not line.startswith("data:"):
        return None
    data = line[5:].strip()
    if data == "[DONE]":
        return _DONE
    event = json.loads(data)
    if isinstance(event, dict) and "error" in event and len(event) == 1:
        raise APIError(500, event)  # an error mid-stream is the stream's last event
    return event


def _json_or_raise(status: int, content: bytes) -> dict:
    try:
        body = json.loads(content) if content else {}
    except json.JSONDecodeError:
        body = content.decode(errors="replace")
    if status >= 400:
        raise APIError(status, body)
    return body
