"""`kimi-service exporter`: GPU series under dcgm-exporter's names, plus health and plan series.

Each scrape reads NVML once (one consistent snapshot). XIDs arrive on an NVML event thread and are
counted per GPU and code. Endpoint health is probed on its own interval, so a slow smoke completion
never delays a scrape. vLLM's own /metrics is scraped by Prometheus directly, not proxied here.
"""

from __future__ import annotations

import logging
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import Any
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

from prometheus_client import make_wsgi_app
from prometheus_client.core import CollectorRegistry, CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from kimi_service import health
from kimi_service import nvml as nvml_reader
from kimi_service.errors import UsageError
from kimi_service.http_limits import IDLE_TIMEOUT, server_class
from kimi_service.untrusted import MAX_COUNT, read_json

log = logging.getLogger(__name__)

GPU_LABELS = ("gpu", "UUID", "device", "modelName", "Hostname", "pci_bus_id")
# dcgm-exporter's help texts and units, so a dashboard's tooltips read the same.
DCGM_HELP = {
    "DCGM_FI_DEV_GPU_UTIL": "GPU utilization (in %).",
    "DCGM_FI_DEV_MEM_COPY_UTIL": "Memory utilization (in %).",
    "DCGM_FI_DEV_FB_USED": "Framebuffer memory used (in MiB).",
    "DCGM_FI_DEV_FB_FREE": "Framebuffer memory free (in MiB).",
    "DCGM_FI_DEV_FB_TOTAL": "Framebuffer memory total (in MiB).",
    "DCGM_FI_DEV_GPU_TEMP": "GPU temperature (in C).",
    "DCGM_FI_DEV_POWER_USAGE": "Power draw (in W).",
    "DCGM_FI_DEV_POWER_MGMT_LIMIT": "Power management limit (in W).",
    "DCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION": "Total energy consumption since boot (in mJ).",
    "DCGM_FI_DEV_SM_CLOCK": "SM clock frequency (in MHz).",
    "DCGM_FI_DEV_MEM_CLOCK": "Memory clock frequency (in MHz).",
    "DCGM_FI_DEV_CLOCKS_EVENT_REASONS": "Current clock event (throttle) reasons, a bit mask.",
    "DCGM_FI_DEV_PCIE_REPLAY_COUNTER": "Total number of PCIe retries.",
    "DCGM_FI_DEV_ECC_SBE_VOL_TOTAL": "Total number of single-bit volatile ECC errors.",
    "DCGM_FI_DEV_ECC_DBE_VOL_TOTAL": "Total number of double-bit volatile ECC errors.",
    "DCGM_FI_DEV_ECC_SBE_AGG_TOTAL": "Total number of single-bit persistent ECC errors.",
    "DCGM_FI_DEV_ECC_DBE_AGG_TOTAL": "Total number of double-bit persistent ECC errors.",
    "DCGM_FI_DEV_CORRECTABLE_REMAPPED_ROWS": "Number of remapped rows for correctable errors.",
    "DCGM_FI_DEV_UNCORRECTABLE_REMAPPED_ROWS": "Number of remapped rows for uncorrectable errors.",
    "DCGM_FI_DEV_ROW_REMAP_PENDING": "Whether rows are pending remapping (needs a GPU reset).",
    "DCGM_FI_DEV_ROW_REMAP_FAILURE": "Whether remapping of rows has failed.",
}
# Every series served only while NVML answers, so only on a host with an NVIDIA GPU. Dashboards and alert
# rules are checked against this list where no GPU is (tests/integration/test_replicas.py).
GPU_SERIES = frozenset({*DCGM_HELP, "DCGM_FI_DEV_COUNT", "kimi_gpu_scrape_seconds", "kimi_gpu_xid_errors_total"})
HEALTH_VALUES = {health.OK: 0, health.DEGRADED: 1, health.DOWN: 2}
# `parallelism` is the plan's layout as people read it ("TP 8", "DP 8 x EP 8"): the sizes alone would show a
# DP+EP plan as TP 1, PP 1.
PLAN_LABELS = ("model", "parallelism", "tensor_parallel_size", "pipeline_parallel_size", "data_parallel_size",
               "max_model_len", "kv_cache_tokens", "vllm_version")
# plan.json's text as a label: a model name, a layout, a version are far shorter.
MAX_LABEL_CHARS = 200


