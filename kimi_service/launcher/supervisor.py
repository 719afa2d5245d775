"""serve's main loop on the leader (or a lone node): followers up, engine ready, watchdog while healthy,
withdraw and drain on SIGTERM, engine stopped."""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import threading
import time
from collections.abc import Iterator, Mapping
from pathlib import Path
from types import FrameType

import httpx

from kimi_service.config import Config
from kimi_service.credentials import bearer, read_secret
from kimi_service.errors import EngineFailed, KimiError
from kimi_service.files import write_atomic
from kimi_service.http_client import client_for
from kimi_service.launcher.cluster import FollowerWatch
from kimi_service.launcher.engine import EngineApi, EngineProcess, Pace, watchdog_interval
from kimi_service.launcher.follower import run_follower
from kimi_service.launcher.launch import Launch, prepare, write_plan
from kimi_service.launcher.listener import foreign_listener
from kimi_service.launcher.process import EngineGroupRecord, serve_lock
from kimi_service.launcher.sockets import waiting_connections
from kimi_service.launcher.status import Readiness, status_server
from kimi_service.sdnotify import Notifier

# serve's journal lines carry one name, whichever of its modules writes them.
log = logging.getLogger(__package__)

# /ready turns 503 once the engine missed this many /health probes in a row: one slow answer (an engine
# busy on a loaded host) is no reason for the balancers to take the replica out, which their own checks
# would do within seconds (kimi_balancer_check_fall).
UNREADY_AFTER_FAILED_PROBES = 2


