"""`kimi-service ctl` over stand-ins for systemctl and supervisorctl, `smoke` and `health --every`'s line
against a stand-in OpenAI server."""

from __future__ import annotations

import json
import os
import socket
import stat
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from kimi_service import cli, ctl
from kimi_service.health import DEGRADED, OK, Check, HealthReport
from kimi_service.launcher import status_server

SUPERVISOR_STATUS = """\
kimi-exporter                    RUNNING   pid 311, uptime 1 day, 2:03:04
kimi-health                      RUNNING   pid 312, uptime 0:00:09
kimi-vllm                        BACKOFF   Exited too quickly (process log may have details)
"""


def test_supervisorctl_status_lines_become_one_status_per_program() -> None:
    found = ctl.parse_supervisor_status(SUPERVISOR_STATUS, ["kimi-vllm", "kimi-exporter", "kimi-health"])
    assert [(s.name, s.state, s.pid, s.uptime, s.running) for s in found] == [
        ("kimi-vllm", "BACKOFF", None, None, False),
        ("kimi-exporter", "RUNNING", 311, 86400 + 7384, True),
        ("kimi-health", "RUNNING", 312, 9, True),
    ]
    assert found[1].line().split() == ["kimi-exporter", "RUNNING", "pid", "311", "uptime", "1d", "2:03:04"]
    missing = ctl.parse_supervisor_status("unix:///run/kimi-service/supervisor.sock no such file", ["kimi-vllm"])
    assert (missing[0].state, missing[0].running) == ("UNKNOWN", False)


class Stub:
    """A fake systemctl and supervisorctl on PATH that record their calls and print what they are given."""

    def __init__(self, directory: Path, monkeypatch: pytest.MonkeyPatch):
        self.calls = directory / "calls"
        for name in ("systemctl", "supervisorctl"):
            script = directory / name
            script.write_text(f'#!/bin/sh\necho "{name} $*" >> "{self.calls}"\n'
                              f'cat "{directory}/{name}.out" 2>/dev/null\n'
                              f'exit "$(cat "{directory}/{name}.rc" 2>/dev/null || echo 0)"\n')
            script.chmod(script.stat().st_mode | stat.S_IEXEC)
        self.directory = directory
        monkeypatch.setenv("PATH", f"{directory}:{os.environ['PATH']}")
        monkeypatch.setattr(ctl.sys, "executable", str(directory / "no-venv" / "python"))

    def answer(self, name: str, out: str, rc: int = 0) -> None:
        (self.directory / f"{name}.out").write_text(out)
        (self.directory / f"{name}.rc").write_text(str(rc))

    def called(self) -> list[str]:
        return self.calls.read_text().splitlines() if self.calls.exists() else []


