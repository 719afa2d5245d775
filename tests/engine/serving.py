"""Run `kimi-service serve` on the real vLLM CPU server and watch what it tells systemd."""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import pytest
import yaml

from tests.support.engine import REPO_ROOT
from tests.support.ports import free_port
from tests.support.tiny_model import SERVED_NAME

READY_TIMEOUT = 240.0
# systemd's WatchdogSec=4 -> serve pings every 2 s at most, every probe (1 s) while healthy.
WATCHDOG_USEC = 4_000_000
# Shorter than the SIGTERM test's requests (about 7 s of work), so that serve's drain has them to wait for.
WITHDRAW_DELAY = 3


class NotifyRecorder:
    """Stands where systemd's notify socket would be and records each datagram with its time."""

    def __init__(self, path: Path):
        self.path = path
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.sock.bind(str(path))
        self.sock.settimeout(0.2)
        self.messages: list[tuple[float, dict[str, str]]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                data = self.sock.recv(4096)
            except TimeoutError:
                continue
            fields = dict(line.split("=", 1) for line in data.decode().splitlines())
            self.messages.append((time.monotonic(), fields))

    def times(self, key: str, value: str | None = None) -> list[float]:
        return [t for t, f in list(self.messages) if key in f and (value is None or f[key] == value)]

    def statuses(self) -> list[str]:
        return [f["STATUS"] for _, f in list(self.messages) if "STATUS" in f]

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=2)
        self.sock.close()


@dataclass
class Served:
    """A running `kimi-service serve` with what the tests need to poke at it."""

    process: subprocess.Popen[bytes]
    notify: NotifyRecorder
    config_path: Path
    url: str
    api_key: str
    log_path: Path
    plan_file: Path
    engine_venv: Path
    state_dir: Path
    first_health_200: list[float] = field(default_factory=list)
    engine_group: int | None = None
    systemd: bool = True  # started as the systemd unit runs it (notify socket, watchdog), else as supervisord does

    def engine_pid(self) -> int:
        """The vLLM API server: serve's child that runs vLLM (the other is the guard that kills the engine's
        group when serve dies)."""
        children = Path(f"/proc/{self.process.pid}/task/{self.process.pid}/children").read_text().split()
        engines = [int(pid) for pid in children if b"\0-m\0vllm." in Path(f"/proc/{pid}/cmdline").read_bytes()]
        assert len(engines) == 1, children
        return engines[0]

    @property
    def ready_url(self) -> str:
        port = yaml.safe_load(self.config_path.read_text())["serve"]["ready_port"]
        return f"http://127.0.0.1:{port}/ready"

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def kimi(self, *args: str, timeout: float = 120, **env: str) -> subprocess.CompletedProcess[str]:
        """Run this checkout's kimi-service from the engine venv, the way the units do."""
        return subprocess.run([str(self.engine_venv / "bin" / "kimi-service"), *args], capture_output=True,
                              text=True, timeout=timeout, env={**os.environ, "PYTHONPATH": str(REPO_ROOT), **env},
                              check=False)

    def stream_to_file(self, body: dict, out: Path) -> subprocess.Popen[bytes]:
        """Start a streamed chat completion whose chunks tests/engine/stream_client.py writes to `out`."""
        argv = [sys.executable, "-m", "tests.engine.stream_client", f"{self.url}/v1/chat/completions", str(out)]
        client = subprocess.Popen(argv, stdin=subprocess.PIPE, cwd=REPO_ROOT,
                                  env={**os.environ, "KIMI_TEST_API_KEY": self.api_key})
        assert client.stdin is not None
        client.stdin.write(json.dumps(body).encode())
        client.stdin.close()
        return client

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout=90)
            except subprocess.TimeoutExpired:
                os.killpg(self.process.pid, signal.SIGKILL)
                self.process.wait()
        if self.engine_group is not None:
            # serve runs vLLM in a process group of its own; nothing of it may outlive the test.
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.engine_group, signal.SIGKILL)
        self.notify.close()
        shutil.rmtree(self.state_dir, ignore_errors=True)


