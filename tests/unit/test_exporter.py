"""The exporter and the GPU health checks over a stand-in `pynvml` (tests/support/fake_pynvml.py).

The stand-in sits at the NVML boundary only: the exporter's real HTTP server is scraped and parsed
with prometheus-client's parser. The same code runs against the real NVML in
scripts/gpu/validate_nvml.sh.
"""

from __future__ import annotations

import json
import logging
import socket
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from kimi_service import exporter, health
from kimi_service import nvml as nvml_reader
from kimi_service.hardware import parse_gpu_spec
from kimi_service.model import inspect_model
from kimi_service.planner import plan
from tests.support.fake_pynvml import FakeNvml, NVMLError
from tests.support.ports import free_port


@pytest.fixture()
def plan_file(tmp_path: Path) -> Path:
    path = tmp_path / "plan.json"
    path.write_text(json.dumps({"served_model_name": "kimi-k2.5", "tensor_parallel_size": 8,
                                "pipeline_parallel_size": 1, "max_model_len": 131072,
                                "kv_cache_tokens": 1_234_567, "vllm_version": "0.21.0"}))
    return path


class Scraper:
    def __init__(self, collector: exporter.KimiCollector):
        self.port = free_port()
        self.stop = threading.Event()
        self.thread = threading.Thread(target=exporter.serve_exporter,
                                       args=(collector, None, "127.0.0.1", self.port, self.stop), daemon=True)
        self.thread.start()

    def scrape(self) -> dict[str, list]:
        text = metrics_text(self.port, seconds=10)
        return {f.name: f.samples for f in text_string_to_metric_families(text)}


def metrics_text(port: int, seconds: float, alive: Callable[[], bool] = lambda: True) -> str:
    """/metrics on 127.0.0.1:port once it answers (within `seconds`, while `alive()`)."""
    deadline = time.monotonic() + seconds
    while True:
        try:
            return httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=5).text
        except httpx.TransportError:
            assert alive(), "the exporter exited"
            assert time.monotonic() < deadline, "the exporter never answered"
            time.sleep(0.05)


@pytest.fixture()
def scrape_with(plan_file: Path) -> Iterator:
    scrapers: list[Scraper] = []

    def start(fake: FakeNvml, xids: bool = True) -> Scraper:
        collector = exporter.KimiCollector(nvml_module=fake, plan_file=plan_file, poller=None,
                                           hostname="gpu-host-1", xids=xids)
        scrapers.append(Scraper(collector))
        return scrapers[-1]

    yield start
    for scraper in scrapers:
        scraper.stop.set()
        scraper.thread.join(timeout=5)


def by_gpu(samples: list) -> dict[str, float]:
    return {s.labels["gpu"]: s.value for s in samples}


def test_gpu_series_use_dcgm_names_labels_and_units(scrape_with) -> None:
    fake = FakeNvml()
    metrics = scrape_with(fake).scrape()
    util = metrics["DCGM_FI_DEV_GPU_UTIL"]
    assert by_gpu(util) == {"0": 40, "1": 41}
    assert util[0].labels == {"gpu": "0", "UUID": "GPU-00000000-aaaa", "device": "nvidia0",
                              "modelName": "NVIDIA H200", "Hostname": "gpu-host-1", "pci_bus_id": "00000000:18:00.0"}
    assert by_gpu(metrics["DCGM_FI_DEV_FB_USED"]) == {"0": 10_000, "1": 10_001}  # MiB
    assert by_gpu(metrics["DCGM_FI_DEV_FB_FREE"])["0"] == 133_771
    assert by_gpu(metrics["DCGM_FI_DEV_POWER_USAGE"])["0"] == 120.5  # W
    assert by_gpu(metrics["DCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION"])["0"] == 123_456_789  # mJ
    assert by_gpu(metrics["DCGM_FI_DEV_SM_CLOCK"])["1"] == 1980
    assert by_gpu(metrics["DCGM_FI_DEV_MEM_CLOCK"])["1"] == 3201
    assert by_gpu(metrics["DCGM_FI_DEV_GPU_TEMP"]) == {"0": 35, "1": 36}
    assert by_gpu(metrics["DCGM_FI_DEV_ECC_SBE_VOL_TOTAL"])["0"] == 2
    assert by_gpu(metrics["DCGM_FI_DEV_ECC_SBE_AGG_TOTAL"])["0"] == 5
    assert by_gpu(metrics["DCGM_FI_DEV_ROW_REMAP_FAILURE"])["0"] == 0
    assert metrics["DCGM_FI_DEV_COUNT"][0].value == 2
    assert metrics["kimi_nvml_up"][0].value == 1
    assert metrics["kimi_exporter_engine_configured"][0].value == 1
    assert metrics["kimi_exporter_scrape_errors"][0].value == 0
    assert len(metrics["kimi_gpu_scrape_seconds"]) == 2


