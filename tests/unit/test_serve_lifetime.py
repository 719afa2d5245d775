"""serve on hosts without systemd: the engine dies with serve, a leftover engine group is killed, one serve per
state directory, a failed start names its cause, serve's own watchdog, --env-file and --user."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest

from kimi_service import launcher
from kimi_service.config import ConfigError, parse_config
from kimi_service.errors import EngineFailed, UsageError
from kimi_service.launcher.output import CauseFinder, root_cause
from kimi_service.launcher.process import EngineGroupRecord, group_members
from kimi_service.sdnotify import Notifier


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def _wait(predicate, seconds: float = 5.0) -> bool:
    deadline = time.monotonic() + seconds
    while not predicate():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


# --- config and pace -------------------------------------------------------------------------------


def test_watchdog_sec_defaults_to_off_and_must_be_a_whole_number_of_seconds() -> None:
    assert parse_config({"model": {"path": "/m"}}).serve.watchdog_sec == 0
    assert parse_config({"model": {"path": "/m"}, "serve": {"watchdog_sec": 60}}).serve.watchdog_sec == 60
    with pytest.raises(ConfigError, match=r"serve\.watchdog_sec: -1 is out of range"):
        parse_config({"model": {"path": "/m"}, "serve": {"watchdog_sec": -1}})
    with pytest.raises(ConfigError, match=r"serve\.watchdog_sec: expected an integer"):
        parse_config({"model": {"path": "/m"}, "serve": {"watchdog_sec": "60"}})


def test_own_watchdog_only_where_systemd_arms_none_and_probes_often_enough() -> None:
    own = launcher.Pace.of(5.0, None, 6)
    assert (own.own_watchdog, own.interval) == (6.0, 3.0)
    systemd = launcher.Pace.of(5.0, 2.0, 6)
    assert (systemd.own_watchdog, systemd.watchdog, systemd.interval) == (None, 2.0, 2.0)
    assert launcher.Pace.of(5.0, None, 0).own_watchdog is None


# --- the cause of a failed start --------------------------------------------------------------------

INDUCTOR_FAILURE = """\
INFO 12-04 16:10:01 [api_server.py:1900] vLLM API server version 0.32.0
(EngineCore_DP0 pid=4242) ERROR 12-04 16:10:30 [core.py:708] EngineCore failed to start.
(EngineCore_DP0 pid=4242) Traceback (most recent call last):
(EngineCore_DP0 pid=4242)   File "/opt/venv/lib/python3.11/site-packages/vllm/v1/engine/core.py", line 699, in run
(EngineCore_DP0 pid=4242)     engine_core = EngineCoreProc(*args, **kwargs)
(EngineCore_DP0 pid=4242)                   ^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^
(EngineCore_DP0 pid=4242) torch._inductor.exc.InvalidCxxCompiler: No working C++ compiler found in \
torch._inductor.config.cpp.cxx: (None, 'g++')
(EngineCore_DP0 pid=4242)
(EngineCore_DP0 pid=4242) The above exception was the direct cause of the following exception:
(EngineCore_DP0 pid=4242)
(EngineCore_DP0 pid=4242) Traceback (most recent call last):
(EngineCore_DP0 pid=4242)   File "/opt/venv/lib/python3.11/site-packages/vllm/v1/engine/core.py", line 712, in run
(EngineCore_DP0 pid=4242) RuntimeError: Engine core initialization failed. See root cause above.
ERROR 12-04 16:10:31 [api_server.py:2000] API server exited
"""


def test_the_first_exception_line_is_the_cause_even_behind_vllms_process_prefix() -> None:
    assert root_cause(INDUCTOR_FAILURE.splitlines()) == (
        "torch._inductor.exc.InvalidCxxCompiler: No working C++ compiler found in "
        "torch._inductor.config.cpp.cxx: (None, 'g++')")


def test_an_argument_error_then_an_error_line_then_the_last_line() -> None:
    refused = ["usage: api_server.py [-h] [--model MODEL]", "                     [--port PORT]",
               "api_server.py: error: unrecognized arguments: --no-such-flag"]
    assert root_cause(refused) == "api_server.py: error: unrecognized arguments: --no-such-flag"
    assert root_cause(["INFO starting", "ERROR 12-04 [x.py:1] out of memory", "INFO bye"]) == (
        "ERROR 12-04 [x.py:1] out of memory")
    assert root_cause(["INFO starting", "INFO still starting"]) == "INFO still starting"
    assert root_cause([]) is None


def test_stdout_and_stderr_interleaved_keep_their_own_tracebacks() -> None:
    finder = CauseFinder()
    finder.feed("Traceback (most recent call last):\n", "stderr")
    finder.feed("INFO a log line on stdout meanwhile\n", "stdout")
    finder.feed('  File "x.py", line 1, in <module>\n', "stderr")
    finder.feed("ValueError: max_model_len 9999 is larger than the model's 2048\n", "stderr")
    assert finder.cause() == "ValueError: max_model_len 9999 is larger than the model's 2048"


def _engine(argv: list[str], record: EngineGroupRecord | None = None) -> launcher.EngineProcess:
    return launcher.EngineProcess(launcher.Launch(argv=argv, env=dict(os.environ), plan_document={}), Notifier(None),
                                  threading.Event(), stop_budget=5, record=record)


def test_an_engine_that_exits_before_ready_fails_with_its_first_exception_line(capfd) -> None:
    script = textwrap.dedent("""
        import sys
        print("INFO loading", flush=True)
        try:
            raise OSError("libcuda.so.1: cannot open shared object file")
        except OSError as exc:
            raise RuntimeError("Engine core initialization failed") from exc
    """)
    engine = _engine([sys.executable, "-c", script])
    engine.spawn()
    assert engine.child is not None
    engine.child.wait(timeout=30)
    with pytest.raises(EngineFailed) as failed:
        engine.check()
    assert str(failed.value) == "vLLM failed to start: OSError: libcuda.so.1: cannot open shared object file"
    assert failed.value.exit_code == 1
    out, err = capfd.readouterr()
    assert "INFO loading" in out and "RuntimeError: Engine core initialization failed" in err  # passed through


def test_an_engine_that_dies_after_ready_is_reported_as_before() -> None:
    engine = _engine([sys.executable, "-c", "import os, signal; os.kill(os.getpid(), signal.SIGKILL)"])
    engine.ready = True
    engine.spawn()
    assert engine.child is not None
    engine.child.wait(timeout=30)
    with pytest.raises(EngineFailed, match=r"^vLLM killed by signal SIGKILL$") as failed:
        engine.check()
    assert failed.value.exit_code == 128 + signal.SIGKILL


# --- the engine never outlives serve ----------------------------------------------------------------


def test_the_engine_dies_when_serve_is_killed(tmp_path: Path) -> None:
    """A stand-in serve spawns its engine the way serve does, then gets SIGKILL. The engine has a child of its
    own, as vLLM's engine core is: the death signal does not reach it, the guard kills it."""
    script = textwrap.dedent(f"""
        import os, sys, threading, time
        from pathlib import Path
        from kimi_service import launcher
        from kimi_service.launcher.process import EngineGroupRecord
        from kimi_service.sdnotify import Notifier
        record = EngineGroupRecord(Path({str(tmp_path / "engine.pgid")!r}))
        argv = ["sh", "-c", "sleep 600 & wait"]
        engine = launcher.EngineProcess(launcher.Launch(argv, dict(os.environ), {{}}), Notifier(None),
                                        threading.Event(), 5, record)
        engine.spawn()
        print(engine.child.pid, flush=True)
        time.sleep(600)
    """)
    serve = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    assert serve.stdout is not None
    engine = int(serve.stdout.readline())
    assert _wait(lambda: len(group_members(engine)) == 2)
    worker = next(m.pid for m in group_members(engine) if m.pid != engine)
    serve.kill()
    serve.wait()
    assert _wait(lambda: not _alive(engine)), "the engine outlived a serve killed with SIGKILL"
    assert _wait(lambda: not _alive(worker)), "the engine's child outlived a serve killed with SIGKILL"
    assert f'"pgid": {engine}' in (tmp_path / "engine.pgid").read_text()


