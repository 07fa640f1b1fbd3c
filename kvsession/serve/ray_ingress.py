"""The ingress of `serve --replicas N --ray-address ADDR|local`: one OpenAI-compatible endpoint
in front of N engine replicas (Ray actors, kvsession/serve/ray_replicas.py), a small reverse
proxy that decides where each request goes (kvsession/serve/router.py) and moves sessions
when a replica dies, is drained or is overloaded. docs/scale-out.md describes the design.

Per request: the body is read once (to find `session_id`, the messages or the prompt), the
router picks a replica, the request goes there unchanged (the client's Authorization too:
replicas run with the same --api-key) and the answer comes back as it is, a stream as a
stream. A replica that refuses the connection is taken as dead: the request is sent to
another (nothing reached the dead one), its keys are forgotten, its sessions resume
elsewhere from the shared --session-dir, and Ray restarts it. A connection lost after the
request was sent is retried elsewhere when the replica is gone (a named session's turn that
its log holds is answered from the log there: no turn runs twice) and answered 502
`replica_error` when it still answers; lost mid-stream, the stream ends with a
`replica_lost` error event. A replica that answers no summary for --replica-unresponsive-s
is hung: killed, and restarted by Ray. A client that leaves closes the upstream connection.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import hashlib
import json
import logging
import time
from collections import Counter

import httpx
import msgspec
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from kvsession.serve import anthropic_messages as A
from kvsession.serve import openai_responses as R
from kvsession.serve import protocol as P
from kvsession.serve.auth import check_key
from kvsession.serve.conversations import conversation_keys
from kvsession.serve.prometheus import CONTENT_TYPE, Exposition, MetricKind
from kvsession.serve.ray_replica import RELEASE_PATH, SUMMARY_PATH
from kvsession.serve.ray_replicas import STOP_GRACE_S, ReplicaGone
from kvsession.serve.responses import ClientGone, SSEResponse, unless_disconnected
from kvsession.serve.router import Decision, Reason, ReplicaRouter, ReplicaState, Routing

log = logging.getLogger("kvsession.serve")
logging.getLogger("httpx").setLevel(logging.WARNING)  # not one line per proxied request

# headers that belong to one hop, not to the request or answer (RFC 9110 7.6.1)
HOP = {"connection", "keep-alive", "transfer-encoding", "te", "trailer", "upgrade",
       "proxy-authorization", "proxy-authenticate", "host", "content-length"}
PROMPT_CHUNK = 256  # characters per affinity key of a text completion's prompt
SUMMARY_TIMEOUT_S = 10.0
# a connect that fails with these failed in this process (out of descriptors, ports or
# memory): the replica is not to blame, and must not be killed for it
INGRESS_ERRNOS = frozenset({errno.EMFILE, errno.ENFILE, errno.EADDRNOTAVAIL, errno.ENOBUFS,
                            errno.ENOMEM})


def ingress_side(e: BaseException) -> bool:
    """Whether a connect error is this process's own (see INGRESS_ERRNOS)."""
    seen = 0
    while e is not None and seen < 16:  # httpx -> httpcore -> OSError, bounded
        if isinstance(e, OSError) and e.errno in INGRESS_ERRNOS:
            return True
        e, seen = e.__cause__ or e.__context__, seen + 1
    return False


def out_of_connections(e: BaseException) -> P.APIError:
    return P.APIError(503, f"the ingress cannot open a connection now ({e}); retry shortly",
                      type="server_error", code="ingress_overloaded",
                      headers={"Retry-After": "1"})