def test_not_supported_fields_are_absent_not_errors(scrape_with) -> None:
    fake = FakeNvml()
    fake.gpus[1]["unsupported"] |= {"ecc", "remap", "replay", "events"}
    metrics = scrape_with(fake).scrape()
    assert set(by_gpu(metrics["DCGM_FI_DEV_ECC_DBE_VOL_TOTAL"])) == {"0"}
    assert set(by_gpu(metrics["DCGM_FI_DEV_ROW_REMAP_FAILURE"])) == {"0"}
    assert set(by_gpu(metrics["DCGM_FI_DEV_GPU_UTIL"])) == {"0", "1"}
    assert metrics["kimi_exporter_scrape_errors"][0].value == 0
    checks = {s.labels["check"] for s in metrics["kimi_health_status"]}
    assert "gpu0_ecc_uncorrectable" in checks and "gpu1_ecc_uncorrectable" not in checks


def test_a_failing_field_is_counted_as_a_scrape_error_and_the_rest_still_served(scrape_with) -> None:
    fake = FakeNvml()
    fake.gpus[0]["temp"] = NVMLError(999, "Unknown Error")
    scraper = scrape_with(fake)
    metrics = scraper.scrape()
    assert set(by_gpu(metrics["DCGM_FI_DEV_GPU_TEMP"])) == {"1"}
    assert by_gpu(metrics["DCGM_FI_DEV_GPU_UTIL"]) == {"0": 40, "1": 41}
    assert metrics["kimi_exporter_scrape_errors"][0].value == 1
    assert scraper.scrape()["kimi_exporter_scrape_errors"][0].value == 2


def test_xid_events_count_per_gpu_and_code(scrape_with) -> None:
    fake = FakeNvml()
    scraper = scrape_with(fake)
    assert scraper.scrape().get("kimi_gpu_xid_errors") == []  # the family exists, no XID yet
    fake.xid(0, 79)
    fake.xid(0, 79)
    fake.xid(1, 48)
    deadline = time.monotonic() + 5
    while True:
        samples = scraper.scrape()["kimi_gpu_xid_errors"]
        counts = {(s.labels["gpu"], s.labels["xid"]): s.value for s in samples if s.name.endswith("_total")}
        if sum(counts.values()) == 3 or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    assert counts == {("0", "79"): 2, ("1", "48"): 1}
    assert "DCGM_FI_DEV_XID_ERRORS" not in scraper.scrape()  # no sticky "last XID" gauge


def test_driver_library_mismatch_keeps_health_and_plan_series(scrape_with, caplog) -> None:
    fake = FakeNvml(init_error=NVMLError(18, "Driver/library version mismatch"))
    scraper = scrape_with(fake)
    with caplog.at_level(logging.WARNING, logger="kimi_service.exporter"):
        metrics = scraper.scrape()
        scraper.scrape()
    up = metrics["kimi_nvml_up"][0]
    assert up.value == 0
    # A code from a fixed set in the label; the driver's words and the fix in the log, once.
    assert up.labels["reason"] == "mismatch"
    logged = [r.getMessage() for r in caplog.records if "Driver/library version mismatch" in r.getMessage()]
    assert len(logged) == 1 and "reboot" in logged[0]
    assert "DCGM_FI_DEV_GPU_UTIL" not in metrics
    assert {s.labels["check"]: s.value for s in metrics["kimi_health_status"]} == {"nvml": 1}  # degraded
    info = metrics["kimi_plan_info"][0].labels
    assert info["tensor_parallel_size"] == "8" and info["kv_cache_tokens"] == "1234567"
    assert info["model"] == "kimi-k2.5" and info["vllm_version"] == "0.21.0"
    assert {s.labels["source"]: s.value for s in metrics["kimi_kv_cache_tokens"]} == {"planned": 1_234_567}
    assert metrics["kimi_exporter_scrape_errors"][0].value == 1
    fake.init_error = None  # the host was rebooted into a matching driver
    assert scraper.scrape()["kimi_nvml_up"][0].value == 1


