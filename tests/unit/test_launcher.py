"""The supervisor's decisions (command line, environment, watchdog interval) and sd_notify framing."""

from __future__ import annotations

import contextlib
import logging
import socket
import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from kimi_service import launcher
from kimi_service.config import RESERVED_EXTRA_ENV, parse_config
from kimi_service.errors import KimiError
from kimi_service.sdnotify import Notifier, format_message
from tests.support.fake_pynvml import FakeNvml, NVMLError
from tests.support.local_http import answer

CONFIG = parse_config({"model": {"path": "/m/tiny"}, "paths": {"state_dir": "/srv/kimi"}})


def test_planned_vllm_serve_becomes_the_module_entry_point_with_a_drain_bound() -> None:
    argv = launcher.engine_argv(["vllm", "serve", "/m/tiny", "--port", "8000"], "/opt/venv/bin/python", 30)
    assert argv == ["/opt/venv/bin/python", "-m", "vllm.entrypoints.openai.api_server", "--model", "/m/tiny",
                    "--port", "8000", "--shutdown-timeout", "30", "--enable-server-load-tracking",
                    "--middleware", "kimi_service.route_gate.RouteGate"]


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


def test_extra_env_reaches_the_engine_but_cannot_move_what_serve_owns() -> None:
    config = parse_config({"model": {"path": "/m/tiny"}, "paths": {"state_dir": "/srv/kimi"},
                           "plan": {"extra_env": {"VLLM_CPU_OMP_THREADS_BIND": "1", "OMP_NUM_THREADS": "2"}}})
    env = launcher.engine_env({"VLLM_CPU_OMP_THREADS_BIND": "auto"}, {"VLLM_CPU_KVCACHE_SPACE": "8"}, [], config)
    assert (env["VLLM_CPU_OMP_THREADS_BIND"], env["OMP_NUM_THREADS"]) == ("1", "2")
    assert env["VLLM_CPU_KVCACHE_SPACE"] == "8"


def test_every_variable_serve_sets_is_one_extra_env_refuses() -> None:
    """Else an operator's extra_env would be silently overwritten."""
    env = launcher.engine_env({}, {}, [], CONFIG)
    assert set(env) <= set(RESERVED_EXTRA_ENV), set(env) - set(RESERVED_EXTRA_ENV)


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
    config.write_text(f"model:\n  path: {tmp_path}/no-such-model\nplan:\n  engine: cpu\n"
                      f"paths:\n  state_dir: {tmp_path}/state\n  tmp_dir: /tmp/kimi\n")
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
    # What `kimi-service ctl start` prints when a start fails before vLLM even runs.
    assert (tmp_path / "state" / "last-failure").read_text().startswith("model.path: ")


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


def test_requests_in_flight_counts_running_and_waiting_over_every_engine() -> None:
    busy = VLLM_METRICS.replace('model_name="kimi-tiny"} 0.0', 'model_name="kimi-tiny"} 2.0') + (
        "# TYPE vllm:num_requests_waiting gauge\n"
        'vllm:num_requests_waiting{engine="0",model_name="kimi-tiny"} 1.0\n'
        'vllm:num_requests_waiting{engine="1",model_name="kimi-tiny"} 3.0\n'
    )
    assert launcher.requests_in_flight(busy) == 6
    assert launcher.requests_in_flight(VLLM_METRICS) == 0
    assert launcher.requests_in_flight("# nothing here\n") is None


def test_a_kv_cache_no_count_reaches_is_not_recorded_and_the_log_says_why(caplog) -> None:
    huge = VLLM_METRICS.replace('num_gpu_blocks="1024"', f'num_gpu_blocks="{"9" * 400}"')
    with caplog.at_level(logging.WARNING, logger="kimi_service.launcher"):
        assert launcher.kv_tokens_from_metrics(huge) is None
    assert f"KV cache (num_gpu_blocks x block_size) outside 0 to {2**53} tokens: not recorded" in caplog.text


@pytest.mark.parametrize("value", ["9" * 400, "+Inf", "NaN", "-1.0"])
def test_requests_in_flight_is_unknown_when_vllm_says_a_count_no_queue_holds(value: str, caplog) -> None:
    odd = VLLM_METRICS.replace('model_name="kimi-tiny"} 0.0', f'model_name="kimi-tiny"}} {value}')
    with caplog.at_level(logging.WARNING, logger="kimi_service.launcher"):
        assert launcher.requests_in_flight(odd) is None
    assert "no count of requests: ignored" in caplog.text


