"""Exercise kimi_service's NVML code against a real GPU and write the evidence to a directory.

Runs on a GPU host with nvidia-ml-py, prometheus-client and httpx importable and this checkout on
PYTHONPATH (no install needed). Writes: nvml.json (every DCGM field read, or absent = NotSupported,
per GPU, with its read time), health-gpu.json (the GPU health checks), metrics.txt (one full scrape
of the exporter over HTTP), scrapes.json (timings of repeated scrapes), summary.txt.
Usage: validate_nvml.py OUT_DIR [SCRAPES]
"""

from __future__ import annotations

import json
import socket
import statistics
import sys
import threading
import time
from dataclasses import asdict
from pathlib import Path
from types import ModuleType

import httpx
from prometheus_client.parser import text_string_to_metric_families

from kimi_service import exporter, health
from kimi_service import nvml as nvml_reader


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main(out: Path, scrapes: int, nvml_module: ModuleType | None = None) -> int:
    """`nvml_module` is pynvml unless a test passes its stand-in to rehearse the run."""
    out.mkdir(parents=True, exist_ok=True)
    try:
        session = nvml_reader.open_nvml(nvml_module)
    except nvml_reader.NvmlUnavailable as exc:
        (out / "summary.txt").write_text(f"NVML unavailable: {exc}\n")
        print(f"validate_nvml: {exc}", file=sys.stderr)
        return 2
    started = time.monotonic()
    snapshot = nvml_reader.sample(session)
    first_sample = time.monotonic() - started
    fields = sorted(exporter.DCGM_HELP)
    report = {
        "driver_version": snapshot.driver_version,
        "first_sample_seconds": first_sample,
        "gpus": [{**asdict(g), "absent_fields": [f for f in fields if f not in g.values]} for g in snapshot.gpus],
    }
    (out / "nvml.json").write_text(json.dumps(report, indent=2))

    checks = health.check_gpus(nvml_module, expect_gpus=True)
    (out / "health-gpu.json").write_text(json.dumps([asdict(c) for c in checks], indent=2))

    plan = out / "plan.json"
    plan.write_text(json.dumps({"served_model_name": "validation", "tensor_parallel_size": len(snapshot.gpus),
                                "pipeline_parallel_size": 1, "max_model_len": 0, "kv_cache_tokens": 0,
                                "vllm_version": "none"}))
    collector = exporter.KimiCollector(nvml_module=nvml_module, plan_file=plan, poller=None)
    port, stop = free_port(), threading.Event()
    thread = threading.Thread(target=exporter.serve_exporter, args=(collector, None, "127.0.0.1", port, stop),
                              daemon=True)
    thread.start()
    timings, text = [], ""
    with httpx.Client() as client:
        for _ in range(50):
            try:
                client.get(f"http://127.0.0.1:{port}/metrics", timeout=30)
                break
            except httpx.ConnectError:
                time.sleep(0.1)
        for _ in range(scrapes):
            t0 = time.monotonic()
            text = client.get(f"http://127.0.0.1:{port}/metrics", timeout=30).text
            timings.append(time.monotonic() - t0)
    stop.set()
    thread.join(timeout=10)
    (out / "metrics.txt").write_text(text)
    families = {f.name: f.samples for f in text_string_to_metric_families(text)}
    per_gpu = {s.labels["gpu"]: s.value for s in families.get("kimi_gpu_scrape_seconds", [])}
    summary = {
        "gpus": len(snapshot.gpus),
        "models": sorted({g.name for g in snapshot.gpus}),
        "driver": snapshot.driver_version,
        "nvml_up": families["kimi_nvml_up"][0].value,
        "scrape_errors": families["kimi_exporter_scrape_errors"][0].value,
        "http_scrape_seconds": {"n": len(timings), "median": statistics.median(timings),
                                "max": max(timings), "min": min(timings)},
        "last_collect_seconds": families["kimi_exporter_scrape_duration_seconds"][0].value,
        "nvml_read_seconds_per_gpu": per_gpu,
        "dcgm_series": sorted(n for n in families if n.startswith("DCGM_")),
        "absent_fields": {g["index"]: g["absent_fields"] for g in report["gpus"]},
        "field_errors": {g["index"]: g["errors"] for g in report["gpus"]},
        "xid_watcher_error": collector._xids.error if collector._xids else "not started",
        "health": {c.name: c.status for c in checks},
    }
    (out / "scrapes.json").write_text(json.dumps({"seconds": timings}, indent=2))
    (out / "summary.txt").write_text(json.dumps(summary, indent=2) + "\n")
    print(json.dumps(summary, indent=2))
    ok = summary["nvml_up"] == 1 and summary["scrape_errors"] == 0 and "DCGM_FI_DEV_GPU_UTIL" in families
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main(Path(sys.argv[1]), int(sys.argv[2]) if len(sys.argv) > 2 else 20))
