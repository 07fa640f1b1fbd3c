"""The server's listening socket and the line that announces it: shared by `serve` (one
engine: serve/main.py) and `serve --replicas N` (the Ray ingress: serve/ray_main.py), and
read by the process helper that waits for a server (serve/process.py)."""

from __future__ import annotations

import socket
import sys

# printed once the server accepts connections, followed by its URL
LISTENING = "kvsession serve listening on"


def bind_listener(host: str, port: int) -> socket.socket:
    """A listening socket bound before the model loads, so a busy port fails fast (exit
    status 1, the cause on stderr); inheritable, for uvicorn's workers."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        print(f"error: cannot listen on {host}:{port}: {e}", file=sys.stderr)
        raise SystemExit(1) from None
    sock.listen(2048)
    sock.set_inheritable(True)
    return sock