def test_readiness_turns_503_for_good_once_draining() -> None:
    readiness = launcher.Readiness()
    assert readiness.document() == (503, {"ready": False, "state": "starting"})
    readiness.set("ready")
    assert readiness.document() == (200, {"ready": True, "state": "ready"})
    readiness.set("engine not answering")
    assert readiness.document()[0] == 503
    readiness.set("draining")
    readiness.set("ready")  # a probe that still passes during the stop must not bring it back
    assert readiness.document() == (503, {"ready": False, "state": "draining"})


@contextlib.contextmanager
def _ready_server(readiness: launcher.Readiness) -> Iterator[int]:
    """serve's /ready on a free local port, for the length of the block."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    server = launcher.status_server("127.0.0.1", port, "/ready", readiness.document, "only /ready is here")
    try:
        yield port
    finally:
        server.shutdown()
        server.server_close()


def test_status_server_answers_its_path_over_http() -> None:
    readiness = launcher.Readiness()
    with _ready_server(readiness) as port:
        assert httpx.get(f"http://127.0.0.1:{port}/ready", timeout=5).status_code == 503
        readiness.set("ready")
        answer = httpx.get(f"http://127.0.0.1:{port}/ready?from=haproxy", timeout=5)
        assert (answer.status_code, answer.json()) == (200, {"ready": True, "state": "ready"})
        other = httpx.get(f"http://127.0.0.1:{port}/v1/models", timeout=5)
        assert other.status_code == 404 and "only /ready is here" in other.text


def test_a_checker_that_resets_the_connection_is_not_logged_as_an_error(capfd) -> None:
    """What HAProxy does after it read a check's status line: close with RST (SO_LINGER 0)."""
    import struct

    with _ready_server(launcher.Readiness()) as port:
        for _ in range(20):
            checker = socket.create_connection(("127.0.0.1", port), timeout=5)
            checker.sendall(b"GET /ready HTTP/1.0\r\n\r\n")
            answer = checker.recv(12)
            checker.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            checker.close()
            assert answer == b"HTTP/1.0 503"
    assert "Traceback" not in capfd.readouterr().err


class _MetricsServer:
    """Stands in for vLLM's /metrics (`text`) and /load (`load`; 404 while None, as without
    --enable-server-load-tracking); neither answers at all while `text` is None."""

    def __init__(self) -> None:
        from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

        outer = self
        self.text: str | None = VLLM_METRICS
        self.load: int | None = None

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                if outer.text is None:
                    time.sleep(1.5)  # longer than the supervisor's probe timeout
                    return
                if self.path == "/load" and outer.load is None:
                    self.send_error(404)
                    return
                answer(self, (f'{{"server_load": {outer.load}}}' if self.path == "/load" else outer.text).encode())

            def log_message(self, format: str, *args: object) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.port = self.server.server_address[1]
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def test_one_slow_health_probe_keeps_ready_and_a_silent_engine_turns_it_503() -> None:
    """A loaded host's engine may miss one /health probe: the balancers must not lose the replica for
    it; an engine that misses UNREADY_AFTER_FAILED_PROBES in a row is taken out through /ready."""
    from kimi_service.launcher.supervisor import UNREADY_AFTER_FAILED_PROBES

    server = _MetricsServer()  # answers /health 200 while `text` is set, nothing while it is None
    config = parse_config({"model": {"path": "/m/tiny"}, "api": {"host": "127.0.0.1", "port": server.port},
                           "serve": {"probe_interval": 1}})  # probes time out after 0.8 s
    supervisor = launcher.Supervisor(config, launcher.Launch(argv=[], env={}, plan_document={}), Notifier(None), {})
    supervisor.engine.child = subprocess.Popen(["sleep", "60"])
    seen: list[str] = []
    watcher = threading.Thread(target=lambda: [seen.append(supervisor.readiness.state) or time.sleep(0.05)
                                               for _ in range(200)], daemon=True)
    try:
        with httpx.Client() as client:
            thread = threading.Thread(target=supervisor._supervise, args=(client,), daemon=True)
            thread.start()
            watcher.start()
            time.sleep(1.2)
            server.text = None  # exactly one probe goes unanswered
            time.sleep(1.0)
            server.text = VLLM_METRICS
            time.sleep(2.0)
            assert "engine not answering" not in seen, seen
            assert seen[-1] == "ready", seen
            server.text = None  # silent from here on
            time.sleep(UNREADY_AFTER_FAILED_PROBES * 1.8 + 1.0)
            assert supervisor.readiness.document()[0] == 503, seen
    finally:
        supervisor.stopping.set()
        server.text = VLLM_METRICS
        supervisor.engine.child.kill()
        supervisor.engine.child.wait()
        server.close()