def test_plan_info_shows_a_data_parallel_plan_as_dp_x_ep(scrape_with, plan_file) -> None:
    """A DP+EP plan runs TP 1, PP 1 per rank: the sizes alone would misstate it, its layout does not."""
    planned = plan(inspect_model("moonshotai/Kimi-K2.5"), parse_gpu_spec("8xH200"))
    plan_file.write_text(json.dumps({**planned.to_json(), "served_model_name": "kimi-k2.5"}))
    info = scrape_with(FakeNvml()).scrape()["kimi_plan_info"][0].labels
    assert info["parallelism"] == planned.parallelism == "DP 8 x EP 8"
    assert (info["data_parallel_size"], info["tensor_parallel_size"]) == ("8", "1")


def _scrape_ok(scraper: Scraper) -> dict[str, list]:
    scraper.scrape()  # it answers
    answer = httpx.get(f"http://127.0.0.1:{scraper.port}/metrics", timeout=5)
    assert answer.status_code == 200, answer.text[-500:]
    return {f.name: f.samples for f in text_string_to_metric_families(answer.text)}


def test_plan_values_no_scrape_can_carry_are_left_out_with_one_log_line_each(scrape_with, plan_file, caplog) -> None:
    """plan.json is the service user's to write: a lone surrogate would fail every scrape's UTF-8 write, a
    400-digit count every float conversion (a 500 for Prometheus each time)."""
    huge = "9" * 400
    plan_file.write_text('{"served_model_name": "a\\udc80b", "max_model_len": ' + huge + ', "kv_cache_tokens": '
                         '1234567, "kv_cache_tokens_measured": ' + huge + ', "vllm_version": "0.21.0"}')
    scraper = scrape_with(FakeNvml())
    with caplog.at_level(logging.WARNING, logger="kimi_service.exporter"):
        metrics = _scrape_ok(scraper)
        _scrape_ok(scraper)
    info = metrics["kimi_plan_info"][0].labels
    assert (info["model"], info["max_model_len"]) == ("", "")
    assert (info["kv_cache_tokens"], info["vllm_version"]) == ("1234567", "0.21.0")
    assert {s.labels["source"]: s.value for s in metrics["kimi_kv_cache_tokens"]} == {"planned": 1_234_567}
    logged = sorted(r.getMessage() for r in caplog.records if str(plan_file) in r.getMessage())
    assert logged == [
        f"{plan_file}: kv_cache_tokens_measured is a count outside 0 to {2**53}; left out of the plan series",
        f"{plan_file}: max_model_len is a count outside 0 to {2**53}; left out of the plan series",
        f"{plan_file}: served_model_name is text that is not UTF-8 (a lone surrogate); left out of the plan series",
    ]  # once each, over two scrapes


def test_quotes_backslashes_and_newlines_in_a_label_round_trip(scrape_with, plan_file) -> None:
    version = 'v"1\\2\nrc" \\n'
    plan_file.write_text(json.dumps({"served_model_name": "kimi", "vllm_version": version}))
    assert _scrape_ok(scrape_with(FakeNvml()))["kimi_plan_info"][0].labels["vllm_version"] == version


def test_nvml_missing_entirely_is_not_a_scrape_error(scrape_with) -> None:
    fake = FakeNvml(init_error=NVMLError(12, "NVML Shared Library Not Found"))
    metrics = scrape_with(fake).scrape()
    assert metrics["kimi_nvml_up"][0].value == 0
    assert metrics["kimi_exporter_scrape_errors"][0].value == 0
    assert metrics["kimi_plan_info"]