def _leftover(*argv: str) -> subprocess.Popen[bytes]:
    """A process group as a dead serve leaves it: running its program, command line and all. Popen returns
    as the child execs, a moment before the kernel shows the new command line (/proc/PID/cmdline reads
    empty until then): wait for it, as a leftover found at the next start has long had it."""
    child = subprocess.Popen(list(argv), start_new_session=True)
    cmdline = Path(f"/proc/{child.pid}/cmdline")
    deadline = time.monotonic() + 10
    while not cmdline.read_bytes() and time.monotonic() < deadline:
        time.sleep(0.01)
    return child


def test_a_leftover_engine_group_is_killed_at_the_next_start(tmp_path: Path) -> None:
    leftover = _leftover(sys.executable, "-c", "import time; time.sleep(600)", "vllm.entrypoints.openai.api_server")
    record = EngineGroupRecord(tmp_path / "run" / "engine.pgid")
    record.write(leftover.pid)
    try:
        assert [m.pid for m in group_members(leftover.pid)] == [leftover.pid]
        assert record.kill_leftover() == 1
        assert leftover.wait(timeout=5) == -signal.SIGKILL
        assert not record.path.exists()
    finally:
        if leftover.poll() is None:
            leftover.kill()
            leftover.wait()


def test_a_recorded_group_that_is_not_vllm_or_not_ours_is_left_alone(tmp_path: Path) -> None:
    record = EngineGroupRecord(tmp_path / "engine.pgid")
    other = _leftover("sleep", "600")
    try:
        record.write(other.pid)
        assert record.kill_leftover() == 0 and other.poll() is None and not record.path.exists()
        record.path.write_text(f'{{"pgid": {other.pid}, "uid": 12345}}')  # recorded by another user's serve
        assert record.kill_leftover() == 0 and other.poll() is None
        record.path.write_text("garbage")
        assert record.kill_leftover() == 0 and other.poll() is None
        assert record.kill_leftover() == 0  # no record at all
    finally:
        other.kill()
        other.wait()


