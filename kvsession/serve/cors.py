"""Cross-origin requests (CORS): which web pages' scripts may call the server.

A browser lets a page call another origin's API only when that API says so: it sends a
preflight `OPTIONS` with the method and headers it wants and reads the
`Access-Control-Allow-*` answer. `--allowed-origins` names the origins (a browser chat UI
on `http://localhost:3000`, say; `*` for any); without it the server answers no CORS
headers and browsers refuse cross-origin calls (other clients are unaffected). Starlette's
CORSMiddleware does the protocol; API keys still apply (`Authorization` and `x-api-key`
are allowed request headers, and credentials are not cookies, so none are allowed).
"""

from __future__ import annotations

from collections.abc import Sequence

from starlette.applications import Starlette
from starlette.middleware.cors import CORSMiddleware

# the server's own response headers a page's script may read (the replica that answered,
# a replayed reply, the token limit a request ran under, when to retry after a 503)
EXPOSED_HEADERS = ["x-kvsession-replica", "x-kvsession-replayed", "x-kvsession-max-tokens",
                   "retry-after"]


def allow_origins(app: Starlette, origins: Sequence[str]) -> None:
    """Answer CORS requests from `origins` on every route of `app` (nothing when empty).
    Before the app starts."""
    if origins:
        app.add_middleware(CORSMiddleware, allow_origins=list(origins),
                           allow_methods=["GET", "POST", "DELETE"], allow_headers=["*"],
                           expose_headers=EXPOSED_HEADERS, max_age=600)
