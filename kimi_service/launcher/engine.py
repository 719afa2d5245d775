"""The vLLM engine serve runs: its child process, and what its HTTP API says about it."""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import subprocess
import threading
from collections.abc import Mapping
from dataclasses import dataclass

import httpx
from prometheus_client.parser import text_string_to_metric_families

from kimi_service.errors import EngineFailed
from kimi_service.launcher.launch import Launch
from kimi_service.sdnotify import Notifier

# serve's journal lines carry one name, whichever of its modules writes them.
log = logging.getLogger(__package__)


def describe_exit(returncode: int) -> str:
    if returncode < 0:
        return f"killed by signal {signal.Signals(-returncode).name}"
    return f"exited with status {returncode}"


def watchdog_interval(env: Mapping[str, str], pid: int) -> float | None:
    """Half of WatchdogSec, as systemd recommends, or None when no watchdog is armed for us."""
    usec = env.get("WATCHDOG_USEC")
    if not usec or (env.get("WATCHDOG_PID") and env["WATCHDOG_PID"] != str(pid)):
        return None
    return int(usec) / 2_000_000


@dataclass(frozen=True)
class Pace:
    """How often serve looks at the engine, and how long one look may take."""

    interval: float
    watchdog: float | None  # seconds between WATCHDOG=1 pings; None when systemd armed no watchdog

    @classmethod
    def of(cls, probe_interval: float, watchdog: float | None) -> Pace:
        return cls(interval=min(probe_interval, watchdog) if watchdog else probe_interval, watchdog=watchdog)

    @property
    def probe_timeout(self) -> float:
        # A probe must give up before the next ping is due, or a hung engine would still look alive.
        return max(0.5, min(5.0, self.interval * 0.8))


class EngineProcess:
    """The vLLM child: started in a process group of its own, watched, stopped within a bound."""

    def __init__(self, launch: Launch, notifier: Notifier, stopping: threading.Event, stop_budget: float):
        self.launch = launch
        self.notifier = notifier
        self.stopping = stopping  # set once serve is asked to stop: the engine's exit is expected then
        self.stop_budget = stop_budget
        self.child: subprocess.Popen[bytes] | None = None

    def spawn(self) -> None:
        log.info("starting vLLM: %s", " ".join(self.launch.argv))
        # Its own process group, so a stop that runs out of time can kill the engine's workers too.
        self.child = subprocess.Popen(self.launch.argv, env=self.launch.env, start_new_session=True)
        self.notifier.notify(STATUS=f"starting vLLM (pid {self.child.pid})")

    def check(self) -> None:
        """Raise EngineFailed when vLLM exited on its own (not because serve is stopping)."""
        assert self.child is not None
        code = self.child.poll()
        if code is not None and not self.stopping.is_set():
            message = f"vLLM {describe_exit(code)}"
            log.error("%s", message)
            self.notifier.notify(STATUS=message)
            raise EngineFailed(message, exit_code=code if code > 0 else 128 - code)

    def alive(self) -> bool:
        assert self.child is not None
        return self.child.poll() is None

    def stop(self) -> None:
        """SIGTERM (vLLM drains what is left for --shutdown-timeout), then SIGKILL to whatever is left of
        its group."""
        assert self.child is not None
        if self.child.poll() is None:
            self.notifier.notify(STOPPING=1, STATUS="stopping vLLM")
            self.child.send_signal(signal.SIGTERM)
        try:
            code = self.child.wait(timeout=self.stop_budget)
        except subprocess.TimeoutExpired:
            log.error("vLLM still running %.0f s after SIGTERM; killing its process group", self.stop_budget)
            code = None
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.child.pid, signal.SIGKILL)
        if code is None:
            code = self.child.wait()
        log.info("vLLM stopped (%s)", describe_exit(code))


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


def requests_in_flight(metrics_text: str) -> int | None:
    """Requests vLLM is running or has queued, from its /metrics; None when it does not say."""
    found = None
    for family in text_string_to_metric_families(metrics_text):
        if family.name in ("vllm:num_requests_running", "vllm:num_requests_waiting"):
            found = (found or 0) + int(sum(sample.value for sample in family.samples))
    return found


@dataclass(frozen=True)
class EngineApi:
    """vLLM's OpenAI server as serve probes it."""

    url: str
    headers: Mapping[str, str]
    timeout: float

    def healthy(self, client: httpx.Client) -> bool:
        try:
            return client.get(f"{self.url}/health", timeout=self.timeout).status_code == 200
        except httpx.HTTPError:
            return False

    def lists(self, client: httpx.Client, served_name: str) -> bool:
        """Whether /v1/models lists the served name: the model is loaded and answers."""
        try:
            response = client.get(f"{self.url}/v1/models", headers=dict(self.headers), timeout=self.timeout)
        except httpx.HTTPError:
            return False
        if response.status_code != 200:
            return False
        return served_name in [m.get("id") for m in response.json().get("data", [])]

    def measured_kv_tokens(self, client: httpx.Client) -> int | None:
        try:
            return kv_tokens_from_metrics(client.get(f"{self.url}/metrics", timeout=self.timeout).text)
        except (httpx.HTTPError, ValueError):
            return None

    def requests_held(self, client: httpx.Client) -> int | None:
        """Requests the API server holds (GET /load: also those still being parsed or tokenized, which
        the engine's metrics do not count yet), or at least those the engine runs or queues."""
        engine = requests_in_flight(client.get(f"{self.url}/metrics", timeout=self.timeout).text)
        answer = client.get(f"{self.url}/load", timeout=self.timeout)
        load = answer.json().get("server_load") if answer.status_code == 200 else None
        if not isinstance(load, int):
            return engine
        return max(load, engine or 0)
