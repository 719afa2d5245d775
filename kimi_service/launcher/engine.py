"""The vLLM engine serve runs: its child process, and what its HTTP API says about it."""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import subprocess
import sys
import threading
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, BinaryIO

import httpx
from prometheus_client.parser import text_string_to_metric_families

from kimi_service.errors import EngineFailed
from kimi_service.launcher.launch import Launch
from kimi_service.launcher.output import CauseFinder, tee
from kimi_service.launcher.process import EngineGroupRecord, die_with_parent, guard_group
from kimi_service.sdnotify import Notifier
from kimi_service.untrusted import MAX_COUNT, UntrustedInput, loads_json

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
    # serve's own watchdog (serve.watchdog_sec) where systemd armed none: seconds without a /health 200
    # after which serve kills the engine; None when off.
    own_watchdog: float | None = None

    @classmethod
    def of(cls, probe_interval: float, watchdog: float | None, watchdog_sec: float = 0) -> Pace:
        own = float(watchdog_sec) if watchdog_sec and not watchdog else None
        bounds = [probe_interval, *([watchdog] if watchdog else []), *([own / 2] if own else [])]
        return cls(interval=min(bounds), watchdog=watchdog, own_watchdog=own)

    @property
    def probe_timeout(self) -> float:
        # A probe must give up before the next ping is due, or a hung engine would still look alive.
        return max(0.5, min(5.0, self.interval * 0.8))


class EngineProcess:
    """The vLLM child: started in a process group of its own that dies with serve, its output passed
    through (and read for the cause of a failed start), watched, stopped within a bound."""

    def __init__(self, launch: Launch, notifier: Notifier, stopping: threading.Event, stop_budget: float,
                 record: EngineGroupRecord | None = None):
        self.launch = launch
        self.notifier = notifier
        self.stopping = stopping  # set once serve is asked to stop: the engine's exit is expected then
        self.stop_budget = stop_budget
        self.record = record
        self.child: subprocess.Popen[bytes] | None = None
        self.ready = False  # set once it answered; an exit before that is a failed start
        self.cause = CauseFinder()
        self._output: list[threading.Thread] = []
        self._guard: subprocess.Popen[bytes] | None = None

    def spawn(self) -> None:
        log.info("starting vLLM: %s", " ".join(self.launch.argv))
        # Its own process group, so a stop that runs out of time can kill the engine's workers too; and
        # killed by the kernel when serve dies (this must run on serve's main thread: the signal follows
        # the thread that spawned the child).
        self.child = subprocess.Popen(self.launch.argv, env=self.launch.env, start_new_session=True,
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                      preexec_fn=die_with_parent())
        self._guard = guard_group(self.child.pid)  # its workers do not get the death signal: this kills them
        if self.record:
            self.record.write(self.child.pid)
        assert self.child.stdout is not None and self.child.stderr is not None
        self._output = [tee(self.child.stdout, _binary(sys.stdout), self.cause, "stdout"),
                        tee(self.child.stderr, _binary(sys.stderr), self.cause, "stderr")]
        self.notifier.notify(STATUS=f"starting vLLM (pid {self.child.pid})")

    def check(self) -> None:
        """Raise EngineFailed when vLLM exited on its own (not because serve is stopping); before it was
        ready, the message names the cause vLLM printed."""
        assert self.child is not None
        code = self.child.poll()
        if code is None or self.stopping.is_set():
            return
        exit_code = code if code > 0 else 128 - code
        if not self.ready:
            log.error("vLLM %s before it was ready", describe_exit(code))
            self.kill_group()  # its workers may still hold the output pipes open
            self.drain_output()
            message = f"vLLM failed to start: {self.cause.cause() or describe_exit(code)}"
        else:
            message = f"vLLM {describe_exit(code)}"
            log.error("%s", message)
        self.notifier.notify(STATUS=message)
        raise EngineFailed(message, exit_code=exit_code)

    def kill_group(self) -> None:
        assert self.child is not None
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.child.pid, signal.SIGKILL)

    def drain_output(self, timeout: float = 5.0) -> None:
        for thread in self._output:
            thread.join(timeout)

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
        self.kill_group()
        if code is None:
            code = self.child.wait()
        self.drain_output()
        if self._guard is not None:
            assert self._guard.stdin is not None
            self._guard.stdin.close()
            self._guard.wait()
        if self.record:
            self.record.clear()
        log.info("vLLM stopped (%s)", describe_exit(code))


def _binary(stream: object) -> BinaryIO:
    """serve's own stdout or stderr as bytes (a test's captured stream may have no buffer)."""
    buffer = getattr(stream, "buffer", None)
    return buffer if buffer is not None else open(os.devnull, "wb")


def kv_tokens_from_metrics(text: str) -> int | None:
    """The KV cache vLLM really allocated: blocks x block size from its `vllm:cache_config_info`."""
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name.startswith("vllm:cache_config_info"):
                try:
                    tokens = int(sample.labels["num_gpu_blocks"]) * int(sample.labels["block_size"])
                except (KeyError, ValueError):
                    return None
                if not 0 <= tokens <= MAX_COUNT:
                    log.warning("vLLM's /metrics gives a KV cache (num_gpu_blocks x block_size) outside 0 to %d "
                                "tokens: not recorded", MAX_COUNT)
                    return None
                return tokens
    return None


def requests_in_flight(metrics_text: str) -> int | None:
    """Requests vLLM is running or has queued, from its /metrics; None when it does not say (or says a
    count no queue holds)."""
    found = None
    for family in text_string_to_metric_families(metrics_text):
        if family.name in ("vllm:num_requests_running", "vllm:num_requests_waiting"):
            for sample in family.samples:
                if not 0 <= sample.value <= MAX_COUNT:  # also NaN
                    log.warning("vLLM's /metrics gives %s %s, no count of requests: ignored", sample.name,
                                sample.value)
                    return None
                found = (found or 0) + int(sample.value)
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
        return served_name in [m.get("id") for m in _json_field(response, "data", list) if isinstance(m, dict)]

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
        load = _json_field(answer, "server_load", int) if answer.status_code == 200 else None
        if not isinstance(load, int):
            return engine
        return max(load, engine or 0)


def _json_field(response: httpx.Response, key: str, kind: type) -> Any:
    """`key` of a JSON object answer when it is a `kind`, else kind's empty value (None for int)."""
    try:
        body = loads_json(response.content, response.request.url.path)
    except UntrustedInput:
        body = None
    value = body.get(key) if isinstance(body, dict) else None
    return value if isinstance(value, kind) and not isinstance(value, bool) else (None if kind is int else kind())
