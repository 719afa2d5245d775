"""The supervisor's decisions (command line, environment, watchdog interval) and sd_notify framing."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest

from kimi_service import launcher
from kimi_service.config import parse_config
from kimi_service.errors import KimiError
from kimi_service.sdnotify import Notifier, format_message
from tests.support.fake_pynvml import FakeNvml, NVMLError

CONFIG = parse_config({"model": {"path": "/m/tiny"}, "paths": {"state_dir": "/srv/kimi"}})


def test_planned_vllm_serve_becomes_the_module_entry_point_with_a_drain_bound() -> None:
    argv = launcher.engine_argv(["vllm", "serve", "/m/tiny", "--port", "8000"], "/opt/venv/bin/python", 30)
    assert argv == ["/opt/venv/bin/python", "-m", "vllm.entrypoints.openai.api_server", "--model", "/m/tiny",
                    "--port", "8000", "--shutdown-timeout", "30"]


def test_an_explicit_shutdown_timeout_is_kept() -> None:
    argv = launcher.engine_argv(["vllm", "serve", "/m", "--shutdown-timeout=5"], "py", 30)
    assert argv.count("--shutdown-timeout") == 0 and "--shutdown-timeout=5" in argv


def test_a_plan_that_is_not_vllm_serve_is_refused() -> None:
    with pytest.raises(KimiError, match="not `vllm serve MODEL"):
        launcher.engine_argv(["python", "-m", "x"], "py", 30)


def test_engine_env_keeps_the_key_moves_caches_and_hides_the_notify_socket() -> None:
    base = {"VLLM_API_KEY": "k", "NOTIFY_SOCKET": "/run/systemd/notify", "WATCHDOG_USEC": "1", "PATH": "/bin"}
    env = launcher.engine_env(base, {"VLLM_CPU_KVCACHE_SPACE": "8"}, ["--enforce-eager"], CONFIG)
    assert env["VLLM_API_KEY"] == "k"
    assert env["VLLM_CPU_KVCACHE_SPACE"] == "8"
    assert env["VLLM_CACHE_ROOT"] == "/srv/kimi/cache/vllm"
    assert env["TORCHINDUCTOR_CACHE_DIR"] == "/srv/kimi/cache/torchinductor"
    assert env["TMPDIR"] == "/srv/kimi/tmp"
    assert "NOTIFY_SOCKET" not in env and "WATCHDOG_USEC" not in env


def test_an_explicit_kv_cache_flag_beats_the_planned_cpu_kv_space() -> None:
    env = launcher.engine_env({}, {"VLLM_CPU_KVCACHE_SPACE": "8"}, ["--kv-cache-memory-bytes", "256M"], CONFIG)
    assert "VLLM_CPU_KVCACHE_SPACE" not in env


@pytest.mark.parametrize(
    ("env", "interval"),
    [
        ({}, None),
        ({"WATCHDOG_USEC": "60000000"}, 30.0),
        ({"WATCHDOG_USEC": "4000000", "WATCHDOG_PID": "42"}, 2.0),
        ({"WATCHDOG_USEC": "4000000", "WATCHDOG_PID": "43"}, None),  # armed for another process
    ],
)
def test_watchdog_interval_is_half_of_watchdog_sec(env: dict[str, str], interval: float | None) -> None:
    assert launcher.watchdog_interval(env, 42) == interval


def test_exit_descriptions_name_the_signal() -> None:
    assert launcher.describe_exit(-9) == "killed by signal SIGKILL"
    assert launcher.describe_exit(3) == "exited with status 3"


def test_notifier_sends_one_datagram_per_call(tmp_path: Path) -> None:
    path = tmp_path / "notify"
    receiver = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    receiver.bind(str(path))
    receiver.settimeout(2)
    try:
        Notifier(str(path)).notify(READY=1, STATUS="ready: 5 KV tokens")
        assert receiver.recv(1024) == b"READY=1\nSTATUS=ready: 5 KV tokens"
    finally:
        receiver.close()


def test_notifier_without_socket_is_silent_and_multiline_status_is_refused() -> None:
    Notifier.from_env({}).notify(READY=1)
    with pytest.raises(ValueError, match="one line"):
        format_message({"STATUS": "a\nb"})


def _config(engine: str):
    return parse_config({"model": {"path": "/m/tiny"}, "plan": {"engine": engine}})


def test_a_driver_library_mismatch_stops_serve_instead_of_planning_for_cpu() -> None:
    fake = FakeNvml(init_error=NVMLError(18, "Driver/library version mismatch"))
    with pytest.raises(KimiError, match=r"Driver/library version mismatch.*reboot"):
        launcher.discover(_config("auto"), fake)


def test_no_driver_means_cpu_for_auto_and_an_error_for_cuda() -> None:
    fake = FakeNvml(init_error=NVMLError(12, "NVML Shared Library Not Found"))
    assert launcher.discover(_config("auto"), fake).is_cpu
    with pytest.raises(KimiError, match=r"plan\.engine is cuda but no GPU is usable"):
        launcher.discover(_config("cuda"), fake)


def test_engine_cpu_ignores_the_gpus() -> None:
    assert launcher.discover(_config("cpu"), FakeNvml()).is_cpu


def test_serve_reports_a_planning_failure_to_systemd_and_exits_with_its_code(tmp_path: Path, monkeypatch,
                                                                             capsys) -> None:
    from kimi_service import cli

    notify = tmp_path / "notify"
    receiver = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    receiver.bind(str(notify))
    receiver.settimeout(2)
    config = tmp_path / "config.yaml"
    config.write_text(f"model:\n  path: {tmp_path}/no-such-model\nplan:\n  engine: cpu\n")
    monkeypatch.setenv("NOTIFY_SOCKET", str(notify))
    try:
        code = cli.main(["serve", "--config", str(config)])
        messages = [receiver.recv(4096).decode(), receiver.recv(4096).decode()]
    finally:
        receiver.close()
    assert code == 2
    assert messages[0] == "STATUS=planning"
    assert messages[1].startswith("STATUS=failed: model.path: ") and "no-such-model" in messages[1]
    assert "Traceback" not in capsys.readouterr().err


VLLM_METRICS = """\
# HELP vllm:cache_config_info Information of the LLMEngine CacheConfig
# TYPE vllm:cache_config_info gauge
vllm:cache_config_info{block_size="128",cache_dtype="auto",engine="0",num_gpu_blocks="1024"} 1.0
# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="kimi-tiny"} 0.0
"""


def test_measured_kv_tokens_are_blocks_times_block_size() -> None:
    assert launcher.kv_tokens_from_metrics(VLLM_METRICS) == 131_072
    unknown = VLLM_METRICS.replace('num_gpu_blocks="1024"', 'num_gpu_blocks="None"')
    assert launcher.kv_tokens_from_metrics(unknown) is None
    assert launcher.kv_tokens_from_metrics("# nothing here\n") is None
