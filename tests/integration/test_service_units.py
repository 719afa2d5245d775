"""The unit templates in a real systemd: they load, their sandboxing scores within bounds, and the
exporter and the health check really run inside that sandbox as the service user.

`systemd-analyze security` grades a loaded unit (0 = locked down, 10 = fully exposed). The vLLM
unit keeps the GPU device nodes and JIT-compiled code allowed, so it scores above the others.
The host has no GPU: the exporter must serve `kimi_nvml_up 0` and the health series, not crash.
"""

from __future__ import annotations

import re
import shlex
import shutil
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.hosts.nspawn import cache_dir, cache_lock
from tests.support.ports import free_port
from tests.support.unit_templates import REPO, UNITS, render, variables

# Measured on Debian 12 (systemd 252): 1.6, 1.4 and 1.5; a change that loosens the sandbox fails here.
MAX_EXPOSURE = {"kimi-vllm.service": 1.8, "kimi-exporter.service": 1.6, "kimi-health.service": 1.7}
# The runtime dependencies of kimi_service for the guest's CPython 3.11, plus pip to install them.
GUEST_WHEELS = ("pip", "prometheus-client>=0.20", "nvidia-ml-py>=12.535", "PyYAML>=6.0", "httpx>=0.27")
WHEELS_RECIPE = "1"


def guest_wheels(tmp: Path) -> Path:
    """Dependency wheels (cached) plus a fresh wheel of this checkout, in one folder."""
    cached = cache_dir() / f"service-unit-wheels-r{WHEELS_RECIPE}"
    with cache_lock(cached.parent / f"{cached.name}.lock"):
        if not (cached / ".complete").exists():
            shutil.rmtree(cached, ignore_errors=True)
            subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--only-binary", ":all:",
                            "--python-version", "3.11", "--implementation", "cp", "--platform",
                            "manylinux2014_x86_64", "--platform", "manylinux_2_17_x86_64", "--dest", str(cached),
                            *GUEST_WHEELS], check=True)
            (cached / ".complete").write_text("")
    out = tmp / "wheels"
    shutil.copytree(cached, out)
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--wheel-dir", str(out), str(REPO)],
                   check=True, capture_output=True)
    return out


@pytest.fixture(scope="module")
def ports() -> dict[str, int]:
    return {"api": free_port(), "exporter": free_port()}


@pytest.fixture(scope="module")
def installed(testhost, tmp_path_factory, ports) -> dict[str, str]:
    wheels = guest_wheels(tmp_path_factory.mktemp("guest"))
    shutil.copytree(wheels, testhost.merged / "var/tmp/kimi-wheels")
    pip = next(p.name for p in wheels.glob("pip-*.whl"))
    testhost.ssh(
        "useradd --system --user-group --home-dir /var/lib/kimi-service --shell /usr/sbin/nologin kimi && "
        "install -d -o kimi -g kimi -m 0750 /var/lib/kimi-service && install -d -m 0755 /etc/kimi-service && "
        "python3 -m venv --without-pip /opt/kimi-service/venv && "
        f"/opt/kimi-service/venv/bin/python /var/tmp/kimi-wheels/{pip}/pip install -q --no-index "
        "--find-links /var/tmp/kimi-wheels kimi-service"
    )
    config = (
        "model:\n  path: /var/lib/kimi-service/models/absent\n  served_name: absent\n"
        f"api:\n  host: 127.0.0.1\n  port: {ports['api']}\n"
        f"exporter:\n  host: 127.0.0.1\n  port: {ports['exporter']}\n  health_interval: 2\n"
        "health:\n  smoke: false\n"
    )
    testhost.ssh(f"cat > /etc/kimi-service/config.yaml <<'EOF'\n{config}EOF")
    testhost.ssh("umask 077 && echo VLLM_API_KEY=sk-unit-test > /etc/kimi-service/secrets.env")
    texts = {name: render(name, variables(Path("/opt/kimi-service"), kimi_exporter_port=ports["exporter"]))
             for name in UNITS}
    for name, text in texts.items():
        testhost.ssh(f"cat > /etc/systemd/system/{name} <<'UNIT'\n{text}UNIT")
    testhost.ssh("systemctl daemon-reload")
    return texts


@pytest.mark.parametrize("name", sorted(MAX_EXPOSURE))
def test_units_load_and_score_within_the_exposure_bound(testhost, installed, name: str) -> None:
    loaded = testhost.ssh(f"systemctl show -p LoadState {shlex.quote(name)}").stdout
    assert "LoadState=loaded" in loaded, loaded
    report = testhost.ssh(f"systemd-analyze security --no-pager {shlex.quote(name)}", check=False).stdout
    match = re.search(r"Overall exposure level for \S+: (\d+\.\d+)", report)
    assert match, report
    assert float(match.group(1)) <= MAX_EXPOSURE[name], report


def test_exporter_runs_sandboxed_as_the_service_user_without_a_gpu(testhost, installed, ports) -> None:
    testhost.ssh("systemctl start kimi-exporter.service")
    url = f"http://127.0.0.1:{ports['exporter']}/metrics"
    deadline = time.monotonic() + 30
    samples: dict[str, list] = {}
    while time.monotonic() < deadline:
        try:
            samples = {f.name: f.samples for f in text_string_to_metric_families(httpx.get(url, timeout=5).text)}
        except httpx.HTTPError:
            samples = {}
        if samples.get("kimi_health_status"):
            break
        time.sleep(0.5)
    assert samples, testhost.ssh("journalctl -u kimi-exporter --no-pager -n 50", check=False).stdout
    assert samples["kimi_nvml_up"][0].value == 0
    assert "NVML" in samples["kimi_nvml_up"][0].labels["reason"]
    assert {s.labels["check"]: s.value for s in samples["kimi_health_status"]} == {"liveness": 2}
    pid = testhost.ssh("systemctl show -p MainPID --value kimi-exporter.service").stdout.strip()
    assert testhost.ssh(f"ps -o user= -p {pid}").stdout.strip() == "kimi"
    # The key came from secrets.env into the environment, not onto the command line.
    assert "sk-unit-test" not in testhost.ssh(f"cat /proc/{pid}/cmdline").stdout
    testhost.ssh("systemctl stop kimi-exporter.service")
    result = testhost.ssh("systemctl show -p Result --value kimi-exporter.service").stdout.strip()
    assert result == "success"


def test_health_check_fails_the_unit_when_the_endpoint_is_down(testhost, installed) -> None:
    testhost.ssh("systemctl start kimi-health.service", check=False)
    shown = testhost.ssh("systemctl show -p ExecMainStatus,Result kimi-health.service").stdout
    assert "ExecMainStatus=2" in shown and "Result=exit-code" in shown, shown
    journal = testhost.ssh("journalctl -u kimi-health.service --no-pager -o cat", check=False).stdout
    assert re.search(r"liveness\s+down", journal), journal
    assert "overall: down" in journal


def test_timer_schedules_the_health_check(testhost, installed) -> None:
    testhost.ssh("systemctl enable --now kimi-health.timer")
    shown = testhost.ssh("systemctl show -p ActiveState,Unit kimi-health.timer").stdout
    assert "ActiveState=active" in shown and "Unit=kimi-health.service" in shown
    assert "kimi-health.timer" in testhost.ssh("systemctl list-timers --all --no-pager").stdout