def write_config(directory: Path, model: Path, port: int, state_dir: Path, **overrides: dict) -> Path:
    data = {
        "model": {"path": str(model), "served_name": SERVED_NAME},
        "api": {"host": "127.0.0.1", "port": port},
        # A 256 MiB KV cache and eager mode keep memory ~2 GB and the start near 40 s.
        "plan": {"engine": "cpu", "extra_args": ["--enforce-eager", "--kv-cache-memory-bytes", "256M"]},
        "paths": {"state_dir": str(state_dir), "plan_file": str(directory / "run" / "plan.json")},
        # /ready for load balancers; a stop keeps serving WITHDRAW_DELAY s after /ready turns 503.
        "serve": {"probe_interval": 1, "drain_timeout": 20, "stop_timeout": 20, "ready_port": free_port(),
                  "withdraw_delay": WITHDRAW_DELAY},
        "health": {"timeout": 20},
        "exporter": {"host": "127.0.0.1", "port": free_port(), "health_interval": 2},
    }
    for section, values in overrides.items():
        data[section] = {**data.get(section, {}), **values}
    path = directory / "config.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


def start_serve(directory: Path, engine_venv: Path, model: Path, *, command: list[str] | None = None,
                systemd: bool = True, state_dir: Path | None = None, user: str | None = None,
                **overrides: dict) -> Served:
    """serve as the unit runs it (systemd's notify socket and watchdog, the key in the environment), or,
    with `systemd=False`, as supervisord does: neither, and `command` (the argv before `serve`'s options,
    default this venv's kimi-service) carries --env-file/--user."""
    directory.mkdir(parents=True, exist_ok=True)
    port = free_port()
    # vLLM's IPC sockets live in TMPDIR, whose path must stay short (pytest's tmp paths are too long).
    state_dir = state_dir or Path(tempfile.mkdtemp(prefix="kimi-engine-", dir="/tmp"))
    config_path = write_config(directory, model, port, state_dir, **overrides)
    plan_file = Path(yaml.safe_load(config_path.read_text())["paths"]["plan_file"])
    notify = NotifyRecorder(directory / "notify.sock")
    api_key = "sk-test-" + secrets.token_hex(16)
    # This checkout's package, whichever checkout the shared engine venv was last installed from.
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT)}
    if systemd:
        env.update({"NOTIFY_SOCKET": str(notify.path), "WATCHDOG_USEC": str(WATCHDOG_USEC), "VLLM_API_KEY": api_key})
    else:
        for name in ("NOTIFY_SOCKET", "WATCHDOG_USEC", "VLLM_API_KEY"):
            env.pop(name, None)
    log_path = directory / "serve.log"
    argv = [*(command or [str(engine_venv / "bin" / "kimi-service")]), "serve", "--config", str(config_path)]
    if not systemd:
        secrets_file = directory / "secrets.env"
        secrets_file.write_text(f'# managed\nVLLM_API_KEY="{api_key}"\n')
        secrets_file.chmod(0o600)
        argv += ["--env-file", str(secrets_file)]
    if user:
        argv += ["--user", user]
    with log_path.open("wb") as log:
        process = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    served = Served(process, notify, config_path, f"http://127.0.0.1:{port}", api_key, log_path,
                    plan_file, engine_venv, state_dir, systemd=systemd)
    _watch_first_health(served)
    return served


def _watch_first_health(served: Served) -> None:
    """Record, independently of serve, when /health first answers 200 (polled every 50 ms)."""

    def poll() -> None:
        deadline = time.monotonic() + READY_TIMEOUT
        with httpx.Client() as client:
            while time.monotonic() < deadline and served.process.poll() is None:
                try:
                    if client.get(f"{served.url}/health", timeout=1).status_code == 200:
                        served.first_health_200.append(time.monotonic())
                        return
                except httpx.HTTPError:
                    pass
                time.sleep(0.05)

    threading.Thread(target=poll, daemon=True).start()


def wait_ready(served: Served) -> None:
    deadline = time.monotonic() + READY_TIMEOUT
    while served.engine_group is None and served.process.poll() is None:
        with contextlib.suppress(OSError, AssertionError):
            served.engine_group = served.engine_pid()
        time.sleep(0.1)
    while not served.notify.times("READY", "1") and not _ready_page_says_ready(served):
        if served.process.poll() is not None:
            pytest.fail(f"serve exited {served.process.returncode} before READY:\n{served.log()[-6000:]}")
        if time.monotonic() > deadline:
            served.stop()
            pytest.fail(f"no READY=1 within {READY_TIMEOUT} s:\n{served.log()[-6000:]}")
        time.sleep(0.2)


def _ready_page_says_ready(served: Served) -> bool:
    """Without systemd (no notify socket), READY is what serve's /ready says."""
    if served.systemd:
        return False
    try:
        return httpx.get(served.ready_url, timeout=2).status_code == 200
    except httpx.HTTPError:
        return False
