"""What the health checks and the exporter do when the endpoint answers 200 with something that is not
the OpenAI API: report it (degraded, with the body's start), never crash or keep the last good result."""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler

import pytest

from kimi_service import exporter, health
from kimi_service.cli import main
from tests.support.local_http import serve_in_thread

GOOD = {"/health": (200, b""), "/v1/models": (200, json.dumps({"data": [{"id": "kimi"}]}).encode()),
        "/v1/chat/completions": (200, json.dumps({"choices": [{"message": {"content": "OK"}}]}).encode())}


class FakeEngine:
    """A real HTTP server on 127.0.0.1 answering each path with the (status, body) in `routes`."""

    def __init__(self) -> None:
        self.routes = dict(GOOD)
        routes = self.routes

        class Handler(BaseHTTPRequestHandler):
            def _answer(self) -> None:
                status, body = routes.get(self.path, (404, b""))
                self.send_response(status)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            do_GET = do_POST = _answer

            def log_message(self, format: str, *args: object) -> None:
                pass

        self.server, self.url = serve_in_thread(Handler)


@pytest.fixture()
def engine() -> Iterator[FakeEngine]:
    fake = FakeEngine()
    yield fake
    fake.server.shutdown()
    fake.server.server_close()


GARBAGE = [b"<html>502 Bad Gateway</html>", b"[]", b'{"data": 5}', b'{"data": [1, 2]}', b'{"data": []}',
           b"\xff\xfe\x00", b"", b'"data"', b"null"]


@pytest.mark.parametrize("body", GARBAGE)
def test_health_reports_a_garbage_model_list_as_degraded_with_a_reason(engine, capsys, body: bytes) -> None:
    engine.routes["/v1/models"] = (200, body)
    code = main(["health", "--url", engine.url, "--model", "kimi", "--no-gpu", "--json"])
    out, err = capsys.readouterr()
    assert (code, err) == (1, "")
    readiness = next(c for c in json.loads(out)["checks"] if c["name"] == "readiness")
    assert readiness["status"] == "degraded"
    assert "not with an OpenAI model list" in readiness["message"] or "lists no model" in readiness["message"]


@pytest.mark.parametrize("body", GARBAGE)
def test_health_reports_a_garbage_completion_as_degraded(engine, body: bytes) -> None:
    engine.routes["/v1/chat/completions"] = (200, body)
    checks = {c.name: c for c in health.probe_endpoint(health.Target(url=engine.url, served_name="kimi"))}
    assert checks["readiness"].status == health.OK
    assert checks["smoke"].status == health.DEGRADED and "chat completion answered 200" in checks["smoke"].message


def test_health_without_a_served_name_and_an_empty_model_list_is_degraded(engine) -> None:
    engine.routes["/v1/models"] = (200, b'{"data": []}')
    checks = health.probe_endpoint(health.Target(url=engine.url, served_name=None))
    assert [(c.name, c.status) for c in checks] == [("liveness", "ok"), ("readiness", "degraded")]


def _wait_for(condition: Callable[[], bool], seconds: float = 10) -> None:
    deadline = time.monotonic() + seconds
    while not condition():
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.05)


def test_exporter_drops_the_last_good_status_when_the_endpoint_turns_to_garbage(engine) -> None:
    poller = exporter.HealthPoller(health.Target(url=engine.url, served_name="kimi"), interval=0.05)
    poller.start()
    try:
        def readiness() -> str:
            return next((c.status for c in poller.checks() if c.name == "readiness"), "")

        _wait_for(lambda: readiness() == health.OK)
        engine.routes["/v1/models"] = (200, b"<html>maintenance</html>")
        _wait_for(lambda: readiness() == health.DEGRADED)
    finally:
        poller.stop()


def test_exporter_reports_a_probe_that_fails_outright_as_down(engine) -> None:
    # A key no HTTP header can carry fails the probe itself, after /health answered.
    target = health.Target(url=engine.url, served_name="kimi", api_key="sk-clé")
    poller = exporter.HealthPoller(target, interval=0.05)
    poller.start()
    try:
        _wait_for(lambda: bool(poller.checks()))
        (check,) = poller.checks()
        assert (check.name, check.status) == ("readiness", health.DOWN) and "health probe failed" in check.message
        assert "sk-cl" not in check.message
    finally:
        poller.stop()


def test_health_with_a_key_no_header_can_carry_exits_2_without_showing_it(engine, tmp_path, capsys) -> None:
    secrets = tmp_path / "secrets.env"
    secrets.write_text('VLLM_API_KEY="sk-clé"\n')
    code = main(["health", "--url", engine.url, "--no-gpu", "--env-file", str(secrets)])
    err = capsys.readouterr().err
    assert code == 2 and "cannot carry" in err and "sk-cl" not in err and err.count("\n") == 1
