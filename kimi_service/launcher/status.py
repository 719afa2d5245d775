"""Small JSON status pages serve answers itself: /ready for load balancers, a follower's /health."""

from __future__ import annotations

import contextlib
import json
import threading
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, HTTPServer
from typing import Any

from kimi_service.http_limits import IDLE_TIMEOUT, server_class


class Readiness:
    """What GET /ready answers on serve.ready_port: 200 only while this node takes new requests.

    vLLM's own /health cannot tell a balancer to stop sending: it answers 200 until the engine is gone
    (measured on 0.32: for its whole shutdown, while new requests get 500). This one turns 503 the moment
    SIGTERM arrives, while the engine still serves what is in flight.
    """

    def __init__(self) -> None:
        self.state = "starting"

    def set(self, state: str) -> None:
        if self.state != "draining":  # once stopping, nothing brings the node back
            self.state = state

    def document(self) -> tuple[int, dict[str, Any]]:
        return (200 if self.state == "ready" else 503), {"ready": self.state == "ready", "state": self.state}


def status_server(host: str, port: int, path: str, document: Callable[[], tuple[int, dict[str, Any]]],
                  not_found: str, *, idle_timeout: float = IDLE_TIMEOUT) -> HTTPServer:
    """A JSON status page on GET `path` (every other path gets 404 with `not_found`), in a thread; a
    client silent for `idle_timeout` seconds is dropped and at most MAX_HANDLERS are served at once."""

    class Handler(BaseHTTPRequestHandler):
        # Buffered, so the status line, headers and body leave in one write: HAProxy resets a check's
        # connection as soon as it has read the status, and a body sent after that would fail.
        wbufsize = 1 << 16
        timeout = idle_timeout

        def handle(self) -> None:
            with contextlib.suppress(ConnectionError):  # a checker that hung up is not our error
                super().handle()

        def do_GET(self) -> None:
            if self.path.split("?")[0] != path:
                self.send_error(404, not_found)
                return
            code, body = document()
            data = json.dumps(body).encode()
            self.send_response(code)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, format: str, *args: Any) -> None:
            pass  # probed every few seconds: not worth a journal line each

    server = server_class(HTTPServer, host, "StatusServer")((host, port), Handler)
    threading.Thread(target=server.serve_forever, name=f"status{path}", daemon=True).start()
    return server