class Supervisor:
    def __init__(self, config: Config, launch: Launch, notifier: Notifier, env: Mapping[str, str]):
        self.config = config
        self.launch = launch
        self.notifier = notifier
        self.pace = Pace.of(config.serve.probe_interval, watchdog_interval(env, os.getpid()),
                            config.serve.watchdog_sec)
        self.stopping = threading.Event()
        self.engine = EngineProcess(launch, notifier, self.stopping,
                                    stop_budget=config.serve.drain_timeout + config.serve.stop_timeout,
                                    record=engine_record(config))
        self.api = EngineApi(config.api.local_url, bearer(read_secret(env=env)), self.pace.probe_timeout)
        cluster = config.cluster
        self.cluster = cluster
        self.followers = (FollowerWatch(cluster, config.api.port, self.pace.probe_timeout)
                          if cluster and cluster.is_leader else None)
        self.readiness = Readiness()

    def _on_signal(self, signum: int, _frame: FrameType | None) -> None:
        log.info("received %s: draining", signal.Signals(signum).name)
        self.readiness.set("draining")
        self.stopping.set()

    def run(self) -> int:
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, self._on_signal)
        for directory in (self.config.paths.cache_dir, self.config.paths.tmp_dir):
            directory.mkdir(parents=True, exist_ok=True)
        write_plan(self.config.paths.plan_file, self.launch.plan_document)
        if self.engine.record:
            self.engine.record.kill_leftover()
        if self.cluster and not self.cluster.is_leader:
            return run_follower(self.config, self.engine, self.notifier, self.pace)
        with client_for(self.config.api.local_url) as client, self._readiness_server():
            if self.followers and not self._wait_followers(client):
                return 0
            self.engine.spawn()
            try:
                if self._wait_ready(client):
                    self.engine.ready = True
                    clear_failure(self.config)
                    kv = self._record_measured_kv(client)
                    self.readiness.set("ready")
                    self.notifier.notify(READY=1, STATUS=f"ready: {self.config.model.served_name}, {kv} KV tokens")
                    log.info("vLLM ready on %s", self.api.url)
                    self._supervise(client)
                    self._withdraw_and_drain(client)
            finally:
                self.readiness.set("draining")
                self.engine.stop()
        return 0

    @contextlib.contextmanager
    def _readiness_server(self) -> Iterator[None]:
        port = self.config.serve.ready_port
        if not port:
            yield
            return
        try:
            server = status_server(self.config.api.host, port, "/ready", self.readiness.document,
                                   f"only /ready is here; the API is on port {self.config.api.port}")
        except OSError as exc:
            raise EngineFailed(f"cannot answer /ready on {self.config.api.host}:{port} (serve.ready_port): "
                               f"{exc.strerror}", 1) from None
        try:
            yield
        finally:
            server.shutdown()
            server.server_close()

    def _wait_followers(self, client: httpx.Client) -> bool:
        """The leader's engine starts only once every follower's engine runs: vLLM's rendezvous would
        otherwise wait out its own (long) timeout for a node that is not coming."""
        assert self.followers is not None and self.cluster is not None
        started = time.monotonic()
        while not self.stopping.is_set():
            missing = self.followers.waiting_for(client)
            if not missing:
                log.info("all %d followers are up", len(self.cluster.followers))
                return True
            waited = time.monotonic() - started
            if waited > self.cluster.join_timeout:
                raise EngineFailed(f"followers not up after {waited:.0f} s (cluster.join_timeout): "
                                   + "; ".join(missing) + "; start them first (the service play does)", 1)
            self.notifier.notify(STATUS=f"waiting for followers ({waited:.0f} s): " + "; ".join(missing))
            self.stopping.wait(min(1.0, self.pace.interval))
        return False

    def _record_measured_kv(self, client: httpx.Client) -> int | None:
        """Put the KV cache vLLM allocated next to the planned one in plan.json; the planned one
        stands in when /metrics does not say."""
        planned = self.launch.plan_document.get("kv_cache_tokens")
        measured = self.api.measured_kv_tokens(client)
        if measured is None:
            return planned
        if planned:
            log.info("KV cache: %d tokens allocated by vLLM, %d planned", measured, planned)
        write_plan(self.config.paths.plan_file, {**self.launch.plan_document, "kv_cache_tokens_measured": measured})
        return measured

    def _wait_ready(self, client: httpx.Client) -> bool:
        started = time.monotonic()
        alive = False
        while not self.stopping.is_set():
            self.engine.check()
            if self.followers:
                self.followers.check(client)
            waited = time.monotonic() - started
            if waited > self.config.serve.startup_timeout:
                raise EngineFailed(
                    f"vLLM failed to start: not ready after {waited:.0f} s (serve.startup_timeout); see its log above",
                    1)
            if self.api.healthy(client):
                if not alive:
                    self._refuse_a_stranger_on_the_port()  # before the first request with the key
                    alive = True
                    self.notifier.notify(STATUS="engine up: waiting for the model to be listed")
                if self.api.lists(client, self.config.model.served_name):
                    return True
            else:
                self.notifier.notify(STATUS=f"loading model: waiting for /health ({waited:.0f} s)")
            # No watchdog ping here: systemd arms it only after READY=1; TimeoutStartSec guards loading.
            self.stopping.wait(min(1.0, self.pace.interval))
        return False

    def _refuse_a_stranger_on_the_port(self) -> None:
        """What answers on the API port must be the engine serve started: a program that bound it first
        would get the key with the next probe."""
        assert self.engine.child is not None
        port = self.config.api.port
        stranger = foreign_listener(port, self.engine.child.pid)
        if stranger:
            self.engine.kill_group()
            raise EngineFailed(f"port {port} (api.port) is held by {stranger}, not by the engine serve started; "
                               "no request with the key was sent there. Stop that program or choose another "
                               "api.port", 2)

    def _supervise(self, client: httpx.Client) -> None:
        failures = 0
        answered = time.monotonic()
        while not self.stopping.is_set():
            self.engine.check()
            if self.followers:
                self.followers.check(client)
            if self.api.healthy(client):
                failures = 0
                answered = time.monotonic()
                self.readiness.set("ready")
                if self.pace.watchdog:
                    self.notifier.notify(WATCHDOG=1)
            else:
                failures += 1
                if failures >= UNREADY_AFTER_FAILED_PROBES:
                    self.readiness.set("engine not answering")
                self.notifier.notify(STATUS=f"engine not answering /health ({failures} probes)")
                log.warning("vLLM /health did not answer (%d in a row)%s", failures,
                            "; withholding the watchdog ping" if self.pace.watchdog else "")
                self._own_watchdog(time.monotonic() - answered)
            self.stopping.wait(self.pace.interval)

    def _own_watchdog(self, silent: float) -> None:
        """Where systemd arms no watchdog: an engine silent for serve.watchdog_sec is killed, and serve
        exits 1 so its service manager (supervisord) starts a fresh one."""
        limit = self.pace.own_watchdog
        if limit is None or silent < limit or self.stopping.is_set():
            return
        message = (f"vLLM has not answered /health for {silent:.0f} s (serve.watchdog_sec is {limit:.0f}); "
                   "killing its process group")
        log.error("%s", message)
        self.notifier.notify(STATUS=message)
        self.stopping.set()  # its exit is ours now, not a failure to report as its own
        self.engine.kill_group()
        raise EngineFailed(message, 1)

    def _withdraw_and_drain(self, client: httpx.Client) -> None:
        """After SIGTERM, while vLLM still serves: let the balancers see /ready fail, then wait for the
        requests in flight, so that the engine's stop cuts none of them (vLLM's own shutdown drain then
        has nothing left to do, and covers whatever outlived ours)."""
        if not self.stopping.is_set():
            return
        serve = self.config.serve
        end = time.monotonic() + serve.withdraw_delay
        if serve.withdraw_delay:
            self.notifier.notify(STOPPING=1, STATUS=f"withdrawing: /ready answers 503; serving "
                                 f"{serve.withdraw_delay:.0f} s more while load balancers take this node out")
            log.info("withdrawing from load balancers for %.0f s before draining", serve.withdraw_delay)
        while time.monotonic() < end:
            if not self._keep_alive():
                return
            time.sleep(min(0.5, max(0.0, end - time.monotonic())))
        deadline = time.monotonic() + serve.drain_timeout
        idle_polls = 0
        while True:
            in_flight = self._held(client)
            idle_polls = idle_polls + 1 if in_flight == 0 else 0
            if idle_polls >= 2:  # two looks 0.5 s apart: a request between two reads is seen by the second
                return
            count = "unknown (vLLM did not answer /metrics or /load)" if in_flight < 0 else str(in_flight)
            if time.monotonic() >= deadline:
                log.warning("requests in flight after %.0f s (serve.drain_timeout): %s; vLLM's shutdown drains them "
                            "for its --shutdown-timeout", serve.drain_timeout, count)
                return
            self.notifier.notify(STOPPING=1, STATUS=f"draining: {count} requests in flight")
            if not self._keep_alive():
                return
            time.sleep(0.5)

    def _held(self, client: httpx.Client) -> int:
        """Requests vLLM holds (its /load and /metrics) plus connections to its port it has not read yet
        (the kernel's accept queue, unread bytes); -1 when vLLM does not answer."""
        waiting = waiting_connections(self.config.api.port) or 0
        try:
            held = self.api.requests_held(client)
        except httpx.HTTPError:
            return -1  # a busy engine may answer slowly: unknown is not idle
        except ValueError:
            held = None  # no metrics to go by: the sockets are all there is
        return (held or 0) + waiting

    def _keep_alive(self) -> bool:
        """While a stop drains: False once vLLM is gone (nothing left to wait for), else ping the
        watchdog (the engine is busy finishing work, not hung) and return True."""
        if not self.engine.alive():
            return False
        if self.pace.watchdog:
            self.notifier.notify(WATCHDOG=1)
        return True


