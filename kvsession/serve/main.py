"""`python -m kvsession serve --model DIR [...]`: build the LLM, serve it with uvicorn.

The listening socket is bound here, before uvicorn starts, so `--port 0` works: the line
`kvsession serve listening on http://HOST:PORT` (stdout, flushed) names the port the system
chose, once the model is loaded and the server accepts connections.

SIGTERM / SIGINT: uvicorn stops accepting connections and waits up to
`--shutdown-timeout-s` for the requests in flight (then cancels them); the application's
shutdown closes the conversation sessions and `llm.close()` persists the named ones to
--session-dir. The process then exits with status 0.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import signal
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import uvicorn

from kvsession.flags import add_llm_flags, llm_kwargs
from kvsession.serve.cors import allow_origins
from kvsession.serve.listen import LISTENING, bind_listener
from kvsession.serve.ray_main import add_replica_arguments, run_replicated, wants_replicas


def add_serve_arguments(p: argparse.ArgumentParser, llm_cls) -> None:
    p.add_argument("--host", default="127.0.0.1",
                   help="interface to bind (default: loopback only)")
    p.add_argument("--port", type=int, default=8000, help="0: a free port, printed")
    p.add_argument("--api-key", default=None,
                   help="require `Authorization: Bearer KEY` on /v1/* (default: none)")
    p.add_argument("--served-model-name", default=None,
                   help="the model id clients send (default: the model directory's name)")
    p.add_argument("--max-concurrent-requests", type=int, default=256,
                   help="generation requests in flight; beyond it: 503 with Retry-After")
    p.add_argument("--max-conversations", type=int, default=256,
                   help="idle conversation sessions kept for reuse (least recently used "
                        "closed first)")
    p.add_argument("--default-max-tokens", type=int, default=None,
                   help="max_tokens of a request that sets none (default: up to "
                        "max_model_len, as OpenAI)")
    p.add_argument("--shutdown-timeout-s", type=float, default=30.0,
                   help="on SIGTERM, how long requests in flight may take to finish")
    p.add_argument("--allowed-origins", nargs="+", default=[], metavar="ORIGIN",
                   help="origins whose web pages may call the API (CORS), e.g. "
                        "http://localhost:3000; * for any (default: none)")
    p.add_argument("--log-level", default="warning",
                   choices=["critical", "error", "warning", "info", "debug"])
    add_llm_flags(p, llm_cls)
    add_replica_arguments(p)


def _check(p: argparse.ArgumentParser, args) -> None:
    if not 0 <= args.port <= 65535:
        p.error(f"--port must be in 0..65535, got {args.port}")
    for name in ("max_concurrent_requests", "max_conversations"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if args.default_max_tokens is not None and args.default_max_tokens < 1:
        p.error(f"--default-max-tokens must be >= 1, got {args.default_max_tokens}")
    if not args.shutdown_timeout_s > 0:
        p.error(f"--shutdown-timeout-s must be > 0, got {args.shutdown_timeout_s}")


def run(args, parser: argparse.ArgumentParser) -> int:
    """Serve until SIGTERM / SIGINT. Errors building the LLM propagate (KVSessionError:
    the CLI prints them on one line)."""
    from kvsession import LLM
    from kvsession.serve.app import Server

    _check(parser, args)
    logging.basicConfig(level=args.log_level.upper(), format="%(levelname)s %(name)s: "
                                                              "%(message)s")
    if wants_replicas(args):  # N engines on Ray behind this process (docs/scale-out.md)
        return run_replicated(args, parser, LLM)
    sock = bind_listener(args.host, args.port)  # before the model loads: a busy port fails fast
    previous = signal.signal(signal.SIGTERM, _stop)  # a SIGTERM while loading: exit 0
    try:
        llm = LLM(args.model, **llm_kwargs(args, LLM))
    except _Stopped:
        sock.close()
        print("kvsession serve: stopped while loading", flush=True)
        return 0
    finally:
        signal.signal(signal.SIGTERM, previous)
    server = Server(llm, args.served_model_name or Path(args.model).name, args.api_key,
                    args.max_concurrent_requests, args.max_conversations,
                    args.default_max_tokens, aliases=(str(args.model),),
                    session_dir=args.session_dir)

    @contextlib.asynccontextmanager
    async def lifespan(app):
        # blocking calls (making and closing sessions, stats) run in threads: as many as
        # requests may be in flight, so a burst of new conversations is not serialised
        # behind asyncio's default of min(32, cores + 4)
        asyncio.get_running_loop().set_default_executor(ThreadPoolExecutor(
            max_workers=args.max_concurrent_requests + 4, thread_name_prefix="kvsession-serve"))
        host, port = sock.getsockname()[:2]
        shown = f"[{host}]" if ":" in host else host
        print(f"{LISTENING} http://{shown}:{port}", flush=True)
        yield
        server.accepting = False
        await asyncio.to_thread(server.conversations.close_all)

    app = server.app()
    allow_origins(app, args.allowed_origins)
    app.router.lifespan_context = lifespan
    config = uvicorn.Config(app, log_level=args.log_level, access_log=False,
                            timeout_graceful_shutdown=int(max(1, args.shutdown_timeout_s)),
                            lifespan="on")
    uv = _Uvicorn(config, server)
    # until uvicorn's own handlers are in place a SIGTERM asks it to exit as soon as it
    # runs; uvicorn re-raises the signal it shut down on once its handlers are gone, and
    # this handler takes that too, so a graceful SIGTERM exits 0 (SIGINT stays
    # KeyboardInterrupt)
    previous = signal.signal(signal.SIGTERM, lambda *_: uv.handle_exit(signal.SIGTERM, None))
    try:
        uv.run(sockets=[sock])
    finally:
        signal.signal(signal.SIGTERM, previous)
        sock.close()
        llm.close()  # persists named sessions to --session-dir
    print("kvsession serve: stopped", flush=True)
    return 0


class _Stopped(Exception):
    """SIGTERM arrived before the server ran."""


def _stop(*_) -> None:
    raise _Stopped()


class _Uvicorn(uvicorn.Server):
    """uvicorn.Server whose exit signal also closes admission at once (new requests get
    503 while the ones in flight finish)."""

    def __init__(self, config, server):
        super().__init__(config)
        self._app_server = server

    def handle_exit(self, sig, frame) -> None:
        self._app_server.accepting = False
        super().handle_exit(sig, frame)
