"""Input nobody here wrote: flags from tuned.json, forwarded addresses, proxies between the host and its own
engine, files that never end, JSON nested past the stack, numbers no one means, answers that trickle."""

from __future__ import annotations

import contextlib
import json
import os
import socket
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler
from pathlib import Path

import pytest

from kimi_service import engine_flags, health, launcher
from kimi_service.cli import main
from kimi_service.config import ConfigError, parse_config
from kimi_service.errors import UsageError
from kimi_service.http_client import PROXY_VARIABLES, client_for
from kimi_service.model import inspect_model
from kimi_service.route_gate import FORWARDED_ALLOW_IPS
from kimi_service.tuned import Workload, configuration_key, tuned_flags
from kimi_service.untrusted import UntrustedInput, read_bytes, read_json
from tests.support.local_http import serve_in_thread
from tests.unit.test_untrusted_responses import FakeEngine


def test_every_flag_judged_by_name_is_one_vllm_has_and_is_judged_once() -> None:
    tables = [engine_flags.RESERVED, engine_flags.REFUSED, engine_flags.ALLOWED]
    judged = [flag for table in tables for flag in table]
    assert len(judged) == len(set(judged))
    assert set(judged) <= engine_flags.vllm_flags()
    assert all(why for table in tables for why in table.values())


@pytest.mark.parametrize("flags", [["--host", "0.0.0.0"], ["--api-k=x"], ["--uds", "/run/x"], ["--middle", "m.M"],
                                   [7], ["--max-num", "8"]])
def test_tuned_json_is_held_to_the_rules_of_extra_args(tmp_path: Path, flags: list) -> None:
    (tmp_path / "model").mkdir()
    config = parse_config({"model": {"path": str(tmp_path / "model")}})
    plan = {"vllm_version": "0.21.0", "hardware": "H100:1"}
    traffic = Workload()
    tuned = {"key": configuration_key(config, traffic, **plan), "winner": "x", "flags": flags,
             "workload": json.loads(json.dumps({**traffic.__dict__, "slo": traffic.slo.__dict__}))}
    applied, why = tuned_flags(tuned, config, **plan)
    assert applied == [] and "not applied" in why


def test_forwarded_addresses_are_never_trusted_by_the_engine() -> None:
    with pytest.raises(ConfigError, match=f"extra_env.{FORWARDED_ALLOW_IPS}: set by kimi-service itself"):
        parse_config({"model": {"path": "/m"}, "plan": {"extra_env": {FORWARDED_ALLOW_IPS: "*"}}})
    config = parse_config({"model": {"path": "/m"}})
    env = launcher.engine_env({FORWARDED_ALLOW_IPS: "*", "PATH": "/bin"}, {}, [], config)
    assert FORWARDED_ALLOW_IPS not in env and env["PATH"] == "/bin"


class RecordingProxy:
    """An HTTP proxy that records every request line it receives and answers each with 502."""

    def __init__(self) -> None:
        self.seen: list[str] = []
        seen = self.seen

        class Handler(BaseHTTPRequestHandler):
            def _record(self) -> None:
                seen.append(f"{self.command} {self.path} {self.headers.get('Authorization')}")
                self.send_response(502)
                self.send_header("Content-Length", "0")
                self.end_headers()

            do_GET = do_POST = do_CONNECT = _record

            def log_message(self, format: str, *args: object) -> None:
                pass

        self.server, self.url = serve_in_thread(Handler)


@pytest.fixture()
def proxy(monkeypatch: pytest.MonkeyPatch) -> Iterator[RecordingProxy]:
    recording = RecordingProxy()
    for name in PROXY_VARIABLES:
        monkeypatch.setenv(name, recording.url)
    monkeypatch.delenv("NO_PROXY", raising=False)
    monkeypatch.delenv("no_proxy", raising=False)
    yield recording
    recording.server.shutdown()
    recording.server.server_close()


