"""`python -m kvsession serve`: an OpenAI-compatible HTTP server over one `LLM` (the optional
extra `server`: `pip install kvsession[server]`).

An application on top of the public API (it imports only `kvsession`'s public names):
`main` (command line, uvicorn), `app` (the Starlette routes, admission), `protocol` (the
OpenAI wire format), `conversations` (stateless clients' conversations -> Sessions),
`runs` (one request on the engine as events), `prometheus` (`/metrics`); every LLM
argument is a command-line flag through `kvsession.flags` (shared with the prefill worker).
docs/server.md describes the design.
"""
