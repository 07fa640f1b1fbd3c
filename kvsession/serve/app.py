"""The Starlette application: OpenAI-compatible routes over one `LLM`.

Admission: at most `max_concurrent` generation requests are in flight (queued in the engine
or running); one more is answered 503 with Retry-After at once, so a flood never grows an
unbounded queue. Every failure of one request is answered as OpenAI error JSON for that
request alone (the engine fails bad requests alone too). A client that goes away cancels
its request: a stateless one at once, a session turn at its next token, the session left
as it was before the turn (see kvsession/serve/runs.py). docs/server.md describes the
design.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import time
from collections import Counter, OrderedDict
from collections.abc import AsyncIterator

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from kvsession import LLM, KVSessionError
from kvsession.serve import agent_hints as H
from kvsession.serve import anthropic_messages as A
from kvsession.serve import openai_responses as R
from kvsession.serve import protocol as P
from kvsession.serve.auth import check_key
from kvsession.serve.conversations import (
    SEND_TAKES,
    SESSION_TAKES,
    Conversations,
    Plan,
    conversation_salt,
    turn_prompt_tokens,
)
from kvsession.serve.prometheus import CONTENT_TYPE, Exposition, MetricKind
from kvsession.serve.responses import ClientGone, SSEResponse, sse, unless_disconnected
from kvsession.serve.runs import SessionTurn, Slot, collect, stateless_events, turn_overrides

log = logging.getLogger("kvsession.serve")

MAX_BODY_BYTES = 32 << 20
CHAT_TAKES = set(inspect.signature(LLM.chat).parameters)
TOOL_ARGS = ("tools", "tool_choice", "chat_template_kwargs", "parallel_tool_calls")


# on a response that repeats a named session's stored reply (a retried request)
REPLAYED = {"X-KVSession-Replayed": "true"}
# on a response whose token limit (max_tokens, max_completion_tokens, --default-max-tokens)
# did not fit in the context after the prompt: the limit it ran under, the room left
MAX_TOKENS_HEADER = "x-kvsession-max-tokens"


class Server:
    """Routes, admission and counters of one served model."""

    def __init__(self, llm: LLM, model_name: str, api_key: str | None = None,
                 max_concurrent: int = 256, max_conversations: int = 256,
                 default_max_tokens: int | None = None, aliases: tuple[str, ...] = (),
                 session_dir: str | None = None, any_model_name: bool = False):
        """`any_model_name`: requests may name any model (in process, serve/inprocess.py:
        one LLM is there); else `model_name` or one of `aliases`."""
        self.llm, self.model_name, self.api_key = llm, model_name, api_key
        self.names = {model_name, *aliases}
        self.any_model_name = any_model_name
        self.max_concurrent = max_concurrent
        self.max_model_len = llm.runtime.max_model_len
        self.default_max_tokens = default_max_tokens or self.max_model_len
        self.configured_max_tokens = default_max_tokens  # None: up to the context's end
        self.conversations = Conversations(llm, max_conversations)
        self.in_flight = 0
        self.accepting = True
        self.started = time.time()
        self.requests: Counter = Counter()  # (route, status) -> count
        self.tokens: Counter = Counter()  # prompt / cached / completion
        self.decode = llm.tokenizer.decode
        # the Responses API's stored responses: kept beside the sessions (LLM.put_file: in
        # session_dir, and in its store where that is a URL, so any replica finds them)
        self.stored = R.ResponseStore(llm if session_dir is not None else None)
        # agent hints: what the server learns of conversations' tool waits, and the
        # engine's decisions on the sessions it suspended for them
        self.gaps = H.ToolGaps()
        self.tool_waits: Counter = Counter()
        # system prompts pinned by Anthropic cache_control breakpoints: (text, ttl) -> pin
        self.pins: OrderedDict[tuple[str, float], object] = OrderedDict()

    # ---- app -------------------------------------------------------------------------

    def app(self) -> Starlette:
        routes = [
            Route("/v1/chat/completions", self.chat, methods=["POST"]),
            Route("/v1/completions", self.completions, methods=["POST"]),
            Route("/v1/responses", self.responses, methods=["POST"]),
            Route("/v1/messages", self.messages, methods=["POST"]),
            Route("/v1/responses/{rid}", self.response, methods=["GET", "DELETE"]),
            Route("/v1/models", self.models, methods=["GET"]),
            Route("/v1/models/{model:path}", self.model, methods=["GET"]),
            Route("/health", self.health, methods=["GET"]),
            Route("/metrics", self.metrics, methods=["GET"]),
        ]
        return Starlette(routes=routes, exception_handlers={
            HTTPException: self._http_error, P.APIError: self._api_error,
            ClientGone: self._gone, Exception: self._internal_error})

    async def _gone(self, request: Request, e: ClientGone) -> Response:
        self.requests[(request.url.path, 499)] += 1  # nginx's "client closed request"
        return Response(status_code=499)

    async def _api_error(self, request: Request, e: P.APIError) -> Response:
        self.requests[(request.url.path, e.status)] += 1
        body = A.error_body(e) if request.url.path == "/v1/messages" else e.body()
        return JSONResponse(body, status_code=e.status, headers=e.headers)

    async def _http_error(self, request: Request, e: HTTPException) -> Response:
        return await self._api_error(request, P.from_routing_error(
            e.status_code, e.detail, request.method, request.url.path))

    async def _internal_error(self, request: Request, e: Exception) -> Response:
        # Starlette re-raises the exception after this answer: uvicorn logs its traceback
        return await self._api_error(request, P.from_engine_error(e))

    # ---- admission -------------------------------------------------------------------

    def _check_key(self, request: Request) -> None:
        check_key(request, self.api_key)

    def _check_model(self, model: str) -> None:
        if model not in self.names and not (self.any_model_name and isinstance(model, str)):
            raise P.APIError(404, f"the model {model!r} does not exist; this server serves "
                                  f"{self.model_name!r}", param="model", code="model_not_found")

    async def _body(self, request: Request, kind: type):
        self._check_key(request)
        # before the body is read: one declared as something else is refused unread
        P.check_content_type(request.headers.get("content-type"))
        too_large = P.APIError(413, f"the request body is over {MAX_BODY_BYTES} bytes",
                               code="body_too_large", headers={"Connection": "close"})
        size = request.headers.get("content-length")
        if size is not None and size.isdigit() and int(size) > MAX_BODY_BYTES:
            raise too_large
        # counted as it arrives: a chunked body has no length up front
        body = bytearray()
        async for part in request.stream():
            body += part
            if len(body) > MAX_BODY_BYTES:
                raise too_large
        req = P.decode_body(bytes(body), kind)
        self._check_model(req.model)
        return req

    def _admit(self) -> Slot:
        if not self.accepting:
            raise P.APIError(503, "the server is shutting down", type="server_error",
                             code="shutting_down", headers={"Retry-After": "1"})
        if self.in_flight >= self.max_concurrent:
            raise P.APIError(503, f"the server is at its bound of {self.max_concurrent} "
                                  f"requests in flight; retry shortly", type="server_error",
                             code="overloaded", headers={"Retry-After": "1"})
        self.in_flight += 1

        def release():
            self.in_flight -= 1
        return Slot(release)

    def _count(self, res: P.Result) -> None:
        u = res.usage()
        self.tokens["prompt"] += u["prompt_tokens"]
        self.tokens["cached"] += u["prompt_tokens_details"]["cached_tokens"]
        self.tokens["completion"] += u["completion_tokens"]

    # ---- /v1/chat/completions ----------------------------------------------------------

    def _chat_params(self, req: P.ChatRequest):
        if not isinstance(req.messages, list) or not req.messages:
            raise P.APIError(400, "messages must be a non-empty list of message objects",
                             param="messages")
        P.check_chat_messages(req.messages)
        P.check_template_kwarg_names(req.chat_template_kwargs)
        P.check_max_tokens(req, self.max_model_len)
        if req.top_logprobs is not None and not req.logprobs:  # as OpenAI answers it
            raise P.APIError(400, "top_logprobs needs logprobs: true", param="top_logprobs")
        top = req.top_logprobs if req.top_logprobs is not None else 0
        # OpenAI's defaults where neither the request nor the checkpoint sets a field (a
        # session turn's greedy fallback is the in-process API's, not this protocol's)
        params = self.llm.get_default_sampling_params(P.sampling_params(
            req, self.default_max_tokens, top if req.logprobs else None, req.response_format,
            req.max_completion_tokens if req.max_completion_tokens is not None
            else req.max_tokens))
        tool_kwargs = {k: getattr(req, k) for k in TOOL_ARGS if getattr(req, k) is not None}
        if tool_kwargs.get("parallel_tool_calls") is True or not req.tools:
            tool_kwargs.pop("parallel_tool_calls", None)  # the default, or nothing to limit
        if tool_kwargs and not set(tool_kwargs) <= CHAT_TAKES:
            raise P.APIError(400, f"this kvsession version does not take "
                                  f"{sorted(set(tool_kwargs) - CHAT_TAKES)}",
                             param=sorted(set(tool_kwargs) - CHAT_TAKES)[0])
        return params, tool_kwargs

    def _session_kwargs(self, params, tool_kwargs) -> tuple[dict, dict, bool]:
        """(llm.session kwargs, per-turn kwargs, whether a Session can run the request):
        tools and template kwargs belong to the session (they are rendered once, into its
        system turn); a forced tool_choice is per turn."""
        per_session, per_turn = {"sampling": params}, {}
        if params.cache_salt is not None and "cache_salt" in SESSION_TAKES:
            per_session["cache_salt"] = params.cache_salt  # the tenant's own blocks
        ok = params.n == 1
        for k, v in tool_kwargs.items():
            if k == "tool_choice":
                if v == "auto":
                    continue  # the default
                if k in SEND_TAKES:
                    per_turn[k] = v
                else:
                    ok = False  # the Session API cannot force a call: stateless
            elif k in SESSION_TAKES:
                per_session[k] = v
                if k == "tools" and k in SEND_TAKES:
                    # every turn too: Session.send checks them against the session's (a
                    # named session continued with other tools is a 400 naming why, not
                    # a turn whose tools are silently neither rendered nor parsed)
                    per_turn[k] = v
            else:
                ok = False
        return per_session, per_turn, ok

    async def chat(self, request: Request) -> Response:
        # set here too, not left to the default: a request may start in the context of the
        # one before it on its connection (uvicorn starts a keep-alive connection's next
        # request from the previous one's task when it had paused reading a large body),
        # where a text completion set "prompt"
        P.PROMPT_FIELD.set("messages")
        req: P.ChatRequest = await self._body(request, P.ChatRequest)
        hints = H.read_hints(req.kvsession, request.headers)
        params, tool_kwargs = self._chat_params(req)
        limit = self._limit(req.max_completion_tokens if req.max_completion_tokens is not None
                            else req.max_tokens)
        session_id = req.session_id or request.headers.get("x-session-id")
        salt = conversation_salt(req.tools, req.chat_template_kwargs, req.cache_salt)
        per_session, per_turn, can_session = self._session_kwargs(params, tool_kwargs)
        if session_id is not None and not can_session:
            raise P.APIError(400, "a named session takes one completion (n=1) and the "
                                  "tool arguments its Session API accepts (not "
                                  "parallel_tool_calls: false)",
                             param="parallel_tool_calls" if "parallel_tool_calls" in
                             tool_kwargs and req.n == 1 else "n")
        slot = self._admit()
        plan: Plan | None = None
        try:
            # a named session's turn may wait behind earlier ones: its client may leave
            plan = await self._until_disconnect(request, self.conversations.plan(
                req.messages, salt, session_id, per_session, can_session), fields=())
            self._arrived(plan, hints)
            rid = P.new_id("chatcmpl")
            log.info("%s: %s, %d new messages", rid, "stateless" if plan.session is None else
                     "session (continued)" if plan.reused or plan.named_len else "session (new)",
                     len(plan.new))
            if plan.replay is not None:  # a retried turn: its stored reply, nothing runs
                log.info("%s: the last turn of session %s answered this request already: "
                         "its reply is sent again", rid, session_id)
                res = self._stored_reply(plan)
                if req.stream:  # as one event
                    return await self._chat_stream(request, req, rid, plan, _events_of(res),
                                                   slot, buffered=True, replayed=True)
            elif req.stream:
                # (counted before the turn starts: the turn changes the session)
                prompt = None if limit is None else await self._chat_prompt_tokens(req, plan)
                events = self._chat_events(plan, params, tool_kwargs, per_turn)
                # (a named session parses with its own tools, the request may send none)
                tools = req.tools or plan.session is not None and plan.session.renderer.tools
                return await self._chat_stream(request, req, rid, plan, events, slot,
                                               False, limit=limit, prompt_tokens=prompt,
                                               calls=bool(tools) and req.tool_choice != "none")
            else:
                res = await self._run_turn(request, plan, params, tool_kwargs, per_turn)
        except BaseException:
            if plan is not None:
                self.conversations.abandon(plan)
            slot.release()
            raise
        self._answered(request, plan, res, slot)
        lp = P.Logprobs(self.decode, params.logprobs) if req.logprobs else None
        return JSONResponse(P.chat_response(rid, self.model_name, res, lp),
                            headers=REPLAYED if plan.replay is not None
                            else self._cut(limit, res.prompt_tokens))

    # ---- the token limit -----------------------------------------------------------------

    def _limit(self, requested: int | None) -> int | None:
        """The token limit a request runs under when one was set (by the request, or
        --default-max-tokens); None: up to the end of the context, nothing is cut."""
        return requested if requested is not None else self.configured_max_tokens

    def _cut(self, limit: int | None, prompt_tokens: int | None) -> dict[str, str]:
        """{x-kvsession-max-tokens: the room the context leaves after the prompt} when it
        is less than the limit (the engine stops there, "length"): a limit that fits the
        context but not after this prompt is cut, and the answer says so. (A limit above
        the whole context is a 400: P.check_max_tokens.)"""
        if limit is None or prompt_tokens is None:
            return {}
        room = self.max_model_len - prompt_tokens
        return {MAX_TOKENS_HEADER: str(room)} if limit > room else {}

    async def _chat_prompt_tokens(self, req: P.ChatRequest, plan: Plan) -> int | None:
        """A streamed chat's prompt length, for its headers, which go out before its usage
        is known (None: told by its first event, or not at all). Rendered off the event
        loop, as the turn will render it."""
        if plan.session is not None:
            return await asyncio.to_thread(turn_prompt_tokens, plan.session, plan.new)
        if req.n > 1:
            return None  # a batch: its first event is its result, usage included
        tokenizer = self.llm.tokenizer  # the conversation as llm.astream renders it
        return await asyncio.to_thread(_best_effort, lambda: len(tokenizer.encode_chat(
            plan.new, True, req.tools or None, req.chat_template_kwargs)))

    def _stored_reply(self, plan: Plan) -> P.Result:
        text = plan.replay.get("content") or ""
        ids = self.llm.tokenizer.encode(text, add_special_tokens=False) if text else []
        prompt = max(len(plan.session.token_ids) - len(ids), 0)
        return P.Result.of_stored(plan.replay, ids, prompt)

    def _chat_events(self, plan: Plan, params, tool_kwargs: dict, per_turn: dict):
        if plan.session is not None:
            return SessionTurn(plan.session, plan.new, turn_overrides(params, per_turn))
        return stateless_events(self.llm, params, messages=plan.new, tool_kwargs=tool_kwargs,
                                priority=_priority(plan))

    @staticmethod
    async def _reply(plan: Plan, overrides: dict) -> P.Result:
        return P.Result.of_reply(await plan.session.asend(plan.new, **overrides),
                                 plan.session)

    def _arrived(self, plan: Plan, hints: H.AgentHints) -> None:
        """A request planned: its hints go with the plan, and a conversation's gap since
        a reply that called a tool is learned (agent_hints.ToolGaps)."""
        plan.hints = hints
        if plan.session is not None:
            self.gaps.request_arrived(plan.session.session_id, time.monotonic())
            if hints.priority is not None:  # kept with the conversation, for its turns
                plan.session.priority = hints.priority

    def _finished(self, plan: Plan, reply: dict) -> None:
        """A turn answered `reply`: its session filed for the conversation's next request;
        then what the agent hints ask (agent_hints.py): the session closed after
        `session_ttl_s` idle, and after a reply that calls a tool, suspended for the
        expected tool latency (the hint's, or the one learned for this conversation)."""
        self.conversations.finish(plan, reply)
        sess, hints = plan.session, plan.hints or H.AgentHints()
        if sess is None or plan.replay is not None:
            return
        if hints.session_ttl_s is not None:
            self.conversations.expire_after(sess, hints.session_ttl_s)
        if not reply.get("tool_calls"):
            return
        self.gaps.replied_with_calls(sess.session_id, time.monotonic())
        wait_s = hints.expected_tool_latency_s
        if wait_s is None:
            wait_s = self.gaps.estimate(sess.session_id)
        if wait_s is not None:
            asyncio.get_running_loop().run_in_executor(None, self._suspend, sess, wait_s)

    def _suspend(self, sess, wait_s: float) -> None:
        """(a worker thread) Suspend a session that waits on a tool; counted by the
        engine's decision."""
        try:
            decision = sess.suspend(expected_idle_s=wait_s)
        except KVSessionError as e:  # closed or taken meanwhile: nothing waits any more
            log.debug("tool wait of session %s not suspended: %s", sess.session_id, e)
            return
        self.tool_waits[decision] += 1

    def _answered(self, request: Request, plan: Plan, res: P.Result, slot: Slot) -> dict:
        """A request answered whole: its session filed under the conversation the client
        will send back, its slot released, counted. The reply's assistant message."""
        reply = P.assistant_message(res.choices[0])
        self._finished(plan, reply)
        slot.release()
        self._count(res)
        self.requests[(request.url.path, 200)] += 1
        return reply

    async def _run_turn(self, request: Request, plan: Plan, params, tool_kwargs: dict,
                        per_turn: dict) -> P.Result:
        """A request answered whole: its session's turn (no thread, no per-token hops: one
        await), or a stateless request; cancelled if the client leaves first."""
        if plan.session is not None:
            work = self._reply(plan, turn_overrides(params, per_turn))
        else:
            work = collect(stateless_events(self.llm, params, messages=plan.new,
                                            tool_kwargs=tool_kwargs,
                                            priority=_priority(plan)))
        return await self._until_disconnect(request, work)

    async def _until_disconnect(self, request: Request, work,
                                fields: tuple[str, ...] = P.SAMPLING_FIELDS):
        """Await `work` (an awaitable: a Result, the results of a batch, a stream's first
        event) unless the client disconnects first: then it is cancelled, and so are its
        requests (a session turn too: `Session.asend` cancels its turn, and the session is
        left as it was before the turn; `agenerate` / `achat` end their requests). `fields`:
        the request fields an engine error may name."""
        return await unless_disconnected(request, self._map_errors(work, fields))

    @staticmethod
    async def _map_errors(coro, fields: tuple[str, ...] = P.SAMPLING_FIELDS):
        try:
            return await coro
        except KVSessionError as e:
            raise P.from_engine_error(e, fields) from None

    async def _first(self, request: Request, events):
        """The first event, before any header is sent: an error the engine raises at
        submission (a bad schema, a prompt too long) is still an HTTP status. Watched for
        the client leaving: a batched stream (n > 1) sends nothing until every completion
        is done."""
        return await self._until_disconnect(request, events.__anext__())

    async def _chat_stream(self, request: Request, req: P.ChatRequest, rid: str, plan: Plan,
                           events, slot: Slot, buffered: bool, replayed: bool = False,
                           limit: int | None = None, prompt_tokens: int | None = None,
                           calls: bool = False) -> Response:
        """`calls`: the reply may be tool calls (its content may never come: the first
        delta's content is then None, as a non-streamed answer's without text)."""
        turn = events if isinstance(events, SessionTurn) else None
        source = turn.events() if turn else events
        # choice 0 arrives as deltas (reasoning, content, tool-call pieces, split as the
        # reply is) unless it is a stored reply sent again (`buffered`) or a batch (n > 1)
        live = not buffered and (turn is not None or req.n == 1)
        first = await self._first(request, source)
        created, model = int(time.time()), self.model_name
        usage = req.stream_options is not None and req.stream_options.include_usage
        lp = P.Logprobs(self.decode, req.top_logprobs or 0) if req.logprobs else None

        state = {"done": False}

        async def body() -> AsyncIterator[str]:
            try:
                yield sse(P.chat_chunk(rid, model, created, 0, {  # (None: as non-streamed
                    "role": "assistant", "content": None if buffered or calls else ""}))
                event = first
                while event[0] == "delta":
                    if live and (delta := P.stream_delta(event[1])):
                        yield sse(P.chat_chunk(rid, model, created, 0, delta))
                    event = await source.__anext__()
                res: P.Result = event[1]
                for c in res.choices:
                    if c.index > 0:
                        yield sse(P.chat_chunk(rid, model, created, c.index,
                                               {"role": "assistant", "content": ""}))
                    delta = {}
                    if c.index or not live:  # the whole choice in its one delta
                        if c.reasoning:
                            delta["reasoning_content"] = c.reasoning
                        if c.text:
                            delta["content"] = c.text
                        if c.tool_calls:
                            delta["tool_calls"] = [P.tool_call_json(t, i)
                                                   for i, t in enumerate(c.tool_calls)]
                    yield sse(P.chat_chunk(rid, model, created, c.index, delta,
                                           P.finish_reason(c),
                                           lp.chat(c.token_ids, c.logprobs) if lp else None))
                if usage:
                    yield sse(P.usage_chunk(rid, model, created, "chat.completion.chunk", res))
                yield "data: [DONE]\n\n"
                state["done"] = True
                self._finished(plan, P.assistant_message(res.choices[0]))
                self._count(res)
                self.requests[("/v1/chat/completions", 200)] += 1
            except KVSessionError as e:  # mid-stream: the error is the last event
                yield sse(P.from_engine_error(e).body())
                yield "data: [DONE]\n\n"

        if first[0] == "done":  # a batch (n > 1), or a turn over at once: its usage is known
            prompt_tokens = first[1].prompt_tokens
        return SSEResponse(body(), self._closer(state, turn, source, plan, slot),
                           REPLAYED if replayed else self._cut(limit, prompt_tokens))

    def _closer(self, state: dict, turn: SessionTurn | None, source, plan: Plan, slot: Slot):
        """What a streamed response runs when it ends (`state["done"]`: it was answered
        whole): an unfinished turn is cancelled (a session's ends at its next token, the
        session as before it; a stateless request at once) and its plan abandoned."""
        async def on_close() -> None:
            if state["done"]:
                slot.release()
            elif turn is not None and not turn.settled.done():
                turn.cancel()  # ends at its next token, its session as before the turn
                turn.settled.add_done_callback(
                    lambda _: (self.conversations.abandon(plan), slot.release()))
            else:
                await source.aclose()  # a stateless request is cancelled here
                self.conversations.abandon(plan)
                slot.release()
        return on_close

    # ---- /v1/responses ---------------------------------------------------------------

    async def _responses_plan(self, req: R.ResponsesRequest, request: Request) -> tuple:
        """(the chat messages to send, the named session they go to or None, the whole
        conversation with them, the response's id) of a Responses request
        (openai_responses' docstring: chains, branches). A new chain's digits are the
        ingress's when it sent them (R.CHAIN_HEADER: it routed the chain already)."""
        new = R.input_messages(req.input)
        system = [{"role": "system", "content": req.instructions}] if req.instructions else []
        given = request.headers.get(R.CHAIN_HEADER)
        rid = R.new_response_id(given if given and R.chain_session(given) else None)
        if req.previous_response_id is None:
            full = system + new
            return full, R.chain_session(rid) if req.store else None, full, rid
        prev = await asyncio.to_thread(self.stored.get, req.previous_response_id)
        if prev is None:
            raise P.APIError(404, f"previous response {req.previous_response_id!r} not "
                                  f"found", param="previous_response_id",
                             code="previous_response_not_found")
        history = prev.messages
        same = req.instructions is None or req.instructions == prev.instructions
        if not same:  # new instructions: the conversation with them in the system's place
            history = system + [m for m in history if m.get("role") != "system"]
        full = history + new
        chain = prev.chain
        if same and chain is not None and await asyncio.to_thread(
                self.stored.is_latest, req.previous_response_id, prev) \
                and (chain in self.conversations.named_ids()
                     or chain in await asyncio.to_thread(self.llm.sessions)):
            # the chain's next turn: only what is new, its id in the chain
            return new, chain, full, R.new_response_id(req.previous_response_id[5:21])
        # a branch: a chain of its own
        return full, R.chain_session(rid) if req.store else None, full, rid

    async def responses(self, request: Request) -> Response:
        P.PROMPT_FIELD.set("input")
        req: R.ResponsesRequest = await self._body(request, R.ResponsesRequest)
        hints = H.read_hints(req.kvsession, request.headers)
        created = R.now()
        messages, chain, full, rid = await self._responses_plan(req, request)
        chat = R.to_chat(req, messages)
        params, tool_kwargs = self._chat_params(chat)
        salt = conversation_salt(chat.tools, None, None)
        per_session, per_turn, can_session = self._session_kwargs(params, tool_kwargs)
        if chain is not None and not can_session:  # (parallel_tool_calls: false) stateless
            chain, messages = None, full
        slot = self._admit()
        plan: Plan | None = None
        try:
            plan = await self._until_disconnect(request, self.conversations.plan(
                messages, salt, chain, per_session, can_session), fields=())
            self._arrived(plan, hints)
            if plan.replay is not None:  # the chain's last turn answered this already
                res = self._stored_reply(plan)
            elif req.stream:
                events = self._chat_events(plan, params, tool_kwargs, per_turn)
                encoder = R.ResponseEvents(rid, req, self.model_name, created)
                return await self._encoded_stream(
                    request, "/v1/responses", plan, events, slot, encoder,
                    lambda res, reply: asyncio.to_thread(
                        self._store_response, req, rid, encoder.response, chain,
                        full + [reply]))
            else:
                res = await self._run_turn(request, plan, params, tool_kwargs, per_turn)
        except BaseException:
            if plan is not None:
                self.conversations.abandon(plan)
            slot.release()
            raise
        reply = self._answered(request, plan, res, slot)
        response = R.response_object(rid, req, self.model_name, created, res)
        await asyncio.to_thread(self._store_response, req, rid, response, chain,
                                full + [reply])
        return JSONResponse(response)

    def _store_response(self, req: R.ResponsesRequest, rid: str, response: dict,
                        chain: str | None, conversation: list[dict]) -> None:
        """A worker thread (the files may be in an object store): stored before the
        response is answered, so the client's next request finds it on any replica."""
        if req.store:
            instructions = req.instructions
            if req.previous_response_id is not None and instructions is None:
                prev = self.stored.get(req.previous_response_id)
                instructions = prev.instructions if prev is not None else None
            self.stored.put(rid, R.Stored(response, chain, conversation, instructions))

    async def _encoded_stream(self, request: Request, route: str, plan: Plan, events,
                              slot: Slot, encoder, finished=None) -> Response:
        """A turn streamed in another API's events: `encoder` (openai_responses'
        ResponseEvents, anthropic_messages' MessageEvents) turns the turn's pieces into
        them (`start()`, `delta(chunk)`, `finish(result)`, `error(api_error)`: lists of
        SSE events, error one); `finished(result, reply message)` is awaited once it is
        done (before the stream ends)."""
        turn = events if isinstance(events, SessionTurn) else None
        source = turn.events() if turn else events
        first = await self._first(request, source)
        state = {"done": False}

        async def body() -> AsyncIterator[str]:
            try:
                for e in encoder.start():
                    yield e
                event = first
                while event[0] == "delta":
                    for e in encoder.delta(event[1]):
                        yield e
                    event = await source.__anext__()
                res: P.Result = event[1]
                for e in encoder.finish(res):
                    yield e
                state["done"] = True
                reply = P.assistant_message(res.choices[0])
                self._finished(plan, reply)
                if finished is not None:
                    await finished(res, reply)
                self._count(res)
                self.requests[(route, 200)] += 1
            except KVSessionError as e:  # mid-stream: the error is the last event
                yield encoder.error(P.from_engine_error(e))

        return SSEResponse(body(), self._closer(state, turn, source, plan, slot))

    async def response(self, request: Request) -> Response:
        """GET or DELETE a stored response."""
        self._check_key(request)
        rid = request.path_params["rid"]
        if request.method == "DELETE":
            stored = await asyncio.to_thread(self.stored.delete, rid)
            body = {"id": rid, "object": "response", "deleted": True}
        else:
            stored = await asyncio.to_thread(self.stored.get, rid)
            body = None if stored is None else stored.response
        if stored is None:
            raise P.APIError(404, f"no stored response {rid!r}", param="response_id",
                             code="not_found")
        return JSONResponse(body)

    # ---- /v1/messages (Anthropic) ----------------------------------------------------

    MAX_PINS = 64  # system prompts pinned by cache_control at once (the oldest unpinned)

    async def _pin_system(self, system: str | None, ttl_s: float | None) -> int:
        """Pin `system` for `ttl_s` (a cache_control breakpoint): the tokens this request
        pinned anew (0 when it was pinned already, or there is nothing to pin)."""
        if system is None or ttl_s is None:
            return 0
        key = (system, ttl_s)
        held = self.pins.get(key)
        if held is not None and held.active:
            self.pins.move_to_end(key)
            return 0
        try:
            pin = await asyncio.to_thread(self.llm.pin, system=system, ttl_s=ttl_s)
        except KVSessionError as e:  # the pinned share is full: served, not pinned
            log.warning("cache_control: the system prompt was not pinned (%s)", e)
            return 0
        self.pins[key] = pin
        while len(self.pins) > self.MAX_PINS:
            _, old = self.pins.popitem(last=False)
            await asyncio.to_thread(old.unpin)
        return pin.num_tokens

    async def messages(self, request: Request) -> Response:
        P.PROMPT_FIELD.set("messages")
        req: A.MessagesRequest = await self._body(request, A.MessagesRequest)
        hints = H.read_hints(req.kvsession, request.headers)
        chat = A.to_chat(req)
        params, tool_kwargs = self._chat_params(chat)
        created = await self._pin_system(A.system_text(req.system), A.system_ttl_s(req))
        salt = conversation_salt(chat.tools, None, None)
        per_session, per_turn, can_session = self._session_kwargs(params, tool_kwargs)
        mid = A.new_id("msg")
        slot = self._admit()
        plan: Plan | None = None
        try:
            plan = await self._until_disconnect(request, self.conversations.plan(
                chat.messages, salt, None, per_session, can_session), fields=())
            self._arrived(plan, hints)
            if req.stream:
                events = self._chat_events(plan, params, tool_kwargs, per_turn)
                return await self._encoded_stream(
                    request, "/v1/messages", plan, events, slot,
                    A.MessageEvents(mid, self.model_name, created))
            res = await self._run_turn(request, plan, params, tool_kwargs, per_turn)
        except BaseException:
            if plan is not None:
                self.conversations.abandon(plan)
            slot.release()
            raise
        self._answered(request, plan, res, slot)
        return JSONResponse(A.message_object(mid, self.model_name, res, created))

    # ---- /v1/completions -------------------------------------------------------------

    async def completions(self, request: Request) -> Response:
        P.PROMPT_FIELD.set("prompt")  # this request's task (and those it starts) only
        req: P.CompletionRequest = await self._body(request, P.CompletionRequest)
        if req.suffix:
            raise P.APIError(400, "suffix is not supported", param="suffix")
        if req.best_of not in (None, req.n):
            raise P.APIError(400, "best_of must equal n (or be omitted)", param="best_of")
        prompts = _prompts(req.prompt)
        # no conversation here: of the agent hints only the priority has something to act on
        priority = H.read_hints(req.kvsession, request.headers).priority
        P.check_max_tokens(req, self.max_model_len)
        params = self.llm.get_default_sampling_params(P.sampling_params(
            req, self.default_max_tokens, req.logprobs, None, req.max_tokens))
        limit = self._limit(req.max_tokens)
        slot = self._admit()
        try:
            rid = P.new_id("cmpl")
            if req.stream and len(prompts) == 1 and params.n == 1:
                return await self._completion_stream(request, req, rid, prompts[0], params,
                                                     slot, limit, priority)
            results = await self._map_errors(self._generate_all(request, prompts, params,
                                                                priority))
        finally:
            if not (req.stream and len(prompts) == 1 and params.n == 1):
                slot.release()
        for _, res in results:
            self._count(res)
        lp = P.Logprobs(self.decode, req.logprobs) if req.logprobs is not None else None
        texts = [(self._prompt_text(p) if req.echo else "", r) for p, r in results]
        body = P.completion_response(rid, self.model_name, texts, lp, req.echo)
        self.requests[(request.url.path, 200)] += 1
        # several prompts: the longest leaves the least room
        cut = self._cut(limit, max(r.prompt_tokens for _, r in results))
        if not req.stream:
            return JSONResponse(body, headers=cut)
        usage = req.stream_options is not None and req.stream_options.include_usage
        return SSEResponse(_replay(body, usage), _nothing, cut)

    def _prompt_text(self, prompt) -> str:
        return prompt if isinstance(prompt, str) else self.decode(prompt)

    async def _generate_all(self, request: Request, prompts: list, params,
                            priority: int | None):
        if len(prompts) == 1 and params.n == 1:
            p = prompts[0]
            events = stateless_events(self.llm, params,
                                      prompt=p if isinstance(p, str) else None,
                                      prompt_token_ids=None if isinstance(p, str) else p,
                                      priority=priority)
            return [(p, await self._until_disconnect(request, collect(events)))]
        texts = [p for p in prompts if isinstance(p, str)]
        if texts:
            work = self.llm.agenerate(texts, params, priority=priority)
        else:
            work = self.llm.agenerate(prompt_token_ids=prompts, sampling_params=params,
                                      priority=priority)
        outs = await self._until_disconnect(request, work)
        return [(p, P.Result.of_output(o)) for p, o in zip(prompts, outs, strict=True)]

    async def _completion_stream(self, request: Request, req, rid: str, prompt, params,
                                 slot: Slot, limit: int | None,
                                 priority: int | None) -> Response:
        events = stateless_events(self.llm, params,
                                  prompt=prompt if isinstance(prompt, str) else None,
                                  prompt_token_ids=None if isinstance(prompt, str) else prompt,
                                  priority=priority)
        try:
            # its headers go out before its usage is known: the prompt counted beforehand,
            # as llm.generate counts it
            prompt_tokens = None if limit is None else _best_effort(
                lambda: len(self.llm.tokenizer.encode(prompt) if isinstance(prompt, str)
                            else prompt))
            first = await self._first(request, events)
            if first[0] == "done":
                prompt_tokens = first[1].prompt_tokens
        except BaseException:
            slot.release()
            raise
        created, model = int(time.time()), self.model_name
        usage = req.stream_options is not None and req.stream_options.include_usage
        echo = self._prompt_text(prompt) if req.echo else ""
        # the tokens' logprobs come with the last chunk, as a streamed chat sends them
        lp = P.Logprobs(self.decode, req.logprobs) if req.logprobs is not None else None

        async def body() -> AsyncIterator[str]:
            try:
                if echo:
                    yield sse(P.completion_chunk(rid, model, created, echo))
                event = first
                while event[0] == "delta":
                    if event[1].text:
                        yield sse(P.completion_chunk(rid, model, created, event[1].text))
                    event = await events.__anext__()
                res: P.Result = event[1]
                c = res.choices[0]
                yield sse(P.completion_chunk(rid, model, created, "", c.finish_reason,
                                             lp.completion(c.token_ids, c.logprobs)
                                             if lp else None))
                if usage:
                    yield sse(P.usage_chunk(rid, model, created, "text_completion", res))
                yield "data: [DONE]\n\n"
                self._count(res)
                self.requests[("/v1/completions", 200)] += 1
            except KVSessionError as e:
                yield sse(P.from_engine_error(e).body())
                yield "data: [DONE]\n\n"

        async def on_close() -> None:
            await events.aclose()  # cancels the request if it has not finished
            slot.release()

        return SSEResponse(body(), on_close, self._cut(limit, prompt_tokens))

    # ---- models, health, metrics -------------------------------------------------------

    def _model_card(self) -> dict:
        return {"id": self.model_name, "object": "model", "created": int(self.started),
                "owned_by": "kvsession", "max_model_len": self.max_model_len}

    async def models(self, request: Request) -> Response:
        self._check_key(request)
        return JSONResponse({"object": "list", "data": [self._model_card()]})

    async def model(self, request: Request) -> Response:
        self._check_key(request)
        self._check_model(request.path_params["model"])
        return JSONResponse(self._model_card())

    async def health(self, request: Request) -> Response:
        st = await asyncio.to_thread(self.llm.stats)
        dev = st.tiers["device"]
        body = {"status": "ok" if self.accepting else "shutting_down",
                "model": self.model_name, "requests_in_flight": self.in_flight,
                "conversations": self.conversations.num_sessions,
                "blocks_used": dev.blocks_used, "blocks_pinned": dev.blocks_pinned,
                "blocks_total": dev.blocks_total}
        return JSONResponse(body, status_code=200 if self.accepting else 503)

    async def metrics(self, request: Request) -> Response:
        st = await asyncio.to_thread(self.llm.stats)
        ex = Exposition()
        ex.add_stats(st)
        ex.add("kvsession_server_requests_in_flight", self.in_flight,
               help="generation requests admitted and not finished")
        ex.add("kvsession_server_max_concurrent_requests", self.max_concurrent,
               help="the admission bound (503 beyond it)")
        counter = MetricKind.COUNTER
        for (route, status), n in sorted(self.requests.items()):
            ex.add("kvsession_server_requests_total", n, {"route": route, "code": str(status)},
                   counter, help="answered requests by route and status")
        conv = self.conversations
        ex.add("kvsession_server_conversations", conv.num_sessions,
               help="idle sessions kept for conversations that may continue")
        ex.add("kvsession_server_conversation_hits_total", conv.hits, kind=counter,
               help="requests that continued a kept session")
        ex.add("kvsession_server_conversation_misses_total", conv.misses, kind=counter,
               help="requests that started a new session")
        for decision, n in sorted(self.tool_waits.items()):
            ex.add("kvsession_server_tool_waits_total", n, {"decision": decision},
                   kind=counter, help="sessions suspended while their client runs a tool, "
                                      "by the engine's decision")
        ex.add("kvsession_server_sessions_expired_total", conv.expired, kind=counter,
               help="conversation sessions closed by their session_ttl_s hint")
        for kind in ("prompt", "cached", "completion"):
            ex.add(f"kvsession_server_{kind}_tokens_total", self.tokens[kind], kind=counter,
                   help=f"{kind} tokens of answered requests")
        return Response(ex.render(), media_type=CONTENT_TYPE)


def _prompts(prompt) -> list:
    """A completion request's prompts: strings, or token id lists (OpenAI's four shapes)."""
    if isinstance(prompt, str):
        return [prompt]
    if prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        return [prompt]
    ok = prompt and (all(isinstance(p, str) for p in prompt) or all(
        isinstance(p, list) and p and all(isinstance(t, int) and not isinstance(t, bool)
                                          for t in p) for p in prompt))
    if not ok:
        raise P.APIError(400, "prompt must be a string, a list of strings, a list of token "
                              "ids or a list of such lists (non-empty)", param="prompt")
    return list(prompt)


def _best_effort(count):
    """count(), or None if it raises: a prompt that cannot be counted fails its request,
    which says why."""
    try:
        return count()
    except Exception:
        return None


async def _events_of(res: P.Result) -> AsyncIterator[tuple[str, object]]:
    """A finished Result as the event stream a streamed chat answer reads."""
    yield "done", res


async def _replay(body: dict, usage: bool) -> AsyncIterator[str]:
    """A finished batch completion as one SSE event per choice, then (stream_options
    include_usage) the usage alone, as a streamed request sends it: never in every chunk,
    where a client adding them up would count the request several times."""
    for c in body["choices"]:
        yield sse({**body, "choices": [c], "usage": None})
    if usage:
        yield sse({**body, "choices": []})
    yield "data: [DONE]\n\n"


async def _nothing() -> None:
    pass


def _priority(plan: Plan) -> int | None:
    """The request's priority hint (None: the default)."""
    return plan.hints.priority if plan.hints is not None else None
