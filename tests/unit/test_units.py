"""The systemd unit templates render from the kimi_* variables and pass `systemd-analyze verify`."""

from __future__ import annotations

import configparser
import shutil
import subprocess
from pathlib import Path

import pytest

from tests.support.unit_templates import REPO, UNITS, render, variables


def parse(text: str) -> configparser.ConfigParser:
    parser = configparser.ConfigParser(strict=False, interpolation=None, comment_prefixes=("#",))
    parser.optionxform = str  # type: ignore[assignment,method-assign]
    parser.read_string(text)
    return parser


@pytest.fixture()
def install_dir(tmp_path: Path) -> Path:
    """An install dir whose venv/bin/kimi-service is this checkout's real console script."""
    (tmp_path / "opt").mkdir()
    (tmp_path / "opt" / "venv").symlink_to(REPO / ".venv")
    return tmp_path / "opt"


@pytest.mark.parametrize("name", UNITS)
def test_templates_start_with_ansible_managed_and_use_no_unknown_variable(name: str, install_dir: Path) -> None:
    text = render(name, variables(install_dir))
    assert text.startswith("#\n# Managed by Ansible: do not edit\n#\n")
    assert "{{" not in text and "{%" not in text


def test_vllm_unit_is_notify_with_watchdog_and_start_budget_grows_with_model(install_dir: Path) -> None:
    small = parse(render("kimi-vllm.service", variables(install_dir, _vllm_service_model_bytes=7 * 1024**2)))
    service = small["Service"]
    assert service["Type"] == "notify"
    assert service["NotifyAccess"] == "main"
    assert service["WatchdogSec"] == "120"
    assert service["Restart"] == "on-failure"
    assert service["User"] == "kimi"
    assert service["TimeoutStartSec"] == "600"
    # Our drain and vLLM's (30 s each), its stop (30 s) and 15 s to spare; a replica withdraws first.
    assert service["TimeoutStopSec"] == "105"
    replica = parse(render("kimi-vllm.service", variables(install_dir, kimi_vllm_withdraw_sec=6)))
    assert replica["Service"]["TimeoutStopSec"] == "111"
    assert "--api-key" not in service["ExecStart"]
    big = parse(render("kimi-vllm.service", variables(install_dir, _vllm_service_model_bytes=600 * 10**9)))
    # 600 GB = 558 GiB -> 55 steps of 10 GiB at one minute each, on top of 5 minutes.
    assert big["Service"]["TimeoutStartSec"] == str(300 + 55 * 60)


def test_vllm_unit_keeps_gpu_device_nodes_reachable(install_dir: Path) -> None:
    text = render("kimi-vllm.service", variables(install_dir))
    assert "PrivateDevices" not in parse(text)["Service"]
    assert "DeviceAllow=char-nvidia-frontend rw" in text
    assert "DeviceAllow=char-nvidia-uvm rw" in text
    assert "LimitMEMLOCK=infinity" in text


@pytest.mark.skipif(shutil.which("systemd-analyze") is None, reason="systemd-analyze not installed")
def test_rendered_units_pass_systemd_analyze_verify(tmp_path: Path, install_dir: Path) -> None:
    units = tmp_path / "units"
    units.mkdir()
    for name in UNITS:
        (units / name).write_text(render(name, variables(install_dir)))
    result = subprocess.run(["systemd-analyze", "verify", *(str(units / n) for n in UNITS)],
                            capture_output=True, text=True, check=False)
    # Lines about units this host does not have (network-online.target etc.) are not ours.
    ours = [line for line in result.stderr.splitlines() if any(n in line for n in UNITS)]
    assert result.returncode == 0 and not ours, result.stderr


def test_verify_catches_a_broken_unit(tmp_path: Path, install_dir: Path) -> None:
    """The verify step above can fail: a typo in a directive is reported against our unit."""
    broken = render("kimi-exporter.service", variables(install_dir)).replace("Restart=", "Restrat=")
    path = tmp_path / "kimi-exporter.service"
    path.write_text(broken)
    result = subprocess.run(["systemd-analyze", "verify", str(path)], capture_output=True, text=True, check=False)
    assert "Restrat" in result.stderr
