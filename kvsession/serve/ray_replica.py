"""One engine replica of `serve --replicas N`: an `LLM` and the single-process server
(kvsession/serve/app.py) on its own port, run as a Ray actor (kvsession/serve/ray_replicas.py
makes it one; nothing here imports Ray, so it also runs as a plain object).

uvicorn runs in a thread of the actor process (a thread has no signal handlers: the actor
is stopped by `stop()`, or killed by Ray). Killing the process releases every session lock it
held (flock), so another replica can resume its sessions from the shared --session-dir.

Besides the OpenAI routes, a replica answers the ingress:
- `GET /v1/kvsession/summary`: what it holds (the conversation keys its idle Sessions are
  filed under, the named sessions open here), its load and its cache counters;
- `POST /v1/kvsession/release` `{"session_id": ...}`: close that named session (persisted to
  --session-dir, its lock released) so another replica can take it; refused while a turn
  runs on it.
Both need the API key when the server has one.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor

from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

from kvsession.serve import protocol as P
from kvsession.serve.auth import check_key

SUMMARY_PATH = "/v1/kvsession/summary"
RELEASE_PATH = "/v1/kvsession/release"


def _node_ip() -> str:
    """The address other nodes reach this one at (the route to a public address, no
    packet sent)."""
    with contextlib.closing(socket.socket(socket.AF_INET, socket.SOCK_DGRAM)) as s:
        try:
            s.connect(("192.0.2.1", 9))  # TEST-NET-1: only the routing table is consulted
            return s.getsockname()[0]
        except OSError:
            return "127.0.0.1"


class Replica:
    """Build the LLM, start the server on `host` (port chosen by the system; "node": this
    node's address) and return once it accepts requests (or raise)."""

    def __init__(self, name: str, model: str, llm_kwargs: dict, server_kwargs: dict,
                 host: str = "127.0.0.1", log_level: str = "warning",
                 start_timeout_s: float = 60.0):
        import uvicorn

        from kvsession import LLM
        from kvsession.serve.app import Server
        from kvsession.serve.listen import bind_listener

        self.name = name
        self.api_key = server_kwargs.get("api_key")
        self.llm = LLM(model, **llm_kwargs)
        self.server = Server(self.llm, **server_kwargs)
        app = self.server.app()
        app.router.routes[0:0] = [Route(SUMMARY_PATH, self.summary, methods=["GET"]),
                                  Route(RELEASE_PATH, self.release, methods=["POST"])]
        self._sock = bind_listener(_node_ip() if host == "node" else host, 0)
        # not inherited by processes the engine starts: when this one dies, its port must
        # refuse connections (that is how the ingress tells a dead replica)
        self._sock.set_inheritable(False)
        ready = threading.Event()
        max_workers = server_kwargs.get("max_concurrent", 256) + 4

        @contextlib.asynccontextmanager
        async def lifespan(_app):
            asyncio.get_running_loop().set_default_executor(ThreadPoolExecutor(
                max_workers=max_workers, thread_name_prefix="kvsession-serve"))
            ready.set()
            yield
            self.server.accepting = False
            await asyncio.to_thread(self.server.conversations.close_all)

        app.router.lifespan_context = lifespan
        config = uvicorn.Config(app, log_level=log_level, access_log=False, lifespan="on",
                                timeout_graceful_shutdown=30)
        self._uv = uvicorn.Server(config)
        self._thread = threading.Thread(target=self._uv.run, kwargs={"sockets": [self._sock]},
                                        daemon=True, name=f"kvsession-{name}")
        self._thread.start()
        if not ready.wait(start_timeout_s):
            self.stop()
            raise RuntimeError(f"{name}: the server did not start in {start_timeout_s} s")
        host, port = self._sock.getsockname()[:2]
        self.url = f"http://{f'[{host}]' if ':' in host else host}:{port}"
        self.started = time.time()

    def info(self) -> dict:
        """Where it serves, and which process it is (a restarted replica has a new pid)."""
        return {"name": self.name, "url": self.url, "pid": os.getpid(),
                "started": self.started}

    def stop(self, timeout_s: float = 60.0) -> bool:
        """Graceful: requests in flight finish (up to uvicorn's 30 s), conversation Sessions
        are closed and `llm.close()` persists the named ones to --session-dir, releasing
        their locks. True when everything stopped within `timeout_s`."""
        self.server.accepting = False
        self._uv.should_exit = True
        self._thread.join(timeout_s)
        stopped = not self._thread.is_alive()
        self._sock.close()
        self.llm.close()
        return stopped

    # ---- routes for the ingress --------------------------------------------------------

    async def summary(self, request: Request) -> JSONResponse:
        check_key(request, self.api_key)
        st = await asyncio.to_thread(self.llm.stats)
        conv, srv = self.server.conversations, self.server
        dev = st.tiers["device"]
        return JSONResponse({
            "replica": self.name, "pid": os.getpid(),
            "conversations": [k.hex() for k in conv.filed_keys()],
            "sessions": conv.named_ids(),
            "in_flight": srv.in_flight,
            "conversation_hits": conv.hits, "conversation_misses": conv.misses,
            "prompt_tokens": srv.tokens["prompt"], "cached_tokens": srv.tokens["cached"],
            "completion_tokens": srv.tokens["completion"],
            "prefix_queried_tokens": st.prefix.queried_tokens,
            "prefix_hit_tokens": st.prefix.hit_tokens, "prefix_hit_rate": st.prefix.hit_rate,
            "prefill_tokens": st.prefill_tokens,
            "blocks_used": dev.blocks_used, "blocks_total": dev.blocks_total,
            "restores": dict(st.restores), "recomputes": st.recomputes})

    async def release(self, request: Request) -> JSONResponse:
        check_key(request, self.api_key)
        try:
            body = await request.body()
            P.check_nesting(body)  # (json.loads recurses: a deep body was a 500)
            sid = json.loads(body)["session_id"]
        except (ValueError, KeyError, TypeError, RecursionError):
            raise P.APIError(400, 'the body must be {"session_id": "..."}',
                             param="session_id") from None
        if not isinstance(sid, str):
            raise P.APIError(400, "session_id must be a string", param="session_id")
        return JSONResponse({"session_id": sid,
                             "released": await self.server.conversations.release(sid)})