def engine_record(config: Config) -> EngineGroupRecord:
    return EngineGroupRecord(config.paths.state_dir / "run" / "engine.pgid")


def failure_file(config: Config) -> Path:
    """One line: why the last start failed (`kimi-service ctl` prints it); gone once a start succeeds."""
    return config.paths.state_dir / "last-failure"


def clear_failure(config: Config) -> None:
    with contextlib.suppress(FileNotFoundError):
        failure_file(config).unlink()


def _record_failure(config: Config, exc: KimiError) -> None:
    line = (str(exc).splitlines() or [type(exc).__name__])[0]
    try:
        path = failure_file(config)
        path.parent.mkdir(parents=True, exist_ok=True)
        write_atomic(path, line + "\n", mode=0o644)
    except OSError as error:
        log.warning("cannot write %s: %s", failure_file(config), error.strerror)


def serve(config: Config, notifier: Notifier | None = None) -> int:
    # Before anything else: a second serve must not touch the first one's plan, failure file or engine.
    with serve_lock(config.paths.state_dir):
        return _serve_locked(config, notifier or Notifier.from_env(os.environ))


def _serve_locked(config: Config, notifier: Notifier) -> int:
    notifier.notify(STATUS="planning")
    supervisor = None
    try:
        launch = prepare(config)
        supervisor = Supervisor(config, launch, notifier, os.environ)
        return supervisor.run()
    except KimiError as exc:
        if supervisor is None:
            notifier.notify(STATUS=f"failed: {str(exc).splitlines()[0]}")
        if supervisor is None or not supervisor.engine.ready:
            _record_failure(config, exc)
        raise