def test_probes_of_this_host_never_go_through_a_proxy(proxy: RecordingProxy, capsys) -> None:
    engine = FakeEngine()
    try:
        for url in (engine.url, engine.url.replace("127.0.0.1", "localhost")):
            checks = health.probe_endpoint(health.Target(url=url, served_name="kimi", api_key="sekret"))
            assert [c.status for c in checks] == ["ok", "ok", "ok"]
        assert main(["smoke", "--url", engine.url, "--model", "kimi"]) == 0
    finally:
        engine.server.shutdown()
        engine.server.server_close()
    assert proxy.seen == []
    # The proxy works: a URL elsewhere goes through it, as the operator's environment says.
    with client_for("http://engine.example:8000") as client:
        assert client.get("http://engine.example:8000/health").status_code == 502
    assert proxy.seen == ["GET http://engine.example:8000/health None"]


def test_a_socks_proxy_is_a_clear_message_not_an_import_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ALL_PROXY", "socks5://127.0.0.1:1080")
    with client_for("http://127.0.0.1:1"):
        pass  # this host's engine: the proxy is not used, so not needed
    with pytest.raises(UsageError, match=r"through the proxy the environment names .*socks"):
        client_for("http://engine.example:8000")


class Trickle:
    """A server that answers 200 and then sends its body one byte every 0.1 s, for a minute."""

    def __init__(self) -> None:
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.listener.getsockname()[1]}"
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        with contextlib.suppress(OSError):
            connection, _ = self.listener.accept()
            connection.recv(65536)
            connection.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: 600\r\n\r\n")
            for _ in range(600):
                connection.sendall(b"x")
                time.sleep(0.1)


def test_an_answer_trickling_a_byte_at_a_time_cannot_stretch_the_timeout() -> None:
    trickle = Trickle()
    started = time.monotonic()
    check = health.check_liveness(client_for(trickle.url), health.Target(url=trickle.url, served_name=None,
                                                                         timeout=1.0))
    assert check.status == health.DOWN and "unreachable" in check.message
    assert time.monotonic() - started < 3
    trickle.listener.close()


def test_files_that_never_end_or_never_open_are_refused_in_bounded_time(tmp_path: Path) -> None:
    with pytest.raises(UntrustedInput, match="larger than 1,024 bytes"):
        read_bytes("/dev/zero", limit=1024)
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    writer = os.open(fifo, os.O_RDWR)  # held open, never written: a read would wait forever
    try:
        started = time.monotonic()
        with pytest.raises(UntrustedInput, match=r"still not at its end after 0\.5 s"):
            read_bytes(fifo, limit=1024, timeout=0.5)
        assert time.monotonic() - started < 2
    finally:
        os.close(writer)
    with pytest.raises(OSError):
        read_bytes(tmp_path / ("x" * 300), limit=10)


@pytest.mark.parametrize(("text", "fragment"), [("[" * 100_000, "nested too deep"), ('{"a": NaN}', "NaN"),
                                                ('{"a": 1e400}', "beyond a float's range"),
                                                ('{"a": ' + "9" * 5000 + "}", "not valid JSON")])
def test_json_nobody_here_wrote_is_one_line_refusal(tmp_path: Path, text: str, fragment: str) -> None:
    path = tmp_path / "x.json"
    path.write_text(text)
    with pytest.raises(UntrustedInput, match=fragment):
        read_json(path)
    (tmp_path / "config.json").write_text(text)
    with pytest.raises(UsageError, match="cannot read"):
        inspect_model(str(tmp_path))


def test_a_home_directory_of_no_user_is_a_usage_error() -> None:
    with pytest.raises(UsageError, match="no such user's home directory"):
        inspect_model("~no-such-user-kimi/model")


@pytest.mark.parametrize("argv", [["plan", "--gpus", "H100:٨", "--model", "x"], ["plan", "--gpus", "٨xH100"],
                                  ["health", "--every", "nan"], ["health", "--wait", "inf"],
                                  ["health", "--wait", "-1"], ["health", "--every", "1e400"],
                                  ["plan", "--gpus", "H100:1", "--nodes", "٢"]])
def test_numbers_nobody_means_exit_2_with_one_line(argv: list[str], capsys) -> None:
    with pytest.raises(SystemExit) as exited:
        code = main(argv)
        raise SystemExit(code)
    err = capsys.readouterr().err
    assert exited.value.code == 2 and "Traceback" not in err and err.strip()
