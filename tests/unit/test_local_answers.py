"""Answers from the host's own engine are untrusted input too: serve's and health's client reads at most
MAX_LOCAL_ANSWER bytes, asks for an unencoded body and refuses an encoded one (a compression bomb), so a
malformed engine or a program on its port costs an error line, not serve's memory."""

from __future__ import annotations

import gzip
from http.server import BaseHTTPRequestHandler
from typing import ClassVar

import pytest

from kimi_service import health
from kimi_service.http_client import MAX_LOCAL_ANSWER, AnswerRefused, client_for
from kimi_service.launcher.engine import EngineApi
from tests.support.local_http import serve_in_thread

# 64 MiB of zeros compress to about 64 KiB.
BOMB = gzip.compress(b"\0" * (64 << 20), compresslevel=9)


class Engine(BaseHTTPRequestHandler):
    """`/huge/...` answers more than the bound; `/bomb/...` a gzip body it was not asked for; anything
    else a well-formed /v1/models answer."""

    asked_encodings: ClassVar[list[str]] = []

    def do_GET(self) -> None:
        Engine.asked_encodings.append(self.headers.get("Accept-Encoding", ""))
        if self.path.startswith("/huge"):
            body, extra = b'{"data": [' + b" " * (MAX_LOCAL_ANSWER + 1) + b"]}", {}
        elif self.path.startswith("/bomb"):
            body, extra = BOMB, {"Content-Encoding": "gzip"}
        else:
            body, extra = b'{"data": [{"id": "tiny"}]}', {}
        self.send_response(200)
        for name, value in {**extra, "Content-Length": str(len(body))}.items():
            self.send_header(name, value)
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args: object) -> None:
        pass


@pytest.fixture
def engine():
    server, url = serve_in_thread(Engine)
    yield url
    server.shutdown()
    server.server_close()


def test_a_well_formed_answer_is_read_and_asked_for_unencoded(engine: str) -> None:
    with client_for(engine) as client:
        assert EngineApi(engine, {}, 5.0).lists(client, "tiny") is True
    assert Engine.asked_encodings[-1] == "identity"


@pytest.mark.parametrize("kind", ["huge", "bomb"])
def test_an_answer_too_large_or_encoded_is_an_error_not_a_memory_spike(engine: str, kind: str) -> None:
    with client_for(engine) as client:
        with pytest.raises(AnswerRefused, match=r"more than|encoded body"):
            client.get(f"{engine}/{kind}/v1/models").read()
        assert EngineApi(f"{engine}/{kind}", {}, 5.0).lists(client, "tiny") is False  # not listed, no crash
        target = health.Target(url=f"{engine}/{kind}", served_name="tiny", api_key="", timeout=5.0)
        check = health.check_readiness(client, target)
    assert check.status == health.DOWN and "/v1/models unreachable" in check.message, check