# --- one serve per state directory -----------------------------------------------------------------


def _lock_holder(state_dir: Path) -> tuple[subprocess.Popen[str], int]:
    """A process that takes serve's lock as serve does, then starts a child that inherits every descriptor
    it may (as an engine that outlives serve would); returns it and its child's PID."""
    code = ("import pathlib, subprocess, time\n"
            "from kimi_service.launcher.process import serve_lock\n"
            f"with serve_lock(pathlib.Path({str(state_dir)!r})):\n"
            "    child = subprocess.Popen(['sleep', '600'], close_fds=False)\n"
            "    print(child.pid, flush=True)\n"
            "    time.sleep(600)\n")
    holder = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True,
                              env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])})
    assert holder.stdout is not None
    return holder, int(holder.stdout.readline())


def _end(holder: subprocess.Popen[str], child: int) -> None:
    holder.kill()
    holder.wait()
    with contextlib.suppress(ProcessLookupError):
        os.kill(child, signal.SIGKILL)


def test_a_second_serve_on_the_state_dir_exits_2_naming_the_first_and_a_killed_one_leaves_no_lock(
        tmp_path: Path) -> None:
    state_dir = tmp_path / "state"
    config = tmp_path / "config.yaml"
    config.write_text(f"model:\n  path: {tmp_path}/no-such-model\nplan:\n  engine: cpu\n"
                      f"paths:\n  state_dir: {state_dir}\n  plan_file: {tmp_path}/run/plan.json\n"
                      "  tmp_dir: /tmp/kimi\n")
    first, first_child = _lock_holder(state_dir)
    try:
        second = _in_child("from kimi_service.cli import main\n"
                           f"raise SystemExit(main(['serve', '--config', {str(config)!r}]))")
        assert second.returncode == 2, second.stderr
        assert second.stderr.strip().splitlines() == [
            f"kimi-service: error: another serve (PID {first.pid}) runs on {state_dir}; stop it first: "
            "a second one would kill its engine"]
        # It touched nothing of the first one's: no failure recorded, no plan written.
        assert not (state_dir / "last-failure").exists() and not (tmp_path / "run" / "plan.json").exists()
        assert first.poll() is None
        first.kill()
        first.wait()
        # The kernel dropped the dead one's lock, and its surviving child never held it: nothing stale.
        assert _alive(first_child)
        after, after_child = _lock_holder(state_dir)
        try:
            assert (state_dir / "serve.lock").read_text() == f"{after.pid}\n"
            assert oct((state_dir / "serve.lock").stat().st_mode & 0o777) == "0o600"
        finally:
            _end(after, after_child)
    finally:
        _end(first, first_child)


def test_the_lock_file_is_never_a_link_someone_planted(tmp_path: Path) -> None:
    from kimi_service.launcher.process import SERVE_LOCK, serve_lock

    target = tmp_path / "precious"
    target.write_text("keep me\n")
    (tmp_path / SERVE_LOCK).symlink_to(target)
    refused = r"serve\.lock: cannot open serve's lock file: it is a symbolic link"
    with pytest.raises(UsageError, match=refused), serve_lock(tmp_path):
        pytest.fail("locked through a symbolic link")
    (tmp_path / SERVE_LOCK).unlink()
    os.link(target, tmp_path / SERVE_LOCK)
    with pytest.raises(UsageError, match=r"serve\.lock: not a plain file of one link"), serve_lock(tmp_path):
        pytest.fail("locked through a hard link")
    assert target.read_text() == "keep me\n"


