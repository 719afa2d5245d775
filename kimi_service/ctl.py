"""`kimi-service ctl {start,stop,restart,status}`: the three programs under whichever service manager runs
them: systemctl where systemd runs the host, supervisorctl (our supervisord.conf) elsewhere.

A start of kimi-vllm returns only once serve's /ready answers 200, or fails naming the engine's own first
error (serve writes it to `<state_dir>/last-failure`) and where the log is; `systemctl start` alone says
"see systemctl status", and `supervisorctl start` says "spawn error".
"""

from __future__ import annotations

import configparser
import re
import shutil
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path

import httpx

from kimi_service.config import Config
from kimi_service.errors import UsageError
from kimi_service.http_client import client_for

PROGRAMS = ("kimi-vllm", "kimi-exporter", "kimi-health")
ENGINE = "kimi-vllm"
DEFAULT_SUPERVISOR_CONF = Path("/etc/kimi-service/supervisord.conf")
SYSTEMD_MARKER = Path("/run/systemd/system")
EXIT_NOT_RUNNING = 3


@dataclass(frozen=True)
class ProgramStatus:
    name: str
    state: str
    pid: int | None
    uptime: float | None  # seconds
    running: bool

    def line(self) -> str:
        return (f"{self.name:<14} {self.state:<10} pid {self.pid or '-':<8} "
                f"uptime {_duration(self.uptime) if self.uptime is not None else '-'}")


def _duration(seconds: float) -> str:
    seconds = int(seconds)
    days, rest = divmod(seconds, 86400)
    text = f"{rest // 3600}:{rest % 3600 // 60:02d}:{rest % 60:02d}"
    return f"{days}d {text}" if days else text


def _run(argv: Sequence[str]) -> subprocess.CompletedProcess[str]:
    try:
        return subprocess.run(list(argv), capture_output=True, text=True, check=False, timeout=120)
    except FileNotFoundError:
        raise UsageError(f"{argv[0]}: not found; is the service manager installed?") from None


class Systemd:
    name = "systemd"

    @staticmethod
    def unit(program: str) -> str:
        # The periodic check is a timer under systemd (a loop, `health --every`, under supervisord).
        return f"{program}.timer" if program == "kimi-health" else f"{program}.service"

    def command(self, action: str, programs: Sequence[str]) -> list[str]:
        return ["systemctl", action, *(self.unit(p) for p in programs)]

    def status(self, programs: Sequence[str]) -> list[ProgramStatus]:
        now = time.clock_gettime(time.CLOCK_MONOTONIC)
        found = []
        for program in programs:
            shown = _run(["systemctl", "show", self.unit(program), "-p",
                          "ActiveState,SubState,MainPID,ActiveEnterTimestampMonotonic"]).stdout
            props = dict(line.split("=", 1) for line in shown.splitlines() if "=" in line)
            active = props.get("ActiveState", "unknown")
            entered = int(props.get("ActiveEnterTimestampMonotonic") or 0)
            pid = int(props.get("MainPID") or 0) or None
            found.append(ProgramStatus(program, f"{active}/{props.get('SubState', '?')}", pid,
                                       now - entered / 1e6 if active == "active" and entered else None,
                                       active == "active"))
        return found

    def log_hint(self, program: str) -> str:
        return f"journalctl -u {self.unit(program)}"


# supervisorctl status: "kimi-vllm   RUNNING   pid 123, uptime 1 day, 0:01:02" or "kimi-vllm  FATAL  Exited too quickly"
_SUPERVISOR_LINE = re.compile(r"^(?P<name>\S+)\s+(?P<state>[A-Z]+)\b\s*(?P<rest>.*)$")
_SUPERVISOR_UPTIME = re.compile(r"pid (?P<pid>\d+), uptime (?:(?P<days>\d+) days?, )?(?P<h>\d+):(?P<m>\d+):(?P<s>\d+)")


def parse_supervisor_status(text: str, programs: Sequence[str]) -> list[ProgramStatus]:
    by_name: dict[str, ProgramStatus] = {}
    for line in text.splitlines():
        match = _SUPERVISOR_LINE.match(line.strip())
        if not match or match["name"] not in programs:
            continue
        up = _SUPERVISOR_UPTIME.search(match["rest"])
        uptime = (int(up["days"] or 0) * 86400 + int(up["h"]) * 3600 + int(up["m"]) * 60 + int(up["s"])) if up else None
        by_name[match["name"]] = ProgramStatus(match["name"], match["state"], int(up["pid"]) if up else None,
                                               uptime, match["state"] == "RUNNING")
    return [by_name.get(p, ProgramStatus(p, "UNKNOWN", None, None, False)) for p in programs]


