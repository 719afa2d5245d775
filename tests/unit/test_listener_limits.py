"""The exporter's /metrics and serve's /ready: idle connections cannot exhaust them (each handler drops a
client silent past its idle timeout, only so many run at once, and a new connection hangs up on the
oldest rather than wait), and a busy port is bad input."""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from pathlib import Path

import httpx

from kimi_service import exporter
from kimi_service.cli import main
from kimi_service.http_limits import IDLE_TIMEOUT, MAX_HANDLERS
from kimi_service.launcher.status import Readiness, status_server
from tests.support.ports import free_port


def _wait_for(condition, seconds: float = 10) -> None:
    deadline = time.monotonic() + seconds
    while not condition():
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.05)


def test_exporter_on_a_busy_port_exits_2_naming_the_port(tmp_path: Path, capsys) -> None:
    config = tmp_path / "config.yaml"
    config.write_text(f"model:\n  path: {tmp_path}\npaths:\n  plan_file: {tmp_path / 'plan.json'}\n")
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        code = main(["exporter", "--config", str(config), "--host", "127.0.0.1", "--port", str(port)])
    err = capsys.readouterr().err
    assert code == 2 and f"cannot listen on 127.0.0.1:{port} (Address already in use)" in err
    assert "Traceback" not in err


def _flood(port: int, count: int) -> list[socket.socket]:
    """`count` connections that never send a byte."""
    return [socket.create_connection(("127.0.0.1", port)) for _ in range(count)]


def _handler_threads() -> int:
    return sum(1 for t in threading.enumerate() if t.name.startswith("Thread-"))


def _trickle(port: int, count: int) -> list[socket.socket]:
    """`count` connections that sent part of a request line and go on a byte at a time."""
    socks = _flood(port, count)
    for sock in socks:
        sock.sendall(b"GET /re")
    return socks


def _survives_idle_connections(url: str, port: int) -> None:
    """With the product's idle timeout: 150 silent and 20 trickling connections hold no more than
    MAX_HANDLERS threads, and the page still answers in well under the balancer's 5 s check timeout
    and a scrape's timeout, every time it is asked."""
    before = _handler_threads()
    idle = _flood(port, 150)
    trickling = _trickle(port, 20)
    try:
        time.sleep(0.3)
        assert _handler_threads() - before <= MAX_HANDLERS  # one per connection would be 170
        for _ in range(5):
            for sock in trickling:
                with contextlib.suppress(OSError):  # one the server hung up on
                    sock.sendall(b"a")
            started = time.monotonic()
            response = httpx.get(url, timeout=15)
            assert response.status_code in (200, 503)
            assert time.monotonic() - started < 1.5, "a page waited behind idle connections"
        idle[0].settimeout(10)
        assert idle[0].recv(1) == b""  # the server hung up on the longest-open client
    finally:
        for sock in idle + trickling:
            sock.close()
    _wait_for(lambda: _handler_threads() <= before, seconds=IDLE_TIMEOUT + 5)


def test_every_connection_gives_its_handler_slot_back() -> None:
    """Many more requests, one after another, than there are handler slots: each is answered at once (a
    slot kept by a finished connection would leave the page silent once they are all gone)."""
    port = free_port()
    server = status_server("127.0.0.1", port, "/ready", Readiness().document, "only /ready")
    try:
        with httpx.Client() as client:
            for _ in range(3 * MAX_HANDLERS):
                assert client.get(f"http://127.0.0.1:{port}/ready", timeout=2).status_code == 503
    finally:
        server.shutdown()
        server.server_close()


def test_ready_server_survives_idle_connections_with_bounded_threads() -> None:
    port = free_port()
    server = status_server("127.0.0.1", port, "/ready", Readiness().document, "only /ready")
    try:
        _survives_idle_connections(f"http://127.0.0.1:{port}/ready", port)
    finally:
        server.shutdown()
        server.server_close()


def test_metrics_server_survives_idle_connections_with_bounded_threads(tmp_path: Path) -> None:
    collector = exporter.KimiCollector(nvml_module=None, plan_file=tmp_path / "plan.json", poller=None, xids=False)
    port = free_port()
    server = exporter.metrics_server(exporter.build_registry(collector), "127.0.0.1", port)
    try:
        _survives_idle_connections(f"http://127.0.0.1:{port}/metrics", port)
    finally:
        server.shutdown()
        server.server_close()