def _draining_supervisor(port: int, drain_timeout: float) -> launcher.Supervisor:
    config = parse_config({"model": {"path": "/m/tiny"}, "api": {"host": "127.0.0.1", "port": port},
                           "serve": {"probe_interval": 1, "drain_timeout": drain_timeout, "withdraw_delay": 0.3}})
    supervisor = launcher.Supervisor(config, launcher.Launch(argv=[], env={}, plan_document={}), Notifier(None), {})
    supervisor.engine.child = subprocess.Popen(["sleep", "60"])
    supervisor.stopping.set()
    return supervisor


@pytest.mark.parametrize(
    ("metrics", "at_least", "at_most"),
    [
        # Two requests running for a second, then none: the drain ends then, well before its bound.
        ("busy-then-idle", 1.0, 3.0),
        # The engine runs nothing yet, but the API server holds a request (still being tokenized).
        ("held-by-the-api-server", 1.0, 3.0),
        # /metrics does not answer (a busy engine): unknown is not idle, so the drain runs to its bound.
        ("silent", 4.0, 6.5),
        # No request metrics at all: nothing to wait for after the withdraw window (and two idle looks).
        ("no-series", 0.3, 1.5),
    ],
)
def test_the_stop_waits_for_requests_in_flight_within_its_bound(metrics: str, at_least: float,
                                                                at_most: float) -> None:
    server = _MetricsServer()
    busy = VLLM_METRICS.replace('model_name="kimi-tiny"} 0.0', 'model_name="kimi-tiny"} 2.0')
    server.text = {"busy-then-idle": busy, "held-by-the-api-server": VLLM_METRICS, "silent": None,
                   "no-series": "# nothing here\n"}[metrics]
    supervisor = _draining_supervisor(server.port, drain_timeout=4)
    if metrics == "busy-then-idle":
        threading.Timer(1.0, lambda: setattr(server, "text", VLLM_METRICS)).start()
    if metrics == "held-by-the-api-server":
        server.load = 1
        threading.Timer(1.0, lambda: setattr(server, "load", 0)).start()
    try:
        elapsed = _timed_drain(supervisor)
    finally:
        server.close()
    assert at_least <= elapsed <= at_most, elapsed


def _timed_drain(supervisor: launcher.Supervisor) -> float:
    """Seconds the stop's withdraw and drain took; the stand-in engine is gone afterwards."""
    started = time.monotonic()
    try:
        with httpx.Client() as client:
            supervisor._withdraw_and_drain(client)
        return time.monotonic() - started
    finally:
        assert supervisor.engine.child is not None
        supervisor.engine.child.kill()
        supervisor.engine.child.wait()


def test_the_stop_stops_waiting_once_vllm_is_gone() -> None:
    server = _MetricsServer()
    server.text = VLLM_METRICS.replace('model_name="kimi-tiny"} 0.0', 'model_name="kimi-tiny"} 2.0')
    supervisor = _draining_supervisor(server.port, drain_timeout=30)
    assert supervisor.engine.child is not None
    threading.Timer(1.0, supervisor.engine.child.kill).start()
    started = time.monotonic()
    try:
        with httpx.Client() as client:
            supervisor._withdraw_and_drain(client)
    finally:
        supervisor.engine.child.wait()
        server.close()
    assert time.monotonic() - started < 5


def test_the_stop_waits_for_a_request_vllm_has_not_accepted_yet() -> None:
    """vLLM's counters say 0, but a request waits in the API port's accept queue (its event loop starved):
    the drain waits until it is read, and stops only after two idle looks."""
    server = _MetricsServer()
    with socket.socket() as api:
        api.bind(("127.0.0.1", 0))
        api.listen(8)
        supervisor = _draining_supervisor(api.getsockname()[1], drain_timeout=10)
        supervisor.api = launcher.EngineApi(f"http://127.0.0.1:{server.port}", {}, supervisor.pace.probe_timeout)
        client = socket.create_connection(api.getsockname())
        client.sendall(b"POST /v1/chat/completions HTTP/1.1\r\n\r\n")

        def serve_it() -> None:
            accepted, _ = api.accept()
            accepted.recv(4096)
            accepted.close()

        threading.Timer(1.5, serve_it).start()
        try:
            elapsed = _timed_drain(supervisor)
        finally:
            client.close()
            server.close()
    assert 1.5 + 0.5 <= elapsed <= 4, elapsed