class Ingress:
    """Routes and state of the ingress. `replicas`: a RayReplicas (or anything with its
    `names`, `info`, `stop`, `kill`)."""

    def __init__(self, replicas, api_key: str | None = None, load_bound: float = 1.25,
                 summary_interval_s: float = 1.0, request_timeout_s: float = 600.0,
                 drain_timeout_s: float = 60.0, routing: Routing = Routing.AFFINITY,
                 unresponsive_s: float = 30.0):
        self.replicas = replicas
        self.api_key = api_key
        self.router = ReplicaRouter(replicas.names, load_bound, routing=routing)
        self.urls: dict[str, str | None] = dict.fromkeys(replicas.names)
        self.pids: dict[str, int | None] = dict.fromkeys(replicas.names)
        self.summaries: dict[str, dict] = {}
        self.restarts: Counter = Counter()
        self.summary_interval_s = summary_interval_s
        self.drain_timeout_s = drain_timeout_s
        # a replica with no summary for this long is hung: killed, Ray restarts it
        self.unresponsive_s = unresponsive_s
        self._answered: dict[str, float] = {}  # replica -> when it last gave a summary
        self._stopped = {n: asyncio.Event() for n in replicas.names}
        self._recovering: dict[str, asyncio.Task] = {}
        self._tasks: set[asyncio.Task] = set()
        # idle connections expire before uvicorn closes them (its keep-alive is 5 s), so a
        # read error on a pooled connection means the replica's process went away
        self.client = httpx.AsyncClient(timeout=httpx.Timeout(request_timeout_s, connect=5.0),
                                        limits=httpx.Limits(max_connections=None,
                                                            keepalive_expiry=2.0))
        self.accepting = True

    # ---- lifecycle -------------------------------------------------------------------

    async def start(self) -> None:
        """Wait for every replica to serve (bounded); raise ReplicaGone if one cannot."""
        infos = await asyncio.gather(*(self.replicas.info(n) for n in self.replicas.names))
        for info in infos:
            self._up(info)
        for name in self.replicas.names:  # one loop each: a hung replica stalls no other
            self._spawn(self._poll_summaries(name))

    async def close(self) -> None:
        self.accepting = False
        for t in list(self._tasks):
            t.cancel()
        await self.replicas.stop_all()
        await self.client.aclose()

    def _spawn(self, coro) -> asyncio.Task:
        t = asyncio.ensure_future(coro)
        self._tasks.add(t)
        t.add_done_callback(self._tasks.discard)
        return t

    def _up(self, info: dict) -> None:
        name = info["name"]
        self.urls[name], self.pids[name] = info["url"], info["pid"]
        self._stopped[name].clear()
        self._answered[name] = time.monotonic()
        self.router.set_state(name, ReplicaState.READY)
        log.info("%s serves at %s (pid %s)", name, info["url"], info["pid"])

    def _lost(self, name: str, reason: Reason = Reason.DEAD, hung: bool = False) -> None:
        """`name` stopped answering: its sessions move, Ray restarts it (`hung`: its
        process is alive but answers nothing; it is killed first)."""
        if self.router.state[name] in (ReplicaState.DEAD, ReplicaState.GONE,
                                       ReplicaState.STARTING, ReplicaState.STOPPING):
            return  # (STOPPING: a drain owns it, and ends it either way)
        log.warning("%s (%s) is lost: its sessions resume elsewhere", name, self.urls[name])
        self.router.set_state(name, ReplicaState.DEAD)
        self.router.lost(name, reason)
        self._stopped[name].set()
        self.urls[name] = None
        if name not in self._recovering:
            self._recovering[name] = self._spawn(self._recover(name, self.pids[name], hung))

    async def _recover(self, name: str, old_pid: int | None, hung: bool = False) -> None:
        try:
            self.router.set_state(name, ReplicaState.STARTING)
            if hung:  # its actor would not answer either: asking it would wait in vain
                self.replicas.kill(name, restart=True)
            info = await self.replicas.info(name)
            if info["pid"] == old_pid:  # alive but not serving: make Ray restart it
                self.replicas.kill(name, restart=True)
                info = await self.replicas.info(name)
            self.restarts[name] += 1
            self._up(info)
        except ReplicaGone as e:
            log.error("%s is dropped: %s", name, e)
            self.router.set_state(name, ReplicaState.GONE)
        finally:
            if self._recovering.get(name) is asyncio.current_task():  # (not another's)
                del self._recovering[name]

    async def _probe(self, name: str) -> bool:
        """After a transport error: is the replica still serving? (On a connection of its
        own: a pooled one to a dead process fails with a read error, not a refusal.) A
        replica that does not answer, but not for slowness, is lost; False then."""
        url = self.urls[name]
        if url is None:
            return False
        try:
            async with httpx.AsyncClient(timeout=5.0) as probe:
                await probe.get(f"{url}/health")
        except httpx.TimeoutException:
            return True  # slow, not dead
        except httpx.TransportError:
            # refused, or reset by a process on its way out (its listening socket lives a
            # moment longer than the connections it had)
            self._lost(name)
            return False
        return True

    async def _poll_summaries(self, name: str) -> None:
        while True:
            if self.router.state[name] in (ReplicaState.READY, ReplicaState.DRAINING):
                await self._summary(name)
                silent_s = time.monotonic() - self._answered[name]
                if silent_s > self.unresponsive_s:
                    log.error("%s answered no summary for %.0f s: it is hung", name, silent_s)
                    self._lost(name, hung=True)
            await asyncio.sleep(self.summary_interval_s)

    async def _summary(self, name: str) -> None:
        url = self.urls[name]
        if url is None:
            return
        try:
            r = await self.client.get(f"{url}{SUMMARY_PATH}", headers=self._auth(),
                                      timeout=min(SUMMARY_TIMEOUT_S, self.unresponsive_s))
            s = r.json()
        except httpx.ConnectError as e:
            if ingress_side(e):
                log.warning("%s: no summary: this process cannot connect (%s)", name, e)
            else:
                self._lost(name)
            return
        except (httpx.HTTPError, ValueError) as e:
            log.warning("%s: no summary (%s)", name, e)
            return
        if r.status_code != 200 or s.get("pid") != self.pids[name]:
            return  # answered by another process than the one this state is about
        self._answered[name] = time.monotonic()
        self.summaries[name] = s
        self.router.report(name, {bytes.fromhex(k) for k in s.get("conversations", ())},
                           s.get("sessions", ()))

    def _auth(self) -> dict:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    # ---- app -------------------------------------------------------------------------

    def app(self) -> Starlette:
        routes = [
            Route("/v1/chat/completions", self.chat, methods=["POST"]),
            Route("/v1/completions", self.completions, methods=["POST"]),
            Route("/v1/responses", self.responses, methods=["POST"]),
            Route("/v1/responses/{rid}", self.stored_response, methods=["GET", "DELETE"]),
            Route("/v1/messages", self.messages, methods=["POST"]),
            Route("/v1/models", self.passthrough, methods=["GET"]),
            Route("/v1/models/{model:path}", self.passthrough, methods=["GET"]),
            Route("/health", self.health, methods=["GET"]),
            Route("/metrics", self.metrics, methods=["GET"]),
            Route("/admin/drain/{replica}", self.drain, methods=["POST"]),
        ]
        # every answer is OpenAI's error JSON, as the single-process server's
        return Starlette(routes=routes, exception_handlers={
            HTTPException: self._http_error, P.APIError: self._api_error,
            ClientGone: self._gone, Exception: self._internal_error})

    @staticmethod
    async def _gone(request: Request, e: ClientGone) -> Response:
        return Response(status_code=499)  # nginx's "client closed request"

    async def _api_error(self, request: Request, e: P.APIError) -> Response:
        body = A.error_body(e) if request.url.path == "/v1/messages" else e.body()
        return JSONResponse(body, status_code=e.status, headers=e.headers)

    async def _http_error(self, request: Request, e: HTTPException) -> Response:
        return await self._api_error(request, P.from_routing_error(
            e.status_code, e.detail, request.method, request.url.path))

    async def _internal_error(self, request: Request, e: Exception) -> Response:
        return await self._api_error(request, P.from_engine_error(e))

    def _check(self, request: Request) -> None:
        check_key(request, self.api_key)
        if not self.accepting:
            raise P.APIError(503, "the server is shutting down", type="server_error",
                             code="shutting_down", headers={"Retry-After": "1"})

    async def chat(self, request: Request) -> Response:
        self._check(request)
        body = await request.body()
        req = _json(body)
        sid = req.get("session_id") or request.headers.get("x-session-id")
        if isinstance(sid, str):
            return await self._session_request(request, body, sid)
        messages = req.get("messages")
        keys = []
        if isinstance(messages, list) and all(isinstance(m, dict) for m in messages):
            # a body its keys cannot be computed from goes on without them: the replica
            # answers its 400 (malformed tool calls, non-text parts, lone surrogates)
            with contextlib.suppress(Exception):
                keys = conversation_keys(messages, req.get("tools"),
                                         req.get("chat_template_kwargs"),
                                         req.get("cache_salt"))[1:]
        return await self._send(request, body, lambda: self.router.route_conversation(keys),
                                keys=keys)

    async def completions(self, request: Request) -> Response:
        self._check(request)
        body = await request.body()
        prompt = _json(body).get("prompt")
        keys = []
        with contextlib.suppress(Exception):  # as for chat: the replica answers the 400
            keys = _prompt_keys(prompt if isinstance(prompt, str) else json.dumps(prompt))
        return await self._send(request, body, lambda: self.router.route_other(keys))

    async def passthrough(self, request: Request) -> Response:
        self._check(request)
        return await self._send(request, b"", lambda: self.router.route_other([]))

    async def responses(self, request: Request) -> Response:
        """A Responses request goes to its chain's Session (a named session: sticky, moved
        as sessions move): the chain of its previous_response_id, or for a stored one
        starting a chain, a chain picked here and passed on (R.CHAIN_HEADER), so that the
        chain's next request finds it. store: false goes anywhere."""
        self._check(request)
        body = await request.body()
        req = _json(body)
        prev = req.get("previous_response_id")
        sid = R.chain_session(prev) if isinstance(prev, str) else None
        extra = {}
        if sid is None and req.get("store", True) is not False:
            chain = R.new_chain()
            sid, extra = R.chain_session(chain), {R.CHAIN_HEADER: chain}
        if sid is None:
            return await self._send(request, body, lambda: self.router.route_other([]))
        return await self._session_request(request, body, sid, extra)

    async def stored_response(self, request: Request) -> Response:
        """GET / DELETE a stored response: where its chain's Session is."""
        self._check(request)
        sid = R.chain_session(request.path_params["rid"])
        if sid is None:
            raise P.APIError(404, "no stored response with that id", code="not_found")
        return await self._session_request(request, b"", sid)

    async def messages(self, request: Request) -> Response:
        """An Anthropic conversation goes where its history is, as a chat one does (its
        messages as chat messages: the keys the replica files it under)."""
        self._check(request)
        body = await request.body()
        keys = []
        with contextlib.suppress(Exception):  # the replica answers a malformed body's 400
            req = msgspec.convert(_json(body), A.MessagesRequest)
            keys = conversation_keys(A.chat_messages(req), A.chat_tools(req.tools))[1:]
        return await self._send(request, body, lambda: self.router.route_conversation(keys),
                                keys=keys)

    async def _session_request(self, request: Request, body: bytes, sid: str,
                               extra: dict | None = None) -> Response:
        holder = self.router.waiting_on(sid)
        if holder is not None:  # it is persisting the session as it stops: wait for it
            with contextlib.suppress(TimeoutError):  # the stop's own bound, and a margin
                await asyncio.wait_for(self._stopped[holder].wait(),
                                       self.drain_timeout_s + STOP_GRACE_S + 5.0)

        def route() -> Decision | None:
            return self.router.route_session(sid)

        return await self._send(request, body, route, session_id=sid, extra=extra)

    async def _send(self, request: Request, body: bytes, route, session_id: str | None = None,
                    extra: dict | None = None,
                    keys: list[bytes] | None = None) -> Response:
        """Route (again after a replica is found dead) and relay the answer."""
        tried_locked = False
        for _ in range(len(self.router.names) + 2):
            d = route()
            if d is None:
                raise P.APIError(503, "no replica is ready; retry shortly", type="server_error",
                                 code="no_replica", headers={"Retry-After": "1"})
            if d.reason is Reason.OVERLOADED and not await self._release(d.moved_from,
                                                                         session_id):
                d = self.router.stay(session_id, d)
            self.router.started(d, session_id)
            handed = False
            try:
                # the client may leave while the replica works on it (non-streamed: no
                # header comes before the answer): the connection to the replica is then
                # closed, which cancels the request there, and its place is free at once
                upstream = await unless_disconnected(request,
                                                     self._forward(d.replica, request, body,
                                                                   extra))
                if (upstream.status_code == 409 and session_id is not None
                        and not tried_locked and await _is_locked(upstream)):
                    # open on a replica this ingress has not heard of: ask them all. This
                    # request's hold on the session is released first: a summary does not
                    # move a session with a request in flight (a stale one could), so the
                    # retry went to the same replica and its 409 reached the client
                    tried_locked, handed = True, True
                    self.router.finished(d, session_id)
                    await asyncio.gather(*(self._summary(n) for n in self.router.ready()))
                    continue
                if upstream.status_code == 200 and keys:
                    self.router.served(d.replica, keys)
                handed = True
                return await self._relay(request, upstream, d, session_id)
            except httpx.ConnectError as e:
                if ingress_side(e):  # out of descriptors here: no replica is to blame
                    raise out_of_connections(e) from None
                self._lost(d.replica)  # nothing reached it: send the request elsewhere
            except httpx.TransportError as e:
                # the replica's process is gone (this request went out on a pooled
                # connection to it, or it died during the turn): the turn was not
                # acknowledged, so it is sent again elsewhere; a named session resumes
                # there from its log (a turn logged but never answered is answered with
                # the reply the log stored: the replica replays a retried last turn)
                if not await self._probe(d.replica):
                    continue
                raise P.APIError(502, f"{d.replica} failed during the request "
                                      f"({type(e).__name__}: {e})", type="server_error",
                                 code="replica_error") from None
            finally:
                if not handed:
                    self.router.finished(d, session_id)
        raise P.APIError(503, "no replica could take the request", type="server_error",
                         code="no_replica", headers={"Retry-After": "1"})

    async def _forward(self, name: str, request: Request, body: bytes,
                       extra: dict | None = None) -> httpx.Response:
        url = self.urls[name]
        if url is None:
            raise httpx.ConnectError(f"{name} has no address")
        headers = [(k, v) for k, v in request.headers.items() if k.lower() not in HOP]
        headers += list((extra or {}).items())
        target = f"{url}{request.url.path}"
        if request.url.query:
            target += f"?{request.url.query}"
        req = self.client.build_request(request.method, target, content=body, headers=headers)
        return await self.client.send(req, stream=True)

    async def _relay(self, request: Request, upstream: httpx.Response, d: Decision,
                     session_id: str | None) -> Response:
        """The replica's answer as this answer; the request's load is released when it has
        been passed on, or when the client went away (closing the upstream connection then
        makes the replica cancel the request)."""
        headers = {k: v for k, v in upstream.headers.items() if k.lower() not in HOP}
        headers["x-kvsession-replica"] = d.replica
        done = False

        def finish() -> None:
            nonlocal done
            if not done:
                done = True
                self.router.finished(d, session_id)

        if not upstream.headers.get("content-type", "").startswith("text/event-stream"):
            try:  # a TransportError: the replica is gone
                content = await unless_disconnected(request, upstream.aread())
            finally:
                await upstream.aclose()
                finish()
            return Response(content, status_code=upstream.status_code, headers=headers)

        async def body():
            try:
                async for chunk in upstream.aiter_raw():
                    yield chunk
            except httpx.TransportError as e:  # the replica died mid-stream
                await self._probe(d.replica)
                err = P.APIError(502, f"the replica was lost mid-stream ({type(e).__name__})",
                                 type="server_error", code="replica_lost")
                yield f"data: {json.dumps(err.body())}\n\ndata: [DONE]\n\n".encode()

        async def on_close() -> None:
            await upstream.aclose()
            finish()

        resp = SSEResponse(body(), on_close)
        resp.status_code = upstream.status_code
        resp.headers["x-kvsession-replica"] = d.replica
        return resp

    async def _release(self, name: str, session_id: str) -> bool:
        """Ask `name` to let an idle session go (persisted, lock released)."""
        url = self.urls[name]
        if url is None:
            return True
        try:
            r = await self.client.post(f"{url}{RELEASE_PATH}", json={"session_id": session_id},
                                       headers=self._auth(), timeout=30.0)
            return r.status_code == 200 and bool(r.json().get("released"))
        except (httpx.HTTPError, ValueError):
            return False

    # ---- drain -----------------------------------------------------------------------

    async def drain(self, request: Request) -> Response:
        """Take a replica out of rotation: no new work; once its requests in flight are
        done (or --drain-timeout-s passed) it stops, persisting its sessions, which resume
        on the others at their next request. `?restart=false` drops it; by default Ray
        starts a fresh one in its place."""
        check_key(request, self.api_key)
        name = request.path_params["replica"]
        if name not in self.router.state:
            raise P.APIError(404, f"no replica {name!r}; replicas: {self.router.names}",
                             param="replica", code="not_found")
        if self.router.state[name] is not ReplicaState.READY:
            raise P.APIError(409, f"{name} is {self.router.state[name].value}, not ready",
                             param="replica", code="not_ready")
        restart = request.query_params.get("restart", "true").lower() not in ("0", "false")
        t0 = time.monotonic()
        self.router.set_state(name, ReplicaState.DRAINING)
        while (self.router.load[name] and self.router.state[name] is ReplicaState.DRAINING
               and time.monotonic() - t0 < self.drain_timeout_s):
            await asyncio.sleep(0.05)  # the in-flight count has no waiter to notify
        if self.router.state[name] is not ReplicaState.DRAINING:
            # lost meanwhile (`_lost`): its sessions moved, and a recovery waits for the
            # process Ray restarts. Killing that one too would spend another restart (the
            # last one: the replica dropped although asked to restart)
            recovery = self._recovering.get(name)
            if restart or self.router.state[name] is ReplicaState.GONE:
                return JSONResponse({"replica": name, "stopped_cleanly": False,
                                     "sessions_moved": 0, "restart": restart, "lost": True,
                                     "seconds": round(time.monotonic() - t0, 3)})
            if recovery is not None:  # asked to drop it: it is not brought back
                recovery.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await recovery
            # (or back already: a fresh process, stopped below as asked)
        sessions = self.router.sessions_on(name)
        self.router.set_state(name, ReplicaState.STOPPING)
        stopped = await self.replicas.stop(name, self.drain_timeout_s)
        self.router.lost(name, Reason.DRAINED)
        self.urls[name] = None
        self.router.set_state(name, ReplicaState.STARTING if restart else ReplicaState.GONE)
        self._stopped[name].set()
        self.replicas.kill(name, restart=restart)
        if restart:
            self._recovering[name] = self._spawn(self._recover(name, self.pids[name]))
        return JSONResponse({"replica": name, "stopped_cleanly": stopped,
                             "sessions_moved": sessions, "restart": restart, "lost": False,
                             "seconds": round(time.monotonic() - t0, 3)})

    # ---- health, metrics -------------------------------------------------------------

    def _replicas_json(self) -> list[dict]:
        out = []
        for n in self.router.names:
            s = self.summaries.get(n, {})
            out.append({"name": n, "state": self.router.state[n].value, "url": self.urls[n],
                        "pid": self.pids[n], "in_flight": self.router.load[n],
                        "sessions": self.router.sessions_on(n),
                        "conversations": len(s.get("conversations", ())),
                        "restarts": self.restarts[n]})
        return out

    async def health(self, request: Request) -> Response:
        ready = self.router.ready()
        status = ("shutting_down" if not self.accepting else "ok" if len(ready) == len(
            self.router.names) else "degraded" if ready else "unavailable")
        return JSONResponse({"status": status, "replicas": self._replicas_json(),
                             "ready": len(ready), "load_cap": self.router.cap()},
                            status_code=200 if ready and self.accepting else 503)

    async def metrics(self, request: Request) -> Response:
        ex, r = Exposition(), self.router
        for st in ReplicaState:
            ex.add("kvsession_router_replicas", sum(1 for n in r.names if r.state[n] is st),
                   {"state": st.value}, help="replicas by state")
        for n in r.names:
            lab = {"replica": n}
            ex.add("kvsession_router_in_flight", r.load[n], lab,
                   help="requests in flight per replica")
            ex.add("kvsession_router_requests_total", r.routed[n], lab, kind=MetricKind.COUNTER,
                   help="requests sent to each replica")
            ex.add("kvsession_router_sessions", r.sessions_on(n), lab,
                   help="named sessions held by each replica")
            ex.add("kvsession_router_restarts_total", self.restarts[n], lab,
                   kind=MetricKind.COUNTER, help="times the replica came back after it was lost")
            s = self.summaries.get(n)
            if s:
                for field in ("prefix_hit_rate", "prefix_hit_tokens", "prefix_queried_tokens",
                              "prefill_tokens", "prompt_tokens", "cached_tokens",
                              "conversation_hits", "conversation_misses", "blocks_used",
                              "blocks_total"):
                    # counts since the replica started (a restart resets them, which
                    # Prometheus' rate() takes for a counter reset); the rest are levels
                    kind = MetricKind.GAUGE if field.startswith(("blocks_", "prefix_hit_rate")) \
                        else MetricKind.COUNTER
                    ex.add(f"kvsession_replica_{field}", s.get(field, 0), lab, kind,
                           help=f"the replica's {field.replace('_', ' ')} (last summary)")
        for kind, count in sorted(r.decisions.items(), key=lambda kv: kv[0].value):
            ex.add("kvsession_router_decisions_total", count, {"kind": kind.value},
                   kind=MetricKind.COUNTER, help="routing decisions by kind")
        for reason in Reason:
            ex.add("kvsession_router_migrations_total", r.migrations[reason],
                   {"reason": reason.value}, kind=MetricKind.COUNTER,
                   help="sessions that moved to another replica, by why")
        ex.add("kvsession_router_load_cap", r.cap(),
               help="the most requests one replica may hold after the next (bounded load)")
        return Response(ex.render(), media_type=CONTENT_TYPE)


def _json(body: bytes) -> dict:
    """The body as a dict when it is one (a bad body goes to a replica, which answers the
    400 as the single-process server does). One nested deeper than P.MAX_NESTING is not
    parsed here (json.loads recurses: a RecursionError, a 500): it goes on as it is, and
    the replica's decode_body answers the 400 naming the field."""
    try:
        P.check_nesting(body)
        obj = json.loads(body)
    except (ValueError, RecursionError, P.APIError):
        return {}
    return obj if isinstance(obj, dict) else {}


def _prompt_keys(text: str) -> list[bytes]:
    """Affinity keys of a text completion: a hash chain over its prompt in fixed chunks."""
    keys, h = [], b""
    for i in range(0, min(len(text), 64 * PROMPT_CHUNK), PROMPT_CHUNK):
        h = hashlib.sha256(h + text[i:i + PROMPT_CHUNK].encode()).digest()
        keys.append(h)
    return keys


async def _is_locked(upstream: httpx.Response) -> bool:
    """A 409 that says the session is open in another process (read and closed here)."""
    try:
        body = json.loads(await upstream.aread())
        return body.get("error", {}).get("code") == "session_locked"
    except (ValueError, httpx.HTTPError, AttributeError):
        return False
    finally:
        await upstream.aclose()