class XidWatcher:
    """Counts XID events per (gpu index, code) from NVML's event set, on a daemon thread."""

    def __init__(self, nvml: ModuleType, wait_ms: int = 1000):
        self._nvml = nvml
        self._wait_ms = wait_ms
        self._counts: dict[tuple[str, str], int] = {}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.error: str | None = None

    def start(self) -> None:
        nvml = self._nvml
        try:
            events = nvml.nvmlEventSetCreate()
            self._index_by_uuid = {}
            for index in range(nvml.nvmlDeviceGetCount()):
                handle = nvml.nvmlDeviceGetHandleByIndex(index)
                self._index_by_uuid[nvml_reader._text(nvml.nvmlDeviceGetUUID(handle))] = str(index)
                try:
                    nvml.nvmlDeviceRegisterEvents(handle, nvml.nvmlEventTypeXidCriticalError, events)
                except Exception as exc:
                    if nvml_reader._code(exc) != nvml_reader.ERROR_NOT_SUPPORTED:
                        raise
        except Exception as exc:
            self.error = f"XID events unavailable: {exc}"
            log.warning("%s", self.error)
            return
        self._events = events
        self._thread = threading.Thread(target=self._run, name="xid-events", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        nvml = self._nvml
        wait = getattr(nvml, "nvmlEventSetWait_v2", None) or nvml.nvmlEventSetWait
        while not self._stop.is_set():
            try:
                data = wait(self._events, self._wait_ms)
            except Exception as exc:
                if nvml_reader._code(exc) == nvml_reader.ERROR_TIMEOUT:
                    continue
                self.error = f"XID event wait failed: {exc}"
                log.warning("%s", self.error)
                self._stop.wait(self._wait_ms / 1000)
                continue
            uuid = nvml_reader._text(nvml.nvmlDeviceGetUUID(data.device))
            key = (self._index_by_uuid.get(uuid, uuid), str(int(data.eventData)))
            log.warning("XID %s on GPU %s", key[1], key[0])
            with self._lock:
                self._counts[key] = self._counts.get(key, 0) + 1

    def counts(self) -> dict[tuple[str, str], int]:
        with self._lock:
            return dict(self._counts)

    def stop(self) -> None:
        # No join: the daemon thread notices within one wait (wait_ms) and NVML's wait cannot be cut short.
        self._stop.set()


class HealthPoller:
    """Probes the endpoint every `interval` seconds on a daemon thread; the last result is served."""

    def __init__(self, target: health.Target, interval: float):
        self._target = target
        self._interval = interval
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._checks: list[health.Check] = []
        self._thread = threading.Thread(target=self._run, name="health-probe", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def poll_once(self) -> None:
        checks = health.probe_endpoint(self._target)
        with self._lock:
            self._checks = checks

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self.poll_once()
            except Exception as exc:  # a probe bug must not kill the thread that keeps series fresh
                log.exception("health probe failed: %s", exc)
                # Never the last good result: an endpoint that cannot be judged is not ready.
                with self._lock:
                    self._checks = [health.Check("readiness", health.DOWN, None, f"health probe failed: {exc}")]
            self._stop.wait(self._interval)

    def checks(self) -> list[health.Check]:
        with self._lock:
            return list(self._checks)

    def stop(self) -> None:
        self._stop.set()


def read_plan(path: Path) -> dict[str, Any] | None:
    try:
        data = read_json(path)
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


class KimiCollector(Collector):
    def __init__(self, *, nvml_module: ModuleType | None, plan_file: Path | None, poller: HealthPoller | None,
                 hostname: str | None = None, xids: bool = True):
        """`plan_file` and `poller` None: no engine configured here, GPU series only."""
        self._nvml_module = nvml_module
        self._nvml: ModuleType | None = None
        self._nvml_error: str | None = None
        self._plan_file = plan_file
        self._poller = poller
        self._hostname = hostname or socket.gethostname()
        self._want_xids = xids
        self._xids: XidWatcher | None = None
        self._lock = threading.Lock()
        self._scrape_errors = 0
        self._last_duration = 0.0
        self._plan_refused: dict[str, str] = {}

    def _session(self) -> ModuleType:
        # Retried on every scrape, so the exporter recovers once a reboot fixes a driver mismatch.
        if self._nvml is None:
            self._nvml = nvml_reader.open_nvml(self._nvml_module)
            if self._want_xids:
                self._xids = XidWatcher(self._nvml)
                self._xids.start()
        return self._nvml

    def collect(self) -> Iterator[Metric]:
        with self._lock:
            started = time.monotonic()
            yield from self._collect()
            self._last_duration = time.monotonic() - started
            duration = GaugeMetricFamily("kimi_exporter_scrape_duration_seconds",
                                         "Time the previous scrape took to read NVML, health and plan.")
            duration.add_metric([], self._last_duration)
            yield duration
            errors = CounterMetricFamily("kimi_exporter_scrape_errors",
                                         "Scrapes in which NVML or a GPU field failed (not NotSupported).")
            errors.add_metric([], self._scrape_errors)
            yield errors

    def _collect(self) -> Iterator[Metric]:
        snapshot: nvml_reader.GpuSnapshot | None = None
        checks: list[health.Check] = list(self._poller.checks()) if self._poller else []
        reason = ""
        try:
            snapshot = nvml_reader.sample(self._session())
            self._nvml_error = None
        except nvml_reader.NvmlUnavailable as exc:
            self._drop_session()
            # The label is NvmlUnavailable.kind, a fixed set, so the series stays one per reason; the
            # message (driver text, the fix) goes to the log, once per change.
            reason = exc.kind
            if str(exc) != self._nvml_error:
                log.warning("%s", exc)
            self._nvml_error = str(exc)
            checks.append(health.nvml_failure(exc, expect_gpus=False))
            if exc.kind != "missing":
                self._scrape_errors += 1
        up = GaugeMetricFamily("kimi_nvml_up", "1 when NVML answered this scrape, else 0; reason: missing (no "
                               "driver), mismatch (driver/library version mismatch) or error", labels=["reason"])
        up.add_metric([reason], 1.0 if snapshot else 0.0)
        yield up

        if snapshot is not None:
            yield from self._gpu_metrics(snapshot)
            checks.extend(health.gpu_checks(snapshot))
            if any(g.errors for g in snapshot.gpus):
                self._scrape_errors += 1
        engine = GaugeMetricFamily("kimi_exporter_engine_configured", "1 when this exporter reads the "
                                   "service's config (health and plan series), 0 when it serves GPU series only.")
        engine.add_metric([], 0.0 if self._plan_file is None else 1.0)
        yield engine
        yield from self._health_metrics(checks)
        yield from self._plan_metrics()

    def _drop_session(self) -> None:
        """Forget a failed NVML session (and its event thread); the next scrape starts afresh."""
        self._nvml = None
        if self._xids:
            self._xids.stop()
            self._xids = None

    def _gpu_metrics(self, snapshot: nvml_reader.GpuSnapshot) -> Iterator[Metric]:
        families = {name: GaugeMetricFamily(name, text, labels=GPU_LABELS) for name, text in DCGM_HELP.items()}
        seconds = GaugeMetricFamily("kimi_gpu_scrape_seconds", "Time to read one GPU's NVML fields.",
                                    labels=GPU_LABELS)
        for gpu in snapshot.gpus:
            labels = [str(gpu.index), gpu.uuid, f"nvidia{gpu.minor if gpu.minor is not None else gpu.index}",
                      gpu.name, self._hostname, gpu.pci_bus_id]
            for name, value in gpu.values.items():
                families[name].add_metric(labels, value)
            seconds.add_metric(labels, gpu.seconds)
            for error in gpu.errors:
                log.warning("GPU %s: %s", gpu.index, error)
        count = GaugeMetricFamily("DCGM_FI_DEV_COUNT", "Number of Devices on the node.")
        count.add_metric([], len(snapshot.gpus))
        yield count
        yield from (f for f in families.values() if f.samples)
        yield seconds
        xids = CounterMetricFamily("kimi_gpu_xid_errors", "XID errors seen by NVML events since the exporter "
                                   "started, per GPU and XID code.", labels=["gpu", "xid"])
        for (gpu_index, xid), count_value in sorted((self._xids.counts() if self._xids else {}).items()):
            xids.add_metric([gpu_index, xid], count_value)
        yield xids

    def _health_metrics(self, checks: list[health.Check]) -> Iterator[Metric]:
        status = GaugeMetricFamily("kimi_health_status", "Health check result: 0 ok, 1 degraded, 2 down.",
                                   labels=["check"])
        for check in checks:
            if check.status in HEALTH_VALUES:
                status.add_metric([check.name], HEALTH_VALUES[check.status])
        yield status
        smoke = next((c for c in checks if c.name == "smoke" and c.status == health.OK), None)
        if smoke is not None:
            latency = GaugeMetricFamily("kimi_smoke_latency_seconds",
                                        "Latency of the last smoke chat completion.")
            latency.add_metric([], float(smoke.value))
            yield latency

    def _plan_metrics(self) -> Iterator[Metric]:
        plan = read_plan(self._plan_file) if self._plan_file else None
        if plan is None:
            return
        info = GaugeMetricFamily("kimi_plan_info", "The plan kimi-service serve runs vLLM with (value 1).",
                                 labels=PLAN_LABELS)
        keys = {"model": "served_model_name"}
        refused: dict[str, str] = {}
        labels = []
        for label in PLAN_LABELS:
            key = keys.get(label, label)
            text, why = _plan_label(plan.get(key, ""))
            labels.append(text)
            if why:
                refused[key] = why
        info.add_metric(labels, 1.0)
        tokens = GaugeMetricFamily("kimi_kv_cache_tokens", "KV cache size in tokens: planned, and measured "
                                   "(what vLLM allocated, once it is ready).", labels=["source"])
        for source, key in (("planned", "kv_cache_tokens"), ("measured", "kv_cache_tokens_measured")):
            value = plan.get(key)
            if not _is_int(value):
                continue
            if 0 <= value <= MAX_COUNT:
                tokens.add_metric([source], value)
            else:
                refused[key] = f"a count outside 0 to {MAX_COUNT}"
        self._log_refused(refused)
        yield info
        yield tokens

    def _log_refused(self, refused: dict[str, str]) -> None:
        """One log line per value plan.json holds that no series may carry, while it is there."""
        for key, why in refused.items():
            if self._plan_refused.get(key) != why:
                log.warning("%s: %s is %s; left out of the plan series", self._plan_file, key, why)
        self._plan_refused = refused

    def close(self) -> None:
        if self._xids:
            self._xids.stop()


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _plan_label(value: Any) -> tuple[str, str | None]:
    """A plan.json value as a label value; or a blank one and why the value cannot be one: a number no
    count reaches, or text no scrape can carry. prometheus_client escapes backslashes, quotes and newlines
    itself; a lone surrogate it cannot encode, and one would fail every scrape."""
    if _is_int(value) and not 0 <= value <= MAX_COUNT:
        return "", f"a count outside 0 to {MAX_COUNT}"
    text = str(value)
    if len(text) > MAX_LABEL_CHARS:
        return "", f"longer than {MAX_LABEL_CHARS} characters"
    try:
        text.encode()
    except UnicodeEncodeError:
        return "", "text that is not UTF-8 (a lone surrogate)"
    return text, None


def build_registry(collector: KimiCollector) -> CollectorRegistry:
    registry = CollectorRegistry(auto_describe=False)
    registry.register(collector)
    return registry


class _QuietHandler(WSGIRequestHandler):
    timeout = IDLE_TIMEOUT  # an idle client frees its handler (http_limits)

    def log_message(self, format: str, *args: Any) -> None:
        pass  # scraped every few seconds: not worth a journal line each


def metrics_server(registry: CollectorRegistry, host: str, port: int, *,
                   idle_timeout: float = IDLE_TIMEOUT) -> WSGIServer:
    """/metrics on host:port, bounded as http_limits says; a port in use is bad input (exit 2), not a
    failure systemd should retry every few seconds."""
    try:
        server = make_server(host, port, make_wsgi_app(registry),
                             server_class=server_class(WSGIServer, host, "ExporterServer"),
                             handler_class=type("Handler", (_QuietHandler,), {"timeout": idle_timeout}))
    except OSError as exc:
        raise UsageError(f"exporter: cannot listen on {host}:{port} ({exc.strerror}); another process has the "
                         "port, or the address is not this host's: set exporter.port/host "
                         "(kimi_exporter_port)") from None
    threading.Thread(target=server.serve_forever, name="exporter-http", daemon=True).start()
    return server


def serve_exporter(collector: KimiCollector, poller: HealthPoller | None, host: str, port: int,
                   stop: threading.Event) -> None:
    """Serve /metrics until `stop` is set."""
    server = metrics_server(build_registry(collector), host, port)
    if poller:
        poller.start()
    log.info("exporter listening on %s:%d", host, port)
    try:
        stop.wait()
    finally:
        server.shutdown()
        server.server_close()
        if poller:
            poller.stop()
        collector.close()