def test_gpu_checks_flag_ecc_remap_and_throttling() -> None:
    fake = FakeNvml()
    fake.gpus[0]["ecc"][(1, 0)] = 3
    fake.gpus[1]["remap"] = (0, 1, True, False)
    fake.gpus[1]["reasons"] = 0x40 | 0x4  # hardware thermal slowdown + the normal power cap
    checks = {c.name: c for c in health.gpu_checks(nvml_reader.sample(nvml_reader.open_nvml(fake)))}
    assert checks["gpu0_ecc_uncorrectable"].status == health.DEGRADED
    assert checks["gpu0_ecc_uncorrectable"].value == 3
    assert checks["gpu1_ecc_uncorrectable"].status == health.OK
    assert checks["gpu1_row_remap"].status == health.DEGRADED
    assert "reset the GPU" in checks["gpu1_row_remap"].message
    assert checks["gpu1_throttle"].value == ["hardware thermal slowdown"]
    assert checks["gpu0_throttle"].status == health.OK
    assert checks["nvml"].value == "580.159.04"


def test_health_names_the_driver_library_mismatch() -> None:
    fake = FakeNvml(init_error=NVMLError(18, "Driver/library version mismatch"))
    [check] = health.check_gpus(fake)
    assert check.status == health.DEGRADED
    assert "Driver/library version mismatch" in check.message


def test_health_without_nvml_is_skipped_on_cpu_and_down_when_gpus_are_expected() -> None:
    fake = FakeNvml(init_error=NVMLError(12, "NVML Shared Library Not Found"))
    assert health.check_gpus(fake)[0].status == health.SKIPPED
    assert health.check_gpus(fake, expect_gpus=True)[0].status == health.DOWN


def test_xids_are_parsed_from_kernel_messages() -> None:
    log = [
        "NVRM: Xid (PCI:0000:3b:00): 79, pid=1234, name=python, GPU has fallen off the bus.",
        "NVRM: Xid (PCI:0000:3b:00): 79, pid=1234, name=python, GPU has fallen off the bus.",
        "6,1234,5678,-;NVRM: Xid (PCI:0000:5E:00): 48, pid='<unknown>', An uncorrectable ECC error",
        "nvidia-nvlink: registered",
    ]
    assert health.parse_xids(log) == {("0000:3b:00", 79): 2, ("0000:5e:00", 48): 1}
    assert health.check_xids(log).status == health.DEGRADED
    assert health.check_xids(["kernel: all quiet"]).status == health.OK
    assert health.check_xids(None).status == health.SKIPPED


def test_report_status_is_the_worst_check() -> None:
    ok = health.Check("a", health.OK, 1, "")
    skipped = health.Check("b", health.SKIPPED, None, "")
    degraded = health.Check("c", health.DEGRADED, None, "")
    down = health.Check("d", health.DOWN, None, "")
    assert health.HealthReport((ok, skipped)).exit_code == 0
    assert health.HealthReport((ok, degraded)).exit_code == 1
    assert health.HealthReport((degraded, down, ok)).exit_code == 2
    parsed = health.HealthReport((ok, degraded)).to_json()
    assert parsed["status"] == "degraded" and [c["name"] for c in parsed["checks"]] == ["a", "c"]


def test_health_wait_gives_up_after_the_deadline_on_a_closed_port() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # bound, never listening: connections are refused
        target = health.Target(url=f"http://127.0.0.1:{port}", served_name="x", timeout=1)
        started = time.monotonic()
        report = health.wait_for_health(target, 2.5, gpus=False)
    assert 2.5 <= time.monotonic() - started < 6
    assert report.exit_code == 2
    assert "unreachable" in report.checks[0].message


def test_without_a_config_the_exporter_serves_gpu_series_and_says_the_engine_is_absent(tmp_path: Path) -> None:
    """Like dcgm-exporter: GPU metrics before (or without) the engine's config, not a crash loop."""
    import signal
    import subprocess
    import sys

    port = free_port()
    missing = tmp_path / "config.yaml"
    process = subprocess.Popen([sys.executable, "-m", "kimi_service", "exporter", "--config", str(missing),
                                "--host", "127.0.0.1", "--port", str(port)],
                               stderr=subprocess.PIPE, text=True)
    try:
        text = metrics_text(port, seconds=30, alive=lambda: process.poll() is None)
    finally:
        process.send_signal(signal.SIGTERM)
        _, stderr = process.communicate(timeout=30)
    families = {f.name: f for f in text_string_to_metric_families(text)}
    assert families["kimi_exporter_engine_configured"].samples[0].value == 0
    assert "kimi_nvml_up" in families
    assert "kimi_plan_info" not in families
    assert f"no {missing}: serving the GPU and NVML series only" in stderr
    assert process.returncode == 0