# --- serve's own watchdog ---------------------------------------------------------------------------


def test_own_watchdog_kills_the_engine_group_and_fails_once_silent_long_enough() -> None:
    config = parse_config({"model": {"path": "/m/tiny"}, "serve": {"watchdog_sec": 5, "probe_interval": 1}})
    supervisor = launcher.Supervisor(config, launcher.Launch(argv=[], env={}, plan_document={}), Notifier(None), {})
    supervisor.engine.child = subprocess.Popen(["sleep", "600"], start_new_session=True)
    try:
        supervisor._own_watchdog(4.0)  # not yet
        assert supervisor.engine.child.poll() is None
        with pytest.raises(EngineFailed, match=r"not answered /health for 5 s \(serve\.watchdog_sec is 5\)") as failed:
            supervisor._own_watchdog(5.2)
        assert failed.value.exit_code == 1
        assert supervisor.engine.child.wait(timeout=5) == -signal.SIGKILL
        assert supervisor.stopping.is_set()  # the exit that follows is serve's doing, not the engine's
    finally:
        if supervisor.engine.child.poll() is None:
            supervisor.engine.child.kill()
            supervisor.engine.child.wait()


def test_under_systemds_watchdog_serve_does_not_run_its_own() -> None:
    config = parse_config({"model": {"path": "/m/tiny"}, "serve": {"watchdog_sec": 5}})
    supervisor = launcher.Supervisor(config, launcher.Launch(argv=[], env={}, plan_document={}), Notifier(None),
                                     {"WATCHDOG_USEC": "4000000"})
    supervisor._own_watchdog(3600)  # nothing to kill, nothing raised


# --- --env-file and --user --------------------------------------------------------------------------


def test_the_env_file_beats_the_environment_as_environmentfile_does(tmp_path: Path) -> None:
    from kimi_service.launcher.identity import load_env_file

    env_file = tmp_path / "secrets.env"
    env_file.write_text('# managed\nVLLM_API_KEY="sk-from-file"\nHF_TOKEN=hf_x\n')
    environ = {"VLLM_API_KEY": "stale", "PATH": "/bin"}
    assert load_env_file(env_file, environ) == ["HF_TOKEN", "VLLM_API_KEY"]
    assert environ == {"VLLM_API_KEY": "sk-from-file", "HF_TOKEN": "hf_x", "PATH": "/bin"}


def _in_child(code: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=30, check=False,
                          env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])}, cwd="/")


@pytest.mark.skipif(os.geteuid() != 0, reason="dropping privileges needs root")
def test_root_becomes_the_user_and_creates_its_missing_runtime_dir(tmp_path: Path) -> None:
    run_dir = tmp_path / "run" / "kimi-service"
    tmp_path.chmod(0o755)
    result = _in_child(
        "import os, pathlib\n"
        "from kimi_service.launcher.identity import become_user\n"
        f"become_user('nobody', [pathlib.Path({str(run_dir)!r})])\n"
        "print(os.getuid(), os.geteuid(), os.getgid(), ','.join(map(str, os.getgroups())), os.environ['HOME'],"
        " os.environ['USER'])\n")
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["65534", "65534", "65534", "65534", "/nonexistent", "nobody"]
    assert run_dir.stat().st_uid == 65534


def test_not_root_only_the_current_user_is_accepted(monkeypatch) -> None:
    from kimi_service.launcher import identity

    monkeypatch.setattr(identity.os, "geteuid", lambda: 65534)
    monkeypatch.setattr(identity.os, "setuid", lambda uid: pytest.fail("setuid called"))
    identity.become_user("nobody")  # who it already is: nothing to do
    with pytest.raises(UsageError, match="--user root: serve runs as uid 65534, not as root, so it cannot become root"):
        identity.become_user("root")


def test_an_unknown_user_is_a_usage_error(tmp_path: Path, capsys) -> None:
    from kimi_service import cli

    config = tmp_path / "config.yaml"
    config.write_text("model:\n  path: /m/tiny\nplan:\n  engine: cpu\n")
    assert cli.main(["serve", "--config", str(config), "--user", "no-such-user-kimi", "--check"]) == 2
    assert "--user no-such-user-kimi: no such user on this host" in capsys.readouterr().err
    with pytest.raises(UsageError):
        from kimi_service.launcher.identity import become_user

        become_user("no-such-user-kimi")
