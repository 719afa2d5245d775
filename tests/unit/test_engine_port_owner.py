"""The engine's port is the engine's: a program that bound the API port before vLLM did is named, and
never receives the key (serve checks the listener's socket belongs to its engine's process group)."""

from __future__ import annotations

import subprocess
import sys
import time
from http.server import BaseHTTPRequestHandler

import httpx
import pytest

from kimi_service import launcher
from kimi_service.config import parse_config
from kimi_service.errors import EngineFailed
from kimi_service.launcher.listener import foreign_listener, listeners
from kimi_service.sdnotify import Notifier
from tests.support.local_http import answer, serve_in_thread
from tests.support.ports import free_port

# A stand-in engine: answers /health and /v1/models on the given port, as a process of its own session.
ENGINE = """
import sys
from http.server import BaseHTTPRequestHandler, HTTPServer
class H(BaseHTTPRequestHandler):
    def do_GET(self):
        body = b'{"data": [{"id": "tiny"}]}'
        self.send_response(200); self.send_header("Content-Length", str(len(body))); self.end_headers()
        self.wfile.write(body)
    def log_message(self, *a): pass
HTTPServer(("127.0.0.1", int(sys.argv[1])), H).serve_forever()
"""


class Squatter:
    """A program of this test's own (not the engine's group) answering 200 on a port, keeping every
    Authorization header it is sent."""

    def __init__(self) -> None:
        outer = self
        self.authorizations: list[str] = []

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                if self.headers.get("Authorization"):
                    outer.authorizations.append(self.headers["Authorization"])
                answer(self, b'{"data": [{"id": "tiny"}]}')

            def log_message(self, format: str, *args: object) -> None:
                pass

        self.server, _ = serve_in_thread(Handler)
        self.port = self.server.server_address[1]

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def _engine(port: int) -> subprocess.Popen[bytes]:
    child = subprocess.Popen([sys.executable, "-c", ENGINE, str(port)], start_new_session=True)
    deadline = time.monotonic() + 10
    while not listeners(port):
        assert time.monotonic() < deadline and child.poll() is None, "the stand-in engine did not listen"
        time.sleep(0.05)
    return child


def _supervisor(port: int) -> launcher.Supervisor:
    config = parse_config({"model": {"path": "/m/tiny", "served_name": "tiny"},
                           "api": {"host": "127.0.0.1", "port": port}, "serve": {"probe_interval": 0.2}})
    return launcher.Supervisor(config, launcher.Launch(argv=[], env={}, plan_document={}), Notifier(None),
                               {"VLLM_API_KEY": "sk-never-to-a-squatter"})


def test_the_engines_own_listener_is_taken_and_answers_with_the_key() -> None:
    port = free_port()
    supervisor = _supervisor(port)
    supervisor.engine.child = _engine(port)
    try:
        assert foreign_listener(port, supervisor.engine.child.pid) is None
        with httpx.Client() as client:
            assert supervisor._wait_ready(client) is True
    finally:
        supervisor.engine.child.kill()
        supervisor.engine.child.wait()


def test_a_program_squatting_on_the_api_port_is_named_and_never_gets_the_key() -> None:
    squatter = Squatter()
    port = squatter.port
    supervisor = _supervisor(port)
    supervisor.engine.child = subprocess.Popen(["sleep", "60"], start_new_session=True)  # not listening yet
    try:
        with httpx.Client() as client, pytest.raises(EngineFailed) as failed:
            supervisor._wait_ready(client)
        assert failed.value.exit_code == 2  # the service manager does not restart into it again
        assert f"port {port} (api.port) is held by a socket of user " in str(failed.value)
        assert "no request with the key was sent there" in str(failed.value)
        assert squatter.authorizations == []
        assert supervisor.engine.child.wait(timeout=5) != 0  # the engine it started is stopped
    finally:
        squatter.close()
        if supervisor.engine.child.poll() is None:
            supervisor.engine.child.kill()
            supervisor.engine.child.wait()