@pytest.fixture
def stub(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Stub:
    return Stub(tmp_path, monkeypatch)


def test_status_under_supervisord_exits_3_unless_all_run(stub: Stub, tmp_path: Path, capsys) -> None:
    stub.answer("supervisorctl", SUPERVISOR_STATUS, rc=3)
    conf = tmp_path / "supervisord.conf"
    assert cli.main(["ctl", "status", "--manager", "supervisord", "--supervisor-conf", str(conf)]) == 3
    assert stub.called() == [f"supervisorctl -c {conf} status kimi-vllm kimi-exporter kimi-health"]
    lines = capsys.readouterr().out.splitlines()
    assert [line.split()[:2] for line in lines] == [["kimi-vllm", "BACKOFF"], ["kimi-exporter", "RUNNING"],
                                                    ["kimi-health", "RUNNING"]]
    stub.answer("supervisorctl", SUPERVISOR_STATUS.replace("BACKOFF   Exited too quickly (process log may have "
                                                           "details)", "RUNNING   pid 310, uptime 0:05:00"))
    assert cli.main(["ctl", "status", "--manager", "supervisord", "--supervisor-conf", str(conf)]) == 0


def test_status_under_systemd_names_the_health_timer(stub: Stub, capsys) -> None:
    stub.answer("systemctl", "ActiveState=active\nSubState=running\nMainPID=42\nActiveEnterTimestampMonotonic=1\n")
    assert cli.main(["ctl", "status", "kimi-vllm", "kimi-health", "--manager", "systemd"]) == 0
    assert [c.split()[2] for c in stub.called()] == ["kimi-vllm.service", "kimi-health.timer"]
    assert capsys.readouterr().out.split()[:4] == ["kimi-vllm", "active/running", "pid", "42"]


def test_unknown_programs_are_refused(stub: Stub, capsys) -> None:
    assert cli.main(["ctl", "stop", "vllm", "--manager", "systemd"]) == 2
    assert "unknown program vllm" in capsys.readouterr().err and stub.called() == []


class _Ready:
    """serve's /ready on a free port (served by serve's own status page): 503 until `ready` is set."""

    def __init__(self) -> None:
        self.ready = threading.Event()
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            self.port = probe.getsockname()[1]
        self.server = status_server("127.0.0.1", self.port, "/ready",
                                    lambda: (200 if self.ready.is_set() else 503, {}), "only /ready")


@pytest.fixture
def ready() -> Iterator[_Ready]:
    server = _Ready()
    yield server
    server.server.shutdown()
    server.server.server_close()


def _config(tmp_path: Path, ready_port: int) -> Path:
    path = tmp_path / "config.yaml"
    path.write_text(f"model:\n  path: /m/tiny\napi:\n  host: 127.0.0.1\n  port: 1\n"
                    f"paths:\n  state_dir: {tmp_path}/state\n  tmp_dir: /tmp/kimi\n"
                    f"serve:\n  ready_port: {ready_port}\n")
    (tmp_path / "state").mkdir(exist_ok=True)
    return path


def test_restart_returns_once_ready_answers(stub: Stub, ready: _Ready, tmp_path: Path, capsys) -> None:
    threading.Timer(1.0, ready.ready.set).start()
    config = _config(tmp_path, ready.port)
    code = cli.main(["ctl", "restart", "kimi-vllm", "--manager", "systemd", "--config", str(config), "--wait", "20"])
    assert code == 0
    assert stub.called() == ["systemctl restart kimi-vllm.service"]
    assert "kimi-vllm: ready" in capsys.readouterr().out


def test_a_failed_start_prints_the_engine_root_cause_and_the_log(stub: Stub, ready: _Ready, tmp_path: Path,
                                                                 capsys) -> None:
    config = _config(tmp_path, ready.port)
    failure = tmp_path / "state" / "last-failure"
    failure.write_text("vLLM failed to start: an old failure, before this start\n")
    conf = tmp_path / "supervisord.conf"
    conf.write_text("[program:kimi-vllm]\ncommand=/opt/kimi-service/venv/bin/kimi-service serve\n"
                    "stdout_logfile=/var/lib/kimi-service/logs/kimi-vllm.log\n")
    cause = "vLLM failed to start: torch._inductor.exc.InvalidCxxCompiler: No working C++ compiler found"

    def fail() -> None:
        (tmp_path / "state" / "new").write_text(cause + "\n")
        (tmp_path / "state" / "new").replace(failure)

    threading.Timer(1.5, fail).start()
    code = cli.main(["ctl", "start", "--manager", "supervisord", "--supervisor-conf", str(conf),
                     "--config", str(config), "--wait", "20"])
    assert code == 1
    assert stub.called() == [f"supervisorctl -c {conf} start kimi-vllm kimi-exporter kimi-health"]
    assert capsys.readouterr().out.splitlines() == [f"kimi-vllm: {cause}",
                                                    "log: /var/lib/kimi-service/logs/kimi-vllm.log"]


def test_a_manager_command_that_fails_without_a_recorded_cause_is_reported(stub: Stub, ready: _Ready, tmp_path: Path,
                                                                           capsys) -> None:
    stub.answer("systemctl", "Unit kimi-vllm.service not found.", rc=5)
    config = _config(tmp_path, ready.port)
    code = cli.main(["ctl", "start", "kimi-vllm", "--manager", "systemd", "--config", str(config), "--wait", "30"])
    out = capsys.readouterr().out
    assert code == 1
    assert "systemctl start kimi-vllm.service failed (5): Unit kimi-vllm.service not found." in out
    assert "log: journalctl -u kimi-vllm.service" in out


def test_stop_runs_the_manager_and_passes_its_status_on(stub: Stub) -> None:
    assert cli.main(["ctl", "stop", "kimi-exporter", "--manager", "systemd"]) == 0
    stub.answer("systemctl", "Failed to stop", rc=1)
    assert cli.main(["ctl", "stop", "--manager", "systemd"]) == 1
    assert stub.called()[-1] == "systemctl stop kimi-vllm.service kimi-exporter.service kimi-health.timer"


# --- smoke and health --every's line ----------------------------------------------------------------


class _OpenAI:
    """A stand-in chat completions endpoint that wants key `sk-right`."""

    def __init__(self) -> None:
        class Handler(BaseHTTPRequestHandler):
            def _send(self, code: int, body: dict) -> None:
                data = json.dumps(body).encode()
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_GET(self) -> None:
                self._send(200, {"data": [{"id": "kimi-tiny"}]})

            def do_POST(self) -> None:
                self.rfile.read(int(self.headers["Content-Length"]))
                if self.headers.get("Authorization") != "Bearer sk-right":
                    self._send(401, {"error": "Unauthorized"})
                    return
                self._send(200, {"choices": [{"message": {"content": "OK, hello"}}],
                                 "usage": {"completion_tokens": 3}})

            def log_message(self, format: str, *args: object) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()


@pytest.fixture
def openai_stub() -> Iterator[_OpenAI]:
    server = _OpenAI()
    yield server
    server.server.shutdown()
    server.server.server_close()


def test_smoke_reads_the_key_from_the_env_file(openai_stub: _OpenAI, tmp_path: Path, monkeypatch, capsys) -> None:
    monkeypatch.delenv("VLLM_API_KEY", raising=False)
    secrets = tmp_path / "secrets.env"
    secrets.write_text('VLLM_API_KEY="sk-right"\n')
    assert cli.main(["smoke", "--url", openai_stub.url, "--env-file", str(secrets), "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert (result["ok"], result["model"], result["reply"], result["completion_tokens"]) == (True, "kimi-tiny",
                                                                                             "OK, hello", 3)
    assert result["latency_s"] >= 0 and result["error"] is None
    secrets.write_text('VLLM_API_KEY="sk-wrong"\n')
    assert cli.main(["smoke", "--url", openai_stub.url, "--env-file", str(secrets), "--model", "kimi-tiny"]) == 1
    assert capsys.readouterr().out.startswith("smoke failed: chat completion answered 401")


def test_smoke_against_nothing_fails_with_exit_1(tmp_path: Path, capsys) -> None:
    assert cli.main(["smoke", "--url", "http://127.0.0.1:9", "--json", "--timeout", "2"]) == 1
    assert json.loads(capsys.readouterr().out)["ok"] is False


def test_health_every_writes_one_line_per_result() -> None:
    report = HealthReport((Check("liveness", OK, 200, "/health answered 200"),
                           Check("readiness", DEGRADED, 401, "/v1/models answered 401: set VLLM_API_KEY")))
    assert report.to_line() == ("health degraded: liveness=ok readiness=degraded; "
                                "readiness: /v1/models answered 401: set VLLM_API_KEY")
    assert "\n" not in report.to_line()


def test_health_every_must_be_positive(capsys) -> None:
    assert cli.main(["health", "--url", "http://127.0.0.1:9", "--every", "0"]) == 2
    assert "--every 0.0: give a number of seconds > 0" in capsys.readouterr().err


def test_health_on_the_host_reads_the_key_from_secrets_env_beside_the_config(openai_stub: _OpenAI, tmp_path: Path,
                                                                             monkeypatch, capsys) -> None:
    # As root on a deployed host: `kimi-service health` with the default --config and no --env-file.
    monkeypatch.delenv("VLLM_API_KEY", raising=False)
    config = tmp_path / "config.yaml"
    config.write_text(json.dumps({"model": {"path": str(tmp_path), "served_name": "kimi-tiny"}}))
    check = ["health", "--config", str(config), "--url", openai_stub.url, "--no-gpu", "--json"]
    assert cli.main(check) != 0
    smoke = {c["name"]: c for c in json.loads(capsys.readouterr().out)["checks"]}["smoke"]
    assert "401" in smoke["message"], smoke
    secrets = tmp_path / "secrets.env"
    secrets.write_text('VLLM_API_KEY="sk-right"\n')
    assert cli.main(check) == 0, capsys.readouterr().out