class Supervisord:
    name = "supervisord"

    def __init__(self, conf: Path):
        self.conf = conf
        # The runtime stage installs supervisor into the service's venv, beside this command.
        beside = Path(sys.executable).parent / "supervisorctl"
        self.supervisorctl = str(beside) if beside.exists() else (shutil.which("supervisorctl") or "supervisorctl")

    def command(self, action: str, programs: Sequence[str]) -> list[str]:
        return [self.supervisorctl, "-c", str(self.conf), action, *programs]

    def status(self, programs: Sequence[str]) -> list[ProgramStatus]:
        result = _run(self.command("status", programs))
        found = parse_supervisor_status(result.stdout, programs)
        if not any(s.state != "UNKNOWN" for s in found):
            print((result.stdout + result.stderr).strip(), file=sys.stderr)
        return found

    def log_hint(self, program: str) -> str:
        parser = configparser.RawConfigParser(strict=False)
        try:
            parser.read(self.conf)
            logfile = parser.get(f"program:{program}", "stdout_logfile", fallback="")
        except configparser.Error:
            logfile = ""
        return logfile or f"{self.supervisorctl} -c {self.conf} tail {program}"


def choose_manager(name: str, supervisor_conf: Path) -> Systemd | Supervisord:
    if name == "auto":
        name = "systemd" if SYSTEMD_MARKER.exists() else "supervisord"
    return Systemd() if name == "systemd" else Supervisord(supervisor_conf)


def ready_url(config: Config) -> str:
    """serve's /ready where configured, else vLLM's own /health."""
    if config.serve.ready_port:
        return replace(config.api, port=config.serve.ready_port).local_url + "/ready"
    return config.api.local_url + "/health"


class FailureWatch:
    """Whether serve wrote `<state_dir>/last-failure` since this was made (a new file, or a rewrite)."""

    def __init__(self, path: Path):
        self.path = path
        self.before = self._stamp()

    def _stamp(self) -> tuple[int, int] | None:
        try:
            stat = self.path.stat()
        except OSError:
            return None
        return (stat.st_ino, stat.st_mtime_ns)

    def fresh(self) -> str | None:
        stamp = self._stamp()
        if stamp is None or stamp == self.before:
            return None
        try:
            return self.path.read_text().strip() or None
        except OSError:
            return None


def wait_started(url: str, failures: FailureWatch, command: subprocess.Popen[str], wait: float) -> str | None:
    """Poll until `url` answers 200 (None), serve records a failure, the manager's command fails without
    one, or `wait` runs out (the reason, each)."""
    deadline = time.monotonic() + wait
    failed_at: float | None = None
    with client_for(url) as client:
        while True:
            try:
                if client.get(url, timeout=5).status_code == 200:
                    return None
            except httpx.HTTPError:
                pass
            if (line := failures.fresh()) is not None:
                return line
            if failed_at is None and command.poll() not in (None, 0):
                failed_at = time.monotonic()
            if failed_at is not None and time.monotonic() - failed_at > 5:
                out = (command.stdout.read() if command.stdout else "").strip()
                return f"{' '.join(command.args)} failed ({command.returncode}): {out or 'no output'}"
            if time.monotonic() >= deadline:
                return f"{url} did not answer 200 within {wait:.0f} s (--wait)"
            time.sleep(1)


def control(action: str, programs: Sequence[str], manager: Systemd | Supervisord, config: Config | None,
            wait: float | None) -> int:
    """Run `action` on `programs`; for start/restart of kimi-vllm, wait for /ready. Returns the exit code."""
    if action == "status":
        found = manager.status(programs)
        for status in found:
            print(status.line())
        return 0 if all(s.running for s in found) else EXIT_NOT_RUNNING
    argv = manager.command(action, programs)
    if action not in ("start", "restart") or ENGINE not in programs or config is None or wait == 0:
        result = _run(argv)
        print((result.stdout + result.stderr).strip() or f"{action}: {', '.join(programs)}")
        return 0 if result.returncode == 0 else 1
    failures = FailureWatch(config.paths.state_dir / "last-failure")
    command = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        reason = wait_started(ready_url(config), failures, command,
                              config.serve.startup_timeout if wait is None else wait)
    finally:
        if command.poll() is None:
            # The manager goes on starting without its client (supervisorctl waits out startsecs).
            command.terminate()
            command.wait()
    if reason is None:
        print(f"{ENGINE}: ready ({ready_url(config)} answers 200)")
        return 0
    print(f"{ENGINE}: {reason}")
    print(f"log: {manager.log_hint(ENGINE)}")
    return 1
