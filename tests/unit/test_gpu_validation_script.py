"""Rehearse scripts/gpu/validate_nvml.py over the NVML stand-in, so device time is not spent on bugs."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

from tests.support.fake_pynvml import FakeNvml, NVMLError

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "gpu" / "validate_nvml.py"


def load_script():
    spec = importlib.util.spec_from_file_location("validate_nvml", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_validation_run_writes_its_evidence(tmp_path: Path) -> None:
    fake = FakeNvml(gpus=1)
    fake.gpus[0]["unsupported"] |= {"replay"}
    assert load_script().main(tmp_path, 3, fake) == 0
    summary = json.loads((tmp_path / "summary.txt").read_text())
    assert summary["gpus"] == 1 and summary["nvml_up"] == 1 and summary["scrape_errors"] == 0
    assert summary["absent_fields"] == {"0": ["DCGM_FI_DEV_PCIE_REPLAY_COUNTER"]}
    assert summary["http_scrape_seconds"]["n"] == 3
    assert "DCGM_FI_DEV_POWER_USAGE" in summary["dcgm_series"]
    assert 'DCGM_FI_DEV_GPU_UTIL{' in (tmp_path / "metrics.txt").read_text()
    assert summary["health"]["nvml"] == "ok"


def test_the_validation_run_fails_clearly_without_nvml(tmp_path: Path, capsys) -> None:
    fake = FakeNvml(init_error=NVMLError(18, "Driver/library version mismatch"))
    assert load_script().main(tmp_path, 1, fake) == 2
    assert "Driver/library version mismatch" in capsys.readouterr().err
