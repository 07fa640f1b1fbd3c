"""The API key check every route behind --api-key makes (the single-process server, the Ray
ingress and the replicas' internal endpoints): OpenAI's clients send
`Authorization: Bearer KEY`, Anthropic's `x-api-key: KEY`; either is accepted. Compared in
constant time."""

from __future__ import annotations

import hmac

from starlette.requests import Request

from kvsession.serve import protocol as P


def check_key(request: Request, api_key: str | None) -> None:
    """401 unless the request carries `api_key` (when one is set)."""
    if api_key is None:
        return
    scheme, _, token = request.headers.get("authorization", "").partition(" ")
    if scheme.lower() != "bearer":
        token = request.headers.get("x-api-key", "")
    if not hmac.compare_digest(token.strip().encode(), api_key.encode()):
        raise P.APIError(401, "invalid or missing API key (Authorization: Bearer KEY, or "
                              "x-api-key: KEY)", code="invalid_api_key")
